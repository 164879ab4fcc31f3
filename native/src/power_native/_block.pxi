# BlockDraft: the shared mechanics of llama.cpp's `dflash` graph (DFlash v1, DFlash2, DSpark;
# common/speculative.cpp common_speculative_impl_draft_dflash). Included by _llama.pyx.
#
# The draft's KV holds, at every committed target position, the target's hidden features there
# (the inputs of the draft's `target_layers`, concatenated), injected as embedding-only entries
# ("fused inject": fc, enc.output_norm, K/V written at the target positions). A draft is one
# decode of the noise block [anchor, mask x (n-1)] at the anchor's position; what each contract
# reads from its rows (logits, the DFlash2 selector lattice, the DSpark confidence) is the
# plugins' business.
#
# One draft context serves every sequence of a target (n_seq_max = n_seq, one KV stream per
# sequence): each sequence's state (its positions, staged rows, compute clock) is its own, every
# memory operation names its sequence, and one decode holds the noise blocks of several sequences
# (noise_many), as llama.cpp's server drafts all its slots in one batch.

cdef class BlockDraft:
    """Injection and noise-block decoding on one DFlash-family draft context, for sequences
    ``0..n_seq-1`` (the context's ``n_seq_max``; a KV stream each). Injections go in decodes of
    ``chunk`` rows (default: the context's ``n_ubatch``), so a shared context whose ubatch holds
    every sequence's block injects in the passes a context of its own would."""

    cdef readonly Context ctx
    cdef BatchExt batch
    cdef readonly int n_embd, n_layers, width, mask_id, n_seq
    cdef readonly int chunk  # rows per injection decode (a solo draft context's n_ubatch: the same passes)
    cdef int[::1] kv  # per sequence: its positions 0..kv[s]-1 hold injected features
    cdef int[::1] n_stg  # per sequence: rows of its staged verify pass (0: none)
    cdef int64_t[::1] ns  # per sequence: ns inside the decodes it took part in
    cdef list staged  # per sequence: its staging rows (float32, grows to the widest verify pass)
    cdef float[:, ::1] feats
    cdef int32_t[::1] firsts  # the last noise_many: each block's first batch entry

    def __init__(self, Context ctx, int n_target_layers, int mask_id, int n_seq=1, int chunk=0):
        if ctx is None:
            raise RuntimeFault("BlockDraft: no draft context")
        ctx._alive()
        if n_target_layers < 1:
            raise ConfigError("target_layers", n_target_layers, "at least one target layer")
        if mask_id < 0 or mask_id >= ctx.n_vocab:
            raise ArtifactError(f"{ctx.model.path}: tokenizer.ggml.mask_token_id={mask_id} is outside the vocabulary "
                                f"[0, {ctx.n_vocab})", reason="dflash_mask_token_missing",
                                evidence="tokenizer.ggml.mask_token_id")
        if n_seq < 1 or n_seq > <int>llama_n_seq_max(ctx.ptr):
            raise ConfigError("n_seq", n_seq, f"an integer in [1, {llama_n_seq_max(ctx.ptr)}] (its n_seq_max)")
        self.ctx = ctx
        self.batch = BatchExt(ctx)
        self.n_embd = ctx.model.n_embd
        self.n_layers = n_target_layers
        self.width = n_target_layers * self.n_embd
        self.mask_id = mask_id
        self.n_seq = n_seq
        if chunk <= 0 or chunk > ctx.n_ubatch:
            chunk = ctx.n_ubatch
        self.chunk = chunk
        self.feats = np.zeros((chunk, self.width), dtype=np.float32)
        self.staged = [np.zeros((16, self.width), dtype=np.float32) for _ in range(n_seq)]
        self.kv = np.zeros(n_seq, dtype=np.intc)
        self.n_stg = np.zeros(n_seq, dtype=np.intc)
        self.ns = np.zeros(n_seq, dtype=np.int64)
        self.firsts = np.zeros(n_seq, dtype=np.int32)

    @property
    def cells(self) -> int:
        """The positions each sequence may hold (its KV stream's share of the context)."""
        return self.ctx.n_ctx // self.n_seq

    cdef int _seq(self, int seq) except -1:
        if seq < 0 or seq >= self.n_seq:
            raise ConfigError("seq_id", seq, f"an integer in [0, {self.n_seq})")
        return seq

    def n_kv(self, int seq=0) -> int:
        """The positions sequence ``seq`` holds (its injected features)."""
        return self.kv[self._seq(seq)]

    def n_staged(self, int seq=0) -> int:
        """Rows of sequence ``seq``'s staged verify pass (0: none)."""
        return self.n_stg[self._seq(seq)]

    def compute_ns(self, int seq=0) -> int:
        """ns inside llama.cpp's decodes that sequence ``seq`` took part in: its own injections and
        every noise decode holding its block (a shared one counts whole for each of its sequences)."""
        return self.ns[self._seq(seq)]

    def reset(self, int seq=0) -> None:
        """Empty sequence ``seq`` (a context of one sequence is cleared; a shared one keeps the others)."""
        self._seq(seq)
        if self.n_seq == 1:
            self.ctx.clear(False)
        elif not self.ctx.seq_rm(seq, 0, -1):
            raise RuntimeFault(f"draft: llama_memory_seq_rm refused to empty sequence {seq}")
        self.kv[seq] = 0
        self.n_stg[seq] = 0

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

    cdef int _process(self, int seq) except -1:
        """Decode the batch for sequence ``seq`` alone, on its compute clock."""
        cdef int64_t before = self.ctx.compute_ns
        try:
            self.ctx.process_c(self.batch, False)
        finally:
            self.ns[seq] += self.ctx.compute_ns - before
        return 0

    cdef int _inject_rows(self, int seq, float[:, ::1] rows, Py_ssize_t n) except -1:
        """Inject ``rows[0..n)`` (concatenated features, ``n <= chunk``) at positions ``kv[seq]..``."""
        cdef Py_ssize_t i
        cdef int32_t rc = 0
        cdef int32_t pos0 = self.kv[seq]
        self.batch.clear_c()
        with nogil:
            for i in range(n):
                rc = self.batch.add_embd_seq_c(&rows[i, 0], self.width, pos0 + <int32_t>i, seq, False)
                if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                    break
        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
            self.batch._fail(rc, self.width, <int32_t>i)
        self._process(seq)
        self.kv[seq] += <int>n
        return 0

    cdef int _room(self, int seq, Py_ssize_t n) except -1:
        cdef int cells = self.ctx.n_ctx // self.n_seq
        if self.kv[seq] + n > cells:
            raise CapacityError(f"draft: positions up to {self.kv[seq] + n} overflow its context of {cells}")
        return 0

    def inject(self, int seq, layers) -> int:
        """Inject one target batch of sequence ``seq`` at its positions ``n_kv(seq)..``: ``layers`` holds,
        per target layer in the draft's order, that layer's input rows (``(n, n_embd)`` float32, e.g.
        zero-copy tap views). Chunked by ``chunk`` rows like llama.cpp's ``n_ubatch``; returns the number
        of positions added."""
        self._seq(seq)
        cdef list views = self._layer_views(layers, "inject")
        cdef Py_ssize_t n = views[0].shape[0]
        self._room(seq, n)
        cdef Py_ssize_t off, chunk, step = self.chunk
        for off in range(0, n, step):
            chunk = min(step, n - off)
            self._gather(views, off, chunk, self.feats)
            self._inject_rows(seq, self.feats, chunk)
        return n

    def stage(self, int seq, layers) -> int:
        """Copy a verify pass's layer rows (as :meth:`inject` takes them) into sequence ``seq``'s staging
        buffer, to inject a prefix of them at commit (:meth:`inject_staged`): the target's own buffers
        may be overwritten (a replay decode) before then. Returns the rows staged."""
        self._seq(seq)
        cdef list views = self._layer_views(layers, "stage")
        cdef Py_ssize_t n = views[0].shape[0]
        if n > self.staged[seq].shape[0]:
            self.staged[seq] = np.zeros((n, self.width), dtype=np.float32)
        self._gather(views, 0, n, self.staged[seq])
        self.n_stg[seq] = <int>n
        return n

    def inject_staged(self, int seq, int n) -> int:
        """Inject the first ``n`` staged rows of sequence ``seq`` (the kept ones) at its positions
        ``n_kv(seq)..`` and drop the rest."""
        self._seq(seq)
        if n < 0 or n > self.n_stg[seq]:
            raise RuntimeFault(f"BlockDraft.inject_staged: {n} rows of {self.n_stg[seq]} staged")
        self._room(seq, n)
        self.n_stg[seq] = 0
        cdef float[:, ::1] rows = self.staged[seq]
        cdef Py_ssize_t off, chunk, step = self.chunk
        for off in range(0, n, step):
            chunk = min(step, n - off)
            self._inject_rows(seq, rows[off:off + chunk], chunk)
        return n

    def inject_staged_many(self, seqs, counts) -> None:
        """:meth:`inject_staged` for several sequences in one pass (``seqs`` in increasing order, each
        once; ``counts[j]`` kept rows of ``seqs[j]``, each at most ``chunk``): with a KV stream per
        sequence and batch-invariant kernels every sequence gets the K/V its own injection writes. The
        pass counts on the compute clock of every sequence in it. On a failure no row stays in any KV
        and every sequence keeps its staged rows."""
        cdef int32_t[::1] s = np.ascontiguousarray(seqs, dtype=np.int32)
        cdef int32_t[::1] c = np.ascontiguousarray(counts, dtype=np.int32)
        cdef Py_ssize_t j, i, m = s.shape[0], total = 0
        if c.shape[0] != m:
            raise ConfigError("inject_staged_many", [m, c.shape[0]], "one count per sequence")
        for j in range(m):
            self._seq(s[j])
            if j and s[j] <= s[j - 1]:
                raise ConfigError("seqs", list(s), "increasing sequence ids, each once")
            if c[j] < 1 or c[j] > self.n_stg[s[j]] or c[j] > self.chunk:
                raise RuntimeFault(f"BlockDraft.inject_staged_many: {c[j]} rows of sequence {s[j]}, which staged "
                                   f"{self.n_stg[s[j]]} (at most {self.chunk} per pass)")
            self._room(s[j], c[j])
            total += c[j]
        if total > self.batch.capacity:
            raise CapacityError(f"draft: {total} injected rows exceed the batch capacity {self.batch.capacity}")
        cdef float[:, ::1] rows
        cdef int32_t rc = 0
        self.batch.clear_c()
        for j in range(m):
            rows = self.staged[s[j]]
            for i in range(c[j]):
                rc = self.batch.add_embd_seq_c(&rows[i, 0], self.width, self.kv[s[j]] + <int32_t>i, s[j], False)
                if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                    self.batch._fail(rc, self.width, <int32_t>i)
        cdef int64_t before = self.ctx.compute_ns
        try:
            self.ctx.process_c(self.batch, False)
        except BaseException:
            for j in range(m):
                llama_memory_seq_rm(self.ctx.mem, s[j], self.kv[s[j]], -1)
            raise
        finally:
            for j in range(m):
                self.ns[s[j]] += self.ctx.compute_ns - before
        for j in range(m):
            self.kv[s[j]] += c[j]
            self.n_stg[s[j]] = 0

    def drop_staged(self, int seq=0) -> None:
        """Forget sequence ``seq``'s staged rows (the round was restored)."""
        self.n_stg[self._seq(seq)] = 0

    cdef int _add_block(self, int seq, int anchor, int n_block, bint outputs) except -1:
        """Add ``[anchor, mask x (n_block-1)]`` at sequence ``seq``'s positions ``n_kv(seq)..``;
        returns the block's first batch entry."""
        self._seq(seq)
        if anchor < 0 or anchor >= self.ctx.n_vocab:
            raise CapacityError(f"draft: anchor {anchor} outside [0, {self.ctx.n_vocab})")
        self._room(seq, n_block)
        cdef int i, first = -1
        cdef int32_t rc = 0
        cdef int32_t pos0 = self.kv[seq]
        with nogil:
            for i in range(n_block):
                rc = self.batch.add_token_seq_c(anchor if i == 0 else self.mask_id, pos0 + i, seq, NULL, 0, outputs)
                if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                    break
                if i == 0:
                    first = rc
        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
            self.batch._fail(rc, 0, i)
        return first

    def noise(self, int seq, int anchor, int n_block, bint outputs) -> None:
        """Decode ``[anchor, mask x (n_block-1)]`` at sequence ``seq``'s positions ``n_kv(seq)..`` (output
        rows on or off). Read the rows with ``ctx.logits()`` / ``ctx.embeddings_nextn()``; :meth:`trim`
        removes them."""
        if n_block < 1:
            raise ConfigError("n_block", n_block, "at least 1")
        self.batch.clear_c()
        self._add_block(seq, anchor, n_block, outputs)
        self._process(seq)

    def noise_many(self, seqs, anchors, int n_block, bint outputs):
        """Decode the noise block ``[anchors[j], mask x (n_block-1)]`` of every sequence ``seqs[j]``
        (each at its own positions ``n_kv(seq)..``; a sequence once) in one pass. Returns each block's
        first batch entry (``int32``): read its rows with ``ctx.logits_ith`` /
        ``ctx.embeddings_nextn_ith`` (llama.cpp maps entries to rows; never assume the blocks' order).
        The pass counts on the compute clock of every sequence in it; :meth:`trim` removes the rows.
        Give the sequences in increasing order: llama.cpp computes a run of consecutive sequences'
        KV streams in one ubatch, and starts another ubatch at every gap or step back."""
        cdef int32_t[::1] s = np.ascontiguousarray(seqs, dtype=np.int32)
        cdef int32_t[::1] a = np.ascontiguousarray(anchors, dtype=np.int32)
        cdef Py_ssize_t j, m = s.shape[0]
        if n_block < 1:
            raise ConfigError("n_block", n_block, "at least 1")
        if m < 1 or a.shape[0] != m or m > self.n_seq:
            raise ConfigError("noise_many", [m, a.shape[0]], f"1 to {self.n_seq} sequences, one anchor each")
        if m * n_block > self.batch.capacity:
            raise CapacityError(f"draft: {m} blocks of {n_block} exceed the batch capacity {self.batch.capacity}")
        seen = set()
        for j in range(m):
            if s[j] in seen:
                raise ConfigError("seqs", s[j], "each sequence once per pass")
            seen.add(s[j])
        self.batch.clear_c()
        for j in range(m):
            self.firsts[j] = self._add_block(s[j], a[j], n_block, outputs)
        cdef int64_t before = self.ctx.compute_ns
        try:
            self.ctx.process_c(self.batch, False)
        finally:
            for j in range(m):
                self.ns[s[j]] += self.ctx.compute_ns - before
        return np.asarray(self.firsts[:m]).copy()

    def trim(self, int seq, int n_kv) -> None:
        """Drop sequence ``seq``'s draft KV positions >= ``n_kv`` (noise rows, rejected injections)."""
        self._seq(seq)
        self.ctx._alive()
        if not llama_memory_seq_rm(self.ctx.mem, seq, n_kv, -1):
            raise RuntimeFault(f"draft: llama_memory_seq_rm refused to trim the draft KV of sequence {seq} to {n_kv}")
        self.kv[seq] = n_kv
