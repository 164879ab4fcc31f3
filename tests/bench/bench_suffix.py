"""bench_suffix: the suffix proposer's own cost per round (index update + lookup + draft), at 512 and
4096 tokens of history, on a copy-heavy sequence (the history repeats a 300-token passage with edits)
and on a sequence with no repeats. Median/min/max microseconds over many rounds; JSON evidence."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from power_suffix.proposer import SuffixProposer

from power_core.runtime import ProposalContext

ROOT = Path(__file__).resolve().parents[2]


def history(kind: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    if kind == "random":
        return rng.integers(0, 49152, n).astype(np.int32)
    passage = rng.integers(0, 49152, 300)
    out = np.resize(passage, n).copy()
    edits = rng.integers(0, n, n // 50)
    out[edits] = rng.integers(0, 49152, edits.size)
    return out.astype(np.int32)


def measure(kind: str, n: int, rounds: int) -> dict:
    seq = history(kind, n + rounds * 8)
    p = SuffixProposer()
    p.begin(seq[:n])
    pos, times = n, []
    for _ in range(rounds):
        h = seq[:pos]
        t0 = time.perf_counter()
        props = p.propose(ProposalContext(history=h, anchor=int(h[-1]), k=32, round_index=1)).ids
        accepted = 0
        for j, t in enumerate(props.tolist()):
            if pos + j < seq.size and t == seq[pos + j]:
                accepted += 1
            else:
                break
        p.commit(accepted, seq[pos:pos + accepted + 1])
        times.append((time.perf_counter() - t0) * 1e6)
        pos += accepted + 1
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times), "rounds": rounds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "bench_suffix.json")
    args = ap.parse_args()
    res = {f"{kind}@{n}": measure(kind, n, args.rounds) for kind in ("copy", "random") for n in (512, 4096)}
    for k, v in res.items():
        print(f"{k:>12}: median {v['median_us']:.1f} us/round (min {v['min_us']:.1f}, max {v['max_us']:.1f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bench": "suffix-round-cost", "results": res}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
