# BlockDraft: the shared mechanics of llama.cpp's `dflash` graph (DFlash v1, DFlash2, DSpark;
# common/speculative.cpp common_speculative_impl_draft_dflash). Included by _llama.pyx.
#
# The draft's KV holds, at every committed target position, the target's hidden features there
# (the inputs of the draft's `target_layers`, concatenated), injected as embedding-only entries
# ("fused inject": fc, enc.output_norm, K/V written at the target positions). A draft is one
# decode of the noise block [anchor, mask x (n-1)] at the anchor's position; what each contract
# reads from its rows (logits, the DFlash2 selector lattice, the DSpark confidence) is the
# plugins' business.

cdef class BlockDraft:
    """Injection and noise-block decoding on one DFlash-family draft context (sequence 0)."""

    cdef readonly Context ctx
    cdef BatchExt batch
    cdef readonly int n_embd, n_layers, width, mask_id, n_kv
    cdef readonly int n_staged  # rows of the staged verify pass (0: none)
    cdef float[:, ::1] feats
    cdef float[:, ::1] staged

    def __init__(self, Context ctx, int n_target_layers, int mask_id):
        if ctx is None:
            raise RuntimeFault("BlockDraft: no draft context")
        ctx._alive()
        if n_target_layers < 1:
            raise ConfigError("target_layers", n_target_layers, "at least one target layer")
        if mask_id < 0 or mask_id >= ctx.n_vocab:
            raise ArtifactError(f"{ctx.model.path}: tokenizer.ggml.mask_token_id={mask_id} is outside the vocabulary "
                                f"[0, {ctx.n_vocab})", reason="dflash_mask_token_missing",
                                evidence="tokenizer.ggml.mask_token_id")
        self.ctx = ctx
        self.batch = BatchExt(ctx)
        self.n_embd = ctx.model.n_embd
        self.n_layers = n_target_layers
        self.width = n_target_layers * self.n_embd
        self.mask_id = mask_id
        self.feats = np.zeros((ctx.n_ubatch, self.width), dtype=np.float32)
        self.staged = np.zeros((16, self.width), dtype=np.float32)  # grows to the widest verify pass
        self.n_kv = 0
        self.n_staged = 0

    def reset(self) -> None:
        self.ctx.clear(False)
        self.n_kv = 0
        self.n_staged = 0

    cdef list _layer_views(self, layers, str what):
        """The per-layer row arrays, checked: one per target layer, each ``(n, n_embd)`` float32."""
        cdef list views = [np.ascontiguousarray(a, dtype=np.float32) for a in layers]
        if len(views) != self.n_layers:
            raise RuntimeFault(f"BlockDraft.{what}: {len(views)} layer arrays for {self.n_layers} target layers")
        cdef Py_ssize_t n = views[0].shape[0]
        for v in views:
            if v.ndim != 2 or v.shape[0] != n or v.shape[1] != self.n_embd:
                raise RuntimeFault(f"BlockDraft.{what}: layer rows of shape {v.shape}; expected ({n}, {self.n_embd})")
        return views

    cdef int _gather(self, list views, Py_ssize_t off, Py_ssize_t n, float[:, ::1] dst) except -1:
        """Rows ``off..off+n`` of every layer, concatenated per row into ``dst[0..n)`` (the draft's order)."""
        cdef const float[:, ::1] src
        cdef Py_ssize_t i
        cdef int k
        cdef size_t row_bytes = self.n_embd * sizeof(float)
        for k in range(self.n_layers):
            src = views[k]
            with nogil:
                for i in range(n):
                    memcpy(&dst[i, k * self.n_embd], &src[off + i, 0], row_bytes)
        return 0

    cdef int _inject_rows(self, float[:, ::1] rows, Py_ssize_t n) except -1:
        """Inject ``rows[0..n)`` (concatenated features, ``n <= n_ubatch``) at positions ``n_kv..``."""
        cdef Py_ssize_t i
        cdef int32_t rc = 0
        self.batch.clear_c()
        with nogil:
            for i in range(n):
                rc = self.batch.add_embd_c(&rows[i, 0], self.width, self.n_kv + <int32_t>i, False)
                if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                    break
        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
            self.batch._fail(rc, self.width, <int32_t>i)
        self.ctx.process_c(self.batch, False)
        self.n_kv += <int>n
        return 0

    def inject(self, layers) -> int:
        """Inject one target batch at positions ``n_kv..``: ``layers`` holds, per target layer in the
        draft's order, that layer's input rows (``(n, n_embd)`` float32, e.g. zero-copy tap views).
        Chunked by ``n_ubatch`` like llama.cpp; returns the number of positions added."""
        cdef list views = self._layer_views(layers, "inject")
        cdef Py_ssize_t n = views[0].shape[0]
        if self.n_kv + n > self.ctx.n_ctx:
            raise CapacityError(f"draft: positions up to {self.n_kv + n} overflow its context of {self.ctx.n_ctx}")
        cdef Py_ssize_t off, chunk, step = self.ctx.n_ubatch
        for off in range(0, n, step):
            chunk = min(step, n - off)
            self._gather(views, off, chunk, self.feats)
            self._inject_rows(self.feats, chunk)
        return n

    def stage(self, layers) -> int:
        """Copy a verify pass's layer rows (as :meth:`inject` takes them) into the draft's staging
        buffer, to inject a prefix of them at commit (:meth:`inject_staged`): the target's own buffers
        may be overwritten (a replay decode) before then. Returns the rows staged."""
        cdef list views = self._layer_views(layers, "stage")
        cdef Py_ssize_t n = views[0].shape[0]
        if n > self.staged.shape[0]:
            self.staged = np.zeros((n, self.width), dtype=np.float32)
        self._gather(views, 0, n, self.staged)
        self.n_staged = <int>n
        return n

    def inject_staged(self, int n) -> int:
        """Inject the first ``n`` staged rows (the kept ones) at positions ``n_kv..`` and drop the rest."""
        if n < 0 or n > self.n_staged:
            raise RuntimeFault(f"BlockDraft.inject_staged: {n} rows of {self.n_staged} staged")
        if self.n_kv + n > self.ctx.n_ctx:
            raise CapacityError(f"draft: positions up to {self.n_kv + n} overflow its context of {self.ctx.n_ctx}")
        self.n_staged = 0
        cdef Py_ssize_t off, chunk, step = self.ctx.n_ubatch
        for off in range(0, n, step):
            chunk = min(step, n - off)
            self._inject_rows(self.staged[off:off + chunk], chunk)
        return n

    def drop_staged(self) -> None:
        """Forget the staged rows (the round was restored)."""
        self.n_staged = 0

    def noise(self, int anchor, int n_block, bint outputs) -> None:
        """Decode ``[anchor, mask x (n_block-1)]`` at positions ``n_kv..`` (output rows on or off).
        Read the rows with ``ctx.logits()`` / ``ctx.embeddings_nextn()``; :meth:`trim` removes them."""
        if n_block < 1:
            raise ConfigError("n_block", n_block, "at least 1")
        if anchor < 0 or anchor >= self.ctx.n_vocab:
            raise CapacityError(f"draft: anchor {anchor} outside [0, {self.ctx.n_vocab})")
        if self.n_kv + n_block > self.ctx.n_ctx:
            raise CapacityError(f"draft: the block at {self.n_kv}..{self.n_kv + n_block} overflows its context "
                                f"of {self.ctx.n_ctx}")
        cdef int i
        cdef int32_t rc = 0
        self.batch.clear_c()
        with nogil:
            for i in range(n_block):
                rc = self.batch.add_token_c(anchor if i == 0 else self.mask_id, self.n_kv + i, NULL, 0, outputs)
                if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                    break
        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
            self.batch._fail(rc, 0, i)
        self.ctx.process_c(self.batch, False)

    def trim(self, int n_kv) -> None:
        """Drop draft KV positions >= ``n_kv`` (noise rows, rejected injections)."""
        self.ctx._alive()
        if not llama_memory_seq_rm(self.ctx.mem, 0, n_kv, -1):
            raise RuntimeFault(f"draft: llama_memory_seq_rm refused to trim the draft KV to {n_kv}")
        self.n_kv = n_kv
