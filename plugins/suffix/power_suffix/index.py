"""An incremental n-gram suffix index over a token sequence, with exact truncation.

For every appended token the index records, for each length ``L`` in :data:`LENGTHS`, the rolling
hash of the ``L`` tokens ending there, chained to the previous position with the same hash (per
length: a dict from hash to the most recent position, and a list of the previous position for every
position; plain ints, so the garbage collector has no per-token objects to walk). A query finds the
longest indexed suffix of the sequence that also ended earlier, walks its chain for the most recent
:data:`MAX_CANDIDATES` occurrences, extends the match backwards exactly (vectorized), and votes over
the continuations of every earlier occurrence with that longest match, position by position, so a
proposal stops where the occurrences disagree. Appends are O(len(LENGTHS)) per token.

Everything appended after a length ``n`` can be removed again (:meth:`SuffixIndex.truncate`),
which is what a proposer's ``restore`` needs.

An index of other text (earlier requests, a corpus: :mod:`power_suffix.memory`) answers
:meth:`SuffixIndex.find`: the longest suffix of a request's history that occurs anywhere in it, and
the continuation its occurrences agree on. Such an index holds several documents, each followed by
:data:`SEPARATOR` (no token id equals it, so no match and no continuation crosses it), is never
truncated (``truncatable=False`` keeps no per-position hashes) and may index fewer lengths.
"""

from __future__ import annotations

from array import array
from collections.abc import MutableSequence
from itertools import repeat

import attrs
import numpy as np

__all__ = ["LENGTHS", "SEPARATOR", "Match", "SuffixIndex", "suffix_hashes"]

#: indexed suffix lengths (a match longer than the largest is measured exactly by extension)
LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 32)
#: rolling hashes are polynomials in _BASE modulo 2**64 (numpy's uint64 arithmetic wraps the same way);
#: a collision only costs a candidate (matches are measured exactly)
_MASK = (1 << 64) - 1
_BASE = 1_000_003
_BASE_INV = pow(_BASE, -1, 1 << 64)
_POW = [pow(_BASE, n, 1 << 64) for n in range(max(LENGTHS) + 1)]
#: extends of this many tokens or more take the vectorized path
_CHUNK = 32
#: occurrences considered per query (the most recent ones)
MAX_CANDIDATES = 32
#: exact backward extension is measured up to this many tokens (the acceptance model buckets
#: every match of 32 or more tokens together)
MAX_MATCH = 64
_OFFSETS = np.arange(MAX_MATCH + 1)
#: ends a document in an index of several (never a token id: nothing matches or continues across it)
SEPARATOR = -1


@attrs.frozen
class Match:
    """The continuation found for the current suffix."""

    length: int  # tokens of the current suffix matched earlier (exact, capped at MAX_MATCH)
    occurrences: int  # earlier occurrences with that match
    tokens: np.ndarray  # the voted continuation
    share: np.ndarray  # per continuation token: fraction of the occurrences that agree


class SuffixIndex:
    """The index of one growing token sequence (``lengths``: the suffix lengths it hashes, ascending;
    ``truncatable``: keep what :meth:`truncate` needs)."""

    def __init__(self, lengths: tuple[int, ...] = LENGTHS, *, truncatable: bool = True) -> None:
        if not lengths or list(lengths) != sorted(set(lengths)) or lengths[0] < 1 or lengths[-1] > max(LENGTHS):
            raise ValueError(f"lengths must be ascending, distinct and within [1, {max(LENGTHS)}], not {lengths}")
        self.lengths = lengths
        self.truncatable = truncatable
        self._tok = np.zeros(1024, dtype=np.int32)
        self.n = 0

        def ints() -> MutableSequence[int]:
            # a request's own index: lists (the fastest appends and reads); an index of other text, which
            # may hold a large budget: packed 8-byte ints
            return [] if truncatable else array("q")

        self._pre: MutableSequence[int] = [] if truncatable else array("Q")  # rolling prefix hashes (< 2**64)
        self._pre.append(0)
        # per length: hash -> most recent position ending with it; per position, the hash of the L tokens
        # ending there (only when truncatable) and the previous position with that hash (-1: none, or
        # fewer than L tokens)
        self._head: dict[int, dict[int, int]] = {L: {} for L in lengths}
        self._keys: dict[int, MutableSequence[int]] = {L: ints() for L in lengths}
        self._prev: dict[int, MutableSequence[int]] = {L: ints() for L in lengths}

    @property
    def tokens(self) -> np.ndarray:
        return self._tok[: self.n]

    def extend(self, tokens) -> None:
        """Append ``tokens`` (ids) and index every suffix length ending at each of them."""
        toks = np.asarray(tokens, dtype=np.int64).ravel()
        if toks.size == 0:
            return
        n0, need = self.n, self.n + toks.size
        if need > self._tok.shape[0]:
            grown = np.zeros(max(need, 2 * self._tok.shape[0]), dtype=np.int32)
            grown[:n0] = self._tok[:n0]
            self._tok = grown
        self._tok[n0:need] = toks
        if toks.size >= _CHUNK:
            self._extend_chunk(toks)
        else:
            self._extend_each(toks)
        self.n = need

    def _extend_each(self, toks: np.ndarray) -> None:
        """:meth:`extend` token by token (a round's few tokens: no array set-up)."""
        pre = self._pre
        keep = self.truncatable
        lanes = [(L, _POW[L], self._head[L], self._keys[L], self._prev[L]) for L in self.lengths]
        for t in toks.tolist():
            h = (pre[-1] * _BASE + t + 1) & _MASK
            pre.append(h)
            end = len(pre) - 1  # the new token's position + 1
            for L, power, head, keys, prev in lanes:
                if L > end:
                    if keep:
                        keys.append(-1)
                    prev.append(-1)
                    continue
                key = (h - pre[end - L] * power) & _MASK
                if keep:
                    keys.append(key)
                prev.append(head.get(key, -1))
                head[key] = end - 1

    def _extend_chunk(self, toks: np.ndarray) -> None:
        """:meth:`extend` of many tokens at once (a prompt, a learned document): the same hashes and
        chains as :meth:`_extend_each`, with the arithmetic vectorized (uint64 wraps modulo 2**64) and
        the dictionaries updated by C loops."""
        m = int(toks.shape[0])
        pre = self._pre
        n0 = len(pre) - 1  # tokens indexed so far
        # prefix hashes: pre[n0 + i] = B^i * (pre[n0] + sum_{j <= i} (t_j + 1) B^-j), modulo 2**64
        with np.errstate(over="ignore"):
            powers = np.cumprod(np.full(m, _BASE, dtype=np.uint64))
            inverse = np.cumprod(np.full(m, _BASE_INV, dtype=np.uint64))
            acc = np.cumsum((toks.astype(np.uint64) + np.uint64(1)) * inverse, dtype=np.uint64)
            new = powers * (np.uint64(pre[-1]) + acc)
            tail = min(n0, max(self.lengths))
            full = np.concatenate([np.asarray(pre[len(pre) - 1 - tail:len(pre) - 1], dtype=np.uint64),
                                   np.asarray([pre[-1]], dtype=np.uint64), new])  # pre[n0 - tail .. n0 + m]
        pre.extend(new.tolist())
        ends = np.arange(n0 + 1, n0 + m + 1)  # a new token's position + 1
        for L in self.lengths:
            head, prev = self._head[L], self._prev[L]
            short = int(np.count_nonzero(ends < L))  # positions with fewer than L tokens: no hash
            if short:
                if self.truncatable:
                    self._keys[L].extend([-1] * short)
                prev.extend([-1] * short)
            if short == m:
                continue
            at = ends[short:] - (n0 - tail)  # indexes into full
            with np.errstate(over="ignore"):
                keys = full[at] - full[at - L] * np.uint64(_POW[L])
            pos = ends[short:] - 1
            # the previous position with the same hash: within the chunk from a stable sort; for the
            # first of each hash in the chunk, the chain head so far
            order = np.argsort(keys, kind="stable")
            sk = keys[order]
            dup = sk[1:] == sk[:-1]
            before = np.full(keys.shape[0], -1, dtype=np.int64)
            before[order[1:][dup]] = pos[order[:-1][dup]]
            first = order[np.concatenate(([True], ~dup))]
            klist = keys.tolist()
            before[first] = np.fromiter(map(head.get, keys[first].tolist(), repeat(-1)), dtype=np.int64,
                                        count=first.shape[0])
            if self.truncatable:
                self._keys[L].extend(klist)
            prev.extend(before.tolist())
            head.update(zip(klist, pos.tolist(), strict=True))  # in order: the last position of a hash wins

    def truncate(self, n: int) -> None:
        """Forget every token from position ``n`` on (exactly as if they had never been appended)."""
        if n >= self.n:
            return
        if not self.truncatable:
            raise ValueError("this index keeps no per-position hashes (truncatable=False)")
        for L in self.lengths:
            head, keys, prev = self._head[L], self._keys[L], self._prev[L]
            for pos in range(self.n - 1, max(n, L - 1) - 1, -1):  # positions with an L-token hash
                if prev[pos] < 0:
                    del head[keys[pos]]
                else:
                    head[keys[pos]] = prev[pos]
            del keys[n:]
            del prev[n:]
        del self._pre[n + 1:]
        self.n = n

    def match(self, max_tokens: int) -> Match | None:
        """The longest earlier occurrence(s) of the current suffix and their voted continuation
        (at most ``max_tokens``); ``None`` when even the last token never occurred before."""
        n = self.n
        if n < 2 or max_tokens <= 0:
            return None
        ends = None
        for L in reversed(self.lengths):
            if L >= n:
                continue
            at = self._prev[L][n - 1]  # the current suffix is the most recent entry of its chain; the one before it
            if at >= 0:
                ends = _chain(self._prev[L], at)
                break
        if ends is None:
            return None
        tok = self._tok
        # exact match length per candidate (hash collisions drop out here), extended backwards
        span = int(min(MAX_MATCH, n - 1))
        lengths = _match_lengths(tok, ends, tok[n - 1 - _OFFSETS[:span]])
        best = int(lengths.max())
        if best == 0:
            return None
        ends = ends[lengths == best]
        out, share = _vote(tok, n, ends, max_tokens)
        period = n - 1 - int(ends[-1])  # the most recent occurrence is this far back
        if period <= best and len(out) == period and out == tok[n - period:n].tolist():
            # the match overlaps itself: the last best + period tokens repeat with this period, and the
            # proposal ran into the present; it goes on repeating (a list, a loop of the model's)
            for j in range(period, max_tokens):
                out.append(out[j - period])
                share.append(share[j - period])
        return Match(length=best, occurrences=int(ends.size), tokens=np.asarray(out, dtype=np.int32),
                     share=np.asarray(share, dtype=np.float64))

    def find(self, query: np.ndarray, max_tokens: int, hashes: dict[int, int] | None = None,
             beat: tuple[int, int] = (0, 0)) -> Match | None:
        """The longest suffix of ``query`` (another sequence's tokens, e.g. a request's history) that
        occurs in this index, and the continuation its most recent occurrences agree on (at most
        ``max_tokens``); ``None`` when not even the shortest indexed length occurs, or when the match's
        ``(length, occurrences)`` is not above ``beat`` (a match found elsewhere: a match that would lose
        to it costs no vote). ``hashes``: :func:`suffix_hashes` of the query, when several indexes are
        asked the same."""
        q = np.asarray(query, dtype=np.int64)[-MAX_MATCH:]
        m = int(q.shape[0])
        if m == 0 or max_tokens <= 0 or self.n == 0:
            return None
        if hashes is None:
            hashes = suffix_hashes(q, self.lengths)
        # a match of beat's length or longer occurs at every indexed length up to it: once the lengths
        # below the longest of those are reached without a hit, nothing here can win
        floor = max((L for L in self.lengths if L <= beat[0]), default=0)
        ends = None
        for L in reversed(self.lengths):
            if L < floor:
                return None
            at = self._head[L].get(hashes[L], -1) if L in hashes else -1
            if at >= 0:
                ends = _chain(self._prev[L], at)
                break
        if ends is None:
            return None
        tok = self._tok
        lengths = _match_lengths(tok, ends, q[::-1])
        best = int(lengths.max())
        if best == 0:  # hash collisions only
            return None
        ends = ends[lengths == best]
        if (best, int(ends.size)) <= beat:
            return None
        out, share = _vote(tok, self.n, ends, max_tokens, separated=True)
        return Match(length=best, occurrences=int(ends.size), tokens=np.asarray(out, dtype=np.int32),
                     share=np.asarray(share, dtype=np.float64))


def _chain(prev: MutableSequence[int], at: int) -> np.ndarray:
    """The occurrences on a hash chain from ``at`` back (at most ``MAX_CANDIDATES``), oldest first."""
    found: list[int] = []
    while at >= 0 and len(found) < MAX_CANDIDATES:
        found.append(at)
        at = prev[at]
    return np.asarray(found[::-1], dtype=np.int64)


def _match_lengths(tok: np.ndarray, ends: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """For each candidate end in ``tok``, how many tokens of ``cur`` (a suffix, read backwards) match
    backwards from it (hash collisions give 0). Ufuncs only (``np.clip``/``np.where`` cost more
    than the comparison itself at these sizes)."""
    span = cur.shape[0]
    at = ends[:, None] - _OFFSETS[None, :span]
    eq = tok[np.maximum(at, 0)] == cur[None, :]
    eq &= at >= 0
    out = eq.argmin(axis=1)
    out[eq.all(axis=1)] = span
    return out


def suffix_hashes(query: np.ndarray, lengths: tuple[int, ...] = LENGTHS) -> dict[int, int]:
    """The hash an index keeps for the window of each of ``lengths`` that ends ``query`` (lengths
    longer than the query are left out), built from the right."""
    qs = np.asarray(query, dtype=np.int64)[-max(lengths):].tolist()
    m = len(qs)
    hashes: dict[int, int] = {}
    h, j = 0, 0
    for L in lengths:
        if L > m:
            break
        while j < L:
            h = (h + (qs[m - 1 - j] + 1) * _POW[j]) & _MASK
            j += 1
        hashes[L] = h
    return hashes


def _vote(tok: np.ndarray, n: int, ends: np.ndarray, max_tokens: int,
          separated: bool = False) -> tuple[list[int], list[float]]:
    """The continuation of the occurrences ending at ``ends`` in ``tok[:n]``, position by position: the
    token most of the occurrences still in agreement continue with (ties: the smaller id), while it
    has at least half of all their votes; an occurrence whose continuation runs past ``n`` stops
    voting, and so does one that reaches a :data:`SEPARATOR` (the end of its document: ``separated``,
    an index of several documents). Returns the tokens and their vote shares (at most ``max_tokens``)."""
    if ends.size == 1:  # one occurrence: its continuation, to the end of the sequence (or of its document)
        e = int(ends[0])
        cont = tok[e + 1:min(n, e + 1 + max_tokens)].tolist()
        if separated and SEPARATOR in cont:
            cont = cont[:cont.index(SEPARATOR)]
        return cont, [1.0] * len(cont)
    total = float(ends.size)
    cols = ends[:, None] + _OFFSETS[None, 1:max_tokens + 1]
    ok = cols < n
    cont = np.where(ok, tok[np.minimum(cols, n - 1)], -1)
    if separated:  # nothing after a separator votes
        ok &= np.cumsum(cont < 0, axis=1) == 0
        cont = np.where(ok, cont, -1)
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
