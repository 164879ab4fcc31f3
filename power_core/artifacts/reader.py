"""A bounded GGUF header parser: every count and length is checked against the file before use.

Why not ``gguf.GGUFReader``: it memory-maps the whole file and builds numpy views for every
field and tensor as it goes, so a lying count or length surfaces as an arbitrary exception (or a
huge allocation) from deep inside numpy. This parser reads only the header (metadata and the
tensor table) through a small buffered window, never touches tensor data, and turns every lie
into an :class:`~power_core.errors.ArtifactError` with a stable reason code. The type tables
(value types, ggml block sizes) come from the ``gguf`` package.

Layout (GGUF v2/v3, little endian): ``magic u32 | version u32 | n_tensors u64 | n_kv u64 |
n_kv × (key str, type u32, value) | n_tensors × (name str, n_dims u32, ne u64 × n_dims,
type u32, offset u64) | pad to alignment | tensor data``.
"""

from __future__ import annotations

import os
import struct
from typing import Any, BinaryIO

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from power_core.errors import ArtifactError

__all__ = ["RawGGUF", "RawTensor", "parse_gguf", "LIMITS", "Limits"]

GGUF_MAGIC = b"GGUF"


@attrs.frozen
class Limits:
    """Hard ceilings independent of the file (the file size bounds everything else too)."""

    max_header_bytes: int = 1 << 30  # metadata + tensor table
    max_kv: int = 1 << 16
    max_tensors: int = 1 << 20
    max_key_bytes: int = 1 << 16
    max_string_bytes: int = 1 << 26  # one string value (chat templates can be large)
    max_array_len: int = 1 << 26
    max_tensor_name: int = 63  # GGML_MAX_NAME - 1
    max_dims: int = 4  # GGML_MAX_DIMS


LIMITS = Limits()

_SCALARS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<B", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
_NP: dict[int, str] = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
_CHUNK = 1 << 20


@attrs.frozen
class RawTensor:
    """One tensor-table entry; ``shape`` is in ggml ``ne`` order (numpy's reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    offset: int  # absolute file offset of the data
    nbytes: int


@attrs.frozen
class RawGGUF:
    """What the header says, after every bound was checked."""

    path: str
    size: int
    version: int
    metadata: dict[str, Any]  # scalars as Python values, numeric arrays as numpy, string arrays as tuples
    value_types: dict[str, str]  # key -> "UINT32", "ARRAY[STRING]", ...
    tensors: dict[str, RawTensor]
    alignment: int
    data_offset: int
    header_bytes_read: int


class _Source:
    """Buffered, bounded reads from the file; counts what it read."""

    def __init__(self, f: BinaryIO, size: int, path: str, limits: Limits) -> None:
        self.f, self.size, self.path, self.limits = f, size, path, limits
        self.pos = 0
        self.buf = b""
        self.buf_start = 0
        self.bytes_read = 0

    def fail(self, reason: str, what: str, evidence: str | None = None) -> ArtifactError:
        return ArtifactError(f"{self.path}: {what} (at byte {self.pos} of {self.size}); the file is not a valid "
                             "GGUF or is damaged — re-download or re-convert it", reason=reason, evidence=evidence)

    def remaining(self) -> int:
        return self.size - self.pos

    def read(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.remaining():
            raise self.fail("gguf_truncated", f"{what} needs {n} bytes but only {self.remaining()} remain", what)
        if self.pos + n > self.limits.max_header_bytes:
            raise self.fail("gguf_header_too_large", f"header exceeds {self.limits.max_header_bytes} bytes", what)
        lo = self.pos - self.buf_start
        if lo < 0 or lo + n > len(self.buf):
            self.f.seek(self.pos)
            want = min(max(n, _CHUNK), self.size - self.pos)
            data = self.f.read(want)
            self.bytes_read += len(data)
            if len(data) < n:  # the file shrank under us
                raise self.fail("gguf_truncated", f"{what}: short read", what)
            self.buf, self.buf_start, lo = data, self.pos, 0
        self.pos += n
        return self.buf[lo:lo + n]

    def unpack(self, fmt: str, n: int, what: str) -> Any:
        return struct.unpack(fmt, self.read(n, what))[0]

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str, limit: int) -> str:
        n = self.u64(f"{what} length")
        if n > limit:
            raise self.fail("gguf_bad_string", f"{what} claims {n} bytes (limit {limit})", what)
        raw = self.read(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail("gguf_bad_string", f"{what} is not valid UTF-8", what) from None


def _type_name(vt: int) -> str:
    try:
        return GGUFValueType(vt).name
    except ValueError:
        return f"TYPE{vt}"


def _read_value(src: _Source, vt: int, key: str) -> Any:
    lim = src.limits
    if vt in _SCALARS:
        fmt, n = _SCALARS[vt]
        v = src.unpack(fmt, n, f"value of {key!r}")
        if vt == GGUFValueType.BOOL:
            if v not in (0, 1):
                raise src.fail("gguf_bad_value", f"bool {key!r} holds {v}", key)
            return bool(v)
        return v
    if vt == GGUFValueType.STRING:
        return src.string(f"string value of {key!r}", lim.max_string_bytes)
    if vt == GGUFValueType.ARRAY:
        et = src.u32(f"array element type of {key!r}")
        count = src.u64(f"array length of {key!r}")
        if et == GGUFValueType.ARRAY:
            raise src.fail("gguf_nested_array", f"array {key!r} nests arrays, which Power does not accept", key)
        if et in _SCALARS:
            size = _SCALARS[et][1]
        elif et == GGUFValueType.STRING:
            size = 8  # at least the length prefix
        else:
            raise src.fail("gguf_bad_value_type", f"array {key!r} has unknown element type {et}", key)
        if count > lim.max_array_len or count * size > src.remaining():
            raise src.fail("gguf_count_too_large", f"array {key!r} claims {count} elements of >= {size} bytes; "
                           f"only {src.remaining()} bytes remain", key)
        if et == GGUFValueType.STRING:
            return tuple(src.string(f"element {i} of {key!r}", lim.max_string_bytes) for i in range(count))
        arr = np.frombuffer(src.read(count * size, f"array {key!r}"), dtype=_NP[et]).copy()
        if et == GGUFValueType.BOOL:
            if arr.size and int(arr.max()) > 1:
                raise src.fail("gguf_bad_value", f"bool array {key!r} holds values other than 0/1", key)
            arr = arr.astype(bool)
        arr.setflags(write=False)
        return arr
    raise src.fail("gguf_bad_value_type", f"key {key!r} has unknown value type {vt}", key)


def _tensor_nbytes(src: _Source, name: str, shape: tuple[int, ...], ttype: int) -> tuple[str, int]:
    try:
        qt = GGMLQuantizationType(ttype)
    except ValueError:
        raise src.fail("gguf_bad_tensor_type", f"tensor {name!r} has unknown ggml type {ttype}", name) from None
    if qt not in GGML_QUANT_SIZES:
        raise src.fail("gguf_bad_tensor_type", f"tensor {name!r} has unsupported ggml type {qt.name}", name)
    block, type_size = GGML_QUANT_SIZES[qt]
    if shape[0] % block:
        raise src.fail("gguf_bad_tensor_shape", f"tensor {name!r} ne[0]={shape[0]} is not a multiple of the "
                       f"{qt.name} block size {block}", name)
    n = 1
    for d in shape:
        n *= d
        if n > src.size * max(block, 1):  # cannot possibly fit; stops big-int growth early
            raise src.fail("gguf_tensor_out_of_bounds", f"tensor {name!r} shape {list(shape)} is larger than the "
                           "whole file", name)
    return qt.name, n // block * type_size


def parse_gguf(path: str | os.PathLike[str], limits: Limits = LIMITS) -> RawGGUF:
    """Parse and bound-check the header of ``path``; raise ArtifactError (never anything else) on a bad file."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ArtifactError(f"{p}: no such file; check the path", reason="file_not_found", evidence=p) from None
    except OSError as exc:
        raise ArtifactError(f"{p}: cannot stat ({exc.strerror})", reason="file_unreadable", evidence=p) from None
    import stat as _stat

    if not _stat.S_ISREG(st.st_mode):
        raise ArtifactError(f"{p}: not a regular file", reason="not_a_file", evidence=p)
    try:
        f = open(p, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ArtifactError(f"{p}: cannot open ({exc.strerror})", reason="file_unreadable", evidence=p) from None
    try:
        with f:
            return _parse(_Source(f, st.st_size, p, limits))
    except ArtifactError:
        raise
    except (OSError, MemoryError) as exc:
        raise ArtifactError(f"{p}: read failed ({type(exc).__name__}: {exc})", reason="file_unreadable",
                            evidence=p) from None


def _parse(src: _Source) -> RawGGUF:
    lim = src.limits
    if src.size < 4:
        raise src.fail("gguf_truncated", "file is shorter than the GGUF magic", "magic")
    magic = src.read(4, "magic")
    if magic != GGUF_MAGIC:
        raise ArtifactError(f"{src.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')",
                            reason="gguf_bad_magic", evidence="magic")
    version = src.u32("version")
    if version not in (2, 3):
        if version and version & 0xFFFF == 0:
            raise src.fail("gguf_big_endian", f"version field {version:#x} looks byte-swapped (big-endian GGUF is "
                           "not supported)", "version")
        raise src.fail("gguf_unsupported_version", f"GGUF version {version} (supported: 2, 3)", "version")
    n_tensors = src.u64("tensor count")
    n_kv = src.u64("metadata count")
    # Each kv needs >= 13 bytes (key length, one key byte, type, one value byte); each tensor entry >= 33.
    if n_kv > lim.max_kv or n_kv * 13 > src.remaining():
        raise src.fail("gguf_count_too_large", f"header claims {n_kv} metadata entries", "n_kv")
    if n_tensors > lim.max_tensors or n_tensors * 33 > src.remaining():
        raise src.fail("gguf_count_too_large", f"header claims {n_tensors} tensors", "n_tensors")

    metadata: dict[str, Any] = {}
    types: dict[str, str] = {}
    for i in range(n_kv):
        key = src.string(f"key {i}", lim.max_key_bytes)
        if not key:
            raise src.fail("gguf_bad_key", f"metadata key {i} is empty", f"key {i}")
        if key in metadata:
            raise src.fail("gguf_duplicate_key", f"metadata key {key!r} appears twice", key)
        vt = src.u32(f"type of {key!r}")
        value = _read_value(src, vt, key)
        metadata[key] = value
        if vt == GGUFValueType.ARRAY:
            et = "STRING" if isinstance(value, tuple) else _np_type_name(value)
            types[key] = f"ARRAY[{et}]"
        else:
            types[key] = _type_name(vt)

    alignment = metadata.get("general.alignment", 32)
    if "general.alignment" in metadata and (types["general.alignment"] != "UINT32" or alignment == 0
                                            or alignment & (alignment - 1)):
        raise src.fail("gguf_bad_alignment", f"general.alignment={alignment!r} must be a power-of-two UINT32",
                       "general.alignment")

    entries: list[tuple[str, tuple[int, ...], str, int, int]] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name = src.string(f"tensor name {i}", lim.max_tensor_name)
        if not name or not name.isprintable():
            raise src.fail("gguf_bad_tensor_name", f"tensor {i} has an empty or unprintable name {name!r}",
                           f"tensor {i}")
        if name in seen:
            raise src.fail("gguf_duplicate_tensor", f"tensor {name!r} appears twice", name)
        seen.add(name)
        n_dims = src.u32(f"n_dims of {name!r}")
        if not 1 <= n_dims <= lim.max_dims:
            raise src.fail("gguf_bad_tensor_dims", f"tensor {name!r} claims {n_dims} dimensions "
                           f"(1..{lim.max_dims})", name)
        shape = tuple(src.u64(f"ne[{d}] of {name!r}") for d in range(n_dims))
        if any(d == 0 or d >= 1 << 62 for d in shape):
            raise src.fail("gguf_bad_tensor_shape", f"tensor {name!r} has shape {list(shape)}", name)
        ttype = src.u32(f"type of {name!r}")
        tname, nbytes = _tensor_nbytes(src, name, shape, ttype)
        offset = src.u64(f"offset of {name!r}")
        if offset % alignment:
            raise src.fail("gguf_tensor_misaligned", f"tensor {name!r} offset {offset} is not a multiple of "
                           f"{alignment}", name)
        entries.append((name, shape, tname, offset, nbytes))

    data_offset = -(-src.pos // alignment) * alignment
    data_size = src.size - data_offset
    tensors: dict[str, RawTensor] = {}
    for name, shape, tname, offset, nbytes in entries:
        if data_size < 0 or offset > data_size or nbytes > data_size - offset:
            raise ArtifactError(
                f"{src.path}: tensor {name!r} ({tname} {list(shape)}, {nbytes} bytes at data offset {offset}) "
                f"extends past the end of the file ({max(data_size, 0)} data bytes); the file is truncated or its "
                "tensor table lies", reason="gguf_tensor_out_of_bounds", evidence=name)
        tensors[name] = RawTensor(name, shape, tname, data_offset + offset, nbytes)
    by_offset = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(by_offset, by_offset[1:], strict=False):
        if a.offset + a.nbytes > b.offset:
            raise ArtifactError(f"{src.path}: tensors {a.name!r} and {b.name!r} overlap in the data section; the "
                                "tensor table lies", reason="gguf_tensor_overlap", evidence=b.name)
    # Every writer (gguf-py, ggml's gguf_write) pads each tensor, the last one included, to the
    # alignment, and ggml sizes the data section as the sum of the padded sizes. A file that ends
    # inside the last tensor's padding lost bytes: fail closed rather than guess what they were.
    if tensors:
        last = max(tensors.values(), key=lambda t: t.offset + t.nbytes)
        end = last.offset + -(-last.nbytes // alignment) * alignment
        if end > src.size:
            raise ArtifactError(
                f"{src.path}: the data section ends at byte {end} (tensor {last.name!r} padded to the {alignment}-byte "
                f"alignment GGUF writers pad every tensor to) but the file has only {src.size} bytes; the file is "
                "truncated — re-download or re-convert it", reason="gguf_truncated", evidence=last.name)
    return RawGGUF(path=src.path, size=src.size, version=version, metadata=metadata, value_types=types,
                   tensors=tensors, alignment=alignment, data_offset=data_offset, header_bytes_read=src.bytes_read)


def _np_type_name(arr: np.ndarray) -> str:
    return {"u1": "UINT8", "i1": "INT8", "u2": "UINT16", "i2": "INT16", "u4": "UINT32", "i4": "INT32",
            "f4": "FLOAT32", "b1": "BOOL", "u8": "UINT64", "i8": "INT64", "f8": "FLOAT64"}.get(
        arr.dtype.str[1:], arr.dtype.str)
