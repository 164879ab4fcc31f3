"""A whole-vocabulary draw (``TargetSampler.sample`` without top-k) before and after its row arrays went into
buffers kept per thread (``power_core.sampling._Rows``): ms per draw, the sampler of 7b1cbb5 (read with ``git
show``) and today's alternated per row, the same token required at every row. Peaked rows as a language model's
(``peaked``) and flat ones (``flat``: the head grows to the whole row), T = 0.8, top-p 0.95, min-p 0.05 and T = 1
with no cut, and top-k 40 (its candidates now the sampled-bound head's first 40). Run from the repository root of a git clone:

    python docs/evidence/bench_sampling/row-buffers-2026-12-07/draw.py
"""
import statistics
import subprocess
import sys
import time
import types

import numpy as np

sys.path.insert(0, ".")
from power_core.sampling import TargetSampler  # noqa: E402

old = types.ModuleType("old_sampling")
exec(subprocess.run(["git", "show", "7b1cbb5:power_core/sampling.py"], capture_output=True, text=True, check=True).stdout,
     old.__dict__)

rng = np.random.default_rng(0)
for n in (151_936, 248_320):
    for kind in ("peaked", "flat"):
        for args in ((0.8, 0, 0.95, 0.05), (1.0, 0, 1.0, 0.0), (0.8, 40, 0.95, 0.05)):
            a, b = [], []
            new_s, old_s = TargetSampler(*args, 7), old.TargetSampler(*args, 7)
            for i in range(40 if kind == "peaked" else 10):
                row = (rng.standard_normal(n) * 2.0).astype(np.float32)
                if kind == "peaked":
                    row[rng.integers(0, n, 20)] += rng.uniform(4, 14, 20).astype(np.float32)
                got = {}
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    t = time.perf_counter()
                    got[side] = (old_s if side == 0 else new_s).sample(row, i)
                    (a if side == 0 else b).append(time.perf_counter() - t)
                assert got[0] == got[1], (n, kind, args, i)
            print(f"n_vocab {n:7d} {kind:6s} T={args[0]} top_k={args[1]} top_p={args[2]} min_p={args[3]}: before "
                  f"{statistics.median(a) * 1e3:6.2f} ms, after {statistics.median(b) * 1e3:6.2f} ms "
                  f"(median of {len(a)} draws, the same tokens)")
