"""The target sampler: one draw per emitted position, from a random stream indexed by position.

The uniform variate for emitted position ``p`` is drawn from ``Philox(key=seed, counter=p)``, so it
depends only on (seed, p). A speculative run therefore draws exactly what an autoregressive run
draws at every emitted position, and a rejected suffix consumes nothing: the stream never advances
for a row that is not sampled.
"""

from __future__ import annotations

import threading

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["TargetSampler", "row_logprobs", "top_ids"]

_F32 = np.float32


class _Rows(threading.local):
    """This thread's buffers for one vocabulary-sized row: its scaled softmax in float64, and a compare's mask. A
    draw at 151,936 logits wrote four fresh ~1.2 MB arrays (the row in float64, scaled, its softmax, a mask),
    whose pages the kernel faulted in and zeroed anew when the allocator had no chunk of that size at hand
    (docs/evidence/bench_sampling/row-buffers-2026-12-07). Now the float64 values are computed from the row as it
    came (a float32 row casts to float64 exactly, and orders as its cast does) into buffers kept per thread: the
    same arithmetic on the same floats. A thread runs one draw (or one logprobs row) at a time."""

    def __init__(self) -> None:
        self.z = np.empty(0)
        self.mask = np.empty(0, dtype=bool)

    def take(self, n: int) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
        """(a float64 buffer, a bool buffer) of ``n`` entries, valid until this thread's next call."""
        if self.z.shape[0] != n:
            self.z, self.mask = np.empty(n), np.empty(n, dtype=bool)
        return self.z, self.mask


_ROWS = _Rows()


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
    #: llama.cpp's penalties over the last ``repeat_last_n`` tokens of prompt + output (``-1``: all of them)
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    #: (token id, bias) pairs added to the row before the penalties (llama.cpp's logit-bias sampler)
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_config(cls, config) -> TargetSampler:
        return cls(config.temperature, config.top_k, config.top_p, config.min_p, config.seed,
                   config.repeat_penalty, config.repeat_last_n, config.frequency_penalty, config.presence_penalty,
                   config.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalizes(self) -> bool:
        """The penalties change rows (llama.cpp's ``is_disabled`` is false)."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)

    @property
    def adjusts(self) -> bool:
        """Rows are changed before sampling (a bias or a penalty): the row at emitted position ``p``
        then depends on the tokens before ``p`` (:meth:`adjust`)."""
        return bool(self.logit_bias) or self.penalizes

    def adjust(self, row: npt.NDArray[np.floating], history: npt.NDArray[np.int32]) -> npt.NDArray[np.float32]:
        """The row as llama.cpp's logit-bias then penalties samplers leave it (float32 arithmetic as
        theirs), given ``history``: every token before this row's position (prompt, output and the
        row's accepted proposals). A copy; ``row`` is not changed."""
        x = np.array(row, dtype=_F32)
        for tok, bias in self.logit_bias:
            x[tok] += _F32(bias)
        if not self.penalizes:
            return x
        n = history.shape[0] if self.repeat_last_n < 0 else self.repeat_last_n
        window = history[-n:] if n else history[:0]
        if window.shape[0] == 0:
            return x
        ids, counts = np.unique(window, return_counts=True)
        v = x[ids]
        if self.repeat_penalty != 1.0:
            r = _F32(self.repeat_penalty)
            v = np.where(v <= 0, v * r, v / r)
        x[ids] = v - (counts.astype(_F32) * _F32(self.frequency_penalty) + _F32(self.presence_penalty))
        return x

    def uniform(self, position: int) -> float:
        """The position-indexed variate in [0, 1)."""
        bitgen = np.random.Philox(key=self.seed, counter=np.array([position, 0, 0, 0], dtype=np.uint64))
        return float(np.random.Generator(bitgen).random())

    def sample(self, row: npt.NDArray[np.floating], position: int) -> int:
        """Sample one token id from a logits row for emitted position ``position``.

        The candidates in a stable order (descending logit, then ascending id), their softmax at the
        temperature, the top-p and min-p cuts, then the inverse CDF of the kept ones at the position's
        variate. Without ``top_k`` the candidates are the whole vocabulary, but only the head of that order
        the draw reaches is sorted (:meth:`_draw_from_all`)."""
        if self.greedy:
            return int(np.argmax(row))
        x = np.asarray(row)
        n = x.shape[0]
        z, mask = _ROWS.take(n)
        if not 0 < self.top_k < n:
            return self._draw_from_all(x, z, mask, self.uniform(position))
        # the stable order's first top_k (descending logit, then ascending id: the lowest ids among ties at the cut)
        cand = top_ids(x, self.top_k, mask)
        z = x[cand].astype(np.float64) / self.temperature
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

    def _draw_from_all(self, x: npt.NDArray[np.floating], z: npt.NDArray[np.float64], mask: npt.NDArray[np.bool_],
                       u: float) -> int:
        """:meth:`sample` over the whole vocabulary without sorting it all (a sort of 151,936 logits takes ~20 ms,
        docs/architecture.md "Why seeded stochastic runs match token for token"). The softmax's normalizer
        and the min-p count are taken over the row in id order. The stable order is built only for the
        head, at least the ``m`` largest logits (:func:`head_order`): 64, then more (:func:`_grown`) while the draw,
        the top-p cut or the min-p cut reaches past what the head decides, and the whole row once the head
        passes an eighth of it. Only the head's entries surely in their place count as sorted."""
        n = x.shape[0]
        # in float64 (``z`` and ``mask``: buffers of ``n``, see :class:`_Rows`)
        z = np.divide(x, self.temperature, out=z, dtype=np.float64)
        z -= z.max()
        p = np.exp(z, out=z)
        total = p.sum()
        p /= total
        cut = n
        if self.min_p > 0.0:  # (the largest p is exp(0) / total: p.max() without reading the row again)
            cut = max(1, int(np.count_nonzero(np.greater_equal(p, self.min_p * (1.0 / total), out=mask))))
        m = 64
        while True:
            if 8 * m >= n:
                order = np.lexsort((np.arange(n), -x))
                sure = n
            else:
                order, sure = head_order(x, m, mask)
            cdf = np.cumsum(p[order])  # the first entries of the whole order's cumulative sum
            covered = float(cdf[sure - 1]) if sure else 0.0
            keep = cut
            if self.top_p < 1.0:
                at = int(np.searchsorted(cdf, self.top_p))
                if at >= sure and sure < n:
                    m = _grown(m, n, covered, self.top_p)
                    continue
                keep = min(keep, at + 1)
            if keep <= sure:
                mass = cdf[keep - 1]
            elif keep < n:  # the min-p cut lies past the head
                m = max(16 * m, 2 * keep)
                continue
            else:  # nothing cut (keep == n): the mass is the whole row's
                mass = p.sum()
            idx = int(np.searchsorted(cdf[:min(keep, sure)], u * mass, side="right"))
            if idx < min(keep, sure) or keep <= sure:
                return int(order[min(idx, keep - 1)])
            m = _grown(m, n, covered, u * mass)


def head_order(x: npt.NDArray[np.floating], m: int,
               mask: npt.NDArray[np.bool_] | None = None) -> tuple[npt.NDArray[np.intp], int]:
    """The first entries of ``x``'s stable order (descending value, ascending id), at least its ``m`` largest, and
    how many of them are surely in their place. Every entry at or above a bound taken from a strided sample of
    the row (about 64 ``m`` values; the bound has about 4 ``m`` of the row above it): the order's exact prefix,
    ties and all, found with one compare over the row (an ``argpartition`` of 151,936 values took ~2.3 of a
    ~2.8 ms draw). When the bound holds fewer than ``m`` or more than 16 ``m`` entries, the ``m`` largest by
    ``argpartition``, of which only those above the last value's ties are sure. ``mask``: a bool buffer of
    ``x``'s size for the compare."""
    n = x.shape[0]
    stride = n // (64 * m)
    if stride >= 2:
        sample = x[::stride]
        rank = -(-4 * m // stride)  # its rank-th largest: about 4 m of the row lie above it
        bound = np.partition(sample, sample.shape[0] - rank)[sample.shape[0] - rank]
        head = np.flatnonzero(np.greater_equal(x, bound, out=mask))
        if m <= head.shape[0] <= 16 * m:
            return head[np.lexsort((head, -x[head]))], int(head.shape[0])
    head = np.argpartition(-x, m - 1)[:m]
    order = head[np.lexsort((head, -x[head]))]
    return order, int(np.searchsorted(-x[order], -x[order[-1]], side="left"))  # above the last value's ties


def top_ids(x: npt.NDArray[np.floating], n: int, mask: npt.NDArray[np.bool_] | None = None) -> npt.NDArray[np.intp]:
    """The ``n`` first ids of ``x``'s stable order (descending value, ascending id; ``1 <= n <= x.shape[0]``): the
    head :func:`head_order` finds, and where fewer than ``n`` of it are sure (ties at its edge), the lowest ids
    among the values tied there. A logprobs request's top ids at 151,936 logits without a partition of the row.
    ``mask``: a bool buffer of ``x``'s size."""
    order, sure = head_order(x, min(max(n, 64), x.shape[0]), mask)  # (a head under 64 is rarely found above the bound)
    if sure >= n:
        return order[:n]
    tied = np.flatnonzero(np.equal(x, x[order[sure]], out=mask))  # ascending ids: the stable order's among equal values
    return np.concatenate((order[:sure], tied[: n - sure]))


def row_logprobs(row: npt.ArrayLike, token: int, n_top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """``token``'s log-probability under ``row``'s log-softmax (float64), and the row's ``n_top`` most likely ids
    (:func:`top_ids`) with theirs: a logprobs request's figures for one emitted token, in this thread's row
    buffers (:class:`_Rows`)."""
    x = np.asarray(row)
    n = x.shape[0]
    z, mask = _ROWS.take(n)
    peak = float(x.max())
    lse = peak + float(np.log(np.exp(np.subtract(x, peak, out=z, dtype=np.float64), out=z).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        top = tuple((int(i), float(x[i]) - lse) for i in top_ids(x, min(n_top, n), mask))
    return float(x[token]) - lse, top


def _grown(m: int, n: int, covered: float, need: float) -> int:
    """The next head size of :meth:`TargetSampler._draw_from_all`: 16x, or the whole row at once when the head
    held less than half of the probability mass the cut or the draw needs (a flat row: a sort of the head
    after the head would cost more than the one sort of the row)."""
    return n if covered < need / 2 else 16 * m
