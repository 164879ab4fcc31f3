"""Tiny synthetic GGUF artifacts for tests: valid targets and drafts, and a malformed corpus.

Drafts are written with the raw key and tensor names llama.cpp expects (PyPI ``gguf`` lacks the
``dflash`` constants of the pinned tree's own ``gguf-py``). A :class:`GGUFSpec` is a mutable
description (keys, tensor shapes in ggml ``ne`` order), so a test can drop a key, resize a tensor, or
add a foreign tensor and write the result::

    spec = dflash_spec(); del spec.tensors["fc.weight"]; path = spec.write(tmp_path / "d.gguf")

The files are for validation only: they are not meant to be loaded by llama.cpp (the target
carries a minimal tensor set).
"""

from __future__ import annotations

import copy
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

__all__ = [
    "GGUFSpec", "N_VOCAB", "N_EMBD", "MASK_ID",
    "target_spec", "dflash_spec", "dflash2_spec", "dspark_spec", "eagle3_spec",
    "write_target", "write_dflash", "write_dflash2", "write_dspark", "write_fixture_set",
    "encode_gguf", "malformed_corpus", "TRUNCATION", "make_sparse_lie", "tensor_entry_offset",
]

N_VOCAB = 128
N_EMBD = 64
N_FF = 128
MASK_ID = 127
BOS_ID, EOS_ID = 1, 2

_VT = {
    "u8": GGUFValueType.UINT8, "u32": GGUFValueType.UINT32, "i32": GGUFValueType.INT32,
    "u64": GGUFValueType.UINT64, "f32": GGUFValueType.FLOAT32, "bool": GGUFValueType.BOOL,
    "str": GGUFValueType.STRING,
}
_TT = {"F32": (GGMLQuantizationType.F32, np.float32), "F16": (GGMLQuantizationType.F16, np.float16),
       "I32": (GGMLQuantizationType.I32, np.int32), "I64": (GGMLQuantizationType.I64, np.int64)}


@attrs.define
class GGUFSpec:
    """Keys as ``key -> (kind, value)`` (kinds: u8 u32 i32 u64 f32 bool str, or ``arr:<kind>``) and
    tensors as ``name -> (ne shape, ggml type)``; ``data`` overrides a tensor's (numpy-shaped) contents."""

    arch: str
    kv: dict[str, tuple[str, Any]] = attrs.field(factory=dict)
    tensors: dict[str, tuple[tuple[int, ...], str]] = attrs.field(factory=dict)
    data: dict[str, np.ndarray] = attrs.field(factory=dict)
    seed: int = 0

    def copy(self) -> GGUFSpec:
        return copy.deepcopy(self)

    def write(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        w = GGUFWriter(str(path), self.arch)
        for key, (kind, value) in self.kv.items():
            if kind.startswith("arr:"):
                w.add_key_value(key, list(value), GGUFValueType.ARRAY, sub_type=_VT[kind[4:]])
            else:
                w.add_key_value(key, value, _VT[kind])
        rng = np.random.default_rng(self.seed)
        for name, (shape, ttype) in self.tensors.items():
            qt, dt = _TT[ttype]
            np_shape = tuple(reversed(shape))
            if name in self.data:
                arr = np.ascontiguousarray(self.data[name], dtype=dt).reshape(np_shape)
            elif dt in (np.int32, np.int64):
                arr = np.zeros(np_shape, dtype=dt)
            else:
                arr = (rng.standard_normal(np_shape) * 0.02).astype(dt)
            w.add_tensor(name, arr, raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path


def _tokenizer(n_vocab: int, *, mask: bool) -> dict[str, tuple[str, Any]]:
    types = [1] * n_vocab
    for i in (0, BOS_ID, EOS_ID):
        types[i] = 3  # control
    kv: dict[str, tuple[str, Any]] = {
        "tokenizer.ggml.model": ("str", "test"),
        "tokenizer.ggml.pre": ("str", "default"),
        "tokenizer.ggml.tokens": ("arr:str", [f"tok_{i}" for i in range(n_vocab)]),
        "tokenizer.ggml.token_type": ("arr:i32", types),
        "tokenizer.ggml.scores": ("arr:f32", [0.0] * n_vocab),
        "tokenizer.ggml.bos_token_id": ("u32", BOS_ID),
        "tokenizer.ggml.eos_token_id": ("u32", EOS_ID),
    }
    if mask:
        kv["tokenizer.ggml.mask_token_id"] = ("u32", MASK_ID)
    return kv


def _hparams(a: str, n_blocks: int, n_embd: int) -> dict[str, tuple[str, Any]]:
    """The transformer hyperparameters every tiny file shares."""
    return {
        f"{a}.block_count": ("u32", n_blocks),
        f"{a}.context_length": ("u32", 256),
        f"{a}.embedding_length": ("u32", n_embd),
        f"{a}.feed_forward_length": ("u32", N_FF),
        f"{a}.attention.head_count": ("u32", 2),
        f"{a}.attention.head_count_kv": ("u32", 1),
        f"{a}.attention.layer_norm_rms_epsilon": ("f32", 1e-6),
    }


def target_spec(*, mtp: bool = True, arch: str = "qwen35", n_layer: int = 2, n_nextn: int = 1,
                n_vocab: int = N_VOCAB, n_embd: int = N_EMBD) -> GGUFSpec:
    """A tiny target; with ``mtp`` it carries ``n_nextn`` MTP blocks after ``n_layer`` trunk blocks."""
    n_all = n_layer + (n_nextn if mtp else 0)
    a = arch
    kv: dict[str, tuple[str, Any]] = {
        **_hparams(a, n_all, n_embd),
        # per-layer flags, trunk block 0 recurrent, the rest (incl. MTP blocks) attention
        f"{a}.attention.recurrent_layers": ("arr:u8", [1] + [0] * (n_all - 1)),
    }
    if mtp:
        kv[f"{a}.nextn_predict_layers"] = ("u32", n_nextn)
    kv.update(_tokenizer(n_vocab, mask=False))
    t: dict[str, tuple[tuple[int, ...], str]] = {
        "token_embd.weight": ((n_embd, n_vocab), "F32"),
        "output_norm.weight": ((n_embd,), "F32"),
        "output.weight": ((n_embd, n_vocab), "F32"),
    }
    for i in range(n_all):
        t[f"blk.{i}.attn_norm.weight"] = ((n_embd,), "F32")
        t[f"blk.{i}.ffn_gate.weight"] = ((n_embd, N_FF), "F32")
        t[f"blk.{i}.ffn_up.weight"] = ((n_embd, N_FF), "F32")
        t[f"blk.{i}.ffn_down.weight"] = ((N_FF, n_embd), "F32")
    if mtp:
        for b in range(n_layer, n_all):
            t[f"blk.{b}.nextn.eh_proj.weight"] = ((2 * n_embd, n_embd), "F32")
            t[f"blk.{b}.nextn.enorm.weight"] = ((n_embd,), "F32")
            t[f"blk.{b}.nextn.hnorm.weight"] = ((n_embd,), "F32")
            t[f"blk.{b}.nextn.shared_head_norm.weight"] = ((n_embd,), "F32")
    return GGUFSpec(arch=a, kv=kv, tensors=t)


def dflash_spec(*, target_layers: Iterable[int] = (0, 1), block_size: int = 8, n_layer: int = 1,
                n_vocab: int = N_VOCAB, n_embd: int = N_EMBD, own_embeddings: bool = True,
                target_n_embd: int = N_EMBD) -> GGUFSpec:
    """A DFlash v1 draft: ``dflash`` arch, backbone keys and tensors, no selector/conv/Markov parts."""
    tl = list(target_layers)
    a = "dflash"
    kv: dict[str, tuple[str, Any]] = {
        **_hparams(a, n_layer, n_embd),
        f"{a}.target_layers": ("arr:i32", tl),
        f"{a}.block_size": ("u32", block_size),
    }
    kv.update(_tokenizer(n_vocab, mask=True))
    hd = n_embd // 2
    t: dict[str, tuple[tuple[int, ...], str]] = {
        "fc.weight": ((len(tl) * target_n_embd, n_embd), "F32"),
        "enc.output_norm.weight": ((n_embd,), "F32"),
        "output_norm.weight": ((n_embd,), "F32"),
    }
    if own_embeddings:
        t["token_embd.weight"] = ((n_embd, n_vocab), "F32")
        t["output.weight"] = ((n_embd, n_vocab), "F32")
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = ((n_embd,), "F32")
        t[p + "attn_q.weight"] = ((n_embd, 2 * hd), "F32")
        t[p + "attn_k.weight"] = ((n_embd, hd), "F32")
        t[p + "attn_v.weight"] = ((n_embd, hd), "F32")
        t[p + "attn_output.weight"] = ((2 * hd, n_embd), "F32")
        t[p + "attn_q_norm.weight"] = ((hd,), "F32")
        t[p + "attn_k_norm.weight"] = ((hd,), "F32")
        t[p + "ffn_norm.weight"] = ((n_embd,), "F32")
        t[p + "ffn_gate.weight"] = ((n_embd, N_FF), "F32")
        t[p + "ffn_up.weight"] = ((n_embd, N_FF), "F32")
        t[p + "ffn_down.weight"] = ((N_FF, n_embd), "F32")
    return GGUFSpec(arch=a, kv=kv, tensors=t, seed=1)


def dflash2_spec(*, kernel: int = 4, group: int = 32, rank: int = 16, top_k: int = 4, **kw: Any) -> GGUFSpec:
    """A DFlash2 draft: the v1 backbone plus selector tensors/keys and per-layer convolution tensors."""
    s = dflash_spec(**kw)
    n_embd = s.kv["dflash.embedding_length"][1]
    n_vocab = len(s.kv["tokenizer.ggml.tokens"][1])
    s.kv.update({
        "dflash.selector_rank": ("u32", rank), "dflash.selector_top_k": ("u32", top_k),
        "dflash.conv_kernel_size": ("u32", kernel), "dflash.conv_group_size": ("u32", group),
    })
    s.tensors["selector_predecessor.weight"] = ((rank, n_vocab), "F32")
    s.tensors["selector_successor.weight"] = ((rank, n_vocab), "F32")
    s.tensors["selector_hidden.weight"] = ((n_embd, rank), "F32")
    for i in range(s.kv["dflash.block_count"][1]):
        for part in ("attn", "ffn"):
            s.tensors[f"blk.{i}.{part}_conv_base"] = ((n_embd, kernel, 2), "F32")
            s.tensors[f"blk.{i}.{part}_conv_proj.weight"] = ((n_embd, 2 * kernel * n_embd // group), "F32")
    s.seed = 2
    return s


def dspark_spec(*, rank: int = 16, confidence: bool = False, **kw: Any) -> GGUFSpec:
    """A DSpark draft: the DFlash backbone plus the Markov head (and optionally a confidence head)."""
    s = dflash_spec(**kw)
    n_embd = s.kv["dflash.embedding_length"][1]
    n_vocab = len(s.kv["tokenizer.ggml.tokens"][1])
    s.kv["dflash.sample_from_anchor"] = ("bool", True)
    s.kv["dflash.has_confidence_head"] = ("bool", confidence)
    s.tensors["markov_w1.weight"] = ((rank, n_vocab), "F32")
    s.tensors["markov_w2.weight"] = ((rank, n_vocab), "F32")
    if confidence:
        s.tensors["conf_proj.weight"] = ((n_embd + rank, 1), "F32")
        s.tensors["conf_proj.bias"] = ((1,), "F32")
    s.seed = 3
    return s


def eagle3_spec(*, target_layers: Iterable[int] = (0, 1, 1), n_vocab: int = N_VOCAB, n_embd: int = N_EMBD,
                target_n_embd: int = N_EMBD, own_embeddings: bool = True, d2t: int | None = None,
                norm_before_residual: bool | None = None, norm_before_fc: bool | None = None) -> GGUFSpec:
    """An EAGLE3 draft as llama.cpp's converter writes one (``eagle3`` arch, one decoder layer over
    ``[embed, g]``, ``fc`` fusing three target layers). ``own_embeddings=False`` drops
    ``token_embd``/``output`` (inherited from the target); ``d2t``: that many output rows scattered
    onto target ids 0.. by a ``d2t`` tensor (I64); the norm flags are written when not ``None``
    (``norm_before_fc`` adds ``enc.output_norm``)."""
    tl = list(target_layers)
    a = "eagle3"
    kv: dict[str, tuple[str, Any]] = {
        **_hparams(a, 1, n_embd),
        f"{a}.target_layers": ("arr:i32", tl),
        f"{a}.target_hidden_size": ("u32", target_n_embd),
        f"{a}.vocab_size": ("u32", n_vocab),
    }
    if norm_before_residual is not None:
        kv[f"{a}.norm_before_residual"] = ("bool", norm_before_residual)
    if norm_before_fc is not None:
        kv[f"{a}.norm_before_fc"] = ("bool", norm_before_fc)
    kv.update(_tokenizer(n_vocab, mask=False))
    hd = n_embd // 2
    t: dict[str, tuple[tuple[int, ...], str]] = {
        "fc.weight": ((len(tl) * target_n_embd, n_embd), "F32"),
        "output_norm.weight": ((n_embd,), "F32"),
    }
    if norm_before_fc:
        t["enc.output_norm.weight"] = ((len(tl) * target_n_embd,), "F32")
    if own_embeddings:
        t["token_embd.weight"] = ((n_embd, n_vocab), "F32")
        t["output.weight"] = ((n_embd, d2t or n_vocab), "F32")
    data: dict[str, np.ndarray] = {}
    if d2t is not None:
        t["d2t"] = ((d2t,), "I64")
        data["d2t"] = np.arange(d2t, dtype=np.int64)
    p = "blk.0."
    t[p + "attn_norm.weight"] = ((n_embd,), "F32")
    t[p + "attn_norm_2.weight"] = ((n_embd,), "F32")
    t[p + "attn_q.weight"] = ((2 * n_embd, 2 * hd), "F32")
    t[p + "attn_k.weight"] = ((2 * n_embd, hd), "F32")
    t[p + "attn_v.weight"] = ((2 * n_embd, hd), "F32")
    t[p + "attn_output.weight"] = ((2 * hd, n_embd), "F32")
    t[p + "ffn_norm.weight"] = ((n_embd,), "F32")
    t[p + "ffn_gate.weight"] = ((n_embd, N_FF), "F32")
    t[p + "ffn_up.weight"] = ((n_embd, N_FF), "F32")
    t[p + "ffn_down.weight"] = ((N_FF, n_embd), "F32")
    return GGUFSpec(arch=a, kv=kv, tensors=t, data=data, seed=4)


def write_target(path: str | os.PathLike[str], **kw: Any) -> Path:
    return target_spec(**kw).write(path)


def write_dflash(path: str | os.PathLike[str], **kw: Any) -> Path:
    return dflash_spec(**kw).write(path)


def write_dflash2(path: str | os.PathLike[str], **kw: Any) -> Path:
    return dflash2_spec(**kw).write(path)


def write_dspark(path: str | os.PathLike[str], **kw: Any) -> Path:
    return dspark_spec(**kw).write(path)


def write_fixture_set(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Write one of each valid artifact into ``directory``; returns role -> path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    return {
        "target_mtp": write_target(d / "target-mtp.gguf", mtp=True),
        "target_plain": write_target(d / "target.gguf", mtp=False),
        "dflash": write_dflash(d / "dflash.gguf"),
        "dflash2": write_dflash2(d / "dflash2.gguf"),
        "dspark": write_dspark(d / "dspark.gguf"),
        "dspark_conf": write_dspark(d / "dspark-conf.gguf", confidence=True),
    }


# ------------------------------------------------------------------------------------------------
# Raw encoding (for what GGUFWriter refuses to write: duplicates, nested arrays, bad bools)
# ------------------------------------------------------------------------------------------------

def _s(x: str | bytes) -> bytes:
    b = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def encode_gguf(kv: list[tuple[str, int, bytes]], tensors: list[tuple[str, tuple[int, ...], int, int]],
                data: bytes = b"", *, version: int = 3, alignment: int = 32) -> bytes:
    """Raw GGUF bytes: ``kv`` as (key, value type, encoded value), tensors as (name, ne, ggml type, offset)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv)))
    for key, vt, raw in kv:
        out += _s(key) + struct.pack("<I", vt) + raw
    for name, shape, tt, off in tensors:
        out += _s(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        out += struct.pack("<IQ", tt, off)
    out += b"\0" * (-len(out) % alignment)
    return bytes(out) + data


def tensor_entry_offset(blob: bytes, name: str) -> int:
    """Byte offset of ``name``'s n_dims field in the tensor table of ``blob``."""
    needle = _s(name)
    i = blob.rfind(needle)
    if i < 0:
        raise KeyError(name)
    return i + len(needle)


def _kv_value_offset(blob: bytes, key: str) -> int:
    """Byte offset of ``key``'s value-type field."""
    i = blob.find(_s(key))
    if i < 0:
        raise KeyError(key)
    return i + len(_s(key))


def _patch(blob: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(blob)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


#: a truncated file may be caught by whichever bound it breaks first
TRUNCATION = "gguf_truncated|gguf_count_too_large|gguf_tensor_out_of_bounds"


def _mutations(blob: bytes) -> dict[str, tuple[bytes, str | None]]:
    """name -> (bytes, expected reason code(s) joined by '|', or None when any gguf_* code is acceptable)."""
    first = next(n for n in ("token_embd.weight", "fc.weight") if _s(n) in blob)
    t = tensor_entry_offset(blob, first)
    n_dims = struct.unpack_from("<I", blob, t)[0]
    t_type = t + 4 + 8 * n_dims
    t_off = t_type + 4
    tok = _kv_value_offset(blob, "tokenizer.ggml.tokens")
    key0 = 24
    u32 = GGUFValueType.UINT32
    m: dict[str, tuple[bytes, str | None]] = {
        "empty": (b"", "gguf_truncated"),
        "magic_only": (blob[:4], "gguf_truncated"),
        "truncated_header": (blob[:20], "gguf_truncated"),
        "truncated_metadata": (blob[: tok + 40], TRUNCATION),
        "truncated_tensor_table": (blob[: t + 6], TRUNCATION),
        "truncated_data": (blob[:-64], "gguf_tensor_out_of_bounds"),
        "bad_magic": (b"GGML" + blob[4:], "gguf_bad_magic"),
        "version_1": (_patch(blob, 4, "<I", 1), "gguf_unsupported_version"),
        "version_99": (_patch(blob, 4, "<I", 99), "gguf_unsupported_version"),
        "big_endian": (_patch(blob, 4, ">I", 3), "gguf_big_endian"),
        "n_tensors_lie": (_patch(blob, 8, "<Q", 1 << 40), "gguf_count_too_large"),
        "n_kv_lie": (_patch(blob, 16, "<Q", 1 << 33), "gguf_count_too_large"),
        "n_tensors_plus_one": (_patch(blob, 8, "<Q", struct.unpack_from("<Q", blob, 8)[0] + 1), None),
        "n_kv_plus_one": (_patch(blob, 16, "<Q", struct.unpack_from("<Q", blob, 16)[0] + 1), None),
        "key_length_lie": (_patch(blob, key0, "<Q", 1 << 50), "gguf_bad_string"),
        "key_bad_utf8": (_patch(blob, key0 + 8, "<B", 0xFF), "gguf_bad_string"),
        "value_type_bad": (_patch(blob, _kv_value_offset(blob, "general.architecture"), "<I", 77),
                           "gguf_bad_value_type"),
        "array_count_lie": (_patch(blob, tok + 8, "<Q", 1 << 45), "gguf_count_too_large"),
        "array_elem_nested": (_patch(blob, tok + 4, "<I", GGUFValueType.ARRAY), "gguf_nested_array"),
        "array_elem_type_bad": (_patch(blob, tok + 4, "<I", 42), "gguf_bad_value_type"),
        "tensor_ndims_lie": (_patch(blob, t, "<I", 7), "gguf_bad_tensor_dims"),
        "tensor_dim_huge": (_patch(blob, t + 4, "<Q", 1 << 40), "gguf_tensor_out_of_bounds"),
        "tensor_dim_zero": (_patch(blob, t + 4, "<Q", 0), "gguf_bad_tensor_shape"),
        "tensor_type_bad": (_patch(blob, t_type, "<I", 99), "gguf_bad_tensor_type"),
        "tensor_offset_past_eof": (_patch(blob, t_off, "<Q", 1 << 36), "gguf_tensor_out_of_bounds"),
        "tensor_offset_misaligned": (_patch(blob, t_off, "<Q", struct.unpack_from("<Q", blob, t_off)[0] + 4),
                                     "gguf_tensor_misaligned"),
        "tensor_name_length_lie": (_patch(blob, blob.rfind(_s(first)), "<Q", 1 << 20), "gguf_bad_string"),
    }
    # make the first tensor overlap the second one (the second starts at the first's offset + its size)
    second_entry = t_off + 8
    sec_dims = struct.unpack_from("<I", blob, second_entry + 8 + struct.unpack_from("<Q", blob, second_entry)[0])[0]
    sec_off_at = second_entry + 8 + struct.unpack_from("<Q", blob, second_entry)[0] + 4 + 8 * sec_dims + 4
    m["tensor_overlap"] = (_patch(blob, sec_off_at, "<Q", struct.unpack_from("<Q", blob, t_off)[0]),
                           "gguf_tensor_overlap")
    # structures GGUFWriter refuses to write
    arch = (GGUFValueType.STRING, _s("qwen35"))
    m["duplicate_key"] = (encode_gguf([("general.architecture", *arch), ("general.architecture", *arch)], []),
                          "gguf_duplicate_key")
    f32 = GGMLQuantizationType.F32
    m["duplicate_tensor"] = (encode_gguf([("general.architecture", *arch)],
                                         [("a.weight", (8,), f32, 0), ("a.weight", (8,), f32, 32)], b"\0" * 64),
                             "gguf_duplicate_tensor")
    m["bad_bool"] = (encode_gguf([("x.flag", GGUFValueType.BOOL, b"\x07")], []), "gguf_bad_value")
    m["bad_alignment"] = (encode_gguf([("general.alignment", u32, struct.pack("<I", 24))], []), "gguf_bad_alignment")
    m["empty_tensor_name"] = (encode_gguf([], [("", (8,), f32, 0)], b"\0" * 32), "gguf_bad_tensor_name")
    m["arch_not_string"] = (encode_gguf([("general.architecture", u32, struct.pack("<I", 5))], []),
                            "gguf_bad_metadata")
    return m


def malformed_corpus(valid: str | os.PathLike[str], directory: str | os.PathLike[str]) -> dict[str, tuple[Path, str | None]]:
    """Write mutations of the valid GGUF ``valid`` into ``directory``: name -> (path, expected reason)."""
    blob = Path(valid).read_bytes()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, (data, reason) in _mutations(blob).items():
        p = d / f"{name}.gguf"
        p.write_bytes(data)
        out[name] = (p, reason)
    return out


def make_sparse_lie(valid: str | os.PathLike[str], path: str | os.PathLike[str], *, size: int = 2 << 30,
                    lie: str = "offset") -> Path:
    """A ``size``-byte sparse file whose header is ``valid``'s and whose tensor table lies.

    ``lie``: ``offset`` (first tensor's data beyond the end), ``shape`` (first tensor larger than the
    file), ``count`` (more tensor entries than the table holds), ``overlap`` (two tensors share bytes
    near the end of the sparse region).
    """
    blob = Path(valid).read_bytes()
    first = next(n for n in ("token_embd.weight", "fc.weight") if _s(n) in blob)
    t = tensor_entry_offset(blob, first)
    n_dims = struct.unpack_from("<I", blob, t)[0]
    t_off = t + 4 + 8 * n_dims + 4
    if lie == "offset":
        blob = _patch(blob, t_off, "<Q", size + (1 << 20))
    elif lie == "shape":
        blob = _patch(blob, t + 4 + 8 * (n_dims - 1), "<Q", size)  # last dim: size rows
    elif lie == "count":
        blob = _patch(blob, 8, "<Q", struct.unpack_from("<Q", blob, 8)[0] + 1000)
    elif lie == "overlap":
        blob = _patch(blob, t + 4 + 8 * (n_dims - 1), "<Q", (size // 2) // (4 * struct.unpack_from("<Q", blob, t + 4)[0]))
    else:
        raise ValueError(lie)
    p = Path(path)
    with open(p, "wb") as f:
        f.write(blob)
        f.truncate(size)
    return p
