"""``TargetSampler.sample`` without top-k on a 151,936-float row, against the full sort it replaced (kept here as
``by_full_sort``): ms a sampled token (median of 9 positions) and that both give the same token at each
position. Two kinds of rows: LLM-like (peaked: N(0, 2) plus 20 tokens 8-20 above) and flat (N(0, 3)).

    python sampler.py
"""
import time

import numpy as np

from power_core.sampling import TargetSampler


def by_full_sort(s: TargetSampler, row: np.ndarray, position: int) -> int:
    x = np.asarray(row, dtype=np.float64)
    cand = np.arange(x.shape[0])
    cand = cand[np.lexsort((cand, -x[cand]))]
    z = x[cand] / s.temperature
    z -= z[0]
    p = np.exp(z)
    p /= p.sum()
    keep = p.shape[0]
    if s.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(p), s.top_p)) + 1)
    if s.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(p >= s.min_p * p[0]))))
    cdf = np.cumsum(p[:keep])
    return int(cand[min(int(np.searchsorted(cdf, s.uniform(position) * cdf[-1], side="right")), keep - 1)])


g = np.random.default_rng(2)
peaked = (g.standard_normal(151936) * 2).astype(np.float32)
peaked[g.integers(0, 151936, 20)] += g.uniform(8, 20, 20).astype(np.float32)
flat = (np.random.default_rng(1).standard_normal(151936) * 3).astype(np.float32)
for name, row in (("peaked", peaked), ("flat", flat)):
    for t, top_p, min_p in ((0.7, 1.0, 0.0), (1.0, 1.0, 0.0), (1.0, 0.95, 0.05), (2.0, 1.0, 0.0)):
        s = TargetSampler(t, 0, top_p, min_p, 7)
        new, old = [], []
        for i in range(9):
            t0 = time.perf_counter()
            a = s.sample(row, i)
            new.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = by_full_sort(s, row, i)
            old.append(time.perf_counter() - t0)
            assert a == b, (name, t, top_p, min_p, i, a, b)
        print(f"{name} T={t} top_p={top_p} min_p={min_p}: head {sorted(new)[4] * 1e3:.2f} ms, "
              f"full sort {sorted(old)[4] * 1e3:.2f} ms, same tokens")
