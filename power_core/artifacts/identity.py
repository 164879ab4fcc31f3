"""Artifact identity: streaming sha256 with a cached result, and a cheap vocabulary digest.

The file digest is cached by ``(realpath, size, mtime_ns, inode, device)`` in
``$POWER_CACHE_DIR/digests`` (default: the platform user cache dir, ``power/digests``), one small
JSON file per key, written atomically. Any change to the file's stat identity misses the cache.
A progress bar (rich) is shown on a terminal for files of at least ``PROGRESS_MIN_BYTES``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import attrs

from power_core.errors import ArtifactError
from power_core.logs import get_logger

__all__ = ["Digest", "file_digest", "sha256_file", "vocab_digest", "cache_dir", "STATS", "PROGRESS_MIN_BYTES"]

log = get_logger(__name__)
PROGRESS_MIN_BYTES = 256 << 20
_CHUNK = 8 << 20
#: process-wide counters (tests read them; they never affect behaviour)
STATS: dict[str, int] = {"hashed": 0, "cache_hits": 0, "bytes_hashed": 0}


@attrs.frozen
class Digest:
    """A file's sha256, its size, and whether it came from the cache."""

    sha256: str
    size: int
    cached: bool


def cache_dir() -> Path:
    """Where digests are cached: ``$POWER_CACHE_DIR/digests`` or the user cache dir."""
    root = os.environ.get("POWER_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("power", appauthor=False)
    return Path(root) / "digests"


def _stat_key(path: str) -> tuple[str, os.stat_result]:
    real = os.path.realpath(path)
    st = os.stat(real)
    ident = f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_dev}"
    return hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest(), st


def _cache_get(key: str, size: int) -> str | None:
    try:
        data = json.loads((cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    sha = data.get("sha256") if isinstance(data, dict) else None
    if isinstance(sha, str) and len(sha) == 64 and data.get("size") == size:
        return sha
    return None


def _cache_put(key: str, path: str, size: int, sha: str) -> None:
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"sha256": sha, "size": size, "path": path}))
        os.replace(tmp, d / f"{key}.json")
    except OSError as exc:  # a read-only cache only costs time
        log.debug("artifact.digest_cache_unwritable", dir=str(d), error=str(exc))


def _progress_wanted(progress: bool | None, size: int) -> bool:
    if progress is not None:
        return progress
    return size >= PROGRESS_MIN_BYTES and sys.stderr.isatty()


def file_digest(path: str | os.PathLike[str], *, progress: bool | None = None, use_cache: bool = True,
                console: Any = None) -> Digest:
    """sha256 of the whole file, streamed; cached by stat identity. ``progress=None``: on a terminal, large files."""
    p = os.fspath(path)
    try:
        key, st = _stat_key(p)
    except FileNotFoundError:
        raise ArtifactError(f"{p}: no such file; check the path", reason="file_not_found", evidence=p) from None
    except OSError as exc:
        raise ArtifactError(f"{p}: cannot stat ({exc.strerror})", reason="file_unreadable", evidence=p) from None
    if use_cache:
        hit = _cache_get(key, st.st_size)
        if hit is not None:
            STATS["cache_hits"] += 1
            return Digest(hit, st.st_size, True)
    try:
        with open(p, "rb") as f:
            sha = _hash_stream(f, st.st_size, os.path.basename(p), _progress_wanted(progress, st.st_size), console)
    except OSError as exc:
        raise ArtifactError(f"{p}: read failed while hashing ({exc})", reason="file_unreadable", evidence=p) from None
    STATS["hashed"] += 1
    STATS["bytes_hashed"] += st.st_size
    if use_cache:
        try:
            key2, st2 = _stat_key(p)
        except OSError:
            key2 = ""
        if key2 == key:  # unchanged while we read it
            _cache_put(key, os.path.realpath(p), st.st_size, sha)
    return Digest(sha, st.st_size, False)


def _hash_stream(f: io.BufferedReader, size: int, label: str, show: bool, console: Any) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    if not show:
        while n := f.readinto(buf):
            h.update(view[:n])
        return h.hexdigest()
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    con = console if console is not None else Console(stderr=True)
    with Progress(TextColumn("sha256 {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=con, transient=False) as bar:
        task = bar.add_task(label, total=size)
        while n := f.readinto(buf):
            h.update(view[:n])
            bar.advance(task, n)
    return h.hexdigest()


def sha256_file(path: str | os.PathLike[str], **kw: Any) -> str:
    """The file's sha256 hex digest (see :func:`file_digest`)."""
    return file_digest(path, **kw).sha256


def vocab_digest(vocab: Any) -> str:
    """sha256 over the tokenizer model, pre-tokenizer, token texts, token types and special ids.

    Cheap (no tensor data) and independent of everything else in the file, so two files with equal
    vocabularies have equal vocabulary digests.
    """
    h = hashlib.sha256(b"power.vocab/1\0")
    if vocab is None:
        return h.hexdigest()
    for s in (vocab.model or "", vocab.pre or ""):
        b = s.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<Q", len(b)) + b)
    h.update(struct.pack("<Q", len(vocab.tokens)))
    for tok in vocab.tokens:
        b = tok.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<Q", len(b)))
        h.update(b)
    types = vocab.token_types or ()
    h.update(struct.pack("<Q", len(types)))
    if types:
        import numpy as np

        h.update(np.asarray(types, dtype="<i8").tobytes())
    for role in sorted(vocab.special):
        h.update(f"{role}={vocab.special[role]};".encode())
    return h.hexdigest()
