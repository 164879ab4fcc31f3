"""c543567's accounting against the one before it, in one process, alternating request by request: before, a
round's stretch (``Charged``) read the compute clocks outside its timed span and the solo path built each round's
commit outside it. Per request: the wall less the receipt's prefill and decode (what no receipt field holds), and
``host_us_per_round``; then the paired differences. Run from the repository root:

    python docs/evidence/bench_drafts/served-2026-12-07/charge_toggle.py mtp|dflash PAIRS
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
from bench_drafts import PROMPTS, _fixtures  # noqa: E402

import power_core.engine as E  # noqa: E402
import power_core.passes as P  # noqa: E402
from power_core.errors import SessionBusy  # noqa: E402
from power_core.session import Session  # noqa: E402

suite, pairs = sys.argv[1], int(sys.argv[2])
tmp = Path(tempfile.gettempdir()) / "power-bench-fixtures"
tmp.mkdir(exist_ok=True)
target, draft = _fixtures(suite, tmp)
new = (P.Charged.__enter__, P.Charged.__exit__, E.Engine._solo_rounds)


def old_enter(self):
    self._before = self._gen.clock()
    self._t0 = P.perf_counter()
    return self


def old_exit(self, *exc):
    seconds = self.extra + P.perf_counter() - self._t0
    self._gen.charge(self._before, self._gen.clock(), seconds, self.rounds)


def old_rounds(self, gen):
    txn, failure = gen.txn, None
    try:
        if not gen.prefilled:
            t0 = time.perf_counter()
            txn.prefill(gen.prompt, gen.resident_prefix())
            gen.prefill_done(time.perf_counter() - t0)
        while txn.finished is None:
            if gen.session.closed:
                raise SessionBusy("closed")
            with P.Charged(gen) as charged:
                record = txn.step()
                charged.rounds = int(record is not None)
            if record is not None:
                yield P.commit_of(gen, record)
    except BaseException as exc:
        failure = exc
        raise
    finally:
        self.end_attempt(gen, failure)


old = (old_enter, old_exit, old_rounds)
res: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
with Session.open(model=str(target), spec_mode=suite.split("-")[0], n_threads=2, n_ctx=512, spec_draft_max=7,
                  **({"draft": str(draft)} if draft else {})) as s:
    s.generate("warm up", max_tokens=192)
    for i in range(pairs):
        for side in (("old", "new") if i % 2 else ("new", "old")):
            P.Charged.__enter__, P.Charged.__exit__, E.Engine._solo_rounds = old if side == "old" else new
            t = time.perf_counter()
            r = s.generate(PROMPTS[i % 4] + f" v{i}", max_tokens=192)
            wall = time.perf_counter() - t
            tm = r.receipt.timings
            res[side].append((wall * 1e3 - (tm["prefill_s"] + tm["decode_s"]) * 1e3, tm["host_us_per_round"]))
for side, v in res.items():
    print(f"{side}: outside prefill and decode, ms median {statistics.median(x[0] for x in v):.2f}; "
          f"host us a round median {statistics.median(x[1] for x in v):.1f}")
pairs_ = list(zip(res["old"], res["new"], strict=True))
print(f"paired: outside, old - new ms {statistics.median(a[0] - b[0] for a, b in pairs_):.3f}; "
      f"host a round, new - old us {statistics.median(b[1] - a[1] for a, b in pairs_):.2f}")
