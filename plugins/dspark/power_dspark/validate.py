"""The DSpark contract: the ``dflash`` backbone plus a Markov head (and optionally a confidence head).

Rules (reason codes in brackets): the marker ``markov_w1.weight`` is present —
otherwise the file is DFlash2 [``contract_is_dflash2``] or DFlash v1 [``contract_is_dflash_v1``];
no DFlash2 part and no MTP layers [``draft_mixed_mechanisms``]; the shared backbone (``dspark_*``
codes); ``markov_w1.weight {rank, n_vocab_target}`` and ``markov_w2.weight {rank, n_vocab_draft}``
with equal rank [``dspark_tensor_missing``, ``dspark_tensor_shape``]; confidence head consistency
[``dspark_confidence_inconsistent``]: ``dflash.has_confidence_head = true`` needs
``conf_proj.weight``, ``false`` forbids ``conf_proj.*``, absent means "present iff the tensor is";
``conf_proj.weight {n_embd + rank, 1}``, ``conf_proj.bias {1}`` only with the weight.
K is at most ``block_size`` when sampling from the anchor (the default), else ``block_size - 1``.
"""

from __future__ import annotations

from typing import Any

import attrs

from power_core.artifacts import ArtifactView
from power_core.artifacts.contracts import (
    Verified,
    check_dflash_backbone,
    discriminate_draft,
    need_tensor,
    reject,
)

__all__ = ["validate_dspark"]


def validate_dspark(target: ArtifactView, draft: ArtifactView | None, config: Any = None) -> Verified:
    """Prove ``draft`` is a DSpark draft for ``target``; raise ArtifactError with a reason code otherwise."""
    discriminate_draft(draft, "dspark")
    assert draft is not None
    bb = check_dflash_backbone(target, draft, "dspark")
    p = "dspark"
    n_vocab_t = target.n_vocab or bb.n_vocab
    w1 = need_tensor(draft, "markov_w1.weight", p, (None, n_vocab_t))
    rank = w1[0]
    # with a reduced vocabulary (d2t) the second Markov factor has one column per draft output row
    n_out = draft.tensors["d2t"].shape[0] if draft.has("d2t") else bb.n_vocab
    need_tensor(draft, "markov_w2.weight", p, (rank, n_out))
    flag = draft.metadata.get("dflash.has_confidence_head") if "dflash.has_confidence_head" in draft.metadata else None
    has_w, has_b = draft.has("conf_proj.weight"), draft.has("conf_proj.bias")
    if has_b and not has_w:
        raise reject(draft, "conf_proj.bias without conf_proj.weight", "dspark_confidence_inconsistent",
                     "conf_proj.bias")
    if flag is True and not has_w:
        raise reject(draft, "dflash.has_confidence_head=true but conf_proj.weight is missing",
                     "dspark_confidence_inconsistent", "conf_proj.weight")
    if flag is False and has_w:
        raise reject(draft, "dflash.has_confidence_head=false but conf_proj.weight is present",
                     "dspark_confidence_inconsistent", "conf_proj.weight")
    if has_w:
        need_tensor(draft, "conf_proj.weight", p, (bb.n_embd + rank, 1))
        if has_b:
            need_tensor(draft, "conf_proj.bias", p, (1,))
    p_min = getattr(config, "spec_draft_p_min", 0.0) or 0.0
    if p_min > 0 and not has_w:
        raise reject(draft, f"spec_draft_p_min={p_min} needs the DSpark confidence head, and this draft has none "
                     "(no conf_proj.weight); set spec_draft_p_min = 0", "dspark_no_confidence_head",
                     "dflash.has_confidence_head" if flag is False else "conf_proj.weight")
    max_k = bb.block_size if bb.sample_from_anchor else bb.block_size - 1
    if max_k < 1:
        raise reject(draft, f"dflash.block_size={bb.block_size} leaves no proposal per round", "dspark_key_invalid",
                     "dflash.block_size")
    facts = attrs.asdict(bb) | {"markov_rank": rank, "confidence_head": has_w}
    return Verified(mode="dspark", max_k=max_k, facts=facts, backbone=bb)
