"""``MtpProposer``: the ``mtp`` strategy's proposer over llama.cpp's own MTP graph.

The target is loaded with its nextn blocks (``load_mtp``) and publishes its unmasked ``h_nextn``
row for every token of every batch (prefill chunks and verify passes) as
``DecodeResult.features["h_nextn"]``. The draft runs in a second context of type MTP on the same
loaded model (:class:`power_mtp._mtp.MtpHead`, Cython). Per round, exactly as llama.cpp's
``draft-mtp`` does:

* ``propose``: greedy drafts from ``(anchor, pending_h)``, each pass feeding back the head's own
  hidden row; the draft chain is removed from the MTP KV again;
* ``observe``: prompt chunks fill the MTP KV with ``(token_k, h_{k-1})`` pairs; a verify pass is
  staged (its rows copied);
* ``commit``: the pairs of the kept tokens (anchor + accepted) are due in the MTP KV and the
  boundary row becomes the last kept token's (``verify_h[n_accepted]``). llama.cpp decodes the
  whole verify batch in a pass of its own and trims the rejected rows; Power decodes only what
  stays, ahead of the anchor in the next draft's first pass (for the requests of a batch, all of
  them in that one pass): one draft pass a round fewer, the same rows;
* ``restore``: KV length and boundary row of the checkpoint.

The sequences of a shared-pass batch share one MTP context (:class:`MtpDraft`, one KV stream per
sequence, from the target's :class:`~power_native.pool.DraftPool`), and it drafts for all of
them at once (:class:`~power_core.runtime.ProposalBatch`): each draft step is one pass over every
drafting request's token, as llama.cpp's server drafts its slots.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from power_core.errors import ArtifactMismatch, RuntimeFault, StrategyNotFound
from power_core.runtime import DecodeResult, Proposal, ProposalContext, Proposer, ProposerCapabilities, TokenArray
from power_core.spec import ProposerRequest

__all__ = ["MtpDraft", "MtpProposer", "make_mtp_proposer", "TARGET_FEATURES"]

#: what the target must provide: its MTP blocks loaded, and the unmasked h_nextn rows
TARGET_FEATURES = frozenset({"mtp_head", "h_nextn"})


class MtpDraft:
    """The MTP context of one target's sequences (a :class:`~power_native.pool.DraftPool` entry):
    a KV stream per sequence, and the :class:`~power_core.runtime.ProposalBatch` that drafts for
    several of them in one pass per step. Closed by the last of its proposers, or with the pool."""

    def __init__(self, ctx: Any, n_seq: int) -> None:
        self.ctx = ctx
        self.n_seq = n_seq
        self.members = 0

    def propose_many(self, asks: Sequence[tuple[Proposer, ProposalContext]]) -> list[Proposal]:
        from power_mtp._mtp import draft_many

        mine: list[MtpProposer] = []
        for proposer, _ in asks:
            if not isinstance(proposer, MtpProposer) or proposer.head.ctx is not self.ctx:
                raise RuntimeFault(f"MtpDraft.propose_many: {type(proposer).__name__} is not a proposer of this MTP "
                                   "context")
            mine.append(proposer)
        ids, passes = draft_many([p.head for p in mine], [ctx.anchor for _, ctx in asks], [ctx.k for _, ctx in asks],
                                 [p.p_min for p in mine])
        stats = {"draft_passes": float(passes), "draft_batch": float(len(asks))}
        return [Proposal(x, stats=stats) for x in ids]

    def release(self) -> None:
        """One proposer of it closed; the last one closes the context."""
        self.members -= 1
        if self.members <= 0:
            self.close()

    def close(self) -> None:
        self.ctx.close()


class MtpProposer:
    """Greedy MTP drafting on the target's own nextn head (single head, qwen35 style): one sequence
    of an :class:`MtpDraft`."""

    features: frozenset[str] = frozenset({"h_nextn"})

    def __init__(self, head: Any, draft: MtpDraft, *, in_graph: bool = False, p_min: float = 0.0) -> None:
        self.head = head
        self.draft = draft
        #: a draft stops at the first id whose top-10 softmax is below this (llama.cpp ``--spec-draft-p-min``)
        self.p_min = float(p_min)
        #: each draft id from the head's graph (Power's first-maximum sampler) instead of its logits row;
        #: a context of one sequence only (llama.cpp attaches the sampler to a sequence); p_min reads the rows
        self.samples_in_graph = bool(in_graph and self.p_min <= 0 and draft.n_seq == 1 and head.ctx.set_greedy(True))
        self._prefill = True  # the last observed batch was a prompt chunk, not a verify pass
        self._caps = ProposerCapabilities(samples_in_graph=self.samples_in_graph,
                                          compute_seconds=self.compute_seconds, close=self.close,
                                          batch=draft if draft.n_seq > 1 else None)

    def begin(self, prompt: TokenArray) -> None:
        self.head.reset()
        self._prefill = True

    def checkpoint(self) -> tuple[int, np.ndarray, np.ndarray | None, np.ndarray | None]:
        return self.head.state()

    def propose(self, ctx: ProposalContext) -> Proposal:
        if ctx.k <= 0:
            return Proposal.none()
        passes = self.head.passes
        ids = self.head.draft(ctx.anchor, ctx.k, self.p_min)
        return Proposal(ids, stats={"draft_passes": float(self.head.passes - passes), "draft_batch": 1.0})

    def observe(self, result: DecodeResult) -> None:
        try:
            h = result.features["h_nextn"]
        except KeyError:
            raise ArtifactMismatch("the target publishes no h_nextn rows; it must be opened with the mtp strategy's "
                                   "target features", evidence="h_nextn") from None
        self._prefill = result.kind == "prompt"
        # prompt chunks go into the MTP KV at once; a verify pass waits for commit (kept rows only)
        self.head.observe(result.tokens, h, not self._prefill)

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        # a verify pass [anchor, p1..pk] keeps the anchor and the accepted proposals; the prefill
        # round (round 0, no verify pass of its own) keeps the whole last prompt chunk
        self.head.keep(self.head.n_rows if self._prefill else n_accepted + 1)

    def restore(self, checkpoint: tuple[int, np.ndarray, np.ndarray | None, np.ndarray | None]) -> None:
        self.head.set_state(checkpoint)

    def compute_seconds(self) -> float:
        """Seconds inside llama.cpp's decode calls for this sequence (its own passes and every shared
        draft pass it took part in; ``ProposerCapabilities.compute_seconds``)."""
        return float(self.head.compute_ns) * 1e-9

    @property
    def capabilities(self) -> ProposerCapabilities:
        """Argmax drafts (from the MTP context's graph or its rows), its compute clock, a close, and the
        batch of the context's sequences (when it has several)."""
        return self._caps

    def close(self) -> None:
        self.draft.release()


def make_mtp_proposer(req: ProposerRequest) -> MtpProposer:
    """Strategy factory: an MTP context on the target's loaded model (``ctx_other`` = the target)."""
    from power_native import _llama
    from power_native.loading import draft_graph_sampling
    from power_native.target import llama_target

    from power_mtp._mtp import MtpHead

    target = llama_target(req.opened.target, "spec_mode 'mtp' runs")
    model, tctx = target.model, target.ctx
    if not model.load_mtp or model.n_layer_nextn < 1:
        raise ArtifactMismatch(f"{model.path}: the target was not loaded with its MTP blocks", evidence="load_mtp")
    if model.n_layer_nextn > 1:
        raise StrategyNotFound(f"{model.path}: nextn_predict_layers={model.n_layer_nextn}: chained MTP heads "
                               "(step35 style, one head per draft step) are not supported by this power-mtp; use a "
                               "single-head MTP target or another spec_mode")
    cfg = req.config
    fr = cfg.spec_mtp_fr_vocab_size or model.n_vocab
    cells = target.cells

    def make(n_seq: int) -> MtpDraft:
        # a KV stream per sequence (a sequence's rows never depend on its neighbours'), sized as the target's
        ctx = _llama.Context(model, n_ctx=cells * n_seq, n_batch=tctx.n_batch, n_ubatch=tctx.n_ubatch, n_rs_seq=0,
                             n_outputs_max=n_seq, ctx_type=1, ctx_other=tctx, n_seq_max=n_seq, kv_unified=False,
                             n_threads=cfg.n_threads or os.cpu_count(), flash_attn=cfg.flash_attn)
        try:
            # masked: the output tokens' rows (a draft pass's first one also carries the deferred pairs, which
            # have none; native/patches/0014 reads the right rows of the graphs that keep one per token)
            ctx.set_embeddings_nextn(True, True)
            if fr < model.n_vocab:
                ctx.set_fr_vocab(fr)  # the head's matmul covers ids < fr only; the draft reads no other
        except BaseException:
            ctx.close()
            raise
        return MtpDraft(ctx, n_seq)

    draft = target.drafts.shared(("mtp", fr), make, MtpDraft)
    draft.members += 1
    try:
        # the head runs on the target's weights: its rows leave a device where the target's do
        head = MtpHead(draft.ctx, fr, target.seq_id, cells)
        proposer = MtpProposer(head, draft, in_graph=draft_graph_sampling(cfg, target.offloaded),
                               p_min=cfg.spec_draft_p_min)
        if cfg.warmup:  # one draft pass from the zero boundary row, as a round's first draft step runs it
            head.draft(0, 1)
            head.reset()
        return proposer
    except BaseException:
        draft.release()
        raise
