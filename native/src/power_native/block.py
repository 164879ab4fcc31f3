"""The DFlash-family proposer (DFlash v1, DFlash2, DSpark share llama.cpp's ``dflash`` graph).

Everything but the readout lives here, once (``common/speculative.cpp``,
``common_speculative_impl_draft_dflash``):

* the draft GGUF is loaded with ``ctx_other`` = the target's context (drafts without
  ``token_embd``/``output`` borrow the target's), bidirectional attention unless the file says
  ``dflash.attention.causal``;
* the target publishes the inputs of the draft's ``target_layers`` for every batch (prompt chunks
  and verify passes); they are injected into the draft KV at the target positions
  (:class:`power_native._llama.BlockDraft`, chunked by ``n_ubatch``): prompt chunks at once, a
  verify pass at ``commit`` and only its kept rows (llama.cpp injects the whole verify batch and
  trims the rejected rows again; the kept rows are the same computation);
* a proposal is one decode of the noise block ``[anchor, mask x ...]`` at the anchor's position,
  always of the configured width (llama.cpp decodes ``n_max`` + 1 tokens whatever the remaining
  budget, so the non-causal block and its predictions do not depend on it), read out by the
  plugin's :class:`Readout` and cut to the round's ``k``; the noise rows leave the KV again;
* ``restore`` trims the draft KV back to the round's checkpoint;
* one draft context serves every sequence of the target (its
  :class:`~power_native.pool.DraftPool`; a KV stream per sequence, each sequence's state its own):
  concurrent requests are asked together (:meth:`SharedBlockDraft.propose_many`), their noise blocks
  decoded in one pass, each read through its own batch entries (``common_speculative_draft`` over
  llama.cpp's slots), so each proposal is the one its request would get alone.

The three plugins differ only in their :class:`Readout` (and their validators).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from power_core.artifacts.contracts import Verified
from power_core.errors import ArtifactMismatch
from power_core.runtime import DecodeResult, Proposal, ProposalContext, Proposer, ProposerCapabilities, TokenArray
from power_core.spec import ProposerRequest

if TYPE_CHECKING:  # the extension loads when a proposer opens, not when a plugin registers
    from power_native import _llama

__all__ = ["BlockRows", "Readout", "SharedBlockDraft", "BlockDraftProposer", "open_block_draft", "target_features"]


@attrs.frozen
class BlockRows:
    """What one noise-block decode exposes: ``logits`` (one row per block token, or ``None`` when
    outputs were off) and ``hidden`` (the draft's ``h_nextn`` rows: one per output when masked,
    one per block token when unmasked, e.g. DFlash2's selector lattice). Views, valid until the
    next decode on the draft."""

    logits: npt.NDArray[np.float32] | None
    hidden: npt.NDArray[np.float32]
    n_block: int
    #: each row's first-maximum id, sampled in the draft's graph (then ``logits`` is ``None``)
    ids: npt.NDArray[np.int32] | None = None


class Readout(Protocol):
    """A contract's reading of the noise block (the only part the three plugins implement)."""

    #: noise rows output logits (DFlash v1, DSpark) or not (DFlash2 reads only the lattice)
    outputs: bool
    #: the block starts with the anchor as its first proposal slot (DSpark ``sample_from_anchor``):
    #: ``n_max`` block tokens instead of ``n_max + 1``
    anchor_first: bool
    #: its proposals are the rows' argmax and it reads no logits otherwise: :attr:`BlockRows.ids`
    #: (sampled in the graph) serve as well as the rows
    argmax_only: bool

    def __call__(self, rows: BlockRows, n: int) -> TokenArray:
        """At most ``n`` proposals from ``rows``."""
        ...


def target_features(verified: Any) -> frozenset[str]:
    """``Strategy.target_features`` of the three plugins: the inputs of the draft's target layers."""
    from power_native.target import layer_feature

    result = verified.result if verified is not None else None
    backbone = result.backbone if isinstance(result, Verified) else None
    layers = backbone.target_layers if backbone is not None else ()
    if not layers:
        raise ArtifactMismatch("the draft's target_layers are unknown (the validator did not run)",
                               evidence="dflash.target_layers")
    return frozenset(layer_feature(lid) for lid in layers)


#: what a proposal drafted alone reports (:attr:`Proposal.stats`): one draft pass, for itself
_ALONE = {"draft_passes": 1.0, "draft_batch": 1.0}


class SharedBlockDraft:
    """One DFlash-family draft context for every sequence of a target (held by its
    :class:`~power_native.pool.DraftPool`), and the :class:`~power_core.runtime.ProposalBatch` of
    the proposers on it: :meth:`propose_many` decodes every asking sequence's noise block in one
    pass, each at its own positions, and reads each block's rows by its own batch entries."""

    def __init__(self, draft: _llama.BlockDraft, *, n_max: int, anchor_first: bool, outputs: bool,
                 greedy: bool) -> None:
        self.draft = draft
        self.n_max = n_max
        self.n_block = n_max if anchor_first else n_max + 1
        #: noise rows output logits (DFlash v1, DSpark) or not (DFlash2 reads only the lattice)
        self.outputs = outputs
        #: the noise rows' ids from the draft's graph (Power's first-maximum sampler), no logits rows;
        #: llama.cpp samples in the graph of a context of one sequence only
        self.samples_in_graph = bool(greedy and draft.ctx.set_greedy(True))
        #: the sequences asked together in the last shared pass whose rounds have not closed yet, and
        #: the kept rows of those that closed (injected together once the last one closes)
        self._expected: set[int] = set()
        self._deferred: dict[int, int] = {}

    @property
    def ctx(self) -> _llama.Context:
        """The draft's llama context (:class:`~power_native.pool.SharedDraft`)."""
        return self.draft.ctx

    def rows(self) -> BlockRows:
        """The rows of the last noise block decoded alone (:meth:`_llama.BlockDraft.noise`)."""
        c = self.draft.ctx
        if self.samples_in_graph:
            return BlockRows(logits=None, hidden=c.embeddings_nextn(), n_block=self.n_block, ids=c.sampled_ids())
        return BlockRows(logits=c.logits() if self.outputs else None, hidden=c.embeddings_nextn(), n_block=self.n_block)

    def propose_many(self, asks: Sequence[tuple[Proposer, ProposalContext]]) -> list[Proposal]:
        """Every ask's proposal, the noise blocks of this draft's proposers in one decode (a lone one,
        or a proposer of another draft, proposes alone); each exactly what its ``propose`` returns.
        The blocks leave every sequence's KV again, also when the pass fails."""
        out: list[Proposal] = [Proposal.none()] * len(asks)
        mine: list[tuple[int, BlockDraftProposer, int]] = []
        alone: list[int] = []
        for i, (proposer, ctx) in enumerate(asks):
            if isinstance(proposer, BlockDraftProposer) and proposer.shared is self:
                if ctx.k > 0:
                    mine.append((i, proposer, ctx.k))
            else:
                alone.append(i)
        if len(mine) == 1:
            alone.append(mine.pop()[0])
        if mine:
            mine.sort(key=lambda m: m[1].seq)  # llama.cpp puts consecutive sequences' streams in one ubatch
            draft, n_block = self.draft, self.n_block
            seqs = [p.seq for _, p, _ in mine]
            self.settle(None)
            self._expected = set(seqs)
            marks = [draft.n_kv(seq) for seq in seqs]
            stats = {"draft_passes": 1.0, "draft_batch": float(len(mine))}
            try:
                firsts = draft.noise_many(seqs, [asks[i][1].anchor for i, _, _ in mine], n_block, self.outputs)
                c = draft.ctx
                for (i, p, k), first in zip(mine, firsts.tolist(), strict=True):
                    rows = BlockRows(logits=c.logits_ith(first, n_block) if self.outputs else None,
                                     hidden=c.embeddings_nextn_ith(first, n_block), n_block=n_block)
                    out[i] = Proposal(np.asarray(p.readout(rows, min(k, self.n_max)), dtype=np.int32), stats=stats)
            except BaseException:
                self._trim(seqs, marks, quiet=True)
                raise
            self._trim(seqs, marks, quiet=False)
        for i in alone:
            proposer, ctx = asks[i]
            out[i] = proposer.propose(ctx)
        return out

    def keep(self, seq: int, n: int) -> None:
        """Sequence ``seq``'s round kept the first ``n`` rows of its staged verify pass. A sequence asked
        in the last shared pass defers them: the kept rows of every sequence of that pass are injected
        together, in one decode, when the last of their rounds closes (llama.cpp's drafter injects each
        slot's alone). Any other injects them now."""
        if seq not in self._expected:
            self.draft.inject_staged(seq, n)
            return
        self._expected.discard(seq)
        self._deferred[seq] = n
        if not self._expected:
            self.settle(None)

    def forget(self, seq: int) -> None:
        """Sequence ``seq``'s round will not close (restored, or its request left): the pass's other
        sequences inject without waiting for it."""
        self._expected.discard(seq)
        if not self._expected:
            self.settle(None)

    def settle(self, seq: int | None) -> None:
        """Inject the deferred rows now (of every sequence; ``seq``: only when it has some): before
        anything reads or moves that sequence's draft state."""
        if not self._deferred or (seq is not None and seq not in self._deferred):
            return
        seqs = sorted(self._deferred)
        counts = [self._deferred[q] for q in seqs]
        self._expected.difference_update(seqs)
        if len(seqs) == 1 or max(counts) > self.draft.chunk:
            for q, n in zip(seqs, counts, strict=True):
                del self._deferred[q]  # inject_staged drops the staged rows first, as at a commit
                self.draft.inject_staged(q, n)
        else:  # a failed decode leaves every row staged and deferred: the next settle injects it again
            self.draft.inject_staged_many(seqs, counts)
            self._deferred = {}

    def _trim(self, seqs: list[int], marks: list[int], *, quiet: bool) -> None:
        """Remove the noise rows from every sequence (each one tried); the first failure raises unless ``quiet``."""
        failure: BaseException | None = None
        for seq, mark in zip(seqs, marks, strict=True):
            try:
                self.draft.trim(seq, mark)
            except BaseException as exc:  # trim the others still
                failure = failure or exc
        if failure is not None and not quiet:
            raise failure

    def close(self) -> None:
        self.draft.ctx.close()


class BlockDraftProposer:
    """The Proposer of one sequence on a DFlash-family draft context (:class:`SharedBlockDraft`, its
    sequence ``seq``); ``readout`` makes it v1, DFlash2 or DSpark."""

    def __init__(self, shared: SharedBlockDraft, seq: int, readout: Readout, *, target_layers: tuple[int, ...]) -> None:
        from power_native.target import layer_feature

        self.shared = shared
        self.draft = shared.draft
        self.seq = seq
        self.readout = readout
        self.samples_in_graph = shared.samples_in_graph
        self.layers = tuple(layer_feature(lid) for lid in target_layers)
        self.features = frozenset(self.layers)
        self.n_max = shared.n_max
        self.n_block = shared.n_block
        self._start = 0  # position of the last observed batch's first token
        self._rows = 0  # tokens of the last observed batch
        self._prefill = True

    # -- protocol ---------------------------------------------------------------------------------
    def begin(self, prompt: TokenArray) -> None:
        self.shared.forget(self.seq)
        self.shared.settle(self.seq)
        self.draft.reset(self.seq)
        self._start = self._rows = 0
        self._prefill = True

    def checkpoint(self) -> int:
        self.shared.settle(self.seq)
        return int(self.draft.n_kv(self.seq))

    def propose(self, ctx: ProposalContext) -> Proposal:
        k = ctx.k
        if k <= 0:
            return Proposal.none()
        draft, seq, shared = self.draft, self.seq, self.shared
        shared.settle(seq)
        pos0 = draft.n_kv(seq)
        try:
            draft.noise(seq, ctx.anchor, self.n_block, shared.outputs)
            props = np.asarray(self.readout(shared.rows(), k if k < self.n_max else self.n_max), dtype=np.int32)
        finally:
            draft.trim(seq, pos0)  # the noise block never stays in the draft KV
        return Proposal(props, stats=_ALONE)

    def observe(self, result: DecodeResult) -> None:
        try:
            layers = [result.features[name] for name in self.layers]
        except KeyError as exc:
            raise ArtifactMismatch(f"the target publishes no {exc.args[0]!r} rows; it must be opened with the "
                                   "strategy's target features", evidence=str(exc.args[0])) from None
        draft, seq = self.draft, self.seq
        self.shared.settle(seq)  # its deferred rows are in the staging buffer this pass overwrites
        self._start = draft.n_kv(seq)
        self._rows = result.tokens.shape[0]
        self._prefill = result.kind == "prompt"
        if self._prefill:
            draft.inject(seq, layers)
        else:  # copied into the draft's staging rows: a replay decode may overwrite the target's before commit
            draft.stage(seq, layers)

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        # a verify pass [anchor, p1..pk] keeps the anchor's and the accepted proposals' features; the
        # prefill round (round 0) keeps the whole last prompt chunk, already injected
        if self.draft.n_staged(self.seq):
            self.shared.keep(self.seq, n_accepted + 1)
        else:
            self.shared.forget(self.seq)
            self.draft.trim(self.seq, self._start + self._rows)

    def restore(self, checkpoint: int) -> None:
        self.shared.forget(self.seq)
        self.shared.settle(self.seq)
        self.draft.drop_staged(self.seq)
        self.draft.trim(self.seq, int(checkpoint))

    def compute_seconds(self) -> float:
        """Seconds inside llama.cpp's decodes of this sequence on the draft context: its injections and
        every noise decode holding its block (``ProposerCapabilities.compute_seconds``)."""
        return float(self.draft.compute_ns(self.seq)) * 1e-9

    @property
    def capabilities(self) -> ProposerCapabilities:
        """Argmax drafts (from the draft context's graph or its rows), its compute clock, and the draft
        batch it is asked in with the other sequences on its draft context (which the target's draft
        pool closes, not the proposer)."""
        return ProposerCapabilities(samples_in_graph=self.samples_in_graph, compute_seconds=self.compute_seconds,
                                    batch=self.shared)


def open_block_draft(req: ProposerRequest, make_readout: Callable[[_llama.Model, Any], Readout]) -> BlockDraftProposer:
    """Load ``req.draft`` on the target's llama.cpp context and wrap it with the contract's readout.

    ``req.validated(Verified).backbone`` is the contract validator's typed result (target layers,
    block size, causality, sample_from_anchor); the loaded model is cross-checked against it before
    any decode."""
    from power_native import _llama
    from power_native.loading import draft_graph_sampling, load_model, offload
    from power_native.target import llama_target

    target = llama_target(req.opened.target, "block drafters run")
    tctx = target.ctx
    if req.draft is None or req.verified is None:
        raise ArtifactMismatch("a DFlash-family strategy needs a verified draft file (--draft)", evidence="draft")
    backbone = req.validated(Verified).backbone
    if backbone is None:
        raise ArtifactMismatch("the validator proved no dflash backbone for this draft", evidence="dflash.target_layers")
    layers = backbone.target_layers
    placed = offload(req.config)
    model = load_model(req.draft, role="draft", n_gpu_layers=placed.draft_gpu_layers, devices=placed.draft_devices)
    if model.arch != "dflash" or tuple(model.target_layer_ids()) != layers:
        raise ArtifactMismatch(f"{req.draft}: llama.cpp loaded arch {model.arch!r} with target layers "
                               f"{tuple(model.target_layer_ids())}; the validator proved 'dflash' with {layers}",
                               evidence="dflash.target_layers")
    readout = make_readout(model, req)
    block = backbone.block_size
    anchor_first = bool(readout.anchor_first)
    limit = block if anchor_first else block - 1
    n_max = min(req.config.draft_max, limit)
    n_block = n_max if anchor_first else n_max + 1
    outputs = bool(readout.outputs)
    greedy = bool(outputs and readout.argmax_only
                  and draft_graph_sampling(req.config, placed.draft_gpu_layers != 0))
    n_threads = req.config.n_threads or os.cpu_count()
    flash_attn = req.config.flash_attn

    def make(n_seq: int) -> SharedBlockDraft:
        # one KV stream per sequence (a sequence's rows never depend on its neighbours'), each of the
        # target sequence's cells; a pass holds every sequence's block, injections keep the solo chunking
        width = max(n_seq * n_block, 1)
        ctx = _llama.Context(model, n_ctx=target.cells * n_seq, n_batch=max(tctx.n_batch, width),
                             n_ubatch=max(tctx.n_ubatch, width), n_rs_seq=0, n_outputs_max=width, ctx_other=tctx,
                             n_threads=n_threads, flash_attn=flash_attn, n_seq_max=n_seq,
                             kv_unified=False if n_seq > 1 else None)
        try:
            ctx.set_embeddings_nextn(True, outputs)  # masked rows follow the outputs; DFlash2: all rows
            ctx.set_causal_attn(backbone.causal)
            draft = _llama.BlockDraft(ctx, len(layers), model.mask, n_seq, tctx.n_ubatch)
            return SharedBlockDraft(draft, n_max=n_max, anchor_first=anchor_first, outputs=outputs, greedy=greedy)
        except BaseException:
            ctx.close()
            raise

    # every setting that changes what the draft context computes (the readouts' own, e.g. p_min, do not)
    key = ("block", os.path.realpath(req.draft), placed.draft_gpu_layers, tuple(placed.draft_devices), n_max,
           anchor_first, outputs, backbone.causal, greedy, n_threads, flash_attn)
    shared = target.drafts.shared(key, make, SharedBlockDraft)
    return BlockDraftProposer(shared, target.seq_id, readout, target_layers=layers)
