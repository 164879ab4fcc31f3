"""``SuffixProposer``: model-free speculation from the sequence's own earlier occurrences.

Per round it looks up the longest suffix of the committed history (prompt, everything emitted,
and, when the host enables it, earlier requests of the same session) that occurred before (:class:`~power_suffix.index.SuffixIndex`),
and proposes the continuation the occurrences agree on. How far it drafts is decided per round:

* at most ``ALPHA`` times the match length (a two-token match drafts little, a long one up to the
  round's cap) and never past the point where the occurrences disagree (vote share < 1/2);
* every proposal carries a confidence, the probability that it is accepted given the previous one
  was: an acceptance model per match-length bucket (a Beta prior that favours long matches,
  updated with every verified round of the session) times the proposal's vote share. The core's
  scheduler combines it with the target's verify-cost curve to choose the width that maximizes
  expected tokens per second (``Proposal.confidence``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from power_core.runtime import DecodeResult, Proposal, ProposalContext, ProposerCapabilities, TokenArray
from power_suffix.index import LENGTHS, SuffixIndex

__all__ = ["SuffixProposer", "ALPHA", "SESSION_MEMORY"]

#: a match of L tokens drafts at most ALPHA * L tokens
ALPHA = 4
#: pseudo-counts of the acceptance model's prior (the prior trusts a match of L tokens (L+1)/(L+2))
PRIOR_WEIGHT = 2.0
#: earlier requests of the session kept searchable (tokens); off unless the host asks for it with
#: ``POWER_SUFFIX_SESSION_TOKENS`` (e.g. a chat host whose requests repeat each other)
SESSION_MEMORY = int(os.environ.get("POWER_SUFFIX_SESSION_TOKENS", "0") or 0)
_EMPTY = np.zeros(0, dtype=np.int32)


def _bucket(length: int) -> int:
    """The largest indexed length not above ``length`` (the acceptance model's bucket)."""
    b = 0
    for i, L in enumerate(LENGTHS):
        if length >= L:
            b = i
    return b


class SuffixProposer:
    """Suffix-index drafting; one per session (it remembers the session's earlier requests)."""

    features: frozenset[str] = frozenset()
    #: none: model-free, on the host, reads no target rows, holds nothing to close
    capabilities = ProposerCapabilities()

    def __init__(self, *, session_memory: int = SESSION_MEMORY) -> None:
        self.session_memory = session_memory
        self.index = SuffixIndex()
        self._base = 0  # tokens of earlier requests at the start of the index
        # acceptance model: per bucket, continued / stopped counts, with a prior favouring long matches
        prior = np.array([(L + 1.0) / (L + 2.0) for L in LENGTHS])
        self._succ = PRIOR_WEIGHT * prior
        self._fail = PRIOR_WEIGHT * (1.0 - prior)
        self._round: tuple[int, int] | None = None  # (bucket, proposals verified) of the current round
        self._offered: tuple[int, int] | None = None

    # -- protocol ---------------------------------------------------------------------------------
    def begin(self, prompt: TokenArray) -> None:
        # earlier requests of the session (the most recent session_memory tokens) stay searchable
        keep = self.index.tokens[-self.session_memory:].copy() if self.session_memory else _EMPTY
        self.index = SuffixIndex()
        self.index.extend(keep)
        self._base = self.index.n
        self.index.extend(prompt)
        self._round = self._offered = None

    def checkpoint(self) -> Any:
        return (self.index.n, self._succ.copy(), self._fail.copy())

    def propose(self, ctx: ProposalContext) -> Proposal:
        self._sync(ctx.history)
        self._offered = None
        if ctx.k <= 0:
            return Proposal.none()
        m = self.index.match(ctx.k)
        if m is None or m.tokens.size == 0:
            return Proposal.none()
        agreed = int(np.argmax(m.share < 0.5)) if (m.share < 0.5).any() else m.share.size
        n = min(ctx.k, ALPHA * m.length, agreed)
        if n <= 0:
            return Proposal.none()
        b = _bucket(m.length)
        q = self._succ[b] / (self._succ[b] + self._fail[b])
        self._offered = (b, n)
        return Proposal(m.tokens[:n].copy(), confidence=q * m.share[:n], stats={"match_length": float(m.length)})

    def observe(self, result: DecodeResult) -> None:
        if self._offered is not None and result.kind == "verify":
            # the scheduler may have verified fewer than offered: learn only from what was verified
            self._round = (self._offered[0], int(result.tokens.shape[0]) - 1)

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        if self._round is not None and self._round[1] > 0:
            b, verified = self._round
            self._succ[b] += n_accepted
            self._fail[b] += 1.0 if n_accepted < verified else 0.0
        self._round = self._offered = None

    def restore(self, checkpoint: Any) -> None:
        n, succ, fail = checkpoint
        self.index.truncate(n)
        self._succ, self._fail = succ.copy(), fail.copy()
        self._round = self._offered = None

    # -- internals ------------------------------------------------------------------------------------
    def _sync(self, history: TokenArray) -> None:
        """Index the committed history (the transaction's history always extends what was indexed)."""
        have = self.index.n - self._base
        hist = np.asarray(history)
        if have > hist.shape[0] or (have and self.index.tokens[self.index.n - 1] != hist[have - 1]):
            self.index.truncate(self._base)  # a history this index did not see grow: re-index it
            have = 0
        if hist.shape[0] > have:
            self.index.extend(hist[have:])
