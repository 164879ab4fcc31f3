"""Strategies own their configuration: declared keys, one validation machinery, scopes.

The core declares the keys of the session, the transaction, the scheduler and the sampler
(:data:`power_core.config.CORE_KEYS`); a strategy declares its own on its :class:`~power_core.spec.Strategy`
(``config_keys``) and the plugin manager enters them. A third-party strategy does exactly what the
first-party ones do.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from power_core.config import (
    CORE_KEYS,
    SAMPLING_KEYS,
    SCOPES,
    ConfigKey,
    PowerConfig,
    declared_keys,
    key_owners,
)
from power_core.errors import ConfigError, PluginError
from power_core.reference.plugin import make_ref_draft
from power_core.session import Session
from power_core.spec import ProposerRequest, Strategy, hookimpl
from tests.helpers import core_plugins

MODEL = "reference:seed=8,vocab=48,dim=8,recurrent=1"

#: a third party's own key, as its plugin would declare it
LOOKBACK = ConfigKey(name="tp_lookback", type=int, default=4, lo=1, hi=64, flag="--tp-lookback",
                     help="how far the third-party drafter looks back")


class ThirdParty:
    """A third-party plugin: a strategy on the reference backend with a key of its own."""

    def __init__(self, keys: tuple[ConfigKey, ...] = (LOOKBACK,), name: str = "tp-draft") -> None:
        self.keys, self.name = keys, name
        self.__name__ = f"third-party-{name}"  # the plugin's name in the manager
        self.seen: list[Any] = []

    @hookimpl
    def power_register_strategies(self, register: Any) -> None:
        def make(req: ProposerRequest) -> Any:
            self.seen.append(req.config.tp_lookback)  # the proposer reads its key from the config
            return make_ref_draft(req)

        register(Strategy(name=self.name, version="1", package="third-party", proposer=make,
                          backends=frozenset({"reference"}), config_keys=self.keys))


@pytest.fixture
def tp() -> ThirdParty:
    plugin = ThirdParty()
    core_plugins(plugin)  # registering declares the key
    return plugin


# -- declaration -------------------------------------------------------------------------------------------
def test_a_third_party_key_is_validated_like_a_core_key(tp):
    cfg = PowerConfig(spec_mode="tp-draft", tp_lookback=9)
    assert cfg.tp_lookback == 9 and cfg.to_dict()["tp_lookback"] == 9
    assert PowerConfig(spec_mode="tp-draft").tp_lookback == 4  # unset: the declared default
    for bad in (0, 65, 2.5, True, "9"):
        with pytest.raises(ConfigError) as err:
            PowerConfig(spec_mode="tp-draft", tp_lookback=bad)
        assert (err.value.key, err.value.value, err.value.allowed) == ("tp_lookback", bad, "an integer in [1, 64]")
    with pytest.raises(ConfigError) as core_err:  # the same shape as a core key's error
        PowerConfig(spec_draft_max=65)
    assert core_err.value.allowed == "an integer in [1, 64]"


def test_a_third_party_key_loads_from_toml_and_round_trips(tp, tmp_path):
    path = tmp_path / "power.toml"
    path.write_text('[power]\nspec_mode = "tp-draft"\ntp_lookback = 12\n')
    cfg = PowerConfig.from_toml(path)
    assert cfg.tp_lookback == 12
    assert PowerConfig.from_mapping(cfg.to_dict()) == cfg
    assert attrs.evolve(cfg, tp_lookback=5).tp_lookback == 5 and attrs.evolve(cfg, top_k=3).tp_lookback == 12


def test_a_default_is_no_choice(tp):
    """A key set to its default is the configuration without it: one configuration, one digest."""
    assert PowerConfig(spec_mode="tp-draft", tp_lookback=4) == PowerConfig(spec_mode="tp-draft")
    assert PowerConfig(spec_mode="tp-draft", tp_lookback=4).digest() == PowerConfig(spec_mode="tp-draft").digest()
    assert "tp_lookback" not in PowerConfig(spec_mode="tp-draft").to_dict()


def test_a_key_of_another_strategy_is_a_typed_error(tp):
    with pytest.raises(ConfigError) as err:
        PowerConfig(spec_mode="off", tp_lookback=9)
    assert err.value.key == "tp_lookback" and "'tp-draft' or 'auto'" in err.value.allowed
    assert PowerConfig(spec_mode="auto", tp_lookback=9).tp_lookback == 9  # auto may pick it


def test_an_unknown_key_is_a_typed_error_with_a_suggestion(tp):
    with pytest.raises(ConfigError, match="did you mean 'tp_lookback'") as err:
        PowerConfig(spec_mode="tp-draft", tp_lookbak=9)
    assert err.value.key == "tp_lookbak"
    with pytest.raises(ConfigError):
        PowerConfig.from_mapping({"options": {"tp_lookback": 3}})  # the field is no key


def test_the_registry_knows_who_owns_a_key(tp):
    plugins = core_plugins(tp)
    assert key_owners("tp_lookback") == ("tp-draft",)
    assert key_owners("temperature") == ("sampler",) and key_owners("nope") == ()
    assert LOOKBACK in plugins.config_keys() and plugins.config_keys()[:len(CORE_KEYS)] == CORE_KEYS
    info = next(p for p in plugins.describe() if p["name"] == "third-party-tp-draft")
    assert info["config_keys"] == ["tp_lookback"]
    assert "tp_lookback" in PowerConfig.keys()


def test_strategies_may_share_a_key_declared_alike():
    shared = ConfigKey(name="tp_shared", type=float, default=0.0, lo=0.0, hi=1.0)
    core_plugins(ThirdParty((shared,), "tp-a"), ThirdParty((shared,), "tp-b"))
    assert key_owners("tp_shared") == ("tp-a", "tp-b")
    assert PowerConfig(spec_mode="tp-b", tp_shared=0.5).tp_shared == 0.5


@pytest.mark.parametrize(("key", "match"), [
    (ConfigKey(name="tp_lookback", type=int, default=4, lo=1, hi=8), "declare it alike or rename it"),
    (ConfigKey(name="temperature", type=float, default=0.0, lo=0.0, hi=1.0), "which is the core's"),
    (ConfigKey(name="tp_per_request", type=bool, default=False, scope="request"), "scope 'request'"),
    (ConfigKey(name="spec_mtp_adaptive", type=bool, default=False), "which is the core's"),  # a core key's alias
    (ConfigKey(name="tp_renamed", type=int, default=1, aliases=("tp_old",)), "earlier names are the core's"),
])
def test_a_bad_declaration_is_a_plugin_error_naming_the_plugin(tp, key, match):
    with pytest.raises(PluginError, match=match) as err:
        core_plugins(ThirdParty((key,), "tp-other"))
    assert "third-party" in str(err.value)


@pytest.mark.parametrize(("kw", "match"), [
    (dict(name="Bad Name", type=int, default=0), "key name"),
    (dict(name="tp_x", type=list, default=[]), "type="),
    (dict(name="tp_x", type=tuple, default=()), "validate="),
    (dict(name="tp_x", type=int, default=-1, lo=0), "default is invalid"),
    (dict(name="tp_x", type=int, default=0, scope="forever"), "scope="),
    (dict(name="tp_x", type=int, default=0, flag="-x"), "flag="),
])
def test_a_malformed_key_is_refused_when_declared(kw, match):
    with pytest.raises(PluginError, match=match):
        ConfigKey(**kw)


def test_first_party_keys_keep_their_names_and_errors():
    """The draft heads' (DFlash family, EAGLE3) and MTP's keys are declared by their strategies, by their names."""
    with pytest.raises(ConfigError) as err:
        PowerConfig(spec_mode="dflash", spec_draft_p_min=1.0)
    assert (err.value.key, err.value.allowed) == ("spec_draft_p_min", "a number in [0.0, 1.0)")
    assert set(key_owners("spec_draft_p_min")) == {"dflash", "dflash2", "dspark", "eagle3", "mtp"}
    assert key_owners("spec_mtp_fr_vocab_size") == ("mtp",)
    with pytest.raises(ConfigError) as err:
        PowerConfig(spec_mode="mtp", spec_mtp_fr_vocab_size=0)
    assert (err.value.key, err.value.allowed) == ("spec_mtp_fr_vocab_size", "an integer >= 1")


# -- a core key's earlier name -----------------------------------------------------------------------------
LEGACY = {"spec_mtp_recurrent_snapshots": ("spec_recurrent_snapshots", 3), "spec_mtp_adaptive": ("spec_adaptive", True)}


@pytest.mark.parametrize("old", sorted(LEGACY))
def test_a_core_keys_earlier_name_is_taken_wherever_the_key_is(old, tmp_path):
    """The seed's ``spec_mtp_*`` names of two keys that serve every strategy: keywords, a mapping, TOML, a
    session's changes all take them as the key; reads by them answer the key's value; the
    configuration (and its digest) is the one the key's name makes."""
    new, value = LEGACY[old]
    want = PowerConfig(spec_mode="mtp", spec_draft_max=7, **{new: value})
    assert want != PowerConfig(spec_mode="mtp", spec_draft_max=7)
    toml = tmp_path / "power.toml"
    toml.write_text(f'spec_mode = "mtp"\nspec_draft_max = 7\n{old} = {str(value).lower()}\n')
    for got in (PowerConfig(spec_mode="mtp", spec_draft_max=7, **{old: value}),
                PowerConfig.from_mapping({"spec_mode": "mtp", "spec_draft_max": 7, old: value}),
                PowerConfig.from_toml(toml),
                PowerConfig(spec_mode="mtp", spec_draft_max=7).scoped("session", {old: value})):
        assert got == want and got.digest() == want.digest()
        assert getattr(got, old) == getattr(got, new) == value
        assert old not in got.to_dict() and got.to_dict()[new] == value


@pytest.mark.parametrize("old", sorted(LEGACY))
def test_both_names_of_one_key_or_a_bad_value_by_the_old_name_are_typed_errors(old):
    new, value = LEGACY[old]
    with pytest.raises(ConfigError, match="not both") as err:
        PowerConfig(spec_mode="mtp", **{old: value, new: value})
    assert err.value.key == old
    with pytest.raises(ConfigError) as err:
        PowerConfig(spec_mode="mtp", **{old: "many"})
    assert err.value.key == new  # the key's own check, by its name
    with pytest.raises(ConfigError, match="fixed when the"):
        PowerConfig(spec_mode="mtp").scoped("request", {old: value})


# -- scopes ------------------------------------------------------------------------------------------------
def test_scopes_come_from_the_declarations(tp):
    assert SAMPLING_KEYS == ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n",
                             "frequency_penalty", "presence_penalty", "logit_bias")
    assert {k.scope for k in declared_keys()} <= set(SCOPES)
    scope = {k.name: k.scope for k in declared_keys()}
    assert {scope[k] for k in ("spec_adaptive", "trace", "spec_draft_p_min", "tp_lookback", "n_ctx")} == {"session"}
    assert scope["spec_draft_max"] == "request"  # a request may narrow K (Session.start's draft_max)
    assert all(k.owner in ("session", "transaction", "scheduler", "sampler") for k in CORE_KEYS)


def test_request_scope_admits_only_request_keys(tp):
    cfg = PowerConfig(spec_mode="tp-draft")
    assert cfg.scoped("request", {"temperature": 0.7, "max_tokens": 9}).temperature == 0.7
    for key, value in (("n_ctx", 512), ("spec_adaptive", True), ("tp_lookback", 2)):
        with pytest.raises(ConfigError) as err:
            cfg.scoped("request", {key: value}, where="sampling.")
        assert err.value.key == f"sampling.{key}" and "fixed when the" in str(err.value)
    with pytest.raises(ConfigError, match="temperature"):
        cfg.scoped("request", {"temperature": -1.0})  # in scope, out of range: the key's own error


# -- end to end --------------------------------------------------------------------------------------------
def test_the_proposer_reads_its_key_from_the_session_config(tp):
    with Session.open(PowerConfig(spec_mode="tp-draft", n_ctx=256, max_tokens=4, tp_lookback=7), model=MODEL,
                      plugins=core_plugins(tp)) as s:
        result = s.generate([1, 2, 3])
    assert tp.seen == [7]
    assert result.receipt.config["tp_lookback"] == 7


# -- the CLI -----------------------------------------------------------------------------------------------
def test_strategy_flags_come_from_the_declarations(capsys):
    """``--p-min`` and ``--fr-vocab`` are the DFlash family's and MTP's declared flags, not the CLI's own."""
    from power_core.cli import build_parser, main
    from power_core.commands import _config_from_args
    from power_core.plugins import get_plugins

    args = build_parser().parse_args(["run", "--mode", "dflash", "--p-min", "0.25"])
    assert _config_from_args(args).spec_draft_p_min == 0.25
    args = build_parser().parse_args(["run", "--mode", "mtp", "--fr-vocab", "64"])
    assert _config_from_args(args).spec_mtp_fr_vocab_size == 64
    assert main(["run", "--mode", "dflash", "--p-min", "1.5", "--json"]) == 2  # the key's own ConfigError
    out, _ = capsys.readouterr()
    assert '"code": "config_invalid"' in out and "spec_draft_p_min" in out
    run_help = _run_help()
    installed = get_plugins().config_keys()  # the core's and the installed strategies' keys
    missing = [k.name for k in installed if k.flag is not None and k.flag not in run_help]
    assert not missing, f"keys whose declared flag power run lacks: {missing}"


def _run_help() -> str:
    from power_core.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "run" in a.choices)  # the subcommands
    return str(sub.choices["run"].format_help())


def test_a_request_may_set_only_request_keys(tp):
    with Session.open(PowerConfig(spec_mode="tp-draft", n_ctx=256, max_tokens=4), model=MODEL,
                      plugins=core_plugins(tp)) as s:
        for key, value in (("tp_lookback", 2), ("n_ctx", 64), ("spec_draft_max", 2)):
            with pytest.raises(ConfigError) as err:
                s.start([1, 2, 3], sampling={key: value})
            assert err.value.key == f"sampling.{key}"
        assert s.start([1, 2, 3], sampling={"temperature": 0.5, "seed": 3}).run().receipt.config["temperature"] == 0.5


def test_the_servers_per_request_fields_are_the_request_scoped_keys():
    """What one HTTP request may set is what one library request may set: the request-scoped keys."""
    pytest.importorskip("pydantic")
    from power_core.serve.protocol import CompletionRequest

    # but the tenant: the server derives it from the API key and the ``user`` field, so a client never claims one
    request_keys = {k.name for k in CORE_KEYS if k.scope == "request"} - {"tenant"}
    assert "tenant" not in CompletionRequest.model_fields
    fields = set(CompletionRequest.model_fields)
    assert request_keys <= fields, f"request-scoped keys the server does not take: {sorted(request_keys - fields)}"
    req = CompletionRequest(model="m", prompt="x", temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, seed=7,
                            repeat_penalty=1.1, repeat_last_n=32, frequency_penalty=0.5, presence_penalty=0.5,
                            logit_bias={"5": -1.0})
    assert set(req.sampling()) == set(SAMPLING_KEYS)
