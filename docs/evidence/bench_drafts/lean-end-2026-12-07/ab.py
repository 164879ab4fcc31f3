"""The request's end and a lone request's passes, before and after (#46), paired in one process.

    python docs/evidence/bench_drafts/lean-end-2026-12-07/ab.py mtp|dflash PAIRS

1. The receipt at a request's end, on a real 192-round receipt: the former implementations (copied here: the
   round's dict by comprehension, the summary's six passes, the canonical JSON by ``json``) against the
   present ones, alternating, median µs of 80 calls each.
2. A lone request on an engine of 4 sequences (``power serve --parallel 4``'s): the former ``SharedPasses._alone``
   (one round, then back to the driver's loop: its lock, its condition, its lists) against the present one
   (round after round while nobody joins), alternating request by request; per request the wall (ms) and the
   receipt's host ms, and the paired ratio.
"""
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [".", "tests/native", "tests/bench"]
import attrs  # noqa: E402
from bench_drafts import PROMPTS, _fixtures  # noqa: E402

import power_core.passes as passes  # noqa: E402
import power_core.receipt as R  # noqa: E402
from power_core.passes import Charged  # noqa: E402
from power_core.rounds import RoundRecord  # noqa: E402
from power_core.session import Session  # noqa: E402

suite, n = sys.argv[1], int(sys.argv[2])
tmp = Path(tempfile.gettempdir()) / "power-bench-fixtures"
tmp.mkdir(exist_ok=True)
target, draft = _fixtures(suite, tmp)
kw = dict(model=str(target), spec_mode=suite.split("-")[0], n_threads=2, n_ctx=512, spec_draft_max=7,
          **({"draft": str(draft)} if draft else {}))
FIELDS = tuple(a.name for a in attrs.fields(RoundRecord))


def old_to_dict(self):
    out = {name: getattr(self, name) for name in FIELDS}
    for key in ("width", "stats"):
        if out[key] is not None:
            out[key] = dict(out[key])
    for key in ("proposal", "width", "source", "stats"):
        if out[key] is None:
            del out[key]
    if not self.cut:
        del out["cut"]
    if self.proposal is not None:
        out["proposal"] = list(self.proposal)
    return out


def old_summary(r):
    rounds = r.rounds
    proposed = sum(x["proposed"] for x in rounds)
    accepted = sum(x["accepted"] for x in rounds)
    return {"rounds": len(rounds), "proposed": sum(x["proposed"] for x in rounds),
            "accepted": sum(x["accepted"] for x in rounds), "acceptance": accepted / proposed if proposed else None,
            "verified_tokens_per_pass": sum(x["emitted"] for x in rounds) / len(rounds) if rounds else None,
            "replays": sum(1 for x in rounds if x["replayed"]), "circuit_open": bool(r.scheduler.get("circuit_open"))}


def old_digest(r):
    body = {a.name: getattr(r, a.name) for a in attrs.fields(R.Receipt) if not a.name.startswith("_")}
    body["proposer"] = r.proposer
    body["summary"] = old_summary(r)
    del body["timings"]
    body["rounds"] = [{k: v for k, v in x.items() if k != "seconds"} for x in r.rounds]
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=R._plain).encode()).hexdigest()


def old_alone(self, a):
    txn = a.gen.txn
    self._last_prefill = 0
    p0 = txn.target_passes
    try:
        with Charged(a.gen) as charged:
            record = txn.step()
            charged.rounds = int(record is not None)
    except BaseException as exc:
        self._leave(a, exc)
        return
    if record is None:
        self._leave(a, None)
        return
    if txn.target_passes > p0:
        a.passes += 1
        a.pass_tokens += record.shape
        a.peak = max(a.peak, 1)
    self._committed(a, record)


def us(fn, k=80):
    ts = []
    for _ in range(k):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


new_alone = passes.SharedPasses._alone
with Session.open_engine(4, **kw) as eng:
    s = eng.sessions[0]
    for i in range(2):
        s.generate(PROMPTS[i % 4] + f" w{i}", max_tokens=192)
    g = s.start(PROMPTS[0] + " r", max_tokens=192)
    g.run()
    r, recs = g.receipt, g.txn.rounds
    assert old_digest(r) == r.digest() and [old_to_dict(x) for x in recs] == [x.to_dict() for x in recs]
    assert old_summary(r) == r.summary()
    rows = {"rounds to dicts": (lambda: [old_to_dict(x) for x in recs], lambda: [x.to_dict() for x in recs]),
            "summary": (lambda: old_summary(r), lambda: attrs.evolve(r).summary()),
            "digest": (lambda: old_digest(r), lambda: attrs.evolve(r).digest())}
    print(f"receipt of {len(recs)} rounds, median µs (former -> present):")
    for name, (old, new) in rows.items():
        a, b = [], []
        for _ in range(5):
            a.append(us(old))
            b.append(us(new))
        print(f"  {name}: {statistics.median(a):.1f} -> {statistics.median(b):.1f}")
    W = {"former": [], "present": []}
    H = {"former": [], "present": []}
    for i in range(n + 2):
        order = ("former", "present") if i % 2 else ("present", "former")
        for side in order:
            passes.SharedPasses._alone = old_alone if side == "former" else new_alone
            t = time.perf_counter()
            res = s.generate(PROMPTS[i % 4] + f" v{i}", max_tokens=192)
            wall = time.perf_counter() - t
            if i >= 2:
                W[side].append(wall * 1e3)
                H[side].append(res.receipt.timings["host_s"] * 1e3)
    passes.SharedPasses._alone = new_alone
    ratio = [b / a for a, b in zip(W["former"], W["present"], strict=True)]
    print(f"{suite}, a lone request on an engine of 4, {n} pairs of 192 tokens: wall ms former "
          f"{statistics.median(W['former']):.2f} present {statistics.median(W['present']):.2f} (paired present/former "
          f"{statistics.median(ratio):.4f}, diff {statistics.median([b - a for a, b in zip(W['former'], W['present'], strict=True)]):+.2f} ms); "
          f"receipt host ms former {statistics.median(H['former']):.2f} present {statistics.median(H['present']):.2f}")
