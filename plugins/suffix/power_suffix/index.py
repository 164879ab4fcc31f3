"""An incremental n-gram suffix index over a token sequence, with exact truncation.

For every appended token the index records, for each length ``L`` in :data:`LENGTHS`, the rolling
hash of the ``L`` tokens ending there. A query finds the longest indexed suffix of the sequence
that also ended earlier, extends the match backwards exactly (vectorized), and votes over the
continuations of every earlier occurrence with that longest match, position by position, so a
proposal stops where the occurrences disagree. Appends are O(len(LENGTHS)) per token; a query is
a few dictionary lookups plus numpy over at most :data:`MAX_CANDIDATES` occurrences.

Everything appended after a length ``n`` can be removed again (:meth:`SuffixIndex.truncate`),
which is what a proposer's ``restore`` needs.
"""

from __future__ import annotations

import attrs
import numpy as np

__all__ = ["LENGTHS", "Match", "SuffixIndex"]

#: indexed suffix lengths (a match longer than the largest is measured exactly by extension)
LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
_MOD = (1 << 61) - 1
_BASE = 1_000_003
_POW = [pow(_BASE, n, _MOD) for n in range(max(LENGTHS) + 1)]
#: occurrences considered per query (the most recent ones)
MAX_CANDIDATES = 32
#: exact backward extension is measured up to this many tokens (the acceptance model buckets
#: every match of 32 or more tokens together)
MAX_MATCH = 64


@attrs.frozen
class Match:
    """The continuation found for the current suffix."""

    length: int  # tokens of the current suffix matched earlier (exact, capped at MAX_MATCH)
    occurrences: int  # earlier occurrences with that match
    tokens: np.ndarray  # the voted continuation
    share: np.ndarray  # per continuation token: fraction of the occurrences that agree


class SuffixIndex:
    """The index of one growing token sequence."""

    def __init__(self) -> None:
        self._tok = np.zeros(1024, dtype=np.int32)
        self.n = 0
        self._pre = [0]  # rolling prefix hashes
        self._tables: dict[int, dict[int, list[int]]] = {L: {} for L in LENGTHS}
        self._journal: list[tuple[int, int]] = []  # (L, key) per insertion, in order, for truncation
        self._marks: list[int] = [0]  # journal length after each token

    @property
    def tokens(self) -> np.ndarray:
        return self._tok[: self.n]

    def extend(self, tokens) -> None:
        """Append ``tokens`` (ids) and index every suffix length ending at each of them."""
        toks = np.asarray(tokens, dtype=np.int64).ravel()
        if toks.size == 0:
            return
        need = self.n + toks.size
        if need > self._tok.shape[0]:
            grown = np.zeros(max(need, 2 * self._tok.shape[0]), dtype=np.int32)
            grown[: self.n] = self._tok[: self.n]
            self._tok = grown
        self._tok[self.n:need] = toks
        pre, tables, journal, marks = self._pre, self._tables, self._journal, self._marks
        for t in toks.tolist():
            h = (pre[-1] * _BASE + t + 1) % _MOD
            pre.append(h)
            end = len(pre) - 1  # the new token's position + 1
            for L in LENGTHS:
                if L > end:
                    break
                key = (h - pre[end - L] * _POW[L]) % _MOD
                tables[L].setdefault(key, []).append(end - 1)
                journal.append((L, key))
            marks.append(len(journal))
        self.n = need

    def truncate(self, n: int) -> None:
        """Forget every token from position ``n`` on (exactly as if they had never been appended)."""
        if n >= self.n:
            return
        keep = self._marks[n]
        for L, key in reversed(self._journal[keep:]):
            bucket = self._tables[L][key]
            bucket.pop()
            if not bucket:
                del self._tables[L][key]
        del self._journal[keep:]
        del self._marks[n + 1:]
        del self._pre[n + 1:]
        self.n = n

    def _key(self, L: int) -> int:
        pre = self._pre
        return (pre[self.n] - pre[self.n - L] * _POW[L]) % _MOD

    def match(self, max_tokens: int) -> Match | None:
        """The longest earlier occurrence(s) of the current suffix and their voted continuation
        (at most ``max_tokens``); ``None`` when even the last token never occurred before."""
        n = self.n
        if n < 2 or max_tokens <= 0:
            return None
        ends = None
        for L in reversed(LENGTHS):
            if L >= n:
                continue
            bucket = self._tables[L].get(self._key(L))
            if bucket is not None and len(bucket) > 1:  # the last entry is the current suffix itself
                ends = np.asarray(bucket[-1 - MAX_CANDIDATES:-1], dtype=np.int64)
                break
        if ends is None:
            return None
        tok = self._tok
        # exact match length per candidate (hash collisions drop out here), extended backwards
        span = int(min(MAX_MATCH, n - 1))
        offs = np.arange(span)
        cur = tok[n - 1 - offs]
        valid = (ends[:, None] - offs[None, :]) >= 0
        eq = (tok[np.clip(ends[:, None] - offs[None, :], 0, None)] == cur[None, :]) & valid
        lengths = np.where(eq.all(axis=1), span, np.argmin(eq, axis=1))
        best = int(lengths.max())
        if best == 0:
            return None
        ends = ends[lengths == best]
        out, share = _vote(tok, n, ends, max_tokens)
        return Match(length=best, occurrences=int(ends.size), tokens=np.asarray(out, dtype=np.int32),
                     share=np.asarray(share, dtype=np.float64))


def _vote(tok: np.ndarray, n: int, ends: np.ndarray, max_tokens: int) -> tuple[list[int], list[float]]:
    """The continuation of the occurrences ending at ``ends`` in ``tok[:n]``, position by position: the
    token most of the occurrences still in agreement continue with (ties: the smaller id), while it
    has at least half of all their votes; an occurrence whose continuation runs past ``n`` stops
    voting. Returns the tokens and their vote shares (at most ``max_tokens``)."""
    total = float(ends.size)
    cols = ends[:, None] + np.arange(1, max_tokens + 1)[None, :]
    ok = cols < n
    cont = np.where(ok, tok[np.minimum(cols, n - 1)], -1)
    # the columns where every occurrence continues with the same token: one vectorized pass
    same = (ok & (cont == cont[:1])).all(axis=0)
    j0 = int(np.argmin(same)) if not same.all() else max_tokens
    out: list[int] = cont[0, :j0].tolist()
    share: list[float] = [1.0] * j0
    # then the majority among the occurrences still agreeing (at most MAX_CANDIDATES x max_tokens
    # small ints: plain Python beats a numpy call per position)
    rows = cont[:, j0:].tolist()
    alive = list(range(len(rows)))
    for j in range(max_tokens - j0):
        counts: dict[int, int] = {}
        for r in alive:
            t = rows[r][j]
            if t >= 0:  # -1: past the end of the sequence
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        votes = max(counts.values())
        if votes / total < 0.5:
            break  # the occurrences disagree: no proposal past this point
        top = min(t for t, c in counts.items() if c == votes)
        out.append(top)
        share.append(votes / total)
        alive = [r for r in alive if rows[r][j] == top]
    return out, share
