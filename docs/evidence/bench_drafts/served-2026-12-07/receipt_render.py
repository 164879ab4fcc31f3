"""What rendering a 192-round MTP receipt costs: its digest (the canonical JSON and its sha256), then its full JSON
(``to_json``), each on a fresh copy; medians of 30. Run from the repository root:

    python docs/evidence/bench_drafts/served-2026-12-07/receipt_render.py
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
import attrs  # noqa: E402
from bench_drafts import _fixtures  # noqa: E402

from power_core.session import Session  # noqa: E402

tmp = Path(tempfile.gettempdir()) / "power-bench-fixtures"
tmp.mkdir(exist_ok=True)
target, _ = _fixtures("mtp", tmp)
with Session.open(model=str(target), spec_mode="mtp", n_threads=2, n_ctx=512, spec_draft_max=7) as s:
    g = s.start([1, 2, 3, 4], max_tokens=192)
    g.run()
    r = g.receipt
d, j = [], []
for _ in range(30):
    x = attrs.evolve(r)
    t = time.perf_counter()
    x.digest()
    d.append((time.perf_counter() - t) * 1e3)
    t = time.perf_counter()
    x.to_json(indent=None)
    j.append((time.perf_counter() - t) * 1e3)
print(f"{len(r.rounds)}-round MTP receipt: digest {statistics.median(d):.2f} ms, then to_json {statistics.median(j):.2f} ms; "
      f"canonical {r.canonical_bytes} B, full {len(r.to_json(indent=None))} B")
