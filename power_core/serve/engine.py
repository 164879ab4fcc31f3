"""Slots, admission and one request's decode for ``power serve``.

``--parallel N`` opens N :class:`~power_core.session.Session` objects on the same model (they share
its weights). A request holds one slot from admission to its last round; its decode runs in a worker
thread (the native decode releases the GIL), while the event loop keeps answering others. Requests
beyond N wait in a bounded queue; beyond that they are refused at once (503 with ``Retry-After``).

A request ends early only through its :class:`~power_core.transaction.CancelToken`: the client went
away, its timeout fired, or the server is draining. The token also aborts a decode in flight, so the
slot comes back within one target pass; the request's receipt says ``cancelled`` and why.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from power_core.engine import Engine
from power_core.errors import Cancelled, PowerError
from power_core.logs import get_logger
from power_core.receipt import Receipt
from power_core.session import Session
from power_core.text import TextAssembler
from power_core.transaction import CancelToken, RoundRecord, TokenLogprob

__all__ = ["Job", "Delta", "Outcome", "SlotPool", "Overloaded", "ReceiptStore", "Metrics", "run_job"]

log = get_logger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class Overloaded(Exception):
    """Every slot is busy and the waiting queue is full (or the wait outlasted the request's timeout)."""


@attrs.define(eq=False)
class Job:
    """One admitted request, as the worker thread runs it."""

    prompt: np.ndarray
    max_tokens: int
    stop: tuple[str, ...]
    sampling: dict[str, Any]
    top_logprobs: int | None
    stream: bool
    #: the response id's prefix (``cmpl-``, ``chatcmpl-``); the id names the request's receipt too
    prefix: str = "req-"
    id: str = attrs.field(default=attrs.Factory(lambda self: self.prefix + uuid.uuid4().hex[:24], takes_self=True))
    cancel: CancelToken = attrs.field(factory=CancelToken)
    arrived: float = attrs.field(factory=time.perf_counter)
    #: why the request was cancelled, when it was (``disconnected``, ``timeout``, ``shutdown``)
    cancel_reason: str | None = None

    def stop_now(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.cancel.cancel()


@attrs.frozen
class Delta:
    """Committed text and the logprobs of the tokens committed since the previous delta."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class Outcome:
    """How a request ended: its tokens, text, receipt and, when it failed, the error."""

    tokens: tuple[int, ...]
    text: str
    receipt: Receipt
    logprobs: tuple[TokenLogprob, ...]
    error: BaseException | None = None


class Metrics:
    """Prometheus metrics in the names llama.cpp's server and vLLM share (``power:`` prefix)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.num_drafts = Counter("power:spec_decode_num_drafts", "Rounds that verified at least one proposal",
                                  registry=r)
        self.num_draft_tokens = Counter("power:spec_decode_num_draft_tokens", "Proposal tokens verified",
                                        registry=r)
        self.num_accepted_tokens = Counter("power:spec_decode_num_accepted_tokens", "Proposal tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("power:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafts whose proposal at this position was accepted", ["position"],
                                        registry=r)
        self.requests = Counter("power:request_success", "Finished requests by finish reason "
                                "(stop, length, abort: cancelled, error: failed)", ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("power:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("power:generation_tokens", "Emitted tokens", registry=r)
        self.running = Gauge("power:num_requests_running", "Requests decoding in a slot", registry=r)
        self.waiting = Gauge("power:num_requests_waiting", "Requests waiting for a slot", registry=r)
        self.ttft = Histogram("power:time_to_first_token_seconds", "Arrival to the first committed token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("power:inter_token_latency_seconds", "Time per emitted token after the first "
                             "(a round's time shared by the tokens it emitted)", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("power:e2e_request_latency_seconds", "Arrival to the end of the request",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def round(self, record: RoundRecord) -> None:
        self.generation_tokens.inc(record.emitted)
        if record.proposed:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(record.proposed)
            self.num_accepted_tokens.inc(record.accepted)
            for pos in range(record.accepted):
                self.accepted_per_pos.labels(position=str(pos)).inc()


@attrs.define(eq=False)
class ReceiptStore:
    """The full receipts of the most recent requests, by request id (oldest dropped first)."""

    capacity: int = 256
    _items: collections.OrderedDict[str, dict[str, Any]] = attrs.field(factory=collections.OrderedDict)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def put(self, rid: str, receipt: dict[str, Any]) -> None:
        with self._lock:
            self._items[rid] = receipt
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> dict[str, Any] | None:
        with self._lock:
            return self._items.get(rid)


class SlotPool:
    """N sessions; requests beyond them wait in a bounded FIFO queue. Used from the event loop only."""

    def __init__(self, sessions: Sequence[Session], queue_max: int, metrics: Metrics) -> None:
        self.sessions = tuple(sessions)
        self._free: collections.deque[Session] = collections.deque(self.sessions)
        self._waiters: collections.deque[asyncio.Future[Session]] = collections.deque()
        self.queue_max = queue_max
        self._metrics = metrics

    @property
    def running(self) -> int:
        return len(self.sessions) - len(self._free)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _gauges(self) -> None:
        self._metrics.running.set(self.running)
        self._metrics.waiting.set(self.waiting)

    async def acquire(self, timeout: float | None) -> Session:
        if self._free and not self._waiters:
            session = self._free.popleft()
            self._gauges()
            return session
        if len(self._waiters) >= self.queue_max:
            raise Overloaded(f"all {len(self.sessions)} slots are busy and {self.waiting} requests are waiting "
                             f"(--queue {self.queue_max})")
        fut: asyncio.Future[Session] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._gauges()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # handed a slot just as the wait ended: pass it on
            else:
                fut.cancel()
            if isinstance(exc, TimeoutError):
                raise Overloaded("the request's timeout passed while it waited for a slot") from None
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
            self._gauges()

    def release(self, session: Session) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(session)
                self._gauges()
                return
        self._free.append(session)
        self._gauges()


def run_job(session: Session, job: Job, metrics: Metrics, emit: Callable[[Delta], None] | None,
            engine: Engine | None = None) -> Outcome:
    """Decode ``job`` on ``session`` (in a worker thread; with ``engine``, in its shared passes).
    ``emit`` receives committed text deltas as rounds commit (streaming); the outcome carries the
    final text and the receipt either way."""
    gen = session.start(job.prompt, cancel=job.cancel, max_tokens=job.max_tokens, stop=job.stop,
                        sampling=job.sampling, logprobs=job.top_logprobs)
    tok = session.opened.tokenizer
    assert tok is not None and gen.config is not None
    text = TextAssembler(tok.decode, gen.config.stop) if emit is not None else None
    sent_lp = 0
    last: float | None = None
    error: BaseException | None = None
    try:
        for record in (engine.rounds(gen) if engine is not None else gen.rounds()):
            now = time.perf_counter()
            if last is None:
                metrics.ttft.observe(now - job.arrived)
            elif record.emitted:
                per_token = (now - last) / record.emitted
                for _ in range(record.emitted):
                    metrics.itl.observe(per_token)
            last = now
            metrics.round(record)
            if text is not None and emit is not None:
                text.sync(gen.tokens)
                delta = text.take(final=gen.finished)
                lps = tuple(gen.txn.logprobs[sent_lp:]) if gen.txn is not None else ()
                sent_lp += len(lps)
                if delta or lps:
                    emit(Delta(delta, lps))
    except Cancelled as exc:
        error = exc
    except PowerError as exc:
        error = exc
        log.warning("serve.request_failed", id=job.id, error=f"{exc.code}: {exc}")
    except Exception as exc:  # a defect: the client gets a 500 without a traceback, the log gets it
        error = exc
        log.error("serve.request_crashed", id=job.id, exc_info=True)
    if text is not None and emit is not None:
        text.sync(gen.tokens)
        delta = text.take(final=True)
        lps = tuple(gen.txn.logprobs[sent_lp:]) if gen.txn is not None else ()
        if delta or lps:
            emit(Delta(delta, lps))
    receipt = gen.receipt
    assert receipt is not None
    metrics.e2e.observe(time.perf_counter() - job.arrived)
    reason = {"completed": None, "cancelled": "abort"}.get(receipt.status, "error")
    if reason is None:
        reason = "stop" if receipt.finish_reason == "stop" else "length"
    metrics.requests.labels(finished_reason=reason).inc()
    return Outcome(tokens=gen.tokens, text=gen.text() or "", receipt=receipt, logprobs=gen.logprobs, error=error)
