// compute_clock: an LD_PRELOAD shim that times every llama_decode / llama_encode / llama_process call of
// a process (any context) and writes one line per call at exit, so a bench can split a llama.cpp tool's
// wall time into compute (time inside those calls, the same span Power's receipts time as compute) and
// host time (everything else). Used by tests/bench/bench_spec.py on llama-speculative-simple.
//
// Output (file named by $POWER_COMPUTE_TRACE, written at exit): "<ctx> <start_ns> <dur_ns> <n_tokens>" per
// call, CLOCK_MONOTONIC (the clock of ggml_time_us, so the tool's own "decoded N tokens in T s" window can
// be placed on it). Nested calls (llama_process calling llama_decode through the PLT) count once. A
// llama_process call's n_tokens is the entries its llama_batch_ext got since its last clear (the shim counts
// llama_batch_ext_add/_add_token/_add_embd; -1 for a batch it never saw filled).
//
// Build: cc -O2 -shared -fPIC compute_clock.c -I<llama.cpp>/include -I<llama.cpp>/ggml/include -ldl -lpthread

#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "llama.h"

#define CAP (1 << 20)

typedef struct {
    const void * ctx;
    int64_t start_ns;
    int64_t dur_ns;
    int32_t n_tokens;
} call_t;

static call_t calls[CAP];
static long n_calls = 0;
static __thread int depth = 0;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void record(const void * ctx, int64_t t0, int32_t n_tokens) {
    const int64_t t1 = now_ns();
    if (n_calls < CAP) {
        calls[n_calls].ctx = ctx;
        calls[n_calls].start_ns = t0;
        calls[n_calls].dur_ns = t1 - t0;
        calls[n_calls].n_tokens = n_tokens;
        n_calls++;
    }
}

static void * next_symbol(const char * name) {
    void * fn = dlsym(RTLD_NEXT, name);
    if (fn == NULL) {  // libllama opened later with RTLD_LOCAL (a Python extension's dependency)
        void * lib = dlopen("libllama.so.0", RTLD_LAZY | RTLD_NOLOAD);
        fn = lib != NULL ? dlsym(lib, name) : NULL;
    }
    if (fn == NULL) {
        fprintf(stderr, "compute_clock: no %s after this shim\n", name);
        abort();
    }
    return fn;
}

static void synchronize(struct llama_context * ctx) {
    static void (*real)(struct llama_context *) = NULL;
    if (real == NULL) real = (void (*)(struct llama_context *)) next_symbol("llama_synchronize");
    real(ctx);
}

// entries of each llama_batch_ext since its last clear (llama_process's n_tokens), by the batch's address
#define N_BATCHES 256

static const void * batch_at[N_BATCHES];
static int32_t batch_entries[N_BATCHES];
static pthread_mutex_t batch_lock = PTHREAD_MUTEX_INITIALIZER;

static int batch_slot(const void * batch, int create) {  // under batch_lock; -1: none (or the table is full)
    int free_slot = -1;
    for (int i = 0; i < N_BATCHES; i++) {
        if (batch_at[i] == batch) return i;
        if (batch_at[i] == NULL && free_slot < 0) free_slot = i;
    }
    if (create && free_slot >= 0) {
        batch_at[free_slot] = batch;
        batch_entries[free_slot] = 0;
    }
    return create ? free_slot : -1;
}

static void batch_count(const void * batch, int32_t added) {  // added < 0: cleared
    pthread_mutex_lock(&batch_lock);
    const int i = batch_slot(batch, 1);
    if (i >= 0) batch_entries[i] = added < 0 ? 0 : batch_entries[i] + added;
    pthread_mutex_unlock(&batch_lock);
}

static int32_t batch_tokens(const void * batch) {
    pthread_mutex_lock(&batch_lock);
    const int i = batch_slot(batch, 0);
    const int32_t n = i >= 0 ? batch_entries[i] : -1;
    pthread_mutex_unlock(&batch_lock);
    return n;
}

void llama_batch_ext_clear(struct llama_batch_ext * batch) {
    static void (*real)(struct llama_batch_ext *) = NULL;
    if (real == NULL) real = (void (*)(struct llama_batch_ext *)) next_symbol("llama_batch_ext_clear");
    real(batch);
    batch_count(batch, -1);
}

void llama_batch_ext_free(struct llama_batch_ext * batch) {
    static void (*real)(struct llama_batch_ext *) = NULL;
    if (real == NULL) real = (void (*)(struct llama_batch_ext *)) next_symbol("llama_batch_ext_free");
    pthread_mutex_lock(&batch_lock);
    const int i = batch_slot(batch, 0);
    if (i >= 0) batch_at[i] = NULL;  // its address may come back for another batch
    pthread_mutex_unlock(&batch_lock);
    real(batch);
}

int32_t llama_batch_ext_add(struct llama_batch_ext * batch, llama_seq_id seq_id) {
    static int32_t (*real)(struct llama_batch_ext *, llama_seq_id) = NULL;
    if (real == NULL) real = (int32_t (*)(struct llama_batch_ext *, llama_seq_id)) next_symbol("llama_batch_ext_add");
    const int32_t rc = real(batch, seq_id);
    if (rc >= 0) batch_count(batch, 1);
    return rc;
}

int32_t llama_batch_ext_add_token(struct llama_batch_ext * batch, llama_seq_id seq_id, llama_token id) {
    static int32_t (*real)(struct llama_batch_ext *, llama_seq_id, llama_token) = NULL;
    if (real == NULL) {
        real = (int32_t (*)(struct llama_batch_ext *, llama_seq_id, llama_token)) next_symbol("llama_batch_ext_add_token");
    }
    const int32_t rc = real(batch, seq_id, id);
    if (rc >= 0) batch_count(batch, 1);
    return rc;
}

int32_t llama_batch_ext_add_embd(struct llama_batch_ext * batch, llama_seq_id seq_id, struct llama_embd embd) {
    static int32_t (*real)(struct llama_batch_ext *, llama_seq_id, struct llama_embd) = NULL;
    if (real == NULL) {
        real = (int32_t (*)(struct llama_batch_ext *, llama_seq_id, struct llama_embd)) next_symbol("llama_batch_ext_add_embd");
    }
    const int32_t rc = real(batch, seq_id, embd);
    if (rc >= 0) batch_count(batch, 1);
    return rc;
}

// llama_decode and llama_encode: the same wrapper around the next definition of the symbol
#define TIMED_BATCH_CALL(name)                                                                             \
    int32_t name(struct llama_context * ctx, struct llama_batch batch) {                                    \
        static int32_t (*real)(struct llama_context *, struct llama_batch) = NULL;                          \
        if (real == NULL) real = (int32_t (*)(struct llama_context *, struct llama_batch)) next_symbol(#name); \
        if (depth++ > 0) { const int32_t rc = real(ctx, batch); depth--; return rc; }                       \
        const int64_t t0 = now_ns();                                                                        \
        const int32_t rc = real(ctx, batch);                                                                \
        synchronize(ctx);                                                                                   \
        record(ctx, t0, batch.n_tokens);                                                                    \
        depth--;                                                                                            \
        return rc;                                                                                          \
    }

TIMED_BATCH_CALL(llama_decode)
TIMED_BATCH_CALL(llama_encode)

int32_t llama_process(struct llama_context * ctx, enum llama_process_type type, struct llama_batch_ext * batch) {
    static int32_t (*real)(struct llama_context *, enum llama_process_type, struct llama_batch_ext *) = NULL;
    if (real == NULL) {
        real = (int32_t (*)(struct llama_context *, enum llama_process_type, struct llama_batch_ext *))
            next_symbol("llama_process");
    }
    if (depth++ > 0) { const int32_t rc = real(ctx, type, batch); depth--; return rc; }
    const int64_t t0 = now_ns();
    const int32_t rc = real(ctx, type, batch);
    synchronize(ctx);
    record(ctx, t0, batch_tokens(batch));
    depth--;
    return rc;
}

__attribute__((destructor)) static void dump(void) {
    const char * path = getenv("POWER_COMPUTE_TRACE");
    if (path == NULL || path[0] == '\0') return;
    FILE * f = fopen(path, "w");
    if (f == NULL) return;
    for (long i = 0; i < n_calls; i++) {
        fprintf(f, "%p %lld %lld %d\n", calls[i].ctx, (long long) calls[i].start_ns, (long long) calls[i].dur_ns,
                calls[i].n_tokens);
    }
    fclose(f);
}
