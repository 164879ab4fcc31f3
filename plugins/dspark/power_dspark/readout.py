"""DSpark's readout (``common/speculative.cpp``, DSpark branch): greedy rows of one forward whose
logits the in-graph Markov head has already biased; anchor-first blocks (``sample_from_anchor``)
read from slot 0 (up to ``block_size`` proposals), others from slot 1. With ``p_min > 0`` the
proposal stops at the first slot whose confidence (the first value of the draft's masked
``h_nextn`` row, the confidence head's output) is below it.
"""

from __future__ import annotations

import attrs
import numpy as np

__all__ = ["DSparkReadout"]


@attrs.frozen
class DSparkReadout:
    anchor_first: bool
    p_min: float = 0.0
    outputs: bool = True
    argmax_only: bool = True  # the p_min cut reads the confidence head's hidden row, not logits

    def __call__(self, rows, n: int) -> np.ndarray:
        first = 0 if self.anchor_first else 1
        idx = np.arange(first, min(first + n, rows.n_block))
        ids = (np.asarray(rows.ids[idx], dtype=np.int32) if rows.ids is not None
               else np.argmax(rows.logits[idx], axis=1).astype(np.int32))
        if self.p_min > 0 and ids.size:
            low = np.flatnonzero(rows.hidden[idx, 0] < self.p_min)
            if low.size:
                ids = ids[: int(low[0])]
        return ids
