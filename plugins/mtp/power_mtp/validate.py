"""The MTP contract: the target itself carries ``<arch>.nextn_predict_layers`` nextn blocks.

Rules (reason codes in brackets; ``evidence`` names the key or tensor that decided):

* no draft file — the MTP head lives in the target [``mtp_unexpected_draft``];
* ``<arch>.nextn_predict_layers`` present and > 0 [``mtp_no_nextn``];
* the architecture has an MTP graph in the pinned llama.cpp [``mtp_arch_unsupported``];
* ``block_count`` includes the nextn blocks and leaves trunk layers [``mtp_key_missing``, ``mtp_key_invalid``];
  single-block archs (nemotron_h_moe) carry exactly one [``mtp_too_many_blocks``];
* every MTP block ``b`` in ``[block_count - n, block_count)`` has ``blk.b.attn_norm.weight`` and
  ``blk.b.nextn.{eh_proj, enorm, hnorm}.weight`` with ``eh_proj {2*n_embd, n_embd}`` and norms
  ``{n_embd}``; optional ``shared_head_norm {n_embd}``, ``embed_tokens``/``shared_head_head
  {n_embd, n_vocab}`` present in all blocks or none [``mtp_tensor_missing``, ``mtp_tensor_shape``,
  ``mtp_tensor_inconsistent``]; no nextn tensor in a trunk block [``mtp_tensor_unexpected``];
* a per-layer ``<arch>.attention.recurrent_layers`` array has ``block_count`` entries and marks MTP
  blocks as attention blocks [``mtp_layer_array_length``, ``mtp_block_recurrent``];
* the FR prefix (``spec_mtp_fr_vocab_size``) is in [1, n_vocab) [``mtp_fr_vocab_too_large``].
"""

from __future__ import annotations

import re
from typing import Any

from power_core.artifacts import ArtifactView
from power_core.artifacts.contracts import (
    MTP_ARCHS,
    MTP_CHAINED_ARCHS,
    MTP_SINGLE_BLOCK_ARCHS,
    Verified,
    need_int,
    need_tensor,
    reject,
)

__all__ = ["validate_mtp"]

_NEXTN_RE = re.compile(r"^blk\.(\d+)\.nextn\.")
_OPTIONAL = ("shared_head_norm", "embed_tokens", "shared_head_head")


def validate_mtp(target: ArtifactView, draft: ArtifactView | None = None, config: Any = None) -> Verified:
    """Prove that ``target`` carries usable MTP heads; raise ArtifactError with a reason code otherwise."""
    if draft is not None:
        raise reject(draft, "spec_mode 'mtp' uses the target's own nextn heads and takes no draft file; two draft "
                     "mechanisms at once are refused", "mtp_unexpected_draft", draft.path, mismatch=True)
    arch = target.architecture
    if not arch:
        raise reject(target, "general.architecture is missing", "mtp_no_nextn", "general.architecture")
    key = target.arch_key("nextn_predict_layers")
    if key not in target.metadata or target.metadata[key] == 0:
        raise reject(target, f"{key} is {'0' if key in target.metadata else 'missing'}: the target carries no MTP "
                     "layers; use a target converted with its MTP head, or another spec_mode", "mtp_no_nextn", key)
    n_nextn = need_int(target, key, "mtp")
    if arch not in MTP_ARCHS:
        raise reject(target, f"architecture {arch!r} has no MTP graph in the pinned llama.cpp (supported: "
                     f"{', '.join(sorted(MTP_ARCHS))})", "mtp_arch_unsupported", "general.architecture")
    n_all = need_int(target, target.arch_key("block_count"), "mtp")
    assert n_nextn is not None and n_all is not None
    if n_nextn >= n_all:
        raise reject(target, f"{key}={n_nextn} must be below {target.arch_key('block_count')}={n_all} (block_count "
                     "includes the MTP blocks)", "mtp_key_invalid", key)
    if arch in MTP_SINGLE_BLOCK_ARCHS and n_nextn != 1:
        raise reject(target, f"{arch} supports exactly one MTP block, the file declares {n_nextn}",
                     "mtp_too_many_blocks", key)
    n_embd = need_int(target, target.arch_key("embedding_length"), "mtp")
    assert n_embd is not None
    n_vocab = target.n_vocab
    if n_vocab is None:
        raise reject(target, "the target has no vocabulary (tokenizer.ggml.tokens) and no token_embd.weight",
                     "vocab_missing", "tokenizer.ggml.tokens")
    first = n_all - n_nextn
    for name in target.tensors:
        m = _NEXTN_RE.match(name)
        if m and not first <= int(m.group(1)) < n_all:
            raise reject(target, f"tensor {name} is a nextn tensor outside the MTP blocks [{first}, {n_all})",
                         "mtp_tensor_unexpected", name)
    optional_present: dict[str, str] = {}
    for b in range(first, n_all):
        p = f"blk.{b}."
        need_tensor(target, p + "attn_norm.weight", "mtp")
        need_tensor(target, p + "nextn.eh_proj.weight", "mtp", (2 * n_embd, n_embd))
        need_tensor(target, p + "nextn.enorm.weight", "mtp", (n_embd,))
        need_tensor(target, p + "nextn.hnorm.weight", "mtp", (n_embd,))
        for opt in _OPTIONAL:
            name = f"{p}nextn.{opt}.weight"
            present = target.has(name)
            if b == first:
                optional_present[opt] = "yes" if present else "no"
            elif (optional_present[opt] == "yes") != present:
                raise reject(target, f"tensor {name} is {'present' if present else 'missing'} but not in MTP block "
                             f"{first}; MTP blocks must have the same tensors", "mtp_tensor_inconsistent", name)
            if present:
                need_tensor(target, name, "mtp", (n_embd,) if opt == "shared_head_norm" else (n_embd, n_vocab))
    rl_key = target.arch_key("attention.recurrent_layers")
    rl = target.metadata.get(rl_key)
    if isinstance(rl, tuple):
        if len(rl) != n_all:
            raise reject(target, f"{rl_key} has {len(rl)} entries for {n_all} blocks (incl. {n_nextn} MTP); "
                         "re-patch the per-layer array", "mtp_layer_array_length", rl_key)
        for b in range(first, n_all):
            if rl[b]:
                raise reject(target, f"{rl_key}[{b}] marks MTP block {b} as recurrent; MTP blocks are attention "
                             "blocks", "mtp_block_recurrent", f"{rl_key}[{b}]")
    fr = getattr(config, "spec_mtp_fr_vocab_size", None)
    if fr is not None and fr >= n_vocab:
        raise reject(target, f"spec_mtp_fr_vocab_size={fr} must be in [1, {n_vocab}) (the vocabulary has {n_vocab} "
                     "tokens; a prefix as large as the vocabulary is no reduction: leave the key unset)",
                     "mtp_fr_vocab_too_large", "spec_mtp_fr_vocab_size")
    return Verified(mode="mtp", max_k=n_nextn if arch in MTP_CHAINED_ARCHS else None, facts={
        "architecture": arch, "n_nextn": n_nextn, "n_layer_all": n_all, "n_trunk": first, "n_embd": n_embd,
        "n_vocab": n_vocab, "fr_vocab_size": fr, "chained_heads": arch in MTP_CHAINED_ARCHS,
    })
