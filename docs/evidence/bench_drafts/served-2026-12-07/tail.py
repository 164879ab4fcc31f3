"""In process, no HTTP: one request at a time as ``power run`` decodes it (``0``: a solo Session) or on an engine of
N sequences (the shared passes' driver, as ``power serve --parallel N``): the wall less the receipt's prefill and
decode (a request's fixed cost outside its rounds), and what ``Generation.end``/``report``/``_receipt`` take of it.
Run from the repository root:

    python docs/evidence/bench_drafts/served-2026-12-07/tail.py mtp|dflash 0|4
"""
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
from bench_drafts import PROMPTS, _fixtures  # noqa: E402

import power_core.generation as G  # noqa: E402
from power_core.session import Session  # noqa: E402

suite, nseq = sys.argv[1], int(sys.argv[2])
tmp = Path(tempfile.gettempdir()) / "power-bench-fixtures"
tmp.mkdir(exist_ok=True)
target, draft = _fixtures(suite, tmp)
kw = dict(model=str(target), spec_mode=suite.split("-")[0], n_threads=2, n_ctx=512, spec_draft_max=7,
          **({"draft": str(draft)} if draft else {}))
T: dict[str, list[float]] = collections.defaultdict(list)


def timed(name: str) -> None:
    orig = getattr(G.Generation, name)

    def f(*a, **k):
        t = time.perf_counter()
        r = orig(*a, **k)
        T[name].append((time.perf_counter() - t) * 1e3)
        return r

    setattr(G.Generation, name, f)


for name in ("end", "report", "_receipt"):
    timed(name)
with Session.open_engine(nseq, **kw) if nseq else Session.open(**kw) as opened:
    s = opened.sessions[0] if nseq else opened
    gaps = []
    for i in range(10):  # the first warms up
        t = time.perf_counter()
        r = s.generate(PROMPTS[i % 4] + f" v{i}", max_tokens=192)
        wall = time.perf_counter() - t
        tm = r.receipt.to_dict()["timings"]
        if i:
            gaps.append(wall * 1e3 - (tm["prefill_s"] + tm["decode_s"]) * 1e3)
print("sequences", nseq or "solo", f"wall - prefill - decode, ms median {statistics.median(gaps):.2f}")
for k, v in T.items():
    print("  ", k, f"ms median {statistics.median(v[1:]):.3f}")
