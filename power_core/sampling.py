"""The target sampler: one draw per emitted position, from a random stream indexed by position.

The uniform variate for emitted position ``p`` is drawn from ``Philox(key=seed, counter=p)``, so it
depends only on (seed, p). A speculative run therefore draws exactly what an autoregressive run
draws at every emitted position, and a rejected suffix consumes nothing: the stream never advances
for a row that is not sampled.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["TargetSampler"]


@attrs.frozen
class TargetSampler:
    """Greedy (``temperature == 0`` or ``top_k == 1``) or seeded stochastic sampling of logits rows.

    Filters apply in llama.cpp's common order: top-k, temperature, softmax, top-p, min-p.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    @classmethod
    def from_config(cls, config) -> TargetSampler:
        return cls(config.temperature, config.top_k, config.top_p, config.min_p, config.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def uniform(self, position: int) -> float:
        """The position-indexed variate in [0, 1)."""
        bitgen = np.random.Philox(key=self.seed, counter=np.array([position, 0, 0, 0], dtype=np.uint64))
        return float(np.random.Generator(bitgen).random())

    def sample(self, row: npt.NDArray[np.floating], position: int) -> int:
        """Sample one token id from a logits row for emitted position ``position``."""
        if self.greedy:
            return int(np.argmax(row))
        x = np.asarray(row, dtype=np.float64)
        if self.top_k > 0 and self.top_k < x.shape[0]:
            cand = np.argpartition(-x, self.top_k - 1)[: self.top_k]
        else:
            cand = np.arange(x.shape[0])
        # stable order (descending logit, then ascending id) makes ties deterministic
        cand = cand[np.lexsort((cand, -x[cand]))]
        z = x[cand] / self.temperature
        z -= z[0]
        p = np.exp(z)
        p /= p.sum()
        keep = p.shape[0]
        if self.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(p), self.top_p)) + 1)
        if self.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(p >= self.min_p * p[0]))))
        p = p[:keep]
        cdf = np.cumsum(p)
        idx = int(np.searchsorted(cdf, self.uniform(position) * cdf[-1], side="right"))
        return int(cand[min(idx, keep - 1)])
