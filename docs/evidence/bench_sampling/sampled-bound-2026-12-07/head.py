"""``TargetSampler.sample`` without top-k: the head of the order found as every logit at or above a bound from a
strided sample of the row (``power_core.sampling.head_order``) against the ``argpartition`` of the 64 largest it
replaced (``by_argpartition`` below, swapped in for A). One process, A and B alternated for each position; the
tokens of both compared. ms a sampled token, median of 15 positions.

    python head.py
"""

import statistics
import time

import numpy as np

import power_core.sampling as sampling
from power_core.sampling import TargetSampler

NEW = sampling.head_order


def by_argpartition(x: np.ndarray, m: int) -> tuple[np.ndarray, int]:
    head = np.argpartition(-x, m - 1)[:m]
    order = head[np.lexsort((head, -x[head]))]
    return order, int(np.searchsorted(-x[order], -x[order[-1]], side="left"))


def rows(n: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(2)
    peaked = (g.standard_normal(n) * 2).astype(np.float32)
    peaked[g.integers(0, n, 20)] += g.uniform(8, 20, 20).astype(np.float32)
    flat = (np.random.default_rng(1).standard_normal(n) * 3).astype(np.float32)
    return {"peaked": peaked, "flat": flat}


print("| vocabulary | row | T, top_p, min_p | argpartition ms | sampled bound ms | same tokens |")
print("|---|---|---|---|---|---|")
for n in (151_936, 248_320):
    for name, row in rows(n).items():
        for t, top_p, min_p in ((0.7, 1.0, 0.0), (1.0, 0.95, 0.05), (2.0, 1.0, 0.0)):
            s = TargetSampler(t, 0, top_p, min_p, 7)
            a, b, same = [], [], True
            for pos in range(15):
                got = []
                for head, into in ((by_argpartition, a), (NEW, b)):
                    sampling.head_order = head
                    t0 = time.perf_counter()
                    got.append(s.sample(row, pos))
                    into.append((time.perf_counter() - t0) * 1e3)
                same &= got[0] == got[1]
            sampling.head_order = NEW
            print(f"| {n:,} | {name} | {t}, {top_p}, {min_p} | {statistics.median(a):.2f} | {statistics.median(b):.2f} "
                  f"| {same} |")
