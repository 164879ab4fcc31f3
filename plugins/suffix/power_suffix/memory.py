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
  so the memory never holds more than the budget.
* **corpus**: files tokenized once (``spec_suffix_corpus``: a codebase, docs), never evicted, read by
  every tenant (the operator's text, not a tenant's), the equivalent of llama.cpp's static lookup
  cache over suffixes.

A query returns the candidate with the longest match, then the most occurrences, then the newest
(the request's own index is consulted by the proposer first and wins ties). Proposals depend only on
the request's history and what the memory holds, never on timing or acceptance statistics.

The learned part can be saved to a store directory and loaded again (:meth:`SuffixMemory.save`,
:meth:`SuffixMemory.load`): a versioned file with a sha256 over its body, bound to the model's
vocabulary digest. A store of another vocabulary is :class:`~power_core.errors.ArtifactMismatch`;
a truncated or corrupt one :class:`~power_core.errors.ArtifactError` (reason
``suffix_store_corrupt``). The memory is thread-safe: one may serve every session and engine of a
process (:func:`power_suffix.share_memory`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import numpy as np

from power_core.errors import ArtifactError, ArtifactMismatch, ConfigError
from power_core.logs import get_logger
from power_suffix.index import MAX_MATCH, SEPARATOR, Match, SuffixIndex, suffix_hashes

__all__ = ["SHARED_LENGTHS", "SEGMENTS", "STORE_FILE", "STORE_FORMAT", "Found", "MemoryStats", "SuffixMemory",
           "corpus_files"]

log = get_logger(__name__)

#: suffix lengths the shared and corpus indexes hash (a longer match is measured exactly by
#: extension; the request's own index covers the short ones)
SHARED_LENGTHS = (2, 4, 8, 16, 32)
#: the budget is kept in this many segments; eviction drops the oldest whole segment
SEGMENTS = 8
STORE_FORMAT = "power-suffix.store/1"
STORE_FILE = "suffix-memory.bin"
_MAGIC = b"PWRSFX1\n"
#: corpus files larger than this are skipped (with a log line): a corpus is text, not data
CORPUS_FILE_MAX = 16 << 20
_TEXT_SUFFIXES_SKIPPED = frozenset({".png", ".jpg", ".jpeg", ".gif", ".pdf", ".zip", ".gz", ".bz2", ".xz", ".so",
                                    ".o", ".a", ".pyc", ".bin", ".gguf", ".safetensors", ".whl", ".tar"})


@attrs.frozen
class Found:
    """A memory's best continuation for a history: the match and which index it came from."""

    match: Match
    source: str  # "shared" or "corpus"


@attrs.frozen
class MemoryStats:
    """What a memory holds: learned tokens (all tenants), their budget, segments, documents,
    tenants, corpus tokens, and the documents evicted so far."""

    tokens: int
    budget_tokens: int
    segments: int
    documents: int
    tenants: int
    corpus_tokens: int
    evicted_documents: int


@attrs.define(eq=False)
class _Segment:
    """Documents of one tenant, in one index, in the order they arrived."""

    tenant: str
    serial: int
    index: SuffixIndex = attrs.field(factory=lambda: SuffixIndex(SHARED_LENGTHS, truncatable=False))
    docs: list[np.ndarray] = attrs.field(factory=list)
    tokens: int = 0

    def add(self, doc: np.ndarray) -> None:
        self.index.extend(doc)
        self.index.extend([SEPARATOR])
        self.docs.append(doc)
        self.tokens += int(doc.shape[0])


def corpus_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The files of ``paths`` (files, or directories walked in name order, hidden entries skipped),
    or :class:`ConfigError` naming ``spec_suffix_corpus`` for a path that does not exist."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                out.extend(Path(root) / f for f in sorted(files) if not f.startswith("."))
        else:
            raise ConfigError("spec_suffix_corpus", str(raw), "existing files or directories")
    return [f for f in out if f.suffix.lower() not in _TEXT_SUFFIXES_SKIPPED]


class SuffixMemory:
    """Cross-request and corpus suffix indexes, bound to one vocabulary (``vocab_digest``).

    ``budget_tokens``: the most learned tokens held (0: learns nothing; the corpus is apart);
    ``learn_prompts``: prompts are learned too, not only outputs; ``share_tenants``: every tenant
    is offered every tenant's documents (a timing channel; see the module's documentation)."""

    def __init__(self, vocab_digest: str, *, budget_tokens: int = 1 << 18, learn_prompts: bool = False,
                 share_tenants: bool = False) -> None:
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 0:
            raise ConfigError("spec_suffix_memory_tokens", budget_tokens, "an integer >= 0")
        self.vocab_digest = vocab_digest
        self.budget_tokens = budget_tokens
        self.learn_prompts = learn_prompts
        self.share_tenants = share_tenants
        self._lock = threading.RLock()
        self._segments: list[_Segment] = []  # oldest first
        self._open: dict[str, _Segment] = {}  # per tenant, the segment new documents go to
        self._serial = 0
        self._tokens = 0
        self._evicted = 0
        self._corpus: SuffixIndex | None = None
        self._corpus_tokens = 0
        self._users = 0
        #: where :meth:`close` saves the learned documents (``None``: nowhere)
        self.store: Path | None = None

    # -- learning ------------------------------------------------------------------------------------
    @property
    def segment_tokens(self) -> int:
        return max(1, self.budget_tokens // SEGMENTS)

    def learn(self, tenant: str, tokens: Sequence[int] | np.ndarray) -> None:
        """Add one document (a request's output, or prompt and output) under ``tenant``; the oldest
        segments go when the budget would be exceeded. A document longer than the budget keeps its
        last ``budget_tokens`` tokens. A segment takes documents up to ``segment_tokens`` (one
        longer document has a segment of its own), so what eviction drops is never the newest."""
        doc = np.array(tokens, dtype=np.int32).ravel()  # a copy: the caller may reuse its buffer (a proposer's index)
        if self.budget_tokens == 0 or doc.shape[0] < 2:
            return
        if doc.shape[0] > self.budget_tokens:
            doc = doc[-self.budget_tokens:]
        with self._lock:
            seg = self._open.get(tenant)
            if seg is None or (seg.docs and seg.tokens + doc.shape[0] > self.segment_tokens):
                self._serial += 1
                seg = _Segment(tenant=tenant, serial=self._serial)
                self._segments.append(seg)
                self._open[tenant] = seg
            seg.add(doc)
            self._tokens += int(doc.shape[0])
            while self._tokens > self.budget_tokens and self._segments:
                old = self._segments.pop(0)
                self._tokens -= old.tokens
                self._evicted += len(old.docs)
                if self._open.get(old.tenant) is old:
                    del self._open[old.tenant]

    def clear(self) -> None:
        """Forget every learned document (the corpus stays)."""
        with self._lock:
            self._segments.clear()
            self._open.clear()
            self._tokens = 0

    # -- the corpus ----------------------------------------------------------------------------------
    def add_corpus(self, paths: Sequence[str | os.PathLike[str]], encode: Callable[[str], np.ndarray], *,
                   progress: bool = True) -> int:
        """Tokenize the files of ``paths`` (:func:`corpus_files`) with ``encode`` into the corpus
        index (one document per file), with a progress bar on a terminal; returns the tokens added."""
        files = corpus_files(paths)
        added = 0
        index = SuffixIndex(SHARED_LENGTHS, truncatable=False)
        with _progress(progress, len(files)) as advance:
            for f in files:
                try:
                    if f.stat().st_size > CORPUS_FILE_MAX:
                        log.warning("suffix.corpus_skipped", path=str(f), reason="larger than 16 MiB")
                        continue
                    text = f.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as exc:
                    log.warning("suffix.corpus_skipped", path=str(f), reason=f"{type(exc).__name__}: {exc}")
                    continue
                finally:
                    advance()
                ids = np.asarray(encode(text), dtype=np.int32).ravel()
                if ids.shape[0] < 2:
                    continue
                index.extend(ids)
                index.extend([SEPARATOR])
                added += int(ids.shape[0])
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
        nothing here has a ``(length, occurrences)`` above ``beat`` (the caller's own match)."""
        best: Found | None = None
        query = np.asarray(history)[-MAX_MATCH:]
        hashes = suffix_hashes(query, SHARED_LENGTHS)  # the same for every index here
        with self._lock:
            for seg in reversed(self._segments):  # newest first: a tie keeps the newer
                if seg.tenant != tenant and not self.share_tenants:
                    continue
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
                               documents=sum(len(s.docs) for s in self._segments),
                               tenants=len({s.tenant for s in self._segments}), corpus_tokens=self._corpus_tokens,
                               evicted_documents=self._evicted)

    def documents(self, tenant: str) -> list[np.ndarray]:
        """``tenant``'s learned documents, oldest first (copies)."""
        with self._lock:
            return [d.copy() for s in self._segments if s.tenant == tenant for d in s.docs]

    # -- users (proposers), and saving when the last one closes -------------------------------------
    def acquire(self) -> None:
        with self._lock:
            self._users += 1

    def release(self) -> None:
        """One user closed; when none is left, the learned documents are saved to :attr:`store`."""
        with self._lock:
            self._users = max(0, self._users - 1)
            last = self._users == 0
        if last and self.store is not None:
            self.save(self.store)

    # -- the store -----------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write the learned documents to ``directory``/``STORE_FILE`` (atomically: a reader never
        sees a half-written store). The corpus is not saved (it is read from its files)."""
        with self._lock:
            docs = [(s.tenant, d) for s in self._segments for d in s.docs]
        header = json.dumps({"format": STORE_FORMAT, "vocab_sha256": self.vocab_digest, "documents": len(docs)},
                            sort_keys=True).encode()
        parts = [struct.pack("<I", len(header)), header]
        for tenant, doc in docs:
            t = tenant.encode("utf-8")
            parts += [struct.pack("<IQ", len(t), doc.shape[0]), t, doc.astype("<i4").tobytes()]
        body = b"".join(parts)
        out = Path(directory)
        path = out / STORE_FILE
        tmp: str | None = None
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=out, prefix=".suffix-memory.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(body).digest() + body)
            os.replace(tmp, path)
        except OSError as exc:
            raise ArtifactError(f"{path}: cannot write the suffix store ({exc}); the previous store, if any, is "
                                "unchanged", reason="suffix_store_unwritable", evidence=str(path)) from None
        finally:
            if tmp is not None and Path(tmp).exists():
                Path(tmp).unlink()
        log.info("suffix.store_saved", path=str(path), documents=len(docs))
        return path

    def load(self, directory: str | os.PathLike[str]) -> int:
        """Learn the documents of the store in ``directory`` (none there: nothing, 0); returns how many.
        The whole store is read and checked before anything is learned: a store that fails a check
        leaves the memory as it was."""
        path = Path(directory) / STORE_FILE
        if not path.exists():
            return 0
        try:
            blob = path.read_bytes()
        except OSError as exc:
            raise ArtifactError(f"{path}: cannot read the suffix store ({exc})", reason="suffix_store_corrupt",
                                evidence=str(path)) from None
        docs = _parse_store(path, blob, self.vocab_digest)
        for tenant, doc in docs:
            self.learn(tenant, doc)
        log.info("suffix.store_loaded", path=str(path), documents=len(docs))
        return len(docs)


def _corrupt(path: Path, what: str) -> ArtifactError:
    return ArtifactError(f"{path}: the suffix store is truncated or corrupt ({what}); delete it to start afresh",
                         reason="suffix_store_corrupt", evidence=str(path))


def _parse_store(path: Path, blob: bytes, vocab: str) -> list[tuple[str, np.ndarray]]:
    if len(blob) < len(_MAGIC) + 32 + 4 or not blob.startswith(_MAGIC):
        raise _corrupt(path, "not a power-suffix store, or cut short")
    digest, body = blob[len(_MAGIC):len(_MAGIC) + 32], blob[len(_MAGIC) + 32:]
    if hashlib.sha256(body).digest() != digest:
        raise _corrupt(path, "its sha256 does not match its contents")
    (n,) = struct.unpack_from("<I", body, 0)
    try:
        header = json.loads(body[4:4 + n])
        fmt, theirs, count = header["format"], header["vocab_sha256"], int(header["documents"])
    except (ValueError, KeyError, TypeError) as exc:
        raise _corrupt(path, f"unreadable header: {exc}") from None
    if fmt != STORE_FORMAT:
        raise _corrupt(path, f"format {fmt!r}, expected {STORE_FORMAT!r}")
    if theirs != vocab:
        raise ArtifactMismatch(f"{path}: the suffix store was learned with another vocabulary ({str(theirs)[:12]}…, "
                               f"this model's is {vocab[:12]}…); its token ids mean other text here. Use another "
                               "--suffix-store directory for this model", reason="suffix_store_mismatch",
                               evidence="vocab_sha256")
    at = 4 + n
    docs: list[tuple[str, np.ndarray]] = []
    try:
        for _ in range(count):
            tl, dl = struct.unpack_from("<IQ", body, at)
            at += 12
            tenant = body[at:at + tl].decode("utf-8")
            at += tl
            end = at + 4 * dl
            if end > len(body):
                raise ValueError("a document runs past the end")
            docs.append((tenant, np.frombuffer(body, dtype="<i4", count=dl, offset=at).astype(np.int32)))
            at = end
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise _corrupt(path, str(exc)) from None
    if at != len(body):
        raise _corrupt(path, f"{len(body) - at} bytes after the last document")
    return docs


class _progress:
    """A rich progress bar over ``total`` files when asked and on a terminal; else nothing."""

    def __init__(self, show: bool, total: int) -> None:
        self.show, self.total = show, total
        self._bar: object | None = None

    def __enter__(self) -> Callable[[], None]:
        import sys

        if not self.show or not sys.stderr.isatty() or self.total == 0:
            return lambda: None
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("suffix corpus", total=self.total)
        self._bar = bar
        return lambda: bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        from rich.progress import Progress

        if isinstance(self._bar, Progress):
            self._bar.stop()
