"""DFlash, DSpark or MTP requests one at a time in process, no HTTP, on bench_drafts' fixtures (its ``_fixtures``):
ms per request, the median and least host µs a round over the requests' receipts, and the last receipt's
compute/host split; with ``profile``, instead a cProfile of the shared passes' driver thread
(``SharedPasses._loop``) over the requests. Run from the repository root:

    python docs/evidence/bench_drafts/host-2026-12-06/inprocess.py [REQUESTS] [dflash|dspark|mtp|mtp-predictable] [profile [SORT]]

(a bench_drafts suite: ``mtp-predictable`` runs the ``mtp`` strategy on that suite's fixture)
"""
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
from bench_drafts import _fixtures  # noqa: E402

import power_core.passes as passes  # noqa: E402
from power_core.session import Session  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 10
mode = sys.argv[2] if len(sys.argv) > 2 else "dflash"
profile = cProfile.Profile() if len(sys.argv) > 3 and sys.argv[3] == "profile" else None
if profile is not None:
    loop = passes.SharedPasses._loop

    def profiled(self):
        profile.enable()
        try:
            loop(self)
        finally:
            profile.disable()

    passes.SharedPasses._loop = profiled
target, draft = _fixtures(mode, Path("/tmp/pd"))
mode = mode.split("-")[0]  # the suite's strategy
with Session.open_engine(1, model=str(target), spec_mode=mode, n_threads=2, n_ctx=512, spec_draft_max=7,
                         **({"draft": str(draft)} if draft is not None else {})) as eng:
    sess = eng.sessions[0]
    for i in range(2):
        sess.generate([1, 2, 3, 4 + i], max_tokens=192)
    t = time.perf_counter()
    host = []
    for i in range(n):
        r = sess.generate([1, 2, 3, 4 + i % 50], max_tokens=192)
        host.append(r.receipt.to_dict()["timings"]["host_us_per_round"])
    dt = (time.perf_counter() - t) / n
rc = r.receipt.to_dict()
if profile is not None:
    pstats.Stats(profile).sort_stats(sys.argv[4] if len(sys.argv) > 4 else "tottime").print_stats(45)
else:
    print(f"{mode}: {dt * 1e3:.2f} ms/request, tokens {len(r.tokens)}, rounds {len(rc['rounds'])}, host µs a round: "
          f"median {statistics.median(host):.1f}, least {min(host):.1f}")
    print(json.dumps(rc["timings"], indent=0))
