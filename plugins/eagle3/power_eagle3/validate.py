"""The EAGLE3 contract: an ``eagle3``-arch draft (llama.cpp ``src/models/eagle3.cpp``) for a target.

What the pinned llama.cpp loads and runs, checked before anything native is touched (it aborts on
several of these files: a narrower draft that inherits the target's embeddings, a layer id past the
target's, a tap the target's graph never records, a second decoder layer). Reason codes in brackets;
``evidence`` names the key or tensor.

* a draft is given [``draft_missing``] and its architecture is ``eagle3`` [``contract_wrong_arch``];
  it declares no MTP layers [``draft_mixed_mechanisms``];
* the keys llama.cpp reads: ``context_length``, ``embedding_length``, ``feed_forward_length``,
  ``attention.head_count(_kv)``, ``attention.layer_norm_rms_epsilon``, ``target_hidden_size``
  [``eagle3_key_missing``, ``eagle3_key_invalid``]; ``block_count`` is 1 (the graph asserts one
  decoder layer) [``eagle3_key_invalid``]; ``norm_before_residual`` / ``norm_before_fc`` are BOOL
  when present [``eagle3_key_invalid``];
* ``eagle3.target_layers``: an integer array of exactly 3 ids, each a layer whose input the target's
  graph records (``LAYER_INPUT_ARCHS``, ids below its trunk layer count) or the target's layer count
  itself, which llama.cpp reads as the target's final hidden state (``llama_get_embeddings_nextn``,
  only where the target's decoder graph sets it: ``NEXTN_TAP_ARCHS``)
  [``eagle3_key_missing``, ``eagle3_key_invalid``, ``eagle3_target_layer_out_of_range``,
  ``eagle3_target_untappable``];
* ``eagle3.target_hidden_size`` equals the target's ``embedding_length`` (the encoder's input is
  three target rows) [``eagle3_target_hidden_mismatch``];
* tensors and shapes: ``fc`` ``{3 * target width, n_embd}``; ``enc.output_norm`` exactly when
  ``norm_before_fc`` (llama.cpp loads it only then, and a file that carries it otherwise fails to
  load) [``eagle3_tensor_missing``, ``eagle3_tensor_unexpected``]; the decoder layer over
  ``[embed, g]`` (``attn_q/k/v`` take ``2 * n_embd`` inputs); ``output_norm``
  [``eagle3_tensor_missing``, ``eagle3_tensor_shape``];
* embeddings: an own ``token_embd`` is ``{n_embd, target vocabulary}``; a draft without
  ``token_embd`` or ``output`` inherits the target's through ``ctx_other``, so it must be as wide as the
  target [``eagle3_embd_mismatch``];
* the tokenizer equals the target's, and a ``d2t`` table (I64) holds one unique absolute target id per
  row of the draft's output: ``power_core.artifacts.vocab.compare_vocab``, which selection runs after
  this validator [``vocab_*``, ``d2t_invalid``]. Its row count must match the output here too
  [``eagle3_tensor_shape``].
"""

from __future__ import annotations

from typing import Any

import attrs

from power_core.artifacts import ArtifactView
from power_core.artifacts.contracts import (
    EAGLE3_ARCH,
    LAYER_INPUT_ARCHS,
    NEXTN_TAP_ARCHS,
    Verified,
    mtp_evidence,
    need_int,
    need_tensor,
    opt_bool,
    reject,
    trunk_layers,
)

__all__ = ["Eagle3Head", "Eagle3Verified", "validate_eagle3", "N_TAPS"]

#: EAGLE3 fuses exactly three target layers (llama.cpp: "EAGLE3 requires exactly 3 entries")
N_TAPS = 3
_PREFIX = "eagle3"


@attrs.frozen
class Eagle3Head:
    """What the validator proved about an EAGLE3 draft, as its proposer reads it."""

    n_embd: int
    n_ff: int
    target_layers: tuple[int, int, int]
    #: the target's layer count as llama.cpp counts it (an id equal to it taps the final hidden state)
    target_n_layer: int
    target_n_embd: int
    #: rows of the draft's output: the target's vocabulary, or the ``d2t`` table's length
    draft_vocab: int
    own_embeddings: bool
    own_output: bool
    d2t: bool
    norm_before_residual: bool
    norm_before_fc: bool

    @property
    def final_tap(self) -> bool:
        """One of the taps is the target's final hidden state (id == the target's layer count)."""
        return self.target_n_layer in self.target_layers


@attrs.frozen
class Eagle3Verified(Verified):
    """The contract's result: :class:`~power_core.artifacts.contracts.Verified` plus the typed head."""

    head: Eagle3Head | None = None


def _target_layers(target: ArtifactView, draft: ArtifactView) -> tuple[tuple[int, int, int], int]:
    key = draft.arch_key("target_layers")
    if key not in draft.metadata:
        raise reject(draft, f"required key {key} is missing (llama.cpp: \"EAGLE3 model requires 'extract_layers'\")",
                     f"{_PREFIX}_key_missing", key)
    if draft.value_types.get(key) not in ("ARRAY[INT32]", "ARRAY[UINT32]"):
        raise reject(draft, f"{key} must be an INT32/UINT32 array, found {draft.value_types.get(key)}",
                     f"{_PREFIX}_key_invalid", key)
    ids = draft.metadata[key]
    if not isinstance(ids, tuple) or len(ids) != N_TAPS:
        n = len(ids) if isinstance(ids, tuple) else 0
        raise reject(draft, f"{key} has {n} entries; EAGLE3 fuses exactly {N_TAPS} target layers",
                     f"{_PREFIX}_key_invalid", key)
    tarch = target.architecture
    if tarch not in LAYER_INPUT_ARCHS:
        raise reject(target, f"target architecture {tarch!r} does not record layer inputs, so no EAGLE3 draft can "
                     "tap it (llama.cpp would abort)", f"{_PREFIX}_target_untappable", "general.architecture",
                     mismatch=True)
    n_all, n_nextn = trunk_layers(target)
    n_trunk = n_all - n_nextn
    for i, lid in enumerate(ids):
        if lid == n_all:  # llama.cpp: the target's final hidden state (nextn embeddings)
            if tarch not in NEXTN_TAP_ARCHS:
                raise reject(draft, f"{key}[{i}]={lid} is the target's layer count, which llama.cpp reads as its "
                             f"final hidden state; {tarch!r} does not publish one (llama.cpp would abort)",
                             f"{_PREFIX}_target_untappable", f"{key}[{i}]", mismatch=True)
        elif not 0 <= lid < n_trunk:
            hint = f" or {n_all} (the final hidden state)" if tarch in NEXTN_TAP_ARCHS else ""
            raise reject(draft, f"{key}[{i}]={lid} is outside the target's tappable layers [0, {n_trunk - 1}]{hint} "
                         f"({tarch}, {n_all} layers)", f"{_PREFIX}_target_layer_out_of_range", f"{key}[{i}]",
                         mismatch=True)
    return (int(ids[0]), int(ids[1]), int(ids[2])), n_all


def validate_eagle3(target: ArtifactView, draft: ArtifactView | None, config: Any = None) -> Eagle3Verified:
    """Prove ``draft`` is an EAGLE3 draft for ``target``; raise a typed ArtifactError naming the key otherwise."""
    if draft is None:
        raise reject(None, "spec_mode 'eagle3' needs an EAGLE3 draft file (--draft)", "draft_missing", "draft",
                     mismatch=True)
    if draft.architecture != EAGLE3_ARCH:
        raise reject(draft, f"general.architecture is {draft.architecture!r}, expected 'eagle3'",
                     "contract_wrong_arch", "general.architecture")
    if (mt := mtp_evidence(draft)) is not None:
        raise reject(draft, f"the draft also declares MTP layers ({mt}); two draft mechanisms at once",
                     "draft_mixed_mechanisms", mt)
    k = draft.arch_key
    for key in ("context_length", "attention.head_count", "attention.head_count_kv"):
        need_int(draft, k(key), _PREFIX)
    if k("attention.layer_norm_rms_epsilon") not in draft.metadata:
        raise reject(draft, f"required key {k('attention.layer_norm_rms_epsilon')} is missing",
                     f"{_PREFIX}_key_missing", k("attention.layer_norm_rms_epsilon"))
    n_layer = need_int(draft, k("block_count"), _PREFIX)
    n_embd = need_int(draft, k("embedding_length"), _PREFIX)
    n_ff = need_int(draft, k("feed_forward_length"), _PREFIX)
    n_head = need_int(draft, k("attention.head_count"), _PREFIX)
    n_head_kv = need_int(draft, k("attention.head_count_kv"), _PREFIX)
    hidden = need_int(draft, k("target_hidden_size"), _PREFIX)
    assert n_layer is not None and n_embd is not None and n_ff is not None and hidden is not None
    assert n_head is not None and n_head_kv is not None
    if n_layer != 1:
        raise reject(draft, f"{k('block_count')}={n_layer}; an EAGLE3 draft has exactly one decoder layer "
                     "(llama.cpp asserts it)", f"{_PREFIX}_key_invalid", k("block_count"))
    residual = opt_bool(draft, k("norm_before_residual"), _PREFIX)
    before_fc = bool(opt_bool(draft, k("norm_before_fc"), _PREFIX))
    layers, n_all = _target_layers(target, draft)
    t_embd = need_int(target, target.arch_key("embedding_length"), "target")
    assert t_embd is not None
    if hidden != t_embd:
        raise reject(draft, f"{k('target_hidden_size')}={hidden} differs from the target's width "
                     f"{target.arch_key('embedding_length')}={t_embd}; the encoder reads {N_TAPS} rows of the target's "
                     "width", f"{_PREFIX}_target_hidden_mismatch", k("target_hidden_size"), mismatch=True)
    n_vocab = target.n_vocab
    if n_vocab is None:
        raise reject(target, "the target has no vocabulary (tokenizer.ggml.tokens)", "vocab_missing",
                     "tokenizer.ggml.tokens", mismatch=True)

    width = N_TAPS * t_embd
    need_tensor(draft, "fc.weight", _PREFIX, (width, n_embd))
    if before_fc:
        need_tensor(draft, "enc.output_norm.weight", _PREFIX, (width,))
    elif draft.has("enc.output_norm.weight"):
        raise reject(draft, f"enc.output_norm.weight is present but {k('norm_before_fc')} is not true; llama.cpp "
                     "loads it only for norm_before_fc drafts (the file would not load)", f"{_PREFIX}_tensor_unexpected",
                     "enc.output_norm.weight")
    need_tensor(draft, "output_norm.weight", _PREFIX, (n_embd,))
    own_embd, own_out, has_d2t = draft.has("token_embd.weight"), draft.has("output.weight"), draft.has("d2t")
    if own_embd:
        need_tensor(draft, "token_embd.weight", _PREFIX, (n_embd, n_vocab))
    draft_vocab = n_vocab
    if has_d2t:
        d2t = draft.shape("d2t")
        assert d2t is not None
        if len(d2t) != 1:
            raise reject(draft, f"d2t has ne {list(d2t)}; it must be a vector of target ids", "d2t_invalid", "d2t")
        draft_vocab = int(d2t[0])
    if own_out:
        out = need_tensor(draft, "output.weight", _PREFIX, (n_embd, None))
        if not has_d2t and out[1] != n_vocab:
            raise reject(draft, f"output.weight has {out[1]} rows but the draft has no d2t table mapping them onto "
                         f"the target's {n_vocab} ids", f"{_PREFIX}_tensor_shape", "output.weight")
        if has_d2t and out[1] != draft_vocab:
            raise reject(draft, f"d2t has {draft_vocab} entries but output.weight has {out[1]} rows; the table "
                         "holds one target id per output row", "d2t_invalid", "d2t")
    elif has_d2t and draft_vocab != n_vocab:
        raise reject(draft, f"d2t has {draft_vocab} entries but the inherited output (the target's) has {n_vocab} "
                     "rows; the table holds one target id per output row", "d2t_invalid", "d2t", mismatch=True)
    if (not own_embd or not own_out) and n_embd != t_embd:
        missing = "token_embd.weight" if not own_embd else "output.weight"
        raise reject(draft, f"the draft has no {missing}, so it inherits the target's, but its width "
                     f"{k('embedding_length')}={n_embd} differs from the target's {t_embd} (llama.cpp would abort)",
                     f"{_PREFIX}_embd_mismatch", k("embedding_length"), mismatch=True)
    hd_k = need_int(draft, k("attention.key_length"), _PREFIX, required=False, default=n_embd // n_head)
    hd_v = need_int(draft, k("attention.value_length"), _PREFIX, required=False, default=n_embd // n_head)
    if hd_k != hd_v:
        raise reject(draft, f"{k('attention.key_length')}={hd_k} differs from {k('attention.value_length')}={hd_v} "
                     "(llama.cpp asserts equal head sizes)", f"{_PREFIX}_key_invalid", k("attention.key_length"))
    assert hd_k is not None
    p = "blk.0."
    shapes: dict[str, tuple[int | None, ...]] = {
        "attn_norm": (n_embd,), "attn_norm_2": (n_embd,), "attn_q": (2 * n_embd, hd_k * n_head),
        "attn_k": (2 * n_embd, hd_k * n_head_kv), "attn_v": (2 * n_embd, hd_k * n_head_kv),
        "attn_output": (hd_k * n_head, n_embd), "ffn_norm": (n_embd,), "ffn_gate": (n_embd, n_ff),
        "ffn_up": (n_embd, n_ff), "ffn_down": (n_ff, n_embd),
    }
    for name, shape in shapes.items():
        need_tensor(draft, p + name + ".weight", _PREFIX, shape)
    for name in draft.tensors:
        if name.startswith("blk.") and not name.startswith(p):
            raise reject(draft, f"tensor {name} belongs to no layer (an EAGLE3 draft has one decoder layer)",
                         f"{_PREFIX}_tensor_unexpected", name)
    head = Eagle3Head(n_embd=n_embd, n_ff=n_ff, target_layers=layers, target_n_layer=n_all, target_n_embd=t_embd,
                      draft_vocab=draft_vocab, own_embeddings=own_embd, own_output=own_out, d2t=has_d2t,
                      norm_before_residual=bool(residual), norm_before_fc=before_fc)
    facts = attrs.asdict(head)
    return Eagle3Verified(mode="eagle3", facts=facts, head=head)
