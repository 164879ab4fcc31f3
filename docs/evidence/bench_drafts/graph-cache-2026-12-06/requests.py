"""Requests of 192 tokens in process on bench_drafts' fixtures (``_fixtures``), the graph cache off and on
for every context of the session (target, draft), alternating request by request: the median ms a
request each way and the median paired ratio; the tokens must be the same both ways. Run from the
repository root:

    python docs/evidence/bench_drafts/graph-cache-2026-12-06/requests.py dflash|dspark|mtp|mtp-predictable [PAIRS]
"""
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
from bench_drafts import _fixtures  # noqa: E402

from power_core.session import Session  # noqa: E402

suite = sys.argv[1]
pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 12
target, draft = _fixtures(suite, Path("/tmp/pd"))
with Session.open_engine(1, model=str(target), spec_mode=suite.split("-")[0], n_threads=2, n_ctx=512, spec_draft_max=7,
                         **({"draft": str(draft)} if draft is not None else {})) as eng:
    sess = eng.sessions[0]
    proposer = sess.lanes[0].proposer
    ctxs = [sess.opened.target.ctx]
    if hasattr(proposer, "head"):  # MTP
        ctxs.append(proposer.head.ctx)
    if hasattr(proposer, "draft") and hasattr(proposer.draft, "ctx"):  # the DFlash family
        ctxs.append(proposer.draft.ctx)

    def request(on, i):
        for c in ctxs:
            c.set_graph_cache(on)
        t = time.perf_counter()
        r = sess.generate([1, 2, 3, 4 + i % 50], max_tokens=192)
        return time.perf_counter() - t, r.tokens

    for i in range(2):
        request(True, i)
        request(False, i)
    off, on = [], []
    for i in range(pairs):
        a, ta = request(False, i)
        b, tb = request(True, i)
        assert ta == tb, f"request {i}: the tokens differ"
        off.append(a)
        on.append(b)
print(f"{suite}: ms a request off {statistics.median(off) * 1e3:.1f}, on {statistics.median(on) * 1e3:.1f}, paired "
      f"off/on {statistics.median([x / y for x, y in zip(off, on, strict=True)]):.3f} ({pairs} pairs, the same tokens)")
