"""``Eagle3Proposer``: the ``eagle3`` strategy's proposer, llama.cpp's ``draft-eagle3`` on power-native.

The target publishes, for every token of every batch (prompt chunks and verify passes), the rows of
the draft's three taps: the input of target layer ``L`` (``layer_inp:L``, power-native's layer-tap
driver, as the DFlash family reads it) or, for an id equal to the target's layer count, its final
hidden state (``h_nextn``), as llama.cpp reads them. The draft runs in a draft context with
``ctx_other`` = the target's (a draft without ``token_embd``/``output`` borrows them), one sequence
per target sequence (:class:`Eagle3Shared`, from the target's ``DraftPool``: the requests of a
shared-pass batch draft in one decode per step, :class:`~power_core.runtime.ProposalBatch`). Per
round (:class:`power_eagle3._eagle3.Eagle3Draft`, Cython, GIL-free per token):

* ``observe``: a prompt chunk is encoded (three taps -> ``g``) and its decoder pairs
  ``(token P+1, g P)`` written at once, the last row deferred as the boundary; a verify pass is only
  copied;
* ``commit``: the kept rows (anchor + accepted) are encoded and written, and the boundary becomes the
  last kept row's ``g``. llama.cpp runs encoder and decoder over the whole verify batch and drops the
  rejected rows at the next draft; the kept rows are the same computation;
* ``propose``: ``(anchor, boundary)`` at the boundary's position, then the decoder's own pre-norm
  state fed back for each further id; greedy, cut at ``p_min``; only the boundary row stays;
* ``restore``: KV length, position and boundary row of the checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from power_core.errors import ArtifactMismatch
from power_core.runtime import DecodeResult, Proposal, ProposalContext, Proposer, ProposerCapabilities, TokenArray
from power_core.spec import ProposerRequest
from power_eagle3.validate import N_TAPS, Eagle3Head, Eagle3Verified

__all__ = ["Eagle3Proposer", "Eagle3Shared", "open_eagle3", "target_features", "tap_names"]

#: the target's final hidden state (llama.cpp: an id equal to the target's layer count)
FINAL_TAP = "h_nextn"


def tap_names(head: Eagle3Head) -> tuple[str, ...]:
    """The target features of the draft's taps, in the draft's order (``fc``'s input order)."""
    from power_native.target import layer_feature

    return tuple(FINAL_TAP if lid == head.target_n_layer else layer_feature(lid) for lid in head.target_layers)


def target_features(verified: Any) -> frozenset[str]:
    """``Strategy.target_features``: the three taps the validator proved."""
    result = verified.result if verified is not None else None
    head = result.head if isinstance(result, Eagle3Verified) else None
    if head is None:
        raise ArtifactMismatch("the draft's target_layers are unknown (the validator did not run)",
                               evidence="eagle3.target_layers")
    return frozenset(tap_names(head))


class Eagle3Shared:
    """The EAGLE3 draft context of one target's sequences (a :class:`power_native.pool.DraftPool`
    entry): a sequence per target sequence, and the :class:`~power_core.runtime.ProposalBatch` that
    drafts for all of them in one decode per step (llama.cpp's ``draft()`` over its slots)."""

    def __init__(self, ctx: Any, n_seq: int) -> None:
        self.ctx = ctx
        self.n_seq = n_seq

    def propose_many(self, asks: Sequence[tuple[Proposer, ProposalContext]]) -> list[Proposal]:
        """One :class:`Proposal` per ask: this context's EAGLE3 proposers draft together; any other
        proposer that declared this batch (a wrapper forwarding its inner proposer's capabilities, as
        the conformance kit's recorders do) proposes alone through its own ``propose``."""
        from power_eagle3._eagle3 import draft_many

        mine = [(i, p, c) for i, (p, c) in enumerate(asks) if isinstance(p, Eagle3Proposer) and p.shared is self]
        mine.sort(key=lambda m: m[1].draft.seq)  # llama.cpp puts consecutive sequences' streams in one ubatch
        ids, passes = draft_many([p.draft for _, p, _ in mine], [c.anchor for _, _, c in mine],
                                 [c.k for _, _, c in mine], [p.p_min for _, p, _ in mine])
        stats = {"draft_passes": float(passes), "draft_batch": float(len(mine))}
        out: list[Proposal | None] = [None] * len(asks)
        for (i, _, _), x in zip(mine, ids, strict=True):
            out[i] = Proposal(x, stats=stats)
        for i, (p, c) in enumerate(asks):
            if out[i] is None:
                out[i] = p.propose(c)
        return [p for p in out if p is not None]

    def close(self) -> None:
        self.ctx.close()


class Eagle3Proposer:
    """Greedy EAGLE3 drafting on one sequence of a draft context (its own, or one the target's
    sequences share: then :attr:`ProposerCapabilities.batch` drafts them together)."""

    def __init__(self, draft: Any, taps: tuple[str, ...], *, shared: Eagle3Shared, p_min: float = 0.0,
                 in_graph: bool = False) -> None:
        self.draft = draft
        self.shared = shared
        self.taps = taps
        self.features = frozenset(taps)
        self.p_min = float(p_min)
        #: the ids from the draft's graph (Power's first-maximum sampler; a context of one sequence only);
        #: p_min reads the rows instead
        self.samples_in_graph = bool(in_graph and self.p_min <= 0 and shared.n_seq == 1
                                     and draft.ctx.set_greedy(True))

    def begin(self, prompt: TokenArray) -> None:
        self.draft.reset()

    def checkpoint(self) -> tuple[int, int, np.ndarray]:
        return self.draft.state()

    def propose(self, ctx: ProposalContext) -> Proposal:
        if ctx.k <= 0:
            return Proposal.none()
        before = self.draft.passes
        ids = self.draft.draft(ctx.anchor, ctx.k, self.p_min)
        return Proposal(ids, stats={"draft_passes": float(self.draft.passes - before), "draft_batch": 1.0})

    def observe(self, result: DecodeResult) -> None:
        try:
            rows = [result.features[name] for name in self.taps]
        except KeyError as exc:
            raise ArtifactMismatch(f"the target publishes no {exc.args[0]!r} rows; it must be opened with the "
                                   "eagle3 strategy's target features", evidence=str(exc.args[0])) from None
        # a prompt chunk goes in at once; a verify pass waits for commit (kept rows only)
        self.draft.observe(result.tokens, rows, result.kind != "prompt")

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        # a verify pass [anchor, p1..pk] keeps the anchor and the accepted proposals; the prefill round
        # (round 0, no verify pass of its own) has nothing staged
        self.draft.keep(n_accepted + 1)

    def restore(self, checkpoint: tuple[int, int, np.ndarray]) -> None:
        self.draft.set_state(*checkpoint)

    def compute_seconds(self) -> float:
        """Seconds inside llama.cpp's encode/decode calls this sequence took part in (shared passes too)."""
        return float(self.draft.compute_ns) * 1e-9

    @property
    def capabilities(self) -> ProposerCapabilities:
        """Argmax drafts (from the graph or the rows), the sequence's compute clock, a close, and the
        shared draft passes when the target's sequences share the draft context."""
        return ProposerCapabilities(samples_in_graph=self.samples_in_graph, compute_seconds=self.compute_seconds,
                                    close=self.close, batch=self.shared if self.shared.n_seq > 1 else None)

    def close(self) -> None:
        """Free this sequence's rows; the context itself closes with the target's draft pool."""
        self.draft.release()


def open_eagle3(req: ProposerRequest) -> Eagle3Proposer:
    """Strategy factory: load ``req.draft`` on the target's context, cross-checked against the validator's head."""
    from power_native import _llama
    from power_native.loading import draft_graph_sampling, load_model, offload
    from power_native.target import llama_target

    from power_eagle3._eagle3 import Eagle3Draft

    target = llama_target(req.opened.target, "EAGLE3 drafts run")
    tctx = target.ctx
    if req.draft is None or req.verified is None:
        raise ArtifactMismatch("spec_mode 'eagle3' needs a verified draft file (--draft)", evidence="draft")
    head = req.validated(Eagle3Verified).head
    if head is None:
        raise ArtifactMismatch("the validator proved no EAGLE3 head for this draft", evidence="eagle3.target_layers")
    if target.model.n_layer != head.target_n_layer:
        raise ArtifactMismatch(f"{target.model.path}: llama.cpp counts {target.model.n_layer} target layers; the "
                               f"validator read {head.target_n_layer}", evidence="block_count")
    cfg, path = req.config, req.draft
    placed = offload(cfg)
    # every setting that changes what the shared draft computes is in the key; p_min is per sequence
    key = ("eagle3", os.path.realpath(path), placed.draft_gpu_layers, tuple(placed.draft_devices),
           cfg.n_threads, cfg.flash_attn)

    def make(n_seq: int) -> Eagle3Shared:
        model = load_model(path, role="draft", n_gpu_layers=placed.draft_gpu_layers, devices=placed.draft_devices)
        if model.arch != "eagle3" or tuple(model.target_layer_ids()) != head.target_layers:
            raise ArtifactMismatch(f"{path}: llama.cpp loaded arch {model.arch!r} with target layers "
                                   f"{tuple(model.target_layer_ids())}; the validator proved 'eagle3' with "
                                   f"{head.target_layers}", evidence="eagle3.target_layers")
        # one KV stream for all sequences with flash attention, as the target's batch does (batch-invariant
        # kernels keep each sequence's cells in position order, so its rows are its solo rows); an encoder
        # pass outputs every row (llama.cpp sizes an encoder model's outputs by n_batch)
        ctx = _llama.Context(model, n_ctx=target.cells * n_seq, n_batch=tctx.n_batch, n_ubatch=tctx.n_ubatch,
                             n_rs_seq=0, n_outputs_max=tctx.n_batch, ctx_other=tctx, n_seq_max=n_seq,
                             kv_unified=cfg.flash_attn != "off" if n_seq > 1 else None,
                             n_threads=cfg.n_threads or os.cpu_count(), flash_attn=cfg.flash_attn)
        try:
            # masked: a decoder pass yields its output rows' pre-norm state; the encoder yields every row's g
            ctx.set_embeddings_nextn(True, True)
        except BaseException:
            ctx.close()
            raise
        return Eagle3Shared(ctx, n_seq)

    shared = target.drafts.shared(key, make, Eagle3Shared)
    draft = Eagle3Draft(shared.ctx, N_TAPS, head.target_n_embd, seq=target.seq_id, n_cells=target.cells)
    return Eagle3Proposer(draft, tap_names(head), shared=shared, p_min=cfg.spec_draft_p_min,
                          in_graph=draft_graph_sampling(cfg, placed.draft_gpu_layers != 0))
