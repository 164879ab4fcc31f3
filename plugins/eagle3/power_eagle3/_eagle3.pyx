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

from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy
from libcpp.vector cimport vector

cimport numpy as cnp

from power_native.llama cimport LLAMA_PROCESS_TYPE_DECODE, llama_memory_seq_rm
from power_native.llama_ext cimport llama_get_embeddings_nextn, llama_get_embeddings_nextn_ith
from power_native._llama cimport (RC_CANCELLED, RC_OK, RC_OP_BATCH, RC_OP_DECODE, RC_OP_OUTPUT, BatchExt, Context,
                                  DRAFT_CUT, DRAFT_NO_ROW, draft_pick, process_timed, rc_raise, rc_status,
                                  rc_translate)

import numpy as np

from power_core.errors import CapacityError, RuntimeFault

cnp.import_array()

__all__ = ["Eagle3Draft", "draft_many"]

ctypedef const float * _row_p


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
    cdef readonly int64_t compute_ns  # ns inside llama.cpp calls this sequence took part in (shared passes too)
    cdef readonly int n_cells  # positions this sequence may use

    def __init__(self, Context ctx, int n_taps, int tap_width, int seq=0, int n_cells=0):
        if ctx is None:
            raise RuntimeFault("Eagle3Draft: no draft context")
        ctx._alive()
        self.ctx = ctx
        self.batch = BatchExt(ctx)
        self.seq = seq
        self.n_cells = n_cells or ctx.n_ctx
        self.compute_ns = 0
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
        if self.n_pos + n > self.n_cells:
            raise CapacityError(f"draft: positions up to {self.n_pos + n} overflow the sequence's {self.n_cells} cells")
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

    cdef int _process(self, bint encode) except -1:
        """Run this sequence's batch on the draft context, counted on its own compute clock too."""
        cdef int64_t t0 = self.ctx.compute_ns
        try:
            self.ctx.process_c(self.batch, encode)
        finally:
            self.compute_ns += self.ctx.compute_ns - t0
        return 0

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
                    # every row is an output (an encode outputs all; a row not marked so logs a warning)
                    rc = self.batch.add_embd_seq_c(&self.feats[off + j, 0], self.width, self.n_kv + j, self.seq, True)
                    if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                        break
            if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                self.batch._fail(rc, self.width, off + j)
            self._process(True)
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
                rc = self.batch.add_token_seq_c(self.toks[0], start - 1, self.seq, &self.pending[0], w, False)
                added += 1
            if rc_translate(RC_OP_BATCH, rc) == RC_OK:
                for i in range(m - 1):
                    rc = self.batch.add_token_seq_c(self.toks[i + 1], start + i, self.seq, &self.g[i, 0], w, False)
                    if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                        break
                    added += 1
        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
            self.batch._fail(rc, w, i)
        if added:
            self._process(False)
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

    def release(self) -> None:
        """Free this sequence's KV rows (its proposer is done; the context may live on for the others).
        A no-op once the context is closed."""
        if self.ctx.ptr != NULL:
            llama_memory_seq_rm(self.ctx.mem, self.seq, 0, -1)
        self.n_kv = 0
        self.n_pos = 0
        self.staged = False

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
        self.trim(n_kv)  # rows the KV lost since (a failed draft's boundary row) stay lost: the bridge rewrites them
        self.n_pos = n_pos
        self.pending[:] = src
        self.staged = False

    def draft(self, int anchor, int k, float p_min=0.0):
        """At most ``k`` ids after ``anchor`` (:func:`draft_many` for this sequence alone)."""
        return draft_many([self], [anchor], [k], [p_min])[0][0]


def draft_many(list drafts, anchors, ks, p_mins) -> tuple:
    """One draft per sequence of a shared draft context, every step one decode of all the sequences
    still drafting (llama.cpp's ``draft()`` over its slots): for each, ``(anchor, pending)`` at its
    ``pending_pos``, then each id with the decoder's own pre-norm row; an id whose top-10 softmax is
    below its ``p_min`` ends that draft (not proposed), as does its ``k``-th id. Each id is the first
    maximum of its row, read on the host, or sampled in the graph on a context of one sequence with
    ``ctx.set_greedy(True)`` (only when ``p_min`` is 0). Afterwards each sequence's KV keeps its boundary
    row and nothing after it, also when a decode fails. Each draft's compute clock counts every pass it
    took part in. Rows are addressed by sequence and position, so a sequence's ids are its solo ids.
    Returns (ids per draft, decode passes run)."""
    cdef Py_ssize_t n = len(drafts), i
    if n == 0:
        return [], 0
    cdef Eagle3Draft d0 = drafts[0], d
    cdef Context ctx = d0.ctx
    ctx._alive()
    # per-ask state in C vectors (a solo draft's host cost is a few of these, not numpy arrays)
    cdef vector[int32_t] pos0 = vector[int32_t](n), tok = vector[int32_t](n), kk = vector[int32_t](n)
    cdef vector[int32_t] seq = vector[int32_t](n), n_out = vector[int32_t](n), n_pass = vector[int32_t](n)
    cdef vector[int32_t] row = vector[int32_t](n), active = vector[int32_t](n)
    cdef vector[float] pm = vector[float](n)
    cdef vector[int64_t] comp = vector[int64_t](n)
    cdef vector[_row_p] hp = vector[_row_p](n)
    cdef int max_k = 1, n_active = 0
    for i in range(n):
        max_k = max(max_k, <int>ks[i])
    cdef cnp.ndarray[int32_t, ndim=2] out = np.empty((n, max_k), dtype=np.int32)
    for i in range(n):
        d = drafts[i]
        if d.ctx is not ctx:
            raise RuntimeFault("draft_many: the drafts do not share one draft context")
        kk[i] = int(ks[i])
        pm[i] = float(p_mins[i])
        tok[i] = int(anchors[i])
        seq[i] = d.seq
        pos0[i] = d.n_pos - 1
        if kk[i] <= 0 or d.n_pos == 0:
            continue
        if pos0[i] + kk[i] > d.n_cells:
            raise CapacityError(f"EAGLE3 draft: positions up to {pos0[i] + kk[i]} overflow the sequence's "
                                f"{d.n_cells} cells")
        if tok[i] < 0 or tok[i] >= d.n_vocab:
            raise CapacityError(f"EAGLE3 draft: anchor {tok[i]} outside [0, {d.n_vocab})")
        hp[i] = &d.pending[0]
        active[i] = 1
        n_active += 1
    cdef BatchExt batch = d0.batch
    cdef int32_t rc = 0, best
    cdef rc_status st
    st.op = RC_OP_DECODE
    st.rc = 0
    cdef const float * h
    cdef size_t w = d0.n_embd
    cdef int nv = d0.n_vocab
    cdef int * abort_flag = ctx.abort_flag
    cdef bint greedy = ctx.greedy
    cdef int64_t dt
    for i in range(n):
        if active[i]:
            llama_memory_seq_rm(ctx.mem, seq[i], pos0[i], -1)
    try:
        with nogil:
            while n_active > 0:
                batch.clear_c()
                for i in range(n):
                    if active[i]:
                        rc = batch.add_token_seq_c(tok[i], pos0[i] + n_pass[i], seq[i], hp[i], w, True)
                        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                            break
                        row[i] = rc
                if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                    st.op = RC_OP_BATCH
                    st.rc = rc
                    break
                st.rc = process_timed(ctx, LLAMA_PROCESS_TYPE_DECODE, batch.ptr, &dt)
                if rc_translate(st.op, st.rc) != RC_OK:
                    break
                for i in range(n):
                    if not active[i]:
                        continue
                    n_pass[i] += 1
                    comp[i] += dt
                    h = llama_get_embeddings_nextn_ith(ctx.ptr, row[i])
                    best = draft_pick(ctx.ptr, row[i], greedy, nv, pm[i])
                    if h == NULL or best == DRAFT_NO_ROW:
                        st.op = RC_OP_OUTPUT
                        st.rc = -1
                        break
                    hp[i] = h
                    if best == DRAFT_CUT:
                        active[i] = 0  # the pass ran; its id is not proposed
                        n_active -= 1
                        continue
                    tok[i] = best
                    out[i, n_out[i]] = best
                    n_out[i] += 1
                    if n_out[i] == kk[i]:
                        active[i] = 0
                        n_active -= 1
                if st.rc != 0:
                    break
        if rc_translate(st.op, st.rc) != RC_OK:
            if st.op == RC_OP_DECODE and rc_translate(st.op, st.rc) == RC_CANCELLED:
                abort_flag[0] = 0
            rc_raise(st.op, st.rc, "EAGLE3 draft pass")
    finally:
        batch.clear_c()
        for i in range(n):
            d = drafts[i]
            if kk[i] <= 0 or d.n_pos == 0:
                continue
            d.passes += n_pass[i]
            d.compute_ns += comp[i]
            # the boundary row stays (llama-speculative-simple trims the draft to the target's length)
            llama_memory_seq_rm(ctx.mem, seq[i], pos0[i] + 1 if n_pass[i] else pos0[i], -1)
            d.n_kv = pos0[i] + 1 if n_pass[i] else min(d.n_kv, pos0[i])
    cdef int passes = 0
    for i in range(n):
        passes = max(passes, n_pass[i])
    return [out[i, :n_out[i]] for i in range(n)], passes
