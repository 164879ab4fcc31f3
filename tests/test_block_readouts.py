"""The DFlash-family readouts on synthetic rows: the compiled DFlash2 lattice walk equals the
per-position walk of ``common/speculative.cpp`` (DFlash2 branch) in its float arithmetic (libm's
``expf``, ``1.0f / sum < p_min``), ties and ``p_min`` cuts included."""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from power_dflash2.readout import LatticeReadout
from power_native.block import BlockRows

_expf = ctypes.CDLL(ctypes.util.find_library("m")).expf  # what std::exp(float) calls
_expf.argtypes, _expf.restype = [ctypes.c_float], ctypes.c_float
f32 = np.float32


def walk(lattice: np.ndarray, top_k: int, p_min: float, n: int, n_block: int) -> list[int]:
    """The lattice walk one position at a time: each position takes the best-scoring successor of the
    previous choice (first maximum); with ``p_min`` it stops below that softmax probability."""
    out: list[int] = []
    pred = 0
    for i in range(1, min(n + 1, n_block)):
        row = lattice[i]
        scores = row[top_k + pred * top_k: top_k + (pred + 1) * top_k]
        pred = int(np.argmax(scores))
        if p_min > 0:
            total = f32(0)
            for s in scores:
                total = f32(total + f32(_expf(f32(s - scores[pred]))))
            if f32(1) / total < f32(p_min):
                break
        out.append(int(row[pred]))
    return out


@settings(max_examples=300, deadline=None)
@given(top_k=st.integers(1, 6), n_block=st.integers(1, 17), n=st.integers(0, 20), seed=st.integers(0, 2**32 - 1),
       ties=st.booleans(), p_min=st.sampled_from([0.0, 0.2, 0.5, 0.9]))
def test_lattice_walk_equals_the_per_position_walk(top_k, n_block, n, seed, ties, p_min):
    rng = np.random.default_rng(seed)
    width = top_k + top_k * top_k
    lattice = rng.normal(0, 2, (n_block, width + 3)).astype(np.float32)  # rows may be wider than the lattice
    if ties:  # coarse scores: equal maxima everywhere
        lattice[:, top_k:] = np.round(lattice[:, top_k:])
    lattice[:, :top_k] = rng.integers(0, 50000, (n_block, top_k))  # candidate ids, stored as floats
    rows = BlockRows(logits=None, hidden=lattice, n_block=n_block)
    got = LatticeReadout(top_k=top_k, p_min=p_min)(rows, n)
    assert got.dtype == np.int32
    assert got.tolist() == walk(lattice, top_k, p_min, n, n_block)


def test_lattice_p_min_cut_is_llama_cpps_float_comparison():
    """1 / (1 + expf(-d)) is 0.89999996 in double but rounds to float32(0.9) in float: llama.cpp's
    ``1.0f / sum < p_min`` keeps the proposal (a double comparison would cut it)."""
    d = 2.197223663330078
    lattice = np.array([[0, 0, 0, 0, 0, 0], [11, 22, d, 0, 0, 0]], dtype=np.float32)
    total = f32(f32(1) + f32(_expf(f32(-d))))
    assert 1.0 / float(total) < 0.9 and not f32(1) / total < f32(0.9)
    rows = BlockRows(logits=None, hidden=lattice, n_block=2)
    assert LatticeReadout(top_k=2, p_min=0.9)(rows, 1).tolist() == [11]


def test_lattice_candidates_that_are_no_token_ids_read_minus_one():
    """NaN, negative or out-of-range candidate slots become -1, which the transaction rejects (an adapter fault)."""
    lattice = np.zeros((4, 6), dtype=np.float32)
    lattice[1:, 0] = [np.nan, -3.0, 3e9]
    rows = BlockRows(logits=None, hidden=lattice, n_block=4)
    assert LatticeReadout(top_k=2)(rows, 3).tolist() == [-1, -1, -1]


@pytest.mark.parametrize(("shape", "top_k", "match"), [((4, 5), 2, "width 5"), ((4, 6), 0, "top_k=0"),
                                                     ((4, 6), 70000, "cannot hold")])  # top_k² overflows an int
def test_lattice_of_the_wrong_shape_is_refused(shape, top_k, match):
    rows = BlockRows(logits=None, hidden=np.zeros(shape, dtype=np.float32), n_block=4)
    with pytest.raises(ValueError, match=match):
        LatticeReadout(top_k=top_k)(rows, 3)


def test_lattice_walk_needs_its_rows():
    from power_dflash2._lattice import walk as compiled

    with pytest.raises(ValueError, match="needs 4 lattice rows"):
        compiled(np.zeros((3, 6), dtype=np.float32), 2, 3, 0.0)
