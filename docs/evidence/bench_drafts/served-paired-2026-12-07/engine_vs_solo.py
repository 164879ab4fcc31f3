"""A solo Session against an engine of N sequences (default 4: ``power serve --parallel 4``'s) in one process,
requests alternating: per side the host ms a request (the receipt's), compute and wall, and the paired ratio.

    python docs/evidence/bench_drafts/served-paired-2026-12-07/engine_vs_solo.py dflash|mtp PAIRS [N]
"""
import statistics, sys, tempfile, time
from pathlib import Path
sys.path[:0] = [".", "tests/native", "tests/bench"]
from bench_drafts import PROMPTS, _fixtures
from power_core.session import Session
suite = sys.argv[1]; n = int(sys.argv[2]); other = int(sys.argv[3]) if len(sys.argv) > 3 else 4
tmp = Path(tempfile.gettempdir()) / "power-bench-fixtures"; tmp.mkdir(exist_ok=True)
target, draft = _fixtures(suite, tmp)
kw = dict(model=str(target), spec_mode=suite.split("-")[0], n_threads=2, n_ctx=512, spec_draft_max=7,
          **({"draft": str(draft)} if draft else {}))
with Session.open(**kw) as solo, Session.open_engine(other, **kw) as eng:
    sides = {"solo": solo, f"engine{other}": eng.sessions[0]}
    H = {k: [] for k in sides}; W = {k: [] for k in sides}; C = {k: [] for k in sides}
    for i in range(n + 2):
        for name, s in (sides.items() if i % 2 else reversed(list(sides.items()))):
            t = time.perf_counter()
            r = s.generate(PROMPTS[i % 4] + f" v{i}", max_tokens=192)
            wall = time.perf_counter() - t
            tm = r.receipt.to_dict()["timings"]
            if i >= 2:
                H[name].append(tm["host_s"] * 1e3); W[name].append(wall * 1e3)
                C[name].append((tm["target_compute_s"] + (tm.get("draft_compute_s") or 0)) * 1e3)
    a, b = list(sides)
    ratio_h = [x / y for x, y in zip(H[b], H[a])]; ratio_w = [x / y for x, y in zip(W[b], W[a])]
    for k in sides:
        print(f"{suite} {k}: host ms/request median {statistics.median(H[k]):.2f}, compute {statistics.median(C[k]):.1f}, wall {statistics.median(W[k]):.1f}")
    print(f"paired {b}/{a}: host {statistics.median(ratio_h):.3f}, wall {statistics.median(ratio_w):.3f}, "
          f"host diff ms {statistics.median([x - y for x, y in zip(H[b], H[a])]):.2f}")
