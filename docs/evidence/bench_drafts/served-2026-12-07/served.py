"""One client's requests to a real ``power serve --parallel 4`` on bench_drafts' fixtures, one at a time: per
request the client's wall against the receipt's prefill and decode (the gap is what serving adds outside the
request's rounds), the receipt's host µs a round and llama.cpp compute, and the server's e2e/TTFT sums.
Run from the repository root (extra arguments go to ``power serve``; ``SHIM=1``: under bench_drafts' compute clock):

    python docs/evidence/bench_drafts/served-2026-12-07/served.py mtp|dflash REQUESTS [--numerics exact ...]
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
import httpx  # noqa: E402
from bench_drafts import PROMPTS, _fixtures  # noqa: E402

from tests.serve_helpers import listening, power_cmd  # noqa: E402

suite, n = sys.argv[1], int(sys.argv[2])
tmp = Path(tempfile.gettempdir()) / "power-bench-fixtures"
tmp.mkdir(exist_ok=True)
target, draft = _fixtures(suite, tmp)
cmd = power_cmd("serve", "--port", "0", "--model", str(target), "--mode", suite.split("-")[0],
                *(["--draft", str(draft)] if draft else []), "--threads", "2", "--n-ctx", "512", "--parallel", "4",
                "--draft-max", "7", *sys.argv[3:])
env = None
if os.environ.get("SHIM"):
    from host_clock import compute_clock, traced_env
    env = traced_env(dict(os.environ), compute_clock(tmp), tmp / "trace-served.txt")
rows = []
with listening(cmd, env=env) as srv, httpx.Client(timeout=600) as c:
    model = c.get(srv.url + "/v1/models").json()["data"][0]["id"]
    for i in range(n + 1):  # the first warms up
        body = {"model": model, "prompt": PROMPTS[i % 4] + f" v{i}", "max_tokens": 192, "temperature": 0}
        t = time.perf_counter()
        r = c.post(srv.url + "/v1/completions", json=body)
        wall = time.perf_counter() - t
        r.raise_for_status()
        receipt = c.get(srv.url + f"/v1/receipts/{r.json()['id']}").json()["receipt"]
        if i:
            rows.append((wall * 1e3, receipt["timings"]))
    metrics = c.get(srv.url + "/metrics").text
gaps = [w - (t["prefill_s"] + t["decode_s"]) * 1e3 for w, t in rows]
print("gap ms (client wall - prefill - decode):", [round(g, 1) for g in gaps], "median", round(statistics.median(gaps), 2))
print("prefill ms", [round(t["prefill_s"] * 1e3, 2) for _, t in rows])
for k in ("host_us_per_round", "target_compute_s", "draft_compute_s", "decode_s"):
    print(k, round(statistics.median(t[k] for _, t in rows), 5))
print("client wall ms median", round(statistics.median(w for w, _ in rows), 1))
print("\n".join(x for x in metrics.splitlines() if ("e2e" in x or "first_token" in x) and ("_sum" in x or "_count" in x)))
