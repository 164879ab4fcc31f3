"""Check a model file in Python *before* llama.cpp sees it, so bad input is a typed error.

llama.cpp returns NULL for most bad files, but a NULL model explains nothing to the user, and some
malformed files reach asserts. The checks: the path exists and is a regular file, starts with the
``GGUF`` magic, has a supported version, a parseable header, tensor data that fits in the file, and
a ``general.architecture`` string.
"""

from __future__ import annotations

import hashlib
import os
import struct
from functools import lru_cache
from pathlib import Path

from power_core.errors import ArtifactError

__all__ = ["check_gguf", "sha256_file", "GGUFSummary"]

GGUF_MAGIC = b"GGUF"


class GGUFSummary(dict):
    """``arch``, ``version``, ``n_tensors``, ``n_kv`` and ``size`` of a checked file."""


def check_gguf(path: str | os.PathLike[str], *, role: str = "model") -> GGUFSummary:
    """Validate ``path`` as a complete GGUF file; raise :class:`ArtifactError` naming the defect."""
    p = Path(path)
    if not p.exists():
        raise ArtifactError(f"{role} file {str(p)!r} does not exist; check the path", reason="file_missing",
                            evidence=str(p))
    if p.is_dir():
        raise ArtifactError(f"{role} path {str(p)!r} is a directory; pass the .gguf file inside it",
                            reason="not_a_file", evidence=str(p))
    if not p.is_file():
        raise ArtifactError(f"{role} path {str(p)!r} is not a regular file", reason="not_a_file",
                            evidence=str(p))
    size = p.stat().st_size
    with p.open("rb") as fh:
        head = fh.read(24)
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        raise ArtifactError(f"{role} file {str(p)!r} is not a GGUF file (magic {head[:4]!r}, expected "
                            f"{GGUF_MAGIC!r}); convert it with llama.cpp's convert_hf_to_gguf.py",
                            reason="gguf_magic", evidence="magic")
    if len(head) < 24:
        raise ArtifactError(f"{role} file {str(p)!r} is truncated inside the GGUF header ({size} bytes)",
                            reason="gguf_truncated", evidence="header")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3):
        raise ArtifactError(f"{role} file {str(p)!r} has GGUF version {version}; llama.cpp reads 2 and 3",
                            reason="gguf_version", evidence="version")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(p, "r")
    except Exception as exc:  # the reader raises several types on a cut header
        raise ArtifactError(f"{role} file {str(p)!r} has an unreadable or truncated GGUF header "
                            f"({type(exc).__name__}: {exc})", reason="gguf_truncated", evidence="header") from None
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ArtifactError(f"{role} file {str(p)!r} has no general.architecture key", reason="gguf_invalid",
                            evidence="general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    end = 0
    for t in reader.tensors:
        end = max(end, int(t.data_offset) + int(t.n_bytes))
    if end > size:
        raise ArtifactError(f"{role} file {str(p)!r} is truncated: tensor data ends at byte {end} but the "
                            f"file has {size} bytes; download or copy it again", reason="gguf_truncated",
                            evidence="tensor data")
    return GGUFSummary(arch=arch, version=version, n_tensors=n_tensors, n_kv=n_kv, size=size)


@lru_cache(maxsize=32)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """sha256 of a file, cached per (path, size, mtime) within the process."""
    st = os.stat(path)
    return _sha256_cached(os.fspath(Path(path).resolve()), st.st_size, st.st_mtime_ns)
