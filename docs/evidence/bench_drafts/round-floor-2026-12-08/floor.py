"""A solo greedy round's host time (wall less the target's and the proposer's compute clocks), on a bench_drafts
fixture (random weights, 192 tokens), one thread.

``floor.py SUITE N``: ``Transaction.step`` against the fewest Python calls that do the same round over the same
target and proposer (checkpoint, propose, decode, first maxima, accept, observe, rollback, commit), requests
alternating between the two; medians a round.

``floor.py SUITE N --calls``: the fewest-calls round only, each call's host time (its wall less the compute
clocks' advance over it; the first line is what such a lap costs with nothing in it), medians over every round.

    PATH=.nox/tests/bin:$PATH python floor.py {mtp,mtp-predictable,dflash} 20
    PATH=.nox/tests/bin:$PATH python floor.py {mtp,dflash} 6 --calls
"""

import collections
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "native"), str(ROOT / "tests" / "bench")]
from bench_drafts import _fixtures  # noqa: E402

from power_core.runtime import ProposalContext  # noqa: E402
from power_core.session import Session  # noqa: E402
from power_core.transaction import Transaction  # noqa: E402

K, TOKENS = 7, 192


def compute(txn: Transaction) -> float:
    return txn.target.capabilities.compute_seconds() + txn.proposer.capabilities.compute_seconds()


def fewest_calls(txn: Transaction, mark: Callable[[str | None], None] | None = None) -> int:
    """The request's rounds after round 0 by the protocol calls alone; ``mark(name)`` ends a lap named ``name``
    (``None``: starts one). Returns the number of rounds."""
    t, p = txn.target, txn.proposer
    anchor, emitted, hist, r = txn.anchor, len(txn.emitted), txn.history, 0
    while emitted < TOKENS:
        k = min(K, TOKENS - emitted - 1)
        if mark:
            mark(None)
            mark("(the lap itself)")
        cp = t.checkpoint()
        p.checkpoint()
        if mark:
            mark("checkpoints")
        ids = p.propose(ProposalContext(history=hist, anchor=anchor, k=k, round_index=r)).ids
        if mark:
            mark("propose")
        block = np.empty(ids.shape[0] + 1, np.int32)
        block[0], block[1:] = anchor, ids
        if mark:
            mark("block")
        res = t.decode(block)
        if mark:
            mark("decode")
        got = (res.greedy_ids[: block.shape[0]] if res.greedy_ids is not None
               else res.logits[: block.shape[0]].argmax(axis=1)).tolist()
        if mark:
            mark("argmax")
        drafted, out, acc = ids.tolist(), [], 0
        for j, tok in enumerate(got):
            out.append(tok)
            if j < len(drafted) and tok == drafted[j]:
                acc += 1
            else:
                break
        if mark:
            mark("accept")
        p.observe(res)
        if mark:
            mark("observe")
        if len(out) < block.shape[0]:
            t.rollback(cp, len(out))
        if mark:
            mark("rollback")
        p.commit(acc, np.asarray(out, dtype=np.int32))
        if mark:
            mark("commit")
        anchor, emitted, r = out[-1], emitted + len(out), r + 1
    return r


def main() -> None:
    suite, n, calls = sys.argv[1], int(sys.argv[2]), "--calls" in sys.argv[3:]
    Path("/tmp/round-floor").mkdir(exist_ok=True)
    target, draft = _fixtures(suite, Path("/tmp/round-floor"))
    by_step: list[float] = []
    minimal: list[float] = []
    laps: dict[str, list[float]] = collections.defaultdict(list)
    with Session.open(model=str(target), spec_mode=suite.split("-")[0], n_threads=1, n_ctx=512, spec_draft_max=K,
                      **({"draft": str(draft)} if draft else {})) as s:
        for i in range(n):
            gen = s.start([1, 2, 3, 5 + i % 40], max_tokens=TOKENS)
            s.driver()._claim(gen)
            txn = gen.begin()
            txn.prefill(gen.prompt)
            txn.step()  # round 0 (the prefill's row)
            if calls:
                at = [0.0, 0.0]

                def mark(name: str | None, txn: Transaction = txn, at: list[float] = at) -> None:
                    now, c = time.perf_counter(), compute(txn)
                    if name is not None:
                        laps[name].append((now - at[0] - (c - at[1])) * 1e6)
                    at[0], at[1] = time.perf_counter(), compute(txn)

                fewest_calls(txn, mark)
            else:
                c0, w0 = compute(txn), time.perf_counter()
                if i % 2 == 0:
                    r = 0
                    while txn.finished is None:
                        txn.step()
                        r += 1
                else:
                    r = fewest_calls(txn)
                (by_step if i % 2 == 0 else minimal).append(
                    (time.perf_counter() - w0 - (compute(txn) - c0)) / r * 1e6)
            gen.end(None)
            s.driver().release(s)
    if calls:
        for name, spans in laps.items():
            print(f"{name:18s} {statistics.median(spans):7.1f} us")
    else:
        print(f"{suite}: host us a round, Transaction.step {statistics.median(by_step):.1f} (n={len(by_step)}), "
              f"the fewest calls {statistics.median(minimal):.1f} (n={len(minimal)})")


if __name__ == "__main__":
    main()
