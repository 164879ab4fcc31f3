"""``power_native._llama.first_max`` (the drafters' host first-maximum rule) against numpy's argmax on one row of
N float32 values (uniform random), µs a call, median of 3 x 200 calls; and that both give the same index.

    python first_max.py [N]
"""
import statistics
import sys
import time

import numpy as np

from power_native import _llama

n = int(sys.argv[1]) if len(sys.argv) > 1 else 151936
row = np.random.default_rng(1).random(n, dtype=np.float32)
assert _llama.first_max(row) == int(row.argmax())
times: dict[str, list[float]] = {"first_max": [], "numpy argmax": []}
for _ in range(3):
    for name, fn in (("first_max", lambda: _llama.first_max(row)), ("numpy argmax", row.argmax)):
        t = time.perf_counter()
        for _ in range(200):
            fn()
        times[name].append((time.perf_counter() - t) / 200 * 1e6)
print(f"n={n}, max at {int(row.argmax())}: " + ", ".join(f"{k} {statistics.median(v):.1f} µs" for k, v in times.items()))
