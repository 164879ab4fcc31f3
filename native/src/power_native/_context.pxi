# Context: one owned llama_context with its reusable batch (decode, logits, memory, state, taps).
# Included by _llama.pyx (one extension module); split by area to keep files small.

@cython.no_gc  # it refers only to a Model and other owners, never in a cycle: the collector must not
# clear ``model`` before ``__dealloc__`` frees the context (llama_free reads the model)
cdef class _CtxOwner:
    """Owner of one ``llama_context``; see ``_llama.pxd``. Never exposed."""

    def __cinit__(self):
        self.ptr = NULL
        self.sampler = NULL
        self.abort_flag = <int *>calloc(2, sizeof(int))  # [0] asked, [1] held (Context.hold_abort)
        if self.abort_flag == NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef llama_context * ptr = self.ptr
        self.ptr = NULL
        if ptr != NULL:
            with nogil:  # see Model.__dealloc__: ggml-rpc's thread may need the GIL to log meanwhile
                llama_free(ptr)
        if self.sampler != NULL:  # after the context: it held the chain
            llama_sampler_free(<llama_sampler *>self.sampler)
            self.sampler = NULL
        if self.abort_flag != NULL:
            free(self.abort_flag)
            self.abort_flag = NULL


#: config ``flash_attn`` -> llama.cpp's flash_attn_type (``auto``: llama.cpp decides per device)
_FLASH_ATTN = {"auto": LLAMA_FLASH_ATTN_TYPE_AUTO, "on": LLAMA_FLASH_ATTN_TYPE_ENABLED,
               "off": LLAMA_FLASH_ATTN_TYPE_DISABLED}


cdef class Context:
    """A ``llama_context`` with one reusable batch of ``n_batch`` tokens (sequence ids 0..n_seq_max-1).

    Lifetimes: :meth:`close` (or collection) ends this object's use of the context — every later
    call raises :class:`RuntimeFault` — but the llama.cpp memory is freed only when nothing uses it
    any more: zero-copy views from :meth:`logits` and the taps, a :class:`BatchExt` bound to it and a
    context created with it as ``ctx_other`` keep it alive, so no view ever reads freed memory."""

    def __cinit__(self):
        self.ptr = NULL
        self.has_batch = False
        self._owner = _CtxOwner()
        self.abort_flag = self._owner.abort_flag
        self._layer_taps = set()

    def __dealloc__(self):
        if self.has_batch:
            llama_batch_free(self.batch)
            self.has_batch = False
        self.ptr = NULL  # the owner frees the context when its last holder goes

    def __init__(self, Model model, *, int n_ctx, int n_batch, int n_ubatch=0, int n_rs_seq=0,
                 n_threads=None, int n_outputs_max=0, int ctx_type=0, Context ctx_other=None,
                 bint embeddings=False, bint swa_full=True, int n_seq_max=1, str flash_attn="auto",
                 kv_unified=None):
        if self.ptr != NULL or self._owner is None:
            raise RuntimeFault("Context: already initialised")
        if model is None or model.ptr == NULL:
            raise RuntimeFault("Context: no loaded model (use Model.load)")
        if ctx_other is not None:
            ctx_other._alive()
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
        if flash_attn not in _FLASH_ATTN:
            raise ConfigError("flash_attn", flash_attn, "one of 'auto', 'on', 'off'")
        cdef llama_context_params p = llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_ubatch
        p.n_seq_max = n_seq_max
        p.n_rs_seq = n_rs_seq
        p.n_outputs_max = n_outputs_max
        p.n_outputs_max_per_seq = 0  # = n_outputs_max: every verify row may be sampled in the graph (set_greedy)
        threads = n_threads or os.cpu_count() or 1
        p.n_threads = threads
        p.n_threads_batch = threads
        p.ctx_type = <llama_context_type>ctx_type
        p.embeddings = embeddings
        p.swa_full = swa_full
        if kv_unified is not None:  # False (llama.cpp's default): one KV stream per sequence
            p.kv_unified = bool(kv_unified)
        p.flash_attn_type = <llama_flash_attn_type><int>_FLASH_ATTN[flash_attn]
        p.no_perf = True
        p.abort_callback = power_abort_cb
        p.abort_callback_data = <void *>self.abort_flag
        p.ctx_other = ctx_other.ptr if ctx_other is not None else NULL
        cdef llama_context * ctx
        _errors.clear()
        with nogil:
            ctx = llama_init_from_model(model.ptr, p)
        if ctx == NULL:
            rc_raise(RC_OP_CONTEXT, -1, None)
        self.ptr = ctx
        self._owner.ptr = ctx
        llama_set_graph_cache(ctx, True)  # see set_graph_cache
        self._owner.model = model
        self._owner.other = ctx_other._owner if ctx_other is not None else None
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
        """End this context (idempotent): later calls raise; its memory is freed now unless a view,
        a batch or a context on top of it still holds it (then when the last of them goes). Refused
        (:class:`RuntimeFault`) while another thread's decode runs on it: cancel it and wait first."""
        if self._inflight:
            raise RuntimeFault("the llama context is decoding in another thread; cancel that request and wait "
                               "for it to end before closing")
        if self.has_batch:
            llama_batch_free(self.batch)
            self.has_batch = False
        self.ptr = NULL
        self.mem = NULL
        self.abort_flag = NULL  # the owner's; it may go with the owner
        self._owner = None

    cdef int _alive(self) except -1:
        if self.ptr == NULL:
            raise RuntimeFault("the llama context is closed")
        return 0

    def memory(self) -> dict:
        """Bytes this context holds, per buffer type (``"CPU"``, a device's): ``model`` (its model's
        weights; a context on another context's model, as an MTP head's, counts them again),
        ``context`` (KV cells, recurrent states and their snapshots) and ``compute`` (the scheduler's
        compute buffers, as large as the widest pass so far needed)."""
        self._alive()
        cdef cpp_map[ggml_backend_buffer_type_t, llama_memory_breakdown_data] mb = llama_get_memory_breakdown(self.ptr)
        out = {}
        for item in mb:
            name = ggml_backend_buft_name(item.first).decode("utf-8", "replace")
            part = out.setdefault(name, {"model": 0, "context": 0, "compute": 0})
            part["model"] += item.second.model
            part["context"] += item.second.context
            part["compute"] += item.second.compute
        return out

    @property
    def graphs_reused(self) -> int:
        """How many ubatches so far ran on the previous ubatch's compute graph (llama.cpp's ``graphs
        reused``): a pass of one shape after another of that shape reuses it, while a pass llama.cpp cuts
        into several ubatches (sequences out of order on one KV stream each) rebuilds a graph per ubatch."""
        self._alive()
        return llama_perf_context(self.ptr).n_reused

    # -- decoding ------------------------------------------------------------------------------------
    cdef int _run_batch(self, int32_t n, int32_t n_out) except -1:
        """``llama_decode`` of the filled ``self.batch`` (``n`` tokens, ``n_out`` output rows) with the GIL
        released, timed into ``compute_ns`` and counted in ``passes``; an abort raised before it started
        runs nothing (llama.cpp's code 2, and the flag is consumed so the next decode runs). The one
        decode path of :meth:`decode` and :meth:`decode_multi`; typed errors through ``rc_raise``."""
        cdef llama_context * ctx = self.ptr
        cdef int32_t rc
        cdef int64_t t0
        _errors.clear()
        if self.abort_flag[0] and not self.abort_flag[1]:
            rc = 2  # cancelled before it started: nothing reaches the memory
        else:
            self._inflight += 1
            try:
                with nogil:
                    t0 = clock_ns()
                    rc = llama_decode(ctx, self.batch)
                    llama_synchronize(ctx)
                    self.compute_ns += clock_ns() - t0
                    self.passes += 1
            finally:
                self._inflight -= 1
        self.n_outputs = 0
        if rc_translate(RC_OP_DECODE, rc) == RC_CANCELLED:
            self.abort_flag[0] = 0  # consumed: the next decode runs
        rc_raise(RC_OP_DECODE, rc, None)
        self.n_outputs = n_out
        self._last_n_tokens = n
        return 0

    def decode(self, tokens, int pos0, int seq_id=0, bint all_outputs=True) -> int:
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
        self._run_batch(n, n_out)
        return n_out

    def decode_multi(self, tokens, pos, seq_ids, outputs):
        """Decode one batch holding tokens of several sequences (``tokens[i]`` at position ``pos[i]``
        of sequence ``seq_ids[i]``; ``outputs[i]``: a logits row for it) with the GIL released, and
        return the output rows in batch order: a read-only ``(n_outputs, n_vocab)`` float32 array
        (a zero-copy view valid until the next decode when llama.cpp's rows are contiguous)."""
        self._alive()
        if self._owner.sampler != NULL:
            raise RuntimeFault("decode_multi: greedy sampling runs in the graph of sequence 0 (set_greedy)")
        cdef cnp.ndarray[int32_t, ndim=1] tok = np.ascontiguousarray(tokens, dtype=np.int32)
        cdef cnp.ndarray[int32_t, ndim=1] ps = np.ascontiguousarray(pos, dtype=np.int32)
        cdef cnp.ndarray[int32_t, ndim=1] sq = np.ascontiguousarray(seq_ids, dtype=np.int32)
        cdef cnp.ndarray[uint8_t, ndim=1] out = np.ascontiguousarray(outputs, dtype=np.uint8)
        cdef int32_t n = <int32_t>tok.shape[0]
        if n == 0:
            raise CapacityError("decode: empty batch")
        if ps.shape[0] != n or sq.shape[0] != n or out.shape[0] != n:
            raise ConfigError("decode_multi", [tok.shape[0], ps.shape[0], sq.shape[0], out.shape[0]],
                              "tokens, pos, seq_ids and outputs of one length")
        if n > self.n_batch:
            raise CapacityError(f"decode: {n} tokens exceed n_batch={self.n_batch}; split the batch")
        cdef llama_batch * b = &self.batch
        cdef int32_t i
        cdef int32_t * t = <int32_t *>tok.data
        cdef int32_t * pp = <int32_t *>ps.data
        cdef int32_t * ss = <int32_t *>sq.data
        cdef uint8_t * oo = <uint8_t *>out.data
        # the checks in one pass over the arrays (numpy's reductions cost more than this whole loop)
        cdef int32_t n_out = 0
        cdef int32_t s_lo = ss[0], s_hi = ss[0], p_lo = pp[0], p_hi = pp[0], t_lo = t[0], t_hi = t[0]
        with nogil:
            for i in range(n):
                n_out += oo[i] != 0
                s_lo = min(s_lo, ss[i])
                s_hi = max(s_hi, ss[i])
                p_lo = min(p_lo, pp[i])
                p_hi = max(p_hi, pp[i])
                t_lo = min(t_lo, t[i])
                t_hi = max(t_hi, t[i])
        if n_out > self.n_outputs_max:
            raise CapacityError(f"decode: {n_out} output rows exceed n_outputs_max={self.n_outputs_max}")
        cdef int n_seq = <int>llama_n_seq_max(self.ptr)
        if s_lo < 0 or s_hi >= n_seq:
            raise ConfigError("seq_id", s_hi if s_hi >= n_seq else s_lo, f"integers in [0, {n_seq})")
        if p_lo < 0 or p_hi >= self.n_ctx:
            raise CapacityError(f"decode: positions up to {p_hi} overflow the context of {self.n_ctx} "
                                "tokens; raise n_ctx or shorten the request")
        if t_lo < 0 or t_hi >= self.n_vocab:
            raise CapacityError(f"decode: a token id is outside the vocabulary [0, {self.n_vocab})")
        with nogil:
            for i in range(n):
                b.token[i] = t[i]
                b.pos[i] = pp[i]
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = ss[i]
                b.logits[i] = 1 if oo[i] else 0
            b.n_tokens = n
        self._run_batch(n, n_out)
        return self._output_rows(n, n_out, "decode_multi")

    def decode_seqs(self, list seqs):
        """Decode one batch holding the tokens of several sequences, each ``(tokens, pos0, seq_id, n_rows)``:
        ``tokens`` (1-D contiguous int32) at positions ``pos0..`` of ``seq_id``, with a logits row for each of
        its last ``n_rows`` tokens, in the order given; with the GIL released. Returns the rows in batch order
        as :meth:`decode_multi` does. The shared pass of :class:`power_native.batch.LlamaBatch`, filled from
        its sequences' blocks here (no position, sequence and output arrays to build on the host)."""
        self._alive()
        if self._owner.sampler != NULL:
            raise RuntimeFault("decode_seqs: greedy sampling runs in the graph of sequence 0 (set_greedy)")
        cdef int32_t n = 0, n_out = 0, at = 0, m, k, i, pos0, sid, tk
        cdef bint bad = False
        cdef int32_t nv = self.n_vocab, n_ctx = self.n_ctx
        cdef int n_seq = <int>llama_n_seq_max(self.ptr)
        cdef cnp.ndarray arr
        cdef int32_t * t
        cdef llama_batch * b = &self.batch
        for spec in seqs:
            arr, pos0, sid, k = spec
            if cnp.PyArray_NDIM(arr) != 1 or cnp.PyArray_TYPE(arr) != cnp.NPY_INT32 \
                    or not cnp.PyArray_IS_C_CONTIGUOUS(arr):
                raise ConfigError("decode_seqs", repr(arr), "1-D contiguous int32 token ids")
            m = <int32_t>cnp.PyArray_DIM(arr, 0)
            if m == 0:
                raise CapacityError("decode: a sequence's block without tokens")
            if k < 0 or k > m:
                raise ConfigError("n_rows", k, f"0..{m} (the block's tokens)")
            if sid < 0 or sid >= n_seq:
                raise ConfigError("seq_id", sid, f"integers in [0, {n_seq})")
            if pos0 < 0 or <int64_t>pos0 + m > n_ctx:
                raise CapacityError(f"decode: positions up to {pos0 + m - 1} overflow the context of {n_ctx} "
                                    "tokens; raise n_ctx or shorten the request")
            n += m
            n_out += k
        if n > self.n_batch:
            raise CapacityError(f"decode: {n} tokens exceed n_batch={self.n_batch}; split the batch")
        if n_out > self.n_outputs_max:
            raise CapacityError(f"decode: {n_out} output rows exceed n_outputs_max={self.n_outputs_max}")
        for spec in seqs:
            arr, pos0, sid, k = spec
            t = <int32_t *>cnp.PyArray_DATA(arr)
            m = <int32_t>cnp.PyArray_DIM(arr, 0)
            with nogil:
                for i in range(m):
                    tk = t[i]
                    bad = bad or tk < 0 or tk >= nv
                    b.token[at + i] = tk
                    b.pos[at + i] = pos0 + i
                    b.n_seq_id[at + i] = 1
                    b.seq_id[at + i][0] = sid
                    b.logits[at + i] = 1 if i >= m - k else 0
            if bad:
                raise CapacityError(f"decode: a token id is outside the vocabulary [0, {nv})")
            at += m
        b.n_tokens = n
        self._run_batch(n, n_out)
        return self._output_rows(n, n_out, "decode_seqs")

    cdef object _output_rows(self, int32_t n, int32_t n_out, str what):
        """The logits rows of the last decode of ``self.batch`` (``n`` entries, ``n_out`` of them flagged), in
        batch order: a read-only view when llama.cpp's rows are contiguous, else a copy."""
        if n_out == 0:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        cdef llama_batch * b = &self.batch
        cdef float * first = NULL
        cdef float * row
        cdef bint contiguous = True
        cdef int k = 0
        cdef int32_t i
        rows = []
        for i in range(n):
            if not b.logits[i]:
                continue
            row = llama_get_logits_ith(self.ptr, i)  # by batch index: llama.cpp maps it to its output row
            if row == NULL:
                raise RuntimeFault(f"{what}: no logits row for batch entry {i}")
            if first == NULL:
                first = row
            elif row != first + <size_t>k * self.n_vocab:
                contiguous = False
            rows.append(<size_t>row)
            k += 1
        if contiguous:
            return self._view(first, n_out, self.n_vocab)
        res = np.empty((n_out, self.n_vocab), dtype=np.float32)
        for k in range(n_out):
            res[k] = self._view(<float *><size_t>rows[k], 1, self.n_vocab)[0]
        return res

    def process(self, BatchExt batch, *, bint encode=False) -> int:
        """Run ``batch`` through ``llama_process`` (decode, or encode for encoder drafts) with the
        GIL released. Returns the number of output rows; the batch is cleared afterwards."""
        self.process_c(batch, encode)
        return self.n_outputs

    cdef int process_c(self, BatchExt batch, bint encode) except -1:
        self._alive()
        if batch is None or batch.ctx is not self:
            raise RuntimeFault("process: the batch belongs to another context")
        cdef int32_t n = batch.n_tokens
        if n == 0:
            raise CapacityError("process: empty batch")
        cdef int32_t rc
        cdef int64_t dt
        cdef llama_process_type kind = LLAMA_PROCESS_TYPE_ENCODE if encode else LLAMA_PROCESS_TYPE_DECODE
        _errors.clear()
        self.n_outputs = 0
        self._inflight += 1
        try:
            with nogil:
                rc = process_timed(self, kind, batch.ptr, &dt)
        finally:
            self._inflight -= 1
        if rc_translate(RC_OP_DECODE, rc) == RC_CANCELLED:
            self.abort_flag[0] = 0
        n_out = batch.n_outputs
        batch.clear_c()
        rc_raise(RC_OP_DECODE, rc, None)
        self.n_outputs = n_out
        self._last_n_tokens = n
        return 0

    def logits(self):
        """The output rows of the last decode as a read-only zero-copy ``(n_outputs, n_vocab)``
        float32 view, valid until the next decode on this context."""
        self._alive()
        cdef int n = self.n_outputs
        if n == 0:
            raise RuntimeFault("logits: no decode with outputs since the last change")
        if self._owner.sampler != NULL:
            raise RuntimeFault("logits: greedy sampling runs in the graph (set_greedy): llama.cpp copies no "
                               "logits rows to the host; read sampled_ids()")
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

    def logits_ith(self, int first, int n):
        """The logits rows of batch entries ``first..first+n-1`` of the last decode, each found by its
        entry through llama.cpp's output mapping (``llama_get_logits_ith``), never by assuming the
        entries' order: a read-only zero-copy ``(n, n_vocab)`` view when the rows lie in a row, else a
        copy. For a pass holding several sequences' entries (a shared draft pass)."""
        self._alive()
        if self._owner.sampler != NULL:
            raise RuntimeFault("logits_ith: greedy sampling runs in the graph (set_greedy): llama.cpp copies no "
                               "logits rows to the host")
        if self.n_outputs == 0:
            raise RuntimeFault("logits_ith: no decode with outputs since the last change")
        return _rows_ith(self, first, n, False)

    def embeddings_nextn_ith(self, int first, int n):
        """The ``h_nextn`` rows of batch entries ``first..first+n-1`` of the last decode
        (``llama_get_embeddings_nextn_ith``: by output mapping when the tap is masked, by entry when
        not), as :meth:`logits_ith` returns them."""
        self._alive()
        if not self._nextn_tap:
            raise RuntimeFault("embeddings_nextn_ith: the nextn tap is not enabled; call set_embeddings_nextn")
        return _rows_ith(self, first, n, True)

    def set_graph_cache(self, bint on) -> None:
        """Keep up to four built compute graphs and let a pass reuse any that fits it (``on``, every
        context's setting from its start; patch 0015), or only the previous pass's, as llama.cpp does.
        Passes of alternating shapes (a draft's injection and its noise block, an MTP head's first pass
        and its steps, verify blocks of two widths) then stop building a graph each time; the same
        graphs compute the same rows. :attr:`graphs_reused` counts the reuses either way."""
        self._alive()
        if self._inflight:
            raise RuntimeFault("set_graph_cache: the llama context is decoding in another thread")
        llama_set_graph_cache(self.ptr, on)

    def set_greedy(self, bint on) -> bool:
        """Sample every output row of sequence 0 in the graph (``on``) with its first maximum
        (numpy's ``argmax`` tie rule; see ``_sampling.pxi``), or stop. While on, llama.cpp copies only
        the ids to the host (:meth:`sampled_ids`) and :meth:`logits` refuses. Returns whether it is on:
        False for a context of several sequences or when llama.cpp cannot offload the sampler. A
        change rebuilds the graph at the next decode, so keep the setting across requests."""
        self._alive()
        if self._inflight:
            raise RuntimeFault("set_greedy: the llama context is decoding in another thread")
        cdef llama_sampler * chain
        if on == (self._owner.sampler != NULL):
            return on
        if not on:
            llama_set_sampler(self.ptr, 0, NULL)
            llama_sampler_free(<llama_sampler *>self._owner.sampler)
            self._owner.sampler = NULL
            self.n_outputs = 0  # the last decode's outputs were ids: it has no rows to read
            return False
        if llama_n_seq_max(self.ptr) != 1:
            return False
        chain = power_first_max_chain()
        if not llama_set_sampler(self.ptr, 0, chain):
            llama_sampler_free(chain)
            return False
        self._owner.sampler = <void *>chain
        self.n_outputs = 0  # the last decode's outputs were rows: it has no ids to read
        return True

    @property
    def greedy(self) -> bool:
        """True while :meth:`set_greedy` sampling runs in the graph."""
        return self._owner is not None and self._owner.sampler != NULL

    def sampled_ids(self):
        """The in-graph greedy token id of every output row of the last decode (``int32``, one per
        row, in output order)."""
        self._alive()
        cdef int n = self.n_outputs
        if self._owner.sampler == NULL:
            raise RuntimeFault("sampled_ids: greedy sampling is not in the graph; call set_greedy(True)")
        if n == 0:
            raise RuntimeFault("sampled_ids: no decode with outputs since the last change")
        out = np.empty(n, dtype=np.int32)
        cdef int32_t[::1] ids = out
        cdef int j
        cdef int32_t tok
        for j in range(n):
            tok = llama_get_sampled_token_ith(self.ptr, j - n)
            if tok < 0:
                raise RuntimeFault(f"sampled_ids: llama.cpp sampled no token for output row {j}")
            ids[j] = tok
        return out

    cdef object _view(self, float * ptr, int rows, int cols):
        cdef cnp.npy_intp dims[2]
        dims[0] = rows
        dims[1] = cols
        cdef cnp.ndarray arr = cnp.PyArray_SimpleNewFromData(2, dims, cnp.NPY_FLOAT32, <void *>ptr)
        cnp.set_array_base(arr, self._owner)  # the view keeps the memory, not the Context, alive
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

    def hold_abort(self, bint held) -> None:
        """While held, no decode on this context is aborted: an :meth:`abort` asked meanwhile, or before,
        stops the first decode after the hold ends (a restore's decodes must run whole)."""
        if self.abort_flag != NULL:
            self.abort_flag[1] = held

    def set_fr_vocab(self, int n) -> None:
        """FR compact vocabulary (Power's patch to the pinned llama.cpp): this context's LM head
        multiplies only the first ``n`` token rows; logits of the others are zero and must not be
        read. ``0`` restores the full head. Meant for draft contexts, never the target."""
        self._alive()
        if n < 0 or n > self.n_vocab:
            raise ConfigError("spec_mtp_fr_vocab_size", n, f"an integer in [1, {self.n_vocab})")
        llama_set_mtp_fr_vocab(self.ptr, 0 if n >= self.n_vocab else n)

    def set_causal_attn(self, bint causal) -> None:
        """Causal (default) or bidirectional attention inside a batch (DFlash blocks are non-causal)."""
        self._alive()
        llama_set_causal_attn(self.ptr, causal)

    # -- memory ------------------------------------------------------------------------------------------
    def clear(self, bint data=False) -> None:
        self._alive()
        cdef llama_memory_t mem = self.mem
        with nogil:  # RPC-held memory: the dispatcher thread may log (our callback takes the GIL)
            llama_memory_clear(mem, data)

    def seq_rm(self, int seq_id, int p0, int p1=-1) -> bool:
        """Remove positions [p0, p1) of ``seq_id``; False when llama.cpp cannot (recurrent memory)."""
        self._alive()
        cdef llama_memory_t mem = self.mem
        cdef bint ok
        with nogil:
            ok = llama_memory_seq_rm(mem, seq_id, p0, p1)
        return ok

    def pos_max(self, int seq_id=0) -> int:
        self._alive()
        return llama_memory_seq_pos_max(self.mem, seq_id)

    def state_get(self, int seq_id=0, int flags=LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, bytearray out=None):
        """The sequence state (``PARTIAL_ONLY`` by default: recurrent/SWA part, not the full KV), as
        ``bytes``; with ``out``, written into that ``bytearray`` (a new one when the size differs) and
        returned: a buffer reused every round needs no allocation and no fresh pages to fault in (a
        recurrent state is 100s of KB even on a tiny model)."""
        self._alive()
        cdef size_t size = llama_state_seq_get_size_ext(self.ptr, seq_id, flags)
        cdef object result
        cdef uint8_t * dst
        if out is not None:
            if <size_t>len(out) != size:
                out = bytearray(size)
            result = out
            dst = <uint8_t *>PyByteArray_AS_STRING(out)
        else:
            result = PyBytes_FromStringAndSize(NULL, size)
            dst = <uint8_t *>PyBytes_AS_STRING(result)
        cdef size_t got
        with nogil:
            got = llama_state_seq_get_data_ext(self.ptr, dst, size, seq_id, flags)
        if got != size:
            rc_raise(RC_OP_STATE_GET, <long>got, None)
        return result

    def state_set(self, data, int seq_id=0, int flags=LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) -> None:
        """Load a state from :meth:`state_get` (``bytes`` or the ``bytearray`` it filled)."""
        self._alive()
        cdef const uint8_t * src
        if isinstance(data, bytearray):
            src = <const uint8_t *>PyByteArray_AS_STRING(data)
        elif isinstance(data, bytes):
            src = <const uint8_t *>PyBytes_AS_STRING(data)
        else:
            raise TypeError(f"state_set takes a state from state_get (bytes or bytearray), not {type(data).__name__}")
        cdef size_t size = len(data)
        cdef size_t got
        _errors.clear()
        with nogil:
            got = llama_state_seq_set_data_ext(self.ptr, src, size, seq_id, flags)
        if got == 0:
            rc_raise(RC_OP_STATE_SET, -1, None)

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
                                  f"only {', '.join(sorted(LAYER_INP_FINAL_ARCHS))} record the output of the "
                                  "last layer")
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

