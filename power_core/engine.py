"""The engine: requests over the sequences of one model, from their admission to a sequence to the end
of the driver that runs them.

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

* *shared*: the sequences are one :class:`~power_core.runtime.BatchRuntime`'s; one driver thread
  runs one target pass at a time for every active request (:class:`~power_core.passes.SharedPasses`).
* *solo*: each sequence has a target of its own. The process's compute thread
  (:func:`~power_core.compute.compute_thread`) runs a request's prefill and rounds, whichever thread reads
  them: llama.cpp's CPU backend leads an OpenMP team from the thread that decodes, and a process with a team
  per reading thread decodes at a third of the speed (:mod:`power_core.compute`). A reader that iterates
  :meth:`Engine.rounds` hands it one round at a time; :meth:`Engine.run` the whole request, which gives way
  between rounds to another request waiting there.

Either way :meth:`Engine.rounds` yields :class:`~power_core.passes.Commit` values: each round's record
with a snapshot of the request taken when the round committed, so a reader in another thread never
reads the request while the driver changes it. On shared passes :meth:`Engine.feed` hands them instead
straight from the driver to a callable of the caller's (``power serve``: its event loop), so no thread
waits for the request. A request's cancel, fault or stop restores only its own
transaction and sequence. A request whose target state could not be restored marks its session lost
(:class:`~power_core.errors.StateLost` for every later request).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import queue
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from power_core.compute import ComputeThread, compute_thread, wait_get
from power_core.constraint import ConstraintSpec
from power_core.errors import Cancelled, ConfigError, Overloaded, PowerError, RuntimeFault, SessionBusy, StateLost
from power_core.logs import get_logger
from power_core.numerics import BatchProbeReport
from power_core.passes import Charged, Commit, Deliver, Ended, Request, SharedPasses, commit_of
from power_core.rounds import CancelToken
from power_core.runtime import BatchRuntime

__all__ = ["Commit", "Engine", "Request", "Slot", "Ticket"]

log = get_logger(__name__)

ResultT = TypeVar("ResultT", covariant=True)


class Slot(Protocol):
    """What the engine needs of one of its sequences (a :class:`~power_core.session.Session`)."""

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
              logprobs: int | None = None, tenant: str | None = None, constraint: ConstraintSpec | None = None,
              strategy: str | None = None, draft_max: int | None = None) -> Request[Any]: ...


SlotT = TypeVar("SlotT", bound=Slot)


class Ticket(Generic[SlotT]):
    """A place in an engine's admission queue; :meth:`wait` returns the sequence it was given."""

    def __init__(self, engine: Engine[SlotT]) -> None:
        self._engine = engine
        self.session: SlotT | None = None
        #: why the wait ended without a sequence (the engine closed, or every sequence was lost)
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


class Engine(Generic[SlotT]):
    """Requests over the sequences of one model. Thread-safe: any thread may :meth:`submit` or
    :meth:`reserve`; :meth:`rounds` runs one request and yields its commits to the thread that reads it,
    :meth:`feed` hands them from the shared passes' driver to a callable."""

    def __init__(self, sessions: Sequence[SlotT], *, runtime: BatchRuntime | None = None,
                 probe: BatchProbeReport | None = None, token_budget: int | None = None,
                 queue_max: int | None = None, closer: Callable[[], None] | None = None) -> None:
        if not sessions:
            raise ConfigError("parallel", 0, "at least one sequence")
        self.sessions = tuple(sessions)
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
        self._failure: str | None = None  # why the driver thread died (the engine then serves nothing)
        self._close_deferred = False  # close() timed out waiting for it: the driver closes the target
        #: the driver of the shared passes (``None``: solo sequences)
        self._driver: SharedPasses | None = None
        if runtime is not None:
            budget = runtime.token_budget if token_budget is None else token_budget
            max_block = max(s.max_block for s in self.sessions)
            if budget < len(self.sessions) * max_block:
                raise PowerError(f"a pass budget of {budget} tokens cannot hold {len(self.sessions)} verify blocks "
                                 f"of {max_block}")
            self.token_budget = budget
            self._driver = SharedPasses(runtime, budget, self._cv, self, n_seq=len(self.sessions), probe=probe)

    @property
    def runtime(self) -> BatchRuntime | None:
        """The shared passes' runtime (``None``: every sequence decodes alone, on the compute thread)."""
        return self._driver.runtime if self._driver is not None else None

    @runtime.setter
    def runtime(self, runtime: BatchRuntime) -> None:
        """Decode the next shared passes with ``runtime`` (e.g. the same runtime, wrapped)."""
        if self._driver is None:
            raise ConfigError("runtime", type(runtime).__name__, "an engine of shared passes (this one has none)")
        self._driver.runtime = runtime

    # -- admission ------------------------------------------------------------------------------------------
    @staticmethod
    def _fits(session: SlotT) -> bool:
        return session.lost is None and not session.closed

    def reserve(self, *, prompt: np.ndarray | None = None, tenant: str = "") -> Ticket[SlotT]:
        """A ticket for the next free sequence (every sequence runs any of the engine's strategies): given
        at once when one is free and nobody waits, else queued. Never blocks; :class:`Overloaded` when ``queue_max``
        tickets already wait, :class:`SessionBusy` once the engine is closed.

        With the request's ``prompt`` (token ids) and ``tenant``, of the free sequences the one that
        holds the longest prefix of the prompt it may reuse (:meth:`Slot.resident_match`), as
        llama-server's slot selection does; with none, the one freed longest ago, so the states
        used most recently stay in their sequences longest. A waiting ticket gets the first
        sequence freed (first come, first served)."""
        ticket: Ticket[SlotT] = Ticket(self)
        with self._cv:
            if self._failure is not None:
                raise self._failed()
            if self._closed:
                raise SessionBusy("the engine is closed")
            if not any(self._fits(s) for s in self.sessions):
                raise StateLost("every sequence of this engine lost its target state (a failed restore); close the "
                                "engine and open a new one")
            free = self._choose([s for s in self._free if self._fits(s)], prompt, tenant)
            if free is not None and not self._waiting:
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

    def acquire(self, timeout: float | None = None, *, cancel: CancelToken | None = None,
                prompt: np.ndarray | None = None, tenant: str = "") -> SlotT:
        """A free sequence (waits for one, up to ``timeout`` seconds: then :class:`Overloaded`); with
        ``prompt`` and ``tenant``, the one holding the most of it (:meth:`reserve`). Start a request on
        it with ``session.start(...)`` and run it with :meth:`rounds`, which gives the sequence back
        when the request ends (:meth:`release` gives back one never used)."""
        return self.reserve(prompt=prompt, tenant=tenant).wait(timeout, cancel)

    def release(self, session: SlotT) -> None:
        """Give ``session`` back: to the oldest waiting ticket, else to the free ones."""
        close_now = False
        with self._cv:
            self._running.pop(session, None)
            self._reserved.discard(session)
            if session not in self._free:
                if self._waiting and self._fits(session):
                    self._reserved.add(session)
                    self._waiting.popleft()._give(session)
                else:
                    self._free.append(session)
            if session.lost is not None and not any(self._fits(s) for s in self.sessions):
                while self._waiting:  # no healthy sequence is left to serve them: they would wait forever
                    self._waiting.popleft()._give(None, StateLost(
                        "every sequence of this engine lost its target state (a failed restore); close the engine "
                        "and open a new one"))
            close_now = self._close_deferred and self._driver is None and not self._running
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
            return self._driver.running if self._driver is not None else len(self._running)

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
               constraint: ConstraintSpec | None = None, draft_max: int | None = None) -> Request[Any]:
        """Start a request on the next free sequence (waits for one; the free one holding the most of its
        prompt, :meth:`reserve`); run it with :meth:`rounds` or :meth:`run`. The rest are
        :meth:`Slot.start`'s (``constraint``: what its output must match, a
        :class:`~power_core.constraint.ConstraintSpec`; ``draft_max``: its own K, at most its strategy's)."""
        if strategy is not None and strategy not in self.sessions[0].strategy_names:  # before it waits for a turn
            raise ConfigError("strategy", strategy,
                              f"one of this engine's strategies ({', '.join(self.sessions[0].strategy_names)})")
        ids = self.sessions[0].encode(prompt)
        session = self.acquire(prompt=ids, tenant=tenant or "")
        try:
            return session.start(ids, cancel=cancel, max_tokens=max_tokens, stop=stop, sampling=sampling,
                                 logprobs=logprobs, tenant=tenant, constraint=constraint, strategy=strategy,
                                 draft_max=draft_max)
        except BaseException:
            self.release(session)
            raise

    def run(self, gen: Request[ResultT]) -> ResultT:
        """Run ``gen`` to its end; its result (tokens, text and receipt). Under the shared driver the
        calling thread sleeps until the request ends (no hand-over per round, as :meth:`rounds` makes)."""
        if gen.session not in self.sessions:
            raise SessionBusy("this request's session does not belong to the engine")
        if gen.txn is None or gen.txn.finished is None:
            for _ in self._solo(gen, quiet=True) if self._driver is None else self._shared(self._driver, gen, quiet=True):
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
        yield from (self._solo(gen) if self._driver is None else self._shared(self._driver, gen))

    def _begin(self, gen: Request[Any]) -> None:
        self._claim(gen)
        try:
            gen.begin()
        except BaseException:
            self.release(gen.session)
            raise

    def end_attempt(self, gen: Request[Any], failure: BaseException | None,
                    batch: Mapping[str, Any] | None = None) -> None:
        """End the request's attempt (on the thread that drives its target), then give its sequence back.
        Its reader then makes its receipt (:meth:`Request.report`), on its own thread."""
        try:
            gen.end(failure, batch)
        finally:
            self.release(gen.session)

    # -- the solo driver: the process's compute thread runs the rounds (power_core.compute) ------------------
    def _solo(self, gen: Request[Any], quiet: bool = False) -> Generator[Commit, None, None]:
        self._begin(gen)
        compute = compute_thread()
        rounds = self._solo_rounds(gen)
        step = functools.partial(next, rounds, None)
        cancel = gen.cancel.cancel
        try:
            if quiet:  # to its end in one call, giving way between rounds to another request's
                while compute.call(functools.partial(self._run_while_alone, rounds, compute), interrupt=cancel):
                    pass
                return
            while (commit := compute.call(step, interrupt=cancel)) is not None:
                yield commit
        finally:
            state = inspect.getgeneratorstate(rounds)
            if state == inspect.GEN_CREATED:  # failed before its first round
                self.end_attempt(gen, sys.exc_info()[1])
            elif state == inspect.GEN_SUSPENDED:  # a reader that left early: its open round ends, its sequence
                compute.call(rounds.close)  # goes back
            gen.report()  # its receipt and observers: on the reader's thread, as on shared passes

    @staticmethod
    def _run_while_alone(rounds: Generator[Commit, None, None], compute: ComputeThread) -> bool:
        """Run ``rounds`` until they end (False) or another request waits for the compute thread (True)."""
        for _ in rounds:
            if compute.busy():
                return True
        return False

    def _solo_rounds(self, gen: Request[Any]) -> Generator[Commit, None, None]:
        """The request's prefill and rounds (on the compute thread); its attempt ends with them."""
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
                with Charged(gen) as charged:  # the round, and its commit for the reader
                    record = txn.step()
                    charged.rounds = int(record is not None)
                    commit = commit_of(gen, record) if record is not None else None
                if commit is not None:
                    yield commit
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self.end_attempt(gen, failure)

    # -- the shared driver: one thread runs every request's rounds in shared passes (power_core.passes) -----
    def _shared(self, driver: SharedPasses, gen: Request[Any], quiet: bool = False) -> Generator[Commit, None, None]:
        self._begin(gen)
        events: queue.Queue[Commit | Ended] = queue.Queue()
        driver.enter(gen, quiet, events.put)
        ended = False
        try:
            while True:
                item = wait_get(events)
                if isinstance(item, Ended):
                    ended = True
                    gen.report()  # its receipt and observers: on this thread, never the driver's
                    if item.failure is not None:
                        raise item.failure
                    return
                yield item
        finally:
            if not ended:  # the reader left early: stop the request at the next pass, wait for its end
                gen.cancel.cancel()
                while not isinstance(wait_get(events), Ended):
                    pass
                gen.report()

    def feed(self, gen: Request[Any], deliver: Deliver, *, quiet: bool = False) -> None:
        """Run ``gen``, a fresh request on one of this engine's sequences, in the shared passes with no
        thread of the caller's waiting for it: the driver hands ``deliver`` each :class:`Commit` as its
        round closes (none when ``quiet``), then one :class:`~power_core.passes.Ended`, on the driver's
        thread (``power serve`` posts them to its event loop). Returns once the request has begun (its
        ``power_request_start`` observers, on this thread) and was handed over; raises, having delivered
        nothing, when the engine or the session refuses to begin it (its sequence is the engine's
        again). Once :class:`~power_core.passes.Ended` arrives its reader makes the receipt
        (:meth:`Request.report`), off the driver's thread."""
        if self._driver is None:
            raise ConfigError("feed", "solo sequences", "an engine of shared passes",
                              "on solo sequences the reader's thread runs the rounds: iterate rounds()")
        if gen.session not in self.sessions:
            raise SessionBusy("this request's session does not belong to the engine")
        self._begin(gen)
        self._driver.enter(gen, quiet, deliver)

    def refusal(self) -> PowerError | None:
        """Why a request may not join the shared passes now (the engine failed or closed), else ``None``."""
        return self._failed() if self._failure is not None else \
            SessionBusy("the engine is closed") if self._closed else None

    def driver_failed(self, exc: BaseException) -> None:  # under the lock
        """The driver thread is dying of ``exc``: the engine refuses every request from now on
        (:attr:`failure`), and the tickets waiting for a sequence end with a :class:`RuntimeFault`."""
        self._failure = f"{type(exc).__name__}: {exc}"
        waiting, self._waiting = list(self._waiting), collections.deque()
        for ticket in waiting:
            ticket._give(None, self._failed())

    def driver_exited(self) -> None:
        """The driver thread has ended: when :meth:`close` stopped waiting for a decode, free the target
        now that it returned."""
        with self._cv:
            deferred = self._close_deferred
        if deferred:
            self._close_sequences()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """While held no pass starts (the pass in flight ends): requests handed to the driver
        meanwhile (:meth:`rounds`/:meth:`run` in other threads) all join at the next pass boundary,
        together, instead of in the order their threads got there."""
        driver = self._driver
        if driver is None:  # solo sequences: no pass to hold
            yield
            return
        with self._cv:
            driver.hold(+1)
        try:
            yield
        finally:
            with self._cv:
                driver.hold(-1)

    def close(self, timeout: float = 60.0) -> None:
        """Cancel what runs, refuse new requests, stop the driver and close the sequences and the target.

        Native memory is never freed under a running decode: when the driver has not stopped within
        ``timeout`` seconds (a decode that cannot be interrupted), the driver closes them itself once
        that decode returns."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            if self._driver is not None:
                self._driver.stop()
            for gen in self._running.values():
                gen.cancel.cancel()
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cv.notify_all()
        with self._cv:
            for ticket in waiting:
                ticket._give(None, SessionBusy("the engine closed before a slot was free"))
        if self._driver is None:  # solo sequences: their readers' threads run the rounds; wait for them
            with self._cv:
                if not self._cv.wait_for(lambda: not self._running, timeout):
                    self._close_deferred = True  # the last request to end closes them (release)
                    log.error("engine.close_deferred", timeout=timeout,
                              reason="requests still running; the last one to end closes the sequences")
                    return
        else:
            self._driver.join(timeout)
            with self._cv:
                if not self._driver.done:
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
