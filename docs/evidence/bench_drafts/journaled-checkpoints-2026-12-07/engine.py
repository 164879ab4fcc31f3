"""MTP requests on bench_drafts' tiny hybrid fixture (qwen35 with its nextn head: a 140 KB recurrent state a
sequence), 1 and 4 at once through the engine (shared passes), the targets' checkpoints copied every round
(``journaled = False``, as before) or journaled: paired in one process, AB BA AB ..., the same tokens
required.
Prints each side's median host µs a round (the receipts' ``host_us_per_round``), the wall time of a rep and
the state copies per round.

    python engine.py        (from the repository root)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[:0] = ["tests/native", "tests/bench"]

from bench_drafts import PROMPTS, _fixtures  # noqa: E402

from power_core.session import Session  # noqa: E402

REPS, MAX_TOKENS = 10, 192


def main() -> None:
    target, _ = _fixtures("mtp", Path(tempfile.mkdtemp()))
    print(f"{REPS} pairs of {MAX_TOKENS}-token requests, tiny qwen35 MTP fixture, 2 threads, default K and S")
    print("| clients | host µs a round, copied every round | journaled | wall s a rep, every round | journaled "
          "| copies a round | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for nc in (1, 4):
        with Session.open_engine(nc, model=str(target), spec_mode="mtp", n_threads=2, n_ctx=512) as eng:
            targets = [s.opened.target for s in eng.sessions]
            assert all(t.journaled for t in targets)
            eng.sessions[0].generate(PROMPTS[0], max_tokens=16)  # warm
            side: dict[bool, dict[str, list]] = {j: {"host": [], "wall": [], "copies": [], "tokens": []}
                                                 for j in (False, True)}
            for rep in range(2 * REPS):
                journaled = bool(rep % 2) != bool(rep // 2 % 2)  # AB BA AB ...: neither side always runs first
                for t in targets:
                    t.journaled = journaled
                copies0 = sum(t.stats["state_copies"] for t in targets)
                out: list = [None] * nc

                def go(j: int, rep: int = rep, out: list = out) -> None:
                    out[j] = eng.sessions[j].generate(PROMPTS[(rep // 2 + j) % len(PROMPTS)], max_tokens=MAX_TOKENS)

                threads = [threading.Thread(target=go, args=(j,)) for j in range(nc)]
                t0 = time.perf_counter()
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                s = side[journaled]
                s["wall"].append(time.perf_counter() - t0)
                s["host"].extend(r.receipt.timings["host_us_per_round"] for r in out)
                rounds = sum(len(r.receipt.rounds) for r in out)
                s["copies"].append((sum(t.stats["state_copies"] for t in targets) - copies0) / rounds)
                s["tokens"].append([r.tokens for r in out])
        same = side[False]["tokens"] == side[True]["tokens"]
        med = {j: (statistics.median(side[j]["host"]), statistics.median(side[j]["wall"]),
                   statistics.median(side[j]["copies"])) for j in side}
        print(f"| {nc} | {med[False][0]:.0f} | {med[True][0]:.0f} | {med[False][1]:.3f} | {med[True][1]:.3f} "
              f"| {med[False][2]:.2f} / {med[True][2]:.2f} | {same} |")


if __name__ == "__main__":
    main()
