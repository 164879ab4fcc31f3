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
    argmax_only: bool = False  # the lattice, not an argmax of logits rows

    def __call__(self, rows, n: int) -> np.ndarray:
        k = self.top_k
        m = min(n + 1, rows.n_block) - 1  # block positions 1..m
        if m <= 0:
            return np.zeros(0, dtype=np.int32)
        lattice = rows.hidden[1:m + 1]
        scores = lattice[:, k:k + k * k].reshape(m, k, k)  # [position, predecessor slot, successor slot]
        best = scores.argmax(axis=2)  # every position's best successor of every slot at once (first maximum)
        walk_best, cand = best.tolist(), lattice[:, :k].tolist()
        conf = None
        if self.p_min > 0:  # softmax probability of each best successor
            top = np.take_along_axis(scores, best[:, :, None], axis=2)
            conf = (1.0 / np.exp(scores - top).sum(axis=2).astype(np.float64)).tolist()  # float32 sum, f64 1/x
        out: list[int] = []
        pred = 0
        for i in range(m):
            if conf is not None and conf[i][pred] < self.p_min:  # the best successor of ``pred`` is unsure
                break
            pred = walk_best[i][pred]
            out.append(int(cand[i][pred]))
        return np.asarray(out, dtype=np.int32)
