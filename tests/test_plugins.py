"""Plugin discovery, registries, allowlist, hook contract, and the public facade."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pluggy
import pytest

import power_core
from power_core import hookspecs
from power_core.errors import AdapterFault, PluginError, StrategyNotFound, StrategyNotInstalled
from power_core.plugins import Backend, Registry, Strategy, build_plugins, hookimpl
from power_core.testing.faults import FailOnCall, FaultInjector
from tests.helpers import core_plugins, open_session, run

DOCS = Path(__file__).resolve().parent.parent / "docs" / "hooks.md"
HOOKS = sorted(n for n in dir(hookspecs) if n.startswith("power_"))


def test_public_facade_is_pinned():
    assert sorted(power_core.__all__) == sorted([
        "PHASES", "AdapterFault", "ArtifactError", "ArtifactMismatch", "Backend", "CancelToken", "Cancelled",
        "CapacityError", "ChatTemplate", "ConfigError", "ConfigKey", "ConstraintError", "ConstraintSpec", "DecodeResult",
        "Generation", "Grammars", "OpenRequest", "OpenedModel",
        "PluginError", "PowerConfig", "PowerError", "PromptCache", "PromptCacheStats", "Proposal", "ProposalBatch", "ProposalContext", "Proposer", "ProposerCapabilities",
        "ProposerRequest",
        "Receipt", "RequestScope", "Result", "RoundOutcome", "RoundPlan", "RuntimeFault", "Scheduler", "Session", "SessionBusy", "StateLost",
        "Strategy", "StrategyNotFound", "StrategyNotInstalled", "Stream", "TargetCapabilities", "TargetRuntime",
        "TargetSampler", "Tokenizer", "ToolPlan", "Transaction", "Vocabulary", "get_plugins", "hookimpl", "token_digest",
    ])
    for name in power_core.__all__:
        assert getattr(power_core, name).__doc__ or name == "PHASES", name


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented_with_its_exact_signature(hook):
    spec = getattr(hookspecs, hook)
    sig = f"{hook}{inspect.signature(spec)}".replace("'", "")
    text = DOCS.read_text()
    assert sig in text, f"docs/hooks.md lacks the signature {sig}"
    assert spec.__doc__ and ":param" in spec.__doc__ and "Called by" in spec.__doc__


def test_every_hook_has_a_test():
    names = set(globals())
    missing = [h for h in HOOKS if f"test_hook_{h}" not in names]
    assert not missing


def test_hook_power_register_strategies():
    class P:
        __name__ = "p"

        @hookimpl
        def power_register_strategies(self, register):
            register(Strategy(name="tiny", version="1", package="tiny"))

    plugins = core_plugins(P())
    assert plugins.strategies["tiny"].package == "tiny"
    assert plugins.strategies.owner("tiny") == "p"


def test_hook_power_register_backends():
    class P:
        __name__ = "pb"

        @hookimpl
        def power_register_backends(self, register):
            register(Backend(name="nullb", version="1", package="x", open=lambda r: None, accepts=lambda m: False))

    assert "nullb" in core_plugins(P()).backends


def test_hook_power_request_start_and_end():
    seen = []

    class P:
        __name__ = "obs"

        @hookimpl
        def power_request_start(self, request):
            seen.append(("start", request.strategy, request.prompt_tokens))

        @hookimpl
        def power_request_end(self, receipt):
            seen.append(("end", receipt.status, receipt.output_tokens))

    with open_session("reference:vocab=40,dim=8", "ref-draft", None, P(), max_tokens=5) as s:
        s.generate([1, 2, 3])
    assert seen == [("start", "ref-draft", 3), ("end", "completed", 5)]


test_hook_power_request_start = test_hook_power_request_end = test_hook_power_request_start_and_end


def test_hook_power_txn_phase():
    order = []

    class Timer:
        __name__ = "timer"

        @hookimpl(wrapper=True)
        def power_txn_phase(self, phase, round_index):
            result = yield
            order.append((round_index, phase))
            return result

    with open_session("reference:vocab=40,dim=8", "ref-draft", None, Timer(), max_tokens=3, spec_draft_max=2) as s:
        s.generate([1, 2, 3])
    assert order[:6] == [(0, p) for p in ("checkpoint", "propose", "verify", "accept", "commit", "emit")]
    inj = FaultInjector(phase="verify", round_index=0)
    with open_session("reference:vocab=40,dim=8", "ref-draft", None, Timer(), inj, max_tokens=3) as s:
        with pytest.raises(RuntimeError, match="injected"):
            s.generate([1, 2, 3])
    assert (0, "restore") in order


def test_registry_rejects_duplicates_and_bad_names():
    reg: Registry[Strategy] = Registry(Strategy)
    reg.registrar("a")(Strategy(name="x", version="1", package="a"))
    with pytest.raises(PluginError, match="already registered by 'a'"):
        reg.registrar("b")(Strategy(name="x", version="1", package="b"))
    with pytest.raises(PluginError, match="expected a power_core.Strategy"):
        reg.registrar("b")("not a strategy")
    with pytest.raises(PluginError, match="lowercase name"):
        Strategy(name="", version="1", package="a")
    with pytest.raises(PluginError, match="lowercase name"):
        Strategy(name="Bad Name", version="1", package="a")


def test_misspelled_hook_is_a_hard_error():
    class Typo:
        __name__ = "typo"

        @hookimpl
        def power_register_stratgies(self, register):
            pass

    with pytest.raises(PluginError, match="names no Power hook"):
        build_plugins(extra=(Typo(),))


def test_allowlist_empty_loads_no_external_plugin(monkeypatch):
    monkeypatch.setenv("POWER_LOAD_PLUGINS", "")
    plugins = build_plugins()
    assert [n for n, _ in plugins.pm.list_name_plugin()] == ["power.core", "power.reference"]


def test_broken_entry_point_names_itself(monkeypatch):
    from importlib import metadata

    ep = metadata.EntryPoint(name="broken", value="no_such_module_xyz", group="power.adapters")
    monkeypatch.setattr("power_core.plugins._entry_points", lambda: [ep])
    monkeypatch.delenv("POWER_LOAD_PLUGINS", raising=False)
    with pytest.raises(PluginError, match="plugin 'broken'.*POWER_LOAD_PLUGINS"):
        build_plugins()
    monkeypatch.setenv("POWER_LOAD_PLUGINS", "something-else")
    build_plugins()  # the escape hatch


def test_uninstalled_first_party_mode_fails_closed_naming_the_package():
    plugins = core_plugins()
    for mode, pkg in [("mtp", "power-mtp"), ("dflash2", "power-dflash2"), ("draft-model", "power-native")]:
        with pytest.raises(StrategyNotInstalled, match=f"pip install {pkg}"):
            plugins.strategy(mode)
    with pytest.raises(StrategyNotFound, match="not an installed strategy"):
        plugins.strategy("nope")


def test_strategy_without_execution_path_fails_closed_before_loading():
    class P:
        __name__ = "vonly"

        @hookimpl
        def power_register_strategies(self, register):
            register(Strategy(name="validator-only", version="1", package="v"))

    with pytest.raises(StrategyNotFound, match="no execution path"):
        open_session("reference", "validator-only", None, P())


def test_hookspecs_are_in_transaction_order():
    src = inspect.getsource(hookspecs)
    order = [m.group(1) for m in re.finditer(r"^def (power_\w+)", src, re.M)]
    assert order == ["power_register_strategies", "power_register_backends", "power_request_start",
                     "power_txn_phase", "power_request_end"]
    assert isinstance(hookspecs.hookspec, pluggy.HookspecMarker)


# -- the transaction cannot be bypassed: power_txn_phase is wrapper-only outside the core -----------------
def test_plain_power_txn_phase_is_refused_naming_the_plugin():
    class Replacer:
        __name__ = "sneaky-verifier"

        @hookimpl(tryfirst=True)
        def power_txn_phase(self, phase, step):
            return "skip" if phase == "verify" else step()

    with pytest.raises(PluginError, match=r"'sneaky-verifier' implements power_txn_phase as a plain "
                                          r"implementation.*@hookimpl\(wrapper=True\)"):
        build_plugins(extra=(Replacer(),))


def test_old_style_hookwrapper_power_txn_phase_is_refused():
    class Old:
        __name__ = "old-wrapper"

        @hookimpl(hookwrapper=True)
        def power_txn_phase(self, phase):
            outcome = yield
            outcome.force_result(None)

    with pytest.raises(PluginError, match="'old-wrapper' implements power_txn_phase as an old-style hookwrapper"):
        build_plugins(extra=(Old(),))


def test_a_plugin_registered_after_loading_cannot_replace_a_phase():
    class Late:
        @hookimpl(tryfirst=True)
        def power_txn_phase(self, phase, step):
            return step()

    with open_session("reference:vocab=40,dim=8", "ref-draft", None, max_tokens=3) as s:
        s.plugins = core_plugins(FaultInjector())  # a fresh manager, so the cached one stays clean
        s.plugins.pm.register(Late(), name="late")
        with pytest.raises(PluginError, match="'late' implements power_txn_phase"):
            s.generate([1, 2, 3])


def test_an_observer_cannot_swallow_a_failure_or_replace_a_result():
    class Liar:
        __name__ = "liar"

        @hookimpl(wrapper=True)
        def power_txn_phase(self, phase, round_index):
            try:
                result = yield
            except Exception:
                return None  # swallow the step's failure
            return [] if phase == "accept" else result  # and replace a result

    ref = run("reference:vocab=40,dim=8", [1, 2, 3], max_tokens=6).tokens
    with open_session("reference:vocab=40,dim=8", "ref-draft", None, Liar(), max_tokens=6) as s:
        assert s.generate([1, 2, 3]).tokens == ref  # the replaced accept result was ignored
    with open_session("reference:vocab=40,dim=8", "ref-draft", None, Liar(), max_tokens=6) as s:
        s.proposer = FailOnCall(s.proposer, "observe", call=2)  # fails inside round 1's verify step
        gen = s.start([1, 2, 3])
        with pytest.raises(AdapterFault, match="observe raised ValueError"):
            gen.run()
        assert s.opened.target.n_past == 3 and len(gen.tokens) == 1  # restored to round 0


def test_restore_runs_even_when_an_observer_fails_before_it():
    class BrokenObserver:
        __name__ = "broken-observer"

        @hookimpl(wrapper=True)
        def power_txn_phase(self, phase, round_index):
            if phase == "restore":
                raise OSError("log sink full")
            return (yield)

    inj = FaultInjector(phase="commit", round_index=1, when="after")
    with open_session("reference:vocab=40,dim=8", "ref-draft", None, inj, BrokenObserver(), max_tokens=6) as s:
        gen = s.start([1, 2, 3])
        with pytest.raises(RuntimeError, match="injected fault"):  # the round's own error, not the observer's
            gen.run()
        assert s.opened.target.n_past == 3 and len(gen.tokens) == 1
