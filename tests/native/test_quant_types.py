"""Exact numerics on every quant type a CPU user runs, with llama.cpp's fast paths kept (patch 0005).

For each type (synthetic wide llama, written as F16 and quantized by the pinned build's ``llama-quantize``),
opened the way Power opens a target (``numerics = "exact"``): every row of a pass of n = 1..16 tokens, of a
64-token pass and of a 512-token prompt chunk has the bits of the one-token decode at that position, at 1
and 2 threads; the layouts llama.cpp repacks on this CPU are repacked (``CPU_REPACK`` holds weights); and
``power selftest`` passes. Stock kernels are the negative control: their rows do differ.
"""

from __future__ import annotations

import json
import platform

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

from native_helpers import WIDE_TYPES, make_wide  # noqa: E402
from power_native import _llama  # noqa: E402
from power_native.target import open_target  # noqa: E402

from power_core.cli import main  # noqa: E402

pytestmark = pytest.mark.native

X86 = platform.machine().lower() in ("x86_64", "amd64")
#: layouts ggml repacks on x86 (AVX2: q4_0, q4_K, iq4_nl 8x8; AVX-512: q2_K 8x8 too), which exact keeps there
REPACKED_X86 = {"Q4_0", "Q4_K_M", "IQ4_NL"} | ({"Q2_K"} if "AVX512 = 1" in _llama.system_info() else set())
PREFIX = 40
WIDTHS = (*range(2, 17), 64, 512)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("wide-gguf")


@pytest.fixture(scope="module")
def wide(wide_dir, peer_bin):
    return lambda qtype: make_wide(wide_dir, qtype, peer_bin / "llama-quantize")


def _rows(model: _llama.Model, threads: int) -> tuple[list[np.ndarray], dict[int, np.ndarray], dict]:
    """One-token rows at PREFIX..PREFIX+15, then each width's rows from one pass at PREFIX."""
    ctx = _llama.Context(model, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads, n_outputs_max=512)
    try:
        rng = np.random.default_rng(3)
        prefix = rng.integers(1, 127, size=PREFIX).astype(np.int32)
        block = rng.integers(1, 127, size=max(WIDTHS)).astype(np.int32)
        ctx.decode(prefix, 0)
        single = []
        for j in range(16):
            ctx.decode(block[j:j + 1], PREFIX + j)
            single.append(ctx.logits()[-1].copy())
        ctx.seq_rm(0, PREFIX)
        passes = {}
        for w in WIDTHS:
            ctx.decode(block[:w], PREFIX, all_outputs=True)
            passes[w] = ctx.logits()[:min(w, 16)].copy()
            ctx.seq_rm(0, PREFIX)
        return single, passes, ctx.memory()
    finally:
        ctx.close()


def _differing(single: list[np.ndarray], passes: dict[int, np.ndarray]) -> dict[int, list[int]]:
    return {w: bad for w, rows in passes.items()
            if (bad := [j for j in range(len(rows)) if not np.array_equal(rows[j], single[j])])}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", WIDE_TYPES)
def test_every_row_of_every_width_is_the_one_token_row(wide, qtype, threads):
    path = wide(qtype)
    target = open_target(path, n_ctx=1024, max_block=17, snapshots=1, n_threads=threads)  # numerics = "exact"
    try:
        assert _llama.batch_invariant()
        single, passes, memory = _rows(target.model, threads)
    finally:
        target.close()
    assert _differing(single, passes) == {}
    if X86 and qtype in REPACKED_X86:
        # the fast layout is really in use: weights were repacked at load under the exact switch
        assert memory.get("CPU_REPACK", {}).get("model", 0) > 0, memory


@pytest.mark.parametrize("qtype", WIDE_TYPES)
def test_power_selftest_passes(wide, qtype, capsys):
    assert main(["selftest", "--model", str(wide(qtype)), "--threads", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is True and out["numerics"] == "exact"


@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q2_K"])
def test_k_quants_off_the_repacked_layouts_take_the_exact_tiled_rows(wide, qtype):
    """Q4_K and Q2_K weights that are not repacked (rows not divisible by 8 in a real model; here a load
    without repacking) take the tiled GEMM at every n, below 16 rows from the raw blocks: those decoders
    give the one-token rows too."""
    _llama.set_batch_invariant(True)
    try:
        model = _llama.Model.load(str(wide(qtype)), repack=False)
        single, passes, memory = _rows(model, 2)
        del model
    finally:
        _llama.set_batch_invariant(False)
    assert memory.get("CPU_REPACK", {}).get("model", 0) == 0, memory
    assert _differing(single, passes) == {}


@pytest.mark.skipif(not X86, reason="the stock paths that differ (repacked q4_K gemm/gemv, tiled K-quant GEMM) are x86's")
@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q5_K_M"])
def test_stock_kernels_are_the_negative_control(wide, qtype):
    _llama.set_batch_invariant(False)
    model = _llama.Model.load(str(wide(qtype)))
    single, passes, memory = _rows(model, 2)
    del model
    assert _differing(single, passes), "stock rows equal one-token rows: the probe would not see a difference"
