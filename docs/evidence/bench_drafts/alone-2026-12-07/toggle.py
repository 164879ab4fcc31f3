"""A request that decodes alone in the shared passes' driver: its round as a solo step (``SharedPasses._alone``,
"on") against the general shared pass of one block ("off": ``SharedPasses._pass`` without that branch), in one
process, alternating request by request (bench_drafts' fixtures, an engine of one sequence, 192-token
requests); per side the median request wall and the receipts' host µs a round, then the paired ratios. Run from
the repository root:

    python docs/evidence/bench_drafts/alone-2026-12-07/toggle.py {mtp|mtp-predictable|dflash|dspark} REQUESTS
"""
import inspect
import statistics
import sys
import textwrap
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
from bench_drafts import _fixtures  # noqa: E402

import power_core.passes as passes  # noqa: E402
from power_core.session import Session  # noqa: E402

src = textwrap.dedent(inspect.getsource(passes.SharedPasses._pass))
off_src = src.replace("""    if len(active) == 1 and active[0].gen.prefilled:
        self._alone(active[0])
        return
""", "")
assert off_src != src
ns = dict(passes.__dict__)
exec(off_src, ns)
ON, OFF = passes.SharedPasses._pass, ns["_pass"]
suite, n = sys.argv[1], int(sys.argv[2])
target, draft = _fixtures(suite, Path("/tmp/pd"))
mode = suite.split("-")[0]
res = {"on": [], "off": []}
with Session.open_engine(1, model=str(target), spec_mode=mode, n_threads=2, n_ctx=512, spec_draft_max=7,
                         **({"draft": str(draft)} if draft else {})) as eng:
    s = eng.sessions[0]
    s.generate([1, 2, 3, 4], max_tokens=192)
    for i in range(n):
        for side in (("on", "off") if i % 2 == 0 else ("off", "on")):
            passes.SharedPasses._pass = ON if side == "on" else OFF
            t = time.perf_counter()
            r = s.generate([1, 2, 3, 5 + i % 40], max_tokens=192)
            w = time.perf_counter() - t
            tm = r.receipt.to_dict()["timings"]
            res[side].append((w, tm["host_us_per_round"]))
for side, v in res.items():
    print(f"{suite} lane {side:3s}: wall median {statistics.median(x[0] for x in v)*1e3:6.1f} ms, host µs a round median "
          f"{statistics.median(x[1] for x in v):6.1f}, least {min(x[1] for x in v):6.1f}")
ratios = [a[0] / b[0] for a, b in zip(res["off"], res["on"], strict=True)]
hd = [a[1] - b[1] for a, b in zip(res["off"], res["on"], strict=True)]
print(f"paired: wall off/on median {statistics.median(ratios):.3f}; host off-on median {statistics.median(hd):.1f} µs a round "
      f"({sum(1 for x in hd if x > 0)}/{len(hd)} pairs on lower)")
