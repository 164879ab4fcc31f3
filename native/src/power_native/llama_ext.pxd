# cython: language_level=3
"""Declarations of the C++ staging header ``src/llama-ext.h`` (hidden-state taps, target layer
ids, DFlash2 selector). It has no ``extern "C"``: the extension is compiled as C++ against the same
tree so the Itanium-mangled names resolve. Treat it as an unstable ABI tied to the exact build.
"""

from libc.stdint cimport int32_t, uint32_t
from libcpp.map cimport map as cpp_map

from power_native.llama cimport ggml_backend_buffer_type_t, llama_context, llama_model


cdef extern from "llama-ext.h" nogil:
    # bytes a context holds, per buffer type: its model's weights, its memory (KV cells, recurrent
    # states), its compute buffers
    cdef cppclass llama_memory_breakdown_data:
        size_t model
        size_t context
        size_t compute
    cpp_map[ggml_backend_buffer_type_t, llama_memory_breakdown_data] llama_get_memory_breakdown(const llama_context * ctx)
    void llama_set_embeddings_nextn(llama_context * ctx, bint value, bint masked)
    void llama_set_nextn_layer_offset(llama_context * ctx, int32_t offset)
    # Power patch native/patches/0001-mtp-fr-vocab.patch: the LM head projects only the first n rows
    void llama_set_mtp_fr_vocab(llama_context * ctx, int32_t n)
    # Power patch native/patches/0015-graph-cache.patch: a pass reuses any of four kept graphs that fits it
    void llama_set_graph_cache(llama_context * ctx, bint value)
    float * llama_get_embeddings_nextn(llama_context * ctx)
    float * llama_get_embeddings_nextn_ith(llama_context * ctx, int32_t i)
    void llama_set_embeddings_layer_inp(llama_context * ctx, uint32_t lid, bint value)
    float * llama_get_embeddings_layer_inp(llama_context * ctx, uint32_t lid)
    llama_context * llama_get_ctx_other(llama_context * ctx)
    int32_t llama_model_dflash_selector_top_k(const llama_model * model)
    const int32_t * llama_model_target_layer_ids(const llama_model * model)
    uint32_t llama_model_target_layer_ids_n(const llama_model * model)
