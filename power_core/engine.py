"""The engine: the one loop that runs rounds, and the admission of requests to its sequences.

Every request runs here, whoever sends it: :meth:`Session.generate` (a request on the session's
own engine, one sequence), :class:`Engine` requests over the sequences of one target that share its
passes (continuous batching), and ``power serve``, which asks the engine for a slot instead of
keeping a pool of its own.

**Admission.** A request needs a free sequence (a :class:`~power_core.session.Session`).
:meth:`Engine.reserve` takes one at once (the free one holding the longest prefix of the request's
prompt that its tenant may reuse, as llama-server's slot selection does) or queues a
:class:`Ticket` (first come, first served; beyond ``queue_max`` waiting tickets it refuses with
:class:`~power_core.errors.Overloaded`).
:meth:`Engine.acquire` waits for the ticket. A request ends by giving its sequence back, to the
oldest waiting ticket that fits.

**Passes.** The engine runs one of two drivers, by what its target can do:

* *shared*: the sequences are one :class:`~power_core.runtime.BatchRuntime`'s. A driver thread runs
  one target pass at a time for every active request: between passes new requests join and finished
  ones leave; each decoding request opens its round (checkpoint, propose:
  :meth:`Transaction.open_round`), one :meth:`~power_core.runtime.BatchRuntime.decode_batch` decodes
  all their verify blocks plus prompt chunks of joining requests up to the pass's token budget
  (round-robin, so a long prompt never stalls the others and no prompt starves), and each request
  accepts, commits and emits from its own rows (:meth:`Transaction.close_round`). Whether a
  request's rows in a shared pass equal its solo rows is the target's numerics: with ``numerics =
  "exact"`` on llama.cpp's CPU backend they are bit-identical (:func:`power_core.numerics.batch_probe`
  checks it at start), so every output equals its solo run.
* *solo*: each sequence has a target of its own. The thread that reads a request's rounds runs them
  (prefill, then one pass per round), so independent requests decode in parallel threads without a
  hand-off per round.

Either way :meth:`Engine.rounds` yields :class:`Commit` values: each round's record with a snapshot
of the request taken when the round committed, so a reader in another thread never reads the
request while the driver changes it. A request's cancel, fault or stop restores only its own
transaction and sequence. A failure of the shared pass itself restores every round of it. A
request whose target state could not be restored marks its session lost
(:class:`~power_core.errors.StateLost` for every later request).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs
import numpy as np

from power_core.constraint import ConstraintSpec
from power_core.errors import Cancelled, ConfigError, Overloaded, PowerError, RuntimeFault, SessionBusy, StateLost
from power_core.logs import get_logger
from power_core.numerics import BatchProbeReport
from power_core.receipt import Receipt
from power_core.runtime import BatchItem, BatchRuntime, DecodeResult, Proposal
from power_core.scheduler import PassLoad
from power_core.transaction import CancelToken, PendingRound, RoundRecord, TokenLogprob, Transaction

__all__ = ["Commit", "Engine", "Request", "Slot", "Ticket"]

ResultT = TypeVar("ResultT", covariant=True)


class Slot(Protocol):
    """What the engine needs of one of its sequences (a :class:`~power_core.session.Session`)."""

    @property
    def strategy_name(self) -> str: ...

    @property
    def strategy_names(self) -> tuple[str, ...]:
        """The strategies a request on it may ask for (its lanes', and ``auto``)."""
        ...

    @property
    def max_block(self) -> int:
        """The widest verify block its rounds open (the anchor plus K proposals)."""
        ...

    @property
    def closed(self) -> bool: ...

    @property
    def lost(self) -> str | None:
        """Why its target's state was lost (it then takes no request), or ``None``."""
        ...

    def hand_over(self, gen: Any) -> None:
        """``gen`` is about to run on this sequence's target (raises when it cannot)."""
        ...

    def resident_match(self, prompt: np.ndarray, tenant: str) -> int:
        """How many of ``prompt``'s tokens (ids) a request of ``tenant`` would keep of what this
        sequence holds now (prompt reuse; 0 without it)."""
        ...

    def encode(self, prompt: Any) -> np.ndarray:
        """A prompt (text or ids) as token ids."""
        ...

    def start(self, prompt: Any, *, cancel: CancelToken | None = None, max_tokens: int | None = None,
              stop: Sequence[str] | None = None, sampling: Mapping[str, Any] | None = None,
              logprobs: int | None = None, tenant: str | None = None,
              constraint: ConstraintSpec | None = None, strategy: str | None = None) -> Request[Any]: ...


SlotT = TypeVar("SlotT", bound=Slot)


class Request(Protocol[ResultT]):
    """What the engine needs of one request (a :class:`~power_core.generation.Generation`): the small
    public interface a driver runs an attempt through."""

    @property
    def session(self) -> Any: ...

    @property
    def prompt(self) -> np.ndarray: ...

    @property
    def cancel(self) -> CancelToken: ...

    @property
    def txn(self) -> Transaction | None: ...

    @property
    def prefilled(self) -> bool: ...

    @property
    def thread(self) -> threading.Thread | None: ...

    def begin(self) -> Transaction: ...

    def resident_prefix(self) -> np.ndarray | None: ...

    def prefill_done(self, seconds: float) -> None: ...

    def clock(self) -> tuple[float | None, float]: ...

    def charge(self, before: tuple[float | None, float], seconds: float, rounds: int) -> None: ...

    def charge_shared_pass(self, compute: float | None) -> None: ...

    def end(self, failure: BaseException | None, batch: Mapping[str, Any] | None = None) -> None: ...

    def report(self) -> Receipt | None: ...

    def result(self) -> ResultT: ...

log = get_logger(__name__)

_END = object()


@attrs.frozen
class Commit:
    """One committed round of a request, as its reader sees it: the round's record and a snapshot of
    the request taken by the driver right after the round committed."""

    record: RoundRecord
    #: the tokens this round emitted
    tokens: tuple[int, ...]
    #: tokens the request has emitted so far, these included
    n_tokens: int
    #: the request ended with this round
    finished: bool
    #: the log-probabilities of this round's tokens (when the request asked for ``logprobs``)
    logprobs: tuple[TokenLogprob, ...] = ()


class Ticket(Generic[SlotT]):
    """A place in an engine's admission queue; :meth:`wait` returns the sequence it was given."""

    def __init__(self, engine: Engine[SlotT], strategy: str | None) -> None:
        self._engine = engine
        self.strategy = strategy
        self.session: SlotT | None = None
        #: why the wait ended without a sequence (the engine closed, or every sequence that fits was lost)
        self.failure: PowerError | None = None
        self._given = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    @property
    def ready(self) -> bool:
        return self._given.is_set()

    def _give(self, session: SlotT | None, failure: PowerError | None = None) -> None:  # under the engine's lock
        """Hand the ticket ``session``, or end its wait with ``failure`` (``session`` None)."""
        self.session, self.failure = session, failure
        self._given.set()
        for fn in self._callbacks:
            fn()

    def on_ready(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (from whichever thread frees the sequence) once the ticket holds one."""
        with self._engine._cv:
            if self._given.is_set():
                fn()
            else:
                self._callbacks.append(fn)

    def wait(self, timeout: float | None = None, cancel: CancelToken | None = None) -> SlotT:
        """The sequence, once it is this ticket's turn; :class:`Overloaded` after ``timeout`` seconds,
        :class:`Cancelled` when ``cancel`` fires first (either way the ticket leaves the queue)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._given.wait(0.05 if cancel is not None else None if deadline is None
                                   else max(0.0, deadline - time.monotonic())):
            if cancel is not None and cancel.cancelled:
                self.withdraw()
                raise Cancelled("the request was cancelled while it waited for a free slot")
            if deadline is not None and time.monotonic() >= deadline and self._engine._dequeue(self):
                raise Overloaded(f"no free slot within {timeout} s")
            # (else handed a sequence just as the time ran out: take it)
        if self.session is None:
            raise self.failure or Overloaded("the ticket left the queue")
        return self.session

    def withdraw(self) -> None:
        """Leave the queue; a sequence already given to the ticket goes to the next one."""
        self._engine._withdraw(self)


@attrs.define(eq=False)
class _Active:
    """A request the shared driver runs."""

    gen: Request[Any]
    events: queue.Queue[Any]
    remaining: np.ndarray  # prompt tokens still to prefill (empty once decoding)
    t0: float
    #: its reader wants the end only (:meth:`Engine.run`): rounds are not handed to its thread one by one
    quiet: bool = False
    #: its round opened in the pass now running and not yet closed (restored when the pass fails)
    pending: PendingRound | None = None
    passes: int = 0
    pass_tokens: int = 0
    peak: int = 0


class Engine(Generic[SlotT]):
    """Requests over the sequences of one model. Thread-safe: any thread may :meth:`submit` or
    :meth:`reserve`; :meth:`rounds` runs one request and yields its commits to the thread that reads it."""

    def __init__(self, sessions: Sequence[SlotT], *, runtime: BatchRuntime | None = None,
                 probe: BatchProbeReport | None = None, token_budget: int | None = None,
                 queue_max: int | None = None, closer: Callable[[], None] | None = None) -> None:
        if not sessions:
            raise ConfigError("parallel", 0, "at least one sequence")
        self.sessions = tuple(sessions)
        #: the shared passes' runtime (``None``: every sequence decodes alone, on its reader's thread)
        self.runtime = runtime
        #: how many tickets may wait for a sequence (``None``: no bound)
        self.queue_max = queue_max
        self._closer = closer
        self._cv = threading.Condition()
        self._free: collections.deque[SlotT] = collections.deque(self.sessions)
        self._waiting: collections.deque[Ticket[SlotT]] = collections.deque()
        self._running: dict[SlotT, Request[Any]] = {}
        #: sequences handed to a ticket whose request has not started yet
        self._reserved: set[SlotT] = set()
        self._closed = False
        #: are a sequence's rows in a shared pass its solo rows on this target? (every receipt says)
        self.probe = probe
        self.token_budget = 0
        self._thread: threading.Thread | None = None
        self._joining: collections.deque[_Active] = collections.deque()
        self._active: list[_Active] = []
        self._rr = 0  # round-robin start among prefilling requests (and among decoding ones' width turns)
        self._last_prefill = 0  # prompt tokens in the previous pass
        self._held = 0  # held(): no pass starts
        self._driver_done = False  # the driver thread has ended
        self._failure: str | None = None  # why the driver thread died (the engine then serves nothing)
        self._close_deferred = False  # close() timed out waiting for it: the driver closes the target
        self._compute: Callable[[], float] | None = None
        if runtime is not None:
            self._start_driver(runtime, token_budget)

    def _start_driver(self, runtime: BatchRuntime, token_budget: int | None) -> None:
        budget = runtime.token_budget if token_budget is None else token_budget
        max_block = max(s.max_block for s in self.sessions)
        if budget < len(self.sessions) * max_block:
            raise PowerError(f"a pass budget of {budget} tokens cannot hold {len(self.sessions)} verify blocks of "
                             f"{max_block}")
        self.token_budget = budget
        # the shared passes' compute clock (BatchRuntime.compute_seconds), bound once
        self._compute = runtime.compute_seconds
        self._thread = threading.Thread(target=self._loop, name="power-engine", daemon=True)
        self._thread.start()

    # -- admission ------------------------------------------------------------------------------------------
    def _fits(self, session: SlotT, strategy: str | None) -> bool:
        return session.lost is None and not session.closed and (strategy is None or strategy in session.strategy_names)

    def reserve(self, *, strategy: str | None = None, prompt: np.ndarray | None = None,
                tenant: str = "") -> Ticket[SlotT]:
        """A ticket for the next free sequence (of ``strategy`` when given): given at once when one is
        free and nobody waits, else queued. Never blocks; :class:`Overloaded` when ``queue_max``
        tickets already wait, :class:`SessionBusy` once the engine is closed.

        With the request's ``prompt`` (token ids) and ``tenant``, of the free sequences the one that
        holds the longest prefix of the prompt it may reuse (:meth:`Slot.resident_match`), as
        llama-server's slot selection does; with none, the one freed longest ago, so the states
        used most recently stay in their sequences longest. A waiting ticket gets the first
        sequence freed (first come, first served)."""
        if strategy is not None and not any(self._fits(s, strategy) for s in self.sessions):
            have = sorted({name for s in self.sessions for name in s.strategy_names})
            raise ConfigError("strategy", strategy, f"one of this engine's strategies ({', '.join(have)})")
        ticket: Ticket[SlotT] = Ticket(self, strategy)
        with self._cv:
            if self._failure is not None:
                raise self._failed()
            if self._closed:
                raise SessionBusy("the engine is closed")
            if not any(self._fits(s, strategy) for s in self.sessions):
                raise StateLost(f"every sequence{'' if strategy is None else ' of ' + strategy} of this engine lost "
                                "its target state (a failed restore); close the engine and open a new one")
            free = self._choose([s for s in self._free if self._fits(s, strategy)], prompt, tenant)
            if free is not None and not any(self._fits(free, t.strategy) for t in self._waiting):
                self._free.remove(free)
                self._reserved.add(free)
                ticket._give(free)
                return ticket
            if self.queue_max is not None and len(self._waiting) >= self.queue_max:
                raise Overloaded(f"all {len(self.sessions)} slots are busy and {len(self._waiting)} requests "
                                 f"are waiting (queue limit {self.queue_max})")
            self._waiting.append(ticket)
            return ticket

    @staticmethod
    def _choose(free: list[SlotT], prompt: np.ndarray | None, tenant: str) -> SlotT | None:  # under the lock
        """Of ``free`` (freed longest ago first), the one that holds the longest prefix of ``prompt``."""
        if not free:
            return None
        if prompt is None or len(free) == 1:
            return free[0]
        return max(free, key=lambda s: s.resident_match(prompt, tenant))  # (a tie: the first, freed longest ago)

    def acquire(self, timeout: float | None = None, *, strategy: str | None = None,
                cancel: CancelToken | None = None, prompt: np.ndarray | None = None, tenant: str = "") -> SlotT:
        """A free sequence (waits for one, up to ``timeout`` seconds: then :class:`Overloaded`); with
        ``prompt`` and ``tenant``, the one holding the most of it (:meth:`reserve`). Start a request on
        it with ``session.start(...)`` and run it with :meth:`rounds`, which gives the sequence back
        when the request ends (:meth:`release` gives back one never used)."""
        return self.reserve(strategy=strategy, prompt=prompt, tenant=tenant).wait(timeout, cancel)

    def release(self, session: SlotT) -> None:
        """Give ``session`` back: to the oldest waiting ticket it fits, else to the free ones."""
        close_now = False
        with self._cv:
            self._running.pop(session, None)
            self._reserved.discard(session)
            if session not in self._free:
                for ticket in self._waiting:
                    if self._fits(session, ticket.strategy):
                        self._waiting.remove(ticket)
                        self._reserved.add(session)
                        ticket._give(session)
                        break
                else:
                    self._free.append(session)
            if session.lost is not None:  # tickets no healthy sequence can serve would wait forever
                for ticket in [t for t in self._waiting if not any(self._fits(s, t.strategy) for s in self.sessions)]:
                    self._waiting.remove(ticket)
                    ticket._give(None, StateLost("every sequence this request could run on lost its target state "
                                                 "(a failed restore); close the engine and open a new one"))
            close_now = self._close_deferred and self.runtime is None and not self._running
            self._cv.notify_all()
        if close_now:  # close() stopped waiting for this request: free the sequences now that it ended
            self._close_sequences()

    def _dequeue(self, ticket: Ticket[SlotT]) -> bool:
        """Take ``ticket`` out of the queue if it still waits there (True), else False (it holds a sequence)."""
        with self._cv:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                return True
            return ticket.session is None

    def _withdraw(self, ticket: Ticket[SlotT]) -> None:
        with self._cv:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
            session, ticket.session = ticket.session, None
            if session is not None:
                self._reserved.discard(session)
        if session is not None:
            self.release(session)

    def _claim(self, gen: Request[Any]) -> None:
        """``gen`` starts an attempt on its session: reserved for it by a ticket, or free now (a
        library call on a session never waits: :class:`SessionBusy`). When the engine or the session
        refuses it, a sequence a ticket admitted for it goes back: every way out of :meth:`rounds` and
        :meth:`run` leaves the sequence as the engine's, never for the caller to release again."""
        s = gen.session
        refused: PowerError | None = None
        with self._cv:
            if self._failure is not None:
                refused = self._failed()
            elif self._closed or s.closed:
                refused = SessionBusy("the session is closed; open a new one")
            elif s in self._running or (s in self._reserved and gen.txn is not None):
                # (a resumed request may not take a sequence admitted for another one)
                raise SessionBusy("the session is serving another request (another thread's, or an unfinished "
                                  "stream); a session runs one request at a time: open one session per thread, "
                                  "or finish/close the stream first")
            else:
                if s in self._free:
                    self._free.remove(s)
                self._reserved.discard(s)
                self._running[s] = gen
            given = refused is not None and s in self._reserved and gen.txn is None
        if refused is not None:
            if given:  # admitted for this fresh request, which will never run on it
                self.release(s)
            raise refused
        try:
            s.hand_over(gen)
        except BaseException:
            self.release(s)
            raise

    def running_request(self, session: SlotT) -> Request[Any] | None:
        """The request running on ``session`` now, if any."""
        with self._cv:
            return self._running.get(session)

    @property
    def running(self) -> int:
        """Requests running: handed to the shared driver (joining or in its passes), or running their
        rounds on their own sequence."""
        with self._cv:
            return len(self._active) + len(self._joining) if self.runtime is not None else len(self._running)

    @property
    def busy(self) -> int:
        """Sequences held by a request (running, or admitted and about to run)."""
        with self._cv:
            return len(self.sessions) - len(self._free)

    @property
    def waiting(self) -> int:
        """Tickets waiting for a sequence."""
        with self._cv:
            return len(self._waiting)

    @property
    def failure(self) -> str | None:
        """Why the engine's driver thread died (it then refuses every request), or ``None``."""
        return self._failure

    def _failed(self) -> RuntimeFault:
        return RuntimeFault(f"the engine's driver failed ({self._failure}); this engine serves no more requests: "
                            "close it and open a new one")

    # -- requests -------------------------------------------------------------------------------------------
    def submit(self, prompt: Any, *, cancel: CancelToken | None = None, max_tokens: int | None = None,
               stop: Sequence[str] | None = None, sampling: Mapping[str, Any] | None = None,
               logprobs: int | None = None, strategy: str | None = None, tenant: str | None = None,
               constraint: ConstraintSpec | None = None) -> Request[Any]:
        """Start a request on the next free sequence (of ``strategy`` when given; waits for one; the
        free one holding the most of its prompt, :meth:`reserve`); run it with :meth:`rounds` or :meth:`run`.
        ``constraint``: what its output must match (:class:`~power_core.constraint.ConstraintSpec`)."""
        ids = self.sessions[0].encode(prompt)
        session = self.acquire(strategy=strategy, prompt=ids, tenant=tenant or "")
        try:
            return session.start(ids, cancel=cancel, max_tokens=max_tokens, stop=stop, sampling=sampling,
                                 logprobs=logprobs, tenant=tenant, constraint=constraint, strategy=strategy)
        except BaseException:
            self.release(session)
            raise

    def run(self, gen: Request[ResultT]) -> ResultT:
        """Run ``gen`` to its end; its result (tokens, text and receipt). Under the shared driver the
        calling thread sleeps until the request ends (no hand-over per round, as :meth:`rounds` makes)."""
        if gen.session not in self.sessions:
            raise SessionBusy("this request's session does not belong to the engine")
        if gen.txn is None or gen.txn.finished is None:
            for _ in self._solo(gen) if self.runtime is None else self._shared(gen, quiet=True):
                pass
        return gen.result()

    def rounds(self, gen: Request[Any]) -> Generator[Commit, None, None]:
        """Run (or resume) ``gen``, a request on one of this engine's sequences, and yield its commits
        as its rounds close. The sequence is the request's from the first ``next()``. Ends as the
        request does: the receipt is final, a cancel raises :class:`Cancelled`, a failure its error;
        closing the iterator early cancels the request."""
        if gen.session not in self.sessions:
            raise SessionBusy("this request's session does not belong to the engine")
        if gen.txn is not None and gen.txn.finished is not None:
            return  # it has ended: nothing to run (and no sequence to claim)
        yield from (self._solo(gen) if self.runtime is None else self._shared(gen))

    def _begin(self, gen: Request[Any]) -> None:
        self._claim(gen)
        try:
            gen.begin()
        except BaseException:
            self.release(gen.session)
            raise

    def _end(self, gen: Request[Any], failure: BaseException | None, batch: dict[str, Any] | None = None) -> None:
        """End the request's attempt (on the thread that drives its target), then give its sequence back.
        Its reader then makes its receipt (:meth:`Request.report`), on its own thread."""
        try:
            gen.end(failure, batch)
        finally:
            self.release(gen.session)

    # -- the solo driver: the reader's thread runs the rounds -----------------------------------------------
    def _solo(self, gen: Request[Any]) -> Generator[Commit, None, None]:
        self._begin(gen)
        txn = gen.txn
        assert txn is not None
        failure: BaseException | None = None
        try:
            if not gen.prefilled:  # (again, when a cancel or failure interrupted the prefill)
                t0 = time.perf_counter()
                txn.prefill(gen.prompt, gen.resident_prefix())
                gen.prefill_done(time.perf_counter() - t0)
            while txn.finished is None:
                if gen.session.closed:  # a suspended iterator resumed after Session.close()
                    raise SessionBusy("the session was closed while this request was unfinished")
                c0 = gen.clock()
                t0 = time.perf_counter()
                record = None
                try:
                    record = txn.step()
                finally:
                    gen.charge(c0, time.perf_counter() - t0, int(record is not None))
                if record is not None:
                    yield _commit(gen, record)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self._end(gen, failure)
            gen.report()

    # -- the shared driver: one thread runs every request's rounds in shared passes -------------------------
    def _shared(self, gen: Request[Any], quiet: bool = False) -> Generator[Commit, None, None]:
        self._begin(gen)
        events: queue.Queue[Any] = queue.Queue()
        active = _Active(gen=gen, events=events, remaining=np.zeros(0, dtype=np.int32), t0=time.perf_counter(),
                         quiet=quiet)
        with self._cv:
            refused: PowerError | None = self._failed() if self._failure is not None else \
                SessionBusy("the engine is closed") if self._closed else None
            if refused is None:
                self._joining.append(active)
                self._cv.notify_all()
        if refused is not None:
            self._finish(active, refused)
            gen.report()
            raise refused
        ended = False
        try:
            while True:
                item = events.get()
                if item is _END:
                    ended = True
                    failure = events.get()
                    gen.report()  # its receipt and observers: on this thread, never the driver's
                    if failure is not None:
                        raise failure
                    return
                yield item
        finally:
            if not ended:  # the reader left early: stop the request at the next pass, wait for its end
                gen.cancel.cancel()
                while events.get() is not _END:
                    pass
                gen.report()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """While held no pass starts (the pass in flight ends): requests handed to the driver
        meanwhile (:meth:`rounds`/:meth:`run` in other threads) all join at the next pass boundary,
        together, instead of in the order their threads got there."""
        with self._cv:
            self._held += 1
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
                self._cv.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Cancel what runs, refuse new requests, stop the driver and close the sequences and the target.

        Native memory is never freed under a running decode: when the driver has not stopped within
        ``timeout`` seconds (a decode that cannot be interrupted), the driver closes them itself once
        that decode returns."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for a in [*self._active, *self._joining]:
                a.gen.cancel.cancel()
            for gen in self._running.values():
                gen.cancel.cancel()
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cv.notify_all()
        with self._cv:
            for ticket in waiting:
                ticket._give(None, SessionBusy("the engine closed before a slot was free"))
        if self._thread is None:  # solo sequences: their readers' threads run the rounds; wait for them
            with self._cv:
                if not self._cv.wait_for(lambda: not self._running, timeout):
                    self._close_deferred = True  # the last request to end closes them (release)
                    log.error("engine.close_deferred", timeout=timeout,
                              reason="requests still running; the last one to end closes the sequences")
                    return
        else:
            self._thread.join(timeout)
            with self._cv:
                if not self._driver_done:
                    self._close_deferred = True
                    log.error("engine.close_deferred", timeout=timeout,
                              reason="a decode is still running; the driver closes the target when it returns")
                    return
        self._close_sequences()

    def _close_sequences(self) -> None:
        if self._closer is not None:
            closer, self._closer = self._closer, None
            closer()

    def __enter__(self) -> Engine[SlotT]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finish(self, a: _Active, failure: BaseException | None) -> None:
        """End the request's attempt (its sequence released) and wake its reader, which makes its
        receipt. Never raises: a request whose end fails gets that error, and the driver serves on."""
        try:
            batch = {"shared_passes": a.passes, "peak_concurrent": a.peak,
                     "mean_tokens_per_pass": a.pass_tokens / a.passes if a.passes else 0.0,
                     "n_seq": len(self.sessions), "token_budget": self.token_budget,
                     "rows_identical_to_solo": self.probe.identical if self.probe is not None else True}
            self._end(a.gen, failure, batch)
        except BaseException as exc:  # noqa: BLE001 - its end failed: that is how it ends
            log.error("engine.end_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
            failure = exc
        finally:
            a.events.put(_END)
            a.events.put(failure)

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: (self._joining or self._active) and not self._held or self._closed)
                    if self._closed and not self._joining and not self._active:
                        return
                    joining = list(self._joining)
                    self._joining.clear()
                for a in joining:  # between passes, in this thread: the target is not decoding now
                    try:
                        if not a.gen.prefilled:
                            assert a.gen.txn is not None
                            a.remaining = a.gen.txn.start_prefill(a.gen.prompt, a.gen.resident_prefix())
                    except BaseException as exc:
                        self._finish(a, exc)
                        continue
                    with self._cv:
                        self._active.append(a)
                with self._cv:
                    active = list(self._active)
                try:
                    self._pass(active)
                except BaseException as exc:  # a defect of the driver: fail every request (its open round
                    # restored), keep serving
                    log.error("engine.pass_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
                    for a in active:
                        if a in self._active:
                            self._leave(a, self._restore(a, exc))
        except BaseException as exc:  # the driver itself failed: no request may wait for it
            self._fail(exc)
        finally:
            with self._cv:
                self._driver_done = True
                deferred = self._close_deferred
            if deferred:  # close() stopped waiting for a decode: free the target now that it returned
                self._close_sequences()

    def _fail(self, exc: BaseException) -> None:
        """The driver thread is dying: the engine refuses every request from now on (:attr:`failure`),
        and the requests it was running or that wait for a sequence end with a :class:`RuntimeFault`
        (none waits for a pass that never comes)."""
        log.critical("engine.driver_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        with self._cv:
            self._failure = f"{type(exc).__name__}: {exc}"
            stranded = [*self._active, *self._joining]
            self._active.clear()
            self._joining.clear()
            waiting, self._waiting = list(self._waiting), collections.deque()
            for ticket in waiting:
                ticket._give(None, self._failed())
            self._cv.notify_all()
        for a in stranded:
            self._finish(a, self._restore(a, self._failed()))

    def _leave(self, a: _Active, failure: BaseException | None) -> None:
        with self._cv:
            self._active.remove(a)
        self._finish(a, failure)

    def _pass(self, active: list[_Active]) -> None:
        decoding = [a for a in active if a.gen.prefilled]
        prefilling = [a for a in active if not a.gen.prefilled]
        items: list[BatchItem] = []
        rounds: list[tuple[_Active, PendingRound]] = []
        if len(decoding) > 1:  # who chooses its width first rotates, so no request always sees the lightest pass
            turn = self._rr % len(decoding)
            decoding = decoding[turn:] + decoding[:turn]
        opened: list[tuple[_Active, PendingRound]] = []
        for a in decoding:
            txn = a.gen.txn
            assert txn is not None
            c0, t0 = a.gen.clock(), time.perf_counter()
            try:
                pending = txn.begin_round()
            except BaseException as exc:  # cancelled, or its checkpoint failed: only this request ends
                a.gen.charge(c0, time.perf_counter() - t0, 0)
                self._leave(a, exc)
                continue
            a.gen.charge(c0, time.perf_counter() - t0, 0)
            if pending is None:  # finished (context full)
                self._leave(a, None)
                continue
            a.pending = pending
            opened.append((a, pending))
        given, failed = self._ask_together(opened)
        opened = [(a, p) for a, p in opened if id(p) not in failed]
        for j, (a, pending) in enumerate(opened):
            txn = a.gen.txn
            assert txn is not None
            # the pass so far: the blocks opened before this one, at least the anchor of each one after,
            # and the prompt chunks joining it (the cost-aware width weighs the whole pass)
            others = sum(int(i.tokens.shape[0]) for i in items) + (len(opened) - j - 1)
            load = PassLoad(tokens=others + self._last_prefill, requests=len(opened) - 1) if len(active) > 1 else None
            c0, t0 = a.gen.clock(), time.perf_counter()
            try:
                txn.offer(pending, given.get(id(pending)), load)
            except BaseException as exc:  # cancelled, or its proposer failed: only this request ends
                a.pending = None  # (offer restored the round)
                a.gen.charge(c0, time.perf_counter() - t0, 0)
                self._leave(a, exc)
                continue
            a.gen.charge(c0, time.perf_counter() - t0, 0)
            if not pending.needs_pass:  # round 0: its verify row came from the prefill
                self._close(a, pending, None, 0.0)
                continue
            rounds.append((a, pending))
            items.append(BatchItem(txn.target, pending.block, "all"))
        budget = self.token_budget - sum(int(i.tokens.shape[0]) for i in items)
        chunks: list[tuple[_Active, int]] = []
        if prefilling:
            start = self._rr % len(prefilling)
            self._rr += 1
            for a in prefilling[start:] + prefilling[:start]:
                txn = a.gen.txn
                assert txn is not None
                if a.gen.cancel.cancelled:
                    txn.target.reset()
                    self._leave(a, Cancelled("generation cancelled during its prefill; nothing was committed"))
                    continue
                if budget <= 0:
                    break
                n = min(budget, int(a.remaining.shape[0]))
                final = n == a.remaining.shape[0]
                items.append(BatchItem(txn.target, a.remaining[:n], "last" if final else "none"))
                chunks.append((a, n))
                budget -= n
        self._last_prefill = sum(n for _, n in chunks)
        if not items:
            return
        assert self.runtime is not None
        t0, before = time.perf_counter(), self._compute() if self._compute is not None else None
        try:
            results = self.runtime.decode_batch(items)
            if len(results) != len(items):
                raise RuntimeFault(f"{type(self.runtime).__name__}.decode_batch returned {len(results)} results for "
                                   f"{len(items)} items; expected one per item, in order")
        except BaseException as exc:  # the shared pass failed: every round of it restores
            for a, _ in rounds:
                self._abort(a, exc)
            for a, _ in chunks:
                assert a.gen.txn is not None
                a.gen.txn.target.reset()
                self._leave(a, exc)
            return
        seconds = time.perf_counter() - t0
        after = self._compute() if self._compute is not None else None
        compute = None if before is None or after is None else after - before
        for a, _ in rounds:  # the shared pass's compute is each decoding request's target compute
            a.gen.charge_shared_pass(compute)
        n_tokens = sum(int(i.tokens.shape[0]) for i in items)
        concurrent = len(items)
        for a in [a for a, _ in rounds] + [a for a, _ in chunks]:
            a.passes += 1
            a.pass_tokens += n_tokens
            a.peak = max(a.peak, concurrent)
        for (a, pending), res in zip(rounds, results[: len(rounds)], strict=True):
            self._close(a, pending, res, seconds)
        for (a, n), res in zip(chunks, results[len(rounds):], strict=True):
            txn = a.gen.txn
            assert txn is not None
            try:
                txn.observe_prompt(res)
            except BaseException as exc:  # its proposer failed on the prompt: only this request ends
                txn.target.reset()
                self._leave(a, exc)
                continue
            a.remaining = a.remaining[n:]
            if a.remaining.shape[0] == 0:
                txn.finish_prefill(np.array(res.logits[-1]))  # a copy: the next pass reuses the buffer
                a.gen.prefill_done(time.perf_counter() - a.t0)

    def _abort(self, a: _Active, exc: BaseException) -> None:
        """A failure outside the request's own round (a shared pass, a shared draft): its round restores
        and it ends with ``exc`` (or with the restore's own failure)."""
        self._leave(a, self._restore(a, exc))

    @staticmethod
    def _restore(a: _Active, exc: BaseException) -> BaseException:
        """Restore the request's open round (:attr:`_Active.pending`), if it has one, after ``exc``: the
        failure it then ends with, ``exc`` or the restore's own."""
        pending, a.pending = a.pending, None
        if pending is None:
            return exc
        try:
            assert a.gen.txn is not None
            a.gen.txn.abort_round(pending, exc)
        except BaseException as lost:  # noqa: BLE001 - its restore failed too: that ends it
            return lost
        return exc

    @staticmethod
    def _asked(a: _Active) -> bool:
        """Whether the request's proposer drafts in a :class:`~power_core.runtime.ProposalBatch`."""
        return a.gen.txn is not None and a.gen.txn.proposer_caps.batch is not None

    def _ask_together(self, opened: list[tuple[_Active, PendingRound]]) -> tuple[dict[int, Proposal], set[int]]:
        """Ask the proposers that share a :class:`~power_core.runtime.ProposalBatch` (two or more
        rounds of this pass) together: one draft pass per step for all of them. Returns each round's
        proposal by ``id(pending)``, and the rounds (``id(pending)``) whose batch was interrupted
        (``KeyboardInterrupt``): those have restored and their requests left. When a batch fails, each
        of its requests proposes alone (its own ``propose``), as does a lone asker."""
        groups: dict[int, list[tuple[_Active, PendingRound]]] = {}
        for a, pending in opened:
            if pending.ask is not None and self._asked(a) and not a.gen.cancel.cancelled:
                assert a.gen.txn is not None
                groups.setdefault(id(a.gen.txn.proposer_caps.batch), []).append((a, pending))
        given: dict[int, Proposal] = {}
        failed: set[int] = set()
        for members in groups.values():
            if len(members) < 2:
                continue
            first = members[0][0].gen.txn
            assert first is not None and first.proposer_caps.batch is not None
            batch = first.proposer_caps.batch
            asks = []
            for a, pending in members:
                assert a.gen.txn is not None and a.gen.txn.proposer is not None and pending.ask is not None
                asks.append((a.gen.txn.proposer, pending.ask))
            clocks, t0 = [a.gen.clock() for a, _ in members], time.perf_counter()
            try:
                got = batch.propose_many(asks)
                if not isinstance(got, list) or len(got) != len(members):
                    raise TypeError(f"propose_many returned {type(got).__name__} for {len(members)} asks; expected a "
                                    "list of one Proposal per ask")
            except Exception as exc:  # noqa: BLE001 - the shared draft failed: each of its requests drafts alone
                # (a batch leaves its proposers as they were when it raises), so a fault of one request's
                # draft ends that request only, and the others propose what they would have
                log.warning("engine.draft_batch_failed", batch=type(batch).__name__, requests=len(members),
                            error=f"{type(exc).__name__}: {exc}")
                seconds = time.perf_counter() - t0
                for (a, _), c0 in zip(members, clocks, strict=True):
                    a.gen.charge(c0, seconds, 0)
                continue
            except BaseException as exc:  # interrupted: every round of it restores
                seconds = time.perf_counter() - t0
                for (a, pending), c0 in zip(members, clocks, strict=True):
                    a.gen.charge(c0, seconds, 0)
                    failed.add(id(pending))
                    self._abort(a, exc)
                continue
            seconds = time.perf_counter() - t0
            for (a, pending), c0, proposal in zip(members, clocks, got, strict=True):
                a.gen.charge(c0, seconds, 0)
                given[id(pending)] = proposal
        return given, failed

    def _close(self, a: _Active, pending: PendingRound, res: DecodeResult | None, seconds: float) -> None:
        txn = a.gen.txn
        assert txn is not None
        c0, t0 = a.gen.clock(), time.perf_counter()
        a.pending = None  # close_round commits the round, or restores it
        try:
            record = txn.close_round(pending, res)
        except BaseException as exc:
            a.gen.charge(c0, seconds + time.perf_counter() - t0, 0)
            self._leave(a, exc)
            return
        a.gen.charge(c0, seconds + time.perf_counter() - t0, 1)
        if not a.quiet:
            a.events.put(_commit(a.gen, record))
        if txn.finished is not None:
            self._leave(a, None)


def _commit(gen: Request[Any], record: RoundRecord) -> Commit:
    """The request as it stands right after ``record`` committed (taken on the driver's thread)."""
    txn = gen.txn
    assert txn is not None
    n = len(txn.emitted)
    lps = tuple(txn.logprobs[n - record.emitted:]) if txn.logprobs else ()
    return Commit(record=record, tokens=tuple(txn.emitted[n - record.emitted:]), n_tokens=n,
                  finished=txn.finished is not None, logprobs=lps)
