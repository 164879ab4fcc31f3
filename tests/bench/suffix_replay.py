"""suffix_replay: how close the suffix proposer's width choice comes to perfect foresight.

Greedy output does not depend on what is proposed, so a request can be replayed offline: each model
writes its ``--mode off`` answer to each prompt once, then the shipped ``SuffixProposer`` and the
core's ``Scheduler`` run over that fixed answer round by round (the proposals, the cost-aware width,
the acceptance model's learning and the back-off exactly as in a session), and every round is
charged the target's measured verify-cost curve (units of one one-token decode). The same rounds
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
from types import SimpleNamespace

import numpy as np
from power_suffix.index import SuffixIndex
from power_suffix.proposer import SuffixProposer

from power_core.bench import read_prompt
from power_core.config import PowerConfig
from power_core.runtime import DecodeResult, ProposalContext
from power_core.scheduler import RoundOutcome, Scheduler
from power_core.session import Session

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


def replay(prompt: list[int], answer: list[int], costs: list[float], k_max: int) -> tuple[float, int]:
    """Units and rounds of the shipped proposer + scheduler over a fixed greedy answer."""
    proposer = SuffixProposer(session_memory=0)
    proposer.begin(np.asarray(prompt, dtype=np.int32))
    cfg = SimpleNamespace(draft_max=k_max, snapshots=k_max, spec_mtp_adaptive=False, spec_adaptive_low_yield=0.25,
                          spec_adaptive_low_yield_rounds=3)
    sched = Scheduler.for_request(cfg, None, True, tuple(costs))
    proposer.commit(0, np.asarray(answer[:1], dtype=np.int32))  # round 0: the prefill's token
    i, units, rounds = 1, 0.0, 0
    while i < len(answer):
        plan = sched.plan()
        k = max(0, min(plan.k, len(answer) - i - 1, len(costs) - 1))
        props, offered = np.zeros(0, dtype=np.int32), 0
        if k > 0:
            hist = np.asarray(prompt + answer[:i], dtype=np.int32)
            props = np.asarray(proposer.propose(ProposalContext(history=hist, anchor=answer[i - 1], k=k,
                                                                round_index=rounds + 1)))
            offered = props.shape[0]
            if offered and proposer.confidence is not None:
                props = props[:sched.choose_width(proposer.confidence, offered)[0]]
        w = props.shape[0]
        accepted = 0
        while accepted < w and props[accepted] == answer[i + accepted]:
            accepted += 1
        if w:
            proposer.observe(DecodeResult(tokens=np.zeros(w + 1, np.int32), logits=np.zeros((w + 1, 1), np.float32)))
        proposer.commit(accepted, np.asarray(answer[i:i + accepted + 1], dtype=np.int32))
        sched.record(plan, RoundOutcome(proposed=w, accepted=accepted, replayed=False, offered=offered))
        units += costs[w]
        i += accepted + 1
        rounds += 1
    return units, rounds


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
    ap.add_argument("--prompts", nargs="+", type=Path, default=sorted((ROOT.parent / "shared" / "bench").glob("*.txt")))
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
