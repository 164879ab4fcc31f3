# cython: language_level=3
"""``cdef extern`` declarations of the pinned ``include/llama.h`` (only what Power uses), in
header order, plus the few ``ggml.h``/``gguf.h`` names they need. Plugin packages ``cimport`` this
module; compile against ``power_native.get_include()`` and link ``power_native.get_library_dir()``.
"""

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdio cimport FILE


cdef extern from "ggml.h" nogil:
    cdef struct ggml_tensor:
        int type
        int64_t ne[4]
        char name[64]
    cdef struct ggml_context
    ctypedef bint (*ggml_abort_callback)(void * data) noexcept
    enum ggml_log_level:
        GGML_LOG_LEVEL_NONE
        GGML_LOG_LEVEL_DEBUG
        GGML_LOG_LEVEL_INFO
        GGML_LOG_LEVEL_WARN
        GGML_LOG_LEVEL_ERROR
        GGML_LOG_LEVEL_CONT
    ctypedef void (*ggml_log_callback)(ggml_log_level level, const char * text, void * user_data) noexcept
    int64_t ggml_nelements(const ggml_tensor * tensor)
    size_t ggml_nbytes(const ggml_tensor * tensor)
    enum:
        GGML_TYPE_F32
        GGML_TYPE_F16


cdef extern from "gguf.h" nogil:
    cdef struct gguf_context
    cdef struct gguf_init_params:
        bint no_alloc
        ggml_context ** ctx
    gguf_context * gguf_init_from_file(const char * fname, gguf_init_params params)
    void gguf_free(gguf_context * ctx)


cdef extern from "ggml-backend.h" nogil:
    cdef struct ggml_backend_buffer_type
    ctypedef ggml_backend_buffer_type * ggml_backend_buffer_type_t
    const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft)
    cdef struct ggml_backend_reg
    ctypedef ggml_backend_reg * ggml_backend_reg_t
    cdef struct ggml_backend_device
    ctypedef ggml_backend_device * ggml_backend_dev_t
    ggml_backend_reg_t ggml_backend_reg_by_name(const char * name)
    const char * ggml_backend_reg_name(ggml_backend_reg_t reg)
    void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name)
    size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg)
    ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index)
    # enum ggml_backend_dev_type (declared anonymous: the function below has the enum's name)
    enum:
        GGML_BACKEND_DEVICE_TYPE_CPU
        GGML_BACKEND_DEVICE_TYPE_GPU
        GGML_BACKEND_DEVICE_TYPE_IGPU
        GGML_BACKEND_DEVICE_TYPE_ACCEL
        GGML_BACKEND_DEVICE_TYPE_META
    const char * ggml_backend_dev_name(ggml_backend_dev_t device)
    int ggml_backend_dev_type(ggml_backend_dev_t device)
    size_t ggml_backend_dev_count()
    ggml_backend_dev_t ggml_backend_dev_get(size_t index)
    ggml_backend_dev_t ggml_backend_dev_by_name(const char * name)
    # backends built as modules (GGML_BACKEND_DL: one ggml-cpu per CPU variant) loaded from a folder
    void ggml_backend_load_all_from_path(const char * dir_path)


cdef extern from "llama.h" nogil:
    ctypedef int32_t llama_pos
    ctypedef int32_t llama_token
    ctypedef int32_t llama_seq_id

    cdef struct llama_vocab
    cdef struct llama_model
    cdef struct llama_context
    cdef struct llama_memory_i
    ctypedef llama_memory_i * llama_memory_t

    enum llama_context_type:
        LLAMA_CONTEXT_TYPE_DEFAULT
        LLAMA_CONTEXT_TYPE_MTP

    ctypedef struct llama_batch:
        int32_t n_tokens
        llama_token * token
        float * embd
        llama_pos * pos
        int32_t * n_seq_id
        llama_seq_id ** seq_id
        int8_t * logits

    ctypedef bint (*llama_progress_callback)(float progress, void * user_data) noexcept

    cdef struct llama_model_params:
        ggml_backend_dev_t * devices
        int32_t n_gpu_layers
        int32_t main_gpu
        llama_progress_callback progress_callback
        void * progress_callback_user_data
        bint vocab_only
        bint check_tensors
        bint use_extra_bufts
        bint no_host
        bint no_alloc
        bint load_mtp

    cdef enum llama_flash_attn_type:
        LLAMA_FLASH_ATTN_TYPE_AUTO
        LLAMA_FLASH_ATTN_TYPE_DISABLED
        LLAMA_FLASH_ATTN_TYPE_ENABLED

    cdef struct llama_context_params:
        uint32_t n_ctx
        uint32_t n_batch
        uint32_t n_ubatch
        uint32_t n_seq_max
        uint32_t n_rs_seq
        uint32_t n_outputs_max
        uint32_t n_outputs_max_per_seq
        int32_t n_threads
        int32_t n_threads_batch
        llama_context_type ctx_type
        llama_flash_attn_type flash_attn_type
        ggml_abort_callback abort_callback
        void * abort_callback_data
        bint embeddings
        bint offload_kqv
        bint no_perf
        bint op_offload
        bint swa_full
        bint kv_unified
        llama_context * ctx_other

    llama_model_params llama_model_default_params()
    llama_context_params llama_context_default_params()

    void llama_backend_init()

    ctypedef void (*llama_model_set_tensor_data_t)(ggml_tensor * tensor, void * userdata) noexcept
    llama_model * llama_model_init_from_user(gguf_context * metadata,
                                             llama_model_set_tensor_data_t set_tensor_data,
                                             void * set_tensor_data_ud, llama_model_params params)
    llama_model * llama_model_load_from_file(const char * path_model, llama_model_params params)
    void llama_model_save_to_file(const llama_model * model, const char * path_model)
    void llama_model_free(llama_model * model)
    llama_context * llama_init_from_model(llama_model * model, llama_context_params params)
    void llama_free(llama_context * ctx)

    uint32_t llama_n_ctx(const llama_context * ctx)
    uint32_t llama_n_batch(const llama_context * ctx)
    uint32_t llama_n_ubatch(const llama_context * ctx)
    uint32_t llama_n_seq_max(const llama_context * ctx)
    uint32_t llama_n_rs_seq(const llama_context * ctx)

    const llama_model * llama_get_model(const llama_context * ctx)
    llama_memory_t llama_get_memory(const llama_context * ctx)

    ctypedef struct llama_perf_context_data:
        double t_start_ms
        double t_load_ms
        double t_p_eval_ms
        double t_eval_ms
        int32_t n_p_eval
        int32_t n_eval
        int32_t n_reused
    llama_perf_context_data llama_perf_context(const llama_context * ctx)

    const llama_vocab * llama_model_get_vocab(const llama_model * model)
    int32_t llama_model_n_ctx_train(const llama_model * model)
    int32_t llama_model_n_embd(const llama_model * model)
    int32_t llama_model_n_embd_out(const llama_model * model)
    int llama_model_rope_type(const llama_model * model)
    int32_t llama_model_n_layer(const llama_model * model)
    int32_t llama_model_n_layer_nextn(const llama_model * model)
    int32_t llama_model_n_head(const llama_model * model)
    int32_t llama_vocab_n_tokens(const llama_vocab * vocab)
    int32_t llama_model_meta_val_str(const llama_model * model, const char * key, char * buf, size_t buf_size)
    int32_t llama_model_meta_count(const llama_model * model)
    int32_t llama_model_meta_key_by_index(const llama_model * model, int32_t i, char * buf, size_t buf_size)
    int32_t llama_model_meta_val_str_by_index(const llama_model * model, int32_t i, char * buf, size_t buf_size)
    int32_t llama_model_desc(const llama_model * model, char * buf, size_t buf_size)
    uint64_t llama_model_size(const llama_model * model)
    uint64_t llama_model_n_params(const llama_model * model)
    bint llama_model_has_encoder(const llama_model * model)
    bint llama_model_is_recurrent(const llama_model * model)
    bint llama_model_is_hybrid(const llama_model * model)

    void llama_memory_clear(llama_memory_t mem, bint data)
    bint llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1)
    void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst,
                             llama_pos p0, llama_pos p1)
    void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id)
    llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id)
    llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id)

    ctypedef uint32_t llama_state_seq_flags
    enum:
        LLAMA_STATE_SEQ_FLAGS_NONE
        LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
    size_t llama_state_seq_get_size_ext(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags)
    size_t llama_state_seq_get_data_ext(llama_context * ctx, uint8_t * dst, size_t size,
                                        llama_seq_id seq_id, llama_state_seq_flags flags)
    size_t llama_state_seq_set_data_ext(llama_context * ctx, const uint8_t * src, size_t size,
                                        llama_seq_id dest_seq_id, llama_state_seq_flags flags)

    llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max)
    void llama_batch_free(llama_batch batch)
    int32_t llama_decode(llama_context * ctx, llama_batch batch)

    # extended batches (llama.h:1011-1091): token and/or embedding rows, per-entry positions and outputs
    cdef struct llama_batch_ext
    cdef struct llama_embd:
        const float * data
        size_t n_rows
        size_t n_embd
    enum llama_process_type:
        LLAMA_PROCESS_TYPE_ENCODE
        LLAMA_PROCESS_TYPE_DECODE
    llama_batch_ext * llama_batch_ext_init(llama_context * ctx)
    void llama_batch_ext_free(llama_batch_ext * batch)
    void llama_batch_ext_clear(llama_batch_ext * batch)
    int32_t llama_batch_ext_add_token(llama_batch_ext * batch, llama_seq_id seq_id, llama_token id)
    int32_t llama_batch_ext_add_embd(llama_batch_ext * batch, llama_seq_id seq_id, llama_embd embd)
    bint llama_batch_ext_set_embd_token(llama_batch_ext * batch, int32_t idx, llama_embd embd)
    bint llama_batch_ext_set_output_logits(llama_batch_ext * batch, int32_t idx, bint value)
    bint llama_batch_ext_set_pos(llama_batch_ext * batch, int32_t idx, const llama_pos * pos)
    int32_t llama_process(llama_context * ctx, llama_process_type type, llama_batch_ext * batch)

    void llama_set_n_threads(llama_context * ctx, int32_t n_threads, int32_t n_threads_batch)
    void llama_set_causal_attn(llama_context * ctx, bint causal_attn)
    void llama_set_abort_callback(llama_context * ctx, ggml_abort_callback abort_callback, void * data)
    void llama_synchronize(llama_context * ctx)

    float * llama_get_logits_ith(llama_context * ctx, int32_t i)
    int32_t llama_get_sampled_token_ith(llama_context * ctx, int32_t i)

    const char * llama_vocab_get_text(const llama_vocab * vocab, llama_token token)
    bint llama_vocab_is_eog(const llama_vocab * vocab, llama_token token)
    bint llama_vocab_is_control(const llama_vocab * vocab, llama_token token)
    llama_token llama_vocab_bos(const llama_vocab * vocab)
    llama_token llama_vocab_eos(const llama_vocab * vocab)
    llama_token llama_vocab_mask(const llama_vocab * vocab)
    bint llama_vocab_get_add_bos(const llama_vocab * vocab)
    bint llama_vocab_get_add_eos(const llama_vocab * vocab)
    int llama_vocab_type(const llama_vocab * vocab)

    int32_t llama_tokenize(const llama_vocab * vocab, const char * text, int32_t text_len,
                           llama_token * tokens, int32_t n_tokens_max, bint add_special, bint parse_special)
    int32_t llama_token_to_piece(const llama_vocab * vocab, llama_token token, char * buf, int32_t length,
                                 int32_t lstrip, bint special)

    const char * llama_print_system_info()
    void llama_log_set(ggml_log_callback log_callback, void * user_data)
