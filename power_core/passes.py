"""The shared passes: the driver thread that runs one target pass at a time for every request on an
engine's sequences (continuous batching). Its interface to a request (:class:`Request`, :class:`Commit`,
:class:`Charged`) is the engine's solo driver's too.

The sequences are one :class:`~power_core.runtime.BatchRuntime`'s. Between passes new requests join
and finished ones leave; each decoding request opens its round (checkpoint, propose:
:meth:`Transaction.begin_round`, :meth:`Transaction.offer`), the requests whose proposers share a
:class:`~power_core.runtime.ProposalBatch` are asked together, one
:meth:`~power_core.runtime.BatchRuntime.decode_batch` decodes all their verify blocks plus prompt
chunks of joining requests up to the pass's token budget (round-robin, so a long prompt never stalls
the others and no prompt starves), and each request accepts from its own rows
(:meth:`Transaction.read_round`; every round of the pass reads before any commits or restores, since either
may decode its sequence alone over the pass's buffers), then commits and emits
(:meth:`Transaction.close_round`). A pass that would hold one request's round and nothing else is that
request's solo step on its own sequence (:meth:`SharedPasses._alone`). Whether a request's rows in a
shared pass equal its solo rows is the target's numerics: with ``numerics = "exact"`` on llama.cpp's
CPU backend they are bit-identical (:func:`power_core.numerics.batch_probe` checks it at start), so
every output equals its solo run.

A request's cancel, fault or stop restores only its own round; a failure of the shared pass itself
restores every round of it; a defect of the driver fails the requests of its pass and it serves on.
Should the driver thread die all the same, its engine (:class:`Owner`) refuses every request from then on.

Each committed round reaches the reader as a :class:`Commit`, a snapshot taken on the driver's
thread and handed to the reader's ``deliver`` callable (a queue's ``put``, or ``power serve``'s post to its
event loop), so a reader in another thread never reads the request while the driver changes it. Every
stretch of a request's own work on the driver is charged to it one way (:class:`Charged`), whichever
way the stretch ends; its decode time holds the whole of the passes its rounds closed in.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from time import perf_counter
from typing import Any, Protocol, TypeVar

import attrs
import numpy as np

from power_core.errors import Cancelled, PowerError, RuntimeFault
from power_core.logs import get_logger
from power_core.numerics import BatchProbeReport
from power_core.receipt import Receipt
from power_core.rounds import CancelToken, PendingRound, RoundRecord, TokenLogprob
from power_core.runtime import BatchItem, BatchRuntime, DecodeResult, Proposal
from power_core.scheduler import PassLoad
from power_core.transaction import Transaction

__all__ = ["Charged", "Commit", "Deliver", "Ended", "Owner", "Request", "SharedPasses", "commit_of"]

log = get_logger(__name__)

ResultT = TypeVar("ResultT", covariant=True)


class Request(Protocol[ResultT]):
    """What a driver needs of one request (a :class:`~power_core.generation.Generation`): the small
    public interface it runs an attempt through."""

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

    def charge(self, before: tuple[float | None, float], after: tuple[float | None, float], seconds: float,
               rounds: int) -> None: ...

    def charge_shared_pass(self, compute: float | None) -> None: ...

    def charge_wait(self, seconds: float) -> None: ...

    def end(self, failure: BaseException | None, batch: Mapping[str, Any] | None = None) -> None: ...

    def report(self) -> Receipt | None: ...

    def result(self) -> ResultT: ...


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


@attrs.frozen
class Ended:
    """The request's attempt has ended (its sequence given back): ``failure`` is how, ``None`` when it
    finished. The last thing the driver hands its reader."""

    failure: BaseException | None


#: where the driver hands a request's commits and then its :class:`Ended`, on the driver's thread: it must
#: neither block nor raise (a ``queue.Queue``'s ``put``; ``power serve`` posts them to its event loop)
Deliver = Callable[[Commit | Ended], None]


def commit_of(gen: Request[Any], record: RoundRecord) -> Commit:
    """The request as it stands right after ``record`` committed (taken on the driver's thread)."""
    txn = gen.txn
    assert txn is not None
    n = len(txn.emitted)
    lps = tuple(txn.logprobs[n - record.emitted:]) if txn.logprobs else ()
    return Commit(record=record, tokens=tuple(txn.emitted[n - record.emitted:]), n_tokens=n,
                  finished=txn.finished is not None, logprobs=lps)


class Charged:
    """A stretch of a request's own work on the thread that drives it, charged to it
    (:meth:`Request.charge`) when the stretch ends, whichever way: the seconds since it began plus
    ``extra`` (the shared pass that decoded the rows a round closes from), the compute its clocks ran
    meanwhile, and the ``rounds`` it committed (set by the stretch once they have); in a shared pass
    the seconds also join the request's tally there (``into``: :attr:`_Active.charged`). Used on the
    hot path, four times per request and shared pass (once for a request alone): slots, one clock read
    at each end."""

    __slots__ = ("_before", "_gen", "_into", "_t0", "extra", "rounds")

    def __init__(self, gen: Request[Any], extra: float = 0.0, into: _Active | None = None) -> None:
        self._gen = gen
        self._into = into
        self.extra = extra
        self.rounds = 0
        self._before: tuple[float | None, float] = (None, 0.0)
        self._t0 = 0.0

    def __enter__(self) -> Charged:
        self._t0 = perf_counter()  # (the clock reads at both ends are the request's work too)
        self._before = self._gen.clock()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        after = self._gen.clock()
        seconds = self.extra + perf_counter() - self._t0
        self._gen.charge(self._before, after, seconds, self.rounds)
        if self._into is not None:
            self._into.charged += seconds


class Owner(Protocol):
    """What the shared driver needs of its engine (:class:`~power_core.engine.Engine`)."""

    def refusal(self) -> PowerError | None:
        """Why a request may not join now (the engine failed or closed), else ``None``."""
        ...

    def end_attempt(self, gen: Request[Any], failure: BaseException | None, batch: Mapping[str, Any]) -> None:
        """End ``gen``'s attempt (on the driver's thread) and give its sequence back."""
        ...

    def driver_failed(self, exc: BaseException) -> None:
        """The driver thread is dying of ``exc`` (called under the lock): refuse every request from now on."""
        ...

    def driver_exited(self) -> None:
        """The driver thread has ended (for whatever reason)."""
        ...


@attrs.define(eq=False)
class _Active:
    """A request the shared driver runs."""

    gen: Request[Any]
    deliver: Deliver
    remaining: np.ndarray  # prompt tokens still to prefill (empty once decoding)
    t0: float
    #: its reader wants the end only (:meth:`Engine.run`): rounds are not handed to its thread one by one
    quiet: bool = False
    #: its round opened in the pass now running and not yet closed (restored when the pass fails)
    pending: PendingRound | None = None
    passes: int = 0
    pass_tokens: int = 0
    peak: int = 0
    #: seconds its stretches charged it in the pass now running (:meth:`SharedPasses._close` charges it the rest)
    charged: float = 0.0


class SharedPasses:
    """The driver of one engine's shared passes: a thread (``power-engine``) that runs one target pass
    at a time for every request handed to it (:meth:`enter`). Its state is guarded by its engine's
    lock ``cv``."""

    def __init__(self, runtime: BatchRuntime, token_budget: int, cv: threading.Condition, owner: Owner, *,
                 n_seq: int, probe: BatchProbeReport | None) -> None:
        self.runtime = runtime
        self.token_budget = token_budget
        self._cv = cv
        self._owner = owner
        self._n_seq = n_seq
        self._probe = probe
        self._joining: collections.deque[_Active] = collections.deque()
        self._active: list[_Active] = []
        self._rr = 0  # round-robin start among prefilling requests (and among decoding ones' width turns)
        self._t_pass = 0.0  # when the pass now running began (its rounds' decode time counts from it)
        self._last_prefill = 0  # prompt tokens in the previous pass
        self._held = 0  # held: no pass starts
        self._stopping = False  # the engine closed: end once no request is left
        #: the driver thread has ended
        self.done = False
        # the shared passes' compute clock (BatchRuntime.compute_seconds), bound once
        self._compute = runtime.compute_seconds
        self._thread = threading.Thread(target=self._loop, name="power-engine", daemon=True)
        self._thread.start()

    # -- the engine's side (under its lock unless said otherwise) --------------------------------------------
    @property
    def running(self) -> int:
        """Requests handed to the driver: joining or in its passes."""
        return len(self._active) + len(self._joining)

    def enter(self, gen: Request[Any], quiet: bool, deliver: Deliver) -> None:
        """Hand ``gen`` (begun) to the driver: it joins at the next pass boundary, and the driver hands
        ``deliver`` its :class:`Commit` values as its rounds commit (none when ``quiet``), then one
        :class:`Ended`. When it may not join (the engine failed or closed) its attempt ends at once, with
        the engine's refusal as the :class:`Ended`'s failure. Not under the lock."""
        active = _Active(gen=gen, deliver=deliver, remaining=np.zeros(0, dtype=np.int32),
                         t0=time.perf_counter(), quiet=quiet)
        with self._cv:
            refused = self._owner.refusal()
            if refused is None:
                self._joining.append(active)
                self._cv.notify_all()
        if refused is not None:
            self._finish(active, refused)

    def hold(self, n: int) -> None:
        """``+1``: no pass starts until the matching ``-1`` (the pass in flight ends)."""
        self._held += n
        if n < 0:
            self._cv.notify_all()

    def stop(self) -> None:
        """The engine closes: cancel every request the driver holds; the thread ends once none is left."""
        self._stopping = True
        for a in [*self._active, *self._joining]:
            a.gen.cancel.cancel()
        self._cv.notify_all()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end (:attr:`done`). Not under the lock."""
        self._thread.join(timeout)

    # -- the driver thread ------------------------------------------------------------------------------------
    def _finish(self, a: _Active, failure: BaseException | None) -> None:
        """End the request's attempt (its sequence released) and hand its reader the :class:`Ended`; the
        reader makes its receipt. Never raises: a request whose end fails gets that error, and the driver
        serves on."""
        try:
            batch = {"shared_passes": a.passes, "peak_concurrent": a.peak,
                     "mean_tokens_per_pass": a.pass_tokens / a.passes if a.passes else 0.0,
                     "n_seq": self._n_seq, "token_budget": self.token_budget,
                     "rows_identical_to_solo": self._probe.identical if self._probe is not None else True}
            self._owner.end_attempt(a.gen, failure, batch)
        except BaseException as exc:  # noqa: BLE001 - its end failed: that is how it ends
            log.error("engine.end_failed", error=f"{type(exc).__name__}: {exc}", exc_info=True)
            failure = exc
        finally:
            a.deliver(Ended(failure))

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: (self._joining or self._active) and not self._held or self._stopping)
                    if self._stopping and not self._joining and not self._active:
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
            self._die(exc)
        finally:
            with self._cv:
                self.done = True
            self._owner.driver_exited()

    def _die(self, exc: BaseException) -> None:
        """The driver thread is dying: its engine refuses every request from now on, and the requests
        the driver held end with the engine's refusal (none waits for a pass that never comes)."""
        log.critical("engine.driver_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        with self._cv:
            self._owner.driver_failed(exc)
            stranded = [*self._active, *self._joining]
            self._active.clear()
            self._joining.clear()
            self._cv.notify_all()
        for a in stranded:
            self._finish(a, self._restore(a, self._owner.refusal() or exc))

    def _leave(self, a: _Active, failure: BaseException | None) -> None:
        with self._cv:
            self._active.remove(a)
        self._finish(a, failure)

    def _pass(self, active: list[_Active]) -> None:
        if len(active) == 1 and active[0].gen.prefilled:
            self._alone(active[0])
            return
        self._t_pass = time.perf_counter()
        decoding = [a for a in active if a.gen.prefilled]
        prefilling = [a for a in active if not a.gen.prefilled]
        items: list[BatchItem] = []
        queued = 0  # tokens in items
        rounds: list[tuple[_Active, PendingRound]] = []
        if len(decoding) > 1:  # who chooses its width first rotates, so no request always sees the lightest pass
            turn = self._rr % len(decoding)
            decoding = decoding[turn:] + decoding[:turn]
        opened: list[tuple[_Active, PendingRound]] = []
        for a in decoding:
            txn = a.gen.txn
            assert txn is not None
            a.charged = 0.0
            try:
                with Charged(a.gen, into=a):
                    pending = txn.begin_round()
            except BaseException as exc:  # cancelled, or its checkpoint failed: only this request ends
                self._leave(a, exc)
                continue
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
            others = queued + (len(opened) - j - 1)
            load = PassLoad(tokens=others + self._last_prefill, requests=len(opened) - 1) if len(active) > 1 else None
            try:
                with Charged(a.gen, into=a):
                    txn.offer(pending, given.get(id(pending)), load)
            except BaseException as exc:  # cancelled, or its proposer failed: only this request ends
                a.pending = None  # (offer restored the round)
                self._leave(a, exc)
                continue
            if not pending.needs_pass:  # round 0: its verify row came from the prefill
                self._close(a, pending, None, 0.0)
                continue
            rounds.append((a, pending))
            items.append(BatchItem(txn.target, pending.block, "all"))
            queued += int(pending.block.shape[0])
        budget = self.token_budget - queued
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
        t0, before = time.perf_counter(), self._compute()
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
        seconds, compute = time.perf_counter() - t0, self._compute() - before
        for a, _ in rounds:  # the shared pass's compute is each decoding request's target compute
            a.gen.charge_shared_pass(compute)
        n_tokens = queued + self._last_prefill
        concurrent = len(items)
        for a in [a for a, _ in rounds] + [a for a, _ in chunks]:
            a.passes += 1
            a.pass_tokens += n_tokens
            a.peak = max(a.peak, concurrent)
        # every round reads its rows, and every prompt chunk its own, before any round commits or restores: either
        # may decode its sequence alone on the pass's context (a replay), over the buffers the rows are views of
        unread: list[tuple[_Active, BaseException]] = []
        read = [(a, pending) for (a, pending), res in zip(rounds, results[: len(rounds)], strict=True)
                if self._read(a, pending, res, unread)]
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
        for a, why in unread:  # its read failed: its round restores, and it ends
            self._abort(a, why)
        for a, pending in read:
            self._close(a, pending, None, seconds)

    def _alone(self, a: _Active) -> None:
        """The passes of a request that decodes alone: each round a solo step (:meth:`Transaction.step
        <power_core.transaction.Transaction.step>`: its sequence decodes its own block, the pass a shared pass of
        that one block would be), in one stretch, without the batch's machinery around it (23-34 µs less host time
        a round, docs/evidence/bench_drafts/alone-2026-12-07); and round after round, without the driver's loop
        between them, while it stays alone: no request joins, no hold, no stop (each read at every pass
        boundary, where the loop reads them; docs/evidence/bench_drafts/lean-end-2026-12-07). Passes of two or
        more requests, or of a prompt, go through the :class:`~power_core.runtime.BatchRuntime`."""
        txn = a.gen.txn
        assert txn is not None
        self._last_prefill = 0
        while True:
            passes = txn.target_passes
            try:
                with Charged(a.gen) as charged:
                    record = txn.step()
                    charged.rounds = int(record is not None)
            except BaseException as exc:  # cancelled, or its round failed (and restored): only this request ends
                self._leave(a, exc)
                return
            if record is None:  # finished (context full)
                self._leave(a, None)
                return
            if txn.target_passes > passes:  # (round 0's verify row came from the prefill: no pass of its own)
                a.passes += 1
                a.pass_tokens += record.shape
                a.peak = max(a.peak, 1)
            self._committed(a, record)
            if txn.finished is not None or self._joining or self._held or self._stopping:
                return

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
            try:
                with contextlib.ExitStack() as charges:  # the shared draft is each member's own work
                    for a, _ in members:
                        charges.enter_context(Charged(a.gen, into=a))
                    got = batch.propose_many(asks)
                    if not isinstance(got, list) or len(got) != len(members):
                        raise TypeError(f"propose_many returned {type(got).__name__} for {len(members)} asks; "
                                        "expected a list of one Proposal per ask")
            except Exception as exc:  # noqa: BLE001 - the shared draft failed: each of its requests drafts alone
                # (a batch leaves its proposers as they were when it raises), so a fault of one request's
                # draft ends that request only, and the others propose what they would have
                log.warning("engine.draft_batch_failed", batch=type(batch).__name__, requests=len(members),
                            error=f"{type(exc).__name__}: {exc}")
                continue
            except BaseException as exc:  # interrupted: every round of it restores
                for a, pending in members:
                    failed.add(id(pending))
                    self._abort(a, exc)
                continue
            for (_, pending), proposal in zip(members, got, strict=True):
                given[id(pending)] = proposal
        return given, failed

    def _read(self, a: _Active, pending: PendingRound, res: DecodeResult,
              unread: list[tuple[_Active, BaseException]]) -> bool:
        """The round reads its rows of the shared pass (:meth:`Transaction.read_round`); False when that
        failed: the round stays open (``a.pending``) and joins ``unread``, to restore once every round of
        the pass has read."""
        txn = a.gen.txn
        assert txn is not None
        try:
            with Charged(a.gen, into=a):
                txn.read_round(pending, res, restore=False)
        except BaseException as exc:
            unread.append((a, exc))
            return False
        return True

    def _close(self, a: _Active, pending: PendingRound, res: DecodeResult | None, seconds: float) -> None:
        txn = a.gen.txn
        assert txn is not None
        a.pending = None  # close_round commits the round, or restores it
        try:
            with Charged(a.gen, extra=seconds, into=a) as charged:
                record = txn.close_round(pending, res)
                charged.rounds = 1
        except BaseException as exc:
            self._leave(a, exc)
            return
        # its round took the pass so far: what no stretch of its own charged (the driver's work between them,
        # the other requests' stretches before this close) is its decode time too, host time
        if (wait := time.perf_counter() - self._t_pass - a.charged) > 0.0:
            a.gen.charge_wait(wait)
        self._committed(a, record)

    def _committed(self, a: _Active, record: RoundRecord) -> None:
        """The request's round committed (``record``): its reader gets the commit (unless it waits for the end
        only), and a request that finished with it leaves."""
        if not a.quiet:
            a.deliver(commit_of(a.gen, record))
        assert a.gen.txn is not None
        if a.gen.txn.finished is not None:
            self._leave(a, None)
