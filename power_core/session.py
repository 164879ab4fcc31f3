"""Sessions: load a target once, select a strategy, and run requests through the transaction.

A :class:`Session` owns one opened target (via a backend plugin) and one :class:`Lane` per strategy it
runs: by default one (``spec_mode``), with at most one proposer; opened with ``strategies`` (``power
serve --mode mtp,suffix,off``) one lane per strategy, each with its own proposer, and every request
picks one (:meth:`Session.start`'s ``strategy``; the first lane is the default). Each request is a
:class:`Generation`; when it is cancelled or fails, its committed tokens stay and
:meth:`Generation.run` continues from them.

Requests: :meth:`Session.generate` (a :class:`Result`), :meth:`Session.stream` (a
:class:`~power_core.streaming.Stream` of committed text deltas), and :meth:`Session.chat` /
:meth:`Session.chat_stream`, which render the model's chat template first. Each takes ``stop``
strings and ``max_tokens`` for the request (recorded in the receipt's config).

Threads: a session serves one request at a time. A call that finds it busy (another thread's
request, or an unfinished stream) raises :class:`~power_core.errors.SessionBusy` at once, never
waits and never interleaves; hosts open one session per worker thread (separate sessions share
nothing) or serialize calls themselves.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import pluggy

from power_core.chat import ChatTemplate, template_for
from power_core.config import LOGPROBS_MAX, MODE_AUTO, MODE_OFF, SAMPLING_KEYS, SEQUENCE_KEYS, PowerConfig, key_owners
from power_core.constraint import Constraint, ConstraintSpec
from power_core.engine import Engine
from power_core.errors import (
    AdapterFault,
    Cancelled,
    ConfigError,
    ConstraintError,
    PowerError,
    SessionBusy,
    StateLost,
    StrategyNotFound,
)
from power_core.logs import get_logger
from power_core.memory import PromptCache, reusable_prefix
from power_core.numerics import DEFAULT_WIDTHS, SelftestReport, batch_probe, selftest
from power_core.plugins import PowerPlugins, check_observers_only, get_plugins
from power_core.prediction import PredictedProposer, Prediction
from power_core.receipt import Receipt, token_digest
from power_core.runtime import (
    BatchRuntime,
    Proposer,
    ProposerCapabilities,
    RequestScope,
    TargetRuntime,
    TokenArray,
    runtime_counters,
)
from power_core.sampling import TargetSampler
from power_core.scheduler import Scheduler
from power_core.selection import Selection, select
from power_core.spec import Backend, OpenedModel, OpenRequest, ProposerRequest, RequestInfo
from power_core.streaming import Stream
from power_core.text import TextAssembler
from power_core.tools import ToolPlan
from power_core.transaction import CancelToken, RoundRecord, TokenLogprob, Transaction

__all__ = ["RequestInfo", "Result", "Generation", "Lane", "Session", "SessionBatch", "SequenceSpec", "SAMPLING_KEYS",
           "SEQUENCE_KEYS"]

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


# SAMPLING_KEYS (what a request may set for itself, Session.start's ``sampling``) and SEQUENCE_KEYS (what one
# sequence of a shared-pass batch may set, SequenceSpec) are read from the keys' declared scopes (config.py)
#: text, or token ids (a sequence or a 1-D integer array)
Prompt = str | Sequence[int] | np.ndarray


@attrs.frozen
class Result:
    """Emitted tokens, their text (when the model has a tokenizer) and the receipt."""

    tokens: tuple[int, ...]
    text: str | None
    receipt: Receipt


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


def _with_cache(overrides: dict[str, Any], cache: PromptCache | None) -> dict[str, Any]:
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
class _OpenPlan:
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
             plugins: PowerPlugins | None, overrides: Mapping[str, Any]) -> _OpenPlan:
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


def _target_request(plans: Sequence[_OpenPlan]) -> OpenRequest:
    """One target for every plan (the lanes of a session, the sequences of a batch): sized for the
    widest block, with every tap and snapshot any of them reads."""
    first = plans[0].request
    return attrs.evolve(first, max_block=max(p.request.max_block for p in plans),
                        snapshots=max(p.request.snapshots for p in plans),
                        features=frozenset().union(*(p.request.features for p in plans)),
                        verify_cost=any(p.request.verify_cost for p in plans))


def _lane_overrides(config: PowerConfig, mode: str) -> dict[str, Any]:
    """``config`` as the configuration of the lane that runs ``mode``: the strategy keys that configure
    other strategies are left out (one configuration carries the keys of every strategy a session
    runs, as under ``spec_mode = "auto"``), and a target-only lane has no adaptive controller."""
    data = config.to_dict()
    for name, _ in config.options:
        if mode != MODE_AUTO and mode not in key_owners(name):
            del data[name]
    if mode == MODE_OFF:
        data["spec_mtp_adaptive"] = False
    data["spec_mode"] = mode
    return data


def _close_proposer(proposer: Proposer | None) -> None:
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
class _LanePlans:
    """The plans of a session's lanes (:meth:`Session.open`'s ``strategies``) and which one ``auto`` runs."""

    plans: tuple[_OpenPlan, ...]
    #: the lane a request asking for ``auto`` runs in, and why
    auto: int
    auto_reason: str

    @classmethod
    def single(cls, plan: _OpenPlan) -> _LanePlans:
        return cls(plans=(plan,), auto=0, auto_reason=plan.selection.reason)

    @classmethod
    def make(cls, config: PowerConfig | None, model: str | None, draft: str | None, backend: str | None,
             plugins: PowerPlugins | None, overrides: Mapping[str, Any], strategies: Sequence[str]) -> _LanePlans:
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
        plans = tuple(_OpenPlan.make(None, model, draft if t else None, backend, plugins, _lane_overrides(base, m))
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


@attrs.frozen
class SequenceSpec:
    """One sequence of a shared-pass batch with a strategy of its own (:meth:`Session.open_batch`'s
    ``sequences``): ``mode`` is its ``spec_mode``, ``draft`` its draft file (``None``: what selection
    finds, e.g. the target drafting for itself), ``config`` any of :data:`SEQUENCE_KEYS`."""

    mode: str
    draft: str | None = None
    config: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.define(eq=False)
class SessionBatch:
    """Sessions on the sequences of one target that share its passes (:meth:`Session.open_batch`)."""

    runtime: BatchRuntime
    sessions: tuple[Session, ...]
    close_runtime: Callable[[], None]

    def close(self) -> None:
        """Close every session (each one, even after one fails), then the shared runtime; the first
        failure is raised."""
        failure: BaseException | None = None
        try:
            for session in self.sessions:
                try:
                    session.close()
                except BaseException as exc:  # close every one; report the first failure
                    failure = failure or exc
        finally:
            self.close_runtime()
        if failure is not None:
            raise failure

    def __enter__(self) -> SessionBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@attrs.define(eq=False)
class Session:
    """One loaded target, its selected strategies (one :class:`Lane` each; the first is the
    default), many requests."""

    plugins: PowerPlugins
    backend: Backend
    opened: OpenedModel
    #: the strategies its requests run with (one by default; :meth:`open`'s ``strategies``)
    lanes: tuple[Lane, ...]
    stop_ids: frozenset[int]
    #: the batch-numerics self-test run at open (config ``selftest`` / ``require_identical``)
    numerics: SelftestReport | None = None
    #: saved prompt states its requests restore and save (:class:`~power_core.memory.PromptCache`), or ``None``
    prompt_cache: PromptCache | None = attrs.field(default=None, repr=False)
    #: the engine whose sequence this session is (its own one-sequence engine unless an engine over
    #: several sessions adopted it); every request runs through it
    engine: Engine[Session] | None = attrs.field(default=None, init=False, repr=False)
    _mutex: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _resident: Generation | None = attrs.field(default=None, init=False, repr=False)  # whose state the target holds
    _closed: bool = attrs.field(default=False, init=False, repr=False)
    #: why the target's state was lost (a failed restore); the session then refuses requests
    _lost: str | None = attrs.field(default=None, init=False, repr=False)
    _chat_template: ChatTemplate | None = attrs.field(default=None, init=False, repr=False)
    #: the lane a request asking for ``auto`` runs in (:meth:`lane`), and why
    auto: int = 0
    auto_reason: str = ""

    @property
    def config(self) -> PowerConfig:
        """The default lane's configuration (the session's, with its strategy's ``spec_mode``)."""
        return self.lanes[0].config

    @property
    def selection(self) -> Selection:
        """The default lane's selection: which strategy, and why."""
        return self.lanes[0].selection

    @property
    def proposer(self) -> Proposer | None:
        """The default lane's proposer (``None``: target-only). Assigning one replaces it (e.g. a
        recording wrapper in the conformance kit) for the requests started afterwards."""
        return self.lanes[0].proposer

    @proposer.setter
    def proposer(self, value: Proposer | None) -> None:
        self.lanes[0].proposer = value

    def lane(self, strategy: str | None = None) -> Lane:
        """The lane a request asking for ``strategy`` runs in: ``None`` the default (the first),
        ``auto`` the one the library's ``auto`` rules pick among the session's strategies, else the
        lane opened under that name or running that strategy. :class:`ConfigError` naming
        ``strategy`` for one the session was not opened with."""
        if strategy is None:
            return self.lanes[0]
        if strategy == MODE_AUTO:
            return self.lanes[self.auto]
        for lane in self.lanes:
            if lane.mode == strategy:
                return lane
        for lane in self.lanes:
            if lane.name == strategy:
                return lane
        raise ConfigError("strategy", strategy, f"one of this session's strategies ({', '.join(self.strategy_names)})",
                          "a session runs the strategies it was opened with (power serve --mode a,b,c)")

    @property
    def strategy_names(self) -> tuple[str, ...]:
        """The names a request may ask for: every lane's (as opened, then the strategy it runs, when
        different), and ``auto``."""
        names: list[str] = []
        for lane in self.lanes:
            for name in (lane.mode, lane.name):
                if name not in names:
                    names.append(name)
        return (*names, MODE_AUTO) if MODE_AUTO not in names else tuple(names)

    @classmethod
    def open(cls, config: PowerConfig | None = None, *, model: str | None = None, draft: str | None = None,
             backend: str | None = None, plugins: PowerPlugins | None = None,
             stop_ids: frozenset[int] | None = None, prompt_cache: PromptCache | None = None,
             strategies: Sequence[str] | None = None, **overrides: Any) -> Session:
        """Select, verify and load. Nothing stays loaded if any step fails. ``prompt_cache``: the
        :class:`~power_core.memory.PromptCache` its requests restore saved prompt states from and
        save theirs into (it may be shared with other sessions and engines; it turns
        ``cache_prompt`` on). ``strategies`` (``spec_mode`` values, e.g. ``["mtp", "suffix", "off"]``):
        one lane per strategy on the one target, the first the default, instead of ``spec_mode``'s
        one; a request picks its own (:meth:`start`'s ``strategy``). ``draft`` goes to the strategies
        that need one (and ``auto``); strategy keys go to the strategies that own them. A listed
        strategy that a listed ``auto`` picks runs in auto's lane (no second proposer of one kind)."""
        lanes = cls._plans(config, model, draft, backend, plugins, _with_cache(overrides, prompt_cache), strategies)
        plan = lanes.plans[0]
        request = _target_request(lanes.plans)

        def load() -> Session:
            opened = plan.backend.open(request)
            try:
                return cls._on(lanes, opened, stop_ids, prompt_cache)
            except BaseException:
                opened.close()
                raise

        return in_own_thread(load, discard=Session.close)

    @classmethod
    def open_batch(cls, n: int, config: PowerConfig | None = None, *, model: str | None = None,
                   draft: str | None = None, backend: str | None = None, plugins: PowerPlugins | None = None,
                   stop_ids: frozenset[int] | None = None, sequences: Sequence[SequenceSpec] | None = None,
                   prompt_cache: PromptCache | None = None, strategies: Sequence[str] | None = None,
                   **overrides: Any) -> SessionBatch:
        """``n`` sessions on the sequences of one target whose passes they share (continuous
        batching; :class:`~power_core.engine.Engine` drives them). Every sequence runs the configured
        strategy, or ``sequences[i]`` its own (off, suffix and draft-model side by side). Raises
        :class:`ConfigError` naming ``parallel`` when the backend or a strategy cannot share passes
        (then open ``n`` sessions). ``prompt_cache`` and ``strategies``: as :meth:`open`'s, for every
        sequence (each sequence then runs a request of any of them: sequences are not split by strategy)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError("parallel", n, "an integer >= 1")
        if sequences is not None and strategies is not None:
            raise ConfigError("sequences", len(sequences), "None with strategies",
                              "strategies gives every sequence all of them; sequences gives each one its own")
        overrides = _with_cache(overrides, prompt_cache)
        lanes = cls._plans(config, model, draft, backend, plugins, overrides, strategies)
        plan = lanes.plans[0]
        if plan.config.verify_capacity:  # named "parallel": serve then runs independent (padded) slots
            raise ConfigError("parallel", n, "independent slots with verify_capacity",
                              f"verify_capacity={plan.config.verify_capacity} pads one sequence's passes, but a shared "
                              "pass holds several requests' blocks and prompt chunks, so its width varies")
        if plan.backend.open_batch is None:
            raise ConfigError("parallel", n, "independent slots on this backend",
                              f"backend {plan.backend.name!r} has no shared-pass (batch) runtime")
        per_seq = [lanes] * n
        if sequences is not None:
            if len(sequences) != n:
                raise ConfigError("sequences", len(sequences), f"one SequenceSpec per sequence ({n})")
            per_seq = []
            for i, spec in enumerate(sequences):
                extra = sorted(set(spec.config) - set(SEQUENCE_KEYS))
                if extra:
                    raise ConfigError(f"sequences[{i}].{extra[0]}", spec.config[extra[0]],
                                      f"one of {', '.join(SEQUENCE_KEYS)}",
                                      "the target's settings (context, threads, numerics) are the batch's")
                per_seq.append(_LanePlans.single(_OpenPlan.make(
                    config, model, spec.draft, plan.backend.name, plan.plugins,
                    {**overrides, "spec_mode": spec.mode, **spec.config})))
        # one target for every sequence: sized for the widest block, with every tap any sequence reads
        request = _target_request([p for own in per_seq for p in own.plans])
        open_batch = plan.backend.open_batch

        def load() -> SessionBatch:
            opened = open_batch(request, n)
            sessions: list[Session] = []
            try:
                for one, own in zip(opened.models, per_seq, strict=True):
                    sessions.append(cls._on(own, one, stop_ids, prompt_cache))
            except BaseException:
                for session in sessions:
                    session.close()
                opened.close()
                raise
            return SessionBatch(runtime=opened.runtime, sessions=tuple(sessions), close_runtime=opened.close)

        return in_own_thread(load, discard=SessionBatch.close)

    @classmethod
    def open_engine(cls, n: int, config: PowerConfig | None = None, *, token_budget: int | None = None,
                    queue_max: int | None = None, **open_kwargs: Any) -> Engine[Session]:
        """``n`` sequences of one target that share its passes (:meth:`open_batch`) and the engine that
        drives them (closing it closes them); ``open_kwargs`` are :meth:`open_batch`'s (``prompt_cache``:
        a :class:`~power_core.memory.PromptCache` its requests share, with other engines too). A request
        goes to the free sequence that holds the longest prefix of its prompt (:meth:`Engine.reserve`).
        With more than one sequence the engine first probes
        whether a sequence's rows beside others are its solo rows (every receipt says); under
        ``require_identical`` rows that are not refuse the batch (:class:`ConfigError` naming ``parallel``)."""
        batch = cls.open_batch(n, config, **open_kwargs)
        try:
            probe = None
            if n > 1:
                # the probe decodes: on a thread that ends with it, so the driver leads the only compute team
                probe = in_own_thread(lambda: batch_probe(batch.runtime))
                log.info("engine.batch_probe", identical=probe.identical, reason=probe.reason())
                if not probe.identical and batch.sessions[0].config.require_identical:
                    raise ConfigError("parallel", n, "independent slots on this target",
                                      f"require_identical: {probe.reason()}")
            engine = Engine[Session](batch.sessions, runtime=batch.runtime, probe=probe, token_budget=token_budget,
                            queue_max=queue_max, closer=batch.close)
        except BaseException:
            batch.close()
            raise
        for session in batch.sessions:
            session.engine = engine
        return engine

    @staticmethod
    def independent_engine(sessions: Sequence[Session], *, queue_max: int | None = None) -> Engine[Session]:
        """One engine admitting requests to ``sessions`` that each decode alone (``power serve
        --no-batch``, or a backend or strategy without shared passes); closing it closes them."""

        def close() -> None:
            failure: BaseException | None = None
            for s in sessions:
                try:
                    s.close()
                except BaseException as exc:  # close every one; report the first failure
                    failure = failure or exc
            if failure is not None:
                raise failure

        engine = Engine[Session](sessions, queue_max=queue_max, closer=close)
        for session in sessions:
            session.engine = engine
        return engine

    @property
    def strategy_name(self) -> str:
        return str(self.selection.strategy.name)

    @property
    def max_block(self) -> int:
        """The widest verify block this session's rounds open, in any lane: the anchor plus K
        proposals (1 target-only)."""
        return max(lane.max_block for lane in self.lanes)

    @staticmethod
    def _plans(config: PowerConfig | None, model: str | None, draft: str | None, backend: str | None,
               plugins: PowerPlugins | None, overrides: Mapping[str, Any],
               strategies: Sequence[str] | None) -> _LanePlans:
        if strategies is None:  # spec_mode's one strategy, exactly as it always was
            return _LanePlans.single(_OpenPlan.make(config, model, draft, backend, plugins, overrides))
        return _LanePlans.make(config, model, draft, backend, plugins, overrides, strategies)

    @classmethod
    def _on(cls, lanes: _LanePlans, opened: OpenedModel, stop_ids: frozenset[int] | None,
            prompt_cache: PromptCache | None = None) -> Session:
        """The session over a loaded target: the self-test, then each lane's proposer (nothing stays
        open when one fails)."""
        plan = lanes.plans[0]
        config = plan.config
        padded = opened.target.capabilities.verify_capacity
        if padded != config.verify_capacity:
            raise ConfigError("verify_capacity", config.verify_capacity, f"{padded} on backend {plan.backend.name!r}",
                              "the backend's target does not pad its passes to the configured width")
        probe = config.selftest or config.require_identical
        report = selftest(opened.target) if probe else None
        if report is not None:
            log.info("session.selftest", identical=report.identical, max_abs_diff=report.max_abs_diff)
        made: list[Lane] = []
        try:
            for one in lanes.plans:
                made.append(cls._lane(one, opened, report))
        except BaseException:
            for lane in made:
                _close_proposer(lane.proposer)
            raise
        stops = opened.target.capabilities.eog_ids if stop_ids is None else frozenset(stop_ids)
        return cls(plugins=plan.plugins, backend=plan.backend, opened=opened, lanes=tuple(made), stop_ids=stops,
                   numerics=report, prompt_cache=prompt_cache, auto=lanes.auto, auto_reason=lanes.auto_reason)

    @staticmethod
    def _lane(plan: _OpenPlan, opened: OpenedModel, report: SelftestReport | None) -> Lane:
        """One lane over the loaded target: its proposer, or target-only where the self-test says
        speculation could change the output (``require_identical``)."""
        config, strategy, selection, speculative = plan.config, plan.strategy, plan.selection, plan.speculative
        if report is not None and config.require_identical and speculative and not report.identical:
            # the target's verify rows are not its one-token rows here: speculation could change
            # the output, so this session decodes target-only and says why
            strategy, speculative = plan.plugins.strategy("off"), False
            selection = Selection(strategy=strategy, reason=f"require_identical: {report.reason()} on this "
                                  f"build, so target-only instead of {selection.strategy.name!r} "
                                  f"({selection.reason})")
        proposer = None
        if speculative:
            assert strategy.proposer is not None
            proposer = strategy.proposer(ProposerRequest(opened=opened, config=config,
                                                         draft=selection.draft or plan.draft,
                                                         verified=selection.verified))
        return Lane(config=config, selection=selection, proposer=proposer)

    def close(self) -> None:
        """Free the model: the proposer (its optional ``close()``), then the target, even if the former
        fails. Raises :class:`SessionBusy` while a request runs in another thread."""
        with self._mutex:  # (the owner is read under the lock hand_over takes: no request starts meanwhile)
            owner = self.engine.running_request(self) if self.engine is not None else None
            if self._closed:
                return
            if owner is not None and owner.thread is not threading.current_thread():
                raise SessionBusy("the session cannot close while another thread's request runs; cancel it "
                                  "and wait for it to end, then close")
            self._closed = True
            resident, self._resident = self._resident, None  # no Session <-> Generation cycle
        if isinstance(owner, Generation):
            owner.close_stream()  # an unfinished stream of this thread ends as cancelled
        elif resident is not None and self._lost is None:
            self._keep(resident)  # what the target holds outlives it in the prompt cache
        failure: BaseException | None = None
        try:
            for lane in self.lanes:  # every lane's proposer closes; the first failure is raised
                try:
                    _close_proposer(lane.proposer)
                except BaseException as exc:
                    failure = failure or exc
        finally:
            self.opened.close()
        if failure is not None:
            raise failure

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def lost(self) -> str | None:
        """Why the target's state was lost (a restore failed), or ``None``: a lost session refuses requests."""
        return self._lost

    def mark_lost(self, reason: str) -> None:
        """The target's state is unknown (its restore failed): refuse every later request."""
        with self._mutex:
            self._lost = reason
        log.error("session.state_lost", reason=reason)

    def driver(self) -> Engine[Session]:
        """The engine that runs this session's requests (its own one-sequence engine by default)."""
        with self._mutex:
            if self.engine is None:
                self.engine = Engine[Session]((self,))
            return self.engine

    @property
    def reuses_prompts(self) -> bool:
        """Its requests keep the prefix of their prompt that its target already holds, or restore it
        from the prompt cache (config ``cache_prompt``), in some lane (:attr:`Lane.reuses_prompts`:
        not one whose proposer is fed from the target's hidden states)."""
        return any(lane.reuses_prompts for lane in self.lanes)

    def _shares(self, owner: str, tenant: str) -> bool:
        """May a request of ``tenant`` reuse what a request of ``owner`` left?"""
        return owner == tenant or (self.prompt_cache is not None and self.prompt_cache.share_tenants)

    def resident_match(self, prompt: TokenArray, tenant: str) -> int:
        """How many of ``prompt``'s tokens a request of ``tenant`` would keep of what this session's
        target holds now (the engine admits a request to the free sequence where this is largest)."""
        resident = self._resident
        held = resident.memory() if resident is not None and self.reuses_prompts else None
        if held is None or not self._shares(held[1], tenant):
            return 0
        return reusable_prefix(held[0], prompt, trims=self.opened.target.capabilities.trims_prefix)

    def prepare_memory(self, previous: Generation | None, prompt: TokenArray, tenant: str,
                       lane: Lane | None = None) -> TokenArray | None:
        """Make the target hold the longest prefix of ``prompt`` it can get for a request of
        ``tenant``, on the thread that drives it, right before the prefill: what ``previous`` (the
        request whose state it holds) left, or the prompt cache's saved state that keeps more of it,
        loaded now. Before what it holds is cut back or replaced, it is saved into the cache. Returns
        the tokens the target now holds (:meth:`Transaction.start_prefill` keeps the shared prefix),
        or ``None``: prefill from empty. A state that cannot be loaded leaves the memory empty.
        ``lane``: the request's (default: the first); one that reuses no prompt prefills from empty,
        after what the target holds is saved for the lanes that do."""
        if not self.reuses_prompts:
            return None
        target = self.opened.target
        caps = target.capabilities
        held = previous.memory() if previous is not None else None
        if not (lane or self.lanes[0]).reuses_prompts:
            if held is not None:
                self._save(held[0], held[1])  # about to be replaced by a whole prefill
            return None
        own = 0
        if held is not None and self._shares(held[1], tenant):
            own = reusable_prefix(held[0], prompt, trims=caps.trims_prefix)
        cache = self.prompt_cache if caps.saves_states else None
        found = None
        if cache is not None:
            assert caps.state_format is not None
            found = cache.lookup(prompt, state_format=caps.state_format, tenant=tenant, trims=caps.trims_prefix,
                                 n_ctx=caps.n_ctx)
            if found is not None and found[1] <= own:
                found = None
        if held is not None and (found is not None or own < held[0].shape[0]):
            self._save(held[0], held[1])  # it is about to be cut back or replaced
        if found is None:
            return held[0] if held is not None and own else None
        state, n = found
        assert cache is not None and caps.load_state is not None
        try:
            loaded = caps.load_state(state.data, int(state.tokens.shape[0]))
        except Exception as exc:
            log.warning("prompt_cache.restore_failed", error=f"{type(exc).__name__}: {exc}")
            loaded = False
        if not loaded:
            cache.failed(state)
            try:  # never half-loaded: the request prefills from empty
                target.reset()
            except BaseException as exc:
                self.mark_lost(f"resetting after a failed prompt-cache restore: {type(exc).__name__}: {exc}")
                raise StateLost(f"the target's state was lost after a failed prompt-cache restore: {exc}") from exc
            return None
        cache.restored(state, n)
        return state.tokens

    def _save(self, tokens: TokenArray, tenant: str) -> None:
        """Save what the target holds (``tokens``, of ``tenant``) into the prompt cache, unless it
        already keeps them; a state the target cannot copy is only not cached.

        On the thread that drives the target (the shared passes' driver), between passes, on purpose:
        the capture (``save_state``, the copy of the memory) must come before the memory changes and
        while no other thread decodes on the target (one llama.cpp context for every sequence of
        shared passes). Filing the captured state (``PromptCache.put``: no copy of the state, a scan of
        the entries) costs microseconds against the capture's copy, and filing it later, on the
        request's reader, made requests joining at the same pass boundary miss it (issue 44: measured
        with ``test_four_concurrent_requests_share_the_warm_cache_and_equal_cold_runs``), so it stays."""
        cache, caps = self.prompt_cache, self.opened.target.capabilities
        if cache is None or not caps.saves_states or tokens.shape[0] == 0:
            return
        assert caps.save_state is not None and caps.state_format is not None
        if cache.covers(tokens, state_format=caps.state_format, tenant=tenant, trims=caps.trims_prefix):
            return
        try:
            data = caps.save_state()
        except Exception as exc:
            log.warning("prompt_cache.save_failed", error=f"{type(exc).__name__}: {exc}")
            return
        cache.put(tokens, data, state_format=caps.state_format, tenant=tenant, trims=caps.trims_prefix)

    def _keep(self, resident: Generation) -> None:
        """The session closes: what ``resident`` left in the target goes into the prompt cache."""
        held = resident.memory() if self.reuses_prompts else None
        if held is not None:
            self._save(*held)

    def hand_over(self, gen: Generation) -> None:
        """``gen`` is about to run on this session's target (the engine admitted it): a fresh request
        may reuse what the previous one left (``cache_prompt``); an interrupted one resumes only if
        no other request ran since."""
        with self._mutex:
            if self._closed:
                raise SessionBusy("the session is closed; open a new one")
            if self._lost is not None:
                raise StateLost(f"this session's target state was lost ({self._lost}); it refuses further "
                                "requests: close it and open a new one")
            if gen.prefilled and self._resident is not gen:
                raise StateLost("this generation can no longer resume: its session has served another request "
                                "since it was interrupted; start a new request")
            gen.take_over(self._resident)
            self._resident = gen

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: Prompt) -> np.ndarray:
        if isinstance(prompt, str):
            if self.opened.tokenizer is None:
                raise ConfigError("prompt", prompt[:40], "token ids", "this model has no tokenizer; pass token ids")
            return np.asarray(self.opened.tokenizer.encode(prompt), dtype=np.int32)
        return np.asarray(list(prompt), dtype=np.int32)

    def start(self, prompt: Prompt, *, cancel: CancelToken | None = None,
              max_tokens: int | None = None, stop: Sequence[str] | None = None,
              sampling: Mapping[str, Any] | None = None, logprobs: int | None = None,
              target_only: bool = False, tenant: str | None = None,
              constraint: ConstraintSpec | None = None, strategy: str | None = None,
              prediction: str | Prediction | None = None) -> Generation:
        """Prepare a request (nothing runs until :meth:`Generation.run` or :meth:`Generation.stream`).

        ``max_tokens``, ``stop`` (stop strings) and ``sampling`` (any of :data:`SAMPLING_KEYS`:
        ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``) override the session's configuration
        for this request; the receipt records the configuration the request ran with.
        ``logprobs=N`` records, for every emitted token, its log-probability under the target row
        that emitted it and the N most likely alternatives (:attr:`Generation.logprobs`).
        ``target_only=True`` decodes without the session's proposer (one token per target pass, the
        same sampling): what speculation must equal, e.g. for ``power serve --audit-rate``.
        ``tenant`` (config ``tenant``) is whom the request runs for: memories kept across requests
        (a proposer's, :class:`~power_core.runtime.RequestScope`) serve only that tenant's requests.
        ``constraint`` (a :class:`~power_core.constraint.ConstraintSpec`: JSON schema, regex or
        grammar, optionally lazy) is what the output must match; it is compiled here, so a schema
        the grammar engine refuses is a :class:`~power_core.errors.ConstraintError` before anything runs.
        ``strategy``: which of the session's strategies runs it (:meth:`lane`: ``None`` the default,
        ``auto`` the library's pick among them); the request starts from that lane's configuration,
        and its receipt names the strategy that ran and the one asked for.
        ``prediction``: text the answer is expected to repeat (OpenAI's Predicted Outputs), or a
        :class:`~power_core.prediction.Prediction` of it: a speculative lane drafts from it first
        (:class:`~power_core.prediction.PredictedProposer`), and the receipt's ``prediction`` counts how
        much of it the output repeated; a target-only lane only counts.
        """
        lane = self.lane(strategy)
        config = lane.config
        changes: dict[str, Any] = {}
        if tenant is not None and tenant != config.tenant:
            changes["tenant"] = tenant
        if max_tokens is not None and max_tokens != config.max_tokens:
            changes["max_tokens"] = max_tokens
        if stop is not None and tuple(stop) != config.stop:
            changes["stop"] = stop
        for key, value in (sampling or {}).items():
            if key not in SAMPLING_KEYS:
                raise ConfigError(f"sampling.{key}", value, f"one of {', '.join(SAMPLING_KEYS)}",
                                  "other keys are the session's; open a session with them")
            if value is not None and value != getattr(config, key):
                changes[key] = value
        if changes:
            config = PowerConfig.from_mapping(config.to_dict(), **changes)  # validated like any config
        if config.stop and self.opened.tokenizer is None:
            raise ConfigError("stop", list(config.stop), "no stop strings for a model without a tokenizer",
                              "stop strings match decoded text; use stop token ids (stop_ids) instead")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= LOGPROBS_MAX):
            raise ConfigError("logprobs", logprobs, f"an integer in [0, {LOGPROBS_MAX}]",
                              "the number of alternatives recorded per emitted token")
        tokens = self.encode(prompt)
        compiled = self.compile(constraint) if constraint is not None else None
        if prediction is not None and not isinstance(prediction, Prediction):
            prediction = Prediction.from_text(prediction, self.opened.tokenizer,
                                              self.opened.target.capabilities.n_ctx)
        return Generation(self, tokens, cancel or CancelToken(), config.max_tokens, config=config,
                          top_logprobs=logprobs, target_only=target_only, constraint=compiled, lane=lane,
                          requested=strategy, prediction=prediction)

    def compile(self, spec: ConstraintSpec) -> Constraint:
        """``spec`` compiled against this model's vocabulary, at the start of an output."""
        if self.opened.grammars is None:
            raise ConstraintError(spec.field, f"the {self.backend.name} backend cannot read this model's vocabulary, "
                                  "so it cannot constrain output; use a model with a tokenizer")
        return self.opened.grammars.compile(spec)

    def generate(self, prompt: Prompt, *, cancel: CancelToken | None = None,
                 max_tokens: int | None = None, stop: Sequence[str] | None = None,
                 sampling: Mapping[str, Any] | None = None, constraint: ConstraintSpec | None = None) -> Result:
        """Run one request to completion and return its tokens, text and receipt."""
        return self.start(prompt, cancel=cancel, max_tokens=max_tokens, stop=stop, sampling=sampling,
                          constraint=constraint).run()

    def stream(self, prompt: Prompt, *, cancel: CancelToken | None = None,
               max_tokens: int | None = None, stop: Sequence[str] | None = None,
               sampling: Mapping[str, Any] | None = None, constraint: ConstraintSpec | None = None) -> Stream[Result]:
        """Run one request as a :class:`~power_core.streaming.Stream` of committed text deltas."""
        return self.start(prompt, cancel=cancel, max_tokens=max_tokens, stop=stop, sampling=sampling,
                          constraint=constraint).stream()

    # -- chat ----------------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], *,
                    chat_template: str | ChatTemplate | None = None, **template_vars: Any) -> np.ndarray:
        """Token ids of ``messages`` rendered with the model's chat template (with the generation prompt).

        ``chat_template`` overrides the GGUF's ``tokenizer.chat_template``: a :class:`ChatTemplate`
        (used as it is), or Jinja source, which gets the GGUF's BOS/EOS tokens and is compiled once per
        model and source, not per call. Raises :class:`ConfigError` when the model has none, naming
        the model.
        """
        if self.opened.tokenizer is None:
            raise ConfigError("chat", self.opened.model_path, "a model with a tokenizer", "pass token ids instead")
        if chat_template is None:
            if self._chat_template is None:
                self._chat_template = template_for(self.opened.model_path, None)
            template = self._chat_template
        else:  # template_for keeps one compiled ChatTemplate per (model file, source)
            template = template_for(self.opened.model_path, chat_template)
        text = template.prompt_text(template.render(messages, **template_vars))
        tokens = template.dedupe_bos(list(self.opened.tokenizer.encode(text)))
        return np.asarray(tokens, dtype=np.int32)

    def chat(self, messages: Sequence[Mapping[str, Any]], *, cancel: CancelToken | None = None,
             max_tokens: int | None = None, stop: Sequence[str] | None = None,
             chat_template: str | ChatTemplate | None = None, sampling: Mapping[str, Any] | None = None,
             constraint: ConstraintSpec | None = None, tools: ToolPlan | None = None) -> Result:
        """Answer a conversation (``[{"role": "user", "content": ...}, ...]``) through the chat template.

        ``tools`` (a :class:`~power_core.tools.ToolPlan`: the functions, ``tool_choice`` and
        ``parallel_tool_calls``) reach the template as its ``tools`` and constrain the answer as the
        choice says (forced calls, or a lazy grammar from the format's opening tag for ``auto``);
        ``tools.parse(result.text)`` separates the text from the calls."""
        return self._chat_start(messages, chat_template, constraint, tools, cancel=cancel, max_tokens=max_tokens,
                                stop=stop, sampling=sampling).run()

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, cancel: CancelToken | None = None,
                    max_tokens: int | None = None, stop: Sequence[str] | None = None,
                    chat_template: str | ChatTemplate | None = None, sampling: Mapping[str, Any] | None = None,
                    constraint: ConstraintSpec | None = None, tools: ToolPlan | None = None) -> Stream[Result]:
        """:meth:`chat` as a :class:`~power_core.streaming.Stream` (``tools.parser()`` splits its deltas)."""
        return self._chat_start(messages, chat_template, constraint, tools, cancel=cancel, max_tokens=max_tokens,
                                stop=stop, sampling=sampling).stream()

    def _chat_start(self, messages: Sequence[Mapping[str, Any]], chat_template: str | ChatTemplate | None,
                    constraint: ConstraintSpec | None, tools: ToolPlan | None, **kw: Any) -> Generation:
        extra: dict[str, Any] = {}
        if tools is not None and tools.active:
            if constraint is not None:
                raise ConstraintError("constraint", "give either a constraint or tools: the tools' choice constrains "
                                      "the answer")
            for spec in tools.parameter_specs():  # a schema the engine refuses names its tool
                self.compile(spec)
            extra = tools.template_vars()
            constraint = tools.constraint()
        prompt = self.chat_prompt(messages, chat_template=chat_template, **extra)
        return self.start(prompt, constraint=constraint, **kw)


@attrs.define
class DecodeClock:
    """Where a request's decode time went: the target's and the draft's compute
    (their capabilities' ``compute_seconds``, read around each round) and the rest, the host's
    (the core, the sampler, the proposer's own host work, the runtime's bindings)."""

    target_s: float = 0.0
    draft_s: float = 0.0
    rounds: int = 0
    #: False once a round ran on a target without a compute clock: host time is then unknown
    timed: bool = True
    _target: Callable[[], float] | None = None
    _draft: Callable[[], float] | None = None

    def bind(self, target: TargetRuntime, proposer: Proposer | None) -> None:
        """Read these two from now on (from the capabilities both declared, once, not every round)."""
        self._target = target.capabilities.compute_seconds
        self._draft = ProposerCapabilities.of(proposer).compute_seconds if proposer is not None else None

    def read(self) -> tuple[float | None, float]:
        """A snapshot of the target's and the proposer's compute clocks (an untimed proposer: 0)."""
        return (self._target() if self._target is not None else None,
                self._draft() if self._draft is not None else 0.0)

    def lap(self, before: tuple[float | None, float], after: tuple[float | None, float], rounds: int = 1) -> None:
        """Add the compute between two :meth:`read` snapshots (and ``rounds`` committed rounds)."""
        if before[0] is None or after[0] is None:
            self.timed = False
        else:
            self.target_s += after[0] - before[0]
        self.draft_s += after[1] - before[1]
        self.rounds += rounds

    def timings(self, decode_s: float) -> dict[str, float]:
        """The receipt's compute/host split of ``decode_s`` (empty when the target has no clock)."""
        if not self.timed:
            return {}
        host = max(decode_s - self.target_s - self.draft_s, 0.0)
        return {"target_compute_s": self.target_s, "draft_compute_s": self.draft_s, "host_s": host,
                "decode_rounds": self.rounds,
                "host_us_per_round": 1e6 * host / self.rounds if self.rounds else 0.0}


@attrs.define(eq=False)
class Generation:
    """One request. ``run()`` drives rounds; after a cancel or failure it resumes from the last commit.

    :meth:`rounds` yields each committed round, :meth:`stream` each committed text delta; both run
    the same request as :meth:`run`, and all three resume an interrupted generation.
    """

    session: Session
    prompt: np.ndarray
    cancel: CancelToken
    max_tokens: int
    txn: Transaction | None = None
    receipt: Receipt | None = None
    #: the request's configuration (the session's, with this request's max_tokens, stop and sampling)
    config: PowerConfig | None = None
    #: record log-probabilities of every emitted token with this many alternatives (None: off)
    top_logprobs: int | None = None
    #: decode without the session's proposer (:meth:`Session.start`'s ``target_only``)
    target_only: bool = False
    #: what the output must match (compiled by :meth:`Session.start`); its state lives with the transaction
    constraint: Constraint | None = None
    #: the session's lane it runs in (its strategy, proposer and configuration; ``None``: the default)
    lane: Lane | None = None
    #: the strategy the request asked for (:meth:`Session.start`'s ``strategy``; the receipt says it)
    requested: str | None = None
    #: what the answer is expected to repeat (:meth:`Session.start`'s ``prediction``), or ``None``
    prediction: Prediction | None = None
    #: observer hooks (``power_request_start``/``power_request_end``) that raised for this request:
    #: logged, counted here and in the receipt, never a failure of the request or of anyone else's
    observer_faults: int = attrs.field(default=0, init=False)
    _prefill_s: float = attrs.field(default=0.0, init=False)
    _prefilled: bool = attrs.field(default=False, init=False)
    _told_end: bool = attrs.field(default=False, init=False)  # its proposer heard that it finished
    _decode_s: float = attrs.field(default=0.0, init=False)
    #: when (``time.perf_counter``) its first round committed; ``None`` before
    first_commit_at: float | None = attrs.field(default=None, init=False)
    #: the compute/host split of ``_decode_s`` (receipt ``timings``)
    _clock: DecodeClock = attrs.field(factory=DecodeClock, init=False, repr=False)
    _text: TextAssembler | None = attrs.field(default=None, init=False)
    _thread: threading.Thread | None = attrs.field(default=None, init=False, repr=False)
    _predecessor: Generation | None = attrs.field(default=None, init=False, repr=False)
    _stream: Stream[Result] | None = attrs.field(default=None, init=False, repr=False)
    #: this request's share of the runtime's counters (``runtime_counters``), summed over its attempts
    _counts: dict[str, int] = attrs.field(factory=dict, init=False, repr=False)
    _before: dict[str, int] | None = attrs.field(default=None, init=False, repr=False)
    #: how the request shared target passes (the engine's, at the attempt's end; receipt ``backend.batch``)
    _batch: dict[str, Any] | None = attrs.field(default=None, init=False, repr=False)
    #: how the attempt ended (status, error), from :meth:`end` until :meth:`report` makes its receipt
    _ended: tuple[str, str | None] | None = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.lane is None:
            self.lane = self.session.lane()
        if self.config is None:
            self.config = attrs.evolve(self.lane.config, max_tokens=self.max_tokens)
        tok = self.session.opened.tokenizer
        if tok is not None:
            self._text = TextAssembler(tok.decode, self.config.stop)

    def _transaction(self) -> Transaction:
        s, lane = self.session, self.lane
        assert self.config is not None and lane is not None
        check_observers_only(s.plugins.pm)  # also when a host registered a plugin after loading
        hook = s.plugins.pm.hook.power_txn_phase
        phase_hook = hook if len(hook.get_hookimpls()) > 1 else None  # observers present
        caps = s.opened.target.capabilities
        proposer = None if self.target_only else lane.proposer
        if proposer is not None and self.prediction is not None:  # the prediction first, then the strategy
            proposer = PredictedProposer(self.prediction, proposer)
        scheduler = Scheduler.for_request(lane.config, caps.rollback_window, enabled=proposer is not None,
                                          costs=caps.verify_cost if lane.selection.strategy.cost_aware else None)
        # the transaction's own assembler: it runs on the driver's thread, the request's text on the reader's
        tok = s.opened.tokenizer
        stop_text = TextAssembler(tok.decode, self.config.stop).find_stop if tok is not None and self.config.stop \
            else None
        return Transaction(target=s.opened.target, proposer=proposer, sampler=TargetSampler.from_config(self.config),
                           scheduler=scheduler, max_tokens=self.max_tokens, stop_ids=s.stop_ids,
                           cancel=self.cancel, phase_hook=phase_hook, trace=lane.config.trace, stop_text=stop_text,
                           top_logprobs=self.top_logprobs,
                           sampling_in_graph=self.config.sampling_in_graph, constraint=self.constraint,
                           scope=RequestScope(tenant=self.config.tenant))

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self.txn.emitted) if self.txn else ()

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        """One entry per emitted token when the request asked for ``logprobs``, else empty."""
        return tuple(self.txn.logprobs) if self.txn else ()

    @property
    def finished(self) -> bool:
        """True once the request ended (stop, max_tokens or context); ``run()`` is then a no-op."""
        return self.txn is not None and self.txn.finished is not None

    def run(self) -> Result:
        """Run (or resume) the request to its end and return its tokens, text and receipt."""
        return self.session.driver().run(self)

    def result(self) -> Result:
        """Tokens, text (cut before a stop string) and receipt of the request as it stands."""
        assert self.receipt is not None, "the request has not run"
        return Result(tokens=self.tokens, text=self.text(), receipt=self.receipt)

    def text(self) -> str | None:
        """The committed text, ending right before a stop string (``None`` without a tokenizer)."""
        if self._text is None:
            return None
        self._text.sync(self.tokens)
        return self._text.text()

    def stream(self) -> Stream[Result]:
        """Run (or resume) the request as a :class:`~power_core.streaming.Stream` of text deltas."""
        if self._text is None:
            raise ConfigError("stream", self.session.opened.model_path, "a model with a tokenizer",
                              "without one, iterate Generation.rounds() and read Generation.tokens")
        self._stream = Stream(self, self._deltas(self._text))
        return self._stream

    def _deltas(self, text: TextAssembler) -> Generator[str, None, None]:
        # from the commits' snapshots: on shared passes the driver runs on while the reader reads
        tokens = list(self.tokens)  # committed before this attempt (a resumed request); nothing runs yet
        commits = self.session.driver().rounds(self)
        try:
            for commit in commits:
                tokens.extend(commit.tokens)
                text.sync(tokens)
                delta = text.take(final=commit.finished)
                if delta:
                    yield delta
        finally:
            commits.close()
        text.sync(self.tokens)
        delta = text.take(final=True)
        if delta:
            yield delta

    def rounds(self) -> Generator[RoundRecord, None, None]:
        """Run (or resume) the request, yielding each committed round; the receipt is final when it ends.

        The request runs through its session's engine (:meth:`Session.driver`), like every request.
        The session is busy from the first ``next()`` until the iterator ends or is closed (closing
        it early ends the request as ``cancelled``).
        """
        commits = self.session.driver().rounds(self)
        try:
            for commit in commits:
                yield commit.record
        finally:
            commits.close()

    # -- what a driver (power_core.engine.Engine) needs: one attempt at the request -----------------------
    @property
    def prefilled(self) -> bool:
        """The prompt is in the target's memory (round 0 can run, or ran)."""
        return self._prefilled

    @property
    def thread(self) -> threading.Thread | None:
        """The thread that started the request's current (or last) attempt."""
        return self._thread

    def take_over(self, resident: Generation | None) -> None:
        """The session hands its target to this request; ``resident`` is the request whose state the
        target holds (prompt reuse for a fresh request)."""
        if not self._prefilled and self.txn is None and resident is not self:
            self._predecessor = resident
        self._thread = threading.current_thread()

    def begin(self) -> Transaction:
        """Start an attempt on the (claimed) session: make, or keep, the request's transaction."""
        s, lane = self.session, self.lane
        assert lane is not None
        self.receipt = None
        self._before = runtime_counters(s.opened.target)  # this attempt's counts: the difference at its end
        self._clock.bind(s.opened.target, lane.proposer)
        if self.txn is None:
            self.txn = self._transaction()
            self._notify(s.plugins.pm.hook.power_request_start, request=RequestInfo(
                config=self.config or lane.config, strategy=lane.name, backend=s.backend.name,
                prompt_tokens=int(self.prompt.shape[0]), selection=lane.selection.reason))
        if (caps := s.opened.target.capabilities).cancel is not None and caps.clear_abort is not None:
            self.cancel.subscribe(caps.cancel, caps.clear_abort)  # it can stop a decode: for this attempt only
        return self.txn

    def resident_prefix(self) -> np.ndarray | None:
        """The tokens the target holds that may seed this prompt (``cache_prompt``; first attempt
        only): what the previous request left, or a state of the prompt cache restored now
        (:meth:`Session.prepare_memory`). Called on the thread that drives the target, right before
        the prefill."""
        # (a retried prefill has none: its memory may be half-filled; a restored state replaces it whole)
        previous, self._predecessor = self._predecessor, None
        assert self.config is not None
        return self.session.prepare_memory(previous, self.prompt, self.config.tenant, self.lane)

    def memory(self) -> tuple[TokenArray, str] | None:
        """What this request left in the target's memory while the target still holds it: its
        committed history but the anchor, and the tenant it belongs to; else ``None``."""
        txn = self.txn
        if txn is None or not self._prefilled:
            return None
        held = txn.history[:-1]
        assert self.config is not None
        return (held, self.config.tenant) if self.session.opened.target.n_past == held.shape[0] else None

    def prefill_done(self, seconds: float) -> None:
        """The prompt is in the target's memory, after ``seconds``."""
        self._prefilled = True
        self._prefill_s = seconds

    def clock(self) -> tuple[float | None, float]:
        """A snapshot of the target's and the proposer's compute clocks (:meth:`charge` takes it)."""
        return self._clock.read()

    def charge(self, before: tuple[float | None, float], seconds: float, rounds: int) -> None:
        """Charge the request's decode time with ``seconds`` of its own work since ``before`` (a
        :meth:`clock` snapshot), in which ``rounds`` rounds committed."""
        self._decode_s += seconds
        self._clock.lap(before, self._clock.read(), rounds)
        if rounds and self.first_commit_at is None:
            self.first_commit_at = time.perf_counter()

    def charge_shared_pass(self, compute: float | None) -> None:
        """A shared pass that decoded this request's block took ``compute`` seconds of target compute
        (``None``: the batch runtime keeps no clock)."""
        if compute is None:
            self._clock.timed = False
        else:
            self._clock.target_s += compute

    def end(self, failure: BaseException | None, batch: Mapping[str, Any] | None = None) -> None:
        """The attempt ended (``failure``: how, if not by finishing; ``batch``: the shared passes it ran
        in). On the thread that drives the target, before the sequence goes back: what must be done
        before another request runs there (the target stops listening to this request's cancel token,
        a failed restore marks the session lost, the proposer hears that the request finished, the
        runtime's counters are read). :meth:`report` then makes the receipt."""
        s = self.session
        caps = s.opened.target.capabilities
        if caps.cancel is not None and caps.clear_abort is not None:
            # a late cancel of this request must never stop the next one on the target, nor an abort
            # no decode consumed (a cancel between decodes) outlive the attempt
            self.cancel.unsubscribe(caps.cancel, caps.clear_abort)
            caps.clear_abort()
        status, error = "completed", None
        if isinstance(failure, GeneratorExit):
            status, error = "cancelled", "the caller stopped reading before the request finished"
        elif isinstance(failure, (Cancelled, KeyboardInterrupt)):  # committed tokens stay; it can resume
            status, error = "cancelled", str(failure) or type(failure).__name__
        elif isinstance(failure, PowerError):
            status, error = "failed", f"{failure.code}: {failure}"
        elif failure is not None:
            status, error = "failed", f"{type(failure).__name__}: {failure}"
        if self.txn is not None and self.txn.state_lost is not None:
            s.mark_lost(self.txn.state_lost)
        if failure is None:
            self._tell_end()
        self._batch = dict(batch) if batch is not None else None
        before, self._before = self._before, None
        if before is not None:
            for key, value in runtime_counters(s.opened.target).items():
                self._counts[key] = self._counts.get(key, 0) + value - before.get(key, 0)
        self._ended = (status, error)

    def report(self) -> Receipt | None:
        """The ended attempt's receipt, made now, and the ``power_request_end`` observers told. On the
        thread that reads the request (never the shared passes' driver, whose other requests would wait
        for a slow observer), after :meth:`end`. Called again, the same receipt; ``None`` when
        :meth:`end` failed."""
        if self._ended is None:
            return self.receipt
        (status, error), self._ended = self._ended, None
        receipt = self._receipt(status, error)
        self.receipt = receipt
        if not self._notify(self.session.plugins.pm.hook.power_request_end, receipt=receipt):
            self.receipt = attrs.evolve(receipt, observer_faults=self.observer_faults)
        if log.isEnabledFor(logging.INFO):
            log.info("request.end", status=status, strategy=self.lane.name if self.lane else None,
                     tokens=len(self.tokens), **self.receipt.summary())
        return self.receipt

    def _tell_end(self) -> None:
        """The request finished: tell its proposer, once, if it asked (``ProposerCapabilities.request_end``)."""
        txn = self.txn
        if self._told_end or txn is None or txn.finished is None or txn.proposer is None:
            return
        self._told_end = True
        if (told := txn.proposer_caps.request_end) is None:
            return
        try:
            told()
        except Exception as exc:  # what it committed is the request's; a proposer's bookkeeping cannot fail it
            log.warning("proposer.request_end_failed", proposer=type(txn.proposer).__name__,
                        error=f"{type(exc).__name__}: {exc}", exc_info=True)

    def close_stream(self) -> None:
        """End an unfinished stream of this request (as cancelled)."""
        if self._stream is not None:
            self._stream.close()

    def _notify(self, hook: pluggy.HookCaller, **kwargs: Any) -> bool:
        """Call the observers' ``hook``; one that raises is logged and counted, never a failure. True
        when every observer returned."""
        try:
            hook(**kwargs)
        except Exception as exc:
            self.observer_faults += 1
            log.warning("observer.failed", hook=hook.name, error=f"{type(exc).__name__}: {exc}", exc_info=True)
            return False
        return True

    def _receipt(self, status: str, error: str | None) -> Receipt:
        s, lane = self.session, self.lane
        assert lane is not None
        txn = self.txn
        st = lane.selection.strategy
        n_out = len(self.tokens)
        config = self.config or lane.config
        backend = copy.deepcopy({"name": s.backend.name, "version": s.backend.version, **s.opened.backend_info})
        if self._counts:  # this request's counts (runtime_counters), never the runtime's running totals
            backend["rollback"] = dict(self._counts)
        if self._batch is not None:  # the shared passes it ran in (continuous batching)
            backend["batch"] = dict(self._batch)
        if txn is not None:  # the widths of the verify passes it ran (all B with verify_capacity B)
            backend["verify_capacity"] = s.opened.target.capabilities.verify_capacity
            backend["verify_widths"] = {str(w): n for w, n in sorted(txn.verify_widths.items())}
            backend["sampling"] = "in-graph" if txn.in_graph else "host"  # where its greedy ids came from
        if txn is not None and txn.proposer_caps.samples_in_graph is not None:  # where the drafter's argmax ids came from
            backend["draft_sampling"] = "in-graph" if txn.proposer_caps.samples_in_graph else "host"
        return Receipt(
            status=status,
            finish_reason=txn.finished if txn else None,
            config=config.to_dict(),
            config_sha256=config.digest(),
            strategy={"name": st.name, "version": st.version, "package": st.package, "kind": st.kind,
                      **({"requested": self.requested} if self.requested is not None else {})},
            # a request that asked for auto: why auto picked this lane (the lane's own reason when it is auto's)
            selection=s.auto_reason if self.requested == MODE_AUTO and lane.mode != MODE_AUTO else lane.selection.reason,
            backend=backend,
            artifacts={**s.opened.artifacts, **lane.selection.artifacts},
            prompt_tokens=int(self.prompt.shape[0]),
            prompt_reused=txn.reused if txn else 0,
            output_tokens=n_out,
            output_sha256=token_digest(self.tokens),
            rounds=[r.to_dict() for r in txn.rounds] if txn else [],
            scheduler=txn.scheduler.summary() if txn else {},
            timings={
                "prefill_s": self._prefill_s,
                "decode_s": self._decode_s,
                # the first token comes from the prefill pass (llama.cpp's "eval" rate excludes it too)
                "decode_tok_s": max(n_out - 1, 0) / self._decode_s if self._decode_s > 0 else 0.0,
                "target_passes": txn.target_passes if txn else 0,
                **self._clock.timings(self._decode_s),
                **({"constraint_us_per_round": 1e6 * self.constraint.stats.seconds / max(1, len(txn.rounds))}
                   if self.constraint is not None and txn is not None else {}),
                **({"selftest_s": s.numerics.seconds} if s.numerics else {}),
            },
            error=error,
            observer_faults=self.observer_faults,
            constraint=self.constraint.stats.to_dict(len(txn.rounds) if txn else 0)
            if self.constraint is not None else None,
            selftest={k: v for k, v in s.numerics.to_dict().items() if k != "seconds"} if s.numerics else None,
            prediction=self.prediction.usage(self.tokens).to_dict() if self.prediction is not None else None,
        )
