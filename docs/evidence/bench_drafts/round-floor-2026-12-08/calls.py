"""The fewest-calls round of ``floor.py``, each call's host time (its wall less the compute clocks' advance over it;
the first line is what such a measurement costs with nothing in it), medians over every round of N requests.

    PATH=.nox/tests/bin:$PATH python calls.py {mtp,dflash} 6
"""

import collections
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

suite = sys.argv[1]
n = int(sys.argv[2])
K = 7
Path("/tmp/round-floor").mkdir(exist_ok=True)
target, draft = _fixtures(suite, Path("/tmp/round-floor"))
with Session.open(
    model=str(target),
    spec_mode=suite.split("-")[0],
    n_threads=1,
    n_ctx=512,
    spec_draft_max=K,
    **({"draft": str(draft)} if draft else {}),
) as s:
    T = collections.defaultdict(list)
    for i in range(n):
        gen = s.start([1, 2, 3, 5 + i % 40], max_tokens=192)
        s.driver()._claim(gen)
        txn = gen.begin()
        txn.prefill(gen.prompt)
        txn.step()
        t, p = txn.target, txn.proposer
        tc, pc = t.capabilities.compute_seconds, p.capabilities.compute_seconds
        anchor = txn.anchor
        emitted = len(txn.emitted)
        hist = txn.history
        r = 0

        def lap(name, t0, c0, tc=tc, pc=pc):
            T[name].append((time.perf_counter() - t0 - (tc() + pc() - c0)) * 1e6)

        while emitted < 192:
            k = min(K, 192 - emitted - 1)
            a = time.perf_counter()
            c = tc() + pc()
            lap("(the lap itself)", a, c)
            a = time.perf_counter()
            c = tc() + pc()
            cp = t.checkpoint()
            p.checkpoint()
            lap("checkpoints", a, c)
            a = time.perf_counter()
            c = tc() + pc()
            prop = p.propose(ProposalContext(history=hist, anchor=anchor, k=k, round_index=r))
            lap("propose", a, c)
            a = time.perf_counter()
            c = tc() + pc()
            ids = prop.ids
            block = np.empty(ids.shape[0] + 1, np.int32)
            block[0] = anchor
            block[1:] = ids
            lap("block", a, c)
            a = time.perf_counter()
            c = tc() + pc()
            res = t.decode(block)
            lap("decode", a, c)
            a = time.perf_counter()
            c = tc() + pc()
            got = (
                res.greedy_ids[: block.shape[0]]
                if res.greedy_ids is not None
                else res.logits[: block.shape[0]].argmax(axis=1)
            ).tolist()
            lap("argmax", a, c)
            a = time.perf_counter()
            c = tc() + pc()
            drafted = ids.tolist()
            out = []
            acc = 0
            for j, tok in enumerate(got):
                out.append(tok)
                if j < len(drafted) and tok == drafted[j]:
                    acc += 1
                else:
                    break
            lap("accept", a, c)
            a = time.perf_counter()
            c = tc() + pc()
            p.observe(res)
            lap("observe", a, c)
            a = time.perf_counter()
            c = tc() + pc()
            if len(out) < block.shape[0]:
                t.rollback(cp, len(out))
            lap("rollback", a, c)
            a = time.perf_counter()
            c = tc() + pc()
            p.commit(acc, np.asarray(out, dtype=np.int32))
            lap("commit", a, c)
            anchor = out[-1]
            emitted += len(out)
            r += 1
        gen.end(None)
        s.driver().release(s)
    for k, v in T.items():
        print(f"{k:12s} {statistics.median(v):7.1f} us")
