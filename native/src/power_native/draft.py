"""The experimental ``draft-model`` proposer: greedy drafting by a second llama.cpp context on a
separate GGUF with the same vocabulary (llama.cpp's ``draft-simple``).

The draft context keeps each sequence's memory in sync with its committed history lazily: before
each proposal it trims that sequence's memory to the longest common prefix with the history (minus
the anchor) and decodes what is missing together with the anchor, then drafts one token per pass.
With the target file as its own draft every proposal is accepted.

One draft context serves every sequence of the target (its
:class:`~power_native.pool.DraftPool`; a KV stream per sequence). Concurrent requests are asked
together (:meth:`SharedDraftModel.propose_many`, llama.cpp's ``common_speculative_draft`` over its
slots): one pass decodes every request's missing history and anchor, then each step decodes one
token per request still drafting; a request that drafts fewer tokens leaves the passes early.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from power_core.errors import ArtifactMismatch, CapacityError
from power_core.runtime import DecodeResult, Proposal, ProposalContext, Proposer, ProposerCapabilities, TokenArray
from power_core.spec import ProposerRequest
from power_native import _llama
from power_native.loading import draft_graph_sampling, load_model, offload, warm_up
from power_native.target import PREFILL_BATCH, llama_target

__all__ = ["SharedDraftModel", "DraftModelProposer", "make_draft_proposer"]


def draft_batch(n_ctx: int, k_max: int) -> int:
    """The draft context's ``n_batch``: a prefill chunk as large as the target's, at least a proposal."""
    return max(min(PREFILL_BATCH, n_ctx), k_max + 1)


class SharedDraftModel:
    """One draft-model context for sequences ``0..n_seq-1`` of a target (``n_ctx`` positions each),
    and the :class:`~power_core.runtime.ProposalBatch` of the proposers on it."""

    def __init__(self, model: _llama.Model, *, n_ctx: int, k_max: int, n_seq: int = 1, n_threads: int | None = None,
                 flash_attn: str = "auto", in_graph: bool = False, warmup: bool = False) -> None:
        n_batch = max(draft_batch(n_ctx, k_max), n_seq)
        self.model = model
        self.n_seq = n_seq
        #: the positions each sequence may hold
        self.cells = n_ctx
        # one KV stream per sequence: a sequence's rows never depend on its neighbours'
        self.ctx = _llama.Context(model, n_ctx=n_ctx * n_seq, n_batch=n_batch, n_ubatch=n_batch, n_rs_seq=0,
                                  n_outputs_max=n_seq, n_threads=n_threads or os.cpu_count(), flash_attn=flash_attn,
                                  n_seq_max=n_seq, kv_unified=False if n_seq > 1 else None)
        try:  # a failing step closes the context it opened
            #: each draft id from the draft's graph (Power's first-maximum sampler) instead of its logits
            #: row; llama.cpp samples in the graph of a context of one sequence only
            self.samples_in_graph = bool(in_graph and self.ctx.set_greedy(True))
            if warmup:
                warm_up(self.ctx)
        except BaseException:
            self.ctx.close()
            raise
        self._ns = [0] * n_seq  # per sequence: ns inside the decodes it took part in
        #: the sequence whose last token's logits row the context's last decode left (-1: none)
        self.row_of = -1

    # -- one sequence -----------------------------------------------------------------------------------
    def forget(self, seq: int) -> None:
        """Empty sequence ``seq`` (a context of one sequence is cleared; a shared one keeps the others)."""
        if self.row_of == seq:
            self.row_of = -1
        if self.n_seq == 1:
            self.ctx.clear(False)
        elif not self.ctx.seq_rm(seq, 0, -1):
            raise CapacityError(f"the draft context refused to empty sequence {seq}")

    def trim(self, seq: int, n: int) -> bool:
        """Keep positions ``< n`` of sequence ``seq``; False when llama.cpp cannot (recurrent memory)."""
        if self.row_of == seq:
            self.row_of = -1
        return bool(self.ctx.seq_rm(seq, n, -1))

    def decode(self, seq: int, tokens: list[int], pos0: int) -> None:
        """Decode ``tokens`` at positions ``pos0..`` of sequence ``seq`` alone (its last row kept)."""
        self.row_of = -1
        before = self.ctx.compute_ns
        try:
            self.ctx.decode(np.asarray(tokens, dtype=np.int32), pos0, seq_id=seq, all_outputs=False)
        finally:
            self._ns[seq] += self.ctx.compute_ns - before
        self.row_of = seq

    def last_id(self) -> int:
        """The argmax of the last decode's last row (from the graph when it samples there)."""
        if self.samples_in_graph:
            return int(self.ctx.sampled_ids()[-1])
        return int(np.argmax(self.ctx.logits()[-1]))

    def compute_ns(self, seq: int) -> int:
        return self._ns[seq]

    # -- every sequence ----------------------------------------------------------------------------------
    def _decode_many(self, tokens: list[int], pos: list[int], seqs: list[int], outputs: list[bool]) -> np.ndarray:
        """One pass over entries of several sequences; the argmax of each output row, in entry order
        (each row found by its own entry). Counts on every participating sequence's clock."""
        self.row_of = -1
        before = self.ctx.compute_ns
        try:
            rows = self.ctx.decode_multi(tokens, pos, seqs, outputs)
        finally:
            spent = self.ctx.compute_ns - before
            for seq in set(seqs):
                self._ns[seq] += spent
        return np.argmax(rows, axis=1) if rows.shape[0] else np.zeros(0, dtype=np.intp)

    def propose_many(self, asks: Sequence[tuple[Proposer, ProposalContext]]) -> list[Proposal]:
        """Every ask's proposal, the proposers on this context drafting in shared passes (a lone one, or
        a proposer of another draft, proposes alone); each exactly what its ``propose`` returns. On a
        failure every sequence's memory is trimmed back to what its proposer knows it holds."""
        out: list[Proposal] = [Proposal.none()] * len(asks)
        mine: list[tuple[int, DraftModelProposer, int]] = []
        alone: list[int] = []
        for i, (proposer, ctx) in enumerate(asks):
            if isinstance(proposer, DraftModelProposer) and proposer.shared is self:
                proposer.follow(ctx.history)
                k = proposer.room(ctx.k)
                if k > 0:
                    mine.append((i, proposer, k))
            else:
                alone.append(i)
        if len(mine) == 1:
            alone.append(mine.pop()[0])
        if mine:
            mine.sort(key=lambda m: m[1].seq)  # llama.cpp puts consecutive sequences' streams in one ubatch
            try:
                drafted, passes = self._draft_all(mine)
            except BaseException:
                for _, p, _ in mine:
                    p.resync()
                raise
            stats = {"draft_passes": float(passes), "draft_batch": float(len(mine))}
            for (i, _, _), ids in zip(mine, drafted, strict=True):
                out[i] = Proposal(np.asarray(ids, dtype=np.int32), stats=stats)
        for i in alone:
            proposer, ctx = asks[i]
            out[i] = proposer.propose(ctx)
        return out

    def _draft_all(self, mine: list[tuple[int, DraftModelProposer, int]]) -> tuple[list[list[int]], int]:
        drafted: list[list[int]] = [[] for _ in mine]
        passes = 0
        # pass 1: each sequence's missing history and its anchor (re-decoded: the context's last row is
        # no sequence's own); a recurrent draft decodes a sequence's tokens in one ubatch, as alone, so
        # its sequences go by how many tokens they decode
        rests = [p.missing() for _, p, _ in mine]
        groups: dict[int, list[int]] = {}
        for j, rest in enumerate(rests):
            groups.setdefault(len(rest) if self.ctx.recurrent else 0, []).append(j)
        for members in groups.values():
            if sum(len(rests[j]) for j in members) > self.ctx.n_batch:  # too long to share a pass: alone
                for j in members:
                    passes += mine[j][1].catch_up(rests[j])
                    drafted[j].append(self.last_id())
                continue
            tokens: list[int] = []
            pos: list[int] = []
            seqs: list[int] = []
            outputs: list[bool] = []
            for j in members:
                p, rest = mine[j][1], rests[j]
                tokens += rest
                pos += range(len(p.held), len(p.held) + len(rest))
                seqs += [p.seq] * len(rest)
                outputs += [False] * (len(rest) - 1) + [True]
            ids = self._decode_many(tokens, pos, seqs, outputs)
            passes += 1
            for j, tok in zip(members, ids.tolist(), strict=True):
                mine[j][1].held.extend(rests[j])
                drafted[j].append(int(tok))
        # steps: one token per sequence still drafting, each at its own next position
        live = [j for j, (_, _, k) in enumerate(mine) if k > 1]
        while live:
            toks = [drafted[j][-1] for j in live]
            ids = self._decode_many(toks, [len(mine[j][1].held) for j in live], [mine[j][1].seq for j in live],
                                    [True] * len(live))
            passes += 1
            for j, tok, tok_id in zip(live, toks, ids.tolist(), strict=True):
                mine[j][1].held.append(tok)
                drafted[j].append(int(tok_id))
            live = [j for j in live if len(drafted[j]) < mine[j][2]]
        return drafted, passes

    def close(self) -> None:
        self.ctx.close()


class DraftModelProposer:
    """Greedy ``k``-token drafts of one sequence (``seq``) on a :class:`SharedDraftModel` (no snapshots)."""

    features: frozenset[str] = frozenset()

    def __init__(self, shared: SharedDraftModel, seq: int = 0) -> None:
        self.shared = shared
        self.seq = seq
        self.samples_in_graph = shared.samples_in_graph
        #: tokens in this sequence's draft memory, positions 0..len-1
        self.held: list[int] = []
        self._history: list[int] = []  # committed tokens incl. the anchor

    # -- protocol -------------------------------------------------------------------------------------
    def begin(self, prompt: TokenArray) -> None:
        self.shared.forget(self.seq)
        self.held = []
        self._history = [int(t) for t in prompt]
        # the whole prompt in one prefill, like the target: the same numerics, so a self-draft agrees
        self._sync(self._history, last_logits=True)

    def checkpoint(self) -> tuple[int, ...]:
        return tuple(self._history)

    def propose(self, ctx: ProposalContext) -> Proposal:
        self.follow(ctx.history)
        k = self.room(ctx.k)
        if k <= 0:
            return Proposal.none()
        passes = self._sync(self._history, last_logits=True)
        out = np.empty(k, dtype=np.int32)
        for i in range(k):
            tok = self.shared.last_id()
            out[i] = tok
            if i + 1 < k:
                self._decode([tok])
                passes += 1
        return Proposal(out, stats={"draft_passes": float(passes), "draft_batch": 1.0})

    def observe(self, result: DecodeResult) -> None:
        return None

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        self._history.extend(int(t) for t in emitted)

    def restore(self, checkpoint: tuple[int, ...]) -> None:
        self._history = list(checkpoint)

    # -- the draft passes ------------------------------------------------------------------------------
    def follow(self, history: TokenArray) -> None:
        """Take the round's history (committed tokens and the anchor)."""
        self._history = [int(t) for t in history]

    def room(self, k: int) -> int:
        """How many tokens this round may draft: ``k``, as the sequence's draft memory allows."""
        return min(k, self.shared.cells - len(self._history)) if k > 0 else 0

    def missing(self) -> list[int]:
        """Trim this sequence's memory to what it shares with the history, keeping the anchor out, and
        return the tokens to decode for the anchor's row (the anchor at least)."""
        want = self._history
        common = self._common(want)
        if common == len(want):
            common -= 1  # re-decode the anchor for its row
        self._cut(common)
        return want[len(self.held):]

    def catch_up(self, rest: list[int]) -> int:
        """Decode ``rest`` after the held tokens alone (in ``n_batch`` chunks); returns the passes."""
        step = self.shared.ctx.n_batch
        for s in range(0, len(rest), step):
            self._decode(rest[s:s + step])
        return -(-len(rest) // step)

    def resync(self) -> None:
        """After a failed pass: trim the memory to the held tokens (the pass may have left some)."""
        if not self.shared.trim(self.seq, len(self.held)):
            self.shared.forget(self.seq)
            self.held = []

    def _common(self, want: list[int]) -> int:
        common = 0
        for a, b in zip(self.held, want, strict=False):
            if a != b:
                break
            common += 1
        return common

    def _cut(self, common: int) -> None:
        if common < len(self.held):
            if not self.shared.trim(self.seq, common):  # recurrent draft: start over
                self.shared.forget(self.seq)
                common = 0
            del self.held[common:]

    def _sync(self, want: list[int], *, last_logits: bool) -> int:
        """Make the memory hold exactly ``want`` (trim to the common prefix, decode the rest), with the
        last token's row when ``last_logits``; returns the passes it decoded."""
        common = self._common(want)
        if common == len(want) == len(self.held) and (self.shared.row_of == self.seq or not last_logits):
            return 0  # memory already holds exactly ``want`` (and its last row when asked)
        if last_logits and common == len(want) and want:
            common -= 1  # re-decode the last token to get its logits row
        self._cut(common)
        rest = want[len(self.held):]
        return self.catch_up(rest) if rest else 0

    def _decode(self, tokens: list[int]) -> None:
        if len(self.held) + len(tokens) > self.shared.cells:
            raise CapacityError(f"the draft context of {self.shared.cells} tokens is full")
        self.shared.decode(self.seq, tokens, len(self.held))
        self.held.extend(tokens)

    def compute_seconds(self) -> float:
        """Seconds inside llama.cpp's decodes of this sequence on the draft context (its own and every
        shared pass it took part in; ``ProposerCapabilities.compute_seconds``)."""
        return float(self.shared.compute_ns(self.seq)) * 1e-9

    @property
    def capabilities(self) -> ProposerCapabilities:
        """Argmax drafts (from the draft context's graph or its rows), its compute clock, and the draft
        batch it is asked in with the other sequences on its draft context (which the target's draft
        pool closes, not the proposer)."""
        return ProposerCapabilities(samples_in_graph=self.samples_in_graph, compute_seconds=self.compute_seconds,
                                    batch=self.shared)


def make_draft_proposer(req: ProposerRequest) -> DraftModelProposer:
    """Strategy factory. Selection has already inspected both files, compared their complete
    vocabularies and bound the pair (``req.verified``); ``req.draft`` is the draft GGUF (the target
    file itself when none was given)."""
    target = llama_target(req.opened.target, "draft-model runs")
    path = req.draft or req.opened.model_path
    if path is None:
        raise ArtifactMismatch("draft-model needs a draft GGUF (--draft PATH)", evidence="draft")
    # the draft runs under the target's numerics (the switch is on while the target is open): a self-draft
    # then computes the target's own bits, shares its loaded weights when offloaded alike, and is accepted in full
    cfg = req.config
    placed = offload(cfg)
    model = load_model(path, role="draft", n_gpu_layers=placed.draft_gpu_layers,
                       devices=placed.draft_devices)
    if model.n_vocab != target.capabilities.n_vocab:  # selection compared the files; this is the loaded truth
        raise ArtifactMismatch(f"draft {str(path)!r} has {model.n_vocab} tokens but the target has "
                               f"{target.capabilities.n_vocab}", evidence="tokenizer.ggml.tokens")
    n_ctx = target.capabilities.n_ctx
    in_graph = draft_graph_sampling(cfg, placed.draft_gpu_layers != 0)

    def make(n_seq: int) -> SharedDraftModel:
        return SharedDraftModel(model, n_ctx=n_ctx, k_max=cfg.draft_max, n_seq=n_seq, n_threads=cfg.n_threads,
                                flash_attn=cfg.flash_attn, in_graph=in_graph, warmup=cfg.warmup)

    # every setting that changes what the draft context computes (its n_batch, not the width itself)
    key = ("draft-model", os.path.realpath(path), cfg.numerics, placed.draft_gpu_layers, tuple(placed.draft_devices),
           draft_batch(n_ctx, cfg.draft_max), cfg.n_threads, cfg.flash_attn, in_graph)
    return DraftModelProposer(target.drafts.shared(key, make, SharedDraftModel), target.seq_id)
