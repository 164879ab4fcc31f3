"""A logprobs row (``TokenLogprob.from_row``) before and after its top ids came from the sampled-bound head
(``power_core.sampling.top_ids``) instead of an ``argpartition`` of the row: ms per row, A and B alternated per
row, the same ids required (rows without ties across the cut, where both are defined). Run from the repository
root:

    python docs/evidence/bench_sampling/logprobs-top-2026-12-07/top.py
"""
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, ".")
from power_core.rounds import TokenLogprob  # noqa: E402


def before(row, token, n_top):  # TokenLogprob.from_row at 05a5cce
    x = np.asarray(row, dtype=np.float64)
    peak = float(x.max())
    lse = peak + float(np.log(np.exp(x - peak).sum()))
    n = min(n_top, x.shape[0])
    ids = np.argpartition(-x, n - 1)[:n]
    ids = ids[np.lexsort((ids, -x[ids]))]
    return TokenLogprob(token=int(token), logprob=float(x[token] - lse),
                        top=tuple((int(i), float(x[i] - lse)) for i in ids))


rng = np.random.default_rng(0)
for n in (151_936, 248_320):
    for n_top in (1, 5, 20):
        a, b = [], []
        for i in range(60):
            row = (rng.standard_normal(n) * 2.0).astype(np.float32)
            row[rng.integers(0, n, 20)] += rng.uniform(4, 14, 20).astype(np.float32)
            for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                t = time.perf_counter()
                got = before(row, 7, n_top) if side == 0 else TokenLogprob.from_row(row, 7, n_top)
                (a if side == 0 else b).append(time.perf_counter() - t)
                if side == 0:
                    ref = got
                else:
                    new = got
            assert ref == new, (n, n_top, i)
        print(f"n_vocab {n:7d} top {n_top:2d}: before {statistics.median(a) * 1e3:5.2f} ms, after "
              f"{statistics.median(b) * 1e3:5.2f} ms (median of 60 rows, same ids and logprobs)")
