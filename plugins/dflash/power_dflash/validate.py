"""The DFlash v1 contract: a ``dflash``-arch draft without selector, convolution or Markov parts.

Rules (reason codes in brackets): a draft is given [``draft_missing``]; no DSpark tensor
(``markov_w1.weight`` ...) [``contract_is_dspark``]; no DFlash2 tensor or key (``selector_*``,
``dflash.conv_*``, ``blk.N.attn_conv_base`` ...) [``contract_is_dflash2``]; no MTP layers
[``draft_mixed_mechanisms``]; the shared backbone (``power_core.artifacts.contracts.check_dflash_backbone``:
required keys, ``target_layers`` within the target's tappable layers, ``mask_token_id``, ``fc``,
norms, per-layer tensors) [``dflash_key_missing``, ``dflash_key_invalid``,
``dflash_target_layer_out_of_range``, ``dflash_target_untappable``, ``dflash_mask_token_missing``,
``dflash_tensor_missing``, ``dflash_tensor_shape``, ``dflash_embd_mismatch`` ...]; ``block_size >= 2``
since v1 proposes at most ``block_size - 1`` tokens per round [``dflash_key_invalid``].
"""

from __future__ import annotations

from typing import Any

import attrs

from power_core.artifacts import ArtifactView
from power_core.artifacts.contracts import (
    Verified,
    check_dflash_backbone,
    discriminate_draft,
    reject,
)

__all__ = ["validate_dflash"]


def validate_dflash(target: ArtifactView, draft: ArtifactView | None, config: Any = None) -> Verified:
    """Prove ``draft`` is a DFlash v1 draft for ``target``; raise ArtifactError with a reason code otherwise."""
    discriminate_draft(draft, "dflash")
    assert draft is not None
    bb = check_dflash_backbone(target, draft, "dflash")
    if bb.block_size < 2:
        raise reject(draft, f"dflash.block_size={bb.block_size}: DFlash v1 proposes block_size-1 tokens, so it must "
                     "be >= 2", "dflash_key_invalid", "dflash.block_size")
    return Verified(mode="dflash", max_k=bb.block_size - 1, facts=attrs.asdict(bb), backbone=bb)
