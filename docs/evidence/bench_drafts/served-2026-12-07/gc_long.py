"""A real ``power serve --parallel 4`` on the MTP fixture answering REQUESTS 64-token completions one at a time:
the client's median, p99 and largest wall. With ``PYTHONPATH=docs/evidence/bench_drafts/served-2026-12-07/gcsite``
and ``GC_LOG=FILE`` every Python process of the run appends its full (generation 2) collections to FILE at exit:
(ms, objects frozen then, time), to set against the time serving began, which this prints. Run from the
repository root:

    GC_LOG=/tmp/gc.log PYTHONPATH=docs/evidence/bench_drafts/served-2026-12-07/gcsite \\
        python docs/evidence/bench_drafts/served-2026-12-07/gc_long.py 400
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
import httpx  # noqa: E402
from bench_drafts import PROMPTS, _fixtures  # noqa: E402

from tests.serve_helpers import listening, power_cmd  # noqa: E402

tmp = Path(tempfile.gettempdir()) / "power-bench-fixtures"
tmp.mkdir(exist_ok=True)
target, _ = _fixtures("mtp", tmp)
n = int(sys.argv[1])
walls = []
cmd = power_cmd("serve", "--port", "0", "--model", str(target), "--mode", "mtp", "--threads", "2", "--n-ctx", "512",
                "--parallel", "4", "--draft-max", "7")
with listening(cmd) as s, httpx.Client(timeout=600) as c:
    model = c.get(s.url + "/v1/models").json()["data"][0]["id"]
    began = time.time()
    for i in range(n):
        t = time.perf_counter()
        c.post(s.url + "/v1/completions", json={"model": model, "prompt": PROMPTS[i % 4] + f" v{i}", "max_tokens": 64,
                                                "temperature": 0}).raise_for_status()
        walls.append((time.perf_counter() - t) * 1e3)
print(f"serving from {began % 1000:.3f}: {n} requests, wall ms median {statistics.median(walls):.1f} "
      f"p99 {sorted(walls)[int(0.99 * n)]:.1f} max {max(walls):.1f}")
