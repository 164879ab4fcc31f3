# Model: one owned llama_model (load, synthetic init, vocabulary, metadata, taps' layer ids).
# Included by _llama.pyx (one extension module); split by area to keep files small.

cdef str _meta_str(const llama_model * m, str key):
    cdef bytes k = key.encode()
    cdef char buf[512]
    cdef int32_t n = llama_model_meta_val_str(m, k, buf, sizeof(buf))
    if n < 0:
        return None
    if n >= <int32_t>sizeof(buf):
        big = bytearray(n + 1)
        llama_model_meta_val_str(m, k, <char *>big, n + 1)
        return bytes(big[:n]).decode("utf-8", "replace")
    return buf[:n].decode("utf-8", "replace")


ctypedef ggml_backend_reg_t (*_rpc_add_server_t)(const char * endpoint) noexcept nogil


_DEVICE_TYPES = {GGML_BACKEND_DEVICE_TYPE_CPU: "cpu", GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
                 GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu", GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel",
                 GGML_BACKEND_DEVICE_TYPE_META: "meta"}


def backend_devices():
    """This build's llama.cpp devices in registry order: ``(name, type)`` pairs, type one of ``cpu``,
    ``gpu``, ``igpu``, ``accel``, ``meta`` (a CPU-only build: ``[("CPU", "cpu")]``)."""
    cdef size_t i
    cdef ggml_backend_dev_t dev
    out = []
    for i in range(ggml_backend_dev_count()):
        dev = ggml_backend_dev_get(i)
        out.append(((<bytes>ggml_backend_dev_name(dev)).decode("utf-8", "replace"),
                    _DEVICE_TYPES.get(ggml_backend_dev_type(dev), "unknown")))
    return out


cdef ggml_backend_dev_t * _offload_devices(tuple endpoints, tuple names) except NULL:
    """The NULL-terminated list (malloc'd) of the devices a model's offloaded layers go to: those of
    llama.cpp's RPC servers at ``endpoints``, then this build's devices named ``names``. Empty: every
    layer stays on the CPU (NULL would let llama.cpp pick every GPU it finds)."""
    devs = []
    cdef ggml_backend_reg_t rpc
    cdef _rpc_add_server_t add
    cdef ggml_backend_reg_t reg
    cdef ggml_backend_dev_t dev
    cdef bytes ep
    cdef const char * cep
    cdef size_t i
    if endpoints:
        rpc = ggml_backend_reg_by_name(b"RPC")
        if rpc == NULL:
            raise ConfigError("rpc_servers", list(endpoints), "a power-native built with llama.cpp's RPC backend",
                              "reinstall it with POWER_NATIVE_RPC=1 (pip install ./native)")
        add = <_rpc_add_server_t>_backend_proc(rpc, "ggml_backend_rpc_add_server")
        for endpoint in endpoints:
            ep = endpoint.encode()
            cep = ep
            with nogil:
                reg = add(cep)
            if reg == NULL:
                raise RuntimeFault(f"rpc server {endpoint} reports no devices")
            for i in range(ggml_backend_reg_dev_count(reg)):
                devs.append(<size_t>ggml_backend_reg_dev_get(reg, i))
    for name in names:
        dev = ggml_backend_dev_by_name(str(name).encode())
        if dev == NULL:
            raise ConfigError("devices", list(names), f"names of this build's devices "
                              f"({', '.join(n for n, _ in backend_devices())})")
        devs.append(<size_t>dev)
    cdef ggml_backend_dev_t * out = <ggml_backend_dev_t *>calloc(len(devs) + 1, sizeof(ggml_backend_dev_t))
    if out == NULL:
        raise MemoryError()
    for i in range(len(devs)):
        out[i] = <ggml_backend_dev_t><size_t>devs[i]
    return out


# -- Model --------------------------------------------------------------------------------------------
cdef class Model:
    """A loaded ``llama_model`` (freed with the object)."""

    def __cinit__(self):
        self.ptr = NULL
        self.vocab = NULL
        self._meta = NULL

    def __dealloc__(self):
        cdef llama_model * ptr = self.ptr
        self.ptr = NULL
        if ptr != NULL:
            # without the GIL: freeing RPC buffers waits on ggml-rpc's dispatcher thread, which may be
            # logging through our callback (it takes the GIL) — holding it here would deadlock
            with nogil:
                llama_model_free(ptr)
        if self._meta != NULL:
            gguf_free(self._meta)
            self._meta = NULL

    def __init__(self, *args, **kwargs):
        raise RuntimeFault("Model cannot be constructed directly; use Model.load(path) or Model.from_metadata(path)")

    cdef llama_model * _p(self) except NULL:
        if self.ptr == NULL:
            raise RuntimeFault("Model: no loaded model (use Model.load or Model.from_metadata)")
        return self.ptr

    cdef const llama_vocab * _v(self) except NULL:
        if self.vocab == NULL:
            raise RuntimeFault("Model: no loaded model (use Model.load or Model.from_metadata)")
        return self.vocab

    cdef _bind(self, llama_model * ptr, str path, bint load_mtp):
        self.ptr = ptr
        self.vocab = llama_model_get_vocab(ptr)
        self.n_vocab = llama_vocab_n_tokens(self.vocab)
        self.path = path
        self.load_mtp = load_mtp
        rope = llama_model_rope_type(ptr)
        self.mrope = rope == 8 or rope == 40  # LLAMA_ROPE_TYPE_MROPE / IMROPE: 4 positions per embedding entry

    @staticmethod
    def load(path, *, bint load_mtp=False, bint vocab_only=False, int n_gpu_layers=0, devices=(), bint repack=True,
             rpc_servers=()):
        """Load a GGUF file. The caller validates the header first (:func:`power_native.target.load_model`);
        a NULL model from llama.cpp is still an :class:`ArtifactError`.

        ``n_gpu_layers`` layers (-1: all) go to the devices of ``rpc_servers`` (``"host:port"``, already
        probed by :mod:`power_native.rpc`; nothing is registered process-wide, so other loads stay local)
        and the devices named ``devices`` (e.g. ``"CUDA0"``); with neither, every layer stays on the CPU."""
        cdef llama_model_params p = llama_model_default_params()
        p.load_mtp = load_mtp
        p.vocab_only = vocab_only
        p.use_extra_bufts = repack
        p.n_gpu_layers = n_gpu_layers
        cdef ggml_backend_dev_t * offload = _offload_devices(tuple(rpc_servers), tuple(devices))
        p.devices = offload
        cdef bytes bpath = os.fsencode(path)
        cdef const char * cpath = bpath
        cdef llama_model * ptr
        _errors.clear()
        try:
            with nogil:
                ptr = llama_model_load_from_file(cpath, p)
        finally:
            free(offload)  # llama.cpp copied the list
        if ptr == NULL:
            rc_raise(RC_OP_MODEL_LOAD, -1, None)
        cdef Model m = Model.__new__(Model)
        m._bind(ptr, os.fsdecode(path), load_mtp)
        return m

    @staticmethod
    def from_metadata(meta_path, *, size_t seed=42, float stdev=0.1, bint load_mtp=False):
        """A synthetic model: every tensor the arch's loader asks for is created from the GGUF
        metadata at ``meta_path`` and filled with seeded N(0, stdev) (llama_model_init_from_user)."""
        cdef gguf_init_params gp
        gp.no_alloc = True
        gp.ctx = NULL
        cdef bytes bpath = os.fsencode(meta_path)
        cdef gguf_context * g = gguf_init_from_file(bpath, gp)
        if g == NULL:
            raise ArtifactError(f"{os.fsdecode(meta_path)}: not a readable GGUF metadata file",
                                reason="gguf_invalid")
        cdef power_fill_params fp
        fp.seed = seed
        fp.stdev = stdev
        cdef llama_model_params p = llama_model_default_params()
        p.load_mtp = load_mtp
        cdef llama_model * ptr
        _errors.clear()
        with nogil:
            ptr = llama_model_init_from_user(g, power_fill_tensor, &fp, p)
        if ptr == NULL:
            gguf_free(g)
            raise ArtifactError(f"{os.fsdecode(meta_path)}: llama_model_init_from_user failed; "
                                + " | ".join(_errors), reason="gguf_load_failed")
        cdef Model m = Model.__new__(Model)
        m._bind(ptr, os.fsdecode(meta_path), load_mtp)
        m._meta = g
        return m

    def save(self, path) -> None:
        """Write the model (tensors included) as a GGUF file."""
        cdef llama_model * ptr = self._p()
        cdef bytes bpath = os.fsencode(path)
        cdef const char * cpath = bpath
        with nogil:
            llama_model_save_to_file(ptr, cpath)

    # -- metadata --------------------------------------------------------------------------------
    def meta(self, str key):
        """A scalar metadata value as a string (``None`` when absent; arrays are not readable)."""
        return _meta_str(self._p(), key)

    def metadata(self) -> dict:
        cdef char buf[512]
        out = {}
        cdef int32_t i, n = llama_model_meta_count(self._p())
        for i in range(n):
            if llama_model_meta_key_by_index(self._p(), i, buf, sizeof(buf)) < 0:
                continue
            key = (<bytes>buf).decode("utf-8", "replace")
            out[key] = _meta_str(self._p(), key)
        return out

    @property
    def arch(self) -> str:
        return _meta_str(self._p(), "general.architecture") or ""

    @property
    def desc(self) -> str:
        cdef char buf[256]
        cdef int32_t n = llama_model_desc(self._p(), buf, sizeof(buf))
        return buf[:max(0, min(n, 255))].decode("utf-8", "replace")

    @property
    def n_layer(self) -> int:
        return llama_model_n_layer(self._p())

    @property
    def n_layer_nextn(self) -> int:
        return llama_model_n_layer_nextn(self._p())

    @property
    def n_embd(self) -> int:
        return llama_model_n_embd(self._p())

    @property
    def n_embd_out(self) -> int:
        return llama_model_n_embd_out(self._p())

    @property
    def n_ctx_train(self) -> int:
        return llama_model_n_ctx_train(self._p())

    @property
    def size(self) -> int:
        return llama_model_size(self._p())

    @property
    def n_params(self) -> int:
        return llama_model_n_params(self._p())

    @property
    def is_recurrent(self) -> bool:
        return llama_model_is_recurrent(self._p())

    @property
    def is_hybrid(self) -> bool:
        return llama_model_is_hybrid(self._p())

    @property
    def has_encoder(self) -> bool:
        return llama_model_has_encoder(self._p())

    def target_layer_ids(self):
        """DFlash/EAGLE3 ``target_layers`` (empty for other archs)."""
        cdef uint32_t n = llama_model_target_layer_ids_n(self._p())
        cdef const int32_t * ids = llama_model_target_layer_ids(self._p())
        if n == 0 or ids == NULL:
            return np.zeros(0, dtype=np.int32)
        return np.asarray(<int32_t[:n]>ids).copy()

    def dflash_selector_top_k(self) -> int:
        return llama_model_dflash_selector_top_k(self._p())

    # -- vocabulary --------------------------------------------------------------------------------
    @property
    def bos(self) -> int:
        return llama_vocab_bos(self._v())

    @property
    def mask(self) -> int:
        """``tokenizer.ggml.mask_token_id`` (-1 when the vocabulary has none)."""
        return llama_vocab_mask(self._v())

    @property
    def eos(self) -> int:
        return llama_vocab_eos(self._v())

    @property
    def add_bos(self) -> bool:
        return llama_vocab_get_add_bos(self._v())

    @property
    def add_eos(self) -> bool:
        return llama_vocab_get_add_eos(self._v())

    @property
    def vocab_type(self) -> int:
        return llama_vocab_type(self._v())

    def is_eog(self, int token) -> bool:
        self._check_token(token)
        return llama_vocab_is_eog(self._v(), token)

    def eog_ids(self) -> frozenset:
        cdef int32_t t
        cdef const llama_vocab * vocab = self._v()
        out = []
        for t in range(self.n_vocab):
            if llama_vocab_is_eog(vocab, t):
                out.append(t)
        return frozenset(out)

    def token_text(self, int token) -> str:
        self._check_token(token)
        return (<bytes>llama_vocab_get_text(self._v(), token)).decode("utf-8", "replace")

    cdef int _check_token(self, int token) except -1:
        self._v()  # a bare Model raises RuntimeFault, not a range error over an empty vocabulary
        if token < 0 or token >= self.n_vocab:
            raise CapacityError(f"token id {token} is outside the vocabulary [0, {self.n_vocab})")
        return 0

    def tokenize(self, text, *, bint add_special=True, bint parse_special=True):
        """Text to int32 ids with llama_tokenize (BOS per the vocabulary, like llama-completion)."""
        self._v()
        cdef bytes b = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        cdef int32_t cap = len(b) + 8
        cdef cnp.ndarray[int32_t, ndim=1] out = np.empty(cap, dtype=np.int32)
        cdef int32_t n = llama_tokenize(self._v(), b, len(b), <llama_token *>out.data, cap, add_special,
                                        parse_special)
        if n < 0:
            if n == -2147483648:
                raise CapacityError("llama_tokenize: the text is too long to tokenize")
            cap = -n
            out = np.empty(cap, dtype=np.int32)
            n = llama_tokenize(self._v(), b, len(b), <llama_token *>out.data, cap, add_special, parse_special)
            if n < 0:
                raise RuntimeFault(f"llama_tokenize failed (rc={n})")
        return out[:n].copy()

    def token_to_piece(self, int token, *, bint special=False) -> bytes:
        self._check_token(token)
        cdef char buf[128]
        cdef int32_t n = llama_token_to_piece(self._v(), token, buf, sizeof(buf), 0, special)
        if n >= 0:
            return buf[:n]
        big = bytearray(-n)
        n = llama_token_to_piece(self._v(), token, <char *>big, len(big), 0, special)
        return bytes(big[:max(n, 0)])

    def detokenize(self, tokens, *, bint special=False) -> bytes:
        """Concatenated pieces (bytes), exactly what llama-completion prints token by token."""
        self._v()
        cdef cnp.ndarray[int32_t, ndim=1] arr = np.ascontiguousarray(tokens, dtype=np.int32)
        cdef char buf[256]
        cdef Py_ssize_t i
        cdef int32_t n, t
        parts = []
        for i in range(arr.shape[0]):
            t = arr[i]
            if t < 0 or t >= self.n_vocab:
                raise CapacityError(f"token id {t} is outside the vocabulary [0, {self.n_vocab})")
            n = llama_token_to_piece(self._v(), t, buf, sizeof(buf), 0, special)
            if n >= 0:
                parts.append(buf[:n])
            else:
                parts.append(self.token_to_piece(t, special=special))
        return b"".join(parts)


# -- Context ------------------------------------------------------------------------------------------
