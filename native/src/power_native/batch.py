"""``LlamaBatch``: several sequences on one llama.cpp context, each a :class:`LlamaTarget`, decoded
together in one pass (:class:`power_core.runtime.BatchRuntime`)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from power_core.errors import CapacityError, ConfigError, StateLost
from power_core.logs import get_logger
from power_core.runtime import BatchItem, DecodeResult
from power_native import _llama
from power_native.target import LlamaTarget, or_compact

log = get_logger(__name__)


class LlamaBatch:
    """Several sequences on one llama.cpp context (``n_seq_max`` = ``n``; one KV cache for all of them
    when ``unified``, else a stream each), each a :class:`LlamaTarget`; :meth:`decode_batch` decodes
    every sequence's tokens of a round in one ``llama_decode`` (:class:`power_core.runtime.BatchRuntime`)."""

    #: set by :func:`open_llama_batch`: releases the numerics mode once
    _release: weakref.finalize

    def __init__(self, model: _llama.Model, ctx: _llama.Context, targets: tuple[LlamaTarget, ...], *,
                 unified: bool = False) -> None:
        self.model = model
        self.ctx = ctx
        self.sequences = targets
        self.passes = 0
        #: one KV cache for every sequence (else a stream each): :meth:`compact` packs it
        self.unified = unified
        #: compactions of the shared cache (:meth:`compact`) over the batch's life
        self.compactions = 0
        self._index = {id(t): t for t in targets}
        for t in targets:
            t._compact = self.compact

    @property
    def token_budget(self) -> int:
        """The most tokens one pass takes (the context's ``n_batch``)."""
        return self.ctx.n_batch

    def compute_seconds(self) -> float:
        """Seconds inside llama.cpp's decode calls on the shared context (``BatchRuntime.compute_seconds``)."""
        return float(self.ctx.compute_ns) * 1e-9

    def decode_batch(self, items: Sequence[BatchItem]) -> list[DecodeResult]:
        index = self._index
        placed: list[tuple[LlamaTarget, np.ndarray, int, int, int]] = []  # target, tokens, length, rows, item
        for i, item in enumerate(items):
            target = index.get(id(item.target))
            if target is None or any(p[0] is target for p in placed):
                raise ConfigError("decode_batch", item.target, "each a distinct sequence of this batch")
            toks = np.ascontiguousarray(item.tokens, dtype=np.int32)
            n = toks.shape[0]
            if n == 0:
                raise CapacityError("decode_batch: an item without tokens")
            target._room(n)
            placed.append((target, toks, n, item.n_rows, i))
        # the pass holds the sequences in id order: with a KV stream per sequence llama.cpp cuts a pass
        # into ubatches at every sequence id that is not the previous one + 1 (a graph each, no reuse)
        if len(placed) > 1:
            placed.sort(key=lambda p: p[0].seq_id)
        try:
            rows = or_compact(self.compact, self.ctx.decode_seqs,
                              [(p[1], p[0].n_past, p[0].seq_id, p[3]) for p in placed])
        except BaseException:
            for p in placed:  # a failed graph may have written part of each sequence's state
                p[0]._tainted = True
            raise
        self.passes += 1
        # the taps hold one row per pass token, in batch order (llama.cpp undoes its ubatch split)
        taps = self.sequences[0]._features()
        if len(placed) == 1:  # one sequence: the pass's rows and taps are its own
            target, toks, n, _, _ = placed[0]
            verify = items[0].rows == "all"
            target._advance(toks, rollable=verify, verify=verify)
            return [DecodeResult(tokens=toks, logits=rows, features=taps, kind="verify" if verify else "prompt")]
        # zero-copy views for every sequence: a recurrent sequence whose rejection runs deeper than its
        # snapshots replays alone on this context, over these buffers, only once every round of the pass
        # has read its rows (the round driver reads them all before it commits any, Transaction.read_round)
        results: dict[int, DecodeResult] = {}  # by the item's index
        at, t_at = 0, 0
        for target, toks, n, k, i in placed:
            verify = items[i].rows == "all"
            target._advance(toks, rollable=verify, verify=verify)
            results[i] = DecodeResult(tokens=toks, logits=rows[at:at + k],
                                      features={name: v[t_at:t_at + n] for name, v in taps.items()},
                                      kind="verify" if verify else "prompt")
            at += k
            t_at += n
        return [results[i] for i in range(len(items))]

    def compact(self) -> bool:
        """Pack a shared cache's sequences into cells in sequence order, each one's in position order;
        False when this batch's sequences have a stream each (nothing to pack).

        In one cache for every sequence, the patched llama.cpp gives a sequence new cells only after
        all of its own cells (batch-invariant kernels: attention sums over cells in cell order), so
        cells freed below them (a finished request's, a rejected block's) may stay unused and a pass
        can find no slot while the cache has room. Called then, before the pass runs again: each
        sequence's state (its cells' bytes, positions) is saved, the cache cleared, and the states
        restored one after the other. Rows read afterwards are bit for bit what they were."""
        if not self.unified:
            return False
        states = [(t.seq_id, self.ctx.state_get(t.seq_id, 0)) for t in self.sequences if t.n_past > 0]
        for t in self.sequences:
            self.ctx.seq_rm(t.seq_id, 0, -1)
        try:
            for seq_id, state in states:
                self.ctx.state_set(state, seq_id, 0)
        except BaseException as exc:
            raise StateLost(f"compacting the shared cache lost a sequence's state: {exc}") from exc
        self.compactions += 1
        log.info("native.batch_compact", sequences=len(states), compactions=self.compactions)
        return True

    def close(self) -> None:
        try:
            self.sequences[0].drafts.close()  # the draft contexts first: they refer to this context
        finally:
            self.ctx.close()
        release = getattr(self, "_release", None)
        if release is not None:
            release()
