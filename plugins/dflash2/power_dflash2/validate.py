"""The DFlash2 contract: the ``dflash`` backbone plus a selector lattice and per-layer convolutions.

Rules (reason codes in brackets): no DSpark tensor [``contract_is_dspark``]; the
marker ``selector_hidden.weight`` is present — a file with no DFlash2 part at all is a v1 draft
[``contract_is_dflash_v1``], one with some parts but no marker is broken [``dflash2_tensor_missing``];
no MTP layers [``draft_mixed_mechanisms``]; the shared backbone (``dflash2_*`` codes); keys
``dflash.selector_rank``, ``selector_top_k``, ``conv_kernel_size``, ``conv_group_size``,
``block_size`` present and > 0 [``dflash2_key_missing``, ``dflash2_key_invalid``];
``n_embd % conv_group_size == 0`` [``dflash2_conv_group_indivisible``]; ``n_embd >= top_k*(top_k+1)``
(the lattice is packed into one hidden row) [``dflash2_lattice_too_small``]; ``top_k <= n_vocab``;
``block_size >= 2``; tensors ``selector_predecessor.weight``/``selector_successor.weight {rank,
n_vocab}``, ``selector_hidden.weight {n_embd, rank}``, and per layer ``blk.i.{attn,ffn}_conv_base``
(no ``.weight`` suffix) ``{n_embd, kernel, 2}`` and ``blk.i.{attn,ffn}_conv_proj.weight {n_embd,
2*kernel*n_embd/group}`` [``dflash2_tensor_missing``, ``dflash2_tensor_shape``].
"""

from __future__ import annotations

from typing import Any

import attrs

from power_core.artifacts import ArtifactView
from power_core.artifacts.contracts import (
    Verified,
    check_dflash_backbone,
    discriminate_draft,
    need_int,
    need_tensor,
    reject,
)
from power_core.errors import ConfigError

__all__ = ["validate_dflash2"]


def validate_dflash2(target: ArtifactView, draft: ArtifactView | None, config: Any = None) -> Verified:
    """Prove ``draft`` is a DFlash2 draft for ``target``; raise ArtifactError with a reason code otherwise."""
    discriminate_draft(draft, "dflash2")
    assert draft is not None
    bb = check_dflash_backbone(target, draft, "dflash2")
    p = "dflash2"
    rank = need_int(draft, "dflash.selector_rank", p)
    top_k = need_int(draft, "dflash.selector_top_k", p)
    kernel = need_int(draft, "dflash.conv_kernel_size", p)
    group = need_int(draft, "dflash.conv_group_size", p)
    block = need_int(draft, "dflash.block_size", p, minimum=2)
    assert rank and top_k and kernel and group and block
    n_embd, n_vocab = bb.n_embd, bb.n_vocab
    if n_embd % group:
        raise reject(draft, f"n_embd={n_embd} is not divisible by dflash.conv_group_size={group}",
                     "dflash2_conv_group_indivisible", "dflash.conv_group_size")
    if n_embd < top_k * (top_k + 1):
        raise reject(draft, f"n_embd={n_embd} < top_k*(top_k+1)={top_k * (top_k + 1)}: the selector lattice does not "
                     "fit in one hidden row", "dflash2_lattice_too_small", "dflash.selector_top_k")
    if top_k > n_vocab:
        raise reject(draft, f"dflash.selector_top_k={top_k} exceeds the vocabulary ({n_vocab})", "dflash2_key_invalid",
                     "dflash.selector_top_k")
    need_tensor(draft, "selector_predecessor.weight", p, (rank, n_vocab))
    need_tensor(draft, "selector_successor.weight", p, (rank, n_vocab))
    need_tensor(draft, "selector_hidden.weight", p, (n_embd, rank))
    proj = 2 * kernel * n_embd // group
    for i in range(bb.n_layer):
        for part in ("attn", "ffn"):
            need_tensor(draft, f"blk.{i}.{part}_conv_base", p, (n_embd, kernel, 2))
            need_tensor(draft, f"blk.{i}.{part}_conv_proj.weight", p, (n_embd, proj))
    if getattr(config, "spec_adaptive", False):
        raise ConfigError("spec_adaptive", True, "false for spec_mode 'dflash2'",
                          "DFlash2 runs its fixed external-draft shape; an adaptive DFlash2 profile needs separate "
                          "evidence (the seed) and is not offered")
    facts = attrs.asdict(bb) | {"selector_rank": rank, "selector_top_k": top_k, "conv_kernel_size": kernel,
                                "conv_group_size": group}
    return Verified(mode="dflash2", max_k=block - 1, facts=facts, backbone=bb)
