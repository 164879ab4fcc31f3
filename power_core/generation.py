"""One request on a session (:class:`Generation`): its transaction, its rounds, its clock and its
receipt (:class:`DecodeClock`, :meth:`Generation.report`); and what a finished one gives (:class:`Result`)."""


from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np
import pluggy

from power_core.config import MODE_AUTO, PowerConfig
from power_core.constraint import NO_PRESERVED, Constraint
from power_core.engine import Engine
from power_core.errors import (
    Cancelled,
    ConfigError,
    PowerError,
)
from power_core.logs import get_logger
from power_core.numerics import SelftestReport
from power_core.opening import Lane
from power_core.plugins import PowerPlugins, check_observers_only
from power_core.prediction import PredictedProposer, Prediction
from power_core.receipt import Receipt, token_digest
from power_core.runtime import (
    Proposer,
    ProposerCapabilities,
    RequestScope,
    TargetRuntime,
    TokenArray,
    runtime_counters,
)
from power_core.sampling import TargetSampler
from power_core.scheduler import Scheduler
from power_core.spec import Backend, OpenedModel, RequestInfo
from power_core.streaming import Stream
from power_core.text import TextAssembler
from power_core.transaction import CancelToken, RoundRecord, TokenLogprob, Transaction

log = get_logger(__name__)


class RequestHost(Protocol):
    """What a :class:`Generation` needs of the session it runs on (:class:`~power_core.session.Session`):
    its target and plugins, its lanes, the engine that drives it, and its prompt memory."""

    plugins: PowerPlugins
    backend: Backend
    opened: OpenedModel
    stop_ids: frozenset[int]
    auto_reason: str
    numerics: SelftestReport | None

    def lane(self, strategy: str | None = None) -> Lane: ...

    def driver(self) -> Engine[Any]: ...

    def prepare_memory(self, previous: Generation | None, prompt: TokenArray, tenant: str,
                       lane: Lane | None = None) -> TokenArray | None: ...

    def mark_lost(self, reason: str) -> None: ...


#: text, or token ids (a sequence or a 1-D integer array)
Prompt = str | Sequence[int] | np.ndarray


@attrs.frozen
class Result:
    """Emitted tokens, their text (when the model has a tokenizer) and the receipt."""

    tokens: tuple[int, ...]
    text: str | None
    receipt: Receipt


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

    session: RequestHost
    prompt: np.ndarray
    cancel: CancelToken
    max_tokens: int
    txn: Transaction | None = None
    receipt: Receipt | None = None
    #: the request's configuration (the session's, with this request's max_tokens, stop and sampling)
    config: PowerConfig = attrs.field(kw_only=True)
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
    #: the tokenizer's decode, showing the constraint's preserved tokens (:meth:`detokenize`)
    _detokenize: Callable[[TokenArray], str] | None = attrs.field(default=None, init=False, repr=False)
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
        tok = self.session.opened.tokenizer
        if tok is not None:
            preserved = self.constraint.preserved if self.constraint is not None else NO_PRESERVED
            self._detokenize = preserved.decoder(tok.decode)
            self._text = TextAssembler(self._detokenize, self.config.stop)

    def detokenize(self, tokens: TokenArray) -> str:
        """The text of ``tokens`` as this request's output shows it: the tokenizer's, with the control
        tokens its constraint preserves (tool-call markers such as Mistral's ``[TOOL_CALLS]``) shown as
        their text, and the others (the end of generation) left out."""
        if self._detokenize is None:
            raise ConfigError("detokenize", self.session.opened.model_path, "a model with a tokenizer",
                              "without one, read Generation.tokens")
        return self._detokenize(tokens)

    def _transaction(self) -> Transaction:
        s, lane = self.session, self.lane
        assert lane is not None
        check_observers_only(s.plugins.pm)  # also when a host registered a plugin after loading
        hook = s.plugins.pm.hook.power_txn_phase
        phase_hook = hook if len(hook.get_hookimpls()) > 1 else None  # observers present
        caps = s.opened.target.capabilities
        proposer = None if self.target_only else lane.proposer
        if proposer is not None and self.prediction is not None:  # the prediction first, then the strategy
            proposer = PredictedProposer(self.prediction, proposer)
        # the request's configuration: its K may be narrower than the lane's (Session.start's draft_max)
        scheduler = Scheduler.for_request(self.config or lane.config, caps.rollback_window, enabled=proposer is not None,
                                          costs=caps.verify_cost if lane.selection.strategy.cost_aware else None,
                                          k_session=lane.config.draft_max)
        # the transaction's own assembler: it runs on the driver's thread, the request's text on the reader's
        stop_text = TextAssembler(self.detokenize, self.config.stop).find_stop \
            if self._detokenize is not None and self.config.stop else None
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
        self._assembler()  # (a model without a tokenizer: refused before anything runs)
        self._stream = Stream(self, self._deltas())
        return self._stream

    def _assembler(self) -> TextAssembler:
        if self._text is None:
            raise ConfigError("stream", self.session.opened.model_path, "a model with a tokenizer",
                              "without one, iterate Generation.rounds() and read Generation.tokens")
        return self._text

    def take_text(self, committed: Sequence[int], final: bool) -> str:
        """The request's text not handed out yet, as of ``committed`` (its committed tokens as the reader's
        snapshot has them, which only grows): until ``final`` it withholds what may still change (an
        incomplete character, a tail that may become a stop string); a final take hands out the rest, cut
        at the stop string. The request has one assembler on the reader's side: this, :meth:`stream` and
        :meth:`text` share it (the transaction's stop check keeps its own, on the driver's thread)."""
        text = self._assembler()
        text.sync(committed)
        return text.take(final=final)

    def _deltas(self) -> Generator[str, None, None]:
        # from the commits' snapshots: on shared passes the driver runs on while the reader reads
        tokens = list(self.tokens)  # committed before this attempt (a resumed request); nothing runs yet
        commits = self.session.driver().rounds(self)
        try:
            for commit in commits:
                tokens.extend(commit.tokens)
                delta = self.take_text(tokens, final=commit.finished)
                if delta:
                    yield delta
        finally:
            commits.close()
        delta = self.take_text(self.tokens, final=True)
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
        return self.session.prepare_memory(previous, self.prompt, self.config.tenant, self.lane)

    def memory(self) -> tuple[TokenArray, str] | None:
        """What this request left in the target's memory while the target still holds it: its
        committed history but the anchor, and the tenant it belongs to; else ``None``."""
        txn = self.txn
        if txn is None or not self._prefilled:
            return None
        held = txn.history[:-1]
        return (held, self.config.tenant) if self.session.opened.target.n_past == held.shape[0] else None

    def prefill_done(self, seconds: float) -> None:
        """The prompt is in the target's memory, after ``seconds``."""
        self._prefilled = True
        self._prefill_s = seconds

    def clock(self) -> tuple[float | None, float]:
        """A snapshot of the target's and the proposer's compute clocks (:meth:`charge` takes it)."""
        return self._clock.read()

    def charge(self, before: tuple[float | None, float], after: tuple[float | None, float], seconds: float,
               rounds: int) -> None:
        """Charge the request's decode time with ``seconds`` of its own work between two :meth:`clock`
        snapshots, ``before`` and ``after``, in which ``rounds`` rounds committed."""
        self._decode_s += seconds
        self._clock.lap(before, after, rounds)
        if rounds and self.first_commit_at is None:
            self.first_commit_at = time.perf_counter()

    def charge_wait(self, seconds: float) -> None:
        """``seconds`` of a shared pass that this request's round took part in and none of its own stretches
        charged (the driver's work between them, the other requests' stretches before its round closed):
        decode time, all of it the host's."""
        self._decode_s += seconds

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
