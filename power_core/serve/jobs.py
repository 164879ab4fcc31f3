"""One request of ``power serve`` from its admission to its :class:`Outcome`: :class:`Job` in, the request's
commits to its answer as its rounds close, :class:`Outcome` out (and the server's metrics of it).

Admission is the engine's (:meth:`power_core.engine.Engine.reserve`): a request holds one of its
sequences from admission to its last round. On shared passes no thread waits for a request
(:class:`Following`): the driver hands each :class:`~power_core.passes.Commit` straight to the event loop
(:meth:`Engine.feed <power_core.engine.Engine.feed>`), and at the end a worker makes its receipt
(:func:`finish_job`, once per request). A sequence that decodes alone has a worker read its rounds
(:func:`run_job`), which the process's compute thread runs (:mod:`power_core.compute`). Either way the
answer reads commits, never the request while the driver changes it.

A request ends early only through its :class:`~power_core.transaction.CancelToken`: the client went
away, its timeout fired, or the server is draining. The token also aborts a decode in flight, so the
slot comes back within one target pass; the request's receipt says ``cancelled`` and why.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import functools
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from power_core.constraint import Constraint
from power_core.engine import Engine
from power_core.errors import Cancelled, PowerError
from power_core.generation import Generation
from power_core.logs import get_logger
from power_core.memory import PromptCache
from power_core.passes import Commit, Ended
from power_core.prediction import Prediction
from power_core.receipt import Receipt
from power_core.session import Session
from power_core.transaction import CancelToken, RoundRecord, TokenLogprob

__all__ = ["Job", "Delta", "Outcome", "ReceiptStore", "Metrics", "Following", "run_job", "finish_job", "StoreReport",
           "DurableStore", "StoreHolder", "SOURCE_LABELS_MAX"]

log = get_logger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@attrs.define(eq=False)
class Job:
    """One admitted request: what its decode needs, and how it ends early."""

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
    #: decode without the proposer (the audit switched the server to target-only)
    target_only: bool = False
    #: whom the request runs for (config ``tenant``): the API key, else the OpenAI ``user`` field
    tenant: str = ""
    #: what the output must match (``response_format``, ``grammar``, ``json_schema``, tools), compiled once
    #: when the request was checked and used by its decode as it is (the audit compiles its ``spec`` afresh)
    constraint: Constraint | None = None
    #: the strategy the request asked for (its ``power.strategy``; ``None``: the server's default)
    strategy: str | None = None
    #: the request's own K (its ``spec_draft_max``; ``None``: its strategy's)
    draft_max: int | None = None
    #: what the answer is expected to repeat (OpenAI's ``prediction``, tokenized), or ``None``
    prediction: Prediction | None = None

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
    #: its text, cut at a stop string (a whole answer's; a stream's went out chunk by chunk: empty here)
    text: str
    receipt: Receipt
    logprobs: tuple[TokenLogprob, ...]
    error: BaseException | None = None
    #: the receipt's size (what :class:`ReceiptStore` budgets): its canonical JSON's, which its digest (in every
    #: response) hashes, so no second rendering sits between a request's end and its answer
    receipt_bytes: int = 0


#: distinct proposal sources (``Proposal.source``, text a proposer chooses) ``/metrics`` labels by name;
#: later ones, and any that is not a short plain name, are counted under ``other``
SOURCE_LABELS_MAX = 16
_SOURCE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,32}")


@runtime_checkable
class StoreReport(Protocol):
    """What a proposer's durable store says of itself (power-suffix's ``StoreStats`` has this shape):
    counters since the process started, read when ``/metrics`` is scraped."""

    @property
    def path(self) -> str: ...
    @property
    def open(self) -> bool: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def bytes(self) -> int: ...
    @property
    def records(self) -> int: ...
    @property
    def appended(self) -> int: ...
    @property
    def synced(self) -> int: ...
    @property
    def syncs(self) -> int: ...
    @property
    def compactions(self) -> int: ...
    @property
    def last_sync_age_s(self) -> float | None: ...
    @property
    def corrupt_moved_aside(self) -> int: ...
    @property
    def torn_bytes_cut(self) -> int: ...
    @property
    def stale_tmp_removed(self) -> int: ...
    @property
    def write_errors(self) -> int: ...


@runtime_checkable
class DurableStore(Protocol):
    """A memory that may keep a durable store (power-suffix's ``SuffixMemory``): ``None``, it has none."""

    def store_stats(self) -> StoreReport | None: ...


@runtime_checkable
class StoreHolder(Protocol):
    """A proposer with a memory that outlives requests (power-suffix's ``SuffixProposer``): the seam
    through which ``/metrics`` exports its store's counters without naming the plugin."""

    @property
    def memory(self) -> object | None: ...


def proposer_stores(proposers: Iterable[object]) -> list[StoreReport]:
    """The durable stores behind ``proposers`` (each memory once: sessions share one), as they stand."""
    seen: set[int] = set()
    reports: list[StoreReport] = []
    for proposer in proposers:
        memory = proposer.memory if isinstance(proposer, StoreHolder) else None
        if not isinstance(memory, DurableStore) or id(memory) in seen:
            continue
        seen.add(id(memory))
        report = memory.store_stats()
        if isinstance(report, StoreReport):  # (None: the memory has no store)
            reports.append(report)
    return reports


#: the store gauges: the metric's name after ``power:proposer_store_``, its value in a report, its help
_STORE_GAUGES: tuple[tuple[str, Callable[[StoreReport], float | None], str], ...] = (
    ("healthy", lambda r: r.healthy, "1 while the store is appended to without failing writes, else 0"),
    ("open", lambda r: r.open, "1 while the store is open for appending"),
    ("bytes", lambda r: r.bytes, "Bytes of the store's file"),
    ("records", lambda r: r.records, "Whole records in the store"),
    ("appended", lambda r: r.appended, "Records this process appended"),
    ("synced", lambda r: r.synced, "Records this process appended and fsynced"),
    ("syncs", lambda r: r.syncs, "fsyncs of the store"),
    ("compactions", lambda r: r.compactions, "Compactions of the store's log to a snapshot"),
    ("last_sync_age_seconds", lambda r: r.last_sync_age_s, "Seconds since the store's last fsync (absent: none "
     "yet)"),
    ("corrupt_moved_aside", lambda r: r.corrupt_moved_aside, "Damaged stores moved aside at startup (the memory "
     "started empty)"),
    ("torn_bytes_cut", lambda r: r.torn_bytes_cut, "Bytes of torn tail cut from the store at startup"),
    ("stale_tmp_removed", lambda r: r.stale_tmp_removed, "Stale temporary files removed at startup"),
    ("write_errors", lambda r: r.write_errors, "Failed writes and fsyncs of the store"),
)


_T = TypeVar("_T")


class RoundHistogram(Histogram):
    """A histogram that takes a request's rounds at once (:meth:`observe_rounds`): a round's tokens share one
    latency, and its rounds are summed first, so a request costs one increment per bucket it touches and one of
    the sum, where a round's own observation cost two a round (a 192-round request's end spent about 0.3 ms in
    them)."""

    def observe_rounds(self, rounds: Iterable[tuple[float, int]]) -> None:
        """For each ``(amount, n)``, ``n`` observations of ``amount``."""
        self._raise_if_not_observable()
        bounds = self._upper_bounds
        counts: dict[int, int] = {}
        total = 0.0
        for amount, n in rounds:
            total += amount * n
            i = bisect.bisect_left(bounds, amount)  # the first bound >= amount: observe's bucket
            counts[i] = counts.get(i, 0) + n
        if counts:
            self._sum.inc(total)
        for i, n in counts.items():
            self._buckets[i].inc(n)


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
        self._positions: dict[int, Counter] = {}
        self.accepted_by_source = Counter("power:spec_decode_num_accepted_tokens_by_source",
                                          "Proposal tokens accepted, by the proposal's source (Proposal.source, e.g. "
                                          "suffix's request, shared, corpus)", ["source"], registry=r)
        self.draft_tokens_by_source = Counter("power:spec_decode_num_draft_tokens_by_source",
                                              "Proposal tokens verified, by the proposal's source", ["source"],
                                              registry=r)
        self.requests = Counter("power:request_success", "Finished requests by finish reason "
                                "(stop, length, abort: cancelled, error: failed)", ["finished_reason"], registry=r)
        self.by_strategy = Counter("power:requests_by_strategy", "Finished requests by the strategy that ran them "
                                   "(power serve --mode a,b,c: each request's power.strategy)", ["strategy"], registry=r)
        self.prompt_tokens = Counter("power:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("power:generation_tokens", "Emitted tokens", registry=r)
        self.running = Gauge("power:num_requests_running", "Requests decoding in a slot", registry=r)
        self.waiting = Gauge("power:num_requests_waiting", "Requests waiting for a slot", registry=r)
        self.ttft = Histogram("power:time_to_first_token_seconds", "Arrival to the first committed token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = RoundHistogram("power:inter_token_latency_seconds", "Time per emitted token after the first "
                             "(a round's time shared by the tokens it emitted)", buckets=_LATENCY_BUCKETS, registry=r)
        self.observer_faults = Counter("power:observer_faults", "Observer hooks that raised (logged; the "
                                       "requests themselves were unaffected)", registry=r)
        self.audit_checked = Counter("power:audit_checked", "Completed requests re-decoded target-only by the "
                                     "audit (--audit-rate)", registry=r)
        self.audit_mismatch = Counter("power:audit_mismatch", "Audited requests whose output differed from their "
                                      "target-only re-decode", registry=r)
        self.audit_skipped = Counter("power:audit_skipped", "Audits skipped because too many waited", registry=r)
        self.e2e = Histogram("power:e2e_request_latency_seconds", "Arrival to the end of the request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        # prompt reuse: a request's prefix kept in its sequence or restored from the prompt cache
        self.prompt_requests = Counter("power:prompt_cache_requests", "Requests that prefilled their prompt "
                                       "(the hit rate's denominator)", registry=r)
        self.prompt_hits = Counter("power:prompt_cache_hits", "Requests that reused a prefix of their prompt "
                                   "(held by their sequence or restored from the prompt cache)", registry=r)
        self.prompt_reused = Counter("power:prompt_tokens_reused", "Prompt tokens not prefilled again "
                                     "(receipts' prompt_reused)", registry=r)
        self.prompt_hit_rate = Gauge("power:prompt_cache_hit_rate", "prompt_cache_hits / prompt_cache_requests",
                                     registry=r)
        self.cache_bytes = Gauge("power:prompt_cache_bytes", "Bytes of saved target states in the prompt cache "
                                 "(--cache-ram)", registry=r)
        self.cache_budget = Gauge("power:prompt_cache_budget_bytes", "The prompt cache's budget (--cache-ram; "
                                  "0: off)", registry=r)
        self.cache_entries = Gauge("power:prompt_cache_entries", "Saved target states in the prompt cache",
                                   registry=r)
        self.cache_restores = Gauge("power:prompt_cache_restores", "Saved states restored into a sequence "
                                    "(since the cache was made)", registry=r)
        self.memory = Gauge("power:memory_bytes", "Bytes the model's llama.cpp contexts hold (at startup): the "
                            "target's and each draft's, as weights, context (KV cells, recurrent states) and "
                            "compute buffers", ["context", "part"], registry=r)
        self._prompt_lock = threading.Lock()
        self._prompts = [0, 0]  # requests, hits
        self.cache_evictions = Gauge("power:prompt_cache_evictions", "Saved states evicted for the budget "
                                     "(since the cache was made)", registry=r)
        self._sources: set[str] = set()
        self._sources_lock = threading.Lock()
        self.receipts_bytes = Gauge("power:receipts_bytes", "Bytes (canonical JSON) of the receipts kept for "
                                    "GET /v1/receipts/{id}", registry=r)
        self.receipts_kept = Gauge("power:receipts_kept", "Receipts kept for GET /v1/receipts/{id}", registry=r)
        self.store = {name: Gauge(f"power:proposer_store_{name}", text + " (a proposer memory's durable store, "
                                  "e.g. --suffix-store)", ["store"], registry=r)
                      for name, _, text in _STORE_GAUGES}

    def set_memory(self, memory: Mapping[str, Any]) -> None:
        """``TargetCapabilities.memory``'s answer as gauges: ``context`` is ``target`` or ``draft:<kind>``."""
        contexts = {"target": memory.get("target", {}),
                    **{f"draft:{k}": v for k, v in memory.get("drafts", {}).items()}}
        for name, parts in contexts.items():
            for part, n in parts.items():
                self.memory.labels(context=name, part=part).set(n)

    def prompt(self, receipt: Receipt) -> None:
        """A request ended: whether and how much of its prompt was reused."""
        if receipt.status == "failed" and not receipt.rounds:
            return  # it never prefilled
        with self._prompt_lock:  # (workers end requests concurrently)
            self._prompts[0] += 1
            self._prompts[1] += bool(receipt.prompt_reused)
            self.prompt_hit_rate.set(self._prompts[1] / self._prompts[0])
        self.prompt_requests.inc()
        if receipt.prompt_reused:
            self.prompt_hits.inc()
            self.prompt_reused.inc(receipt.prompt_reused)

    def cache(self, cache: PromptCache | None) -> None:
        """The prompt cache's gauges, as it stands now (read when ``/metrics`` is scraped)."""
        if cache is None:
            return
        st = cache.stats()
        self.cache_bytes.set(st.bytes)
        self.cache_budget.set(st.budget_bytes)
        self.cache_entries.set(st.entries)
        self.cache_restores.set(st.restores)
        self.cache_evictions.set(st.evictions)

    def receipts(self, store: ReceiptStore) -> None:
        """The receipt store's gauges, as it stands now (read when ``/metrics`` is scraped)."""
        kept, nbytes = store.usage()
        self.receipts_kept.set(kept)
        self.receipts_bytes.set(nbytes)

    def stores(self, reports: Iterable[StoreReport]) -> None:
        """The proposer stores' gauges (:func:`proposer_stores`), labelled by the store's path."""
        for report in reports:
            for name, read, _ in _STORE_GAUGES:
                value = read(report)
                gauge = self.store[name]
                if value is None:  # (no fsync yet)
                    try:
                        gauge.remove(report.path)
                    except KeyError:
                        pass
                    continue
                gauge.labels(store=report.path).set(float(value))

    def source(self, source: str) -> str:
        """``source``'s label: itself while fewer than :data:`SOURCE_LABELS_MAX` distinct sources have
        been labelled and it is a short plain name, else ``other`` (a proposer chooses the text)."""
        with self._sources_lock:
            if source in self._sources:
                return source
            if len(self._sources) < SOURCE_LABELS_MAX and _SOURCE_NAME.fullmatch(source):
                self._sources.add(source)
                return source
        return "other"

    def _per_pos(self, pos: int) -> Counter:
        """The accepted-at-position counter of ``pos`` (its child looked up once: ``labels`` takes a lock)."""
        child = self._positions.get(pos)
        if child is None:
            child = self._positions[pos] = self.accepted_per_pos.labels(position=str(pos))
        return child

    def rounds(self, records: Sequence[RoundRecord]) -> None:
        """A request's rounds, summed first: one increment per counter and label (a label lookup and a
        counter's lock cost microseconds, and the request's end waits for this)."""
        emitted = drafts = proposed = accepted = 0
        runs: dict[int, int] = {}  # drafts by their accepted count: position p was accepted in those above p
        by_source: dict[str, list[int]] = {}
        for record in records:
            emitted += record.emitted
            if record.proposed:
                drafts += 1
                proposed += record.proposed
                accepted += record.accepted
                if record.accepted:
                    runs[record.accepted] = runs.get(record.accepted, 0) + 1
                if record.source is not None:
                    counts = by_source.setdefault(record.source, [0, 0])
                    counts[0] += record.proposed
                    counts[1] += record.accepted
        self.generation_tokens.inc(emitted)
        if drafts:
            self.num_drafts.inc(drafts)
            self.num_draft_tokens.inc(proposed)
            self.num_accepted_tokens.inc(accepted)
        above = sum(runs.values())  # drafts that accepted more than pos
        for pos in range(max(runs, default=0)):
            self._per_pos(pos).inc(above)
            above -= runs.get(pos + 1, 0)
        for name, (p, a) in by_source.items():
            source = self.source(name)
            self.draft_tokens_by_source.labels(source=source).inc(p)
            self.accepted_by_source.labels(source=source).inc(a)


@attrs.define(eq=False)
class ReceiptStore:
    """The full receipts of the most recent requests, by request id: an envelope per request whose
    ``receipt`` is the :class:`~power_core.receipt.Receipt` (rendered when asked for). At most
    ``capacity`` of them and ``budget_bytes`` of their JSON (canonical: what the digest hashes), the oldest
    dropped first; a receipt larger than the whole budget is not kept, and :meth:`too_large` says so for it (the
    last ``capacity`` such ids)."""

    capacity: int = 256
    budget_bytes: int = 64 << 20
    _items: collections.OrderedDict[str, tuple[dict[str, Any], int]] = attrs.field(factory=collections.OrderedDict)
    _bytes: int = 0
    _too_large: collections.OrderedDict[str, int] = attrs.field(factory=collections.OrderedDict)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    def put(self, rid: str, receipt: dict[str, Any], nbytes: int) -> None:
        """Keep ``receipt``, an envelope of ``nbytes`` bytes as JSON, dropping the oldest for the bounds."""
        with self._lock:
            old = self._items.pop(rid, None)
            if old is not None:
                self._bytes -= old[1]
            if nbytes > self.budget_bytes:
                self._too_large[rid] = nbytes
                while len(self._too_large) > self.capacity:
                    self._too_large.popitem(last=False)
                return
            self._items[rid] = (receipt, nbytes)
            self._bytes += nbytes
            self._trim()

    def _trim(self) -> None:
        while self._items and (len(self._items) > self.capacity or self._bytes > self.budget_bytes):
            _, (_, n) = self._items.popitem(last=False)
            self._bytes -= n

    def annotate(self, rid: str, key: str, value: Any) -> None:
        """Add ``key`` to a stored request's envelope (next to its receipt), if it is still kept."""
        with self._lock:
            if rid in self._items:
                envelope, n = self._items[rid]
                self._items[rid] = ({**envelope, key: value}, n + len(json.dumps({key: value}, default=str)))
                self._bytes += self._items[rid][1] - n
                self._trim()

    def get(self, rid: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._items.get(rid)
            return found[0] if found is not None else None

    def too_large(self, rid: str) -> int | None:
        """The size of ``rid``'s receipt when it was not kept because it alone exceeded the budget."""
        with self._lock:
            return self._too_large.get(rid)

    def usage(self) -> tuple[int, int]:
        """Receipts kept, and their bytes."""
        with self._lock:
            return len(self._items), self._bytes


def _round_metrics(metrics: Metrics, job: Job, gen: Generation) -> None:
    """A request's rounds in the metrics, once it ended, the same way whether it streamed or not: the time
    to its first commit as the driver stamped it, and per token after it each later round's own seconds
    shared by the tokens it emitted (never the reader's clock, which also counts the hand-over)."""
    if gen.first_commit_at is not None:
        metrics.ttft.observe(gen.first_commit_at - job.arrived)
    rounds = gen.txn.rounds if gen.txn is not None else []
    metrics.itl.observe_rounds((r.seconds / r.emitted, r.emitted) for r in rounds[1:] if r.emitted)
    metrics.rounds(rounds)


def run_job(engine: Engine[Session], gen: Generation, job: Job, metrics: Metrics,
            post: Callable[[Commit], None] | None) -> Outcome:
    """Run ``gen`` (``job`` started on a sequence of ``engine`` admitted for it) to its end on this thread: a
    worker, for a sequence that decodes alone (its rounds run on the compute thread, this one reads them).
    ``post`` receives each :class:`~power_core.passes.Commit` as its round closes (streaming; ``None``: the
    end only, and no hand-over per round)."""
    error: BaseException | None = None
    try:
        if post is None:
            engine.run(gen)
        else:
            for commit in engine.rounds(gen):
                post(commit)
    except Exception as exc:  # (how it ended: finish_job says it, and raises it when it never started)
        error = exc
    return finish_job(job, gen, metrics, error)


def finish_job(job: Job, gen: Generation, metrics: Metrics, error: BaseException | None) -> Outcome:
    """``gen`` has ended (the driver no longer touches it), by ``error`` when not by finishing: its receipt
    (:meth:`Generation.report`: the ``power_request_end`` observers; the same receipt when the reader made it
    already), the server's metrics of it, and its outcome. On a worker thread, once per request (a receipt
    of a long request takes milliseconds). Raises ``error`` when the request never started (the engine or
    the session refused it: no receipt to give; the engine gave the sequence back)."""
    gen.report()
    if isinstance(error, PowerError) and not isinstance(error, Cancelled):
        log.warning("serve.request_failed", id=job.id, error=f"{error.code}: {error}")
    elif error is not None and not isinstance(error, Cancelled):  # a defect: the client gets a 500 without a
        log.error("serve.request_crashed", id=job.id, exc_info=error)  # traceback, the log gets it
    _round_metrics(metrics, job, gen)
    receipt = gen.receipt
    if receipt is None:
        assert error is not None
        raise error
    metrics.e2e.observe(time.perf_counter() - job.arrived)
    metrics.observer_faults.inc(receipt.observer_faults)
    metrics.prompt(receipt)
    reason = {"completed": None, "cancelled": "abort"}.get(receipt.status, "error")
    if reason is None:
        reason = "stop" if receipt.finish_reason == "stop" else "length"
    metrics.requests.labels(finished_reason=reason).inc()
    metrics.by_strategy.labels(strategy=str(receipt.strategy["name"])).inc()
    # (a stream's text is its answer's to take, on the event loop, from the request's one assembler)
    return Outcome(tokens=gen.tokens, text="" if job.stream else gen.text() or "", receipt=receipt,
                   logprobs=gen.logprobs, error=error, receipt_bytes=receipt.canonical_bytes)


class Following:
    """A request on the shared passes as the event loop follows it, with no thread of its own: its
    :meth:`deliver` is what :meth:`Engine.feed` hands the driver; the driver hands each commit through it
    straight to the answer (``post``: to the loop) and its end to :meth:`_ended` on the loop, which makes the
    outcome (:func:`finish_job`). :attr:`outcome` is that outcome, or the error when the engine or the
    session refused to begin the request. Its begin (:meth:`start`) and its end run on the loop itself,
    unless a ``power_request_start``/``power_request_end`` observer listens (:meth:`PowerPlugins.observes_requests
    <power_core.plugins.PowerPlugins.observes_requests>`): one may be slow, so both then run on a worker. Either
    way they hold the GIL, so a worker spares the loop's other requests nothing, and costs thread hand-offs at
    both ends (a median 0.16 ms a request on a 2-core machine, docs/evidence/bench_drafts/ends-2026-12-05)."""

    def __init__(self, executor: Executor, job: Job, gen: Generation, metrics: Metrics,
                 post: Callable[[Commit], None] | None, *, observed: bool) -> None:
        self.loop = asyncio.get_running_loop()
        self.executor, self.job, self.gen, self.metrics, self.post = executor, job, gen, metrics, post
        self.observed = observed
        self.outcome: asyncio.Future[Outcome] = self.loop.create_future()

    def start(self, engine: Engine[Session]) -> None:
        """Begin the request and hand it to ``engine``'s driver (:meth:`Engine.feed`). A refusal is the outcome
        (nothing was delivered)."""
        self._run(functools.partial(engine.feed, self.gen, self.deliver, quiet=self.post is None)) \
            .add_done_callback(self._begun)

    def _run(self, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """``fn(*args)`` on a worker when request observers listen (one may be slow), else here and now; its
        future either way."""
        if self.observed:
            return self.loop.run_in_executor(self.executor, fn, *args)
        done: asyncio.Future[_T] = self.loop.create_future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def deliver(self, item: Commit | Ended) -> None:
        """The driver's thread: a commit goes to the answer, the end to the event loop."""
        if isinstance(item, Commit):
            if self.post is not None:
                self.post(item)
            return
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody waits
            self.loop.call_soon_threadsafe(self._ended, item.failure)

    def _ended(self, failure: BaseException | None) -> None:
        self._run(finish_job, self.job, self.gen, self.metrics, failure).add_done_callback(self._settle)

    def _begun(self, begun: asyncio.Future[None]) -> None:
        """The begin ended (on the loop): a refusal is the outcome (nothing was delivered)."""
        if not begun.cancelled() and (exc := begun.exception()) is not None and not self.outcome.done():
            self.outcome.set_exception(exc)

    def _settle(self, done: asyncio.Future[Outcome]) -> None:
        """The outcome made (on the loop): :attr:`outcome` takes it, or its error."""
        if self.outcome.done():
            return
        if done.cancelled():
            self.outcome.cancel()
        elif (exc := done.exception()) is not None:
            self.outcome.set_exception(exc)
        else:
            self.outcome.set_result(done.result())
