"""Frozen configuration: :class:`PowerConfig`, one session's (and request's) values of every key, built from
a mapping, a TOML file or keywords and checked by the keys' declarations (:mod:`power_core.config_keys`), and
:class:`RequestSettings`, what one request sets for itself beside its session's configuration.

This module is also the keys' public path: plugins and the docs import :class:`ConfigKey`, :data:`CORE_KEYS`,
:func:`declare_keys` and the rest of the keys' vocabulary from here.
"""

from __future__ import annotations

import hashlib
import json
import operator
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from power_core.config_keys import (
    CORE_ALIASES,
    CORE_BY_NAME,
    CORE_KEYS,
    CORE_OWNERS,
    DEFAULT_DRAFT_MAX,
    FLASH_ATTN,
    LOGPROBS_MAX,
    MODE_AUTO,
    MODE_NAME_RE,
    MODE_OFF,
    NUMERICS,
    REQUEST_KEYS,
    SAMPLING_IN_GRAPH,
    SAMPLING_KEYS,
    SCOPES,
    STOP_MAX,
    VERIFY_CAPACITY_MAX,
    ConfigKey,
    canonical_keys,
    config_table,
    declare_keys,
    declared_keys,
    device_names,
    key_owners,
    parse_endpoint,
    set_key_loader,
    strategy_key,
    unknown_key,
)
from power_core.errors import ConfigError

__all__ = ["PowerConfig", "RequestSettings", "ConfigKey", "CORE_KEYS", "CORE_ALIASES", "REQUEST_KEYS", "SAMPLING_KEYS",
           "SCOPES", "CORE_OWNERS", "MODE_AUTO", "MODE_OFF", "MODE_NAME_RE", "NUMERICS", "FLASH_ATTN",
           "VERIFY_CAPACITY_MAX", "SAMPLING_IN_GRAPH", "STOP_MAX", "LOGPROBS_MAX", "declare_keys", "declared_keys",
           "key_owners", "set_key_loader", "config_table", "device_names", "parse_endpoint"]


def _options(pairs: Any) -> dict[str, Any]:
    if isinstance(pairs, Mapping):
        return dict(pairs)
    return {k: v for k, v in pairs}


def _in_scope(scope: str, changes: Mapping[str, Any], where: str) -> None:
    """:class:`ConfigError` naming (prefixed by ``where``) the first key of ``changes`` that is neither of
    ``scope`` nor of a narrower one (a session may set what a request may)."""
    allowed = SCOPES[SCOPES.index(scope):]
    for name, value in changes.items():
        key = CORE_BY_NAME.get(name) or strategy_key(name)
        if key is None:
            raise unknown_key(f"{where}{name}", value)
        if key.scope not in allowed:
            names = [k.name for k in declared_keys() if k.scope in allowed]
            raise ConfigError(f"{where}{name}", value, f"one of {', '.join(names)}",
                              f"{name} is a {key.scope} key: it is fixed when the session opens")


def _request_values(values: Any) -> tuple[tuple[str, Any], ...]:
    """A request's settings (a mapping or pairs; ``None``: the session's value) -> the set keys' checked values,
    in the table's order: a key that is not a request's, or a bad value, is the :class:`ConfigError` a
    configuration with it would raise."""
    given = canonical_keys({k: v for k, v in _options(values).items() if v is not None})
    if not given:
        return ()
    _in_scope("request", given, "")
    return tuple((name, CORE_BY_NAME[name].check(given[name])) for name in REQUEST_KEYS if name in given)


@attrs.frozen
class RequestSettings:
    """What one request sets for itself (:meth:`power_core.Session.start`'s ``max_tokens``, ``stop``,
    ``tenant`` and ``sampling``): values of the request-scoped keys (:data:`REQUEST_KEYS`), each checked by its
    key's declaration when the settings are made. The request's configuration is its session's with these
    in place (:meth:`PowerConfig.with_request`), so the session's keys, checked when it opened, are not
    checked again for every request.

    ``RequestSettings({"max_tokens": 64, "temperature": 0.7})``; a ``None`` value leaves the key to the session.
    """

    #: the keys set, in the table's order, with their checked values
    values: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_request_values)


@attrs.frozen
class PowerConfig:
    """One session's (and request's) configuration: the core's keys as fields, and the values of the
    strategies' keys that differ from their declared defaults in ``options``.

    ``PowerConfig(spec_mode="mtp", spec_mtp_fr_vocab_size=64)`` takes a strategy's key like a core key, and
    ``config.spec_mtp_fr_vocab_size`` reads it (its default when unset). What each core key means is its
    declaration in :data:`CORE_KEYS` (README's configuration table is generated from them).
    """

    spec_mode: str = CORE_BY_NAME["spec_mode"].field()
    spec_draft_max: int | None = CORE_BY_NAME["spec_draft_max"].field()
    spec_recurrent_snapshots: int | None = CORE_BY_NAME["spec_recurrent_snapshots"].field()
    spec_adaptive: bool = CORE_BY_NAME["spec_adaptive"].field()
    spec_adaptive_low_yield: float = CORE_BY_NAME["spec_adaptive_low_yield"].field()
    spec_adaptive_low_yield_rounds: int = CORE_BY_NAME["spec_adaptive_low_yield_rounds"].field()
    temperature: float = CORE_BY_NAME["temperature"].field()
    top_k: int = CORE_BY_NAME["top_k"].field()
    top_p: float = CORE_BY_NAME["top_p"].field()
    min_p: float = CORE_BY_NAME["min_p"].field()
    seed: int = CORE_BY_NAME["seed"].field()
    repeat_penalty: float = CORE_BY_NAME["repeat_penalty"].field()
    repeat_last_n: int = CORE_BY_NAME["repeat_last_n"].field()
    frequency_penalty: float = CORE_BY_NAME["frequency_penalty"].field()
    presence_penalty: float = CORE_BY_NAME["presence_penalty"].field()
    logit_bias: tuple[tuple[int, float], ...] = CORE_BY_NAME["logit_bias"].field()
    tenant: str = CORE_BY_NAME["tenant"].field()
    max_tokens: int = CORE_BY_NAME["max_tokens"].field()
    n_ctx: int = CORE_BY_NAME["n_ctx"].field()
    n_threads: int | None = CORE_BY_NAME["n_threads"].field()
    trace: bool = CORE_BY_NAME["trace"].field()
    stop: tuple[str, ...] = CORE_BY_NAME["stop"].field()
    cache_prompt: bool = CORE_BY_NAME["cache_prompt"].field()
    rpc_servers: tuple[str, ...] = CORE_BY_NAME["rpc_servers"].field()
    n_gpu_layers: int = CORE_BY_NAME["n_gpu_layers"].field()
    devices: tuple[str, ...] = CORE_BY_NAME["devices"].field()
    flash_attn: str = CORE_BY_NAME["flash_attn"].field()
    draft_gpu_layers: int = CORE_BY_NAME["draft_gpu_layers"].field()
    numerics: str = CORE_BY_NAME["numerics"].field()
    sampling_in_graph: str = CORE_BY_NAME["sampling_in_graph"].field()
    selftest: bool = CORE_BY_NAME["selftest"].field()
    warmup: bool = CORE_BY_NAME["warmup"].field()
    require_identical: bool = CORE_BY_NAME["require_identical"].field()
    verify_capacity: int = CORE_BY_NAME["verify_capacity"].field()
    #: the strategies' keys whose values differ from their defaults, sorted by name
    options: tuple[tuple[str, Any], ...] = ()

    def __attrs_post_init__(self) -> None:
        b, k = self.verify_capacity, self.spec_draft_max
        if b == 1:
            raise ConfigError("verify_capacity", b, f"0 (off) or an integer in [2, {VERIFY_CAPACITY_MAX}]",
                              "a padded pass holds the anchor and at least one more token")
        if b and k is not None and k + 1 > b:
            raise ConfigError("verify_capacity", b, f"0 (off) or at least spec_draft_max + 1 = {k + 1}",
                              "a verify pass holds the anchor and up to spec_draft_max proposals; raise "
                              "verify_capacity or lower spec_draft_max")
        s = self.spec_recurrent_snapshots
        if s is not None and s > self.draft_max:
            raise ConfigError(
                "spec_recurrent_snapshots", s, f"an integer in [1, spec_draft_max={self.draft_max}]",
                "snapshots beyond the proposal width can never be used; lower S or raise spec_draft_max",
            )
        if self.spec_mode == MODE_OFF and self.spec_adaptive:
            raise ConfigError("spec_adaptive", True, "false when spec_mode = 'off'",
                              "the adaptive controller schedules proposals; enable a speculative mode")
        for name, value in self.options:
            owners = key_owners(name)
            if self.spec_mode != MODE_AUTO and self.spec_mode not in owners:
                key = strategy_key(name)
                assert key is not None  # (an option's key was declared: __init__ checked it)
                default = key.default
                shown = "unset" if default is None else repr(default)
                modes = " or ".join(repr(m) for m in (*owners, MODE_AUTO))
                raise ConfigError(name, value, f"{shown} unless spec_mode is {modes}",
                                  f"the key configures the {', '.join(owners)} strateg"
                                  f"{'y' if len(owners) == 1 else 'ies'} only")

    def __getattr__(self, name: str) -> Any:
        # only a strategy's key reaches here (fields are slots): its value, else its declared default
        if name.startswith("_") or name == "options":
            raise AttributeError(name)
        if name in CORE_ALIASES:  # a core key's earlier name (``config.spec_mtp_adaptive``)
            return getattr(self, CORE_ALIASES[name])
        key = strategy_key(name)
        if key is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return dict(self.options).get(name, key.default)

    # -- derived -------------------------------------------------------------------------------
    @property
    def draft_max(self) -> int:
        """Effective K (the session resolves an unset key to the strategy's default first, capped
        like the core's default by ``verify_capacity - 1``)."""
        if self.spec_draft_max is not None:
            return self.spec_draft_max
        return self.capped_draft_max(DEFAULT_DRAFT_MAX)

    def capped_draft_max(self, k: int) -> int:
        """``k`` as a default K under ``verify_capacity``: at most B - 1 when padding is on."""
        return min(k, self.verify_capacity - 1) if self.verify_capacity else k

    @property
    def snapshots(self) -> int:
        """Effective S: resident rollback snapshots (defaults to K)."""
        return self.draft_max if self.spec_recurrent_snapshots is None else self.spec_recurrent_snapshots

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        """Every core key, then the strategies' keys that differ from their defaults: flat, as a TOML
        file or :meth:`from_mapping` takes them."""
        out = {a.name: getattr(self, a.name) for a in attrs.fields(type(self)) if a.name != "options"}
        for name in ("stop", "rpc_servers", "devices"):
            out[name] = list(out[name])  # as JSON reads it back
        out.update(self.options)
        return out

    def digest(self) -> str:
        """sha256 over the canonical JSON of every key: the receipt's config hash."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def scoped(self, scope: str, changes: Mapping[str, Any], *, where: str = "") -> PowerConfig:
        """This configuration with ``changes`` to keys of ``scope`` (or a narrower one: a session may set
        what a request may); any other key is a :class:`ConfigError` naming it (prefixed by ``where``)."""
        changes = canonical_keys(changes)
        _in_scope(scope, changes, where)
        return attrs.evolve(self, **changes) if changes else self

    def with_request(self, settings: RequestSettings) -> PowerConfig:
        """This configuration with a request's ``settings`` in place: equal, key for key, to
        ``PowerConfig.from_mapping(self.to_dict(), **dict(settings.values))`` (so the receipt's ``config`` and
        its digest are too), but only the checks across keys run again: every value is one checked
        already, by this configuration's construction or the settings'. ``self`` when nothing differs. A
        narrower K (``spec_draft_max``) narrows a set S with it: snapshots beyond K are never used."""
        changed = {name: value for name, value in settings.values if value != getattr(self, name)}
        if not changed:
            return self
        k, s = changed.get("spec_draft_max"), self.spec_recurrent_snapshots
        if k is not None and s is not None and s > k:
            changed["spec_recurrent_snapshots"] = k
        new = object.__new__(PowerConfig)  # its slots set as the attrs-made __init__ of a frozen class does
        for name, value in zip(_FIELDS, _field_values(self), strict=True):
            object.__setattr__(new, name, value)
        for name, value in changed.items():
            object.__setattr__(new, name, value)
        new.__attrs_post_init__()
        return new

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every key: the core's, then the installed strategies' (:func:`declared_keys`)."""
        return tuple(k.name for k in declared_keys())

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], **overrides: Any) -> PowerConfig:
        """Build from a mapping (TOML table, JSON) plus keyword overrides; ``None`` overrides are ignored."""
        merged = dict(data)
        merged.update({k: v for k, v in overrides.items() if v is not None})
        if "options" in merged:
            raise unknown_key("options", merged["options"])
        return cls(**{str(k): v for k, v in merged.items()})

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> PowerConfig:
        """Load top-level keys (or a ``[power]`` table) from a TOML file."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("config", str(p), "an existing TOML file", "check the --config path") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, IsADirectoryError) as exc:
            raise ConfigError("config", str(p), "a readable TOML file", str(exc)) from None
        if set(data) == {"power"} and isinstance(data["power"], dict):
            data = data["power"]
        return cls.from_mapping(data, **overrides)


_FIELDS: tuple[str, ...] = tuple(a.name for a in attrs.fields(PowerConfig))
_field_values = operator.attrgetter(*_FIELDS)
_generated_init = PowerConfig.__init__


def _init(self: PowerConfig, **values: Any) -> None:
    """``PowerConfig(**keys)``: the core's keys as attrs takes them; a strategy's key by its declaration
    (:func:`declare_keys`), kept in ``options`` unless it is the declared default. Wraps the attrs-made
    ``__init__`` (whose signature type checkers and ``attrs.evolve`` see) so strategy keys pass as keywords, and
    a core key by an earlier name (:data:`~power_core.config_keys.CORE_ALIASES`) as by its name."""
    values = canonical_keys(values)
    core = {k: v for k, v in values.items() if k in CORE_BY_NAME}
    options = _options(values.get("options", ()))  # from attrs.evolve / attrs.asdict
    options.update({k: v for k, v in values.items() if k not in CORE_BY_NAME and k != "options"})
    checked: dict[str, Any] = {}
    for name, value in options.items():
        key = strategy_key(name)
        if key is None:
            raise unknown_key(name, value)
        value = key.check(value)
        if value != key.default:  # a default is no choice: one configuration, one digest
            checked[name] = value
    _generated_init(self, **core, options=tuple(sorted(checked.items())))


PowerConfig.__init__ = _init  # type: ignore[method-assign,assignment]
