"""Plugin discovery and the typed registries of strategies and backends.

Plugins are found through the entry-point group ``power.adapters`` (and Power's built-ins), then
``check_pending()`` runs so that a misspelled hook is an error. ``POWER_LOAD_PLUGINS`` is an
allowlist of entry-point or distribution names; set but empty, it loads no external plugin — the
escape hatch when a broken plugin breaks the CLI.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Any, Generic, Literal, Protocol, TypeVar

import attrs
import pluggy

from power_core import hookspecs
from power_core.config import MODE_NAME_RE
from power_core.errors import PluginError, StrategyNotFound, StrategyNotInstalled
from power_core.logs import get_logger
from power_core.runtime import Proposer, TargetRuntime, TokenArray

__all__ = [
    "ENTRY_POINT_GROUP",
    "FIRST_PARTY_PACKAGES",
    "Strategy",
    "Backend",
    "OpenRequest",
    "OpenedModel",
    "ProposerRequest",
    "Tokenizer",
    "Registry",
    "PowerPlugins",
    "get_plugins",
    "hookimpl",
    "package_version",
]

log = get_logger(__name__)
hookimpl = pluggy.HookimplMarker("power")
ENTRY_POINT_GROUP = "power.adapters"
#: where each reserved first-party mode comes from, for fail-closed "install X" messages
FIRST_PARTY_PACKAGES: Mapping[str, str] = {
    "mtp": "power-mtp",
    "dflash": "power-dflash",
    "dflash2": "power-dflash2",
    "dspark": "power-dspark",
    "draft-model": "power-native",
}


class Tokenizer(Protocol):
    """Optional text codec of a loaded model."""

    def encode(self, text: str) -> TokenArray: ...

    def decode(self, tokens: TokenArray) -> str: ...


@attrs.frozen
class OpenRequest:
    """What a backend needs to open a target: the model, the request shape and the taps."""

    model: str | None
    config: Any  # PowerConfig
    max_block: int  # anchor + K
    snapshots: int  # S requested; the runtime reports what it got
    features: frozenset[str] = frozenset()
    #: measure (or load the cached) verify-cost curve of passes of 1..max_block tokens
    verify_cost: bool = False


@attrs.define(eq=False)
class OpenedModel:
    """A loaded target with its optional tokenizer and evidence for the receipt."""

    target: TargetRuntime
    tokenizer: Tokenizer | None = None
    model_path: str | None = None
    artifacts: dict[str, str] = attrs.field(factory=dict)  # role -> sha256
    backend_info: dict[str, Any] = attrs.field(factory=dict)
    close: Callable[[], None] = lambda: None


@attrs.frozen
class ProposerRequest:
    """What a strategy's factory receives to build its proposer for one loaded target."""

    opened: OpenedModel
    config: Any  # PowerConfig
    draft: str | None = None
    verified: Any = None  # the strategy validator's result, when it has one


def _check_name(inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not MODE_NAME_RE.match(value):
        raise PluginError(f"{type(inst).__name__}.{attr.name}={value!r}: expected a lowercase name "
                          "matching [a-z][a-z0-9_.-]*; fix the plugin's register() call")


@attrs.frozen
class Strategy:
    """A proposal mechanism a plugin offers (``spec_mode`` selects it by ``name``).

    ``proposer`` builds the :class:`~power_core.runtime.Proposer` for one session (``None`` for
    target-only); ``target_features`` names what it needs the target to publish. ``validate`` is the fail-closed artifact validator (``(target_view, draft_view,
    config) -> verified``; raises :class:`~power_core.errors.ArtifactError`). ``backends`` lists the
    backends it can run on (empty: any).
    """

    name: str = attrs.field(validator=_check_name)
    version: str
    package: str
    summary: str = ""
    kind: Literal["target-only", "model-backed", "model-free"] = "model-backed"
    needs_draft: bool = False
    proposer: Callable[[ProposerRequest], Proposer] | None = None
    validate: Callable[..., Any] | None = None
    backends: frozenset[str] = frozenset()
    #: hidden-state taps the target must publish (``DecodeResult.features``), or a callable that
    #: derives them from the validator's result (e.g. the layers a DFlash draft reads)
    target_features: frozenset[str] | Callable[[Any], frozenset[str]] = frozenset()
    experimental: bool = False
    #: with ``needs_draft`` and no draft given, the target file drafts for itself (a self-check)
    self_draft: bool = False
    #: K when the configuration leaves ``spec_draft_max`` unset (None: the core's 7)
    default_draft_max: int | None = None
    #: the scheduler picks each round's verified width from the target's verify-cost curve and the
    #: proposer's ``confidence`` (the backend measures the curve once per model)
    cost_aware: bool = False


    def features_for(self, verified: Any) -> frozenset[str]:
        """The target features for this selection (``verified``: the validator's result, or None)."""
        tf = self.target_features
        return frozenset(tf(verified) if callable(tf) else tf)


@attrs.frozen
class Backend:
    """A target runtime family (``llama`` from power-native, ``reference`` from the core)."""

    name: str = attrs.field(validator=_check_name)
    version: str
    package: str
    open: Callable[[OpenRequest], OpenedModel]
    accepts: Callable[[str | None], bool]
    summary: str = ""
    priority: int = 0  # higher wins when several backends accept the same model (None = default)
    #: maps a model argument (``None`` = the backend's default, an alias) to what gets inspected
    #: and opened, e.g. the path of the embedded GGUF; identity by default
    resolve: Callable[[str | None], str | None] = lambda model: model


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
            })
        return out


def package_version(distribution: str) -> str:
    """Installed version of ``distribution`` (``0+unknown`` when running from a source tree)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _own_version() -> str:
    return package_version("power-core")


def _allowlist() -> set[str] | None:
    raw = os.environ.get("POWER_LOAD_PLUGINS")
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _entry_points() -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def build_plugins(extra: tuple[object, ...] = ()) -> PowerPlugins:
    """Build a fresh plugin manager: built-ins, allowed entry points, then ``extra`` objects."""
    from power_core import builtins as _builtins

    pm = pluggy.PluginManager("power")
    pm.add_hookspecs(hookspecs)
    from power_core.reference import plugin as _reference

    pm.register(_builtins, name="power.core")
    pm.register(_reference, name="power.reference")
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
    strategies: Registry[Strategy] = Registry(Strategy)
    backends: Registry[Backend] = Registry(Backend)
    for name, plugin in pm.list_name_plugin():
        for caller, registry in ((pm.hook.power_register_strategies, strategies),
                                 (pm.hook.power_register_backends, backends)):
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    kwargs = {"register": registry.registrar(name)}
                    impl.function(*[kwargs[a] for a in impl.argnames])
    return PowerPlugins(pm=pm, strategies=strategies, backends=backends, entry_points=eps)


_cached: PowerPlugins | None = None


def get_plugins(refresh: bool = False) -> PowerPlugins:
    """The process-wide plugins (built on first use; ``refresh=True`` rebuilds)."""
    global _cached
    if _cached is None or refresh:
        _cached = build_plugins()
    return _cached
