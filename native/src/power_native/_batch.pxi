# BatchExt: llama.cpp's extended batch (token entries with an optional embedding row, embedding-only
# entries, per-entry positions and output flags) and Context.process (llama_process).
# Included by _llama.pyx. The cdef methods are the GIL-free building blocks plugin extensions
# (power-mtp, the DFlash family) call per token; the def methods fill whole arrays in one call.

cdef class BatchExt:
    """An extended batch bound to one :class:`Context` (capacity ``n_batch`` entries; sequence 0, or any
    sequence through the ``*_seq_c`` methods).

    llama.cpp copies every embedding row into the batch when it is added, so the caller's arrays
    need not outlive the call. ``n_embd`` is the row width the context accepts for token entries
    (``n_embd_out`` on an MTP context, ``n_embd_inp`` otherwise; DFlash drafts also take
    ``n_target_layers * n_embd`` wide rows).
    """

    def __cinit__(self):
        self.ptr = NULL
        self.n_tokens = 0
        self.n_outputs = 0

    def __dealloc__(self):
        if self.ptr != NULL:
            llama_batch_ext_free(self.ptr)
            self.ptr = NULL

    def __init__(self, Context ctx):
        if ctx is None:
            raise RuntimeFault("BatchExt: no context")
        ctx._alive()
        self._owner = ctx._owner  # llama_batch_ext refers to the context: keep it allocated
        self.ptr = llama_batch_ext_init(ctx.ptr)
        if self.ptr == NULL:
            raise MemoryError("llama_batch_ext_init returned NULL")
        self.ctx = ctx
        self.capacity = ctx.n_batch
        self.n_pos_per_embd = 4 if ctx.model.mrope else 1

    def clear(self) -> None:
        """Drop every entry."""
        self.clear_c()

    cdef void clear_c(self) noexcept nogil:
        if self.ptr != NULL:
            llama_batch_ext_clear(self.ptr)
        self.n_tokens = 0
        self.n_outputs = 0

    cdef int32_t add_token_c(self, int32_t token, int32_t pos, const float * row, size_t width,
                             bint output) noexcept nogil:
        """Add ``token`` at ``pos`` of sequence 0 (with an embedding row when ``row`` is not NULL).
        Returns the entry index, or a negative code: -1 full, -2 invalid token, -4 embedding rejected
        (width), -5 position rejected, -6 more outputs than the context allows."""
        return self.add_token_seq_c(token, pos, 0, row, width, output)

    cdef int32_t add_token_seq_c(self, int32_t token, int32_t pos, int32_t seq, const float * row, size_t width,
                                 bint output) noexcept nogil:
        """:meth:`add_token_c` at ``pos`` of sequence ``seq`` (a draft context shared by the sequences
        of a batch: each entry is addressed by its own sequence and position, never by its index)."""
        cdef llama_embd e
        cdef llama_pos p = pos
        if output and self.n_outputs >= self.ctx.n_outputs_max:
            return -6
        cdef int32_t idx = llama_batch_ext_add_token(self.ptr, seq, token)
        if idx < 0:
            return idx
        if row != NULL:
            e.data = row
            e.n_rows = 1
            e.n_embd = width
            if not llama_batch_ext_set_embd_token(self.ptr, idx, e):
                return -4
        if not llama_batch_ext_set_pos(self.ptr, idx, &p):
            return -5
        llama_batch_ext_set_output_logits(self.ptr, idx, output)
        self.n_tokens += 1
        self.n_outputs += output
        return idx

    cdef int32_t add_embd_c(self, const float * row, size_t width, int32_t pos, bint output) noexcept nogil:
        """Add an embedding-only entry at ``pos`` of sequence 0 (M-RoPE models get ``{pos, pos, pos,
        0}``, as llama.cpp's DFlash injection does). Returns the index or a negative code as above."""
        return self.add_embd_seq_c(row, width, pos, 0, output)

    cdef int32_t add_embd_seq_c(self, const float * row, size_t width, int32_t pos, int32_t seq,
                                bint output) noexcept nogil:
        """:meth:`add_embd_c` at ``pos`` of sequence ``seq``."""
        cdef llama_embd e
        cdef llama_pos p[4]
        if output and self.n_outputs >= self.ctx.n_outputs_max:
            return -6
        e.data = row
        e.n_rows = 1
        e.n_embd = width
        cdef int32_t idx = llama_batch_ext_add_embd(self.ptr, seq, e)
        if idx < 0:
            return idx if idx != -2 else -4
        p[0] = pos
        p[1] = pos
        p[2] = pos
        p[3] = 0
        if not llama_batch_ext_set_pos(self.ptr, idx, p):
            return -5
        llama_batch_ext_set_output_logits(self.ptr, idx, output)
        self.n_tokens += 1
        self.n_outputs += output
        return idx

    def add_tokens(self, tokens, int pos0, embd=None, outputs="last") -> int:
        """Add ``tokens`` at ``pos0, pos0+1, ...``; ``embd`` (``(n, width)`` float32) attaches one
        row per token; ``outputs`` is ``"all"``, ``"last"``, ``"none"`` or a boolean mask.
        Returns the number of entries added; raises a typed error (nothing partial stays)."""
        cdef cnp.ndarray[int32_t, ndim=1] toks = np.ascontiguousarray(tokens, dtype=np.int32)
        cdef Py_ssize_t n = toks.shape[0], i
        cdef cnp.ndarray[float, ndim=2] rows
        cdef cnp.ndarray[cnp.uint8_t, ndim=1] outs
        cdef const float * base = NULL
        cdef size_t width = 0
        if embd is not None:
            rows = np.ascontiguousarray(embd, dtype=np.float32)
            if rows.ndim != 2 or rows.shape[0] != n:
                raise CapacityError(f"add_tokens: embd has shape {np.shape(embd)}; expected ({n}, width)")
            base = &rows[0, 0] if n else NULL
            width = rows.shape[1]
        outs = self._outputs(outputs, n)
        if self.n_tokens + n > self.capacity:
            raise CapacityError(f"add_tokens: {self.n_tokens + n} entries exceed the batch capacity {self.capacity}")
        cdef int32_t rc = 0, start = self.n_tokens, start_out = self.n_outputs
        cdef int32_t nv = self.ctx.n_vocab
        for i in range(n):
            if toks[i] < 0 or toks[i] >= nv:
                raise CapacityError(f"add_tokens: token id {toks[i]} at index {i} is outside [0, {nv})")
        with nogil:
            for i in range(n):
                rc = self.add_token_c(toks[i], pos0 + <int32_t>i, base + i * width if base != NULL else NULL,
                                      width, outs[i])
                if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                    break
        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
            self._fail(rc, width, start)
        return n

    def add_embd(self, embd, int pos0, outputs="none") -> int:
        """Add one embedding-only entry per row of ``embd`` at ``pos0, pos0+1, ...``."""
        cdef cnp.ndarray[float, ndim=2] rows = np.ascontiguousarray(embd, dtype=np.float32)
        cdef Py_ssize_t n = rows.shape[0], i
        cdef size_t width = rows.shape[1]
        cdef cnp.ndarray[cnp.uint8_t, ndim=1] outs = self._outputs(outputs, n)
        if self.n_tokens + n > self.capacity:
            raise CapacityError(f"add_embd: {self.n_tokens + n} entries exceed the batch capacity {self.capacity}")
        cdef int32_t rc = 0, start = self.n_tokens
        with nogil:
            for i in range(n):
                rc = self.add_embd_c(&rows[i, 0], width, pos0 + <int32_t>i, outs[i])
                if rc_translate(RC_OP_BATCH, rc) != RC_OK:
                    break
        if rc_translate(RC_OP_BATCH, rc) != RC_OK:
            self._fail(rc, width, start)
        return n

    cdef object _outputs(self, outputs, Py_ssize_t n):
        if isinstance(outputs, str):
            mask = np.zeros(n, dtype=np.uint8)
            if outputs == "all":
                mask[:] = 1
            elif outputs == "last":
                if n:
                    mask[n - 1] = 1
            elif outputs != "none":
                raise ConfigError("outputs", outputs, "'all', 'last', 'none' or a boolean mask")
            return mask
        mask = np.ascontiguousarray(outputs, dtype=np.uint8)
        if mask.shape != (n,):
            raise ConfigError("outputs", f"shape {mask.shape}", f"a boolean mask of shape ({n},)")
        return mask

    cdef int _fail(self, int32_t rc, size_t width, int32_t start) except -1:
        """Drop the whole batch (nothing partial) and raise for the code ``add_token_c``/``add_embd_c``
        returned at entry ``start`` (:func:`rc_raise`)."""
        self.clear_c()
        return rc_raise(RC_OP_BATCH, rc, f"batch entry {start} (row width {width}, capacity {self.capacity}, "
                        f"n_outputs_max={self.ctx.n_outputs_max})")


cdef object _rows_ith(Context self, int first, int n, bint nextn):
    """Context.logits_ith / embeddings_nextn_ith (a function, not a method: Context's C methods are
    the ABI that plugin extensions compiled against _llama.pxd share)."""
    cdef int width = llama_model_n_embd_out(self.model.ptr) if nextn else self.n_vocab
    cdef float * head = NULL
    cdef float * row
    cdef bint contiguous = True
    cdef list rows = []
    cdef int j
    if n < 1 or first < 0 or first + n > self._last_n_tokens:
        raise RuntimeFault(f"rows of entries {first}..{first + n - 1} requested; the last decode had "
                           f"{self._last_n_tokens} entries")
    for j in range(n):
        if nextn:
            row = llama_get_embeddings_nextn_ith(self.ptr, first + j)
        else:
            row = llama_get_logits_ith(self.ptr, first + j)
        if row == NULL:
            raise RuntimeFault(f"no {'nextn' if nextn else 'logits'} row for batch entry {first + j}")
        if j == 0:
            head = row
        elif row != head + <size_t>j * width:
            contiguous = False
        rows.append(<size_t>row)
    if contiguous:
        return self._view(head, n, width)
    out = np.empty((n, width), dtype=np.float32)
    for j in range(n):
        out[j] = self._view(<float *><size_t>rows[j], 1, width)[0]
    return out
