"""The experimental ``draft-model`` proposer: greedy drafting by a second llama.cpp context on a
separate GGUF with the same vocabulary (llama.cpp's ``draft-simple``).

The draft context keeps its own memory in sync with the committed history lazily: before each
proposal it trims its memory to the longest common prefix with the history (minus the anchor) and
decodes what is missing together with the anchor, then drafts one token per pass. With the target
file as its own draft every proposal is accepted.
"""

from __future__ import annotations

import os

import numpy as np

from power_core.errors import ArtifactMismatch, CapacityError
from power_core.runtime import DecodeResult, Proposal, ProposalContext, ProposerCapabilities, TokenArray
from power_core.spec import ProposerRequest
from power_native import _llama
from power_native.target import PREFILL_BATCH, draft_graph_sampling, llama_target, load_model, offload, warm_up

__all__ = ["DraftModelProposer", "make_draft_proposer"]


class DraftModelProposer:
    """Greedy ``k``-token drafts from a second llama context (sequence 0, no snapshots)."""

    features: frozenset[str] = frozenset()

    def __init__(self, model: _llama.Model, *, n_ctx: int, k_max: int, n_threads: int | None = None,
                 flash_attn: str = "auto", in_graph: bool = False, warmup: bool = False) -> None:
        n_batch = max(min(PREFILL_BATCH, n_ctx), k_max + 1)
        self.model = model
        self.ctx = _llama.Context(model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_rs_seq=0,
                                  n_outputs_max=1, n_threads=n_threads or os.cpu_count(), flash_attn=flash_attn)
        try:  # a failing step closes the context it opened
            #: each draft id from the draft's graph (Power's first-maximum sampler) instead of its logits row
            self.samples_in_graph = bool(in_graph and self.ctx.set_greedy(True))
            if warmup:
                warm_up(self.ctx)
        except BaseException:
            self.ctx.close()
            raise
        self._kv: list[int] = []  # tokens in the draft memory, positions 0..len-1
        self._row_ready = False  # the context holds the logits row of the last token in memory
        self._history: list[int] = []  # committed tokens incl. the anchor

    # -- protocol -------------------------------------------------------------------------------------
    def begin(self, prompt: TokenArray) -> None:
        self.ctx.clear(False)
        self._kv = []
        self._row_ready = False
        self._history = [int(t) for t in prompt]
        # the whole prompt in one prefill, like the target: the same numerics, so a self-draft agrees
        self._sync(self._history, last_logits=True)

    def checkpoint(self) -> tuple[int, ...]:
        return tuple(self._history)

    def propose(self, ctx: ProposalContext) -> Proposal:
        self._history = [int(t) for t in ctx.history]
        if ctx.k <= 0:
            return Proposal.none()
        committed = self._history[:-1]
        k = min(ctx.k, self.ctx.n_ctx - len(committed) - 1)
        if k <= 0:
            return Proposal.none()
        self._sync(committed + [self._history[-1]], last_logits=True)
        out = np.empty(k, dtype=np.int32)
        for i in range(k):
            tok = int(self.ctx.sampled_ids()[-1]) if self.samples_in_graph else int(np.argmax(self.ctx.logits()[-1]))
            out[i] = tok
            if i + 1 < k:
                self._decode([tok], last_logits=True)
        return Proposal(out)

    def observe(self, result: DecodeResult) -> None:
        return None

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        self._history.extend(int(t) for t in emitted)

    def restore(self, checkpoint: tuple[int, ...]) -> None:
        self._history = list(checkpoint)

    # -- internals ------------------------------------------------------------------------------------
    def _sync(self, want: list[int], *, last_logits: bool) -> None:
        """Make the draft memory hold exactly ``want`` (trim to the common prefix, decode the rest)."""
        common = 0
        for a, b in zip(self._kv, want, strict=False):
            if a != b:
                break
            common += 1
        if common == len(want) == len(self._kv) and (self._row_ready or not last_logits):
            return  # memory already holds exactly ``want`` (and its last row when asked)
        if last_logits and common == len(want) and want:
            common -= 1  # re-decode the last token to get its logits row
        if common < len(self._kv):
            if not self.ctx.seq_rm(0, common, -1):  # recurrent draft: start over
                self.ctx.clear(False)
                common = 0
            del self._kv[common:]
            self._row_ready = False
        rest = want[common:]
        if not rest:
            return
        step = self.ctx.n_batch
        for s in range(0, len(rest), step):
            self._decode(rest[s:s + step], last_logits=last_logits and s + step >= len(rest))

    def _decode(self, tokens: list[int], *, last_logits: bool) -> None:
        if len(self._kv) + len(tokens) > self.ctx.n_ctx:
            raise CapacityError(f"the draft context of {self.ctx.n_ctx} tokens is full")
        self.ctx.decode(np.asarray(tokens, dtype=np.int32), len(self._kv), all_outputs=False)
        self._kv.extend(tokens)
        self._row_ready = True  # a decode always outputs its last row

    def compute_seconds(self) -> float:
        """Seconds inside llama.cpp's decode calls on the draft context (``ProposerCapabilities.compute_seconds``)."""
        return float(self.ctx.compute_ns) * 1e-9

    @property
    def capabilities(self) -> ProposerCapabilities:
        """Argmax drafts (from the draft context's graph or its rows), the draft context's compute clock, and a close."""
        return ProposerCapabilities(samples_in_graph=self.samples_in_graph, compute_seconds=self.compute_seconds,
                                    close=self.close)

    def close(self) -> None:
        self.ctx.close()


def make_draft_proposer(req: ProposerRequest) -> DraftModelProposer:
    """Strategy factory. Selection has already inspected both files, compared their complete
    vocabularies and bound the pair (``req.verified``); ``req.draft`` is the draft GGUF (the target
    file itself when none was given)."""
    target = llama_target(req.opened.target, "draft-model runs")
    path = req.draft or req.opened.model_path
    if path is None:
        raise ArtifactMismatch("draft-model needs a draft GGUF (--draft PATH)", evidence="draft")
    # the draft runs under the target's numerics (no repack when exact): a self-draft then computes the
    # target's own bits, shares its loaded weights when offloaded alike, and is accepted in full
    cfg = req.config
    placed = offload(cfg)
    model = load_model(path, role="draft", repack=cfg.numerics == "stock", n_gpu_layers=placed.draft_gpu_layers,
                       devices=placed.draft_devices)
    if model.n_vocab != target.capabilities.n_vocab:  # selection compared the files; this is the loaded truth
        raise ArtifactMismatch(f"draft {str(path)!r} has {model.n_vocab} tokens but the target has "
                               f"{target.capabilities.n_vocab}", evidence="tokenizer.ggml.tokens")
    return DraftModelProposer(model, n_ctx=target.capabilities.n_ctx, k_max=cfg.draft_max,
                              n_threads=cfg.n_threads, flash_attn=cfg.flash_attn,
                              in_graph=draft_graph_sampling(cfg, placed.draft_gpu_layers != 0), warmup=cfg.warmup)
