"""A transaction's round values, shared with whoever drives it and reads it (the engine, a
generation, the server): the :class:`CancelToken` checked between its steps, an open round
(:class:`PendingRound`), a committed one (:class:`RoundRecord`, a line of the receipt's trace) and an
emitted token's log-probability (:class:`TokenLogprob`). They hold no logic of the transaction's own
(:mod:`power_core.transaction`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from power_core.runtime import DecodeResult, Proposal, ProposalContext, TokenArray
from power_core.sampling import row_logprobs
from power_core.scheduler import RoundPlan

__all__ = ["CancelToken", "PendingRound", "RoundRecord", "TokenLogprob"]

_EMPTY = np.zeros(0, dtype=np.int32)


class CancelToken:
    """Thread-safe cancellation flag, checked between transaction steps.

    Runtimes that can interrupt work in flight (llama.cpp's abort callback) subscribe with
    :meth:`subscribe`; ``cancel()`` then also stops a running decode, and ``reset()`` withdraws it.
    A request's runtime listens only while the request runs (:meth:`unsubscribe` when it ends), so a
    late ``cancel()`` never stops the next request on that runtime.
    """

    def __init__(self) -> None:
        self._set = False  # one bool: reading or writing it is atomic under the GIL
        self._subscribers: list[tuple[Callable[[], None], Callable[[], None]]] = []
        self._lock = threading.RLock()  # a subscriber is never called after unsubscribe() returned

    def subscribe(self, on_cancel: Callable[[], None], on_reset: Callable[[], None]) -> None:
        with self._lock:
            if (on_cancel, on_reset) not in self._subscribers:
                self._subscribers.append((on_cancel, on_reset))

    def unsubscribe(self, on_cancel: Callable[[], None], on_reset: Callable[[], None]) -> None:
        """Stop telling ``on_cancel``/``on_reset``; once this returns, neither runs for this token."""
        with self._lock:
            if (on_cancel, on_reset) in self._subscribers:
                self._subscribers.remove((on_cancel, on_reset))

    def cancel(self) -> None:
        self._set = True
        with self._lock:
            for on_cancel, _ in self._subscribers:
                on_cancel()

    def reset(self) -> None:
        self._set = False
        with self._lock:
            for _, on_reset in self._subscribers:
                on_reset()

    @property
    def cancelled(self) -> bool:
        return self._set


@attrs.frozen
class RoundRecord:
    """One committed round, as it appears in the receipt's trace."""

    index: int
    planned: int
    reason: str
    proposed: int
    accepted: int
    emitted: int
    replayed: bool
    shape: int  # tokens in the verify pass (anchor + proposals)
    stop: str | None
    seconds: float
    #: the proposed token ids, recorded only when tracing (config ``trace``)
    proposal: tuple[int, ...] | None = None
    #: the cost-aware width choice and its inputs (cost-aware strategies only)
    width: dict[str, Any] | None = None
    #: proposed tokens the request's constraint removed before verification (from the first it forbids)
    cut: int = 0
    #: where the proposal came from and the proposer's statistics of it (``Proposal.source``, ``.stats``)
    source: str | None = None
    stats: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as the receipt's trace holds it: its fields in declaration order, its dicts copied, the
        optional ones only when set (``cut`` when non-zero); a literal, a third of a comprehension's cost."""
        out = {"index": self.index, "planned": self.planned, "reason": self.reason, "proposed": self.proposed,
               "accepted": self.accepted, "emitted": self.emitted, "replayed": self.replayed, "shape": self.shape,
               "stop": self.stop, "seconds": self.seconds}
        if self.proposal is not None:
            out["proposal"] = list(self.proposal)
        if self.width is not None:
            out["width"] = dict(self.width)
        if self.cut:
            out["cut"] = self.cut
        if self.source is not None:
            out["source"] = self.source
        if self.stats is not None:
            out["stats"] = dict(self.stats)
        return out


@attrs.frozen
class TokenLogprob:
    """An emitted token's log-probability under the target row that emitted it (the row's
    log-softmax: the model's distribution, before temperature and truncation), and the row's most
    likely ids with theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_row(cls, row: Any, token: int, n_top: int) -> TokenLogprob:
        logprob, top = row_logprobs(row, int(token), n_top)
        return cls(token=int(token), logprob=logprob, top=top)


@attrs.define(eq=False)
class PendingRound:
    """A round between :meth:`~power_core.transaction.Transaction.open_round` (or ``begin_round``) and
    :meth:`~power_core.transaction.Transaction.close_round` (or ``abort_round``)."""

    t0: float
    plan: RoundPlan
    first: DecodeResult | None  # round 0: the prefill's row is its verify pass
    cp_target: Any
    cp_proposer: Any
    decoder: tuple[int, int, str | None]
    props: TokenArray = _EMPTY
    block: TokenArray = _EMPTY
    width: dict[str, Any] | None = None
    cut: int = 0
    #: the checked proposal (its ``ids``: what the proposer offered, before the width and constraint cuts)
    proposal: Proposal = attrs.field(factory=Proposal.none)
    #: what the proposer is asked this round (``None``: nothing, the width is 0 or no proposer)
    ask: ProposalContext | None = None
    #: the accept phase's result once the round's rows are read (:meth:`~power_core.transaction.Transaction.read_round`):
    #: the round's tokens, how many proposals they accept, and the stop reason
    accept: tuple[list[int], int, str | None] | None = None

    @property
    def needs_pass(self) -> bool:
        """False for round 0, whose verify row came from the prefill."""
        return self.first is None
