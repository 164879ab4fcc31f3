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
the others' tokens. Each sequence's rows are compared bit for bit with its solo decode. Part 3: one
token of each of 4 sequences per pass over histories of ``LONG`` tokens (multi-turn chats), the median
of 40 passes, the layouts taking turns: with a stream each, in one cache packed tight, and in one cache
whose used cells reach far up (a sequence holding late cells, as the cache is after many requests came
and went); then the same with sequence 0 bringing a ``CHUNK``-token prompt chunk instead of its token (a
new turn's prefill joining the others' decode steps, as in a server's passes). The attention of a shared
cache reads a mask row over every used cell for each query; it costs what the streams' does only if
hidden cells cost nothing (native/patches/0004-fa-visible-runs.patch). (docs/evidence/bench-engine.md)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
from power_native import _llama
from power_native.loading import load_model, numerics_guard
from power_native.models import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native"))
from native_helpers import rollback_rows_differ  # noqa: E402

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


LONG = 1500
CHUNK = 128
LAYOUTS = ("streams", "unified, packed", "unified, cells up to the top")


def long_history_ms(model: _llama.Model, rounds: int = 5, passes: int = 8, chunk: int = 0) -> dict[str, float]:
    """Part 3: a pass of one token per sequence (4) over histories of ``LONG`` tokens each, per layout:
    the median over ``rounds`` x ``passes`` passes, the layouts taking turns (a noisy machine drifts).
    ``chunk``: sequence 0 brings a prompt chunk of that many tokens instead (a new turn's prefill joining
    the others' decode steps, as a server's passes do; it is removed again after each pass)."""
    n = 4
    rng = np.random.default_rng(0)
    opened: dict[str, tuple[_llama.Context, list[int]]] = {}

    def fill(ctx: _llama.Context, seq: int, n_tok: int) -> None:
        for lo in range(0, n_tok, 512):
            k = min(512, n_tok - lo)
            ctx.decode_multi(rng.integers(0, 1000, k).astype(np.int32), np.arange(lo, lo + k, dtype=np.int32),
                             np.full(k, seq, dtype=np.int32), np.zeros(k, dtype=np.uint8))

    try:
        for layout in LAYOUTS:
            ctx = _llama.Context(model, n_ctx=2048 * n, n_threads=2, n_batch=512, n_ubatch=512, n_outputs_max=512,
                                 n_seq_max=n, kv_unified=layout != "streams", flash_attn="on")
            opened[layout] = (ctx, [LONG] * n)
            if layout == "unified, cells up to the top":  # sequence 1 keeps the last LONG of 7000 of 8192 cells
                fill(ctx, 1, 7000)
                ctx.seq_rm(1, 0, 7000 - LONG)
                opened[layout] = (ctx, [LONG, 7000, LONG, LONG])
                for s in (0, 2, 3):
                    fill(ctx, s, LONG)
            else:
                for s in range(n):
                    fill(ctx, s, LONG)
        times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for _ in range(rounds):
            for layout in LAYOUTS:
                ctx, pos = opened[layout]
                for i in range(passes + 1):
                    widths = [chunk or 1] + [1] * (n - 1)
                    toks = rng.integers(0, 1000, sum(widths)).astype(np.int32)
                    at = np.concatenate([np.arange(p, p + w) for p, w in zip(pos, widths, strict=True)]).astype(np.int32)
                    seqs = np.repeat(np.arange(n), widths).astype(np.int32)
                    t0 = time.perf_counter()
                    ctx.decode_multi(toks, at, seqs, np.ones(len(toks), dtype=np.uint8))
                    if i:  # the first pass after another context's warms the caches
                        times[layout].append(time.perf_counter() - t0)
                    if chunk:
                        ctx.seq_rm(0, pos[0], -1)
                    pos[:] = [p + (0 if chunk and s == 0 else 1) for s, p in enumerate(pos)]
        return {layout: round(statistics.median(t) * 1000, 1) for layout, t in times.items()}
    finally:
        for ctx, _ in opened.values():
            ctx.close()


def first_differences(model: _llama.Model, unified: bool) -> list[int | None]:
    ctx, solo = context(model, 3, unified), context(model, 1, False)
    try:
        return rollback_rows_differ(ctx, solo)
    finally:
        ctx.close()
        solo.close()


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m"
    numerics_guard.acquire("exact")
    model = load_model(resolve_model(name), repack=False)  # exact numerics: weights as stored, as Power loads them
    for unified in (False, True):
        layout = "unified" if unified else "streams"
        print(f"{name} {layout}: pass ms {costs(model, unified)}; first row differing from solo per sequence "
              f"{first_differences(model, unified)}", flush=True)
    print(f"{name}: a pass of 4 x 1 token over histories of {LONG}, ms: {long_history_ms(model)}", flush=True)
    print(f"{name}: a pass of a {CHUNK}-token prompt chunk + 3 x 1 token over histories of {LONG}, ms: "
          f"{long_history_ms(model, passes=3, chunk=CHUNK)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
