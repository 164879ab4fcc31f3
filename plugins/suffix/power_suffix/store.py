"""The suffix memory's durable store: an append-only, checksummed log of what the memory learned,
compacted to a snapshot, that a crash cannot take back.

One file, ``DIR/suffix-memory.bin`` (:data:`STORE_FILE`), format ``power-suffix.store/3``::

    file    := MAGIC record*
    MAGIC   := b"PWRSFX3\\n"
    record  := crc32:u32le  length:u32le  kind:u8  payload[length]
               (crc32: zlib's, over the length, the kind and the payload)

    kind 1  HEADER  the first record, once: UTF-8 JSON {"format": "power-suffix.store/3",
                    "vocab_sha256": the model's vocabulary digest, "snapshot": n, "created": unix seconds}
    kind 2  DOC     tenant_length:u32le  tenant:UTF-8  tokens:i32le*   a learned document
    kind 3  FORGET  tenant:UTF-8    the tenant's documents were dropped (``SuffixMemory.forget``)
    kind 4  CLEAR   (empty)         every document was dropped
    kind 5  EVICT   victims:u32le  (tenant_length:u32le tenant:UTF-8)*victims  then a DOC's payload:
                    the tenant LRU dropped the victims to make room for this document

The ``n`` records after the header are the **snapshot**: they were written with the file, fsynced,
and only then renamed into place (a compaction), so they are whole or the store is damaged. Every
record after them is the **log**: appended (``O_APPEND``) as the memory learns, fsynced by a thread
of the store's own every ``sync_s`` seconds or ``sync_requests`` records, whichever comes first. A
kill can only tear the record being written: loading stops at the first record that is incomplete or
fails its checksum and the store is cut there (the **torn tail**).

Replaying the records in order on an empty memory of the same budget and tenant cap gives back what
the memory held when the last one was written: eviction by budget is deterministic and not logged;
an eviction by the tenant LRU, which depends on reads too, is, in the record of the document that
caused it (``EVICT``: one record, so a torn write loses the learn and the eviction together, never
the victim alone). A compaction rewrites the file as a snapshot of what the memory holds, in
the order it was learned, into a temporary file, fsyncs it, appends what was logged meanwhile, and
``os.replace``-s it over the store, then fsyncs the directory.

Formats ``power-suffix.store/2`` (``PWRSFX2\\n``: /3 without ``EVICT``, the LRU's eviction a
``FORGET`` before the document) and ``/1`` (``PWRSFX1\\n``, one sha256 over the whole body, written
only at close) are still read, and rewritten as /3 on open. A store whose magic names another
version is refused (:class:`~power_core.errors.ArtifactMismatch`, ``suffix_store_format``), never
moved aside: a newer power-suffix may have written it.

``DIR/suffix-memory.lock`` is ``flock``-ed while a memory has the store open: one writer per store.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import numpy as np

from power_core.errors import ArtifactError, ArtifactMismatch
from power_core.logs import get_logger

try:  # POSIX: one writer per store directory
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock
    fcntl = None  # type: ignore[assignment]

__all__ = ["CLEAR", "DOC", "EVICT", "FORGET", "HEADER", "STORE_FILE", "STORE_FORMAT", "STORE_FORMAT_V1", "STORE_FORMAT_V2", "LOCK_FILE",
           "DirLock", "Op", "Parsed", "StoreBusy", "StoreLog", "doc_record", "forget_record", "clear_record",
           "learn_record",
           "cut_tail", "file_identity", "fsync_dir", "move_aside", "parse_store", "unwritable", "write_snapshot"]

log = get_logger(__name__)

STORE_FILE = "suffix-memory.bin"
LOCK_FILE = "suffix-memory.lock"
STORE_FORMAT = "power-suffix.store/3"
STORE_FORMAT_V2 = "power-suffix.store/2"
STORE_FORMAT_V1 = "power-suffix.store/1"
MAGIC = b"PWRSFX3\n"
MAGIC_V2 = b"PWRSFX2\n"
MAGIC_V1 = b"PWRSFX1\n"
_OTHER_VERSION = re.compile(rb"PWRSFX([0-9]+)\n")
TMP_PREFIX = ".suffix-memory."
TMP_SUFFIX = ".tmp"

HEADER, DOC, FORGET, CLEAR, EVICT = 1, 2, 3, 4, 5
_REC = struct.Struct("<IIB")  # crc32, payload length, kind
_LEN_KIND = struct.Struct("<IB")
#: the longest payload a record may declare: a document of the largest budget (2**26 tokens) and its
#: tenant; a longer length is damage (and no allocation follows it)
RECORD_MAX = (1 << 28) + (1 << 20)
#: a compaction writes its snapshot in chunks of about this many bytes
_CHUNK = 1 << 20

#: (kind, tenant, tokens): what one record asks of the memory (tokens only for DOC; tenant "" for CLEAR)
Op = tuple[int, str, "np.ndarray | None"]


# -- records ---------------------------------------------------------------------------------------------
def _record(kind: int, payload: bytes) -> bytes:
    head = _LEN_KIND.pack(len(payload), kind)
    return struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + head + payload


def _doc_payload(tenant: str, doc: np.ndarray) -> bytes:
    t = tenant.encode("utf-8")
    return struct.pack("<I", len(t)) + t + doc.astype("<i4", copy=False).tobytes()


def doc_record(tenant: str, doc: np.ndarray) -> bytes:
    return _record(DOC, _doc_payload(tenant, doc))


def learn_record(tenant: str, doc: np.ndarray, evicted: Sequence[str]) -> bytes:
    """The record of one learn: a DOC, or an EVICT where the tenant LRU dropped ``evicted`` to make room
    (one record: a kill that tears it loses the eviction with the learn)."""
    if not evicted:
        return doc_record(tenant, doc)
    victims = [v.encode("utf-8") for v in evicted]
    head = struct.pack("<I", len(victims)) + b"".join(struct.pack("<I", len(v)) + v for v in victims)
    return _record(EVICT, head + _doc_payload(tenant, doc))


def doc_record_size(tenant: str, n_tokens: int) -> int:
    """Bytes of :func:`doc_record` for a document of ``n_tokens`` (what a snapshot holds per document)."""
    return _REC.size + 4 + len(tenant.encode("utf-8")) + 4 * n_tokens


def forget_record(tenant: str) -> bytes:
    return _record(FORGET, tenant.encode("utf-8"))


def clear_record() -> bytes:
    return _record(CLEAR, b"")


def _header_record(vocab: str, snapshot: int) -> bytes:
    body = json.dumps({"format": STORE_FORMAT, "vocab_sha256": vocab, "snapshot": snapshot,
                       "created": round(time.time(), 3)}, sort_keys=True).encode()
    return _record(HEADER, body)


def _read_record(blob: bytes, at: int) -> tuple[int, memoryview, int] | None:
    """The record at ``at``: (kind, payload, end), or ``None`` where it is incomplete or fails its checksum."""
    if at + _REC.size > len(blob):
        return None
    crc, n, kind = _REC.unpack_from(blob, at)
    end = at + _REC.size + n
    if n > RECORD_MAX or end > len(blob):
        return None
    payload = memoryview(blob)[at + _REC.size:end]
    if zlib.crc32(payload, zlib.crc32(memoryview(blob)[at + 4:at + _REC.size])) != crc:
        return None
    return kind, payload, end


def _decode_doc(payload: memoryview, at: int) -> Op:
    (tl,) = struct.unpack_from("<I", payload, at)
    rest = len(payload) - at - 4 - tl
    if rest < 0 or rest % 4:
        raise ValueError(f"a document of {len(payload) - at} bytes with a tenant of {tl}")
    tenant = bytes(payload[at + 4:at + 4 + tl]).decode("utf-8")
    tokens = (np.frombuffer(payload, dtype="<i4", count=rest // 4, offset=at + 4 + tl).astype(np.int32)
              if rest else np.zeros(0, dtype=np.int32))
    return DOC, tenant, tokens


def _decode(kind: int, payload: memoryview, version: int) -> list[Op]:
    """The ops of a checksummed record (ValueError, UnicodeDecodeError or struct.error: not a record of
    this format ``version``)."""
    if kind == DOC:
        return [_decode_doc(payload, 0)]
    if kind == FORGET:
        return [(FORGET, bytes(payload).decode("utf-8"), None)]
    if kind == CLEAR:
        if len(payload):
            raise ValueError("a CLEAR record with a payload")
        return [(CLEAR, "", None)]
    if kind == EVICT and version >= 3:
        (n,) = struct.unpack_from("<I", payload, 0)
        if not 1 <= n <= (len(payload) - 8) // 4:  # each victim's length, and the DOC's tenant length
            raise ValueError(f"an eviction of {n} tenants in a record of {len(payload)} bytes")
        ops: list[Op] = []
        at = 4
        for _ in range(n):
            (vl,) = struct.unpack_from("<I", payload, at)
            if at + 4 + vl > len(payload):
                raise ValueError(f"an eviction's tenant of {vl} bytes runs past its record")
            ops.append((FORGET, bytes(payload[at + 4:at + 4 + vl]).decode("utf-8"), None))
            at += 4 + vl
        return [*ops, _decode_doc(payload, at)]
    raise ValueError(f"a record of kind {kind}")


# -- parsing -----------------------------------------------------------------------------------------------
@attrs.frozen
class Parsed:
    """A store read and checked: its format version, its ops in order (an EVICT record is its FORGETs
    then its DOC), how many records its snapshot and its log hold, where the valid part ends and how
    many bytes of torn tail follow it."""

    version: int
    ops: list[Op]
    snapshot: int
    records: int
    valid_bytes: int
    torn_bytes: int

    @property
    def documents(self) -> int:
        return sum(1 for kind, _, _ in self.ops if kind == DOC)


def corrupt(path: Path, what: str) -> ArtifactError:
    return ArtifactError(f"{path}: the suffix store is truncated or corrupt ({what}); delete it to start afresh",
                         reason="suffix_store_corrupt", evidence=str(path))


def _mismatch(path: Path, theirs: object, vocab: str) -> ArtifactMismatch:
    return ArtifactMismatch(f"{path}: the suffix store was learned with another vocabulary ({str(theirs)[:12]}…, "
                            f"this model's is {vocab[:12]}…); its token ids mean other text here. Use another "
                            "--suffix-store directory for this model", reason="suffix_store_mismatch",
                            evidence="vocab_sha256")


def parse_store(path: Path, blob: bytes, vocab: str) -> Parsed:
    """Check and read a store's bytes. Another vocabulary, or another version's magic, is
    :class:`ArtifactMismatch` (whatever follows); a damaged magic, header or snapshot is an
    :class:`ArtifactError` (``suffix_store_corrupt``); a damaged log record ends the valid part (the
    torn tail, :attr:`Parsed.torn_bytes`)."""
    if blob.startswith(MAGIC_V1):
        return _parse_v1(path, blob, vocab)
    if blob.startswith(MAGIC):
        version, fmt = 3, STORE_FORMAT
    elif blob.startswith(MAGIC_V2):
        version, fmt = 2, STORE_FORMAT_V2
    else:
        other = _OTHER_VERSION.match(blob[:16])
        if other is not None and other.group(1) not in (b"1", b"2", b"3"):
            raise ArtifactMismatch(f"{path}: a suffix store of format version {other.group(1).decode()}, written by "
                                   f"another power-suffix; this one reads {STORE_FORMAT_V1} to {STORE_FORMAT}. Use "
                                   "that version, or another --suffix-store directory", reason="suffix_store_format",
                                   evidence="magic")
        raise corrupt(path, "not a power-suffix store, or cut short")
    first = _read_record(blob, len(MAGIC))
    if first is None or first[0] != HEADER:
        raise corrupt(path, "its header record is damaged")
    kind, payload, at = first
    snapshot = _header(path, bytes(payload), fmt, "snapshot", vocab)
    ops: list[Op] = []
    records = 0
    while at < len(blob):
        rec = _read_record(blob, at)
        if rec is None:
            break
        kind, payload, end = rec
        try:
            ops += _decode(kind, payload, version)
        except (ValueError, UnicodeDecodeError, struct.error) as exc:
            raise corrupt(path, f"record {records} at byte {at}: {exc}") from None
        records += 1
        at = end
    if records < snapshot:
        raise corrupt(path, f"its snapshot holds {records} whole records of {snapshot}")
    return Parsed(version=version, ops=ops, snapshot=snapshot, records=records, valid_bytes=at,
                  torn_bytes=len(blob) - at)


def _header(path: Path, raw: bytes, expected: str, count_key: str, vocab: str) -> int:
    """A store header's count (``count_key``), once its format is ``expected`` and its vocabulary ``vocab``."""
    try:
        header = json.loads(raw)
        fmt, theirs, count = header["format"], header["vocab_sha256"], int(header[count_key])
    except (ValueError, KeyError, TypeError) as exc:
        raise corrupt(path, f"unreadable header: {exc}") from None
    if fmt != expected:
        raise corrupt(path, f"format {fmt!r}, expected {expected!r}")
    if theirs != vocab:
        raise _mismatch(path, theirs, vocab)
    return count


def _parse_v1(path: Path, blob: bytes, vocab: str) -> Parsed:
    """``power-suffix.store/1``: MAGIC_V1, sha256(body), body = u32 header length, JSON header, then per
    document u32 tenant length, u64 token count, the tenant, the tokens (i32le)."""
    if len(blob) < len(MAGIC_V1) + 32 + 4:
        raise corrupt(path, "not a power-suffix store, or cut short")
    digest, body = blob[len(MAGIC_V1):len(MAGIC_V1) + 32], blob[len(MAGIC_V1) + 32:]
    if hashlib.sha256(body).digest() != digest:
        raise corrupt(path, "its sha256 does not match its contents")
    (n,) = struct.unpack_from("<I", body, 0)
    count = _header(path, body[4:4 + n], STORE_FORMAT_V1, "documents", vocab)
    at = 4 + n
    ops: list[Op] = []
    try:
        for _ in range(count):
            tl, dl = struct.unpack_from("<IQ", body, at)
            at += 12
            tenant = body[at:at + tl].decode("utf-8")
            at += tl
            end = at + 4 * dl
            if end > len(body):
                raise ValueError("a document runs past the end")
            ops.append((DOC, tenant, np.frombuffer(body, dtype="<i4", count=dl, offset=at).astype(np.int32)))
            at = end
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise corrupt(path, str(exc)) from None
    if at != len(body):
        raise corrupt(path, f"{len(body) - at} bytes after the last document")
    return Parsed(version=1, ops=ops, snapshot=len(ops), records=len(ops), valid_bytes=len(blob), torn_bytes=0)


# -- files -------------------------------------------------------------------------------------------------
def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(directory: Path) -> None:
    """fsync ``directory`` (a rename or a new file in it is durable once this returns)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:  # pragma: no cover - a filesystem that cannot fsync a directory
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _snapshot_tmp(directory: Path, vocab: str, docs: Iterable[tuple[str, np.ndarray]]) -> tuple[int, str, int, int]:
    """A new store holding ``docs`` as its snapshot in a temporary file of ``directory``, fsynced:
    (its open descriptor, positioned at the end, its path, its size, its records)."""
    items = list(docs)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=TMP_PREFIX, suffix=TMP_SUFFIX)
    try:
        size = 0
        parts = [MAGIC, _header_record(vocab, len(items))]
        pending = sum(len(p) for p in parts)
        for tenant, doc in items:
            rec = doc_record(tenant, doc)
            parts.append(rec)
            pending += len(rec)
            if pending >= _CHUNK:
                data = b"".join(parts)
                _write_all(fd, data)
                size += len(data)
                parts, pending = [], 0
        data = b"".join(parts)
        _write_all(fd, data)
        size += len(data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return fd, tmp, size, len(items)


def write_snapshot(directory: Path, vocab: str, docs: Iterable[tuple[str, np.ndarray]]) -> Path:
    """Write a store of ``docs`` to ``directory`` atomically and durably (the file fsynced before the
    rename, the directory after): a crash leaves the old store or the new one. OSError as it comes."""
    fd, tmp, _, _ = _snapshot_tmp(directory, vocab, docs)
    os.close(fd)
    path = directory / STORE_FILE
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    return path


def unwritable(path: Path, exc: OSError) -> ArtifactError:
    """The error for a store that cannot be written at ``path`` (the previous one, if any, is unchanged)."""
    return ArtifactError(f"{path}: cannot write the suffix store ({exc}); the previous store, if any, is "
                         "unchanged", reason="suffix_store_unwritable", evidence=str(path))


def file_identity(path: Path) -> tuple[int, int, int] | None:
    """``path``'s inode, size and modification time (``None``: it is gone): has the file changed since?"""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def cut_tail(path: Path, length: int) -> None:
    """Cut ``path`` to ``length`` bytes, durably (a torn tail)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, length)
        os.fsync(fd)
    finally:
        os.close(fd)


def move_aside(path: Path) -> Path:
    """Rename a damaged store to ``<name>.corrupt-<UTC time>`` (``-N`` added if taken), durably."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    i = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{i}")
        i += 1
    os.replace(path, aside)
    fsync_dir(path.parent)
    return aside


def remove_stale_tmp(directory: Path) -> int:
    """Delete the temporary files a compaction killed midway left (call with the directory locked)."""
    n = 0
    for p in directory.glob(f"{TMP_PREFIX}*{TMP_SUFFIX}"):
        try:
            p.unlink()
            n += 1
        except OSError:  # pragma: no cover
            pass
    return n


class StoreBusy(Exception):
    """Another process (or memory) holds the store directory's lock."""


class DirLock:
    """An exclusive ``flock`` on ``directory/suffix-memory.lock`` (released by :meth:`release`, or by
    the kernel when the process dies); :class:`StoreBusy` when another holder has it."""

    def __init__(self, directory: Path) -> None:
        self._fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(self._fd)
                self._fd = -1
                raise StoreBusy(str(directory)) from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1


# -- the open store ----------------------------------------------------------------------------------------
class StoreLog:
    """A store opened for appending (its directory locked): :meth:`append` writes records at once (a
    kill of the process loses none of them: they are in the kernel), a thread of its own fsyncs them
    every ``sync_s`` seconds or once ``sync_requests`` are waiting, whichever comes first (a power cut
    loses at most those), and calls ``tick`` after each wake (the memory compacts from there).

    ``tick`` should be a :class:`weakref.WeakMethod`-like callable returning the bound method or
    ``None``: the thread holds no reference to the memory, and closes the store once it is gone.

    A write or fsync that fails marks the store failed (logged, counted): nothing more is appended
    and the memory goes on in RAM until a compaction succeeds (:meth:`finish_compaction`)."""

    def __init__(self, directory: Path, vocab: str, lock: DirLock, *, sync_s: float, sync_requests: int,
                 snapshot_records: int = 0, records: int = 0,
                 tick: Callable[[], Callable[[], None] | None] | None = None) -> None:
        self.directory = directory
        self.path = directory / STORE_FILE
        self.vocab = vocab
        self.sync_s = float(sync_s)
        self.sync_requests = int(sync_requests)
        self._lock_file = lock
        self._cond = threading.Condition(threading.Lock())  # appends, and the counters
        self._io = threading.Lock()  # fsyncs, compactions and close: never two at once
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.size = os.fstat(self._fd).st_size
        self.snapshot_records = snapshot_records
        self.records = records  # whole records after the header
        self.appended = 0  # records this process appended
        self.synced = 0  # of those, how many are fsynced
        self.syncs = 0
        self.compactions = 0
        self.write_errors = 0
        self.last_sync: float | None = None
        self.failed_at: float | None = None
        self._tail: list[bytes] | None = None  # the records appended during a compaction
        self._tick = tick
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def failed(self) -> bool:
        return self.failed_at is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="power-suffix-store", daemon=True)
        self._thread.start()

    # -- appending ------------------------------------------------------------------------------------------
    def append(self, record: bytes) -> None:
        """Write one ``record`` at the end of the store (call in the memory's order: under its lock). One
        call, one record, one ``write``: what a change of the memory needs is one record (a learn that
        evicts tenants is one ``EVICT``), so a torn write loses that change whole."""
        with self._cond:
            if self._fd < 0:
                return
            if self._tail is not None:  # a compaction is writing its snapshot: this goes after it too
                self._tail.append(record)
            if self.failed_at is not None:
                return
            try:
                _write_all(self._fd, record)
            except OSError as exc:
                self._fail("write", exc)
                return
            self.size += len(record)
            self.records += 1
            self.appended += 1
            if self.appended - self.synced >= self.sync_requests:
                self._cond.notify_all()

    def _fail(self, what: str, exc: OSError) -> None:
        """(with ``_cond`` held)"""
        self.write_errors += 1
        if self.failed_at is None:
            log.error("suffix.store_write_failed", path=str(self.path), op=what, error=f"{type(exc).__name__}: {exc}",
                      consequence="the memory goes on in RAM; a compaction retries the store")
        self.failed_at = time.monotonic()

    def sync(self) -> None:
        """fsync what was appended so far (blocking; the thread does this on its own)."""
        with self._io:
            with self._cond:
                if self._fd < 0 or self.failed_at is not None or self.synced >= self.appended:
                    return
                fd, upto = self._fd, self.appended
            try:
                os.fsync(fd)
            except OSError as exc:
                with self._cond:
                    self._fail("fsync", exc)
                return
            with self._cond:
                self.synced = max(self.synced, upto)
                self.syncs += 1
                self.last_sync = time.time()

    # -- compaction ---------------------------------------------------------------------------------------
    def begin_compaction(self) -> None:
        """From now on appends are kept for the snapshot being written (call under the memory's lock,
        with the documents the snapshot will hold taken under the same hold)."""
        with self._cond:
            self._tail = []

    def abort_compaction(self) -> None:
        with self._cond:
            self._tail = None

    def finish_compaction(self, docs: Iterable[tuple[str, np.ndarray]]) -> None:
        """Write ``docs`` as a new store's snapshot, fsync it, append what was logged since
        :meth:`begin_compaction`, fsync, replace the store with it, fsync the directory, and append
        to it from then on. OSError: the store is as it was (the temporary file removed)."""
        with self._io:
            try:
                fd, tmp, size, n = _snapshot_tmp(self.directory, self.vocab, docs)
            except BaseException:
                self.abort_compaction()
                raise
            with self._cond:
                tail, self._tail = self._tail or [], None
                try:
                    data = b"".join(tail)
                    if data:
                        _write_all(fd, data)
                        os.fsync(fd)
                    os.replace(tmp, self.path)
                except BaseException:
                    os.close(fd)
                    Path(tmp).unlink(missing_ok=True)
                    raise
                old, self._fd = self._fd, fd
                self.size = size + len(data)
                self.snapshot_records = n
                self.records = n + len(tail)
                self.synced = self.appended  # everything appended is in the new file, fsynced
                self.last_sync = time.time()
                recovered = self.failed_at is not None
                self.failed_at = None
                self.compactions += 1
                try:
                    fsync_dir(self.directory)
                except OSError as exc:
                    self._fail("fsync of the directory", exc)
            if old >= 0:
                os.close(old)
        if recovered:
            log.warning("suffix.store_recovered", path=str(self.path), records=self.records)
        log.debug("suffix.store_compacted", path=str(self.path), records=self.records, bytes=self.size)

    # -- the thread, and closing -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._stopping and self.appended - self.synced < self.sync_requests:
                    self._cond.wait(self.sync_s)
                if self._stopping:
                    return
            self.sync()
            tick = self._tick() if self._tick is not None else None
            if self._tick is not None and tick is None:  # the memory is gone
                self.close()
                return
            if tick is not None:
                try:
                    tick()
                except Exception as exc:  # never let the thread die: the next tick retries
                    log.warning("suffix.store_tick_failed", path=str(self.path), error=f"{type(exc).__name__}: {exc}")

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the thread (waiting up to ``timeout`` for a compaction it runs)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def close(self) -> None:
        """Stop the thread, fsync what is left, close the file and unlock the directory."""
        self.stop()
        self.sync()
        with self._io, self._cond:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        self._lock_file.release()

    @property
    def closed(self) -> bool:
        return self._fd < 0

