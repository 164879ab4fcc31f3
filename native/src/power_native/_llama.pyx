# cython: language_level=3, boundscheck=False, cdivision=True
# distutils: language = c++
"""Owning wrappers over the pinned llama.cpp: :class:`Model`, :class:`Context` (with its reusable
batch), llama.cpp logging routed to structlog, and the one place where return codes become
typed exceptions (:func:`_check`).

Every ``GGML_ASSERT`` reachable through these wrappers is pre-checked here (LLAMACPP_NOTES §1.2,
§1.4, §8): batch larger than ``n_batch``, outputs above ``n_outputs_max``, ``n_ubatch <= n_rs_seq+1``
on recurrent memory, token ids outside the vocabulary, context overflow, reading an untapped layer
input and tapping a layer the architecture does not record.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, uint8_t, uint32_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy

cimport numpy as cnp

from power_native.llama cimport *
from power_native.llama_ext cimport *

import atexit
import os
from collections import deque

import numpy as np
import structlog

from power_core.errors import (ArtifactError, Cancelled, CapacityError, ConfigError, RuntimeFault,
                               StateLost)

cnp.import_array()

cdef extern from *:
    """
    #include <cmath>
    #include <cstring>
    #include <functional>
    #include <random>
    #include <string>
    #include <vector>
    #include "ggml-backend.h"

    struct power_fill_params { size_t seed; float stdev; };

    /* Random N(0, stdev) tensor data for synthetic models (as tests/test-llama-archs.cpp does):
       seeded per tensor name, ssm_a forced negative (state decay). */
    static void power_fill_tensor(struct ggml_tensor * t, void * ud) {
        const power_fill_params & p = *(const power_fill_params *) ud;
        size_t seed = p.seed ^ std::hash<std::string>()(t->name);
        std::mt19937 gen(seed);
        std::normal_distribution<float> dis(0.0f, p.stdev);
        const bool neg = strstr(t->name, "ssm_a") != nullptr;
        const int64_t ne = ggml_nelements(t);
        if (t->type == GGML_TYPE_F32) {
            std::vector<float> tmp(ne);
            for (int64_t i = 0; i < ne; i++) { float v = dis(gen); tmp[i] = neg ? -fabsf(v) : v; }
            ggml_backend_tensor_set(t, tmp.data(), 0, ggml_nbytes(t));
        } else if (t->type == GGML_TYPE_F16) {
            std::vector<ggml_fp16_t> tmp(ne);
            for (int64_t i = 0; i < ne; i++) { float v = dis(gen); tmp[i] = ggml_fp32_to_fp16(neg ? -fabsf(v) : v); }
            ggml_backend_tensor_set(t, tmp.data(), 0, ggml_nbytes(t));
        }
    }

    static bool power_abort_cb(void * data) { return *(volatile int *) data != 0; }
    """
    struct power_fill_params:
        size_t seed
        float stdev
    void power_fill_tensor(ggml_tensor * t, void * ud) noexcept nogil
    bint power_abort_cb(void * data) noexcept nogil


__all__ = ["Model", "Context", "set_log_level", "system_info", "last_errors",
           "LAYER_INP_ARCHS", "LAYER_INP_FINAL_ARCHS"]

#: archs whose graph records ``t_layer_inp[il]`` (else the next decode aborts, llama-graph.cpp:1384)
LAYER_INP_ARCHS = frozenset({
    "llama", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "qwen4exp", "gemma3n", "gemma4",
    "lfm2", "openai-moe", "gpt-oss", "minimax-01", "minimax-m2", "bailingmoe3", "mimo2", "nemotron_h",
    "nanbeige", "hunyuan-vl", "muse-glimmer", "deepseek4"})
#: the only archs that also record ``lid == n_layer`` (the output of the last layer)
LAYER_INP_FINAL_ARCHS = frozenset({"deepseek4", "mimo2", "nemotron_h"})

# -- logging ---------------------------------------------------------------------------------------
_log = structlog.get_logger("power_native.llama")
cdef int _log_min_level = GGML_LOG_LEVEL_WARN
cdef int _last_level = GGML_LOG_LEVEL_INFO
cdef bint _log_alive = True
_log_parts = []
_errors = deque(maxlen=8)
_LEVEL_NAMES = {GGML_LOG_LEVEL_DEBUG: "debug", GGML_LOG_LEVEL_INFO: "info",
                GGML_LOG_LEVEL_WARN: "warning", GGML_LOG_LEVEL_ERROR: "error"}


cdef void _log_emit(int level, const char * text) noexcept with gil:
    try:
        _log_parts.append(text.decode("utf-8", "replace"))
        if not _log_parts[-1].endswith("\n"):
            return
        line = "".join(_log_parts).rstrip()
        _log_parts.clear()
        if not line:
            return
        if level >= GGML_LOG_LEVEL_ERROR:
            _errors.append(line)
        if level >= _log_min_level:
            getattr(_log, _LEVEL_NAMES.get(level, "info"))("llama.log", text=line)
    except BaseException:
        pass


cdef void _log_cb(ggml_log_level level, const char * text, void * ud) noexcept nogil:
    global _last_level
    cdef int lvl = <int>level
    if lvl == GGML_LOG_LEVEL_CONT:
        lvl = _last_level
    else:
        _last_level = lvl
    if not _log_alive or (lvl < _log_min_level and lvl < GGML_LOG_LEVEL_ERROR):
        return
    _log_emit(lvl, text)


def set_log_level(level: str) -> None:
    """Forward llama.cpp messages at or above ``level`` (debug, info, warning, error) to structlog."""
    global _log_min_level
    table = {"debug": GGML_LOG_LEVEL_DEBUG, "info": GGML_LOG_LEVEL_INFO, "warning": GGML_LOG_LEVEL_WARN,
             "error": GGML_LOG_LEVEL_ERROR}
    if level not in table:
        raise ConfigError("log_level", level, "one of debug, info, warning, error")
    _log_min_level = table[level]


def last_errors() -> list:
    """The last llama.cpp error lines (they explain a NULL model or context)."""
    return list(_errors)


def system_info() -> str:
    return (<bytes>llama_print_system_info()).decode("utf-8", "replace")


def _shutdown() -> None:
    global _log_alive
    _log_alive = False  # the callback stays installed (silent): NULL would print to stderr


llama_log_set(_log_cb, NULL)
llama_backend_init()
atexit.register(_shutdown)
set_log_level(os.environ.get("POWER_NATIVE_LOG_LEVEL", "warning"))


# -- the one return-code helper ---------------------------------------------------------------------
cdef int _check(str op, long rc) except -1:
    """Translate a llama.cpp return code of ``op`` into a typed exception (0 = success)."""
    if rc == 0:
        return 0
    detail = "; llama.cpp said: " + " | ".join(list(_errors)[-2:]) if _errors else ""
    if op == "decode":
        if rc == 1:
            raise CapacityError(f"llama_decode: no memory slot for the batch (rc=1); raise n_ctx or "
                                f"shorten the request{detail}")
        if rc == 2:
            raise Cancelled("llama_decode was aborted through the cancel callback (rc=2); processed "
                            "micro-batches remain in memory and the runtime restores its checkpoint")
        if rc == -1:
            raise RuntimeFault(f"llama_decode rejected the batch as invalid (rc=-1){detail}")
        raise RuntimeFault(f"llama_decode failed fatally (rc={rc}); the context may hold a partial "
                           f"batch{detail}")
    if op == "state_set":
        raise StateLost(f"llama_state_seq_set_data_ext could not load the saved sequence state{detail}")
    if op == "state_get":
        raise StateLost(f"llama_state_seq_get_data_ext wrote {rc} bytes; expected the full state{detail}")
    if op == "model_load":
        raise ArtifactError(f"llama_model_load_from_file returned NULL{detail}", reason="gguf_load_failed")
    if op == "context":
        raise CapacityError(f"llama_init_from_model returned NULL (out of memory or unsupported "
                            f"parameters){detail}")
    raise RuntimeFault(f"{op} failed (rc={rc}){detail}")


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


# -- Model --------------------------------------------------------------------------------------------
cdef class Model:
    """A loaded ``llama_model`` (freed with the object)."""

    def __cinit__(self):
        self.ptr = NULL
        self.vocab = NULL
        self._meta = NULL

    def __dealloc__(self):
        if self.ptr != NULL:
            llama_model_free(self.ptr)
            self.ptr = NULL
        if self._meta != NULL:
            gguf_free(self._meta)
            self._meta = NULL

    cdef _bind(self, llama_model * ptr, str path, bint load_mtp):
        self.ptr = ptr
        self.vocab = llama_model_get_vocab(ptr)
        self.n_vocab = llama_vocab_n_tokens(self.vocab)
        self.path = path
        self.load_mtp = load_mtp

    @staticmethod
    def load(path, *, bint load_mtp=False, bint vocab_only=False, n_gpu_layers=None, bint repack=True):
        """Load a GGUF file. The caller validates the header first (``power_native.gguf_check``);
        a NULL model from llama.cpp is still an :class:`ArtifactError`."""
        cdef llama_model_params p = llama_model_default_params()
        p.load_mtp = load_mtp
        p.vocab_only = vocab_only
        p.use_extra_bufts = repack
        if n_gpu_layers is not None:
            p.n_gpu_layers = n_gpu_layers
        cdef bytes bpath = os.fsencode(path)
        cdef const char * cpath = bpath
        cdef llama_model * ptr
        _errors.clear()
        with nogil:
            ptr = llama_model_load_from_file(cpath, p)
        if ptr == NULL:
            _check("model_load", -1)
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
        cdef bytes bpath = os.fsencode(path)
        cdef const char * cpath = bpath
        with nogil:
            llama_model_save_to_file(self.ptr, cpath)

    # -- metadata --------------------------------------------------------------------------------
    def meta(self, str key):
        """A scalar metadata value as a string (``None`` when absent; arrays are not readable)."""
        return _meta_str(self.ptr, key)

    def metadata(self) -> dict:
        cdef char buf[512]
        out = {}
        cdef int32_t i, n = llama_model_meta_count(self.ptr)
        for i in range(n):
            if llama_model_meta_key_by_index(self.ptr, i, buf, sizeof(buf)) < 0:
                continue
            key = (<bytes>buf).decode("utf-8", "replace")
            out[key] = _meta_str(self.ptr, key)
        return out

    @property
    def arch(self) -> str:
        return _meta_str(self.ptr, "general.architecture") or ""

    @property
    def desc(self) -> str:
        cdef char buf[256]
        cdef int32_t n = llama_model_desc(self.ptr, buf, sizeof(buf))
        return buf[:max(0, min(n, 255))].decode("utf-8", "replace")

    @property
    def n_layer(self) -> int:
        return llama_model_n_layer(self.ptr)

    @property
    def n_layer_nextn(self) -> int:
        return llama_model_n_layer_nextn(self.ptr)

    @property
    def n_embd(self) -> int:
        return llama_model_n_embd(self.ptr)

    @property
    def n_embd_out(self) -> int:
        return llama_model_n_embd_out(self.ptr)

    @property
    def n_ctx_train(self) -> int:
        return llama_model_n_ctx_train(self.ptr)

    @property
    def size(self) -> int:
        return llama_model_size(self.ptr)

    @property
    def n_params(self) -> int:
        return llama_model_n_params(self.ptr)

    @property
    def is_recurrent(self) -> bool:
        return llama_model_is_recurrent(self.ptr)

    @property
    def is_hybrid(self) -> bool:
        return llama_model_is_hybrid(self.ptr)

    @property
    def has_encoder(self) -> bool:
        return llama_model_has_encoder(self.ptr)

    def target_layer_ids(self):
        """DFlash/EAGLE3 ``target_layers`` (empty for other archs)."""
        cdef uint32_t n = llama_model_target_layer_ids_n(self.ptr)
        cdef const int32_t * ids = llama_model_target_layer_ids(self.ptr)
        if n == 0 or ids == NULL:
            return np.zeros(0, dtype=np.int32)
        return np.asarray(<int32_t[:n]>ids).copy()

    def dflash_selector_top_k(self) -> int:
        return llama_model_dflash_selector_top_k(self.ptr)

    # -- vocabulary --------------------------------------------------------------------------------
    @property
    def bos(self) -> int:
        return llama_vocab_bos(self.vocab)

    @property
    def eos(self) -> int:
        return llama_vocab_eos(self.vocab)

    @property
    def add_bos(self) -> bool:
        return llama_vocab_get_add_bos(self.vocab)

    @property
    def add_eos(self) -> bool:
        return llama_vocab_get_add_eos(self.vocab)

    @property
    def vocab_type(self) -> int:
        return llama_vocab_type(self.vocab)

    def is_eog(self, int token) -> bool:
        self._check_token(token)
        return llama_vocab_is_eog(self.vocab, token)

    def eog_ids(self) -> frozenset:
        cdef int32_t t
        out = []
        for t in range(self.n_vocab):
            if llama_vocab_is_eog(self.vocab, t):
                out.append(t)
        return frozenset(out)

    def token_text(self, int token) -> str:
        self._check_token(token)
        return (<bytes>llama_vocab_get_text(self.vocab, token)).decode("utf-8", "replace")

    cdef int _check_token(self, int token) except -1:
        if token < 0 or token >= self.n_vocab:
            raise CapacityError(f"token id {token} is outside the vocabulary [0, {self.n_vocab})")
        return 0

    def tokenize(self, text, *, bint add_special=True, bint parse_special=True):
        """Text to int32 ids with llama_tokenize (BOS per the vocabulary, like llama-completion)."""
        cdef bytes b = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        cdef int32_t cap = len(b) + 8
        cdef cnp.ndarray[int32_t, ndim=1] out = np.empty(cap, dtype=np.int32)
        cdef int32_t n = llama_tokenize(self.vocab, b, len(b), <llama_token *>out.data, cap, add_special,
                                        parse_special)
        if n < 0:
            if n == -2147483648:
                raise CapacityError("llama_tokenize: the text is too long to tokenize")
            cap = -n
            out = np.empty(cap, dtype=np.int32)
            n = llama_tokenize(self.vocab, b, len(b), <llama_token *>out.data, cap, add_special, parse_special)
            if n < 0:
                raise RuntimeFault(f"llama_tokenize failed (rc={n})")
        return out[:n].copy()

    def token_to_piece(self, int token, *, bint special=False) -> bytes:
        self._check_token(token)
        cdef char buf[128]
        cdef int32_t n = llama_token_to_piece(self.vocab, token, buf, sizeof(buf), 0, special)
        if n >= 0:
            return buf[:n]
        big = bytearray(-n)
        n = llama_token_to_piece(self.vocab, token, <char *>big, len(big), 0, special)
        return bytes(big[:max(n, 0)])

    def detokenize(self, tokens, *, bint special=False) -> bytes:
        """Concatenated pieces (bytes), exactly what llama-completion prints token by token."""
        cdef cnp.ndarray[int32_t, ndim=1] arr = np.ascontiguousarray(tokens, dtype=np.int32)
        cdef char buf[256]
        cdef Py_ssize_t i
        cdef int32_t n, t
        parts = []
        for i in range(arr.shape[0]):
            t = arr[i]
            if t < 0 or t >= self.n_vocab:
                raise CapacityError(f"token id {t} is outside the vocabulary [0, {self.n_vocab})")
            n = llama_token_to_piece(self.vocab, t, buf, sizeof(buf), 0, special)
            if n >= 0:
                parts.append(buf[:n])
            else:
                parts.append(self.token_to_piece(t, special=special))
        return b"".join(parts)


# -- Context ------------------------------------------------------------------------------------------
cdef class Context:
    """A ``llama_context`` with one reusable batch of ``n_batch`` tokens (sequence ids 0..n_seq_max-1)."""

    def __cinit__(self):
        self.ptr = NULL
        self.has_batch = False
        self.abort_flag = <int *>calloc(1, sizeof(int))
        if self.abort_flag == NULL:
            raise MemoryError()
        self._layer_taps = set()

    def __dealloc__(self):
        if self.has_batch:
            llama_batch_free(self.batch)
            self.has_batch = False
        if self.ptr != NULL:
            llama_free(self.ptr)
            self.ptr = NULL
        if self.abort_flag != NULL:
            free(self.abort_flag)
            self.abort_flag = NULL

    def __init__(self, Model model, *, int n_ctx, int n_batch, int n_ubatch=0, int n_rs_seq=0,
                 n_threads=None, int n_outputs_max=0, int ctx_type=0, Context ctx_other=None,
                 bint embeddings=False, bint swa_full=True, int n_seq_max=1, flash_attn=None):
        if model is None or model.ptr == NULL:
            raise RuntimeFault("Context: the model is closed")
        if n_ubatch <= 0:
            n_ubatch = n_batch
        if n_ctx < 1 or n_batch < 1 or n_ubatch > n_batch or n_rs_seq < 0 or n_seq_max < 1:
            raise ConfigError("context", dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                                              n_rs_seq=n_rs_seq, n_seq_max=n_seq_max),
                              "n_ctx >= 1, 1 <= n_ubatch <= n_batch, n_rs_seq >= 0, n_seq_max >= 1")
        recurrent = llama_model_is_recurrent(model.ptr) or llama_model_is_hybrid(model.ptr)
        # src/llama-batch.cpp:641 asserts n_ubatch > n_rs_seq + 1 on recurrent memory
        if recurrent and n_rs_seq > 0 and n_ubatch <= n_rs_seq + 1:
            raise ConfigError("n_ubatch", n_ubatch, f"an integer > n_rs_seq + 1 = {n_rs_seq + 1}",
                              "llama.cpp asserts this for recurrent snapshots; raise n_ubatch or lower S")
        if ctx_type == LLAMA_CONTEXT_TYPE_MTP and llama_model_n_layer_nextn(model.ptr) == 0:
            raise ArtifactError(f"{model.path}: an MTP context needs nextn layers; the model has none "
                                "(or was loaded without load_mtp)", reason="mtp_missing")
        if n_outputs_max < 0 or n_outputs_max > n_batch:
            raise ConfigError("n_outputs_max", n_outputs_max, f"an integer in [0, n_batch={n_batch}]")
        cdef llama_context_params p = llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_ubatch
        p.n_seq_max = n_seq_max
        p.n_rs_seq = n_rs_seq
        p.n_outputs_max = n_outputs_max
        threads = n_threads or os.cpu_count() or 1
        p.n_threads = threads
        p.n_threads_batch = threads
        p.ctx_type = <llama_context_type>ctx_type
        p.embeddings = embeddings
        p.swa_full = swa_full
        if flash_attn is not None:
            p.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.no_perf = True
        p.abort_callback = power_abort_cb
        p.abort_callback_data = <void *>self.abort_flag
        p.ctx_other = ctx_other.ptr if ctx_other is not None else NULL
        cdef llama_context * ctx
        _errors.clear()
        with nogil:
            ctx = llama_init_from_model(model.ptr, p)
        if ctx == NULL:
            _check("context", -1)
        self.ptr = ctx
        self.model = model
        self.ctx_other = ctx_other
        self.mem = llama_get_memory(ctx)
        self.n_ctx = llama_n_ctx(ctx)
        self.n_batch = llama_n_batch(ctx)
        self.n_ubatch = llama_n_ubatch(ctx)
        self.n_rs_seq = llama_n_rs_seq(ctx)
        self.n_outputs_max = n_outputs_max if n_outputs_max > 0 else self.n_batch
        self.n_vocab = model.n_vocab
        self.ctx_type = ctx_type
        self.recurrent = recurrent
        self.n_outputs = 0
        self._last_n_tokens = 0
        if recurrent and self.n_rs_seq > 0 and self.n_ubatch <= self.n_rs_seq + 1:
            raise ConfigError("n_ubatch", self.n_ubatch, f"an integer > n_rs_seq + 1 = {self.n_rs_seq + 1}")
        self.batch = llama_batch_init(self.n_batch, 0, n_seq_max)
        self.has_batch = True

    def close(self) -> None:
        """Free the context now (idempotent)."""
        if self.has_batch:
            llama_batch_free(self.batch)
            self.has_batch = False
        if self.ptr != NULL:
            llama_free(self.ptr)
            self.ptr = NULL

    cdef int _alive(self) except -1:
        if self.ptr == NULL:
            raise RuntimeFault("the llama context is closed")
        return 0

    # -- decoding ------------------------------------------------------------------------------------
    def decode(self, tokens, int pos0, *, int seq_id=0, bint all_outputs=True) -> int:
        """Decode ``tokens`` at positions ``pos0..`` of ``seq_id`` with the GIL released.

        ``all_outputs`` asks for one logits row per token (else only the last). Returns the number
        of output rows; read them with :meth:`logits`."""
        self._alive()
        cdef cnp.ndarray[int32_t, ndim=1] arr = np.ascontiguousarray(tokens, dtype=np.int32)
        cdef int32_t n = <int32_t>arr.shape[0]
        if n == 0:
            raise CapacityError("decode: empty batch")
        if n > self.n_batch:
            raise CapacityError(f"decode: {n} tokens exceed n_batch={self.n_batch}; split the batch")
        cdef int32_t n_out = n if all_outputs else 1
        if n_out > self.n_outputs_max:
            raise CapacityError(f"decode: {n_out} output rows exceed n_outputs_max={self.n_outputs_max}")
        if pos0 < 0 or pos0 + n > self.n_ctx:
            raise CapacityError(f"decode: positions [{pos0}, {pos0 + n}) overflow the context of "
                                f"{self.n_ctx} tokens; raise n_ctx or shorten the request")
        if seq_id < 0 or seq_id >= <int>llama_n_seq_max(self.ptr):
            raise ConfigError("seq_id", seq_id, f"an integer in [0, {llama_n_seq_max(self.ptr)})")
        cdef int32_t * src = <int32_t *>arr.data
        cdef int32_t i, bad = -1, nv = self.n_vocab
        cdef llama_batch * b = &self.batch
        cdef llama_context * ctx = self.ptr
        cdef int32_t rc
        with nogil:
            for i in range(n):
                if src[i] < 0 or src[i] >= nv:
                    bad = i
                    break
            if bad < 0:
                memcpy(b.token, src, n * sizeof(int32_t))
                for i in range(n):
                    b.pos[i] = pos0 + i
                    b.n_seq_id[i] = 1
                    b.seq_id[i][0] = seq_id
                    b.logits[i] = 1 if (all_outputs or i == n - 1) else 0
                b.n_tokens = n
        if bad >= 0:
            raise CapacityError(f"decode: token id {arr[bad]} at index {bad} is outside the vocabulary "
                                f"[0, {nv})")
        _errors.clear()
        if self.abort_flag[0]:
            rc = 2  # cancelled before it started: nothing reaches the memory
        else:
            with nogil:
                rc = llama_decode(ctx, b[0])
        self.n_outputs = 0
        if rc == 2:
            self.abort_flag[0] = 0  # consumed: the next decode runs
        _check("decode", rc)
        self.n_outputs = n_out
        self._last_n_tokens = n
        return n_out

    def logits(self):
        """The output rows of the last decode as a read-only zero-copy ``(n_outputs, n_vocab)``
        float32 view, valid until the next decode on this context."""
        self._alive()
        cdef int n = self.n_outputs
        if n == 0:
            raise RuntimeFault("logits: no decode with outputs since the last change")
        cdef float * first = llama_get_logits_ith(self.ptr, -n)
        cdef float * last = llama_get_logits_ith(self.ptr, -1)
        if first == NULL or last == NULL:
            raise RuntimeFault("logits: llama_get_logits_ith returned NULL")
        if last == first + <size_t>(n - 1) * self.n_vocab:
            return self._view(first, n, self.n_vocab)
        out = np.empty((n, self.n_vocab), dtype=np.float32)  # outputs not contiguous: copy rows
        cdef int j
        for j in range(n):
            out[j] = self._view(llama_get_logits_ith(self.ptr, j - n), 1, self.n_vocab)[0]
        return out

    cdef object _view(self, float * ptr, int rows, int cols):
        cdef cnp.npy_intp dims[2]
        dims[0] = rows
        dims[1] = cols
        cdef cnp.ndarray arr = cnp.PyArray_SimpleNewFromData(2, dims, cnp.NPY_FLOAT32, <void *>ptr)
        cnp.set_array_base(arr, self)
        cnp.PyArray_CLEARFLAGS(arr, cnp.NPY_ARRAY_WRITEABLE)
        return arr

    def abort(self) -> None:
        """Ask the running (or else the next) decode to stop; it raises :class:`Cancelled`."""
        if self.abort_flag != NULL:
            self.abort_flag[0] = 1

    def clear_abort(self) -> None:
        """Withdraw an :meth:`abort` that no decode has consumed yet."""
        if self.abort_flag != NULL:
            self.abort_flag[0] = 0

    def set_threads(self, int n_threads, int n_threads_batch=0) -> None:
        self._alive()
        llama_set_n_threads(self.ptr, n_threads, n_threads_batch or n_threads)

    # -- memory ------------------------------------------------------------------------------------------
    def clear(self, bint data=False) -> None:
        self._alive()
        llama_memory_clear(self.mem, data)

    def seq_rm(self, int seq_id, int p0, int p1=-1) -> bool:
        """Remove positions [p0, p1) of ``seq_id``; False when llama.cpp cannot (recurrent memory)."""
        self._alive()
        return llama_memory_seq_rm(self.mem, seq_id, p0, p1)

    def seq_cp(self, int src, int dst, int p0=-1, int p1=-1) -> None:
        self._alive()
        llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_keep(self, int seq_id) -> None:
        self._alive()
        llama_memory_seq_keep(self.mem, seq_id)

    def pos_min(self, int seq_id=0) -> int:
        self._alive()
        return llama_memory_seq_pos_min(self.mem, seq_id)

    def pos_max(self, int seq_id=0) -> int:
        self._alive()
        return llama_memory_seq_pos_max(self.mem, seq_id)

    def state_get(self, int seq_id=0, int flags=LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) -> bytes:
        """The sequence state (``PARTIAL_ONLY`` by default: recurrent/SWA part, not the full KV)."""
        self._alive()
        cdef size_t size = llama_state_seq_get_size_ext(self.ptr, seq_id, flags)
        cdef bytes out = PyBytes_FromStringAndSize(NULL, size)
        cdef uint8_t * dst = <uint8_t *>PyBytes_AS_STRING(out)
        cdef size_t got
        with nogil:
            got = llama_state_seq_get_data_ext(self.ptr, dst, size, seq_id, flags)
        if got != size:
            _check("state_get", <long>got)
        return out

    def state_set(self, bytes data, int seq_id=0, int flags=LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) -> None:
        self._alive()
        cdef const uint8_t * src = <const uint8_t *>PyBytes_AS_STRING(data)
        cdef size_t size = len(data)
        cdef size_t got
        _errors.clear()
        with nogil:
            got = llama_state_seq_set_data_ext(self.ptr, src, size, seq_id, flags)
        if got == 0:
            _check("state_set", -1)

    # -- hidden-state taps (llama-ext.h) -------------------------------------------------------------------
    def set_embeddings_nextn(self, bint value, bint masked=False) -> None:
        self._alive()
        llama_set_embeddings_nextn(self.ptr, value, masked)
        self._nextn_tap = value
        self._nextn_masked = masked

    def embeddings_nextn(self):
        """Rows of the ``h_nextn`` tap of the last decode (zero-copy, ``n_embd_out`` wide)."""
        self._alive()
        if not self._nextn_tap:
            raise RuntimeFault("embeddings_nextn: the nextn tap is not enabled; call set_embeddings_nextn")
        cdef float * ptr = llama_get_embeddings_nextn(self.ptr)
        if ptr == NULL:
            raise RuntimeFault("embeddings_nextn: llama.cpp returned NULL (no decode yet?)")
        rows = self.n_outputs if self._nextn_masked else self._last_n_tokens
        return self._view(ptr, rows, llama_model_n_embd_out(self.model.ptr))

    def set_embeddings_layer_inp(self, int lid, bint value=True) -> None:
        """Tap the input of layer ``lid``; refuses layers the arch does not record (that aborts)."""
        self._alive()
        arch = self.model.arch
        n_layer = self.model.n_layer
        if value:
            if arch not in LAYER_INP_ARCHS:
                raise ArtifactError(f"{self.model.path}: arch {arch!r} records no layer inputs; "
                                    "hidden-state taps are unsupported", reason="tap_unsupported",
                                    evidence="general.architecture")
            limit = n_layer if arch in LAYER_INP_FINAL_ARCHS else n_layer - 1
            if lid < 0 or lid > limit:
                raise ConfigError("layer", lid, f"an integer in [0, {limit}] for arch {arch!r}",
                                  "only deepseek4, mimo2 and nemotron_h record the output of the last layer")
        llama_set_embeddings_layer_inp(self.ptr, lid, value)
        if value:
            self._layer_taps.add(lid)
        else:
            self._layer_taps.discard(lid)

    def embeddings_layer_inp(self, int lid):
        """Input of layer ``lid`` for every token of the last decode (zero-copy, ``n_embd`` wide)."""
        self._alive()
        if lid not in self._layer_taps:
            raise RuntimeFault(f"embeddings_layer_inp: layer {lid} is not tapped; call "
                               "set_embeddings_layer_inp first (llama.cpp would abort)")
        cdef float * ptr = llama_get_embeddings_layer_inp(self.ptr, lid)
        if ptr == NULL:
            raise RuntimeFault("embeddings_layer_inp: llama.cpp returned NULL (no decode yet?)")
        return self._view(ptr, self._last_n_tokens, llama_model_n_embd(self.model.ptr))

    @property
    def other(self):
        """The ``ctx_other`` this context was created with (or ``None``)."""
        return self.ctx_other

    @property
    def has_ctx_other(self) -> bool:
        self._alive()
        return llama_get_ctx_other(self.ptr) != NULL
