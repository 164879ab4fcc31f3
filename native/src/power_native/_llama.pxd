# cython: language_level=3
"""The owning wrappers of ``_llama.pyx``, declared so plugin packages can ``cimport`` them and
reach the raw pointers (``Model.ptr``, ``Context.ptr``) for calls Power does not wrap."""

from libc.stdint cimport int32_t

from power_native.llama cimport (gguf_context, llama_batch, llama_batch_ext, llama_context, llama_memory_t,
                                  llama_model, llama_vocab)


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
    # owns one llama_context (and its abort flag): freed when the last holder goes — the Context,
    # a zero-copy view of its buffers, a batch bound to it, or a context created with it as ctx_other
    cdef llama_context * ptr
    cdef int * abort_flag
    cdef object model
    cdef object other


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
    cdef object __weakref__
    cdef _CtxOwner _owner
    cdef int _alive(self) except -1
    cdef object _view(self, float * ptr, int rows, int cols)
    cdef int process_c(self, BatchExt batch, bint encode) except -1


cdef class BatchExt:
    cdef llama_batch_ext * ptr
    cdef readonly Context ctx
    cdef _CtxOwner _owner
    cdef readonly int capacity, n_tokens, n_outputs, n_pos_per_embd
    cdef void clear_c(self) noexcept nogil
    cdef int32_t add_token_c(self, int32_t token, int32_t pos, const float * row, size_t width,
                             bint output) noexcept nogil
    cdef int32_t add_embd_c(self, const float * row, size_t width, int32_t pos, bint output) noexcept nogil
    cdef object _outputs(self, outputs, Py_ssize_t n)
    cdef int _fail(self, int32_t rc, size_t width, int32_t start) except -1
