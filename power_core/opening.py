"""How a session opens: the backend, each strategy's open plan (:class:`OpenPlan`), the lanes of one
target (:class:`Lane`, :class:`LanePlans`), and the thread an open runs on (:func:`in_own_thread`)."""


from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from power_core.config import MODE_AUTO, MODE_OFF, PowerConfig, key_owners
from power_core.errors import (
    AdapterFault,
    ConfigError,
    PowerError,
    StrategyNotFound,
)
from power_core.logs import get_logger
from power_core.memory import PromptCache
from power_core.numerics import DEFAULT_WIDTHS
from power_core.plugins import PowerPlugins, get_plugins
from power_core.runtime import (
    Proposer,
    ProposerCapabilities,
)
from power_core.selection import Selection, select
from power_core.spec import Backend, OpenRequest

log = get_logger(__name__)

_T = TypeVar("_T")


def in_own_thread(fn: Callable[[], _T], *, discard: Callable[[_T], None] | None = None) -> _T:
    """``fn()`` run on a thread of its own that ends with it; its result, or its exception, here.

    Opening a model computes (a warm-up pass, the verify-cost curve, probes). llama.cpp's CPU
    backend runs a graph as an OpenMP team led by the calling thread, and libgomp keeps a team for
    every thread that has led one; once there are more of their threads than CPUs it stops
    spinning at the barriers between a graph's ops, and every pass of the process pays a sleep and
    a wake-up per barrier (a one-token SmolLM2 pass took 13-18 ms instead of 7 on a server worker
    after the main thread had opened the model). A thread that ends takes its team with it, so the
    thread that decodes afterwards (the caller, a server worker, the engine's driver) leads the only
    team. Interrupted (Ctrl-C) while waiting, it lets ``fn`` finish, hands its result to
    ``discard`` (nothing stays open) and re-raises."""
    box: list[Any] = []
    ctx = contextvars.copy_context()

    def run() -> None:
        try:
            box.append((True, ctx.run(fn)))
        except BaseException as exc:
            box.append((False, exc))

    thread = threading.Thread(target=run, name="power-open", daemon=True)
    thread.start()
    try:
        thread.join()
    except BaseException:
        thread.join()
        if box and box[0][0] and discard is not None:
            discard(box[0][1])
        raise
    ok, value = box[0]
    if not ok:
        raise value
    return value


def choose_backend(plugins: PowerPlugins, model: str | None, name: str | None) -> Backend:
    if name is not None:
        if name not in plugins.backends:
            hint = " (pip install power-native)" if name == "llama" else ""
            raise StrategyNotFound(f"backend {name!r} is not installed{hint}; installed: "
                                   f"{', '.join(plugins.backends.names())}")
        return plugins.backends[name]
    for backend in sorted(plugins.backends, key=lambda b: -b.priority):
        if backend.accepts(model):
            return backend
    raise ConfigError("model", model, "a model one installed backend accepts",
                      f"backends: {', '.join(plugins.backends.names())}; GGUF files need power-native")


def with_cache(overrides: dict[str, Any], cache: PromptCache | None) -> dict[str, Any]:
    """``overrides`` for sessions with ``cache``: a prompt cache is prompt reuse, so it turns ``cache_prompt`` on."""
    if cache is None:
        return overrides
    if not isinstance(cache, PromptCache):
        raise ConfigError("prompt_cache", type(cache).__name__, "a power_core.PromptCache, or None")
    if overrides.get("cache_prompt") is False:
        raise ConfigError("cache_prompt", False, "true with a prompt_cache",
                          "a prompt cache restores saved prompt states: that is prompt reuse")
    return {**overrides, "cache_prompt": True}


@attrs.frozen
class OpenPlan:
    """Everything :meth:`Session.open` decides before it loads anything."""

    config: PowerConfig
    plugins: PowerPlugins
    backend: Backend
    selection: Selection
    draft: str | None
    request: OpenRequest

    @property
    def strategy(self) -> Any:
        return self.selection.strategy

    @property
    def speculative(self) -> bool:
        return bool(self.selection.strategy.kind != "target-only")

    @classmethod
    def make(cls, config: PowerConfig | None, model: str | None, draft: str | None, backend: str | None,
             plugins: PowerPlugins | None, overrides: Mapping[str, Any]) -> OpenPlan:
        config = PowerConfig.from_mapping(config.to_dict() if config else {}, **overrides)
        plugins = plugins or get_plugins()
        chosen = choose_backend(plugins, model, backend)
        model = chosen.resolve(model)  # e.g. None -> the embedded GGUF, so selection inspects the real file
        selection = select(plugins, config, model=model, draft=draft)
        strategy = selection.strategy
        if strategy.backends and chosen.name not in strategy.backends:
            raise StrategyNotFound(f"strategy {strategy.name!r} runs on backend(s) {sorted(strategy.backends)}, "
                                   f"but model {model!r} is served by {chosen.name!r}")
        speculative = strategy.kind != "target-only"
        if config.spec_draft_max is None and strategy.default_draft_max and speculative:
            config = attrs.evolve(config, spec_draft_max=config.capped_draft_max(strategy.default_draft_max))
        if speculative and strategy.proposer is None:
            raise StrategyNotFound(f"strategy {strategy.name!r} ({strategy.package} {strategy.version}) validates "
                                   "artifacts but has no execution path in this version; use spec_mode='off' or "
                                   "another strategy")
        probe = config.selftest or config.require_identical
        # target-only decoding verifies one token per pass and never rolls back: size the context for
        # that (the self-test verifies blocks up to its widest probe)
        max_block = config.draft_max + 1 if speculative else 1
        if config.verify_capacity:  # every pass is B wide (the self-test probes widths up to B)
            max_block = config.verify_capacity
        elif probe:
            max_block = max(max_block, max(DEFAULT_WIDTHS))
        request = OpenRequest(model=model, config=config, max_block=max_block,
                              snapshots=config.snapshots if speculative else 0,
                              features=strategy.features_for(selection.verified) if speculative else frozenset(),
                              verify_cost=speculative and strategy.cost_aware)
        return cls(config=config, plugins=plugins, backend=chosen, selection=selection, draft=draft, request=request)


def target_request(plans: Sequence[OpenPlan]) -> OpenRequest:
    """One target for every plan (the lanes of a session, the sequences of a batch): sized for the
    widest block, with every tap and snapshot any of them reads."""
    first = plans[0].request
    return attrs.evolve(first, max_block=max(p.request.max_block for p in plans),
                        snapshots=max(p.request.snapshots for p in plans),
                        features=frozenset().union(*(p.request.features for p in plans)),
                        verify_cost=any(p.request.verify_cost for p in plans))


def lane_overrides(config: PowerConfig, mode: str) -> dict[str, Any]:
    """``config`` as the configuration of the lane that runs ``mode``: the strategy keys that configure
    other strategies are left out (one configuration carries the keys of every strategy a session
    runs, as under ``spec_mode = "auto"``), and a target-only lane has no adaptive controller."""
    data = config.to_dict()
    for name, _ in config.options:
        if mode != MODE_AUTO and mode not in key_owners(name):
            del data[name]
    if mode == MODE_OFF:
        data["spec_adaptive"] = False
    data["spec_mode"] = mode
    return data


def close_proposer(proposer: Proposer | None) -> None:
    """Close ``proposer`` (its optional ``close()``); a foreign exception is an :class:`AdapterFault`."""
    if proposer is None or (close := ProposerCapabilities.of(proposer).close) is None:
        return
    try:
        close()
    except PowerError:
        raise
    except Exception as exc:
        name = type(proposer).__name__
        raise AdapterFault(f"proposer {name}.close raised {type(exc).__name__}: {exc}; the target "
                           "was closed anyway", proposer=name, method="close") from exc


@attrs.frozen
class LanePlans:
    """The plans of a session's lanes (:meth:`Session.open`'s ``strategies``) and which one ``auto`` runs."""

    plans: tuple[OpenPlan, ...]
    #: the lane a request asking for ``auto`` runs in, and why
    auto: int
    auto_reason: str

    @classmethod
    def single(cls, plan: OpenPlan) -> LanePlans:
        return cls(plans=(plan,), auto=0, auto_reason=plan.selection.reason)

    @classmethod
    def make(cls, config: PowerConfig | None, model: str | None, draft: str | None, backend: str | None,
             plugins: PowerPlugins | None, overrides: Mapping[str, Any], strategies: Sequence[str]) -> LanePlans:
        """Select every strategy of ``strategies`` (``spec_mode`` values; the first is the default) on
        one target. ``draft`` goes to the strategies that need one (and ``auto``). ``auto``: the lane
        named ``auto``, else the one the library's ``auto`` rules pick among these strategies
        (:func:`~power_core.selection.select`'s ``only``; target-only without an ``off`` lane: the default)."""
        if isinstance(strategies, str) or not strategies or not all(isinstance(m, str) for m in strategies):
            raise ConfigError("strategies", strategies, "a non-empty list of spec_mode values",
                              "e.g. ['mtp', 'suffix', 'off']; the first is the default")
        modes = list(strategies)
        if len(set(modes)) != len(modes):
            raise ConfigError("strategies", modes, "each strategy once")
        base = PowerConfig.from_mapping(config.to_dict() if config else {}, **overrides)
        plugins = plugins or get_plugins()
        for name, value in base.options:  # a key no listed strategy reads is a mistake, as with one spec_mode
            owners = key_owners(name)
            if MODE_AUTO not in modes and not set(owners) & set(modes):
                raise ConfigError(name, value, f"unset unless strategies include {' or '.join(map(repr, owners))}",
                                  f"the key configures the {', '.join(owners)} strateg"
                                  f"{'y' if len(owners) == 1 else 'ies'} only")
        takes = [m == MODE_AUTO or (m != MODE_OFF and plugins.strategy(m).needs_draft) for m in modes]
        if draft is not None and not any(takes):
            raise ConfigError("draft", draft, "no draft, or a strategy among strategies that reads one (auto, or "
                              "one that needs a draft)", f"none of {', '.join(modes)} reads a draft file")
        plans = tuple(OpenPlan.make(None, model, draft if t else None, backend, plugins, lane_overrides(base, m))
                      for m, t in zip(modes, takes, strict=True))
        names = [str(p.strategy.name) for p in plans]
        if MODE_AUTO in modes:
            # a listed strategy that auto picked runs in auto's lane: one proposer per strategy on a sequence
            auto = modes.index(MODE_AUTO)
            kept = tuple(p for i, p in enumerate(plans) if i == auto or modes[i] != names[auto])
            return cls(plans=kept, auto=kept.index(plans[auto]), auto_reason=plans[auto].selection.reason)
        first = plans[0]
        chosen = select(plugins, PowerConfig.from_mapping(base.to_dict(), spec_mode=MODE_AUTO),
                        model=first.request.model, draft=draft, only=frozenset(names))
        if chosen.strategy.name in names:
            return cls(plans=plans, auto=names.index(chosen.strategy.name), auto_reason=chosen.reason)
        return cls(plans=plans, auto=0, auto_reason=f"{chosen.reason}; without an 'off' strategy, the default "
                   f"{modes[0]!r}")


@attrs.define(eq=False)
class Lane:
    """One strategy a session runs requests with: the configuration they start from (``spec_mode``
    is the name it was asked for: a strategy's, or ``auto``), what selection proved, and the
    strategy's proposer on this session's target (``None``: target-only). The proposer is read when
    a request begins, so one replaced meanwhile (:attr:`Session.proposer`) is the one that runs."""

    config: PowerConfig
    selection: Selection
    proposer: Proposer | None

    @property
    def mode(self) -> str:
        """The name the lane was asked for (``spec_mode``)."""
        return self.config.spec_mode

    @property
    def name(self) -> str:
        """The strategy it runs (``auto``'s pick; ``off`` where ``require_identical`` turned it off)."""
        return str(self.selection.strategy.name)

    def request_k(self, draft_max: int | None) -> int | None:
        """A request's own K (``draft_max``; ``None``: the lane's), checked: at most the lane's K, which sized
        the target's verify passes and the draft's work; else a :class:`ConfigError` naming ``spec_draft_max``."""
        k = self.config.draft_max
        if draft_max is not None and (isinstance(draft_max, bool) or not isinstance(draft_max, int)
                                      or not 1 <= draft_max <= k):
            raise ConfigError("spec_draft_max", draft_max, f"an integer in [1, {k}]",
                              f"a request may narrow its strategy's K ({self.mode}), not widen it: that K sizes the "
                              "target's verify passes; open the session (power serve --draft-max) with a wider one")
        return draft_max

    @property
    def max_block(self) -> int:
        """The widest verify block its rounds open: the anchor plus K proposals (1 target-only)."""
        return self.config.draft_max + 1 if self.proposer is not None else 1

    @property
    def reuses_prompts(self) -> bool:
        """Its requests keep the prefix of their prompt that the target already holds, or restore it
        from the prompt cache (config ``cache_prompt``). Not when the proposer is fed from the target's
        hidden states: it must observe the whole prompt's prefill."""
        return self.config.cache_prompt and not (self.proposer is not None and self.proposer.features)
