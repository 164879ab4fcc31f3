"""The batch-numerics self-test and ``require_identical``, on the reference backend and on a backend
whose verify rows drift from its one-token rows (as Gemma-3's do on stock CPU kernels)."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
from helpers import core_plugins, open_session

from power_core import cli
from power_core.config import PowerConfig
from power_core.errors import CapacityError, ConfigError
from power_core.numerics import selftest
from power_core.plugins import Backend, OpenRequest, Strategy, hookimpl
from power_core.reference import plugin as reference
from power_core.runtime import DecodeResult, TokenArray

MODEL = "reference:seed=3,vocab=97,dim=16,recurrent=1"


class DriftingTarget:
    """A reference target whose multi-row passes add ``drift`` to row ``j >= from_row``'s logit
    ``j`` (so the argmax can flip), like a kernel that picks another summation order for n > 1."""

    def __init__(self, inner, drift: float, from_row: int = 3) -> None:
        self.inner, self.drift, self.from_row = inner, drift, from_row

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def capabilities(self):
        return self.inner.capabilities

    @property
    def n_past(self) -> int:
        return self.inner.n_past

    def decode(self, tokens: TokenArray) -> DecodeResult:
        res = self.inner.decode(tokens)
        if len(tokens) <= self.from_row:
            return res
        logits = np.array(res.logits, dtype=np.float32)
        for j in range(self.from_row, len(tokens)):
            logits[j, j % logits.shape[1]] += self.drift
        return DecodeResult(tokens=res.tokens, logits=logits, features=res.features)


class _DriftPlugin:
    __name__ = "test.drift"

    def __init__(self, drift: float) -> None:
        self.drift = drift

    @hookimpl
    def power_register_backends(self, register) -> None:
        def open_(req: OpenRequest):
            opened = reference.open_reference(req)
            return type(opened)(target=DriftingTarget(opened.target, self.drift), tokenizer=opened.tokenizer,
                                model_path=opened.model_path, artifacts=opened.artifacts,
                                backend_info=opened.backend_info, close=opened.close)

        register(Backend(name="drifting", version="0", package="test", open=open_,
                         accepts=lambda m: False, resolve=lambda m: m))

    @hookimpl
    def power_register_strategies(self, register) -> None:
        register(Strategy(name="drift-draft", version="0", package="test", kind="model-backed",
                          proposer=_unwrapped_ref_draft, backends=frozenset({"drifting"})))


def _unwrapped_ref_draft(req):
    """The reference's self-draft, drafting from the undrifted weights (its proposals are exact)."""
    return reference.make_ref_draft(attrs.evolve(req, opened=attrs.evolve(req.opened, target=req.opened.target.inner)))


def _target(drift: float | None, **cfg):
    extra = (_DriftPlugin(drift),) if drift is not None else ()
    config = PowerConfig(spec_mode="off", n_ctx=512, **cfg)
    plugins = core_plugins(*extra)
    backend = plugins.backends["drifting" if drift is not None else "reference"]
    return backend.open(OpenRequest(model=MODEL, config=config, max_block=16, snapshots=0))


def test_reference_target_is_batch_invariant():
    opened = _target(None)
    report = selftest(opened.target)
    assert report.identical and report.max_abs_diff == 0.0 and report.first_argmax_diff is None
    assert {(p["context"], p["width"]) for p in report.probes} == {(c, w) for c in (20, 250, 300) for w in (2, 4, 8, 16, 64)}
    assert opened.target.n_past == 0  # the probe leaves the target empty


def test_drift_is_measured_with_its_first_argmax_flip():
    opened = _target(1e-3)
    report = selftest(opened.target)
    assert not report.identical
    assert report.max_abs_diff == pytest.approx(1e-3, rel=0.2)
    assert report.first_argmax_diff is None  # too small to flip an argmax
    assert all(p["rows_differing"] == (max(0, p["width"] - 3)) for p in report.probes)

    report = selftest(_target(1e4).target)
    assert report.first_argmax_diff == {"context": 20, "width": 4, "row": 3}
    assert "argmax first differs at context 20 + row 3" in report.reason()


def test_probes_fit_the_target_or_fail_typed():
    opened = _target(None)
    report = selftest(opened.target, contexts=(20, 10_000), widths=(2, 100_000))
    assert [(p["context"], p["width"]) for p in report.probes] == [(20, 2)]
    with pytest.raises(CapacityError, match="n_ctx"):
        selftest(opened.target, contexts=(600,))


def test_require_identical_falls_back_to_target_only_with_the_reason():
    extra = (_DriftPlugin(1e4),)
    prompt = list(range(1, 9))
    with open_session(MODEL, "off", None, n_ctx=512) as s:
        want = s.generate(prompt).tokens
    from power_core.session import Session

    config = PowerConfig(spec_mode="drift-draft", n_ctx=512, require_identical=True)
    with Session.open(config, model=MODEL, backend="drifting", plugins=core_plugins(*extra)) as s:
        assert s.selection.strategy.name == "off"
        assert s.selection.reason.startswith("require_identical: verify rows differ")
        res = s.generate(prompt)
    assert res.receipt.strategy["name"] == "off" and res.receipt.selftest["identical"] is False
    assert res.receipt.selftest["first_argmax_diff"] is not None
    assert "selftest_s" in res.receipt.timings
    # an identical build keeps the strategy, and the receipt says it was checked
    with Session.open(attrs.evolve(config, spec_mode="ref-draft"), model=MODEL, plugins=core_plugins()) as s:
        assert s.selection.strategy.name == "ref-draft"
        res = s.generate(prompt)
    assert res.receipt.selftest["identical"] is True and res.tokens == want


def test_without_the_probe_a_drifting_target_is_not_caught_by_the_session():
    """What the probe is for: speculation on a drifting target silently changes the output."""
    from power_core.session import Session

    extra = (_DriftPlugin(1e4),)
    prompt = list(range(1, 9))
    plugins = core_plugins(*extra)
    with Session.open(PowerConfig(spec_mode="off", n_ctx=512), model=MODEL, backend="drifting", plugins=plugins) as s:
        want = s.generate(prompt).tokens
    with Session.open(PowerConfig(spec_mode="drift-draft", n_ctx=512), model=MODEL, backend="drifting",
                      plugins=plugins) as s:
        got = s.generate(prompt)
    assert got.receipt.selftest is None
    assert got.tokens != want


@pytest.mark.parametrize("value", ["fast", "", None, 1])
def test_numerics_key_is_validated(value):
    if value is None:
        assert PowerConfig().numerics == "exact"
        return
    with pytest.raises(ConfigError, match="numerics"):
        PowerConfig(numerics=value)


def test_cli_selftest_json_and_exit_code(capsys):
    assert cli.main(["selftest", "--model", MODEL, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is True and out["numerics"] == "exact" and out["max_abs_diff"] == 0.0
    assert out["first_argmax_diff"] is None and len(out["probes"]) == 15
    assert cli.main(["selftest", "--model", MODEL]) == 0
    assert "bit-identical" in capsys.readouterr().out
    assert cli.main(["selftest", "--model", MODEL, "--numerics", "fast"]) == 1
