"""Why shared passes cost more than llama-server's: the KV layout of a context with several sequences.

With one KV stream per sequence (``kv_unified = False``, what ``open_llama_batch`` opens), llama.cpp
splits a pass into ubatches that hold the same number of tokens of every sequence
(``llama_batch_allocr::split_equal``). Every ubatch reads all the weights again, so blocks of 5, 3, 9
and 2 tokens cost four ubatches. With one unified cache one ubatch holds them. But a unified cache
reuses cells freed by a rollback in the order it finds them, so a sequence's cells stop being in
position order. The CPU flash-attention kernel sums over cells in cell order, so that sequence's rows
then differ from its solo rows.

    python tests/bench/kv_layout.py [MODEL]     # MODEL: default gemma3-270m

Part 1: the time of one pass per layout and block shape, every token with a row, at a context position
of 200; the median of 5 after a warm-up. Part 2: three sequences decoding greedily, one token each per
pass, while sequence 1 rolls back its last 3 tokens at steps 10, 20 and 30 and decodes them again after
the others' tokens. Each sequence's rows are compared bit for bit with its solo decode.
(docs/evidence/bench-engine.md)
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from power_native import _llama
from power_native.models import resolve_model
from power_native.target import _numerics, load_model

SHAPES = {"1x32": [32], "4x8": [8, 8, 8, 8], "3,3,3,3": [3, 3, 3, 3], "5,3,9,2": [5, 3, 9, 2],
          "7,4,1,12": [7, 4, 1, 12], "17,1,1,1": [17, 1, 1, 1]}


def context(model: _llama.Model, n: int, unified: bool) -> _llama.Context:
    return _llama.Context(model, n_ctx=1024 * n, n_threads=2, n_batch=512, n_ubatch=512, n_outputs_max=512,
                          n_seq_max=n, kv_unified=unified, flash_attn="on")


def pass_ms(ctx: _llama.Context, spec: list[int], rng: np.random.Generator) -> float:
    toks = np.concatenate([rng.integers(0, 1000, k) for k in spec]).astype(np.int32)
    pos = np.concatenate([np.arange(200, 200 + k) for k in spec]).astype(np.int32)
    seq = np.concatenate([np.full(k, s) for s, k in enumerate(spec)]).astype(np.int32)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        ctx.decode_multi(toks, pos, seq, np.ones(len(toks), dtype=np.uint8))
        times.append(time.perf_counter() - t0)
        for s in range(len(spec)):
            ctx.seq_rm(s, 200, -1)
    return statistics.median(times[1:]) * 1000


def costs(model: _llama.Model, unified: bool) -> dict[str, float]:
    ctx = context(model, 4, unified)
    rng = np.random.default_rng(0)
    for s in range(4):
        ctx.decode_multi(rng.integers(0, 1000, 200).astype(np.int32), np.arange(200, dtype=np.int32),
                         np.full(200, s, dtype=np.int32), np.zeros(200, dtype=np.uint8))
    out = {name: round(pass_ms(ctx, spec, rng), 1) for name, spec in SHAPES.items()}
    ctx.close()
    return out


def first_differences(model: _llama.Model, unified: bool) -> list[int | None]:
    """Per sequence: the first of its 41 rows that differs from its solo decode (None: none does)."""
    n = 3
    ctx, solo = context(model, n, unified), context(model, 1, False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 1000, length).astype(np.int32) for length in (37, 61, 20)]
    outputs = np.zeros(sum(len(p) for p in prompts), dtype=np.uint8)
    outputs[np.cumsum([len(p) for p in prompts]) - 1] = 1
    rows = ctx.decode_multi(np.concatenate(prompts), np.concatenate([np.arange(len(p)) for p in prompts]).astype(np.int32),
                            np.concatenate([np.full(len(p), i) for i, p in enumerate(prompts)]).astype(np.int32), outputs)
    got = [[np.array(rows[i])] for i in range(n)]
    gen = [[int(np.argmax(rows[i]))] for i in range(n)]
    past = [len(p) for p in prompts]
    for step in range(40):
        cur = [g[-1] for g in gen]
        if step in (10, 20, 30):  # sequence 1 rolls back 3 tokens; they go again after the others' tokens
            ctx.seq_rm(1, past[1] - 3, -1)
            toks = [cur[0], cur[2], *gen[1][-4:-1], cur[1]]
            pos = [past[0], past[2], *range(past[1] - 3, past[1]), past[1]]
            r = ctx.decode_multi(np.array(toks, dtype=np.int32), np.array(pos, dtype=np.int32),
                                 np.array([0, 2, 1, 1, 1, 1], dtype=np.int32), np.array([1, 1, 0, 0, 0, 1], dtype=np.uint8))
            rows = [r[0], r[2], r[1]]
        else:
            rows = ctx.decode_multi(np.array(cur, dtype=np.int32), np.array(past, dtype=np.int32),
                                    np.arange(n, dtype=np.int32), np.ones(n, dtype=np.uint8))
        for i in range(n):
            got[i].append(np.array(rows[i]))
            gen[i].append(int(np.argmax(rows[i])))
            past[i] += 1
    first: list[int | None] = []
    for i in range(n):
        solo.clear(False)
        solo.decode(prompts[i], 0, all_outputs=False)
        want = [np.array(solo.logits()[-1])]
        p = len(prompts[i])
        for t in gen[i][:-2]:
            solo.decode(np.array([t], dtype=np.int32), p)
            p += 1
            want.append(np.array(solo.logits()[-1]))
        first.append(next((k for k, (a, b) in enumerate(zip(want, got[i], strict=False)) if not np.array_equal(a, b)),
                          None))
    ctx.close()
    solo.close()
    return first


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m"
    _numerics.acquire("exact")
    model = load_model(resolve_model(name), repack=False)  # exact numerics: weights as stored, as Power loads them
    for unified in (False, True):
        layout = "unified" if unified else "streams"
        print(f"{name} {layout}: pass ms {costs(model, unified)}; first row differing from solo per sequence "
              f"{first_differences(model, unified)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
