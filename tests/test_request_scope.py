"""The request's scope reaches a proposer that declares it wants it (ProposerCapabilities.request_scope),
right before each begin; a proposer that declares nothing is begun as before."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from power_core import AdapterFault, PowerConfig, ProposerCapabilities, RequestScope, Session
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
