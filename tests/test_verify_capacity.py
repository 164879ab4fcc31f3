"""Config ``verify_capacity`` (stable verify shapes) on the reference backend: every target pass is
padded to exactly B tokens, and the padding never reaches the output, the memory or a proposer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from power_core.config import PowerConfig
from power_core.errors import CapacityError, ConfigError
from power_core.reference.model import ReferenceModel, ReferenceTarget
from power_core.reference.plugin import make_ref_draft
from power_core.reference.proposers import ProposerWrapper
from power_core.runtime import DecodeResult, TokenArray
from power_core.session import Session
from power_core.spec import Backend, OpenedModel, OpenRequest, ProposerRequest, Strategy, hookimpl
from tests.helpers import core_plugins, open_session, run

try:
    import power_suffix.plugin as suffix_plugin
except ImportError:  # the suffix strategy is a plugin; the core's tests run without it
    suffix_plugin = None

FLAT = "reference:seed=3,vocab=61,dim=12,recurrent=0"


# -- configuration --------------------------------------------------------------------------------------
def test_default_is_off_and_k_resolves_under_b():
    assert PowerConfig().verify_capacity == 0
    assert PowerConfig(verify_capacity=4).draft_max == 3  # the core's default K=7, capped at B - 1
    assert PowerConfig(verify_capacity=16).draft_max == 7
    assert PowerConfig(verify_capacity=8, spec_draft_max=7).draft_max == 7
    assert PowerConfig(verify_capacity=6).capped_draft_max(32) == 5
    assert PowerConfig().capped_draft_max(32) == 32


@pytest.mark.parametrize("value", [-1, 1, 257, True, 2.0, "8"])
def test_bad_values_are_typed_errors(value):
    with pytest.raises(ConfigError) as err:
        PowerConfig(verify_capacity=value)
    assert err.value.key == "verify_capacity"


def test_block_wider_than_capacity_names_both_keys():
    with pytest.raises(ConfigError) as err:
        PowerConfig(spec_draft_max=8, verify_capacity=8)
    assert err.value.key == "verify_capacity" and "spec_draft_max + 1 = 9" in str(err.value)
    PowerConfig(spec_draft_max=7, verify_capacity=8)  # K + 1 == B fits
    with pytest.raises(ConfigError, match="spec_draft_max"):
        PowerConfig.from_mapping({"verify_capacity": 4}, spec_draft_max=4)


def test_cli_flag_sets_the_key(capsys):
    from power_core.cli import main

    rc = main(["run", "--backend", "reference", "--model", FLAT, "--mode", "off", "--prompt", "ab", "--max-tokens",
               "4", "--verify-capacity", "6", "--json"])
    assert rc == 0
    import json

    receipt = json.loads(capsys.readouterr().out)["receipt"]
    assert receipt["config"]["verify_capacity"] == 6
    assert receipt["backend"]["verify_capacity"] == 6 and receipt["backend"]["verify_widths"] == {"6": 3}


def test_strategy_default_k_is_capped():
    pytest.importorskip("power_suffix")
    with Session.open(PowerConfig(spec_mode="suffix", verify_capacity=6, n_ctx=256), model=FLAT,
                      plugins=core_plugins(suffix_plugin)) as s:
        assert s.config.spec_draft_max == 5  # suffix's default 32, capped at B - 1
        assert s.opened.target.capabilities.max_block == 6


# -- refusals ---------------------------------------------------------------------------------------------
def test_recurrent_target_is_refused():
    with pytest.raises(ConfigError, match="recurrent") as err:
        open_session("reference:recurrent=1", "ref-draft", spec_draft_max=3, verify_capacity=4)
    assert err.value.key == "verify_capacity"


def test_shared_passes_are_refused_and_serve_runs_padded_slots():
    cfg = PowerConfig(spec_mode="off", verify_capacity=4, n_ctx=256)
    with pytest.raises(ConfigError, match="verify_capacity") as err:
        Session.open_batch(2, cfg, model=FLAT, plugins=core_plugins())
    assert err.value.key == "parallel"  # like a strategy that cannot share passes
    from power_core.serve import open_sessions

    slots = open_sessions(cfg, 2, model=FLAT, plugins=core_plugins())
    try:
        assert not slots.shared and "verify_capacity" in slots.why
        assert all(s.opened.target.capabilities.verify_capacity == 4 for s in slots.sessions)
    finally:
        slots.close()


class _UnpaddedBackend:
    """A backend that ignores ``verify_capacity``: its target reports no padding."""

    @hookimpl
    def power_register_backends(self, register: Callable[[Backend], None]) -> None:
        def open_plain(req: OpenRequest) -> OpenedModel:
            return OpenedModel(target=ReferenceTarget(ReferenceModel.from_spec(FLAT), n_ctx=req.config.n_ctx))

        register(Backend(name="plain", version="1", package="tests", open=open_plain, accepts=lambda m: False))


def test_a_backend_that_does_not_pad_is_refused():
    with pytest.raises(ConfigError, match="does not pad") as err:
        Session.open(PowerConfig(spec_mode="off", verify_capacity=4, n_ctx=256), model=FLAT, backend="plain",
                     plugins=core_plugins(_UnpaddedBackend()))
    assert err.value.key == "verify_capacity"


# -- the runtime ------------------------------------------------------------------------------------------
def test_padded_rows_and_memory_are_the_unpadded_ones():
    model = ReferenceModel.from_spec(FLAT)
    plain, padded = ReferenceTarget(model, n_ctx=64, max_block=8), ReferenceTarget(model, n_ctx=64, max_block=8,
                                                                                  verify_capacity=8)
    assert padded.capabilities.verify_capacity == 8
    rng = np.random.default_rng(0)
    for t in (plain, padded):
        t.prefill(np.arange(1, 10, dtype=np.int32))
    for n in (1, 3, 8, 5):
        block = rng.integers(0, model.vocab, n).astype(np.int32)
        cps = [t.checkpoint() for t in (plain, padded)]
        a, b = plain.decode(block), padded.decode(block)
        assert b.logits.shape == (n, model.vocab) and b.features["hidden"].shape[0] == n
        assert a.logits.tobytes() == b.logits.tobytes()
        assert a.features["hidden"].tobytes() == b.features["hidden"].tobytes()
        assert plain.n_past == padded.n_past
        keep = max(1, n - 2)
        assert plain.rollback(cps[0], keep) and padded.rollback(cps[1], keep)
    with pytest.raises(CapacityError):
        ReferenceTarget(model, n_ctx=64, max_block=8, verify_capacity=8).decode(np.zeros(9, dtype=np.int32))
    # the last position of the context still has cells for the padding
    full = ReferenceTarget(model, n_ctx=16, max_block=8, verify_capacity=8)
    full.prefill(np.ones(15, dtype=np.int32))
    assert full.decode(np.ones(1, dtype=np.int32)).logits.shape[0] == 1 and full.n_past == 16


# -- end to end: padded == unpadded, and no proposer ever sees the padding -------------------------------
class _Spy(ProposerWrapper):
    """Records what the proposer is shown: every observed pass (tokens, rows, taps) and commit."""

    def __init__(self, inner: Any, log: list[tuple[Any, ...]]) -> None:
        super().__init__(inner)
        self.log = log

    def observe(self, result: DecodeResult) -> None:
        self.log.append(("observe", result.kind, result.tokens.tolist(), result.logits.shape[0],
                         np.asarray(result.logits).tobytes(),
                         {k: np.asarray(v).tobytes() for k, v in result.features.items()}))
        super().observe(result)

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        self.log.append(("commit", n_accepted, np.asarray(emitted).tolist()))
        super().commit(n_accepted, emitted)


class _SpyPlugin:
    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    @hookimpl
    def power_register_strategies(self, register: Callable[[Strategy], None]) -> None:
        def make(req: ProposerRequest) -> _Spy:
            return _Spy(make_ref_draft(req), self.log)

        register(Strategy(name="spy-draft", version="1", package="tests", proposer=make,
                          backends=frozenset({"reference"})))


def _spied(model: str, prompt: list[int], draft: str | None, **cfg: Any) -> tuple[Any, list[tuple[Any, ...]]]:
    spy = _SpyPlugin()
    with Session.open(PowerConfig(spec_mode="spy-draft", n_ctx=256, **cfg), model=model, draft=draft,
                      plugins=core_plugins(spy)) as s:
        return s.generate(prompt), spy.log


def test_proposer_sees_exactly_the_unpadded_passes():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain, seen = _spied(FLAT, prompt, "reference:accept=0.5", spec_draft_max=5, max_tokens=40)
    padded, seen_padded = _spied(FLAT, prompt, "reference:accept=0.5", spec_draft_max=5, max_tokens=40,
                                 verify_capacity=9)
    assert padded.tokens == plain.tokens and seen_padded == seen
    assert any(entry[0] == "commit" and entry[1] < 5 for entry in seen)  # rejections happened
    assert padded.receipt.backend["verify_widths"] == {"9": padded.receipt.timings["target_passes"]}
    assert padded.receipt.rounds == [{**r, "seconds": p["seconds"]}
                                     for r, p in zip(plain.receipt.rounds, padded.receipt.rounds, strict=True)]


STRATEGIES = ["off", "ref-draft"] + (["suffix"] if suffix_plugin is not None else [])


@st.composite
def scenarios(draw):
    vocab = draw(st.integers(8, 97))
    model = (f"reference:seed={draw(st.integers(0, 10_000))},vocab={vocab},dim={draw(st.integers(4, 16))},"
             f"recurrent=0,sharp={draw(st.sampled_from([1.0, 3.0, 8.0]))}")
    mode = draw(st.sampled_from(STRATEGIES))
    k = draw(st.integers(1, 12))
    b = draw(st.integers(k + 1, k + 9))
    draft = None
    if mode == "ref-draft":
        draft = draw(st.sampled_from([None, "reference:accept=0.3", "reference:accept=0.8",
                                      f"reference:seed=7,vocab={vocab},dim=8,recurrent=0"]))
    # repeats give the suffix strategy something to copy
    unit = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
    prompt = (unit * draw(st.integers(1, 4)))[:16]
    cfg: dict[str, Any] = dict(max_tokens=draw(st.integers(1, 40)))
    if mode != "off":
        cfg.update(spec_draft_max=k, spec_adaptive=draw(st.booleans()))
    if draw(st.booleans()):
        cfg.update(temperature=draw(st.floats(0.2, 1.5)), top_k=draw(st.sampled_from([0, 5])),
                   seed=draw(st.integers(0, 2**32)))
    return model, mode, draft, prompt, b, cfg


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_padded_equals_unpadded(scenario):
    model, mode, draft, prompt, b, cfg = scenario
    extra = (suffix_plugin,) if mode == "suffix" else ()

    def go(**more: Any) -> Any:
        with Session.open(PowerConfig(spec_mode=mode, n_ctx=256, **cfg, **more), model=model, draft=draft,
                          plugins=core_plugins(*extra)) as s:
            return s.generate(prompt)

    plain, padded = go(), go(verify_capacity=b)
    assert padded.tokens == plain.tokens
    assert padded.receipt.output_sha256 == plain.receipt.output_sha256
    passes = padded.receipt.timings["target_passes"]
    assert padded.receipt.backend["verify_widths"] == ({str(b): passes} if passes else {})
    assert sum(plain.receipt.backend["verify_widths"].values()) == plain.receipt.timings["target_passes"]
    if mode != "suffix":  # suffix's cost-aware width sees a flat cost curve when padded, so its rounds may differ
        strip = [{k: v for k, v in r.items() if k != "seconds"} for r in plain.receipt.rounds]
        assert [{k: v for k, v in r.items() if k != "seconds"} for r in padded.receipt.rounds] == strip


def test_run_helper_pads_target_only_decoding():
    res = run(FLAT, [1, 2, 3], "off", max_tokens=6, verify_capacity=4)
    assert res.receipt.backend["verify_widths"] == {"4": 5}
    assert res.tokens == run(FLAT, [1, 2, 3], "off", max_tokens=6).tokens
