"""Complete vocabulary comparison between a target and a draft whose contexts bind.

Compared: tokenizer model, pre-tokenizer, every token text and type, and the special ids
(bos/eos/eot/eom/pad/unk/sep; ``mask`` only when both files set it, since DFlash drafts add a mask
token the target need not have). The first differing id is reported. A draft with a reduced
vocabulary is accepted only through its ``d2t`` tensor, which maps every draft id to a target id
(absolute ids, I64/I32); each mapped pair must have equal text and type.
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
    if draft.has("d2t"):
        return _compare_d2t(target, draft, tv, dv)
    _compare_special(tv, dv, None)
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
    return VocabMatch(len(tv.tokens), len(dv.tokens), "identity")


def _compare_special(tv: Vocabulary, dv: Vocabulary, d2t: Any) -> None:
    for role, key in SPECIAL_TOKEN_KEYS.items():
        a, b = tv.special.get(role), dv.special.get(role)
        if role == "mask" and (a is None or b is None):
            continue
        if d2t is not None and b is not None:
            b = int(d2t[b]) if 0 <= b < len(d2t) else -1 - b  # an out-of-range draft id never matches
        if a != b:
            raise _fail(f"special token {role} differs: target {a}, draft {b}", "vocab_special_mismatch", key)


def _compare_d2t(target: ArtifactView, draft: ArtifactView, tv: Vocabulary, dv: Vocabulary) -> VocabMatch:
    info = draft.tensors["d2t"]
    if info.ggml_type not in ("I64", "I32") or len(info.shape) != 1 or info.shape[0] != len(dv.tokens):
        raise _fail(f"d2t must be an I64 vector with one entry per draft token ({len(dv.tokens)}); found "
                    f"{info.ggml_type} {list(info.shape)}", "d2t_invalid", "d2t")
    m: Any = draft.read_tensor("d2t").astype(np.int64)
    n_t = len(tv.tokens)
    bad = np.flatnonzero((m < 0) | (m >= n_t))
    if bad.size:
        i = int(bad[0])
        raise _fail(f"d2t[{i}]={int(m[i])} is outside the target vocabulary [0, {n_t})", "d2t_invalid", f"d2t[{i}]")
    if np.unique(m).size != m.size:
        raise _fail("d2t maps two draft ids to the same target id", "d2t_invalid", "d2t")
    _compare_special(tv, dv, m)
    for i, t in enumerate(m.tolist()):
        if dv.tokens[i] != tv.tokens[t]:
            raise _fail(f"d2t maps draft id {i} ({dv.tokens[i]!r}) to target id {t} ({tv.tokens[t]!r}); texts "
                        f"differ (first differing id {i})", "vocab_token_mismatch", f"d2t[{i}]")
        if tv.token_types is not None and dv.token_types is not None and dv.token_types[i] != tv.token_types[t]:
            raise _fail(f"d2t maps draft id {i} to target id {t} but their token types differ",
                        "vocab_type_mismatch", f"d2t[{i}]")
    return VocabMatch(n_t, len(dv.tokens), "d2t")
