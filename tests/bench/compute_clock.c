// compute_clock: an LD_PRELOAD shim that times every llama_decode / llama_encode / llama_process call of
// a process (any context) and writes one line per call at exit, so a bench can split a llama.cpp tool's
// wall time into compute (time inside those calls, the same span Power's receipts time as compute) and
// host time (everything else). Used by tests/bench/bench_spec.py on llama-speculative-simple.
//
// Output (file named by $POWER_COMPUTE_TRACE, written at exit): "<ctx> <start_ns> <dur_ns> <n_tokens>" per
// call, CLOCK_MONOTONIC (the clock of ggml_time_us, so the tool's own "decoded N tokens in T s" window can
// be placed on it). Nested calls (llama_process calling llama_decode through the PLT) count once.
//
// Build: cc -O2 -shared -fPIC compute_clock.c -I<llama.cpp>/include -I<llama.cpp>/ggml/include -ldl

#define _GNU_SOURCE
#include <dlfcn.h>
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
    record(ctx, t0, -1);
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
