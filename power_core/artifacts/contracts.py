"""Shared artifact facts and checks that the first-party validators build on.

What lives here is what more than one contract needs, or what the core needs without any plugin
installed (``auto`` must tell a DSpark file from a DFlash2 file): the discriminating markers
(as the pinned llama.cpp's ``src/models/dflash.cpp`` loader and ``common/speculative.cpp``
auto-detection tell them apart), the architecture lists, the ``dflash`` backbone check shared by
DFlash v1, DFlash2 and DSpark, and small ``need_*`` helpers that raise an
:class:`~power_core.errors.ArtifactError` whose ``reason`` is stable and whose ``evidence`` names
the key or tensor that decided. The contract-specific rules live in each plugin.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from power_core.artifacts.archs import FINAL_TAP_ARCHS, LAYER_INPUT_ARCHS, NEXTN_TAP_ARCHS
from power_core.artifacts.view import ArtifactView
from power_core.errors import ArtifactError, ArtifactMismatch

__all__ = [
    "Verified", "MTP_ARCHS", "LAYER_INPUT_ARCHS", "FINAL_TAP_ARCHS", "NEXTN_TAP_ARCHS", "DFLASH_ARCH", "EAGLE3_ARCH",
    "DSPARK_MARKER", "DFLASH2_MARKER", "BLOCK_CONTRACTS", "dflash2_evidence", "dspark_evidence", "classify_draft",
    "classify_target", "discriminate_draft",
    "mtp_evidence", "reject", "need_int", "need_tensor", "opt_bool", "trunk_layers", "DFlashBackbone",
    "check_dflash_backbone",
]


@attrs.frozen
class Verified:
    """A validator's result: the contract, the largest K it supports, and the facts it proved.

    ``backbone`` is the typed :class:`DFlashBackbone` of a ``dflash``-arch draft (DFlash v1, DFlash2,
    DSpark) as :func:`check_dflash_backbone` returned it: what their proposer reads, as attributes
    (``facts`` is the evidence the receipt shows)."""

    mode: str
    max_k: int | None = None
    facts: Mapping[str, Any] = attrs.field(factory=dict)
    backbone: DFlashBackbone | None = None


#: architectures with an ``LLM_GRAPH_TYPE_DECODER_MTP`` graph in the pinned llama.cpp
MTP_ARCHS = frozenset({
    "qwen3next", "qwen35", "qwen35moe", "glm4moe", "glm-dsa", "glm5-next", "deepseek2", "deepseek32",
    "deepseek4", "mimo2", "step35", "bailingmoe3", "cohere2moe", "hy_v3", "nemotron_h_moe",
})
#: MTP archs whose graph asserts a single nextn block
MTP_SINGLE_BLOCK_ARCHS = frozenset({"nemotron_h_moe"})
#: MTP archs that chain one head per draft step (K <= number of heads)
MTP_CHAINED_ARCHS = frozenset({"step35"})
# LAYER_INPUT_ARCHS (target archs whose graph records ``t_layer_inp``: DFlash/DSpark layer taps) and
# FINAL_TAP_ARCHS (those that also record the output of the last layer, ``lid == n_layer``) are
# generated from the pinned llama.cpp source in ``archs`` and shared with power-native's tap call.
DFLASH_ARCH = "dflash"
#: EAGLE3 drafts (power-eagle3): one architecture, one contract; ``auto`` names it only for a given draft
EAGLE3_ARCH = "eagle3"
DSPARK_MARKER = "markov_w1.weight"
DFLASH2_MARKER = "selector_hidden.weight"
_DSPARK_TENSORS = ("markov_w1.weight", "markov_w2.weight", "markov_w2.scale", "conf_proj.weight", "conf_proj.bias")
_DFLASH2_TENSORS = ("selector_hidden.weight", "selector_predecessor.weight", "selector_successor.weight")
_DFLASH2_KEYS = ("dflash.selector_rank", "dflash.selector_top_k", "dflash.conv_kernel_size", "dflash.conv_group_size")
_CONV_RE = re.compile(r"^blk\.\d+\.(attn|ffn)_conv_(base|proj\.weight)$")
_BLK_RE = re.compile(r"^blk\.(\d+)\.")


def reject(view: ArtifactView | None, message: str, reason: str, evidence: str, *, mismatch: bool = False) -> ArtifactError:
    """Build the typed error; ``mismatch`` for files that are valid alone but do not fit together."""
    where = f"{view.path}: " if view is not None else ""
    cls = ArtifactMismatch if mismatch else ArtifactError
    return cls(f"{where}{message}", reason=reason, evidence=evidence)


def need_int(view: ArtifactView, key: str, prefix: str, *, minimum: int = 1, required: bool = True,
             default: int | None = None) -> int | None:
    """An integer key ``>= minimum``: ``<prefix>_key_missing`` / ``<prefix>_key_invalid`` otherwise."""
    if key not in view.metadata:
        if required:
            raise reject(view, f"required key {key} is missing", f"{prefix}_key_missing", key)
        return default
    try:
        v = view.int_key(key)
    except ArtifactError:
        raise reject(view, f"{key} must be an integer, found {view.value_types.get(key)}", f"{prefix}_key_invalid",
                     key) from None
    assert v is not None
    if v < minimum:
        raise reject(view, f"{key}={v} must be >= {minimum}", f"{prefix}_key_invalid", key)
    return v


def opt_bool(view: ArtifactView, key: str, prefix: str) -> bool | None:
    """A BOOL key or None when absent; any other type is ``<prefix>_key_invalid``."""
    if key not in view.metadata:
        return None
    if view.value_types.get(key) != "BOOL":
        raise reject(view, f"{key} must be a bool, found {view.value_types.get(key)}", f"{prefix}_key_invalid", key)
    return bool(view.metadata[key])


def need_tensor(view: ArtifactView, name: str, prefix: str, shape: Iterable[int | None] | None = None) -> tuple[int, ...]:
    """The tensor's ne shape; ``<prefix>_tensor_missing`` / ``<prefix>_tensor_shape`` (None = any extent)."""
    got = view.shape(name)
    if got is None:
        raise reject(view, f"required tensor {name} is missing", f"{prefix}_tensor_missing", name)
    if shape is not None:
        want = tuple(shape)
        if len(want) != len(got) or any(w is not None and w != g for w, g in zip(want, got, strict=True)):
            shown = "{" + ", ".join("*" if w is None else str(w) for w in want) + "}"
            raise reject(view, f"tensor {name} has ne {list(got)}, expected {shown}", f"{prefix}_tensor_shape", name)
    return got


def trunk_layers(target: ArtifactView) -> tuple[int, int]:
    """(n_layer_all, n_nextn) of a target; ``target_key_missing``/``target_key_invalid`` when unreadable."""
    n_all = need_int(target, target.arch_key("block_count"), "target")
    n_nextn = need_int(target, target.arch_key("nextn_predict_layers"), "target", minimum=0, required=False, default=0)
    assert n_all is not None and n_nextn is not None
    if n_nextn >= n_all:
        raise reject(target, f"{target.arch_key('nextn_predict_layers')}={n_nextn} leaves no trunk layers "
                     f"({target.arch_key('block_count')}={n_all})", "target_key_invalid",
                     target.arch_key("nextn_predict_layers"))
    return n_all, n_nextn


# -- discrimination ---------------------------------------------------------------------------------

def dspark_evidence(view: ArtifactView) -> str | None:
    """The first DSpark-only tensor present (the Markov/confidence head), or None."""
    return next((t for t in _DSPARK_TENSORS if view.has(t)), None)


def dflash2_evidence(view: ArtifactView) -> str | None:
    """The first DFlash2-only tensor or key present (selector, convolution), or None."""
    hit = next((t for t in _DFLASH2_TENSORS if view.has(t)), None)
    if hit:
        return hit
    hit = next((k for k in _DFLASH2_KEYS if k in view.metadata), None)
    if hit:
        return hit
    return next((t for t in view.tensors if _CONV_RE.match(t)), None)


def mtp_evidence(view: ArtifactView) -> str | None:
    """``<arch>.nextn_predict_layers`` when the file declares MTP layers (> 0) or carries nextn tensors."""
    if view.architecture is None:
        return None
    key = view.arch_key("nextn_predict_layers")
    try:
        n = view.int_key(key)
    except ArtifactError:
        return key
    if n:
        return key
    return next((t for t in view.tensors if ".nextn." in t or t.startswith("nextn.")), None)


#: the block-draft contracts of ``dflash``-arch files, with the names their messages use
BLOCK_CONTRACTS = {"dflash": "DFlash v1", "dflash2": "DFlash2", "dspark": "DSpark"}


def discriminate_draft(view: ArtifactView | None, expect: str | None = None) -> tuple[str, str]:
    """The one contract discriminator of ``dflash``-arch drafts: (contract, evidence).

    ``expect=None`` classifies a file (``auto``): the architecture must be ``dflash``; a file with
    both a DSpark head and DFlash2 parts, or with MTP layers, is rejected; otherwise DSpark evidence
    makes it ``dspark``, DFlash2 evidence ``dflash2``, and anything else ``dflash``.

    ``expect`` in :data:`BLOCK_CONTRACTS` is the opening check of that contract's validator: a
    draft is given [``draft_missing``]; the file is no other contract [``contract_is_dspark``,
    ``contract_is_dflash2``, ``contract_is_dflash_v1``] and carries its contract's marker
    (``selector_hidden.weight`` for DFlash2 [``dflash2_tensor_missing``], ``markov_w1.weight`` for
    DSpark); no second mechanism [``draft_mixed_mechanisms``]. The architecture itself is left to
    :func:`check_dflash_backbone`."""
    if expect is not None and expect not in BLOCK_CONTRACTS:
        raise ValueError(f"unknown block-draft contract {expect!r}")
    if view is None:
        assert expect is not None
        raise reject(None, f"spec_mode '{expect}' needs a {BLOCK_CONTRACTS[expect]} draft file", "draft_missing",
                     "draft", mismatch=True)
    if expect is None and view.architecture != DFLASH_ARCH:
        raise reject(view, f"general.architecture is {view.architecture!r}; draft files must be 'dflash' "
                     "(DFlash v1, DFlash2, DSpark) or 'eagle3'", "draft_unknown_contract", "general.architecture")
    sp, d2 = dspark_evidence(view), dflash2_evidence(view)
    found, ev = ("dspark", sp) if sp else ("dflash2", d2) if d2 else ("dflash", "general.architecture")
    if expect is not None:
        _check_expected(view, expect, found, ev, d2)
    if sp and d2:
        if expect is None:
            raise reject(view, f"the draft carries both a DSpark head ({sp}) and DFlash2 parts ({d2}); two draft "
                         "mechanisms in one file are not a contract Power runs", "draft_mixed_mechanisms", d2)
        raise reject(view, f"the draft carries both the DSpark Markov head and DFlash2 parts ({d2}); two draft "
                     "mechanisms in one file", "draft_mixed_mechanisms", d2)
    mt = mtp_evidence(view)
    if mt:
        raise reject(view, f"the draft also declares MTP layers ({mt}); two draft mechanisms at once",
                     "draft_mixed_mechanisms", mt)
    return found, ev


def _check_expected(view: ArtifactView, expect: str, found: str, ev: str, d2: str | None) -> None:
    """Reject a file whose evidence (``found``/``ev``) or missing marker says it is not ``expect``."""
    want = BLOCK_CONTRACTS[expect]
    if expect == "dspark":
        if view.has(DSPARK_MARKER):
            return
        if d2 is not None:
            raise reject(view, f"this is a DFlash2 draft ({d2} is present, {DSPARK_MARKER} is absent), not DSpark; "
                         "use spec_mode 'dflash2'", "contract_is_dflash2", DSPARK_MARKER)
        raise reject(view, f"this is a DFlash v1 draft ({DSPARK_MARKER} is absent), not DSpark; use spec_mode "
                     "'dflash'", "contract_is_dflash_v1", DSPARK_MARKER)
    if found != expect and found != "dflash":
        raise reject(view, f"this is a {BLOCK_CONTRACTS[found]} draft ({ev} is present), not {want}; use spec_mode "
                     f"'{found}'", f"contract_is_{found}", ev)
    if expect == "dflash2" and not view.has(DFLASH2_MARKER):
        if found == "dflash":
            raise reject(view, f"this is a DFlash v1 draft ({DFLASH2_MARKER} is absent and no selector/conv part is "
                         "present), not DFlash2; use spec_mode 'dflash'", "contract_is_dflash_v1", DFLASH2_MARKER)
        raise reject(view, f"the draft has DFlash2 parts ({ev}) but not the selector tensor {DFLASH2_MARKER}",
                     "dflash2_tensor_missing", DFLASH2_MARKER)


def classify_draft(view: ArtifactView) -> tuple[str, str]:
    """(contract, evidence) of a draft file: ``eagle3`` for the ``eagle3`` architecture, else ``dspark``,
    ``dflash2`` or ``dflash``; mixed files are rejected (:func:`discriminate_draft` without an expected
    contract)."""
    if view.architecture == EAGLE3_ARCH:
        return EAGLE3_ARCH, "general.architecture"
    return discriminate_draft(view)


def classify_target(view: ArtifactView) -> tuple[str, str] | None:
    """(contract, evidence) of what a target file can draft for itself (``mtp``: it carries MTP layers), or
    None. ``auto`` runs the installed strategies' own detectors; this only names what to install when none
    of them claimed the target."""
    evidence = mtp_evidence(view)
    return ("mtp", f"MTP layers ({evidence})") if evidence is not None else None


# -- the dflash backbone ----------------------------------------------------------------------------

@attrs.frozen
class DFlashBackbone:
    """Facts of a ``dflash``-arch draft shared by DFlash v1, DFlash2 and DSpark."""

    n_embd: int
    n_layer: int
    n_ff: int
    target_layers: tuple[int, ...]
    target_n_embd: int
    block_size: int
    block_size_declared: bool
    mask_token_id: int
    n_vocab: int
    own_embeddings: bool
    causal: bool
    sample_from_anchor: bool


_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                  "ffn_gate", "ffn_up", "ffn_down")


def check_dflash_backbone(target: ArtifactView, draft: ArtifactView, prefix: str = "dflash") -> DFlashBackbone:
    """Keys, ``target_layers`` against the target's tappable layers, mask token, and backbone tensors."""
    if draft.architecture != DFLASH_ARCH:
        raise reject(draft, f"general.architecture is {draft.architecture!r}, expected 'dflash'",
                     "contract_wrong_arch", "general.architecture")
    k = draft.arch_key
    for key in ("context_length", "attention.head_count", "attention.head_count_kv"):
        need_int(draft, k(key), prefix)
    if k("attention.layer_norm_rms_epsilon") not in draft.metadata:
        raise reject(draft, f"required key {k('attention.layer_norm_rms_epsilon')} is missing",
                     f"{prefix}_key_missing", k("attention.layer_norm_rms_epsilon"))
    n_layer = need_int(draft, k("block_count"), prefix)
    n_embd = need_int(draft, k("embedding_length"), prefix)
    n_ff = need_int(draft, k("feed_forward_length"), prefix)
    assert n_layer is not None and n_embd is not None and n_ff is not None

    # target_layers: input-of-layer indices the target must be able to tap
    tl_key = k("target_layers")
    if tl_key not in draft.metadata:
        raise reject(draft, f"required key {tl_key} is missing (llama.cpp: \"DFlash model requires "
                     "'target_layers'\")", f"{prefix}_key_missing", tl_key)
    if draft.value_types.get(tl_key) not in ("ARRAY[INT32]", "ARRAY[UINT32]"):
        raise reject(draft, f"{tl_key} must be an INT32/UINT32 array, found {draft.value_types.get(tl_key)}",
                     f"{prefix}_key_invalid", tl_key)
    tl = draft.metadata[tl_key]
    if not isinstance(tl, tuple) or not tl:
        raise reject(draft, f"{tl_key} must be a non-empty array", f"{prefix}_key_invalid", tl_key)
    if len(set(tl)) != len(tl):
        raise reject(draft, f"{tl_key}={list(tl)} repeats a layer", f"{prefix}_key_invalid", tl_key)
    tarch = target.architecture
    if tarch not in LAYER_INPUT_ARCHS:
        raise reject(target, f"target architecture {tarch!r} does not record layer inputs, so no DFlash/DSpark "
                     "draft can tap it (llama.cpp would abort)", "dflash_target_untappable", "general.architecture",
                     mismatch=True)
    n_all, n_nextn = trunk_layers(target)
    n_trunk = n_all - n_nextn
    top = n_trunk if tarch in FINAL_TAP_ARCHS else n_trunk - 1
    for i, lid in enumerate(tl):
        if not 0 <= lid <= top:
            raise reject(draft, f"{tl_key}[{i}]={lid} is outside the target's tappable layers [0, {top}] "
                         f"({tarch}, {n_trunk} trunk layers)", "dflash_target_layer_out_of_range",
                         f"{tl_key}[{i}]", mismatch=True)
    t_embd = need_int(target, target.arch_key("embedding_length"), "target")
    assert t_embd is not None

    block_size = need_int(draft, k("block_size"), prefix, minimum=1, required=False, default=16)
    assert block_size is not None
    causal = opt_bool(draft, k("attention.causal"), prefix)
    anchor = opt_bool(draft, k("sample_from_anchor"), prefix)
    opt_bool(draft, k("has_confidence_head"), prefix)

    # the mask token: required at runtime (llama_vocab_mask), default -1 otherwise
    voc = draft.vocab
    mask = voc.special.get("mask") if voc is not None else None
    if mask is None:
        raise reject(draft, "tokenizer.ggml.mask_token_id is missing; DFlash/DSpark drafts need a mask token",
                     f"{prefix}_mask_token_missing", "tokenizer.ggml.mask_token_id")
    n_vocab = draft.n_vocab
    if n_vocab is None:
        raise reject(draft, "the draft has no vocabulary (tokenizer.ggml.tokens) and no token_embd.weight",
                     "vocab_missing", "tokenizer.ggml.tokens")
    if not 0 <= mask < n_vocab:
        raise reject(draft, f"tokenizer.ggml.mask_token_id={mask} is outside the vocabulary [0, {n_vocab})",
                     f"{prefix}_mask_token_out_of_range", "tokenizer.ggml.mask_token_id")

    # the pinned llama.cpp sizes the feature input as n_target_layers * the draft's own n_embd
    # (src/models/dflash.cpp:41), so the target's layer inputs fit only when the widths are equal
    if n_embd != t_embd:
        raise reject(draft, f"the draft's n_embd ({n_embd}) differs from the target's ({t_embd}); llama.cpp feeds "
                     f"it {len(tl)} target layer inputs of the target's width", f"{prefix}_embd_mismatch",
                     k("embedding_length"), mismatch=True)
    need_tensor(draft, "fc.weight", prefix, (len(tl) * t_embd, n_embd))
    need_tensor(draft, "enc.output_norm.weight", prefix, (n_embd,))
    need_tensor(draft, "output_norm.weight", prefix, (n_embd,))
    own = True
    # a reduced-vocabulary export (d2t) has fewer output rows; vocab.compare_vocab checks d2t against them
    n_out = None if draft.has("d2t") else n_vocab
    for name, rows in (("token_embd.weight", n_vocab), ("output.weight", n_out)):
        if draft.has(name):
            need_tensor(draft, name, prefix, (n_embd, rows))
        else:
            own = False
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes: dict[str, tuple[int | None, ...]] = {
            "attn_norm": (n_embd,), "ffn_norm": (n_embd,), "attn_q": (n_embd, None), "attn_k": (n_embd, None),
            "attn_output": (None, n_embd), "attn_q_norm": (None,), "attn_k_norm": (None,),
            "ffn_gate": (n_embd, n_ff), "ffn_up": (n_embd, n_ff), "ffn_down": (n_ff, n_embd),
        }
        for t in _LAYER_TENSORS:
            need_tensor(draft, p + t + ".weight", prefix, shapes[t])
    for name in draft.tensors:
        m = _BLK_RE.match(name)
        if m and int(m.group(1)) >= n_layer:
            raise reject(draft, f"tensor {name} belongs to no layer ({k('block_count')}={n_layer})",
                         f"{prefix}_tensor_unexpected", name)
    return DFlashBackbone(n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, target_layers=tuple(tl), target_n_embd=t_embd,
                          block_size=block_size, block_size_declared=k("block_size") in draft.metadata,
                          mask_token_id=mask, n_vocab=n_vocab, own_embeddings=own,
                          causal=bool(causal), sample_from_anchor=True if anchor is None else anchor)
