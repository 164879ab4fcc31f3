"""The request's scope reaches a proposer that declares it wants it (ProposerCapabilities.request_scope),
right before each begin; a proposer that declares nothing is begun as before."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from power_core import AdapterFault, Cancelled, CancelToken, PowerConfig, ProposerCapabilities, RequestScope, Session
from power_core.reference.proposers import ProposerWrapper

REF = "reference:seed=11,vocab=97,dim=16"


class Scoped(ProposerWrapper):
    """Records the scopes it is told and the begins that follow them."""

    def __init__(self, inner: Any, fail: bool = False) -> None:
        super().__init__(inner)
        self.seen: list[Any] = []
        self.fail = fail

    @property
    def capabilities(self) -> ProposerCapabilities:
        return attrs.evolve(self.inner.capabilities, request_scope=self.told)

    def told(self, scope: RequestScope) -> None:
        if self.fail:
            raise ValueError("scope bug")
        self.seen.append(scope)

    def begin(self, prompt: Any) -> None:
        self.seen.append("begin")
        super().begin(prompt)


def test_the_tenant_is_told_before_each_begin() -> None:
    with Session.open(PowerConfig(spec_mode="ref-draft", max_tokens=6), model=REF) as s:
        assert s.proposer is not None
        s.proposer = spy = Scoped(s.proposer)
        s.start([1, 2, 3, 4], tenant="a").run()
        s.start([1, 2, 3, 4]).run()
        res = s.start([5, 6, 7], tenant="b").run()
    assert spy.seen == [RequestScope("a"), "begin", RequestScope(""), "begin", RequestScope("b"), "begin"]
    assert res.receipt.config["tenant"] == "b"


def test_a_failing_scope_is_an_adapter_fault_naming_it() -> None:
    with Session.open(PowerConfig(spec_mode="ref-draft", max_tokens=6), model=REF) as s:
        assert s.proposer is not None
        s.proposer = Scoped(s.proposer, fail=True)
        with pytest.raises(AdapterFault) as err:
            s.start([1, 2, 3]).run()
        assert err.value.method == "request_scope" and s.opened.target.n_past == 0


class Ends(ProposerWrapper):
    """Records the requests it is told have finished."""

    def __init__(self, inner: Any, fail: bool = False) -> None:
        super().__init__(inner)
        self.ended = 0
        self.fail = fail

    @property
    def capabilities(self) -> ProposerCapabilities:
        return attrs.evolve(self.inner.capabilities, request_end=self.told)

    def told(self) -> None:
        self.ended += 1
        if self.fail:
            raise ValueError("end bug")


def test_a_finished_request_is_told_once_a_cancelled_one_never() -> None:
    with Session.open(PowerConfig(spec_mode="ref-draft", max_tokens=6), model=REF) as s:
        assert s.proposer is not None
        s.proposer = spy = Ends(s.proposer)
        gen = s.start([1, 2, 3])
        gen.run()
        gen.run()  # a finished request runs no more and is not told again
        assert spy.ended == 1
        cancel = CancelToken()
        cancelled = s.start([4, 5, 6], cancel=cancel)
        rounds = cancelled.rounds()
        next(rounds)
        cancel.cancel()
        with pytest.raises(Cancelled):
            for _ in rounds:
                pass
        assert spy.ended == 1 and cancelled.receipt is not None and cancelled.receipt.status == "cancelled"
        s.start([1, 2, 3], target_only=True).run()  # the proposer did not serve it
        assert spy.ended == 1
        s.proposer = Ends(spy.inner, fail=True)
        res = s.start([1, 2, 3]).run()  # a proposer that fails to hear it: logged, the request is whole
        assert res.receipt.status == "completed" and len(res.tokens) == 6
