"""Served against run, paired: a real ``power serve --parallel 4`` and a solo Session (``power run``'s) in this
client process, both alive, the two sides' requests alternating (the order flips each prompt), so each pair
meets the same minute of this machine. Per request: the wall (served: the client's), llama.cpp compute (the
receipt's target + draft compute), the receipt's rounds' host time, the time outside prefill and decode, and
the prefill. Paired per prompt: the differences, and served against run at equal compute,
(C + run's host) / (C + served host) with C the run's compute. Run from the repository root:

    python docs/evidence/bench_drafts/served-paired-2026-12-07/srvpair.py mtp|dflash REQUESTS
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
import httpx  # noqa: E402
from bench_drafts import PROMPTS, _fixtures  # noqa: E402

from power_core.session import Session  # noqa: E402
from tests.serve_helpers import listening, power_cmd  # noqa: E402

suite, n = sys.argv[1], int(sys.argv[2])
tmp = Path(tempfile.gettempdir()) / "power-bench-fixtures"
tmp.mkdir(exist_ok=True)
target, draft = _fixtures(suite, tmp)
cmd = power_cmd("serve", "--port", "0", "--model", str(target), "--mode", suite.split("-")[0],
                *(["--draft", str(draft)] if draft else []), "--threads", "2", "--n-ctx", "512", "--parallel", "4",
                "--draft-max", "7", *sys.argv[3:])
kw = dict(model=str(target), spec_mode=suite.split("-")[0], n_threads=2, n_ctx=512, spec_draft_max=7,
          **({"draft": str(draft)} if draft else {}))
R: dict[str, list[dict[str, float]]] = {"served": [], "run": []}
with listening(cmd) as srv, httpx.Client(timeout=600) as c, Session.open(**kw) as solo:
    model = c.get(srv.url + "/v1/models").json()["data"][0]["id"]
    for i in range(n + 2):  # the first two pairs warm up
        prompt = PROMPTS[i % 4] + f" v{i}"
        for side in (("served", "run") if i % 2 else ("run", "served")):
            t = time.perf_counter()
            if side == "served":
                body = {"model": model, "prompt": prompt, "max_tokens": 192, "temperature": 0}
                r = c.post(srv.url + "/v1/completions", json=body)
                wall = time.perf_counter() - t
                r.raise_for_status()
                rc = c.get(srv.url + f"/v1/receipts/{r.json()['id']}").json()["receipt"]
            else:
                rc = solo.generate(prompt, max_tokens=192).receipt.to_dict()
                wall = time.perf_counter() - t
            tm = rc["timings"]
            comp = tm["target_compute_s"] + (tm.get("draft_compute_s") or 0)
            if i >= 2:
                R[side].append(dict(wall=wall * 1e3, comp=comp * 1e3, rounds_host=tm["host_s"] * 1e3,
                                    outside=(wall - tm["prefill_s"] - tm["decode_s"]) * 1e3,
                                    pre=tm["prefill_s"] * 1e3))
med = statistics.median
for side, rows in R.items():
    print(suite, side, {k: round(med([r[k] for r in rows]), 2) for k in rows[0]})
pairs = list(zip(R["served"], R["run"], strict=True))
print("paired served - run, ms: wall - compute", round(med([(s["wall"] - s["comp"]) - (r["wall"] - r["comp"]) for s, r in pairs]), 2),
      "rounds' host", round(med([s["rounds_host"] - r["rounds_host"] for s, r in pairs]), 2),
      "outside prefill and decode", round(med([s["outside"] - r["outside"] for s, r in pairs]), 2),
      "prefill", round(med([s["pre"] - r["pre"] for s, r in pairs]), 2),
      "| served / run at equal compute", round(med([r["wall"] / (s["wall"] - s["comp"] + r["comp"]) for s, r in pairs]), 4))
