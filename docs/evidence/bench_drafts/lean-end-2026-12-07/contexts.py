"""llama.cpp compute of one request on a solo session against an engine of N sequences, each in a process of its
own (one OpenMP team per process: ``power_core.compute``'s note), the receipts' target and draft compute and the
wall, medians of 8 requests after 2 warm-ups. Run from the repository root, alternating the sides:

    python docs/evidence/bench_drafts/lean-end-2026-12-07/contexts.py mtp solo|4|1
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
from bench_drafts import PROMPTS, _fixtures  # noqa: E402

from power_core.session import Session  # noqa: E402

suite, which = sys.argv[1], sys.argv[2]
tmp = Path(tempfile.gettempdir()) / "power-bench-fixtures"
tmp.mkdir(exist_ok=True)
target, draft = _fixtures(suite, tmp)
kw = dict(model=str(target), spec_mode=suite, n_threads=2, n_ctx=512, spec_draft_max=7,
          **({"draft": str(draft)} if draft else {}))
opener = (lambda: Session.open(**kw)) if which == "solo" else (lambda: Session.open_engine(int(which), **kw))
with opener() as x:
    s = x if which == "solo" else x.sessions[0]
    T, D, W = [], [], []
    for i in range(10):
        t = time.perf_counter()
        r = s.generate(PROMPTS[i % 4] + f" v{i}", max_tokens=192)
        w = time.perf_counter() - t
        tm = r.receipt.timings
        if i >= 2:
            T.append(tm["target_compute_s"] * 1e3)
            D.append(tm["draft_compute_s"] * 1e3)
            W.append(w * 1e3)
print(f"{suite} {which}: target {statistics.median(T):.1f} draft {statistics.median(D):.1f} "
      f"wall {statistics.median(W):.1f}")
