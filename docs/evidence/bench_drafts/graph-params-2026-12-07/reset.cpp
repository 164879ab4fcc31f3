// full vs sparse scheduler-table reset, cold caches between resets (a pass's weights sweep them)
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
int main(int argc, char** argv) {
    size_t size = argc > 1 ? atol(argv[1]) : 32771, used_n = argc > 2 ? atol(argv[2]) : 600, per = 1;
    std::vector<int> ids(size, -1); std::vector<void*> copies(size * per, nullptr);
    std::vector<uint32_t> bits((size + 31) / 32, 0);
    std::vector<char> sweep(32 << 20, 1);  // 32 MB: evicts L2/L3 as a pass over the weights does
    std::mt19937 rng(1);
    std::vector<double> t_full, t_sparse;
    volatile long sink = 0;
    for (int it = 0; it < 400; ++it) {
        // the split marks used slots and writes their entries
        for (size_t k = 0; k < used_n; ++k) { size_t i = rng() % size; bits[i >> 5] |= 1u << (i & 31); ids[i] = 0; copies[i * per] = (void*) ids.data(); }
        for (size_t j = 0; j < sweep.size(); j += 64) sink += sweep[j];
        auto t0 = std::chrono::steady_clock::now();
        if (it & 1) {
            for (size_t w = 0; w < bits.size(); ++w) { uint32_t b = bits[w];
                for (size_t i = w << 5; b != 0; ++i, b >>= 1) if (b & 1) { ids[i] = -1; memset(&copies[i * per], 0, per * sizeof(void*)); } }
            memset(bits.data(), 0, bits.size() * 4);
        } else {
            memset(bits.data(), 0, bits.size() * 4);
            memset(ids.data(), -1, size * 4); memset(copies.data(), 0, size * per * sizeof(void*));
        }
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        (it & 1 ? t_sparse : t_full).push_back(us);
    }
    auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    printf("size %zu used %zu: full %.1f us, sparse %.1f us (medians of %zu)\n", size, used_n, med(t_full), med(t_sparse), t_full.size());
}
