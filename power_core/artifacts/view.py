"""The typed, frozen view of one GGUF artifact that validators read.

``ArtifactView.from_gguf(path)`` parses only the header (bounded, see :mod:`.reader`); tensor data
is read on request (:meth:`ArtifactView.read_tensor`, small integer tensors such as ``d2t``).
Shapes are in ggml ``ne`` order, the order the llama.cpp notes and loaders use
(``fc.weight {n_embd_inp_enc, n_embd}``); numpy shapes are the reverse.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from power_core.artifacts.reader import LIMITS, Limits, parse_gguf
from power_core.errors import ArtifactError

__all__ = ["ArtifactView", "TensorInfo", "Vocabulary", "ArraySummary", "SPECIAL_TOKEN_KEYS", "inspect_gguf"]

#: arrays longer than this are summarised in ``metadata`` (vocabulary arrays live in ``vocab``)
INLINE_ARRAY_MAX = 4096
#: special-token roles compared between target and draft
SPECIAL_TOKEN_KEYS: Mapping[str, str] = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic: the GGUF key is misspelled upstream
}
_INT_TYPES = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}


@attrs.frozen
class ArraySummary:
    """Stand-in for a long metadata array: its element type and length."""

    element_type: str
    length: int


@attrs.frozen
class TensorInfo:
    """A tensor's name, ggml ``ne`` shape, ggml type, absolute data offset and byte size."""

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    offset: int
    nbytes: int


@attrs.frozen
class Vocabulary:
    """The tokenizer facts that must agree between a target and a draft."""

    model: str | None
    pre: str | None
    tokens: tuple[str, ...]
    token_types: tuple[int, ...] | None
    special: Mapping[str, int]  # role -> id, only the roles the file sets

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def _ro(arr: Any) -> tuple:
    return tuple(arr.tolist()) if isinstance(arr, np.ndarray) else tuple(arr)


@attrs.frozen
class ArtifactView:
    """Header facts of one GGUF file: architecture, metadata, tensor table, vocabulary."""

    path: str
    size: int
    version: int
    architecture: str | None
    metadata: Mapping[str, Any]
    value_types: Mapping[str, str]
    tensors: Mapping[str, TensorInfo]
    vocab: Vocabulary | None
    alignment: int = 32
    data_offset: int = 0

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], *, limits: Limits = LIMITS) -> ArtifactView:
        """Parse ``path``'s header; raise :class:`ArtifactError` (with a reason code) for any bad file."""
        raw = parse_gguf(path, limits)
        md = raw.metadata
        arch = md.get("general.architecture")
        if "general.architecture" in md and not isinstance(arch, str):
            raise ArtifactError(f"{raw.path}: general.architecture must be a string, found "
                                f"{raw.value_types['general.architecture']}", reason="gguf_bad_metadata",
                                evidence="general.architecture")
        metadata: dict[str, Any] = {}
        for key, value in md.items():
            if isinstance(value, (tuple, np.ndarray)):
                n = len(value)
                if n > INLINE_ARRAY_MAX:
                    metadata[key] = ArraySummary(raw.value_types[key][6:-1], n)
                else:
                    metadata[key] = _ro(value)
            else:
                metadata[key] = value
        tensors = {n: TensorInfo(t.name, t.shape, t.ggml_type, t.offset, t.nbytes) for n, t in raw.tensors.items()}
        return cls(path=raw.path, size=raw.size, version=raw.version, architecture=arch, metadata=metadata,
                   value_types=dict(raw.value_types), tensors=tensors, vocab=_vocabulary(raw.path, md, raw.value_types),
                   alignment=raw.alignment, data_offset=raw.data_offset)

    # -- queries ---------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, suffix: str) -> str:
        return f"{self.architecture}.{suffix}"

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def shape(self, tensor: str) -> tuple[int, ...] | None:
        t = self.tensors.get(tensor)
        return None if t is None else t.shape

    def int_key(self, key: str) -> int | None:
        """An integer-typed scalar, or None when absent; a wrong type is an ArtifactError."""
        if key not in self.metadata:
            return None
        if self.value_types.get(key) not in _INT_TYPES:
            raise ArtifactError(f"{self.path}: {key} must be an integer, found {self.value_types.get(key)}",
                                reason="gguf_bad_metadata", evidence=key)
        return int(self.metadata[key])

    @property
    def n_vocab(self) -> int | None:
        if self.vocab is not None and self.vocab.n_tokens:
            return self.vocab.n_tokens
        emb = self.shape("token_embd.weight")
        return emb[1] if emb is not None and len(emb) == 2 else None

    def read_tensor(self, name: str, *, max_bytes: int = 1 << 26) -> np.ndarray:
        """Read a small F32/F16/I8..I64 tensor's data (numpy shape = reversed ne); bounded and type-checked."""
        t = self.tensors.get(name)
        if t is None:
            raise ArtifactError(f"{self.path}: no tensor {name!r}", reason="tensor_missing", evidence=name)
        dtypes = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}
        if t.ggml_type not in dtypes:
            raise ArtifactError(f"{self.path}: tensor {name!r} has type {t.ggml_type}; expected one of "
                                f"{', '.join(dtypes)}", reason="tensor_bad_type", evidence=name)
        if t.nbytes > max_bytes:
            raise ArtifactError(f"{self.path}: tensor {name!r} is {t.nbytes} bytes (limit {max_bytes})",
                                reason="tensor_too_large", evidence=name)
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size != self.size:
                    raise ArtifactError(f"{self.path}: file changed since it was inspected", reason="file_changed",
                                        evidence=name)
                f.seek(t.offset)
                data = f.read(t.nbytes)
        except OSError as exc:
            raise ArtifactError(f"{self.path}: cannot read tensor {name!r}: {exc}", reason="file_unreadable",
                                evidence=name) from None
        if len(data) != t.nbytes:
            raise ArtifactError(f"{self.path}: short read of tensor {name!r}", reason="gguf_truncated", evidence=name)
        return np.frombuffer(data, dtype=dtypes[t.ggml_type]).reshape(tuple(reversed(t.shape)))

    def summary(self) -> dict[str, Any]:
        """JSON-ready description (``power inspect --json``)."""

        def js(v: Any) -> Any:
            if isinstance(v, ArraySummary):
                return {"array": v.element_type, "length": v.length}
            if isinstance(v, tuple):
                return list(v)
            if isinstance(v, float) and v != v:
                return "nan"
            return v

        voc = None
        if self.vocab is not None:
            voc = {"model": self.vocab.model, "pre": self.vocab.pre, "n_tokens": self.vocab.n_tokens,
                   "special": dict(self.vocab.special)}
        return {
            "path": self.path, "size": self.size, "gguf_version": self.version,
            "architecture": self.architecture, "alignment": self.alignment, "data_offset": self.data_offset,
            "metadata": {k: js(v) for k, v in self.metadata.items() if not k.startswith("tokenizer.ggml.tokens")},
            "tensors": [{"name": t.name, "shape": list(t.shape), "type": t.ggml_type, "nbytes": t.nbytes}
                        for t in self.tensors.values()],
            "vocab": voc,
        }


def _vocabulary(path: str, md: Mapping[str, Any], types: Mapping[str, str]) -> Vocabulary | None:
    tokens = md.get("tokenizer.ggml.tokens")
    model = md.get("tokenizer.ggml.model")
    if tokens is None and model is None:
        return None

    def bad(msg: str, key: str) -> ArtifactError:
        return ArtifactError(f"{path}: {msg}", reason="gguf_bad_vocab", evidence=key)

    if tokens is None:
        tokens = ()
    elif not isinstance(tokens, tuple):
        raise bad(f"tokenizer.ggml.tokens must be an array of strings, found {types['tokenizer.ggml.tokens']}",
                  "tokenizer.ggml.tokens")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
        if key in md and not isinstance(md[key], str):
            raise bad(f"{key} must be a string", key)
    ttypes = md.get("tokenizer.ggml.token_type")
    if ttypes is not None:
        if not isinstance(ttypes, np.ndarray) or ttypes.dtype.kind not in "iu":
            raise bad("tokenizer.ggml.token_type must be an integer array", "tokenizer.ggml.token_type")
        if len(ttypes) != len(tokens):
            raise bad(f"tokenizer.ggml.token_type has {len(ttypes)} entries for {len(tokens)} tokens",
                      "tokenizer.ggml.token_type")
        ttypes = tuple(ttypes.tolist())
    scores = md.get("tokenizer.ggml.scores")
    if scores is not None and (not isinstance(scores, np.ndarray) or len(scores) != len(tokens)):
        raise bad(f"tokenizer.ggml.scores must be a numeric array with {len(tokens)} entries", "tokenizer.ggml.scores")
    special: dict[str, int] = {}
    for role, key in SPECIAL_TOKEN_KEYS.items():
        if key in md:
            if types.get(key) not in _INT_TYPES:
                raise bad(f"{key} must be an integer, found {types.get(key)}", key)
            special[role] = int(md[key])
    return Vocabulary(model=md.get("tokenizer.ggml.model"), pre=md.get("tokenizer.ggml.pre"), tokens=tokens,
                      token_types=ttypes, special=special)


def inspect_gguf(path: str | os.PathLike[str]) -> ArtifactView:
    """Shorthand for :meth:`ArtifactView.from_gguf`."""
    return ArtifactView.from_gguf(path)
