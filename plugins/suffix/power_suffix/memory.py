"""``SuffixMemory``: what suffix drafts learn across requests, and a static corpus.

Two indexes sit next to each request's own (:class:`~power_suffix.index.SuffixIndex`):

* **shared**: the outputs of earlier requests (and, with ``learn_prompts``, their prompts), one
  document each, kept **per tenant** (config ``tenant``; :class:`~power_core.runtime.RequestScope`).
  A request is offered continuations from its own tenant's documents only, unless the memory was
  made with ``share_tenants=True``. Sharing is a timing channel: a proposal from another tenant's
  text makes a request measurably faster, so one tenant could learn whether another sent a given
  text by timing its own requests. Turn it on only where every tenant may read every other's text.
  The memory is bounded by ``budget_tokens`` (documents of every tenant together): documents are
  kept in segments of at most ``budget_tokens / SEGMENTS`` tokens and the oldest segment goes first,
  so the memory never holds more than the budget. It is bounded in tenants too (``tenants_max``): the
  tenant is client-controlled text (the ``user`` field), so past the cap the least recently used
  tenant (the one whose documents were learned or read longest ago) is dropped whole. A query scans
  only its tenant's segments (every segment with ``share_tenants``).
* **corpus**: files tokenized once (``spec_suffix_corpus``: a codebase, docs), never evicted, read by
  every tenant (the operator's text, not a tenant's), the equivalent of llama.cpp's static lookup
  cache over suffixes.

A query returns the candidate with the longest match, then the most occurrences, then the newest
(the request's own index is consulted by the proposer first and wins ties). Proposals depend only on
the request's history and what the memory holds, never on timing or acceptance statistics.

The learned part is kept durably in a store directory (:meth:`SuffixMemory.open_store`; the format is
:mod:`power_suffix.store`'s): every document is appended to a checksummed log as it is learned, a
thread fsyncs it every ``sync_s`` seconds or ``sync_requests`` documents, whichever comes first, and
compacts it to a snapshot when the log outgrows what the memory holds. A kill at any moment loses
nothing that was learned (a power cut: at most the last sync interval); on open a torn tail is cut
and a damaged store is moved aside (``suffix-memory.bin.corrupt-<time>``, logged, counted in
:meth:`SuffixMemory.store_stats`) and the memory starts empty. A store of another vocabulary is
:class:`~power_core.errors.ArtifactMismatch` (a configuration error, not damage: nothing is moved).
:meth:`SuffixMemory.save` and :meth:`SuffixMemory.load` write and read a store without keeping it
open (``load`` raises :class:`~power_core.errors.ArtifactError`, reason ``suffix_store_corrupt``, on a
damaged one). The memory is thread-safe: one may serve every session and engine of a process
(:func:`power_suffix.share_memory`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import numpy as np

from power_core.errors import ArtifactError, ArtifactMismatch, ConfigError, PowerError
from power_core.logs import get_logger
from power_suffix import store as _store
from power_suffix.corpus import corpus_index
from power_suffix.index import MAX_MATCH, SEPARATOR, Match, SuffixIndex, suffix_hashes
from power_suffix.store import STORE_FILE, STORE_FORMAT

__all__ = ["COMPACT_MIN_BYTES", "SHARED_LENGTHS", "SEGMENTS", "STORE_FILE", "STORE_FORMAT", "SYNC_REQUESTS",
           "SYNC_S", "TENANTS_MAX", "Found", "MemoryStats", "StoreStats", "SuffixMemory"]

log = get_logger(__name__)

#: suffix lengths the shared and corpus indexes hash (a longer match is measured exactly by
#: extension; the request's own index covers the short ones)
SHARED_LENGTHS = (2, 4, 8, 16, 32)
#: the budget is kept in this many segments; eviction drops the oldest whole segment
SEGMENTS = 8
#: tenants whose documents are held at once, by default (past it the least recently used goes)
TENANTS_MAX = 1024
#: the store's log is fsynced this often (seconds) ...
SYNC_S = 1.0
#: ... or once this many records wait, whichever comes first
SYNC_REQUESTS = 32
#: the store is compacted once its file is larger than twice what a snapshot of the memory would be,
#: and larger than this
COMPACT_MIN_BYTES = 1 << 20
#: a store whose writes failed is retried (by a compaction) at most this often (seconds)
RETRY_S = 10.0


@attrs.frozen
class Found:
    """A memory's best continuation for a history: the match and which index it came from."""

    match: Match
    source: str  # "shared" or "corpus"


@attrs.frozen
class MemoryStats:
    """What a memory holds: learned tokens (all tenants), their budget, segments, documents,
    tenants, corpus tokens, the documents evicted so far, the tenant cap and the tenants the LRU
    dropped so far."""

    tokens: int
    budget_tokens: int
    segments: int
    documents: int
    tenants: int
    corpus_tokens: int
    evicted_documents: int
    tenants_max: int = TENANTS_MAX
    evicted_tenants: int = 0


@attrs.frozen
class StoreStats:
    """The durable store of a memory (:meth:`SuffixMemory.store_stats`), for logs and ``/metrics``.

    ``open``: the store is being appended to (false once closed, or while writes fail:
    ``healthy`` false); ``records``: whole records after the header (``snapshot_records`` of them the
    last compaction's snapshot); ``appended``/``synced``: records this process appended and, of
    those, fsynced; ``last_sync_age_s``: seconds since the last fsync (``None``: none yet);
    ``corrupt_moved_aside``: damaged stores moved aside when opening (``moved_aside``: the last one's
    path); ``torn_bytes_cut``: bytes of torn tail cut when opening; ``write_errors``: failed writes
    and fsyncs."""

    path: str
    open: bool
    healthy: bool
    bytes: int
    records: int
    snapshot_records: int
    appended: int
    synced: int
    syncs: int
    compactions: int
    last_sync_age_s: float | None
    corrupt_moved_aside: int
    moved_aside: str | None
    torn_bytes_cut: int
    stale_tmp_removed: int
    write_errors: int
    sync_s: float
    sync_requests: int


@attrs.define(eq=False)
class _Segment:
    """Documents of one tenant, in one index, in the order they arrived (``seqs``: when each was
    learned, in the memory's order; ``nbytes``: the bytes they take in a store's snapshot)."""

    tenant: str
    serial: int
    index: SuffixIndex = attrs.field(factory=lambda: SuffixIndex(SHARED_LENGTHS, truncatable=False))
    docs: list[np.ndarray] = attrs.field(factory=list)
    seqs: list[int] = attrs.field(factory=list)
    tokens: int = 0
    nbytes: int = 0

    def add(self, doc: np.ndarray, seq: int) -> None:
        self.index.extend(doc)
        self.index.extend([SEPARATOR])
        self.docs.append(doc)
        self.seqs.append(seq)
        self.tokens += int(doc.shape[0])
        self.nbytes += _store.doc_record_size(self.tenant, int(doc.shape[0]))


class SuffixMemory:
    """Cross-request and corpus suffix indexes, bound to one vocabulary (``vocab_digest``).

    ``budget_tokens``: the most learned tokens held (0: learns nothing; the corpus is apart);
    ``learn_prompts``: prompts are learned too, not only outputs; ``share_tenants``: every tenant
    is offered every tenant's documents (a timing channel; see the module's documentation);
    ``tenants_max``: the most tenants whose documents are held (the least recently used goes)."""

    def __init__(self, vocab_digest: str, *, budget_tokens: int = 1 << 18, learn_prompts: bool = False,
                 share_tenants: bool = False, tenants_max: int = TENANTS_MAX) -> None:
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 0:
            raise ConfigError("spec_suffix_memory_tokens", budget_tokens, "an integer >= 0")
        if isinstance(tenants_max, bool) or not isinstance(tenants_max, int) or tenants_max < 1:
            raise ConfigError("spec_suffix_tenants", tenants_max, "an integer >= 1")
        self.vocab_digest = vocab_digest
        self.budget_tokens = budget_tokens
        self.learn_prompts = learn_prompts
        self.share_tenants = share_tenants
        self.tenants_max = tenants_max
        self._lock = threading.RLock()
        self._segments: list[_Segment] = []  # oldest first
        #: per tenant, its segments (oldest first); the tenants in LRU order (least recently used first)
        self._tenants: OrderedDict[str, list[_Segment]] = OrderedDict()
        self._open: dict[str, _Segment] = {}  # per tenant, the segment new documents go to
        self._serial = 0
        self._seq = 0
        self._tokens = 0
        self._bytes = 0  # what a snapshot of the held documents takes in a store
        self._evicted = 0
        self._evicted_tenants = 0
        self._corpus: SuffixIndex | None = None
        self._corpus_tokens = 0
        self._users = 0
        # the durable store (open_store): where, how, and its counters (kept across a close and reopen)
        self._store_dir: Path | None = None
        self._log: _store.StoreLog | None = None
        self._sync = (SYNC_S, SYNC_REQUESTS, COMPACT_MIN_BYTES)
        self._closed_identity: tuple[int, int, int] | None = None
        self._closed_counts = (0, 0)
        self._moved = 0
        self._moved_last: str | None = None
        self._torn_cut = 0
        self._stale_tmp = 0
        self._changes = 0  # learns, forgets and clears so far (a reopen compares them with the close's)
        self._changes_at_close = 0
        self._past = (0, 0, 0, 0)  # appended, synced, syncs, compactions of logs closed before (a reopen)
        self._store_lock = threading.Lock()  # opening and closing the store

    # -- learning ------------------------------------------------------------------------------------
    @property
    def segment_tokens(self) -> int:
        return max(1, self.budget_tokens // SEGMENTS)

    @property
    def store(self) -> Path | None:
        """The store directory this memory keeps its documents in (:meth:`open_store`; ``None``: none)."""
        return self._store_dir

    def learn(self, tenant: str, tokens: Sequence[int] | np.ndarray) -> None:
        """Add one document (a request's output, or prompt and output) under ``tenant``; the oldest
        segments go when the budget would be exceeded, the least recently used tenant when a new
        tenant would exceed ``tenants_max``. A document longer than the budget keeps its last
        ``budget_tokens`` tokens. A segment takes documents up to ``segment_tokens`` (one longer
        document has a segment of its own), so what eviction drops is never the newest. With a store
        open, the document is appended to its log before this returns."""
        doc = np.array(tokens, dtype=np.int32).ravel()  # a copy: the caller may reuse its buffer (a proposer's index)
        if self.budget_tokens == 0 or doc.shape[0] < 2:
            return
        if doc.shape[0] > self.budget_tokens:
            doc = doc[-self.budget_tokens:]
        with self._lock:
            forgot = self._learn(tenant, doc)
            self._changes += 1
            if self._log is not None:
                self._log.append(_store.learn_record(tenant, doc, forgot))

    def _learn(self, tenant: str, doc: np.ndarray) -> list[str]:
        """(under the lock) Learn ``doc``; returns the tenants the LRU dropped to make room (at most one)."""
        forgot: list[str] = []
        if tenant not in self._tenants and len(self._tenants) >= self.tenants_max:
            victim = next(iter(self._tenants))
            self._drop_tenant(victim)
            self._evicted_tenants += 1
            forgot.append(victim)
        seg = self._open.get(tenant)
        if seg is None or (seg.docs and seg.tokens + doc.shape[0] > self.segment_tokens):
            self._serial += 1
            seg = _Segment(tenant=tenant, serial=self._serial)
            self._segments.append(seg)
            self._tenants.setdefault(tenant, []).append(seg)
            self._open[tenant] = seg
        self._tenants.move_to_end(tenant)
        before = seg.nbytes
        self._seq += 1
        seg.add(doc, self._seq)
        self._tokens += int(doc.shape[0])
        self._bytes += seg.nbytes - before
        while self._tokens > self.budget_tokens and self._segments:
            old = self._segments.pop(0)
            self._tokens -= old.tokens
            self._bytes -= old.nbytes
            self._evicted += len(old.docs)
            mine = self._tenants[old.tenant]
            mine.pop(0)  # a tenant's segments are in the memory's order: its oldest is the oldest overall
            if not mine:
                del self._tenants[old.tenant]
            if self._open.get(old.tenant) is old:
                del self._open[old.tenant]
        return forgot

    def _drop_tenant(self, tenant: str) -> None:
        """(under the lock) Forget every document of ``tenant``."""
        segs = self._tenants.pop(tenant, None)
        if not segs:
            return
        gone = set(map(id, segs))
        self._segments = [s for s in self._segments if id(s) not in gone]
        for s in segs:
            self._tokens -= s.tokens
            self._bytes -= s.nbytes
            self._evicted += len(s.docs)
        self._open.pop(tenant, None)

    def forget(self, tenant: str) -> None:
        """Forget every document of ``tenant`` (in the store too)."""
        with self._lock:
            if tenant not in self._tenants:
                return
            self._drop_tenant(tenant)
            self._changes += 1
            if self._log is not None:
                self._log.append(_store.forget_record(tenant))

    def clear(self) -> None:
        """Forget every learned document (the corpus stays; in the store too)."""
        with self._lock:
            self._clear()
            self._changes += 1
            if self._log is not None:
                self._log.append(_store.clear_record())

    def _clear(self) -> None:
        self._segments.clear()
        self._tenants.clear()
        self._open.clear()
        self._tokens = 0
        self._bytes = 0

    def _apply(self, ops: Iterable[_store.Op]) -> None:
        """(under the lock, the store not appended to) Replay a store's records."""
        for kind, tenant, tokens in ops:
            if kind == _store.DOC and tokens is not None:
                doc = tokens if tokens.shape[0] <= self.budget_tokens else tokens[-self.budget_tokens:]
                if self.budget_tokens and doc.shape[0] >= 2:
                    self._learn(tenant, doc)
            elif kind == _store.FORGET:
                self._drop_tenant(tenant)
            elif kind == _store.CLEAR:
                self._clear()

    def _held(self) -> list[tuple[str, np.ndarray]]:
        """(under the lock) Every held document with its tenant, in the order they were learned (what
        a snapshot holds: replayed, it rebuilds the same segments and tenant order)."""
        items = [(seq, s.tenant, d) for s in self._segments for seq, d in zip(s.seqs, s.docs, strict=True)]
        items.sort(key=lambda x: x[0])
        return [(t, d) for _, t, d in items]

    # -- the corpus ----------------------------------------------------------------------------------
    def add_corpus(self, paths: Sequence[str | os.PathLike[str]], encode: Callable[[str], np.ndarray], *,
                   progress: bool = True) -> int:
        """Tokenize the files of ``paths`` (:func:`~power_suffix.corpus.corpus_files`) with ``encode`` into the
        corpus index (one document per file), with a progress bar on a terminal; returns the tokens added."""
        index, added = corpus_index(paths, encode, SHARED_LENGTHS, progress=progress)
        with self._lock:
            if self._corpus is None:
                self._corpus = index
            else:  # a second corpus goes after the first (rare: one call per memory is the rule)
                self._corpus.extend(index.tokens)
            self._corpus_tokens += added
        return added

    # -- queries -------------------------------------------------------------------------------------
    def find(self, tenant: str, history: np.ndarray, max_tokens: int, beat: tuple[int, int] = (0, 0)) -> Found | None:
        """The best continuation of ``history`` in what ``tenant`` may read: the longest match, then
        the most occurrences, then the newest segment (the corpus after every segment); ``None`` when
        nothing here has a ``(length, occurrences)`` above ``beat`` (the caller's own match). Only
        ``tenant``'s segments are scanned (every segment with ``share_tenants``); ``tenant`` becomes
        the most recently used."""
        best: Found | None = None
        query = np.asarray(history)[-MAX_MATCH:]
        hashes = suffix_hashes(query, SHARED_LENGTHS)  # the same for every index here
        with self._lock:
            mine = self._tenants.get(tenant)
            if mine is not None:
                self._tenants.move_to_end(tenant)
            for seg in reversed(self._segments if self.share_tenants else mine or ()):  # newest first: a tie keeps the newer
                m = seg.index.find(query, max_tokens, hashes, beat)
                if m is not None and m.tokens.size:
                    best = Found(match=m, source="shared")
                    beat = (m.length, m.occurrences)
            if self._corpus is not None:
                m = self._corpus.find(query, max_tokens, hashes, beat)
                if m is not None and m.tokens.size:
                    best = Found(match=m, source="corpus")
        return best

    def stats(self) -> MemoryStats:
        with self._lock:
            return MemoryStats(tokens=self._tokens, budget_tokens=self.budget_tokens, segments=len(self._segments),
                               documents=sum(len(s.docs) for s in self._segments), tenants=len(self._tenants),
                               corpus_tokens=self._corpus_tokens, evicted_documents=self._evicted,
                               tenants_max=self.tenants_max, evicted_tenants=self._evicted_tenants)

    def documents(self, tenant: str) -> list[np.ndarray]:
        """``tenant``'s learned documents, oldest first (copies)."""
        with self._lock:
            return [d.copy() for s in self._tenants.get(tenant, ()) for d in s.docs]

    def tenants(self) -> list[str]:
        """The tenants whose documents are held, least recently used first."""
        with self._lock:
            return list(self._tenants)

    # -- users (proposers): the store is closed when the last one closes, reopened with the next ----------
    def acquire(self) -> None:
        with self._lock:
            self._users += 1
            first = self._users == 1
        if first and self._store_dir is not None and self._log is None:
            self._reopen()

    def release(self) -> None:
        """One user closed; when none is left, the store (if open) is compacted and closed."""
        with self._lock:
            self._users = max(0, self._users - 1)
            last = self._users == 0
        if last and self._log is not None:
            with self._store_lock:
                with self._lock:
                    still = self._users == 0
                if still:
                    self._close_store()

    # -- the durable store ---------------------------------------------------------------------------
    def open_store(self, directory: str | os.PathLike[str], *, sync_s: float = SYNC_S,
                   sync_requests: int = SYNC_REQUESTS, compact_bytes: int = COMPACT_MIN_BYTES) -> int:
        """Keep the learned documents in ``directory`` (created if missing) from now on: load its store
        (returns how many documents it gave), then append every document learned to its log, fsynced
        every ``sync_s`` seconds or ``sync_requests`` records, whichever comes first, and compacted once
        the file is larger than ``compact_bytes`` and twice a snapshot of the memory. Until
        :meth:`close_store` (or the last :meth:`release`) the directory is locked against other writers.

        A torn tail (a record a kill cut short) is cut; a damaged store is moved aside
        (``suffix-memory.bin.corrupt-<UTC time>``), logged (``suffix.store_corrupt``), counted
        (:attr:`StoreStats.corrupt_moved_aside`) and the memory starts without it. Raises
        :class:`~power_core.errors.ArtifactMismatch` for a store of another vocabulary or format version
        (nothing is moved), :class:`ConfigError` (``spec_suffix_store``) when another process or memory
        has the directory open, :class:`ArtifactError` (``suffix_store_unwritable``) when it cannot be
        written."""
        if isinstance(sync_s, bool) or not isinstance(sync_s, int | float) or not sync_s > 0:
            raise ConfigError("spec_suffix_store_sync_s", sync_s, "a number of seconds > 0")
        if isinstance(sync_requests, bool) or not isinstance(sync_requests, int) or sync_requests < 1:
            raise ConfigError("spec_suffix_store_sync_requests", sync_requests, "an integer >= 1")
        where = Path(directory).resolve()
        with self._store_lock:
            if self._log is not None:
                if where == self._store_dir:
                    return 0
                raise ConfigError("spec_suffix_store", str(where), f"this memory's store ({self._store_dir})",
                                  "a memory keeps one store; close_store() first")
            self._sync = (float(sync_s), int(sync_requests), int(compact_bytes))
            n = self._open_store(where, identity=None)
            self._store_dir = where
            return n

    def close_store(self) -> None:
        """Compact the store to a snapshot of what the memory holds, close it and unlock its directory
        (the memory keeps its documents; the next :meth:`acquire` after the last :meth:`release`
        reopens it). Never raises for the disk: a compaction that fails leaves the synced log."""
        with self._store_lock:
            self._close_store()

    def sync(self) -> None:
        """fsync the store's log now (the store's thread does it every ``sync_s`` on its own)."""
        log_ = self._log
        if log_ is not None:
            log_.sync()

    def store_stats(self) -> StoreStats | None:
        """The durable store's counters (``None``: the memory never had one). ``power serve`` may export
        them: ``corrupt_moved_aside`` is the count of damaged stores moved aside."""
        log_ = self._log
        if self._store_dir is None and not self._moved:
            return None
        past_appended, past_synced, past_syncs, past_compactions = self._past
        path = str((self._store_dir or Path()) / STORE_FILE)
        if log_ is None:
            return StoreStats(path=path, open=False, healthy=False, bytes=0, records=0, snapshot_records=0,
                              appended=past_appended, synced=past_synced, syncs=past_syncs,
                              compactions=past_compactions, last_sync_age_s=None, corrupt_moved_aside=self._moved,
                              moved_aside=self._moved_last, torn_bytes_cut=self._torn_cut,
                              stale_tmp_removed=self._stale_tmp, write_errors=0, sync_s=self._sync[0],
                              sync_requests=self._sync[1])
        last = log_.last_sync
        return StoreStats(path=path, open=not log_.closed, healthy=not log_.failed and not log_.closed,
                          bytes=log_.size, records=log_.records, snapshot_records=log_.snapshot_records,
                          appended=past_appended + log_.appended, synced=past_synced + log_.synced,
                          syncs=past_syncs + log_.syncs, compactions=past_compactions + log_.compactions,
                          last_sync_age_s=None if last is None else max(0.0, time.time() - last),
                          corrupt_moved_aside=self._moved, moved_aside=self._moved_last,
                          torn_bytes_cut=self._torn_cut, stale_tmp_removed=self._stale_tmp,
                          write_errors=log_.write_errors, sync_s=log_.sync_s, sync_requests=log_.sync_requests)

    def _open_store(self, directory: Path, identity: tuple[int, int, int] | None) -> int:
        """(under the store lock) Lock ``directory``, load its store, open it for appending."""
        path = directory / STORE_FILE
        try:
            if not directory.is_dir():
                directory.mkdir(parents=True, exist_ok=True)
                _store.fsync_dir(directory.parent)  # the new directory's name is durable too
            lock = _store.DirLock(directory)
        except _store.StoreBusy:
            raise ConfigError("spec_suffix_store", str(directory),
                              "a directory no other running process or suffix memory has open",
                              "a store has one writer; give each its own --suffix-store directory") from None
        except OSError as exc:
            raise _store.unwritable(path, exc) from None
        try:
            return self._open_locked(directory, lock, identity)
        except BaseException:
            lock.release()
            raise

    def _open_locked(self, directory: Path, lock: _store.DirLock, identity: tuple[int, int, int] | None) -> int:
        path = directory / STORE_FILE
        self._stale_tmp += _store.remove_stale_tmp(directory)  # a compaction killed midway
        sync_s, sync_requests, _ = self._sync
        tick = weakref.WeakMethod(self._tick)
        if identity is not None:  # a reopen: the file this memory closed, unless something changed it since
            with self._lock:
                same = _store.file_identity(path) == identity and self._changes == self._changes_at_close
            if same:
                snapshot, records = self._closed_counts
                self._log = _store.StoreLog(directory, self.vocab_digest, lock, sync_s=sync_s,
                                            sync_requests=sync_requests, snapshot_records=snapshot, records=records,
                                            tick=tick)
                self._log.start()
                return 0
            with self._lock:
                self._clear()  # it is reloaded from the store: what the file holds wins
        parsed: _store.Parsed | None = None
        try:
            blob: bytes | None = path.read_bytes()
        except FileNotFoundError:
            blob = None
        except OSError as exc:
            raise ArtifactError(f"{path}: cannot read the suffix store ({exc})", reason="suffix_store_unreadable",
                                evidence=str(path)) from None
        if blob is not None:
            try:
                parsed = _store.parse_store(path, blob, self.vocab_digest)
            except ArtifactMismatch:
                raise  # another model's (or version's) store: the operator's to fix, never moved
            except ArtifactError as exc:
                try:
                    aside = _store.move_aside(path)
                except OSError as err:
                    raise _store.unwritable(path, err) from None
                self._moved += 1
                self._moved_last = str(aside)
                log.error("suffix.store_corrupt", path=str(path), moved_to=str(aside), reason=str(exc),
                          consequence="the suffix memory starts without it")
            del blob
        with self._lock:
            had = bool(self._segments)
            n = 0
            if parsed is not None:
                if had:  # an embedder's memory with documents of its own: the store's go after them
                    scratch = SuffixMemory(self.vocab_digest, budget_tokens=self.budget_tokens,
                                           tenants_max=self.tenants_max)
                    scratch._apply(parsed.ops)
                    held = scratch._held()
                    for t, d in held:
                        self._learn(t, d)
                    n = len(held)
                else:
                    self._apply(parsed.ops)
                    n = sum(len(s.docs) for s in self._segments)
            try:
                if parsed is None or parsed.version < 3 or had:  # a new store, or one rewritten as this format
                    _store.write_snapshot(directory, self.vocab_digest, self._held())
                    snapshot = records = len(self._held())
                else:
                    snapshot, records = parsed.snapshot, parsed.records
                    if parsed.torn_bytes:
                        _store.cut_tail(path, parsed.valid_bytes)
                if parsed is not None and parsed.torn_bytes:
                    self._torn_cut += parsed.torn_bytes
                    log.warning("suffix.store_tail_cut", path=str(path), bytes=parsed.torn_bytes,
                                records=parsed.records)
            except OSError as exc:
                raise _store.unwritable(path, exc) from None
            self._log = _store.StoreLog(directory, self.vocab_digest, lock, sync_s=sync_s, sync_requests=sync_requests,
                                        snapshot_records=snapshot, records=records, tick=tick)
        self._log.start()
        log.info("suffix.store_opened", path=str(path), documents=n, records=records,
                 format=None if parsed is None else parsed.version)
        return n

    def _reopen(self) -> None:
        with self._store_lock:
            if self._log is not None or self._store_dir is None:
                return
            try:
                self._open_store(self._store_dir, identity=self._closed_identity)
            except (PowerError, OSError) as exc:
                log.error("suffix.store_reopen_failed", path=str(self._store_dir / STORE_FILE),
                          error=f"{type(exc).__name__}: {exc}", consequence="the suffix memory goes on in RAM")

    def _close_store(self) -> None:
        """(under the store lock)"""
        log_ = self._log
        if log_ is None:
            return
        log_.stop()
        try:
            self._compact()
        except OSError as exc:
            log.warning("suffix.store_compaction_failed", path=str(log_.path), error=f"{type(exc).__name__}: {exc}",
                        consequence="the store keeps its log")
        with self._lock:
            self._log = None
            self._changes_at_close = self._changes
        log_.close()
        a, s, y, c = self._past
        self._past = (a + log_.appended, s + log_.synced, y + log_.syncs, c + log_.compactions)
        self._closed_identity = _store.file_identity(log_.path)
        self._closed_counts = (log_.snapshot_records, log_.records)
        log.info("suffix.store_closed", path=str(log_.path), records=log_.records)

    def _compact(self) -> None:
        """Rewrite the store as a snapshot of what the memory holds (OSError: the store is as it was)."""
        log_ = self._log
        if log_ is None or log_.closed:
            return
        with self._lock:
            docs = self._held()
            log_.begin_compaction()
        log_.finish_compaction(docs)

    def _tick(self) -> None:
        """The store's thread, after each sync: compact when the file has outgrown the memory (or
        retry a store whose writes failed)."""
        log_ = self._log
        if log_ is None or log_.closed:
            return
        failed = log_.failed_at
        if failed is not None:
            if time.monotonic() - failed < RETRY_S:
                return
        else:
            with self._lock:
                live = self._bytes
            if log_.size <= max(self._sync[2], 2 * live):
                return
        try:
            self._compact()
        except OSError as exc:
            if failed is not None:
                log_.failed_at = time.monotonic()
            log.warning("suffix.store_compaction_failed", path=str(log_.path), error=f"{type(exc).__name__}: {exc}",
                        consequence="the store keeps its log; retried later")

    # -- saving and loading without keeping the store open --------------------------------------------
    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the learned documents to ``directory``/``STORE_FILE`` as a snapshot, atomically and
        durably (fsync of the file, then of the directory, around the rename). The corpus is not
        saved (it is read from its files). This memory's own open store is compacted instead."""
        out = Path(directory)
        path = out / STORE_FILE
        if self._log is not None and self._store_dir is not None and out.resolve() == self._store_dir:
            try:
                self._compact()
            except OSError as exc:
                raise _store.unwritable(path, exc) from None
            return path
        with self._lock:
            docs = self._held()
        try:
            out.mkdir(parents=True, exist_ok=True)
            lock = _store.DirLock(out)
        except _store.StoreBusy:
            raise ArtifactError(f"{out}: another process or suffix memory has this store open; the store is "
                                "unchanged", reason="suffix_store_busy", evidence=str(out)) from None
        except OSError as exc:
            raise _store.unwritable(path, exc) from None
        try:
            _store.write_snapshot(out, self.vocab_digest, docs)
        except OSError as exc:
            raise _store.unwritable(path, exc) from None
        finally:
            lock.release()
        log.info("suffix.store_saved", path=str(path), documents=len(docs))
        return path

    def load(self, directory: str | os.PathLike[str]) -> int:
        """Learn the documents of the store in ``directory`` (none there: nothing, 0); returns how many
        it gave. The whole store is read and checked before anything is learned: a damaged one
        (:class:`ArtifactError`, ``suffix_store_corrupt``) or another vocabulary's
        (:class:`ArtifactMismatch`) leaves the memory as it was. A torn tail is ignored (logged)."""
        path = Path(directory) / STORE_FILE
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise ArtifactError(f"{path}: cannot read the suffix store ({exc})", reason="suffix_store_corrupt",
                                evidence=str(path)) from None
        parsed = _store.parse_store(path, blob, self.vocab_digest)
        del blob
        if parsed.torn_bytes:
            log.warning("suffix.store_tail_ignored", path=str(path), bytes=parsed.torn_bytes)
        with self._lock:
            if not self._segments and self._log is None:
                self._apply(parsed.ops)
                n = sum(len(s.docs) for s in self._segments)
                log.info("suffix.store_loaded", path=str(path), documents=n)
                return n
        scratch = SuffixMemory(self.vocab_digest, budget_tokens=self.budget_tokens, tenants_max=self.tenants_max)
        scratch._apply(parsed.ops)
        held = scratch._held()
        for t, d in held:
            self.learn(t, d)
        log.info("suffix.store_loaded", path=str(path), documents=len(held))
        return len(held)
