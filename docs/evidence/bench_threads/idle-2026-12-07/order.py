"""Sessions and engines one after another in one process, DFlash on bench_drafts' fixtures (``_fixtures``,
written under /tmp/pd), the compute thread ending after ``IDLE`` seconds without a call (``1e9``: never, as
before 2026-12-07): the median ms of 6 requests of 192 tokens each. Run from the repository root:

    python docs/evidence/bench_threads/idle-2026-12-07/order.py dflash solo,engine,solo,engine IDLE
"""
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
from bench_drafts import _fixtures  # noqa: E402

import power_core.compute as compute  # noqa: E402
from power_core.session import Session  # noqa: E402

mode, order, idle = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3])
compute._compute = compute.ComputeThread(idle=idle)
target, draft = _fixtures(mode, Path("/tmp/pd"))
mode = mode.split("-")[0]
kw = dict(model=str(target), spec_mode=mode, n_threads=2, n_ctx=512, spec_draft_max=7, **({"draft": str(draft)} if draft else {}))
def run(sess, tag, n=6):
    for i in range(2):
        sess.generate([1, 2, 3, 4 + i], max_tokens=192)
    ms = []
    for i in range(n):
        t = time.perf_counter()
        sess.generate([1, 2, 3, 4 + i % 50], max_tokens=192)
        ms.append((time.perf_counter() - t) * 1e3)
    print(f"idle={idle} {tag}: ms/request median {statistics.median(ms):.1f}", flush=True)
for p in order:
    if p == "solo":
        with Session.open(**kw) as s:
            run(s, "solo  ")
    else:
        with Session.open_engine(1, **kw) as eng:
            run(eng.sessions[0], "engine")
