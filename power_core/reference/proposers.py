"""Toy proposers over the reference backend, with controllable acceptance.

:class:`DraftModelProposer` drafts greedily with any :class:`~power_core.runtime.TargetRuntime`
(the target's own weights give 100 % greedy acceptance). :class:`NoisyProposer` wraps a proposer and
corrupts each proposal with a seeded, position-indexed probability, so tests can dial acceptance
from 0 to 1 (or force a rejection at one position with ``reject_at``).
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from power_core.runtime import (
    DecodeResult,
    Proposal,
    ProposalContext,
    Proposer,
    ProposerCapabilities,
    TargetRuntime,
    TokenArray,
)

__all__ = ["DraftModelProposer", "NoisyProposer", "ProposerWrapper"]


@attrs.define(eq=False)
class DraftModelProposer:
    """Greedy drafting with a second runtime whose memory mirrors the committed history."""

    draft: TargetRuntime
    features: frozenset[str] = frozenset()
    #: none (a test may declare more, e.g. ``reads_target_rows``)
    capabilities: ProposerCapabilities = attrs.field(factory=ProposerCapabilities)
    _anchor: int = attrs.field(init=False, default=-1)
    _base: Any = attrs.field(init=False, default=None)

    def begin(self, prompt: TokenArray) -> None:
        self.draft.reset()
        if len(prompt) > 1:
            self.draft.prefill(np.asarray(prompt[:-1], dtype=np.int32))  # memory: all but the anchor
        self._anchor = int(prompt[-1])

    def checkpoint(self) -> Any:
        self._base = self.draft.checkpoint()
        return (self._base, self._anchor)

    def propose(self, ctx: ProposalContext) -> Proposal:
        out = np.empty(ctx.k, dtype=np.int32)
        cur = ctx.anchor
        for i in range(ctx.k):
            cur = int(np.argmax(self.draft.decode(np.array([cur], dtype=np.int32)).logits[0]))
            out[i] = cur
        return Proposal(out)

    def observe(self, result: DecodeResult) -> None:
        return None

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        # back to the round's base, then append the old anchor and every emitted token but the last
        self.draft.restore(self._base)
        block = np.concatenate(([self._anchor], np.asarray(emitted[:-1], dtype=np.int32))).astype(np.int32)
        self.draft.decode(block)
        self._anchor = int(emitted[-1])

    def restore(self, checkpoint: Any) -> None:
        base, anchor = checkpoint
        self.draft.restore(base)
        self._anchor = anchor


class ProposerWrapper:
    """Forwards the :class:`~power_core.runtime.Proposer` protocol to ``inner``; subclasses override
    the methods they change (acceptance control here, fault injection in the conformance kit)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.features = frozenset(inner.features)

    @property
    def capabilities(self) -> ProposerCapabilities:
        """The wrapped proposer's (wrapping changes nothing it declared)."""
        return self.inner.capabilities

    def begin(self, prompt: TokenArray) -> None:
        self.inner.begin(prompt)

    def checkpoint(self) -> Any:
        return self.inner.checkpoint()

    def propose(self, ctx: ProposalContext) -> Proposal:
        return self.inner.propose(ctx)

    def observe(self, result: DecodeResult) -> None:
        self.inner.observe(result)

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        self.inner.commit(n_accepted, emitted)

    def restore(self, checkpoint: Any) -> None:
        self.inner.restore(checkpoint)


class NoisyProposer(ProposerWrapper):
    """Corrupt proposals of ``inner``: position ``j`` survives with probability ``acceptance``.

    The draw depends only on (seed, committed length, j), so a restored round proposes the same
    tokens again. ``reject_at`` forces the first corruption at that position (``None``: random);
    ``keep_tail`` keeps the (now unverifiable) proposals after it, so blocks stay full width.
    """

    def __init__(self, inner: Proposer, vocab: int, acceptance: float = 1.0, seed: int = 0,
                 reject_at: int | None = None, keep_tail: bool = False) -> None:
        super().__init__(inner)
        self.vocab, self.acceptance, self.seed = vocab, acceptance, seed
        self.reject_at, self.keep_tail = reject_at, keep_tail

    def propose(self, ctx: ProposalContext) -> Proposal:
        got = self.inner.propose(ctx)
        props = np.array(got.ids, dtype=np.int32)
        rng = np.random.Generator(np.random.Philox(key=self.seed, counter=[len(ctx.history), 0, 0, 0]))
        u = np.atleast_1d(rng.random(props.shape[0]))
        for j in range(props.shape[0]):
            if j == self.reject_at or (self.reject_at is None and u[j] >= self.acceptance):
                props[j] = (props[j] + 1 + int(u[j] * (self.vocab - 1)) % (self.vocab - 1)) % self.vocab
                n = props.shape[0] if self.keep_tail else j + 1
                conf = None if got.confidence is None else got.confidence[:n]
                return Proposal(props[:n], confidence=conf, stats=got.stats)
        return Proposal(props, confidence=got.confidence, stats=got.stats)
