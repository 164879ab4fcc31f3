"""The plugin manager: discovery, loading and the typed registries of strategies and backends.

Plugins are found through the entry-point group ``power.adapters`` (and Power's built-ins, listed by
module name in :data:`BUILTIN_PLUGINS` and imported when the manager is built), then
``check_pending()`` runs so that a misspelled hook is an error. ``POWER_LOAD_PLUGINS`` is an
allowlist of entry-point or distribution names; set but empty, it loads no external plugin — the
escape hatch when a broken plugin breaks the CLI.

The vocabulary a plugin imports (``hookimpl``, ``Strategy``, ``Backend``, ``OpenRequest``, ...)
lives in :mod:`power_core.spec`; it is re-exported here for older code.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any, Generic, TypeVar

import attrs
import pluggy

from power_core import hookspecs
from power_core.config import ConfigKey, declare_keys, declared_keys, set_key_loader
from power_core.errors import PluginError, StrategyNotFound, StrategyNotInstalled
from power_core.logs import get_logger
from power_core.spec import (
    FIRST_PARTY_PACKAGES,
    Backend,
    OpenedModel,
    OpenRequest,
    ProposerRequest,
    RequestInfo,
    Strategy,
    Tokenizer,
    hookimpl,
    package_version,
)

__all__ = [
    "BUILTIN_PLUGINS",
    "CORE_PLUGIN",
    "ENTRY_POINT_GROUP",
    "FIRST_PARTY_PACKAGES",
    "Strategy",
    "Backend",
    "OpenRequest",
    "OpenedModel",
    "ProposerRequest",
    "RequestInfo",
    "Tokenizer",
    "Registry",
    "PowerPlugins",
    "build_plugins",
    "check_observers_only",
    "get_plugins",
    "hookimpl",
    "package_version",
]

log = get_logger(__name__)
ENTRY_POINT_GROUP = "power.adapters"
#: the plugin whose ``power_txn_phase`` runs each phase's step (the innermost implementation)
CORE_PLUGIN = "power.core"
#: Power's own plugins, registered before any entry point: plugin name -> module, imported by
#: :func:`build_plugins` (by name, so that the manager does not depend on what it loads)
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    (CORE_PLUGIN, "power_core.builtins"),
    ("power.reference", "power_core.reference.plugin"),
)


T = TypeVar("T", Strategy, Backend)


class Registry(Generic[T]):
    """Name → item, rejecting missing and duplicate names; remembers which plugin registered what."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._owner: dict[str, str] = {}

    def registrar(self, plugin_name: str) -> Callable[[T], None]:
        def register(item: T) -> None:
            if not isinstance(item, self.kind):
                raise PluginError(f"plugin {plugin_name!r} registered {item!r}; expected a "
                                  f"power_core.{self.kind.__name__}")
            if item.name in self._items:
                raise PluginError(f"plugin {plugin_name!r} registered {self.kind.__name__.lower()} "
                                  f"{item.name!r}, already registered by {self._owner[item.name]!r}; "
                                  "uninstall one of them or rename")
            self._items[item.name] = item
            self._owner[item.name] = plugin_name

        return register

    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())

    def names(self) -> list[str]:
        return sorted(self._items)

    def owner(self, name: str) -> str:
        return self._owner[name]


@attrs.define(eq=False)
class PowerPlugins:
    """The loaded plugin manager plus its registries."""

    pm: pluggy.PluginManager
    strategies: Registry[Strategy]
    backends: Registry[Backend]
    entry_points: dict[str, metadata.EntryPoint]

    def strategy(self, name: str) -> Strategy:
        """Look up a strategy, failing closed with the package to install when it is missing."""
        if name in self.strategies:
            return self.strategies[name]
        if name in FIRST_PARTY_PACKAGES:
            raise StrategyNotInstalled(
                f"spec_mode {name!r} is provided by the package {FIRST_PARTY_PACKAGES[name]!r}, which is "
                f"not installed (or not allowed by POWER_LOAD_PLUGINS); run: pip install "
                f"{FIRST_PARTY_PACKAGES[name]}")
        raise StrategyNotFound(f"spec_mode {name!r} is not an installed strategy; installed: "
                               f"{', '.join(self.strategies.names())}")

    def observes_requests(self) -> bool:
        """Whether a registered plugin implements ``power_request_start`` or ``power_request_end``. A
        server runs a request's begin and end on a worker only because such an observer may be slow;
        with none it skips the hand-off. Asked per request: plugins may register late."""
        hook = self.pm.hook
        return bool(hook.power_request_start.get_hookimpls() or hook.power_request_end.get_hookimpls())

    def config_keys(self) -> tuple[ConfigKey, ...]:
        """The core's configuration keys, then those the registered strategies declare."""
        return declared_keys(self.strategies.names())

    def describe(self) -> list[dict[str, Any]]:
        """Name, version, hooks and registrations of every plugin (``power plugins --json``)."""
        out = []
        for plugin_name, plugin in self.pm.list_name_plugin():
            ep = self.entry_points.get(plugin_name)
            dist = ep.dist if ep is not None else None
            out.append({
                "name": plugin_name,
                "distribution": dist.name if dist else "power-core",
                "version": dist.version if dist else _own_version(),
                "hooks": sorted(h.name for h in self.pm.get_hookcallers(plugin) or []),
                "strategies": sorted(s.name for s in self.strategies if self.strategies.owner(s.name) == plugin_name),
                "backends": sorted(b.name for b in self.backends if self.backends.owner(b.name) == plugin_name),
                "config_keys": sorted({k.name for s in self.strategies if self.strategies.owner(s.name) == plugin_name
                                       for k in s.config_keys}),
            })
        return out


def _own_version() -> str:
    return package_version("power-core")


def _allowlist() -> set[str] | None:
    raw = os.environ.get("POWER_LOAD_PLUGINS")
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _entry_points() -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def check_observers_only(pm: pluggy.PluginManager) -> None:
    """Refuse any ``power_txn_phase`` implementation outside the core that is not a new-style wrapper.

    The transaction's phases are not replaceable: a plain implementation (which would answer instead
    of the core's step) or an old-style ``hookwrapper`` (which can force a result) is a
    :class:`PluginError` naming the plugin.
    """
    for impl in pm.hook.power_txn_phase.get_hookimpls():
        if impl.plugin_name == CORE_PLUGIN or impl.wrapper:
            continue
        style = "an old-style hookwrapper" if impl.hookwrapper else "a plain implementation"
        raise PluginError(f"plugin {impl.plugin_name!r} implements power_txn_phase as {style}; only observers "
                          "may implement it, with @hookimpl(wrapper=True) (result = yield; return result), "
                          "and the transaction's phases cannot be replaced. Fix the plugin, or exclude it with "
                          "POWER_LOAD_PLUGINS")


def build_plugins(extra: tuple[object, ...] = ()) -> PowerPlugins:
    """Build a fresh plugin manager: built-ins, allowed entry points, then ``extra`` objects."""
    pm = pluggy.PluginManager("power")
    pm.add_hookspecs(hookspecs)
    for plugin_name, module in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module), name=plugin_name)
    allowed = _allowlist()
    eps: dict[str, metadata.EntryPoint] = {}
    for ep in _entry_points():
        dist_name = ep.dist.name if ep.dist else ""
        if allowed is not None and ep.name not in allowed and dist_name not in allowed:
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken plugin must name itself, not crash with its traceback
            raise PluginError(f"plugin {ep.name!r} ({dist_name or 'unknown distribution'}) failed to import: "
                              f"{type(exc).__name__}: {exc}. Fix or uninstall it, or exclude it with "
                              "POWER_LOAD_PLUGINS") from exc
        if pm.is_registered(plugin):
            continue
        pm.register(plugin, name=ep.name)
        eps[ep.name] = ep
    for i, plugin in enumerate(extra):
        pm.register(plugin, name=getattr(plugin, "__name__", f"extra-{i}"))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{exc}; a hook implementation names no Power hook (misspelled?)") from exc
    check_observers_only(pm)
    strategies: Registry[Strategy] = Registry(Strategy)
    backends: Registry[Backend] = Registry(Backend)
    for name, plugin in pm.list_name_plugin():
        for caller, registry in ((pm.hook.power_register_strategies, strategies),
                                 (pm.hook.power_register_backends, backends)):
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    kwargs = {"register": registry.registrar(name)}
                    impl.function(*[kwargs[a] for a in impl.argnames])
    for strategy in strategies:
        try:
            declare_keys(strategy.name, strategy.config_keys)
        except PluginError as exc:
            raise PluginError(f"plugin {strategies.owner(strategy.name)!r}: {exc}") from None
    return PowerPlugins(pm=pm, strategies=strategies, backends=backends, entry_points=eps)


_cached: PowerPlugins | None = None
_cached_allow: str | None = None  # the POWER_LOAD_PLUGINS it was built under


def get_plugins(refresh: bool = False) -> PowerPlugins:
    """The process-wide plugins (built on first use, and again when ``POWER_LOAD_PLUGINS`` changed
    since; ``refresh=True`` rebuilds)."""
    global _cached, _cached_allow
    allow = os.environ.get("POWER_LOAD_PLUGINS")
    if _cached is None or refresh or allow != _cached_allow:
        _cached, _cached_allow = build_plugins(), allow
    return _cached


# a key the configuration does not know yet may be an installed strategy's: load the plugins then
set_key_loader(get_plugins)
