"""Complete vocabulary comparison between a target and a draft whose contexts bind.

Compared: tokenizer model, pre-tokenizer, every token text and type, and the special ids
(bos/eos/eot/eom/pad/unk/sep; ``mask`` only when both files set it, since DFlash drafts add a mask
token the target need not have). The first differing id is reported.

A reduced draft vocabulary is llama.cpp's format (``src/models/dflash.cpp``): the draft carries the
target's complete tokenizer (its input embeddings and the anchor/mask ids are target ids) and a
``d2t`` tensor (I64, one absolute target id per row of the draft's output projection) that
scatters its fewer output rows onto the target vocabulary in-graph. Checked: the tokenizers are
identical, ``d2t`` is I64 with exactly one entry per output row (own ``output.weight``, or the
target's vocabulary when the output is borrowed; llama.cpp asserts both), every id is inside the
target vocabulary, and no id repeats.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from power_core.artifacts.view import SPECIAL_TOKEN_KEYS, ArtifactView, Vocabulary
from power_core.errors import ArtifactMismatch

__all__ = ["VocabMatch", "compare_vocab"]


@attrs.frozen
class VocabMatch:
    """How the draft's vocabulary maps onto the target's."""

    n_target: int
    n_draft: int
    mapping: str  # "identity" | "d2t"


def _fail(msg: str, reason: str, evidence: str) -> ArtifactMismatch:
    return ArtifactMismatch(msg, reason=reason, evidence=evidence)


def _first_diff(a: tuple, b: tuple) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare_vocab(target: ArtifactView, draft: ArtifactView) -> VocabMatch:
    """Raise :class:`ArtifactMismatch` naming the first difference; return how the vocabularies map."""
    tv, dv = target.vocab, draft.vocab
    tn, dn = target.path, draft.path
    if tv is None or not tv.tokens:
        raise _fail(f"{tn}: the target has no tokenizer vocabulary to compare the draft against",
                    "vocab_missing", "tokenizer.ggml.tokens")
    if dv is None or not dv.tokens:
        raise _fail(f"{dn}: the draft has no tokenizer vocabulary; it must carry the target's tokenizer",
                    "vocab_missing", "tokenizer.ggml.tokens")
    for attr, key, code in (("model", "tokenizer.ggml.model", "vocab_model_mismatch"),
                            ("pre", "tokenizer.ggml.pre", "vocab_pre_mismatch")):
        a, b = getattr(tv, attr), getattr(dv, attr)
        if a != b:
            raise _fail(f"{key} differs: target {a!r}, draft {b!r}; the draft was converted with another tokenizer",
                        code, key)
    n_rows = _check_d2t(target, draft) if draft.has("d2t") else None
    _compare_special(tv, dv)
    if tv.tokens != dv.tokens:
        i = _first_diff(tv.tokens, dv.tokens)
        if i >= min(len(tv.tokens), len(dv.tokens)):
            raise _fail(f"vocabulary sizes differ: target {len(tv.tokens)} tokens, draft {len(dv.tokens)} (first "
                        f"differing id {i}); a reduced draft vocabulary needs an explicit d2t mapping",
                        "vocab_size_mismatch", f"tokenizer.ggml.tokens[{i}]")
        raise _fail(f"token {i} differs: target {tv.tokens[i]!r}, draft {dv.tokens[i]!r} (first differing id {i})",
                    "vocab_token_mismatch", f"tokenizer.ggml.tokens[{i}]")
    if (tv.token_types or None) != (dv.token_types or None):
        if tv.token_types is None or dv.token_types is None:
            raise _fail("only one of target and draft has tokenizer.ggml.token_type", "vocab_type_mismatch",
                        "tokenizer.ggml.token_type")
        i = _first_diff(tv.token_types, dv.token_types)
        raise _fail(f"token type of id {i} differs: target {tv.token_types[i]}, draft {dv.token_types[i]} "
                    f"(first differing id {i})", "vocab_type_mismatch", f"tokenizer.ggml.token_type[{i}]")
    if n_rows is not None:
        return VocabMatch(len(tv.tokens), n_rows, "d2t")
    return VocabMatch(len(tv.tokens), len(dv.tokens), "identity")


def _compare_special(tv: Vocabulary, dv: Vocabulary) -> None:
    for role, key in SPECIAL_TOKEN_KEYS.items():
        a, b = tv.special.get(role), dv.special.get(role)
        if role == "mask" and (a is None or b is None):
            continue
        if a != b:
            raise _fail(f"special token {role} differs: target {a}, draft {b}", "vocab_special_mismatch", key)


def _check_d2t(target: ArtifactView, draft: ArtifactView) -> int:
    """Validate the ``d2t`` scatter map; returns the number of draft output rows."""
    info = draft.tensors["d2t"]
    out = draft.tensors.get("output.weight")
    n_t = len(target.vocab.tokens) if target.vocab else 0
    rows = int(out.shape[1]) if out is not None and len(out.shape) == 2 else n_t
    where = "the draft's output.weight" if out is not None else "the target's output (borrowed)"
    if info.ggml_type != "I64" or len(info.shape) != 1 or info.shape[0] != rows:
        raise _fail(f"d2t must be an I64 vector with one target id per output row ({rows} rows in {where}); found "
                    f"{info.ggml_type} {list(info.shape)}", "d2t_invalid", "d2t")
    m: Any = draft.read_tensor("d2t").astype(np.int64)
    bad = np.flatnonzero((m < 0) | (m >= n_t))
    if bad.size:
        i = int(bad[0])
        raise _fail(f"d2t[{i}]={int(m[i])} is outside the target vocabulary [0, {n_t})", "d2t_invalid", f"d2t[{i}]")
    if np.unique(m).size != m.size:
        raise _fail("d2t maps two draft output rows to the same target id", "d2t_invalid", "d2t")
    return rows
