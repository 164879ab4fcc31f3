"""The DFlash-family readouts on synthetic rows: the vectorised DFlash2 lattice walk equals the
per-position walk of ``common/speculative.cpp`` (DFlash2 branch), ties and ``p_min`` cuts included."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from power_dflash2.readout import LatticeReadout
from power_native.block import BlockRows


def walk(lattice: np.ndarray, top_k: int, p_min: float, n: int, n_block: int) -> list[int]:
    """The lattice walk one position at a time: each position takes the best-scoring successor of the
    previous choice (first maximum); with ``p_min`` it stops below that softmax probability."""
    out: list[int] = []
    pred = 0
    for i in range(1, min(n + 1, n_block)):
        row = lattice[i]
        scores = row[top_k + pred * top_k: top_k + (pred + 1) * top_k]
        pred = int(np.argmax(scores))
        if p_min > 0 and 1.0 / float(np.exp(scores - scores[pred]).sum()) < p_min:
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
