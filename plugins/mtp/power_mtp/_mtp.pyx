# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# distutils: language = c++
"""The MTP draft head on llama.cpp (DRAFT_MTP of ``common/speculative.cpp``), GIL-free per token.

A second context of type ``LLAMA_CONTEXT_TYPE_MTP`` on the target's own model runs the nextn
block. Its KV is filled from every target batch with pairs ``(token_k, h_{k-1})`` (the target's
unmasked ``h_nextn`` row of the previous token; the first token of a batch pairs with the row
carried over from the previous batch, ``pending``). A draft decodes ``(anchor, pending)`` and then
feeds back the head's own hidden row, greedily, one token per pass.

The context may hold several sequences (one per request of a shared-pass batch, llama.cpp's
``n_seq = n_parallel``): each :class:`MtpHead` is one sequence's state and addresses only its own
sequence and positions; :func:`draft_many` runs the draft steps of several heads in one pass each.
"""

from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy
from libcpp.vector cimport vector

cimport numpy as cnp

from power_native.llama cimport LLAMA_PROCESS_TYPE_DECODE, llama_memory_seq_rm
from power_native.llama_ext cimport llama_get_embeddings_nextn_ith
from power_native._llama cimport (RC_CANCELLED, RC_OK, RC_OP_BATCH, RC_OP_DECODE, RC_OP_OUTPUT, BatchExt,
                                  Context, DRAFT_CUT, DRAFT_NO_ROW, draft_pick, process_timed, rc_raise,
                                  rc_status, rc_translate)

import numpy as np

from power_core.errors import CapacityError, RuntimeFault

cnp.import_array()

__all__ = ["MtpHead", "draft_many"]


cdef class MtpHead:
    """Draft state of one request: its sequence of the MTP context, the boundary row and the last batch's rows."""

    cdef readonly Context ctx
    cdef BatchExt batch
    cdef readonly int seq  # its sequence in the context
    cdef readonly int cells  # the positions its sequence may hold
    cdef readonly int64_t compute_ns  # this sequence's compute: its own passes and its share of draft_many's
    cdef readonly int n_embd, n_vocab, fr
    cdef float[::1] pending
    cdef object pending_array  # the ndarray behind ``pending`` (its copy is a checkpoint's boundary row)
    cdef float[:, ::1] rows
    cdef int32_t[::1] toks
    cdef readonly bint staged  # the last observed batch is copied but not yet in the KV
    cdef readonly int deferred  # kept rows of the staged batch whose pairs the next draft pass decodes first
    cdef readonly int n_rows  # rows of the last observed batch
    cdef readonly int start  # position of that batch's first token
    cdef readonly int n_kv  # positions filled in the MTP KV (0..n_kv-1)
    cdef readonly long passes  # draft passes run

    def __init__(self, Context ctx, int fr, int seq=0, int cells=0):
        if ctx.ctx_type != 1:
            raise RuntimeFault("MtpHead: the context is not an MTP context (ctx_type=LLAMA_CONTEXT_TYPE_MTP)")
        self.ctx = ctx
        self.seq = seq
        self.cells = cells or ctx.n_ctx
        if self.cells > ctx.n_ctx:
            raise CapacityError(f"MtpHead: {self.cells} positions per sequence in a context of {ctx.n_ctx}")
        self.batch = BatchExt(ctx)
        self.n_embd = ctx.model.n_embd_out
        self.n_vocab = ctx.n_vocab
        if fr < 1 or fr > self.n_vocab:
            raise CapacityError(f"spec_mtp_fr_vocab_size={fr} outside [1, {self.n_vocab}]")
        self.fr = fr
        self.pending_array = np.zeros(self.n_embd, dtype=np.float32)
        self.pending = self.pending_array
        self.rows = np.zeros((ctx.n_batch, self.n_embd), dtype=np.float32)
        self.toks = np.zeros(ctx.n_batch, dtype=np.int32)
        self.reset()

    def reset(self) -> None:
        """A new request: its sequence emptied, zero boundary row (as llama.cpp starts a sequence)."""
        if not self.ctx.seq_rm(self.seq, 0, -1):
            raise RuntimeFault(f"MTP: llama_memory_seq_rm refused to empty sequence {self.seq}")
        self.pending[:] = 0
        self.n_rows = 0
        self.start = 0
        self.n_kv = 0
        self.staged = False
        self.deferred = 0

    def observe(self, tokens, h, bint defer=False) -> None:
        """One target batch (``tokens`` and their ``h_nextn`` rows) at positions ``n_kv..``.

        A prompt chunk fills the MTP KV at once. A verify pass is only staged (``defer``): its rows
        are copied and :meth:`keep` decodes the pairs of the kept tokens alone. llama.cpp decodes
        the whole verify batch and trims the rejected rows again; the kept rows are the same
        computation, and rejected ones cost nothing."""
        cdef const int32_t[::1] toks = np.ascontiguousarray(tokens, dtype=np.int32)
        cdef const float[:, ::1] hv = np.ascontiguousarray(h, dtype=np.float32)
        cdef int n = toks.shape[0]
        if n == 0:
            return
        if hv.shape[0] != n or hv.shape[1] != self.n_embd:
            raise RuntimeFault(f"MTP observe: {hv.shape[0]}x{hv.shape[1]} h_nextn rows for {n} tokens; expected "
                               f"{n}x{self.n_embd}")
        if n > self.rows.shape[0]:
            raise CapacityError(f"MTP observe: a batch of {n} tokens exceeds the MTP context batch {self.rows.shape[0]}")
        self.flush()  # a round that drafted nothing: the kept pairs of the last one go in first
        if self.n_kv + n > self.cells:
            raise CapacityError(f"MTP observe: positions up to {self.n_kv + n} overflow the context {self.cells}")
        cdef size_t w = self.n_embd
        with nogil:
            memcpy(&self.rows[0, 0], &hv[0, 0], n * w * sizeof(float))
            memcpy(&self.toks[0], &toks[0], n * sizeof(int32_t))
        self.start = self.n_kv
        self.n_rows = n
        self.staged = defer
        if not defer:
            self._fill(n)

    cdef int _add_fill(self, BatchExt batch, int m) except -1:
        """Add the pairs ``(token_i, h_{i-1})`` of the first ``m`` staged rows at ``start..`` of its
        sequence to ``batch`` (no outputs); the first pairs with the boundary row."""
        cdef int32_t rc = 0
        cdef int k = 0
        cdef size_t w = self.n_embd
        cdef const float * src
        with nogil:
            for k in range(m):
                if k == 0:
                    src = &self.pending[0]
                else:
                    src = &self.rows[k - 1, 0]
                rc = batch.add_token_seq_c(self.toks[k], self.start + k, self.seq, src, w, False)
                if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                    break
        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
            batch._fail(rc, w, k)
        return 0

    cdef void _filled(self, int m) noexcept:
        """The first ``m`` staged pairs are in the KV: the last row becomes the new boundary."""
        self.n_kv = self.start + m
        memcpy(&self.pending[0], &self.rows[m - 1, 0], self.n_embd * sizeof(float))
        self.staged = False
        self.deferred = 0

    cdef int _fill(self, int m) except -1:
        """Decode the first ``m`` staged pairs (:meth:`_add_fill`) in a pass of their own."""
        self.batch.clear_c()
        self._add_fill(self.batch, m)
        cdef int64_t before = self.ctx.compute_ns
        try:
            self.ctx.process_c(self.batch, False)
        except BaseException:
            llama_memory_seq_rm(self.ctx.mem, self.seq, self.start, -1)  # nothing half-decoded stays
            raise
        finally:
            self.compute_ns += self.ctx.compute_ns - before
        self._filled(m)
        return 0

    def flush(self) -> None:
        """Decode the deferred kept pairs now (they go first into whatever the head decodes next)."""
        if self.deferred:
            self._fill(self.deferred)

    def keep(self, int kept) -> None:
        """Keep the first ``kept`` tokens of the last observed batch and nothing after them; the
        boundary row becomes the last kept row. A staged verify pass's kept pairs are deferred: the
        next draft's first pass decodes them ahead of its anchor (:func:`draft_many`), or :meth:`flush`."""
        if not 0 < kept <= self.n_rows:
            raise RuntimeFault(f"MTP keep: {kept} rows of a {self.n_rows}-row batch")
        if self.staged:
            self.staged = False
            self.deferred = kept
        else:
            self.pending[:] = self.rows[kept - 1]
            self.trim(self.start + kept)

    def trim(self, int n_kv) -> None:
        """Drop MTP KV positions >= ``n_kv``."""
        if not self.ctx.seq_rm(self.seq, n_kv, -1):
            raise RuntimeFault(f"MTP: llama_memory_seq_rm refused to trim the draft KV to {n_kv}")
        self.n_kv = n_kv

    def state(self):
        """What a checkpoint needs: (n_kv, boundary row, the deferred pairs' tokens and rows or None)."""
        # ndarray.copy: np.array over the memoryview costs more
        if not self.deferred:
            return self.n_kv, self.pending_array.copy(), None, None
        m = self.deferred
        return (self.n_kv, self.pending_array.copy(), np.asarray(self.toks)[:m].copy(),
                np.asarray(self.rows)[:m].copy())

    def set_state(self, state) -> None:
        """Back to a :meth:`state`: the KV is trimmed (the draft chain, any observed rows after
        ``n_kv`` and deferred pairs decoded since go), the boundary row restored, and the pairs that
        were deferred then are deferred again. The last batch's rows stay readable otherwise: the
        next :meth:`keep` always follows a new :meth:`observe`, except in the prefill round, whose
        rows no later batch has replaced."""
        n_kv, pending, toks, rows = state
        cdef const float[::1] src = np.ascontiguousarray(pending, dtype=np.float32)
        if src.shape[0] != self.n_embd:
            raise RuntimeFault(f"MTP set_state: a boundary row of {src.shape[0]} values; expected {self.n_embd}")
        self.trim(n_kv)
        self.pending[:] = src
        self.staged = False
        self.deferred = 0
        if toks is not None:
            m = len(toks)
            np.asarray(self.toks)[:m] = toks
            np.asarray(self.rows)[:m] = rows
            self.start = n_kv
            self.n_rows = max(self.n_rows, m)
            self.deferred = m

    def draft(self, int anchor, int k, float p_min=0.0):
        """Greedy ``k`` tokens after ``anchor`` (at position ``n_kv``), each pass feeding back the
        head's own hidden row, cut where an id's top-10 softmax falls below ``p_min``; the draft rows
        are removed from the KV afterwards (:func:`draft_many` for this head alone)."""
        if k <= 0:
            return np.empty(0, dtype=np.int32)
        return draft_many([self], [anchor], [k], [p_min])[0][0]


def _seq_of(MtpHead head):
    return head.seq


def draft_many(list heads, anchors, ks, p_mins):
    """One greedy draft per head of one context (llama.cpp's draft-mtp ``draft()`` over its slots): draft
    step ``i`` decodes, in one pass, token ``i`` of every head still drafting, each at its own sequence and
    position with its own hidden row (``pending``, then the head's own row of the previous step), and reads
    each head's rows by the index its entry got in that pass. A head stops after its ``k``-th id, or at the
    first id whose top-10 softmax is below its ``p_min`` (that id is not proposed): it leaves the batch
    early. Each id is the first maximum of the head's row (ids below its FR size), read on the host, or
    sampled in the graph by Power's first-maximum sampler when the context has one (``ctx.set_greedy``,
    a context of one sequence) and ``p_min`` is 0. Returns one id array per head, each what the head
    drafts alone (one KV stream per sequence and batch-invariant kernels: the same rows), and the number
    of passes run. Every head's draft chain leaves its KV again, also on a failure; each head's
    ``compute_ns`` and ``passes`` gain the passes it took part in.

    The first step's pass also carries each head's deferred kept pairs (:meth:`MtpHead.keep`), ahead of its
    anchor and without outputs: llama.cpp decodes them in a pass of their own (its ``process`` hook), and
    Power's one pass gives the anchor's row the same bits (batch-invariant kernels; the pairs' KV is
    written before the anchor attends to it). The anchor's hidden row is then the last kept pair's, the
    boundary row those pairs leave. Once that pass ran, the pairs stay in the KV as :meth:`MtpHead.flush`
    would have left them (whatever the later steps do); if it failed, they leave the KV and stay deferred."""
    cdef Py_ssize_t n = len(heads), j
    if n == 0:
        return [], 0
    cdef MtpHead head, first = heads[0]
    cdef Context ctx = first.ctx
    ctx._alive()  # a closed context raises instead of reaching llama.cpp with NULL
    cdef vector[int32_t] tok, kk, pos0, seqs, fr, idx, n_out, n_pass, order, fill
    cdef vector[float] pm
    cdef vector[const float *] h
    cdef vector[int32_t *] out
    cdef vector[int64_t] spent
    cdef list result = []
    cdef cnp.ndarray[int32_t, ndim=1] arr
    cdef int n_active = n
    cdef set seen = set()
    cdef int m
    for j in range(n):
        head = heads[j]
        if head.ctx is not ctx:
            raise RuntimeFault("MTP draft_many: the heads belong to different contexts")
        if n > 1:
            if head.seq in seen:
                raise RuntimeFault(f"MTP draft_many: sequence {head.seq} asked twice in one draft pass")
            seen.add(head.seq)
        a, k = int(anchors[j]), int(ks[j])
        m = head.deferred  # kept pairs at n_kv.., decoded by the first step's pass
        if k < 1:
            raise CapacityError(f"MTP draft_many: head {j} asks for {k} tokens; ask only heads that draft")
        if head.n_kv + m + k > head.cells:
            raise CapacityError(f"MTP draft: positions up to {head.n_kv + m + k} overflow the context {head.cells}")
        if a < 0 or a >= head.n_vocab:
            raise CapacityError(f"MTP draft: anchor {a} outside [0, {head.n_vocab})")
        arr = np.empty(k, dtype=np.int32)
        result.append(arr)
        out.push_back(&arr[0])
        tok.push_back(a)
        kk.push_back(k)
        pos0.push_back(head.n_kv + m)
        seqs.push_back(head.seq)
        fr.push_back(head.fr)
        pm.push_back(float(p_mins[j]))
        h.push_back(&head.rows[m - 1, 0] if m else &head.pending[0])
        fill.push_back(m)
        idx.push_back(-1)
        n_out.push_back(0)
        n_pass.push_back(0)
        spent.push_back(0)
    # entries in sequence order: llama.cpp cuts a pass of one-stream-per-sequence KV into ubatches at every
    # sequence id that is not the previous one + 1 (each ubatch a graph of its own)
    if n == 1:
        order.push_back(0)
    else:
        for j in sorted(range(n), key=[_seq_of(x) for x in heads].__getitem__):
            order.push_back(j)
    cdef BatchExt batch = first.batch
    cdef size_t w = first.n_embd
    cdef int i = 0, best
    cdef Py_ssize_t q
    cdef int32_t rc = 0
    cdef rc_status st
    st.op = RC_OP_DECODE
    st.rc = 0
    cdef int * abort_flag = ctx.abort_flag
    cdef bint in_graph = ctx.greedy
    cdef int64_t t0
    cdef int64_t passes0 = ctx.passes
    cdef int passes = 0
    cdef bint filled = False  # the first step's pass ran (its deferred pairs are in the KV)
    try:
        batch.clear_c()
        for q in range(n):  # the first step's pass: each head's deferred pairs, then its anchor
            j = order[q]
            if fill[j]:
                (<MtpHead>heads[j])._add_fill(batch, fill[j])
        with nogil:
            while n_active > 0:
                if i > 0:
                    batch.clear_c()
                for q in range(n):
                    j = order[q]
                    idx[j] = -1
                    if n_out[j] == i and i < kk[j]:  # still drafting (not cut, not done)
                        rc = batch.add_token_seq_c(tok[j], pos0[j] + i, seqs[j], h[j], w, True)
                        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                            st.op = RC_OP_BATCH
                            st.rc = rc
                            break
                        idx[j] = rc
                if st.op == RC_OP_BATCH:
                    break
                st.rc = process_timed(ctx, LLAMA_PROCESS_TYPE_DECODE, batch.ptr, &t0)
                for j in range(n):
                    if idx[j] >= 0:
                        spent[j] += t0
                        n_pass[j] += 1
                if rc_translate(st.op, st.rc) != RC_OK:
                    break
                filled = True
                for j in range(n):
                    if idx[j] < 0:
                        continue
                    h[j] = llama_get_embeddings_nextn_ith(ctx.ptr, idx[j])
                    best = draft_pick(ctx.ptr, idx[j], in_graph, fr[j], pm[j])
                    if h[j] == NULL or best == DRAFT_NO_ROW:
                        st.op = RC_OP_OUTPUT
                        st.rc = -1
                        break
                    if best == DRAFT_CUT:
                        n_active -= 1  # the pass ran; its id is not proposed
                        continue
                    tok[j] = best
                    out[j][i] = best
                    n_out[j] += 1
                    if n_out[j] == kk[j]:
                        n_active -= 1
                if st.op == RC_OP_OUTPUT:
                    break
                i += 1
        if rc_translate(st.op, st.rc) != RC_OK:
            if st.op == RC_OP_DECODE and rc_translate(st.op, st.rc) == RC_CANCELLED:
                abort_flag[0] = 0
            rc_raise(st.op, st.rc, f"MTP draft pass {i}")
    finally:
        batch.clear_c()
        passes = <int>(ctx.passes - passes0)  # the passes that ran (process_timed counts them)
        for j in range(n):
            head = heads[j]
            head.compute_ns += spent[j]
            head.passes += n_pass[j]
            if fill[j] and filled:  # the first step's pass ran: its deferred pairs are in the KV
                head._filled(fill[j])
            # no draft chain stays in any KV (nor pairs whose pass failed: they stay deferred)
            llama_memory_seq_rm(ctx.mem, seqs[j], head.n_kv, -1)
    return [result[j] if n_out[j] == kk[j] else result[j][:n_out[j]] for j in range(n)], passes
