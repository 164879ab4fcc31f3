"""One context, passes of alternating widths, the graph cache off (llama.cpp's reuse: only the previous
pass's graph) and on (patch 0015), alternating in one process: µs a pass and the paired ratio, after
checking that both give the same rows. Run from the repository root:

    python docs/evidence/bench_drafts/graph-cache-2026-12-06/passes.py [MODEL.gguf]

(default: the bench fixtures' tiny hybrid target, written by ``inprocess.py`` under /tmp/pd)
"""
import statistics
import sys
import time

import numpy as np
from power_native import _llama

model = _llama.Model.load(sys.argv[1] if len(sys.argv) > 1 else "/tmp/pd/tiny-qwen35.gguf")
ctx = _llama.Context(model, n_ctx=8192, n_batch=64, n_threads=2)


def run(widths, n, on, keep=False):
    ctx.set_graph_cache(on)
    ctx.seq_rm(0, 0, -1)
    pos, rows = 0, []
    t = time.perf_counter()
    for i in range(n):
        w = widths[i % len(widths)]
        ctx.decode(np.full(w, 5 + i % 7, dtype=np.int32), pos)
        pos += w
        if keep:
            rows.append(np.array(ctx.logits()))
    return (time.perf_counter() - t) / n * 1e6, rows


pattern = [1, 3, 1, 8, 2, 1, 3]
_, a = run(pattern, 60, False, True)
_, b = run(pattern, 60, True, True)
print("same rows:", all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)))
for pattern in ([1], [1, 2], [8, 2], [8, 1, 1, 1, 1, 1, 1]):
    on, off = [], []
    for _ in range(7):
        off.append(run(pattern, 200, False)[0])
        on.append(run(pattern, 200, True)[0])
    ratio = statistics.median([x / y for x, y in zip(off, on, strict=True)])
    print(f"widths {pattern}: µs a pass off {statistics.median(off):.0f}, on {statistics.median(on):.0f}, "
          f"paired off/on {ratio:.3f}")
