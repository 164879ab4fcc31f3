# In-graph greedy sampling: a llama.cpp backend sampler whose graph picks each row's *first*
# maximum (numpy's ``argmax``), so only token ids leave the device. Included by _llama.pyx.
#
# ggml's own argmax (and so llama.cpp's greedy backend sampler) keeps the *last* maximum on the CPU
# (``ggml_vec_argmax_f32``: ``max = MAX(max, x[i]); if (max == x[i]) idx = i``). This sampler does
# not depend on any argmax's tie rule: it takes the value ``m`` of some maximum, marks the maxima
# exactly (``1 + sgn(x - m)``: ``x - m == 0`` iff ``x == m`` for finite floats), weights each mark by
# ``n - i`` and takes the argmax of that, which is unique: the first maximum.

cdef extern from *:
    """
    #include "llama.h"
    #include "ggml.h"

    static const char * power_first_max_name(const struct llama_sampler *) { return "power-first-max"; }

    static void power_first_max_apply(struct llama_sampler *, llama_token_data_array * cur_p) {
        cur_p->selected = 0;
        for (size_t i = 1; i < cur_p->size; ++i) {
            if (cur_p->data[i].logit > cur_p->data[cur_p->selected].logit) { cur_p->selected = i; }
        }
    }

    /* The per-graph rank tensor (n - i), built once per sampling graph and shared by its rows. */
    struct power_first_max_state { struct ggml_tensor * rank; };

    static void power_first_max_free(struct llama_sampler * smpl) {
        delete (power_first_max_state *) smpl->ctx;
    }

    static bool power_first_max_backend_init(struct llama_sampler *, ggml_backend_buffer_type_t, uint32_t) {
        return true;
    }

    static void power_first_max_backend_reset(struct llama_sampler * smpl) {
        ((power_first_max_state *) smpl->ctx)->rank = nullptr;  /* a new graph: its tensors are new */
    }

    static void power_first_max_backend_apply(struct llama_sampler * smpl, struct ggml_context * ctx,
                                              struct ggml_cgraph *, struct llama_sampler_data * data) {
        power_first_max_state * st = (power_first_max_state *) smpl->ctx;
        struct ggml_tensor * x = ggml_reshape_1d(ctx, data->logits, ggml_nelements(data->logits));
        const int64_t n = x->ne[0];
        int64_t k = 64;  /* elementwise ops on k rows of n / k: the CPU backend splits them by row */
        while (n % k != 0) { k /= 2; }
        if (st->rank == nullptr || st->rank->ne[0] * st->rank->ne[1] != n) {
            st->rank = ggml_reshape_2d(ctx, ggml_scale_bias(ctx, ggml_arange(ctx, 0.0f, (float) n, 1.0f),
                                                            -1.0f, (float) n), n / k, k);   /* n - i */
        }
        struct ggml_tensor * some = ggml_argmax(ctx, x);                                    /* a maximum */
        struct ggml_tensor * m = ggml_get_rows(ctx, ggml_reshape_2d(ctx, x, 1, n), some);   /* its value */
        struct ggml_tensor * d = ggml_sub(ctx, ggml_reshape_2d(ctx, x, n / k, k), m);       /* 0 iff x == m */
        struct ggml_tensor * is_max = ggml_scale_bias(ctx, ggml_sgn(ctx, d), 1.0f, 1.0f);   /* 1 + sgn(d) */
        struct ggml_tensor * score = ggml_mul(ctx, is_max, st->rank);
        struct ggml_tensor * first = ggml_argmax(ctx, ggml_reshape_1d(ctx, score, n));
        ggml_set_name(first, "power_first_max");
        data->sampled = first;
    }

    static struct llama_sampler_i power_first_max_i = {
        /* .name              = */ power_first_max_name,
        /* .accept            = */ nullptr,
        /* .apply             = */ power_first_max_apply,
        /* .reset             = */ nullptr,
        /* .clone             = */ nullptr,
        /* .free              = */ power_first_max_free,
        /* .backend_init      = */ power_first_max_backend_init,
        /* .backend_accept    = */ nullptr,
        /* .backend_apply     = */ power_first_max_backend_apply,
        /* .backend_set_input = */ nullptr,
        /* .backend_reset     = */ power_first_max_backend_reset,
        /* .copy_state        = */ nullptr,
    };

    /* A sampler chain (what llama_set_sampler takes) holding the first-maximum sampler. */
    static struct llama_sampler * power_first_max_chain(void) {
        struct llama_sampler * chain = llama_sampler_chain_init(llama_sampler_chain_default_params());
        llama_sampler_chain_add(chain, llama_sampler_init(&power_first_max_i, new power_first_max_state{nullptr}));
        return chain;
    }
    """
    cdef struct llama_sampler
    llama_sampler * power_first_max_chain() nogil
    bint llama_set_sampler(llama_context * ctx, int32_t seq_id, llama_sampler * smpl) nogil
    void llama_sampler_free(llama_sampler * smpl) nogil
