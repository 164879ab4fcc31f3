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

import gguf
import numpy as np
from power_native import _llama
from power_native.target import JOURNAL_ROUNDS, open_target

ROUNDS, PAIRS, K = 64, 5, 4


def hybrid(out: Path, heads: int) -> Path:
    """A qwen35 of 4 layers (3 gated-delta-net, 1 attention), n_embd 512, ``heads`` value heads of 128."""
    arch, n_vocab = "qwen35", 128
    meta = out / f"h{heads}-meta.gguf"
    w = gguf.GGUFWriter(str(meta), arch)
    for key, val in (("vocab_size", n_vocab), ("context_length", 512), ("embedding_length", 512),
                     ("feed_forward_length", 1024), ("block_count", 4), ("attention.head_count", 4),
                     ("attention.head_count_kv", 4), ("ssm.conv_kernel", 4), ("ssm.inner_size", heads * 128),
                     ("ssm.state_size", 128), ("ssm.time_step_rank", heads), ("ssm.group_count", heads),
                     ("full_attention_interval", 4)):
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_array(f"{arch}.rope.dimension_sections", [32] * 4)
    w.add_string("tokenizer.ggml.model", "test")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(n_vocab)])
    w.add_array("tokenizer.ggml.scores", [0.0] * n_vocab)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
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
