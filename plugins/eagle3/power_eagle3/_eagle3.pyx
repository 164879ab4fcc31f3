# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The EAGLE3 drafter on llama.cpp (``common_speculative_impl_draft_eagle3``), GIL-free per token.

A draft context on the EAGLE3 model (``ctx_other`` = the target's context, whose token embeddings
and output a draft without its own borrows) runs two graphs:

* the encoder: the three tapped target rows of a token, concatenated, become ``g`` (``fc``, with
  ``enc.output_norm`` before it for ``norm_before_fc`` drafts), read from the ``h_nextn`` buffer;
* the decoder: at draft position ``P`` its input is ``(token P+1, g P)``, so the last row of every
  target batch is *deferred* (its next token is not known yet): the boundary row ``(pending_pos,
  pending)`` is completed by the next batch's first token (the bridge) or by the next draft's anchor.

A draft decodes ``(anchor, pending)`` at ``pending_pos`` and then ``K - 1`` more steps, each feeding
the decoder's own pre-norm state (``h_nextn``) back as ``g``; each id is the first maximum of the row
(top-k(10) greedy, llama.cpp's first candidate), cut where its top-10 softmax falls below ``p_min``.
Only the boundary row stays in the KV afterwards, as llama-speculative-simple keeps it.

Every entry addresses this object's sequence (``seq``): several drafters may share one context.
"""

from libc.math cimport expf
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy, memset

cimport numpy as cnp

from power_native.llama cimport (LLAMA_PROCESS_TYPE_DECODE, llama_batch_ext_add_embd, llama_batch_ext_add_token,
                                 llama_batch_ext_set_embd_token, llama_batch_ext_set_output_logits,
                                 llama_batch_ext_set_pos, llama_embd, llama_get_logits_ith, llama_get_sampled_token_ith,
                                 llama_memory_seq_rm, llama_pos, llama_process, llama_synchronize)
from power_native.llama_ext cimport llama_get_embeddings_nextn, llama_get_embeddings_nextn_ith
from power_native._llama cimport (RC_CANCELLED, RC_OK, RC_OP_BATCH, RC_OP_DECODE, RC_OP_OUTPUT, BatchExt, Context,
                                  clock_ns, rc_raise, rc_status, rc_translate)

import numpy as np

from power_core.errors import CapacityError, RuntimeFault

cnp.import_array()

__all__ = ["Eagle3Draft", "TOP_K"]

#: llama.cpp's draft sampler: top-k(10), its first candidate; p_min compares that candidate's softmax
cdef enum:
    _TOP_K = 10
TOP_K = _TOP_K


cdef int32_t _add(BatchExt b, int seq, int32_t token, int32_t pos, const float * row, size_t width,
                  bint output) noexcept nogil:
    """One entry on sequence ``seq``: a token (with an embedding row when ``row`` is not NULL), or an
    embedding-only row when ``token`` < 0. Returns the index or BatchExt's negative codes."""
    cdef llama_embd e
    cdef llama_pos p[4]
    cdef int32_t idx
    if output and b.n_outputs >= b.ctx.n_outputs_max:
        return -6
    e.data = row
    e.n_rows = 1
    e.n_embd = width
    if token >= 0:
        idx = llama_batch_ext_add_token(b.ptr, seq, token)
        if idx < 0:
            return idx
        if row != NULL and not llama_batch_ext_set_embd_token(b.ptr, idx, e):
            return -4
    else:
        idx = llama_batch_ext_add_embd(b.ptr, seq, e)
        if idx < 0:
            return idx if idx != -2 else -4
    p[0] = pos
    p[1] = pos
    p[2] = pos
    p[3] = 0
    if not llama_batch_ext_set_pos(b.ptr, idx, p):
        return -5
    llama_batch_ext_set_output_logits(b.ptr, idx, output)
    b.n_tokens += 1
    b.n_outputs += output
    return idx


cdef float _top_p(const float * row, int n) noexcept nogil:
    """Softmax probability of the row's maximum among its ``TOP_K`` largest logits (llama.cpp's top-k
    sampler followed by its softmax: ``1 / sum(exp(l_i - l_max))`` over the ten, in descending order)."""
    cdef float top[_TOP_K]
    cdef int m = 0, i, j
    cdef float v, s = 0
    for i in range(n):
        v = row[i]
        if m < _TOP_K:
            j = m
            m += 1
        elif v > top[_TOP_K - 1]:
            j = _TOP_K - 1
        else:
            continue
        while j > 0 and top[j - 1] < v:
            top[j] = top[j - 1]
            j -= 1
        top[j] = v
    for i in range(m):
        s += expf(top[i] - top[0])
    return 1.0 / s


cdef class Eagle3Draft:
    """Draft state of one sequence on an EAGLE3 draft context: its KV, the boundary row, the last batch."""

    cdef readonly Context ctx
    cdef BatchExt batch
    cdef readonly int seq  # the draft context's sequence this drafter addresses
    cdef readonly int n_embd, n_taps, tap_width, width, n_vocab
    cdef float[:, ::1] feats  # concatenated target rows of the last batch (n, width)
    cdef float[:, ::1] g  # their encoder outputs (n, n_embd)
    cdef int32_t[::1] toks  # the last batch's tokens
    cdef float[::1] pending
    cdef object pending_array
    cdef readonly int n_pos  # target positions committed: the next batch starts here (pending_pos + 1)
    cdef readonly int n_kv  # the draft KV holds positions 0..n_kv-1 of this sequence
    cdef readonly int n_rows  # rows of the last observed batch
    cdef readonly bint staged  # the last batch is a verify pass, kept rows not committed yet
    cdef readonly long passes  # decoder passes of drafts

    def __init__(self, Context ctx, int n_taps, int tap_width, int seq=0):
        if ctx is None:
            raise RuntimeFault("Eagle3Draft: no draft context")
        ctx._alive()
        self.ctx = ctx
        self.batch = BatchExt(ctx)
        self.seq = seq
        self.n_embd = ctx.model.n_embd
        self.n_taps = n_taps
        self.tap_width = tap_width
        self.width = n_taps * tap_width
        self.n_vocab = ctx.n_vocab
        self.pending_array = np.zeros(self.n_embd, dtype=np.float32)
        self.pending = self.pending_array
        self._grow(16)
        self.reset()

    cdef int _grow(self, Py_ssize_t n) except -1:
        self.feats = np.zeros((n, self.width), dtype=np.float32)
        self.g = np.zeros((n, self.n_embd), dtype=np.float32)
        self.toks = np.zeros(n, dtype=np.int32)
        return 0

    def reset(self) -> None:
        """A new request: this sequence's KV empty, no boundary row."""
        self.ctx._alive()
        llama_memory_seq_rm(self.ctx.mem, self.seq, 0, -1)
        self.pending[:] = 0
        self.n_pos = 0
        self.n_kv = 0
        self.n_rows = 0
        self.staged = False

    def observe(self, tokens, layers, bint defer=False) -> None:
        """One target batch at positions ``n_pos..``: ``tokens`` and, per tap in the draft's order, that
        tap's rows (``(n, tap_width)`` float32, zero-copy views of the target's buffers are fine: they
        are copied here). A prompt chunk is encoded and decoded at once; a verify pass (``defer``) only
        copied, :meth:`keep` runs the kept rows."""
        cdef const int32_t[::1] tv = np.ascontiguousarray(tokens, dtype=np.int32)
        cdef Py_ssize_t n = tv.shape[0], i
        cdef list views = [np.ascontiguousarray(a, dtype=np.float32) for a in layers]
        if len(views) != self.n_taps:
            raise RuntimeFault(f"Eagle3Draft.observe: {len(views)} tap arrays for {self.n_taps} taps")
        for v in views:
            if v.ndim != 2 or v.shape[0] != n or v.shape[1] != self.tap_width:
                raise RuntimeFault(f"Eagle3Draft.observe: tap rows of shape {v.shape}; expected ({n}, {self.tap_width})")
        if n == 0:
            return
        if self.n_pos + n > self.ctx.n_ctx:
            raise CapacityError(f"draft: positions up to {self.n_pos + n} overflow its context of {self.ctx.n_ctx}")
        if n > self.toks.shape[0]:
            self._grow(n)
        cdef const float[:, ::1] src
        cdef int k
        cdef size_t row_bytes = self.tap_width * sizeof(float)
        for k in range(self.n_taps):
            src = views[k]
            with nogil:
                for i in range(n):
                    memcpy(&self.feats[i, k * self.tap_width], &src[i, 0], row_bytes)
        with nogil:
            memcpy(&self.toks[0], &tv[0], n * sizeof(int32_t))
        self.n_rows = <int>n
        self.staged = defer
        if not defer:
            self._commit(<int>n)

    cdef int _encode(self, int m) except -1:
        """``g`` rows of the first ``m`` staged feature rows (the encoder, chunked by ``n_ubatch``)."""
        cdef int off = 0, chunk, j
        cdef int32_t rc = 0
        cdef int step = self.ctx.n_ubatch
        cdef const float * out
        while off < m:
            chunk = min(step, m - off)
            self.batch.clear_c()
            with nogil:
                for j in range(chunk):  # the per-token encoder reads no positions; llama.cpp numbers them on
                    rc = _add(self.batch, self.seq, -1, self.n_kv + j, &self.feats[off + j, 0], self.width, False)
                    if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                        break
            if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                self.batch._fail(rc, self.width, off + j)
            self.ctx.process_c(self.batch, True)
            out = llama_get_embeddings_nextn(self.ctx.ptr)
            if out == NULL:
                raise RuntimeFault("EAGLE3 encoder produced no output (h_nextn)")
            with nogil:
                memcpy(&self.g[off, 0], out, chunk * self.n_embd * sizeof(float))
            off += chunk
        return 0

    cdef int _commit(self, int m) except -1:
        """Encode the first ``m`` rows of the last batch and write their decoder pairs: the bridge
        ``(token 0, pending)`` at ``pending_pos`` when the boundary row is not in the KV yet, then
        ``(token i+1, g i)`` at ``n_pos + i`` for ``i < m - 1``; row ``m - 1`` becomes the boundary."""
        self._encode(m)
        cdef int start = self.n_pos, i = 0, added = 0
        cdef int32_t rc = 0
        cdef size_t w = self.n_embd
        self.batch.clear_c()
        with nogil:
            if start > 0 and start - 1 >= self.n_kv:  # the cross-batch bridge
                rc = _add(self.batch, self.seq, self.toks[0], start - 1, &self.pending[0], w, False)
                added += 1
            if rc_translate(RC_OP_BATCH, rc) == RC_OK:
                for i in range(m - 1):
                    rc = _add(self.batch, self.seq, self.toks[i + 1], start + i, &self.g[i, 0], w, False)
                    if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                        break
                    added += 1
        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
            self.batch._fail(rc, w, i)
        if added:
            self.ctx.process_c(self.batch, False)
            self.n_kv = start + m - 1
        with nogil:
            memcpy(&self.pending[0], &self.g[m - 1, 0], w * sizeof(float))
        self.n_pos = start + m
        self.staged = False
        return 0

    def keep(self, int kept) -> None:
        """Keep the first ``kept`` rows of the last observed batch (a verify pass: anchor + accepted):
        their pairs go into the KV and the boundary row becomes the last kept row's ``g``. After a
        prompt chunk (the prefill round) everything is already in."""
        if self.staged:
            if not 0 < kept <= self.n_rows:
                raise RuntimeFault(f"Eagle3Draft.keep: {kept} rows of a {self.n_rows}-row batch")
            self._commit(kept)

    def trim(self, int n_kv) -> None:
        """Drop this sequence's KV positions >= ``n_kv``."""
        self.ctx._alive()
        if not llama_memory_seq_rm(self.ctx.mem, self.seq, n_kv, -1):
            raise RuntimeFault(f"draft: llama_memory_seq_rm refused to trim the draft KV to {n_kv}")
        self.n_kv = min(self.n_kv, n_kv)

    def state(self):
        """What a checkpoint needs: (n_kv, n_pos, boundary row)."""
        return self.n_kv, self.n_pos, self.pending_array.copy()

    def set_state(self, int n_kv, int n_pos, pending) -> None:
        """Back to a :meth:`state`: the KV trimmed to ``n_kv``, the boundary row and position restored,
        any staged verify pass dropped."""
        cdef const float[::1] src = np.ascontiguousarray(pending, dtype=np.float32)
        if src.shape[0] != self.n_embd:
            raise RuntimeFault(f"Eagle3Draft.set_state: a boundary row of {src.shape[0]} values; expected {self.n_embd}")
        self.trim(n_kv)
        self.n_kv = n_kv
        self.n_pos = n_pos
        self.pending[:] = src
        self.staged = False

    def draft(self, int anchor, int k, float p_min=0.0):
        """At most ``k`` ids after ``anchor``: ``(anchor, pending)`` at ``pending_pos``, then each id with
        the decoder's own pre-norm row, one pass per id; an id whose top-10 softmax is below ``p_min``
        ends the draft (not proposed). Each id is the row's first maximum: read on the host, or sampled in
        the graph (``ctx.set_greedy(True)``, only when ``p_min`` is 0). Afterwards the KV keeps the
        boundary row and nothing after it."""
        cdef cnp.ndarray[int32_t, ndim=1] out = np.empty(max(k, 0), dtype=np.int32)
        if k <= 0 or self.n_pos == 0:
            return out[:0]
        self.ctx._alive()
        cdef int pos0 = self.n_pos - 1, i = 0, j, best, n_out = 0, n_pass = 0
        if pos0 + k > self.ctx.n_ctx:
            raise CapacityError(f"EAGLE3 draft: positions up to {pos0 + k} overflow the context {self.ctx.n_ctx}")
        if anchor < 0 or anchor >= self.n_vocab:
            raise CapacityError(f"EAGLE3 draft: anchor {anchor} outside [0, {self.n_vocab})")
        cdef int32_t rc = 0, tok = anchor
        cdef rc_status st
        cdef bint ok
        st.op = RC_OP_DECODE
        st.rc = 0
        cdef const float * h = &self.pending[0]
        cdef const float * row
        cdef float v
        cdef size_t w = self.n_embd
        cdef int nv = self.n_vocab
        cdef int * abort_flag = self.ctx.abort_flag
        cdef bint in_graph = self.ctx.greedy and p_min <= 0
        cdef int64_t t0
        cdef int seq = self.seq
        llama_memory_seq_rm(self.ctx.mem, seq, pos0, -1)
        try:
            with nogil:
                for i in range(k):
                    self.batch.clear_c()
                    rc = _add(self.batch, seq, tok, pos0 + i, h, w, True)
                    if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                        st.op = RC_OP_BATCH
                        st.rc = rc
                        break
                    if abort_flag[0]:
                        st.rc = 2  # as llama.cpp reports an abort
                        break
                    t0 = clock_ns()
                    st.rc = llama_process(self.ctx.ptr, LLAMA_PROCESS_TYPE_DECODE, self.batch.ptr)
                    llama_synchronize(self.ctx.ptr)
                    self.ctx.compute_ns += clock_ns() - t0
                    if rc_translate(st.op, st.rc) != RC_OK:
                        break
                    n_pass += 1
                    h = llama_get_embeddings_nextn_ith(self.ctx.ptr, 0)
                    if in_graph:
                        best = llama_get_sampled_token_ith(self.ctx.ptr, 0)
                        row = NULL
                    else:
                        best = 0
                        row = llama_get_logits_ith(self.ctx.ptr, 0)
                    if (row == NULL and not in_graph) or h == NULL or best < 0:
                        st.op = RC_OP_OUTPUT
                        st.rc = -1
                        break
                    if not in_graph:
                        v = row[0]
                        for j in range(1, nv):
                            if row[j] > v:
                                v = row[j]
                                best = j
                        if p_min > 0 and _top_p(row, nv) < p_min:
                            break  # the pass ran; its id is not proposed
                    tok = best
                    out[n_out] = tok
                    n_out += 1
            ok = rc_translate(st.op, st.rc) == RC_OK
            if not ok:
                if st.op == RC_OP_DECODE and rc_translate(st.op, st.rc) == RC_CANCELLED:
                    abort_flag[0] = 0
                rc_raise(st.op, st.rc, f"EAGLE3 draft pass {i}")
        finally:
            self.batch.clear_c()
            self.passes += n_pass
            # the boundary row stays (llama-speculative-simple trims the draft to the target's length)
            llama_memory_seq_rm(self.ctx.mem, seq, pos0 + 1 if n_pass else pos0, -1)
            self.n_kv = pos0 + 1 if n_pass else min(self.n_kv, pos0)
        return out[:n_out]
