"""The conformance kit's fault tools: :class:`FaultInjector` (an observer that raises or cancels at one phase
of one round) and proposer wrappers that misbehave on purpose or watch (:class:`SkipRounds`,
:class:`FailOnCall`, :class:`Recorder`)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from power_core.errors import Cancelled, RuntimeFault
from power_core.reference.proposers import ProposerWrapper
from power_core.runtime import Proposal, ProposalContext, Proposer
from power_core.spec import hookimpl
from power_core.transaction import CancelToken

__all__ = ["FailOnCall", "FaultInjector", "InjectedFault", "Recorder", "SkipRounds"]


class InjectedFault(RuntimeFault):
    code = "injected_fault"


@attrs.define(eq=False)
class FaultInjector:
    """An observer plugin that cancels or raises at one phase of one round (before or after it runs)."""

    phase: str | None = None
    round_index: int = 1
    when: str = "before"  # before | after
    action: str = "raise"  # raise | cancel
    cancel: CancelToken | None = None
    fired: int = 0
    __name__: str = "power.testing.injector"

    @hookimpl(wrapper=True)
    def power_txn_phase(self, phase: str, round_index: int):
        hit = phase == self.phase and round_index == self.round_index and self.fired == 0
        if hit and self.when == "before":
            self._fire(phase)
        result = yield
        if hit and self.when == "after":
            self._fire(phase)
        return result

    def _fire(self, phase: str) -> None:
        self.fired += 1
        if self.action == "cancel":
            assert self.cancel is not None
            self.cancel.cancel()
            if phase == "emit":  # nothing left to check in this round: cancel takes effect next round
                return
            raise Cancelled(f"injected cancel at {phase}")
        raise InjectedFault(f"injected fault at {self.when} {phase}")


class _Transparent(ProposerWrapper):
    """A wrapper that forwards every attribute it does not define to the proposer it wraps (its
    ``capabilities`` too, through :class:`ProposerWrapper`), so wrapping changes nothing the
    transaction can see."""

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class SkipRounds(ProposerWrapper):
    """Every ``every``-th round proposes nothing."""

    def __init__(self, inner: Proposer, every: int = 2) -> None:
        super().__init__(inner)
        self.every = every

    def propose(self, ctx: ProposalContext) -> Proposal:
        got = self.inner.propose(ctx)
        return Proposal.none() if ctx.round_index % self.every == 0 and isinstance(got, Proposal) else got


class FailOnCall(_Transparent):
    """Raise ``ValueError`` from ``method`` on its ``call``-th invocation (an adapter bug)."""

    def __init__(self, inner: Proposer, method: str, call: int = 2) -> None:
        super().__init__(inner)
        self.method, self.call, self.calls = method, call, 0
        original = getattr(self, method)

        def failing(*args: Any) -> Any:
            self.calls += 1
            if self.calls == self.call:
                raise ValueError(f"adapter bug in {method}")
            return original(*args)

        setattr(self, method, failing)


class Recorder(_Transparent):
    """Records what the proposer offered each round, before the scheduler chose a width:
    ``offered[round_index] == (ctx.k, [ids...])`` and ``at[len(ctx.history)]`` the same, keyed by
    where the round starts (a re-run round overwrites its entries)."""

    def __init__(self, inner: Proposer) -> None:
        super().__init__(inner)
        self.offered: dict[int, tuple[int, list[int]]] = {}
        self.at: dict[int, tuple[int, list[int]]] = {}

    def propose(self, ctx: ProposalContext) -> Proposal:
        got = self.inner.propose(ctx)
        # what is not a Proposal goes through unrecorded: the transaction refuses it with the fix
        ids = got.ids if isinstance(got, Proposal) else ()
        self.offered[ctx.round_index] = self.at[len(ctx.history)] = (ctx.k, np.asarray(ids).reshape(-1).tolist())
        return got
