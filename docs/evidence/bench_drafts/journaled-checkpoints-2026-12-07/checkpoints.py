"""Per-round cost of a recurrent target's checkpoints, copied every round (``journaled = False``: what the
llama target did before) against once in JOURNAL_ROUNDS rounds (journaled), on synthetic hybrid (qwen35)
targets whose gated-delta-net state grows with its heads (H x 128 x 128 floats a layer). Same process, same
target, the two policies alternated (ABAB...), the same rounds: greedy ids of every round are compared.

    python checkpoints.py [OUT_DIR]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from power_native import _llama
from power_native.target import JOURNAL_ROUNDS, open_target

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests" / "native"))
from native_helpers import write_metadata  # noqa: E402

ROUNDS, PAIRS, K = 64, 5, 4


def hybrid(out: Path, heads: int) -> Path:
    """A qwen35 of 4 layers (3 gated-delta-net, 1 attention), n_embd 512, ``heads`` value heads of 128."""
    meta = write_metadata(out / f"h{heads}-meta.gguf", "qwen35", n_embd=512, n_head=4, n_ff=1024, n_layer=4,
                          n_ctx=512, token_prefix="t", ssm_heads=heads, attention_interval=4)
    model = _llama.Model.from_metadata(str(meta), seed=1, stdev=0.05)
    path = out / f"hybrid-h{heads}.gguf"
    model.save(str(path))
    return path


def run(t, journaled: bool) -> tuple[list[float], list[float], list[int], int]:
    """ROUNDS rounds of checkpoint → verify [anchor, K proposals] → rollback to a seeded keep."""
    t.journaled = journaled
    t.reset()
    rng = np.random.default_rng(0)
    t.prefill(rng.integers(0, 128, 16).astype(np.int32))
    anchor, cps, rounds, ids = 5, [], [], []
    copies = t.stats["state_copies"]
    for _ in range(ROUNDS):
        block = np.array([anchor, *rng.integers(0, 128, K)], dtype=np.int32)
        keep = int(rng.integers(1, K + 2))
        t0 = time.perf_counter()
        cp = t.checkpoint()
        t1 = time.perf_counter()
        res = t.decode(block)
        picked = int(np.argmax(res.logits[keep - 1]))
        if keep < block.shape[0] and not t.rollback(cp, keep):
            raise AssertionError("the rollback fits the snapshots")
        t2 = time.perf_counter()
        cps.append((t1 - t0) * 1e6)
        rounds.append((t2 - t0) * 1e6)
        ids.append(picked)
        anchor = picked
    return cps, rounds, ids, t.stats["state_copies"] - copies


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    print(f"JOURNAL_ROUNDS={JOURNAL_ROUNDS}, {ROUNDS} rounds of [anchor + {K}], {PAIRS} pairs, 2 threads")
    print("| value heads | state a sequence | checkpoint µs a round (mean), every round | journaled | round µs, every round "
          "| journaled | copies | same ids |")
    print("|---|---|---|---|---|---|---|---|")
    for heads in (2, 16, 32):
        t = open_target(hybrid(out, heads), n_ctx=512, max_block=K + 1, snapshots=K, n_threads=2)
        t.reset()
        t.prefill(np.arange(4, dtype=np.int32))
        size = len(t.ctx.state_get(0, _llama.STATE_PARTIAL_ONLY))
        res: dict[bool, list] = {False: [], True: []}
        for _ in range(PAIRS):
            for journaled in (False, True):
                res[journaled].append(run(t, journaled))
        same = all(r[2] == res[False][0][2] for side in res.values() for r in side)
        # a round's mean over the request (a copy lands on one round in JOURNAL_ROUNDS), the median over the pairs
        med = {j: (statistics.median(statistics.fmean(r[0]) for r in res[j]),
                   statistics.median(statistics.fmean(r[1]) for r in res[j]), res[j][0][3]) for j in res}
        print(f"| {heads} | {size / 2**20:.2f} MiB | {med[False][0]:.1f} | {med[True][0]:.1f} | {med[False][1]:.0f} "
              f"| {med[True][1]:.0f} | {med[False][2]} / {med[True][2]} | {same} |")
        t.close()


if __name__ == "__main__":
    main()
