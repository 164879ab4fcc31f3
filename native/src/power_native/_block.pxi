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
    cdef float[:, ::1] feats

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
        self.n_kv = 0

    def reset(self) -> None:
        self.ctx.clear(False)
        self.n_kv = 0

    def inject(self, layers) -> int:
        """Inject one target batch at positions ``n_kv..``: ``layers`` holds, per target layer in the
        draft's order, that layer's input rows (``(n, n_embd)`` float32, e.g. zero-copy tap views).
        Chunked by ``n_ubatch`` like llama.cpp; returns the number of positions added."""
        cdef list views = [np.ascontiguousarray(a, dtype=np.float32) for a in layers]
        if len(views) != self.n_layers:
            raise RuntimeFault(f"BlockDraft.inject: {len(views)} layer arrays for {self.n_layers} target layers")
        cdef Py_ssize_t n = views[0].shape[0]
        for v in views:
            if v.ndim != 2 or v.shape[0] != n or v.shape[1] != self.n_embd:
                raise RuntimeFault(f"BlockDraft.inject: layer rows of shape {v.shape}; expected ({n}, {self.n_embd})")
        if self.n_kv + n > self.ctx.n_ctx:
            raise CapacityError(f"draft: positions up to {self.n_kv + n} overflow its context of {self.ctx.n_ctx}")
        cdef const float[:, ::1] src
        cdef Py_ssize_t off, i, chunk, step = self.ctx.n_ubatch
        cdef int k
        cdef int32_t rc = 0
        cdef size_t row_bytes = self.n_embd * sizeof(float)
        for off in range(0, n, step):
            chunk = min(step, n - off)
            for k in range(self.n_layers):
                src = views[k]
                with nogil:
                    for i in range(chunk):
                        memcpy(&self.feats[i, k * self.n_embd], &src[off + i, 0], row_bytes)
            self.batch.clear_c()
            with nogil:
                for i in range(chunk):
                    rc = self.batch.add_embd_c(&self.feats[i, 0], self.width, self.n_kv + <int32_t>i, False)
                    if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                        break
            if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                self.batch._fail(rc, self.width, <int32_t>i)
            self.ctx.process_c(self.batch, False)
            self.n_kv += <int>chunk
        return n

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
