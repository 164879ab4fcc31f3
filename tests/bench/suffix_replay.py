"""suffix_replay: how close the suffix proposer's width choice comes to perfect foresight.

Greedy output does not depend on what is proposed, so a request can be replayed offline: each model
writes its ``--mode off`` answer to each prompt once, then the core's own ``Transaction`` (with the
shipped ``SuffixProposer`` and the cost-aware ``Scheduler``, exactly as in a session) runs over a
scripted target whose every row predicts that answer, and each verify pass it made is charged the
target's measured verify-cost curve (units of one one-token decode). The same rounds
with perfect foresight (a dynamic program over how much of each round's offer to verify, knowing
which tokens the target accepts) bound what any width policy over these proposals can reach.

    python tests/bench/suffix_replay.py [--models smollm2,gemma3-270m] [--numerics exact] [--prompts F ...]

Seconds per policy instead of a noisy benchmark, so a change to the acceptance model or the width
rule can be tried on many prompts; the real speed is still what ``power bench`` measures. JSON
evidence with ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from power_suffix.index import SuffixIndex
from power_suffix.proposer import SuffixProposer

from power_core.bench import read_prompt
from power_core.config import PowerConfig
from power_core.runtime import DecodeResult, TargetCapabilities
from power_core.sampling import TargetSampler
from power_core.scheduler import Scheduler
from power_core.session import Session
from power_core.transaction import Transaction

ROOT = Path(__file__).resolve().parents[2]


def answers(model: str, numerics: str, prompts: list[Path], tokens: int) -> tuple[list[float], list[tuple]]:
    """The target's verify-cost curve and, per prompt, (prompt ids, greedy answer ids)."""
    from power_native.models import resolve_model

    path = str(resolve_model(model))
    with Session.open(PowerConfig(spec_mode="suffix", numerics=numerics, n_threads=2), model=path) as s:
        costs = list(s.opened.target.capabilities.verify_cost)
    out = []
    with Session.open(PowerConfig(spec_mode="off", numerics=numerics, n_threads=2, max_tokens=tokens),
                      model=path) as s:
        for p in prompts:
            text = read_prompt(p)
            out.append((s.encode(text).tolist(), list(map(int, s.generate(text).tokens))))
    return costs, out


class _Scripted:
    """A target whose row after position ``p`` of ``prompt + answer`` predicts token ``p + 1``: greedy
    decoding writes ``answer`` whatever is proposed, at no model cost."""

    def __init__(self, prompt: list[int], answer: list[int], max_block: int) -> None:
        self.seq = np.asarray(prompt + answer + [0], dtype=np.int64)
        self.n_vocab = int(self.seq.max()) + 1
        self.capabilities = TargetCapabilities(name="scripted", n_vocab=self.n_vocab, n_ctx=self.seq.size + max_block,
                                               max_block=max_block, rollback_window=None)
        self.n_past = 0

    def _rows(self, n: int) -> np.ndarray:
        rows = np.zeros((n, self.n_vocab), dtype=np.float32)
        rows[np.arange(n), self.seq[self.n_past + 1:self.n_past + n + 1]] = 1.0
        return rows

    def decode(self, tokens):
        rows = self._rows(len(tokens))
        self.n_past += len(tokens)
        return DecodeResult(tokens=np.asarray(tokens, dtype=np.int32), logits=rows)

    def prefill(self, tokens, observe=None):
        self.n_past += len(tokens) - 1
        row = self._rows(1)[0]
        self.n_past += 1
        return row

    def checkpoint(self):
        return self.n_past

    def rollback(self, checkpoint, keep: int) -> bool:
        self.n_past = checkpoint + keep
        return True

    def restore(self, checkpoint) -> None:
        self.n_past = checkpoint

    def reset(self) -> None:
        self.n_past = 0


def replay(prompt: list[int], answer: list[int], costs: list[float], k_max: int) -> tuple[float, int]:
    """Units and rounds of the core's transaction with the shipped proposer over a fixed greedy answer."""
    config = PowerConfig(spec_mode="suffix", spec_draft_max=k_max)
    txn = Transaction(target=_Scripted(prompt, answer, min(k_max + 1, len(costs))), proposer=SuffixProposer(),
                      sampler=TargetSampler.from_config(config),
                      scheduler=Scheduler.for_request(config, None, True, tuple(costs)), max_tokens=len(answer))
    txn.prefill(prompt)
    while txn.step() is not None:  # a scripted target, no session: the rounds one by one
        pass
    assert txn.emitted == answer, "the scripted target must reproduce the answer"
    rounds = txn.rounds[1:]  # round 0 emits the prefill's token
    return sum(costs[r.shape - 1] for r in rounds), len(rounds)


def foresight(prompt: list[int], answer: list[int], costs: list[float], k_max: int) -> float:
    """Fewest units with the same proposals (the index's full offer at each position) and perfect
    knowledge of how much of each offer the target accepts."""
    n = len(answer)
    index = SuffixIndex()
    index.extend(prompt + answer[:1])
    right = [0] * n  # correct prefix of the offer made at position i
    for i in range(1, n):
        m = index.match(min(k_max, len(costs) - 1))
        if m is not None:
            while right[i] < m.tokens.size and i + right[i] < n and m.tokens[right[i]] == answer[i + right[i]]:
                right[i] += 1
        index.extend(answer[i:i + 1])
    best = [0.0] * (n + 1)
    for i in range(n - 1, 0, -1):
        best[i] = min(costs[w] + best[min(n, i + w + 1)] for w in range(right[i] + 1))
    return best[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--numerics", default="exact")
    ap.add_argument("--prompts", nargs="+", type=Path, default=sorted((ROOT / "docs" / "examples").glob("*.txt")))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--draft-max", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        for numerics in args.numerics.split(","):
            costs, runs = answers(model, numerics, args.prompts, args.tokens)
            for path, (prompt, answer) in zip(args.prompts, runs, strict=True):
                units, rounds = replay(prompt, answer, costs, args.draft_max)
                bound = foresight(prompt, answer, costs, args.draft_max)
                n = len(answer) - 1  # the first token comes from the prefill
                rows.append({"model": model, "numerics": numerics, "prompt": path.name, "tokens": n,
                             "units": units, "rounds": rounds, "foresight_units": bound,
                             "model_speedup": n / units, "foresight_speedup": n / bound, "efficiency": bound / units})
                r = rows[-1]
                print(f"{model:>12} {numerics:>5} {path.name:>24}: {n:3d} tokens, shipped {units:6.1f} units "
                      f"({r['model_speedup']:.2f}x off, {rounds} rounds), perfect foresight {bound:6.1f} "
                      f"({r['foresight_speedup']:.2f}x): efficiency {r['efficiency']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
