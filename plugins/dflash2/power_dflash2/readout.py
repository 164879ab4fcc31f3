"""DFlash2's readout: the walk over the selector lattice (``common/speculative.cpp``, DFlash2 branch).

With noise outputs off, the draft's unmasked ``h_nextn`` rows are the lattice: row ``i`` holds
``top_k`` candidate token ids followed by a ``top_k x top_k`` block of transition scores
(``scores[pred]`` for each predecessor slot). Starting from slot 0, each block position takes the
best-scoring successor of the previous choice; with ``p_min`` the walk stops where the softmax of
the scores at the chosen slot falls below it.
"""

from __future__ import annotations

import attrs
import numpy as np

__all__ = ["LatticeReadout"]


@attrs.frozen
class LatticeReadout:
    top_k: int
    p_min: float = 0.0
    outputs: bool = False
    anchor_first: bool = False

    def __call__(self, rows, n: int) -> np.ndarray:
        k = self.top_k
        lattice = rows.hidden
        out: list[int] = []
        pred = 0
        for i in range(1, min(n + 1, rows.n_block)):
            row = lattice[i]
            scores = row[k + pred * k: k + (pred + 1) * k]
            pred = int(np.argmax(scores))
            if self.p_min > 0 and 1.0 / float(np.exp(scores - scores[pred]).sum()) < self.p_min:
                break
            out.append(int(row[pred]))
        return np.asarray(out, dtype=np.int32)
