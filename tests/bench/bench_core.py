"""bench_core: the transaction's own cost per round, runtime and proposer excluded.

A null target returns preallocated logits rows and a null proposer returns preallocated ids; both
record the time spent inside them, which is subtracted from each round's wall time. What remains is
Power's core: scheduling, checkpoint bookkeeping, proposal validation, sampling the accepted rows,
commit and emit. Reported as median/min/max over many rounds, per (vocab, K, acceptance).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from power_core.config import PowerConfig
from power_core.runtime import DecodeResult, Proposal, ProposalContext, ProposerCapabilities, TargetCapabilities
from power_core.sampling import TargetSampler
from power_core.scheduler import Scheduler
from power_core.transaction import Transaction


class Clock:
    def __init__(self) -> None:
        self.spent = 0.0


class NullTarget:
    def __init__(self, vocab: int, max_block: int, clock: Clock, token: int = 7) -> None:
        self.rows = np.zeros((max_block, vocab), dtype=np.float32)
        self.rows[:, token] = 1.0
        self.tokens = np.zeros(max_block, dtype=np.int32)
        self.caps = TargetCapabilities(name="null", n_vocab=vocab, n_ctx=1 << 30, max_block=max_block,
                                       rollback_window=None)
        self.clock = clock
        self._n = 0

    @property
    def capabilities(self) -> TargetCapabilities:
        return self.caps

    @property
    def n_past(self) -> int:
        return self._n

    def decode(self, tokens):
        t0 = time.perf_counter()
        n = tokens.shape[0]
        self._n += n
        res = DecodeResult(tokens=tokens, logits=self.rows[:n])
        self.clock.spent += time.perf_counter() - t0
        return res

    def prefill(self, tokens, observe=None):
        self._n += len(tokens)
        return self.rows[0]

    def checkpoint(self):
        return self._n

    def rollback(self, cp, keep):
        t0 = time.perf_counter()
        self._n = cp + keep
        self.clock.spent += time.perf_counter() - t0
        return True

    def restore(self, cp):
        self._n = cp

    def reset(self):
        self._n = 0


class NullProposer:
    features: frozenset[str] = frozenset()
    capabilities = ProposerCapabilities()

    def __init__(self, k: int, clock: Clock, hit: int, token: int = 7) -> None:
        self.props = np.full(k, token, dtype=np.int32)
        if hit < k:
            self.props[hit] = token + 1  # first mismatch at `hit`
        self.clock = clock

    def _timed(self, fn, *a):
        t0 = time.perf_counter()
        r = fn(*a)
        self.clock.spent += time.perf_counter() - t0
        return r

    def begin(self, prompt):
        pass

    def checkpoint(self) -> Any:
        return None

    def propose(self, ctx: ProposalContext):
        return self._timed(lambda: Proposal(self.props[: ctx.k]))

    def observe(self, result):
        pass

    def commit(self, n, emitted):
        pass

    def restore(self, cp):
        pass


def measure(vocab: int, k: int, hit: int, rounds: int) -> dict[str, Any]:
    clock = Clock()
    target = NullTarget(vocab, k + 1, clock)
    proposer = NullProposer(k, clock, hit) if k else None
    cfg = PowerConfig(spec_mode="off" if not k else "auto", spec_draft_max=max(k, 1))
    txn = Transaction(target=target, proposer=proposer, sampler=TargetSampler(),
                      scheduler=Scheduler.for_request(cfg, None, enabled=bool(k)), max_tokens=1 << 40)
    txn.prefill([1, 2, 3])
    samples = []
    for _ in range(rounds):
        before = clock.spent
        t0 = time.perf_counter()
        txn.step()
        samples.append((time.perf_counter() - t0 - (clock.spent - before)) * 1e6)
    emitted = len(txn.emitted)
    return {"vocab": vocab, "k": k, "accepted_per_round": min(hit, k), "rounds": rounds,
            "core_us_per_round": {"median": statistics.median(samples), "min": min(samples), "max": max(samples)},
            "core_us_per_token": statistics.median(samples) * rounds / emitted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--out", type=Path, default=Path("evidence/bench_core.json"))
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    results = []
    for vocab in (128, 49152, 262144):
        for k, hit in ((0, 0), (3, 3), (7, 7), (7, 2), (16, 16)):
            r = measure(vocab, k, hit, args.rounds)
            results.append(r)
            c = r["core_us_per_round"]
            print(f"vocab={vocab:>6} K={k:>2} accepted={r['accepted_per_round']:>2}: core {c['median']:7.1f} us/round "
                  f"median (min {c['min']:.1f}, max {c['max']:.1f}); {r['core_us_per_token']:.1f} us/token")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "core", "python": platform.python_version(),
                                    "machine": platform.machine(), "results": results}, indent=2))
    print(f"evidence written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
