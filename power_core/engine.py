"""The round driver: one target pass per round for every active request (continuous batching).

An :class:`Engine` owns the sessions of a :class:`~power_core.session.SessionBatch` — one per
sequence of a target whose passes they share — and a driver thread. Each request is an ordinary
:class:`~power_core.session.Generation` on one of those sessions, with its own transaction,
scheduler, sampler and proposer; the driver only decides *when* its steps run:

1. between passes, new requests join (their session was free) and finished ones leave;
2. every decoding request opens its round (checkpoint, propose: :meth:`Transaction.open_round`);
3. one :meth:`~power_core.runtime.BatchRuntime.decode_batch` decodes all their verify blocks, plus
   prompt chunks of joining requests up to the pass's token budget (round-robin, so a long prompt
   never stalls the others' decoding and no prompt starves);
4. each request accepts, commits and emits from its own rows (:meth:`Transaction.close_round`).

A request's cancel, fault or stop restores only its own transaction and sequence: the other
requests' rounds close as usual. A failure of the shared pass itself restores every round of it.
Whether a request's rows in a shared pass equal its solo rows is the target's numerics: with
``numerics = "exact"`` on llama.cpp's CPU backend they are bit-identical (the batch probe of
:func:`power_core.numerics.batch_probe` checks it), so every output equals its solo run.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from power_core.errors import Cancelled, ConfigError, PowerError, SessionBusy
from power_core.logs import get_logger
from power_core.numerics import BatchProbeReport, batch_probe
from power_core.runtime import BatchItem, ComputeTimed, DecodeResult
from power_core.scheduler import PassLoad
from power_core.session import Generation, Prompt, Result, Session, SessionBatch, in_own_thread
from power_core.transaction import CancelToken, PendingRound, RoundRecord, Transaction

__all__ = ["Engine"]

log = get_logger(__name__)

_END = object()


@attrs.define(eq=False)
class _Active:
    gen: Generation
    txn: Transaction
    events: queue.Queue[Any]
    remaining: np.ndarray  # prompt tokens still to prefill (empty once decoding)
    t0: float
    passes: int = 0
    pass_tokens: int = 0
    peak: int = 0

    @property
    def prefilling(self) -> bool:
        return not self.gen._prefilled


class Engine:
    """Concurrent requests over one target's shared passes. Thread-safe: any thread may
    :meth:`submit`; :meth:`rounds` streams one request's committed rounds to the thread that reads it."""

    def __init__(self, batch: SessionBatch, *, token_budget: int | None = None) -> None:
        self.batch = batch
        self.sessions = batch.sessions
        budget = batch.runtime.token_budget if token_budget is None else token_budget
        # the widest verify block a round opens: the anchor plus K proposals (1 for target-only)
        max_block = max(s.config.draft_max + 1 if s.proposer is not None else 1 for s in self.sessions)
        if budget < len(self.sessions) * max_block:
            raise PowerError(f"a pass budget of {budget} tokens cannot hold {len(self.sessions)} verify blocks of "
                             f"{max_block}")
        self.token_budget = budget
        #: are a sequence's rows in a shared pass its solo rows on this target? (every receipt says)
        # the probe decodes: on a thread that ends with it, so the driver leads the only compute team
        # (see power_core.session.in_own_thread)
        self.probe: BatchProbeReport | None = (in_own_thread(lambda: batch_probe(batch.runtime))
                                                if len(self.sessions) > 1 else None)
        if self.probe is not None:
            log.info("engine.batch_probe", identical=self.probe.identical, reason=self.probe.reason())
        config = self.sessions[0].config
        if self.probe is not None and not self.probe.identical and config.require_identical:
            raise ConfigError("parallel", len(self.sessions), "independent slots on this target",
                              f"require_identical: {self.probe.reason()}")
        self._cv = threading.Condition()
        self._free: collections.deque[Session] = collections.deque(self.sessions)
        self._joining: collections.deque[_Active] = collections.deque()
        self._active: list[_Active] = []
        self._rr = 0  # round-robin start among prefilling requests (and among decoding ones' width turns)
        self._last_prefill = 0  # prompt tokens in the previous pass
        self._closed = False
        self._held = 0  # held(): no pass starts
        # the shared passes' compute clock, bound once (a protocol check costs more than the read)
        runtime = batch.runtime
        self._compute = runtime.compute_seconds if isinstance(runtime, ComputeTimed) else None
        self._thread = threading.Thread(target=self._loop, name="power-engine", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, n: int, config: Any = None, *, token_budget: int | None = None, **open_kwargs: Any) -> Engine:
        """``n`` sequences of one target (:meth:`Session.open_batch`) and their driver."""
        batch = Session.open_batch(n, config, **open_kwargs)
        try:
            return cls(batch, token_budget=token_budget)
        except BaseException:
            batch.close()
            raise

    # -- requests -------------------------------------------------------------------------------------------
    def acquire(self, timeout: float | None = None, *, strategy: str | None = None) -> Session:
        """A free session (blocks until one is free), of ``strategy`` when given (the sequences of an
        engine opened with ``sequences=`` run different strategies). Start a request on it with
        ``session.start(...)`` and run it with :meth:`rounds`, which gives the session back when the
        request ends."""
        if strategy is not None and not any(s.selection.strategy.name == strategy for s in self.sessions):
            have = sorted({s.selection.strategy.name for s in self.sessions})
            raise ConfigError("strategy", strategy, f"one of this engine's strategies ({', '.join(have)})")

        def free() -> Session | None:
            return next((s for s in self._free if strategy is None or s.selection.strategy.name == strategy), None)

        with self._cv:
            if not self._cv.wait_for(lambda: free() is not None or self._closed, timeout):
                raise SessionBusy(f"no free slot{'' if strategy is None else ' of ' + strategy} within {timeout} s")
            if self._closed:
                raise SessionBusy("the engine is closed")
            session = free()
            assert session is not None
            self._free.remove(session)
            return session

    def release(self, session: Session) -> None:
        with self._cv:
            if session not in self._free:
                self._free.append(session)
            self._cv.notify_all()

    def submit(self, prompt: Prompt, *, cancel: CancelToken | None = None, max_tokens: int | None = None,
               stop: Sequence[str] | None = None, sampling: Mapping[str, Any] | None = None,
               logprobs: int | None = None, strategy: str | None = None) -> Generation:
        """Start a request on the next free session (of ``strategy`` when given; waits for one); run
        it with :meth:`rounds` or :meth:`run`."""
        session = self.acquire(strategy=strategy)
        try:
            return session.start(prompt, cancel=cancel, max_tokens=max_tokens, stop=stop, sampling=sampling,
                                 logprobs=logprobs)
        except BaseException:
            self.release(session)
            raise

    def run(self, gen: Generation) -> Result:
        """Run ``gen`` in the shared passes to its end; its tokens, text and receipt."""
        for _ in self.rounds(gen):
            pass
        return gen.result()

    def rounds(self, gen: Generation) -> Generator[RoundRecord, None, None]:
        """Hand ``gen`` (a request on one of this engine's sessions) to the driver and yield its
        committed rounds as they close. Ends as ``gen.rounds()`` does: the receipt is final, a cancel
        raises :class:`Cancelled`, a failure its error; closing the iterator early cancels the request."""
        if gen.session not in self.sessions:
            raise SessionBusy("this request's session does not belong to the engine")
        events: queue.Queue[Any] = queue.Queue()
        try:
            txn = gen._begin_attempt()
        except BaseException:
            self.release(gen.session)
            raise
        active = _Active(gen=gen, txn=txn, events=events, remaining=np.zeros(0, dtype=np.int32),
                         t0=time.perf_counter())
        with self._cv:
            if self._closed:
                self._finish(active, SessionBusy("the engine is closed"))
                raise SessionBusy("the engine is closed")
            self._joining.append(active)
            self._cv.notify_all()
        ended = False
        try:
            while True:
                item = events.get()
                if item is _END:
                    ended = True
                    failure = events.get()
                    if failure is not None:
                        raise failure
                    return
                yield item
        finally:
            if not ended:  # the reader left early: stop the request at the next pass, wait for its receipt
                gen.cancel.cancel()
                while events.get() is not _END:
                    pass

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

    def close(self) -> None:
        """Cancel what runs, stop the driver, close the sessions and the target."""
        with self._cv:
            self._closed = True
            for a in [*self._active, *self._joining]:
                a.gen.cancel.cancel()
            self._cv.notify_all()
        self._thread.join(60)
        self.batch.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> int:
        with self._cv:
            return len(self._active) + len(self._joining)

    # -- the driver -----------------------------------------------------------------------------------------
    def _finish(self, a: _Active, failure: BaseException | None) -> None:
        """End the request's attempt (receipt, session released) and wake its reader."""
        gen = a.gen
        gen._batch = {"shared_passes": a.passes, "peak_concurrent": a.peak,
                      "mean_tokens_per_pass": a.pass_tokens / a.passes if a.passes else 0.0,
                      "n_seq": len(self.sessions), "token_budget": self.token_budget,
                      "rows_identical_to_solo": self.probe.identical if self.probe is not None else True}
        try:
            gen._end_attempt(failure)
        finally:
            self.release(gen.session)
            a.events.put(_END)
            a.events.put(failure)

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: (self._joining or self._active) and not self._held or self._closed)
                if self._closed and not self._joining and not self._active:
                    return
                joining = list(self._joining)
                self._joining.clear()
            for a in joining:  # between passes, in this thread: the target is not decoding now
                try:
                    if not a.gen._prefilled:
                        a.remaining = a.txn.start_prefill(a.gen.prompt, a.gen._take_resident())
                except BaseException as exc:
                    self._finish(a, exc)
                    continue
                with self._cv:
                    self._active.append(a)
            with self._cv:
                active = list(self._active)
            try:
                self._pass(active)
            except BaseException as exc:  # a defect of the driver: fail every request, keep serving
                log.error("engine.pass_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
                for a in active:
                    if a in self._active:
                        self._active.remove(a)
                        self._finish(a, exc)

    def _leave(self, a: _Active, failure: BaseException | None) -> None:
        with self._cv:
            self._active.remove(a)
        self._finish(a, failure)

    def _pass(self, active: list[_Active]) -> None:
        decoding = [a for a in active if not a.prefilling]
        prefilling = [a for a in active if a.prefilling]
        items: list[BatchItem] = []
        rounds: list[tuple[_Active, PendingRound]] = []
        if len(decoding) > 1:  # who chooses its width first rotates, so no request always sees the lightest pass
            turn = self._rr % len(decoding)
            decoding = decoding[turn:] + decoding[:turn]
        for j, a in enumerate(decoding):
            # the pass so far: the blocks opened before this one, at least the anchor of each one after,
            # and the prompt chunks joining it (the cost-aware width weighs the whole pass)
            others = sum(int(i.tokens.shape[0]) for i in items) + (len(decoding) - j - 1)
            load = PassLoad(tokens=others + self._last_prefill, requests=len(decoding) - 1) if len(active) > 1 else None
            c0, t0 = self._clock(a), time.perf_counter()
            try:
                pending = a.txn.open_round(load)
            except BaseException as exc:  # cancelled, or its proposer failed: only this request ends
                self._account(a, c0, time.perf_counter() - t0, 0)
                self._leave(a, exc)
                continue
            self._account(a, c0, time.perf_counter() - t0, 0)
            if pending is None:  # finished (context full)
                self._leave(a, None)
                continue
            if not pending.needs_pass:  # round 0: its verify row came from the prefill
                self._close(a, pending, None, 0.0)
                continue
            rounds.append((a, pending))
            items.append(BatchItem(a.txn.target, pending.block, "all"))
        budget = self.token_budget - sum(int(i.tokens.shape[0]) for i in items)
        chunks: list[tuple[_Active, int]] = []
        if prefilling:
            start = self._rr % len(prefilling)
            self._rr += 1
            for a in prefilling[start:] + prefilling[:start]:
                if a.gen.cancel.cancelled:
                    a.txn.target.reset()
                    self._leave(a, Cancelled("generation cancelled during its prefill; nothing was committed"))
                    continue
                if budget <= 0:
                    break
                n = min(budget, int(a.remaining.shape[0]))
                final = n == a.remaining.shape[0]
                items.append(BatchItem(a.txn.target, a.remaining[:n], "last" if final else "none"))
                chunks.append((a, n))
                budget -= n
        self._last_prefill = sum(n for _, n in chunks)
        if not items:
            return
        t0, before = time.perf_counter(), self._compute() if self._compute is not None else None
        try:
            results = self.batch.runtime.decode_batch(items)
        except BaseException as exc:  # the shared pass failed: every round of it restores
            for a, pending in rounds:
                try:
                    a.txn.abort_round(pending, exc)
                finally:
                    self._leave(a, exc)
            for a, _ in chunks:
                a.txn.target.reset()
                self._leave(a, exc)
            return
        seconds = time.perf_counter() - t0
        after = self._compute() if self._compute is not None else None
        for a, _ in rounds:  # the shared pass's compute is each decoding request's target compute
            if before is None or after is None:
                a.gen._clock.timed = False
            else:
                a.gen._clock.target_s += after - before
        n_tokens = sum(int(i.tokens.shape[0]) for i in items)
        concurrent = len(items)
        for a in [a for a, _ in rounds] + [a for a, _ in chunks]:
            a.passes += 1
            a.pass_tokens += n_tokens
            a.peak = max(a.peak, concurrent)
        for (a, pending), res in zip(rounds, results[: len(rounds)], strict=True):
            self._close(a, pending, res, seconds)
        for (a, n), res in zip(chunks, results[len(rounds):], strict=True):
            try:
                a.txn.observe_prompt(res)
            except BaseException as exc:  # its proposer failed on the prompt: only this request ends
                a.txn.target.reset()
                self._leave(a, exc)
                continue
            a.remaining = a.remaining[n:]
            if a.remaining.shape[0] == 0:
                a.txn.finish_prefill(np.array(res.logits[-1]))  # a copy: the next pass reuses the buffer
                a.gen._prefilled = True
                a.gen._prefill_s = time.perf_counter() - a.t0

    @staticmethod
    def _clock(a: _Active) -> tuple[float | None, float]:
        return a.gen._clock.read()

    def _account(self, a: _Active, c0: tuple[float | None, float], seconds: float, rounds: int) -> None:
        """Charge ``a``'s decode time with ``seconds`` of its own work since the snapshot ``c0``."""
        a.gen._decode_s += seconds
        a.gen._clock.lap(c0, self._clock(a), rounds)

    def _close(self, a: _Active, pending: PendingRound, res: DecodeResult | None, seconds: float) -> None:
        c0, t0 = self._clock(a), time.perf_counter()
        try:
            record = a.txn.close_round(pending, res)
        except BaseException as exc:
            self._account(a, c0, seconds + time.perf_counter() - t0, 0)
            self._leave(a, exc)
            return
        self._account(a, c0, seconds + time.perf_counter() - t0, 1)
        a.events.put(record)
        if a.txn.finished is not None:
            self._leave(a, None)
