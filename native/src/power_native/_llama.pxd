# cython: language_level=3
"""The owning wrappers of ``_llama.pyx``, declared so plugin packages can ``cimport`` them and
reach the raw pointers (``Model.ptr``, ``Context.ptr``) for calls Power does not wrap."""

from libc.math cimport expf
from libc.stdint cimport int32_t, int64_t
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from power_native.llama cimport (gguf_context, llama_batch, llama_batch_ext, llama_context, llama_get_logits_ith,
                                  llama_get_sampled_token_ith, llama_memory_t, llama_model, llama_process,
                                  llama_process_type, llama_synchronize, llama_vocab)


# -- return codes: the one translation of every native path ------------------------------------------
# GIL-free code records what failed in an ``rc_status`` (or keeps the raw code) and, once it holds the
# GIL again, hands it to ``rc_raise``, which raises the typed exception (nothing when ``rc_translate``
# says ``RC_OK``). ``rc_translate`` is the table; it needs no GIL.

cdef enum rc_op:
    RC_OP_DECODE      # llama_decode / llama_process: 0 ok, 1 no memory slot, 2 aborted, -1 invalid, else fatal
    RC_OP_BATCH       # BatchExt.add_token_c / add_embd_c: >= 0 the entry index, -1 full, -4 embedding width
                      # rejected, -6 more outputs than n_outputs_max, else refused
    RC_OP_OUTPUT      # a decode's output row (logits / hidden): 0 present, else missing
    RC_OP_STATE_GET   # llama_state_seq_get_data_ext: the short byte count (called only when short)
    RC_OP_STATE_SET   # llama_state_seq_set_data_ext: 0 ok, else not loaded
    RC_OP_MODEL_LOAD  # llama_model_load_from_file: 0 ok, else NULL
    RC_OP_CONTEXT     # llama_init_from_model: 0 ok, else NULL

cdef enum rc_kind:
    RC_OK
    RC_NO_SLOT        # CapacityError
    RC_CANCELLED      # Cancelled
    RC_INVALID        # RuntimeFault
    RC_FATAL          # RuntimeFault
    RC_BATCH_FULL     # CapacityError
    RC_BATCH_WIDTH    # CapacityError
    RC_BATCH_OUTPUTS  # CapacityError
    RC_NO_OUTPUT      # RuntimeFault
    RC_STATE_LOST     # StateLost
    RC_LOAD_FAILED    # ArtifactError
    RC_NO_CONTEXT     # CapacityError

cdef struct rc_status:
    rc_op op
    long rc

cdef rc_kind rc_translate(rc_op op, long rc) noexcept nogil
cdef int rc_raise(rc_op op, long rc, str what) except -1


cdef class Model:
    cdef llama_model * ptr
    cdef const llama_vocab * vocab
    cdef readonly str path
    cdef readonly int n_vocab
    cdef readonly bint load_mtp
    cdef readonly bint mrope
    cdef gguf_context * _meta
    cdef object __weakref__
    cdef _bind(self, llama_model * ptr, str path, bint load_mtp)
    cdef llama_model * _p(self) except NULL
    cdef const llama_vocab * _v(self) except NULL
    cdef int _check_token(self, int token) except -1


cdef class _CtxOwner:
    # owns one llama_context (and its abort flags: [0] asked, [1] held): freed when the last holder goes — the Context,
    # a zero-copy view of its buffers, a batch bound to it, or a context created with it as ctx_other
    cdef llama_context * ptr
    cdef int * abort_flag
    cdef void * sampler  # the in-graph greedy sampler chain attached to seq 0 (llama_sampler *), or NULL
    cdef object model
    cdef object other


cdef inline int64_t clock_ns() noexcept nogil:
    """CLOCK_MONOTONIC in ns (ggml_time_us's clock): the compute clock around every llama.cpp decode
    call (``Context.compute_ns``; plugins that call ``llama_process`` themselves add to it too)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef class Context:
    cdef llama_context * ptr
    cdef llama_memory_t mem
    cdef llama_batch batch
    cdef bint has_batch
    cdef int * abort_flag
    cdef readonly Model model
    cdef readonly object ctx_other
    cdef readonly int n_ctx, n_batch, n_ubatch, n_rs_seq, n_outputs_max, n_vocab, ctx_type
    cdef readonly int n_outputs
    cdef readonly bint recurrent
    cdef set _layer_taps
    cdef bint _nextn_tap
    cdef bint _nextn_masked
    cdef int _last_n_tokens
    cdef int _inflight  # decodes running without the GIL (close() refuses meanwhile)
    cdef readonly int64_t compute_ns  # monotonic ns inside llama_decode/llama_process (+ synchronize)
    cdef readonly int64_t passes  # llama_decode/llama_process calls made through its methods or process_timed
    cdef object __weakref__
    cdef _CtxOwner _owner
    cdef int _alive(self) except -1
    cdef object _view(self, float * ptr, int rows, int cols)
    cdef int process_c(self, BatchExt batch, bint encode) except -1
    cdef int _run_batch(self, int32_t n, int32_t n_out) except -1
    cdef object _output_rows(self, int32_t n, int32_t n_out, str what)


cdef class BatchExt:
    cdef llama_batch_ext * ptr
    cdef readonly Context ctx
    cdef _CtxOwner _owner
    cdef readonly int capacity, n_tokens, n_outputs, n_pos_per_embd
    cdef void clear_c(self) noexcept nogil
    cdef int32_t add_token_c(self, int32_t token, int32_t pos, const float * row, size_t width,
                             bint output) noexcept nogil
    cdef int32_t add_token_seq_c(self, int32_t token, int32_t pos, int32_t seq, const float * row, size_t width,
                                 bint output) noexcept nogil
    cdef int32_t add_embd_c(self, const float * row, size_t width, int32_t pos, bint output) noexcept nogil
    cdef int32_t add_embd_seq_c(self, const float * row, size_t width, int32_t pos, int32_t seq,
                                bint output) noexcept nogil
    cdef object _outputs(self, outputs, Py_ssize_t n)
    cdef int _fail(self, int32_t rc, size_t width, int32_t start) except -1


cdef inline int32_t process_timed(Context ctx, llama_process_type kind, llama_batch_ext * batch,
                                  int64_t * dt) noexcept nogil:
    """One ``llama_process`` of ``batch`` on ``ctx``, as every GIL-free decode loop runs it (``Context.process``
    and the plugins' draft loops): 2 (llama.cpp's abort code) without running when the context's abort
    flag is up, else the call's code. The call and its ``llama_synchronize`` are timed into ``dt`` (0 when it
    did not run) and counted on ``ctx.compute_ns`` and ``ctx.passes``."""
    cdef int32_t rc
    cdef int64_t t0
    dt[0] = 0
    if ctx.abort_flag[0] and not ctx.abort_flag[1]:
        return 2
    t0 = clock_ns()
    rc = llama_process(ctx.ptr, kind, batch)
    llama_synchronize(ctx.ptr)
    dt[0] = clock_ns() - t0
    ctx.compute_ns += dt[0]
    ctx.passes += 1
    return rc


# -- a logits row's first maximum and the values above a bound, vectorized (SSE2) -------------------------
cdef extern from *:
    """
    #if defined(__SSE2__) && defined(__GNUC__)
    #include <emmintrin.h>
    #endif
    /* The index of the first maximum of row[0..n), n >= 1: what the scalar loop
       `v = row[0]; for i: if (row[i] > v) { v = row[i]; best = i; }` returns (numpy's argmax tie rule; a NaN
       never compares greater, so a NaN row[0] gives 0). With SSE2 (every x86-64): the largest value by a
       branch-free max over 16 lanes, then the first index holding it: 18 us on a 152k-float row, where the
       scalar loop took 121-143 us (docs/evidence/bench_drafts/first-max-2026-12-07); the drafters read a
       vocabulary-sized row a draft step, for every drafting sequence. */
    static inline int power_row_first_max(const float * row, int n) {
        float v = row[0];
    #if defined(__SSE2__) && defined(__GNUC__)
        if (n >= 16) {
            /* _mm_max_ps(x, m) is `x > m ? x : m` exactly: the second operand when either is NaN or both
               are equal; four accumulators, so no one max waits on the one before it */
            __m128 m0 = _mm_set1_ps(v), m1 = m0, m2 = m0, m3 = m0;
            int c = 0;
            for (; c + 16 <= n; c += 16) {
                m0 = _mm_max_ps(_mm_loadu_ps(row + c), m0);
                m1 = _mm_max_ps(_mm_loadu_ps(row + c + 4), m1);
                m2 = _mm_max_ps(_mm_loadu_ps(row + c + 8), m2);
                m3 = _mm_max_ps(_mm_loadu_ps(row + c + 12), m3);
            }
            float lanes[16];
            _mm_storeu_ps(lanes, m0);
            _mm_storeu_ps(lanes + 4, m1);
            _mm_storeu_ps(lanes + 8, m2);
            _mm_storeu_ps(lanes + 12, m3);
            for (int k = 0; k < 16; k++) if (lanes[k] > v) v = lanes[k];
            for (; c < n; c++) if (row[c] > v) v = row[c];
            if (v != v) return 0;  /* row[0] is NaN: nothing compared greater */
            const __m128 vv = _mm_set1_ps(v);
            for (c = 0; c + 16 <= n; c += 16) {  /* 16 at a time, then the 4 that hold it */
                const __m128 e0 = _mm_cmpeq_ps(_mm_loadu_ps(row + c), vv);
                const __m128 e1 = _mm_cmpeq_ps(_mm_loadu_ps(row + c + 4), vv);
                const __m128 e2 = _mm_cmpeq_ps(_mm_loadu_ps(row + c + 8), vv);
                const __m128 e3 = _mm_cmpeq_ps(_mm_loadu_ps(row + c + 12), vv);
                if (_mm_movemask_ps(_mm_or_ps(_mm_or_ps(e0, e1), _mm_or_ps(e2, e3)))) break;
            }
            for (; c + 4 <= n; c += 4) {
                const int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(row + c), vv));
                if (hit) return c + __builtin_ctz(hit);
            }
            for (; c < n; c++) if (row[c] == v) return c;
            return 0;
        }
    #endif
        int best = 0;
        for (int i = 1; i < n; i++) if (row[i] > v) { v = row[i]; best = i; }
        return best;
    }
    /* The first index i >= `from` with row[i] > t (a NaN never is), else n: what a scalar scan finds, 16 floats a
       compare where SSE2 is there. */
    static inline int power_row_next_above(const float * row, int from, int n, float t) {
        int i = from;
    #if defined(__SSE2__) && defined(__GNUC__)
        const __m128 tt = _mm_set1_ps(t);
        for (; i + 16 <= n; i += 16) {
            const __m128 g = _mm_or_ps(_mm_or_ps(_mm_cmpgt_ps(_mm_loadu_ps(row + i), tt),
                                                 _mm_cmpgt_ps(_mm_loadu_ps(row + i + 4), tt)),
                                       _mm_or_ps(_mm_cmpgt_ps(_mm_loadu_ps(row + i + 8), tt),
                                                 _mm_cmpgt_ps(_mm_loadu_ps(row + i + 12), tt)));
            if (_mm_movemask_ps(g)) break;
        }
    #endif
        for (; i < n; i++) if (row[i] > t) return i;
        return n;
    }
    """
    int power_row_first_max(const float * row, int n) noexcept nogil
    int power_row_next_above(const float * row, int start, int n, float t) noexcept nogil


# -- llama.cpp's draft sampler confidence (``common/speculative.cpp``: top-k(10), ``p_min``) -------------------
cdef enum:
    DRAFT_TOP_K = 10


cdef inline float draft_top_p(const float * row, int n) noexcept nogil:
    """Softmax probability of the row's maximum among its ``DRAFT_TOP_K`` largest logits: llama.cpp's
    drafters (draft-mtp, draft-eagle3) sample with top-k(10) and cut a draft where that first candidate's
    ``p`` falls below ``--spec-draft-p-min`` (``1 / sum(exp(l_i - l_max))`` over the ten, in descending
    order)."""
    cdef float top[DRAFT_TOP_K]
    cdef int m = 0, i = 0, j
    cdef float v, s = 0
    while i < n:
        if m == DRAFT_TOP_K:  # full: only a value above the tenth enters (the next one, SIMD-scanned)
            i = power_row_next_above(row, i, n, top[DRAFT_TOP_K - 1])
            if i >= n:
                break
            j = DRAFT_TOP_K - 1
        else:
            j = m
            m += 1
        v = row[i]
        while j > 0 and top[j - 1] < v:
            top[j] = top[j - 1]
            j -= 1
        top[j] = v
        i += 1
    for i in range(m):
        s += expf(top[i] - top[0])
    return 1.0 / s


cdef enum:
    DRAFT_NO_ROW = -1  # draft_pick: the pass left no output for the row
    DRAFT_CUT = -2     # draft_pick: the id's confidence is below p_min; the draft stops before it


cdef inline int32_t draft_pick(llama_context * ctx, int32_t row, bint in_graph, int n_ids,
                               float p_min) noexcept nogil:
    """A greedy drafter's id for output ``row`` of the last pass: the id sampled in the draft's graph
    (``in_graph``: Power's first-maximum sampler attached, and no ``p_min`` to read the logits for), else the
    first maximum of the row's first ``n_ids`` logits; ``DRAFT_CUT`` when its top-10 softmax is below
    ``p_min`` (llama.cpp's draft-mtp and draft-eagle3 cut), ``DRAFT_NO_ROW`` when the row is missing."""
    cdef const float * logits
    cdef int32_t best
    if in_graph and p_min <= 0:
        best = llama_get_sampled_token_ith(ctx, row)
        return best if best >= 0 else DRAFT_NO_ROW
    logits = llama_get_logits_ith(ctx, row)
    if logits == NULL:
        return DRAFT_NO_ROW
    best = power_row_first_max(logits, n_ids)
    if p_min > 0 and draft_top_p(logits, n_ids) < p_min:
        return DRAFT_CUT
    return best

