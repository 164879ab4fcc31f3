"""DFlash v1's readout: proposals from noise positions 1..n of one forward, greedy, optional ``p_min``.

llama.cpp (``common/speculative.cpp``, the v1 branch of ``draft()``) reads each row through a
top-k(10) sampler and takes its first candidate; the candidate's probability is the softmax over
those ten logits, and drafting stops at the first row below ``p_min``. A reduced draft vocabulary
(``d2t``) is already scattered onto target ids in the graph, so rows are target-vocabulary wide.
"""

from __future__ import annotations

import attrs
import numpy as np

__all__ = ["V1Readout", "top10_confidence"]


def top10_confidence(rows: np.ndarray) -> np.ndarray:
    """Per row: softmax probability of the argmax among the row's 10 largest logits."""
    k = min(10, rows.shape[1])
    top = np.partition(rows, rows.shape[1] - k, axis=1)[:, -k:]
    m = top.max(axis=1, keepdims=True)
    return 1.0 / np.exp(top - m).sum(axis=1)


@attrs.frozen
class V1Readout:
    p_min: float = 0.0
    outputs: bool = True
    anchor_first: bool = False

    @property
    def argmax_only(self) -> bool:
        return self.p_min <= 0  # the p_min cut reads the rows' top-10 logits

    def __call__(self, rows, n: int) -> np.ndarray:
        if rows.ids is not None:  # sampled in the draft's graph: the rows' first maxima
            return np.asarray(rows.ids[1:1 + n], dtype=np.int32)
        logits = rows.logits[1:1 + n]
        ids = np.argmax(logits, axis=1).astype(np.int32)
        if self.p_min > 0 and ids.size:
            low = np.flatnonzero(top10_confidence(logits) < self.p_min)
            if low.size:
                ids = ids[: int(low[0])]
        return ids
