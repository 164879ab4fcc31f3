"""A solo greedy round's host time: ``Transaction.step`` against the fewest Python calls that do the same round over
the same target and proposer (checkpoint, propose, decode, first maxima, accept, observe, rollback, commit),
requests alternating between the two, on one thread, on a bench_drafts fixture (random weights, 192 tokens).
Host time a round = wall less the target's and the proposer's compute clocks.

    PATH=.nox/tests/bin:$PATH python floor.py {mtp,mtp-predictable,dflash} 20
"""

import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "native"), str(ROOT / "tests" / "bench")]
from bench_drafts import _fixtures  # noqa: E402

from power_core.runtime import ProposalContext  # noqa: E402
from power_core.session import Session  # noqa: E402

suite, n, K = sys.argv[1], int(sys.argv[2]), 7
Path("/tmp/round-floor").mkdir(exist_ok=True)
target, draft = _fixtures(suite, Path("/tmp/round-floor"))


def compute(t, p) -> float:
    return t.capabilities.compute_seconds() + p.capabilities.compute_seconds()


with Session.open(
    model=str(target),
    spec_mode=suite.split("-")[0],
    n_threads=1,
    n_ctx=512,
    spec_draft_max=K,
    **({"draft": str(draft)} if draft else {}),
) as s:
    by_step, minimal = [], []
    for i in range(n):
        gen = s.start([1, 2, 3, 5 + i % 40], max_tokens=192)
        s.driver()._claim(gen)
        txn = gen.begin()
        txn.prefill(gen.prompt)
        txn.step()  # round 0 (the prefill's row)
        t, p = txn.target, txn.proposer
        c0, w0, r = compute(t, p), time.perf_counter(), 0
        if i % 2 == 0:
            while txn.finished is None:
                txn.step()
                r += 1
            by_step.append((time.perf_counter() - w0 - (compute(t, p) - c0)) / r * 1e6)
        else:
            anchor, emitted, hist = txn.anchor, len(txn.emitted), txn.history
            while emitted < 192:
                k = min(K, 192 - emitted - 1)
                cp = t.checkpoint()
                p.checkpoint()
                ids = p.propose(ProposalContext(history=hist, anchor=anchor, k=k, round_index=r)).ids
                block = np.empty(ids.shape[0] + 1, np.int32)
                block[0], block[1:] = anchor, ids
                res = t.decode(block)
                got = (
                    res.greedy_ids[: block.shape[0]]
                    if res.greedy_ids is not None
                    else res.logits[: block.shape[0]].argmax(axis=1)
                ).tolist()
                drafted, out, acc = ids.tolist(), [], 0
                for j, tok in enumerate(got):
                    out.append(tok)
                    if j < len(drafted) and tok == drafted[j]:
                        acc += 1
                    else:
                        break
                p.observe(res)
                if len(out) < block.shape[0]:
                    t.rollback(cp, len(out))
                p.commit(acc, np.asarray(out, dtype=np.int32))
                anchor, emitted, r = out[-1], emitted + len(out), r + 1
            minimal.append((time.perf_counter() - w0 - (compute(t, p) - c0)) / r * 1e6)
        gen.end(None)
        s.driver().release(s)
    print(
        f"{suite}: host us a round, Transaction.step {statistics.median(by_step):.1f} (n={len(by_step)}), "
        f"the fewest calls {statistics.median(minimal):.1f} (n={len(minimal)})"
    )
