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

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from power_core.chat import ChatTemplate, template_for
from power_core.config import LOGPROBS_MAX, MODE_AUTO, SAMPLING_KEYS, PowerConfig, RequestSettings
from power_core.constraint import Constraint, ConstraintSpec
from power_core.engine import Engine
from power_core.errors import (
    ConfigError,
    ConstraintError,
    SessionBusy,
    StateLost,
)
from power_core.generation import Generation, Prompt, Result
from power_core.logs import get_logger
from power_core.memory import PromptCache, hold_prefix, reusable_prefix, save_prefix, shares
from power_core.numerics import SelftestReport, batch_probe, selftest
from power_core.opening import (
    Lane,
    LanePlans,
    OpenPlan,
    close_proposer,
    in_own_thread,
    target_request,
    with_cache,
)
from power_core.plugins import PowerPlugins
from power_core.prediction import Prediction
from power_core.runtime import (
    BatchRuntime,
    Proposer,
    TokenArray,
)
from power_core.selection import Selection
from power_core.spec import Backend, OpenedModel, ProposerRequest, RequestInfo
from power_core.streaming import Stream
from power_core.tools import ToolPlan
from power_core.transaction import CancelToken

__all__ = ["RequestInfo", "Result", "Generation", "Lane", "Session", "SessionBatch", "SAMPLING_KEYS"]

log = get_logger(__name__)

# SAMPLING_KEYS (what a request may set for itself, Session.start's ``sampling``) are read from the keys'
# declared scopes (config.py)


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
        lanes = cls._plans(config, model, draft, backend, plugins, with_cache(overrides, prompt_cache), strategies)
        plan = lanes.plans[0]
        request = target_request(lanes.plans)

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
                   stop_ids: frozenset[int] | None = None, prompt_cache: PromptCache | None = None,
                   strategies: Sequence[str] | None = None, **overrides: Any) -> SessionBatch:
        """``n`` sessions on the sequences of one target whose passes they share (continuous
        batching; :class:`~power_core.engine.Engine` drives them). Raises :class:`ConfigError` naming
        ``parallel`` when the backend or a strategy cannot share passes (then open ``n`` sessions).
        ``prompt_cache`` and ``strategies``: as :meth:`open`'s, for every sequence (each sequence runs a
        request of any of them, off, suffix and draft-model side by side)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError("parallel", n, "an integer >= 1")
        overrides = with_cache(overrides, prompt_cache)
        lanes = cls._plans(config, model, draft, backend, plugins, overrides, strategies)
        plan = lanes.plans[0]
        if plan.config.verify_capacity:  # named "parallel": serve then runs independent (padded) slots
            raise ConfigError("parallel", n, "independent slots with verify_capacity",
                              f"verify_capacity={plan.config.verify_capacity} pads one sequence's passes, but a shared "
                              "pass holds several requests' blocks and prompt chunks, so its width varies")
        if plan.backend.open_batch is None:
            raise ConfigError("parallel", n, "independent slots on this backend",
                              f"backend {plan.backend.name!r} has no shared-pass (batch) runtime")
        request = target_request(lanes.plans)
        open_batch = plan.backend.open_batch

        def load() -> SessionBatch:
            opened = open_batch(request, n)
            sessions: list[Session] = []
            try:
                for one in opened.models:
                    sessions.append(cls._on(lanes, one, stop_ids, prompt_cache))
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
               strategies: Sequence[str] | None) -> LanePlans:
        if strategies is None:  # spec_mode's one strategy, exactly as it always was
            return LanePlans.single(OpenPlan.make(config, model, draft, backend, plugins, overrides))
        return LanePlans.make(config, model, draft, backend, plugins, overrides, strategies)

    @classmethod
    def _on(cls, lanes: LanePlans, opened: OpenedModel, stop_ids: frozenset[int] | None,
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
                close_proposer(lane.proposer)
            raise
        stops = opened.target.capabilities.eog_ids if stop_ids is None else frozenset(stop_ids)
        return cls(plugins=plan.plugins, backend=plan.backend, opened=opened, lanes=tuple(made), stop_ids=stops,
                   numerics=report, prompt_cache=prompt_cache, auto=lanes.auto, auto_reason=lanes.auto_reason)

    @staticmethod
    def _lane(plan: OpenPlan, opened: OpenedModel, report: SelftestReport | None) -> Lane:
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
                    close_proposer(lane.proposer)
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

    def resident_match(self, prompt: TokenArray, tenant: str) -> int:
        """How many of ``prompt``'s tokens a request of ``tenant`` would keep of what this session's
        target holds now (the engine admits a request to the free sequence where this is largest)."""
        resident = self._resident
        held = resident.memory() if resident is not None and self.reuses_prompts else None
        if held is None or not shares(self.prompt_cache, held[1], tenant):
            return 0
        return reusable_prefix(held[0], prompt, trims=self.opened.target.capabilities.trims_prefix)

    def prepare_memory(self, previous: Generation | None, prompt: TokenArray, tenant: str,
                       lane: Lane | None = None) -> TokenArray | None:
        """Make the target hold the longest prefix of ``prompt`` it can get for a request of ``tenant``, on
        the thread that drives it, right before the prefill (:func:`power_core.memory.hold_prefix`, from what
        ``previous``, the request whose state it holds, left). ``lane``: the request's (default: the first);
        one that reuses no prompt prefills from empty, after what the target holds is saved for the lanes
        that do."""
        if not self.reuses_prompts:
            return None
        held = previous.memory() if previous is not None else None
        target = self.opened.target
        if not (lane or self.lanes[0]).reuses_prompts:
            if held is not None:
                save_prefix(target, self.prompt_cache, *held)  # about to be replaced by a whole prefill
            return None
        return hold_prefix(target, self.prompt_cache, held, prompt, tenant, lost=self.mark_lost)

    def _keep(self, resident: Generation) -> None:
        """The session closes: what ``resident`` left in the target goes into the prompt cache."""
        held = resident.memory() if self.reuses_prompts else None
        if held is not None:
            save_prefix(self.opened.target, self.prompt_cache, *held)

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
              constraint: ConstraintSpec | Constraint | None = None, strategy: str | None = None,
              prediction: str | Prediction | None = None, draft_max: int | None = None) -> Generation:
        """Prepare a request (nothing runs until :meth:`Generation.run` or :meth:`Generation.stream`).

        ``max_tokens``, ``stop`` (stop strings) and ``sampling`` (any of :data:`SAMPLING_KEYS`:
        ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, the penalties, ``logit_bias``) override the
        session's configuration for this request: they are its :class:`~power_core.config.RequestSettings`,
        each value checked by its key (``None``: the session's), and the request runs with the session's
        configuration with them in place (:meth:`PowerConfig.with_request`), which its receipt records.
        ``logprobs=N`` records, for every emitted token, its log-probability under the target row
        that emitted it and the N most likely alternatives (:attr:`Generation.logprobs`).
        ``target_only=True`` decodes without the session's proposer (one token per target pass, the
        same sampling): what speculation must equal, e.g. for ``power serve --audit-rate``.
        ``tenant`` (config ``tenant``) is whom the request runs for: memories kept across requests
        (a proposer's, :class:`~power_core.runtime.RequestScope`) serve only that tenant's requests.
        ``constraint`` (a :class:`~power_core.constraint.ConstraintSpec`: JSON schema, regex or
        grammar, optionally lazy) is what the output must match; it is compiled here, so a schema
        the grammar engine refuses is a :class:`~power_core.errors.ConstraintError` before anything runs.
        A constraint :meth:`compile` made already (e.g. while the server checked the request) is used as
        it is, not compiled again: it carries its parse state, so it must be fresh (one per request).
        ``strategy``: which of the session's strategies runs it (:meth:`lane`: ``None`` the default,
        ``auto`` the library's pick among them); the request starts from that lane's configuration,
        and its receipt names the strategy that ran and the one asked for.
        ``prediction``: text the answer is expected to repeat (OpenAI's Predicted Outputs), or a
        :class:`~power_core.prediction.Prediction` of it: a speculative lane drafts from it first
        (:class:`~power_core.prediction.PredictedProposer`), and the receipt's ``prediction`` counts how
        much of it the output repeated; a target-only lane only counts.
        ``draft_max``: this request's K (config ``spec_draft_max``), at most its lane's, which sized the
        target's verify passes and the draft's work: a block draft (the DFlash family) still decodes the
        lane's block and the request verifies at most ``draft_max`` of it, as llama-server's per-request
        ``speculative.n_max`` truncates a draft.
        """
        lane = self.lane(strategy)
        for key, value in (sampling or {}).items():
            if key not in SAMPLING_KEYS:
                raise ConfigError(f"sampling.{key}", value, f"one of {', '.join(SAMPLING_KEYS)}",
                                  "other keys are the session's; open a session with them")
        settings = RequestSettings({**(sampling or {}), "tenant": tenant, "max_tokens": max_tokens, "stop": stop,
                                    "spec_draft_max": lane.request_k(draft_max)})
        config = lane.config.with_request(settings)
        if config.stop and self.opened.tokenizer is None:
            raise ConfigError("stop", list(config.stop), "no stop strings for a model without a tokenizer",
                              "stop strings match decoded text; use stop token ids (stop_ids) instead")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= LOGPROBS_MAX):
            raise ConfigError("logprobs", logprobs, f"an integer in [0, {LOGPROBS_MAX}]",
                              "the number of alternatives recorded per emitted token")
        tokens = self.encode(prompt)
        if isinstance(constraint, ConstraintSpec):
            constraint = self.compile(constraint)
        elif constraint is not None and constraint.consumed:
            raise ConstraintError(constraint.spec.field, "this compiled constraint has parsed another output "
                                  f"({constraint.consumed} tokens); give each request a fresh one "
                                  "(Session.compile) or its ConstraintSpec")
        if prediction is not None and not isinstance(prediction, Prediction):
            prediction = Prediction.from_text(prediction, self.opened.tokenizer,
                                              self.opened.target.capabilities.n_ctx)
        return Generation(self, tokens, cancel or CancelToken(), config.max_tokens, config=config,
                          top_logprobs=logprobs, target_only=target_only, constraint=constraint, lane=lane,
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
