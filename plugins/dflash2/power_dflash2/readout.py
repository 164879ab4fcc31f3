"""DFlash2's readout: the walk over the selector lattice (``common/speculative.cpp``, DFlash2 branch).

With noise outputs off, the draft's unmasked ``h_nextn`` rows are the lattice: row ``i`` holds
``top_k`` candidate token ids followed by a ``top_k x top_k`` block of transition scores
(``scores[pred]`` for each predecessor slot). Starting from slot 0, each block position takes the
best-scoring successor of the previous choice; with ``p_min`` the walk stops where the softmax of
the scores at the chosen slot falls below it. The walk itself is :func:`power_dflash2._lattice.walk`,
compiled, in llama.cpp's float arithmetic.
"""

from __future__ import annotations

import attrs
import numpy as np

from power_dflash2._lattice import walk

__all__ = ["LatticeReadout"]


@attrs.frozen
class LatticeReadout:
    top_k: int
    p_min: float = 0.0
    outputs: bool = False
    anchor_first: bool = False
    argmax_only: bool = False  # the lattice, not an argmax of logits rows

    def __call__(self, rows, n: int) -> np.ndarray:
        return walk(rows.hidden, self.top_k, min(n + 1, rows.n_block) - 1, self.p_min)  # block positions 1..m
