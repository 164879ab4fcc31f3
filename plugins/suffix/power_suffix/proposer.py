"""``SuffixProposer``: model-free speculation from earlier occurrences of the current suffix.

Per round it looks up the longest suffix of the committed history (prompt and everything emitted)
that occurred before in the request itself (:class:`~power_suffix.index.SuffixIndex`) and, when the
session has a :class:`~power_suffix.memory.SuffixMemory`, in earlier requests of the same tenant
and in the corpus. It prefers the longest match, then the most occurrences, then the request's own
text, and proposes the continuation the occurrences agree on. How far it drafts is decided per round:

* at most ``ALPHA`` times the match length (a two-token match drafts little, a long one up to the
  round's cap) and never past the point where the occurrences disagree (vote share < 1/2);
* every proposal carries a confidence, the probability that it is accepted given the previous one
  was: an acceptance model per source and match-length bucket (a Beta prior that favours long
  matches, updated with every verified round of the session) times the proposal's vote share. The
  core's scheduler combines it with the target's verify-cost curve to choose the width that
  maximizes expected tokens per second (``Proposal.confidence``).

What is offered depends only on the history and on what the memory holds (never on the acceptance
model); each proposal names its source (``request``, ``shared`` or ``corpus``: ``Proposal.source``),
so the receipt counts the tokens accepted from each. The memory learns a request when it finishes
(``ProposerCapabilities.request_end``); one cancelled or failed, when the next begins or the session
closes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from power_core.runtime import (
    DecodeResult,
    Proposal,
    ProposalContext,
    ProposerCapabilities,
    RequestScope,
    TokenArray,
)
from power_suffix.index import LENGTHS, Match, SuffixIndex
from power_suffix.memory import SuffixMemory

__all__ = ["SuffixProposer", "ALPHA", "SOURCES"]

#: a match of L tokens drafts at most ALPHA * L tokens
ALPHA = 4
#: pseudo-counts of the acceptance model's prior: it trusts a match of L tokens L/(L+1) (a one-token
#: match is a coin flip; on bench_memory's traffic matches of 1-3 tokens continued 41-63 % of the
#: time, 6 or more 95-99 %), worth this many verified rounds
PRIOR_WEIGHT = 4.0
#: where a proposal comes from (``Proposal.source``), in the order that wins a tie
SOURCES = ("request", "shared", "corpus")


def _bucket(length: int) -> int:
    """The largest indexed length not above ``length`` (the acceptance model's bucket)."""
    b = 0
    for i, L in enumerate(LENGTHS):
        if length >= L:
            b = i
    return b


class SuffixProposer:
    """Suffix-index drafting; one per session. ``memory``: the cross-request and corpus indexes it
    consults and teaches (``None``: the request's own text only)."""

    features: frozenset[str] = frozenset()

    def __init__(self, memory: SuffixMemory | None = None) -> None:
        self.index = SuffixIndex()
        self.memory: SuffixMemory | None = None
        self._tenant = ""
        self._prompt_len = 0
        self._learned = True  # the current request was given to the memory (or there is none)
        # acceptance model: per source and bucket, continued / stopped counts, with a prior favouring long matches
        prior = np.array([L / (L + 1.0) for L in LENGTHS])
        self._succ = np.tile(PRIOR_WEIGHT * prior, (len(SOURCES), 1))
        self._fail = np.tile(PRIOR_WEIGHT * (1.0 - prior), (len(SOURCES), 1))
        self._round: tuple[int, int, int] | None = None  # (source, bucket, proposals verified) of the round
        self._offered: tuple[int, int, int] | None = None
        if memory is not None:
            self.attach(memory)

    @property
    def capabilities(self) -> ProposerCapabilities:
        """Model-free, on the host, reads no target rows; it learns whom each request runs for and,
        with a memory, hands each request to it when the request finishes (or, one that did not
        finish, when the next begins or the session closes)."""
        return ProposerCapabilities(request_scope=self.request_scope, request_end=self._learn, close=self.close)

    # -- the memory ----------------------------------------------------------------------------------
    def attach(self, memory: SuffixMemory | None) -> None:
        """Consult and teach ``memory`` from the next request on (``None``: none); the previous one
        is given what it has not learned yet."""
        if memory is self.memory:
            return
        self._learn()
        if self.memory is not None:
            self.memory.release()
        if memory is not None:
            memory.acquire()
        self.memory = memory

    def close(self) -> None:
        """The session closes: the memory learns the last request (and saves, when this was its last user)."""
        self.attach(None)

    def _learn(self) -> None:
        """Give the current request (its output; with ``learn_prompts`` its prompt too) to the memory."""
        if self._learned or self.memory is None:
            self._learned = True
            return
        self._learned = True
        tokens = self.index.tokens
        self.memory.learn(self._tenant, tokens if self.memory.learn_prompts else tokens[self._prompt_len:])

    # -- protocol ---------------------------------------------------------------------------------
    def request_scope(self, scope: RequestScope) -> None:
        self._learn()  # the previous request, under the tenant it ran for
        self._tenant = scope.tenant

    def begin(self, prompt: TokenArray) -> None:
        self._learn()
        self._reindex(np.asarray(prompt))
        self._prompt_len = self.index.n
        self._learned = False
        self._round = self._offered = None

    def checkpoint(self) -> Any:
        return (self.index.n, self._succ.copy(), self._fail.copy())

    def propose(self, ctx: ProposalContext) -> Proposal:
        self._sync(ctx.history)
        self._offered = None
        if ctx.k <= 0:
            return Proposal.none()
        best: Match | None = self.index.match(ctx.k)
        source = 0
        if best is not None and best.tokens.size == 0:
            best = None
        if self.memory is not None:
            found = self.memory.find(self._tenant, ctx.history, ctx.k,
                                     (0, 0) if best is None else (best.length, best.occurrences))
            if found is not None:  # longer, or as long with more occurrences
                best, source = found.match, SOURCES.index(found.source)
        if best is None:
            return Proposal.none()
        m = best
        agreed = int(np.argmax(m.share < 0.5)) if (m.share < 0.5).any() else m.share.size
        n = min(ctx.k, ALPHA * m.length, agreed)
        if n <= 0:
            return Proposal.none()
        b = _bucket(m.length)
        q = self._succ[source, b] / (self._succ[source, b] + self._fail[source, b])
        self._offered = (source, b, n)
        return Proposal(m.tokens[:n].copy(), confidence=q * m.share[:n], source=SOURCES[source],
                        stats={"match_length": float(m.length), "occurrences": float(m.occurrences)})

    def observe(self, result: DecodeResult) -> None:
        if self._offered is not None and result.kind == "verify":
            # the scheduler may have verified fewer than offered: learn only from what was verified
            source, b, _ = self._offered
            self._round = (source, b, int(result.tokens.shape[0]) - 1)

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        if self._round is not None and self._round[2] > 0:
            source, b, verified = self._round
            self._succ[source, b] += n_accepted
            self._fail[source, b] += 1.0 if n_accepted < verified else 0.0
        self._round = self._offered = None
        # the round's tokens are committed: index them now, so the last round's reach the memory too
        # (the round's checkpoint holds the length before them, so a restore takes them out again)
        self.index.extend(emitted)

    def restore(self, checkpoint: Any) -> None:
        n, succ, fail = checkpoint
        self.index.truncate(n)
        self._succ, self._fail = succ.copy(), fail.copy()
        self._round = self._offered = None

    # -- internals ------------------------------------------------------------------------------------
    def _sync(self, history: TokenArray) -> None:
        """Index the committed history (the transaction's history always extends what was indexed)."""
        have = self.index.n
        hist = np.asarray(history)
        if have > hist.shape[0] or (have and self.index.tokens[have - 1] != hist[have - 1]):
            self._reindex(hist)  # a history this index did not see grow
        elif hist.shape[0] > have:
            self.index.extend(hist[have:])

    def _reindex(self, tokens: np.ndarray) -> None:
        """Make the index hold exactly ``tokens``. A new request usually resends what the previous one
        held (a chat's history, an agent's transcript): the index is cut back to the prefix they share
        and only the rest is indexed (the index is the same as a fresh one's: truncation is exact),
        unless that costs more than indexing everything afresh."""
        held = self.index.tokens
        n = min(held.shape[0], tokens.shape[0])
        differ = np.flatnonzero(held[:n] != tokens[:n])
        keep = int(differ[0]) if differ.size else n
        if (held.shape[0] - keep) + (tokens.shape[0] - keep) < tokens.shape[0]:
            self.index.truncate(keep)
            self.index.extend(tokens[keep:])
        else:
            self.index = SuffixIndex()
            self.index.extend(tokens)
