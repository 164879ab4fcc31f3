"""``LlamaTarget``: the core's :class:`~power_core.runtime.TargetRuntime` over one llama.cpp context,
and the ``llama`` backend's ``open`` function.

Memory holds every committed token except the anchor. Rollback of the last decode is done in place
with ``llama_memory_seq_rm`` when llama.cpp allows it (always for attention KV; for recurrent or
hybrid memory only within the granted ``n_rs_seq`` snapshots, at most ``tokens_in_last_decode - 1``
deep and once per decode); otherwise the round's checkpoint is restored and the core replays the
accepted prefix.

A recurrent checkpoint needs the state, which llama.cpp cannot trim back past a pass. Where every
round's rollback fits the snapshots (``n_rs_seq >= max_block - 1``: the default S = K) only a
failure needs it, so the target copies its state (``PARTIAL_ONLY``) once every
:data:`JOURNAL_ROUNDS` checkpoints and journals the blocks it keeps in between; a restore loads the
copy and decodes the journal again, each block alone as it was verified (the rows and states of a
sequence do not depend on its pass: ``docs/numerics.md``). Otherwise it copies at every checkpoint,
as llama-server does for a draft longer than its snapshots.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import attrs
import numpy as np

from power_core.artifacts.archs import NEXTN_TAP_ARCHS
from power_core.errors import ArtifactError, CapacityError, ConfigError, RuntimeFault, StateLost, StrategyNotFound
from power_core.logs import get_logger
from power_core.runtime import DecodeResult, TargetCapabilities, TokenArray
from power_native import _llama
from power_native.loading import is_offloaded, load_model, numerics_guard, warm_up
from power_native.pool import DraftPool, context_memory

__all__ = ["JOURNAL_ROUNDS", "LlamaCheckpoint", "LlamaTarget", "layer_feature", "llama_target", "open_target",
           "PREFILL_BATCH", "TARGET_FEATURES"]

log = get_logger(__name__)  # stdlib logging: an embedding host's configuration decides
_T = TypeVar("_T")

#: tokens per llama_decode call during prefill (llama-completion's n_ubatch default)
PREFILL_BATCH = 512
#: llama.cpp rounds a context's KV cells up to a multiple of this
KV_CELLS_PAD = 256
#: a journaled recurrent target copies its state at one checkpoint in this many; a restore decodes
#: at most this many kept blocks again
JOURNAL_ROUNDS = 8
#: what a strategy may ask of the target (``Strategy.target_features``): ``h_nextn`` publishes the
#: unmasked nextn hidden state of every decoded token as ``DecodeResult.features["h_nextn"]``;
#: ``mtp_head`` loads the target's MTP (nextn) blocks (llama.cpp ``load_mtp``); ``layer_inp:<L>``
#: publishes the input of target layer ``L`` for every decoded token (:func:`layer_feature`)
TARGET_FEATURES = frozenset({"h_nextn", "mtp_head"})
_LAYER_PREFIX = "layer_inp:"


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _weakly(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """``method``, holding its object weakly: a target's capabilities hold its abilities, and a
    strong reference would make a cycle that keeps the target (and its numerics mode, which its
    finalizer releases) alive until the garbage collector runs."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        bound = ref()
        if bound is None:
            raise StateLost("the llama target these capabilities describe is gone")
        result: _R = bound(*args, **kwargs)
        return result

    return call


def layer_feature(layer: int) -> str:
    """The feature name of target layer ``layer``'s input tap."""
    return f"{_LAYER_PREFIX}{int(layer)}"

def _layer_of(name: str) -> int | None:
    rest = name[len(_LAYER_PREFIX):] if name.startswith(_LAYER_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


@attrs.frozen
class LlamaCheckpoint:
    """Position mark (+ recurrent ``PARTIAL_ONLY`` state) of one :class:`LlamaTarget`.

    The state lives in one of the target's state buffers (``slot``), reused: it stays this
    checkpoint's until the target copies into that buffer again, and ``ident`` (the copy's serial)
    tells whether it still is. A journaled checkpoint shares the newest copy and adds the first
    ``journal`` blocks decoded since (``entry``: the serial of the last of them, 0 for none)."""

    n_past: int
    epoch: int
    state: bytes | bytearray | None = attrs.field(default=None, repr=lambda s: f"<{len(s)} bytes>" if s else "None")
    slot: int = 0
    ident: int = 0
    #: the tokens in memory when the state was copied (``n_past`` itself unless journaled)
    copied_at: int = 0
    journal: int = 0
    entry: int = 0


class LlamaTarget:
    """The authoritative model on one llama.cpp context: its sequence ``seq_id`` (0 for a context of
    its own; a :class:`LlamaBatch` gives each of its sequences one ``LlamaTarget`` with ``shared``)."""

    #: set by :func:`open_target`: releases the numerics mode once (absent on targets it did not open)
    _release: weakref.finalize

    def __init__(self, model: _llama.Model, ctx: _llama.Context, *, max_block: int, digest: str | None = None,
                 features: frozenset[str] = frozenset(), numerics: str = "stock", seq_id: int = 0,
                 shared: bool = False, n_ctx: int | None = None, verify_capacity: int = 0,
                 offloaded: bool = False, device_states: bool | None = None, state_format: str | None = None,
                 drafts: DraftPool | None = None) -> None:
        self.model = model
        self.ctx = ctx
        #: the draft contexts its proposers share with the other sequences of its context (:class:`DraftPool`)
        self.drafts = drafts if drafts is not None else DraftPool(1)
        self.numerics = numerics
        self.seq_id = seq_id
        #: the context holds other sequences too: reset trims this one, a cancel never aborts the shared pass
        self.shared = shared
        #: the model's layers, the output layer included, live off the host (a GPU or rpc-server)
        self.offloaded = offloaded
        recurrent = model.is_recurrent or model.is_hybrid
        if verify_capacity and recurrent:
            raise ConfigError("verify_capacity", verify_capacity, f"0 for a recurrent or hybrid target ({model.arch})",
                              "padding would advance the recurrent state, which rolls back only once per pass "
                              "within the n_rs_seq snapshots, and the round's own rollback needs that")
        if verify_capacity and (shared or max_block > verify_capacity):
            raise ConfigError("verify_capacity", verify_capacity, f"0 or at least max_block={max_block} on a context "
                              "of its own", "a padded pass is one sequence's block and nothing else")
        n_ctx = ctx.n_ctx if n_ctx is None else n_ctx
        if n_ctx + verify_capacity > ctx.n_ctx:
            raise ConfigError("verify_capacity", verify_capacity, f"at most {ctx.n_ctx - n_ctx} on a context of "
                              f"{ctx.n_ctx} cells holding {n_ctx} tokens", "the padding of the last pass needs cells")
        own = not shared  # a sequence of a shared context cannot abort the pass or sample in its graph
        self._caps = TargetCapabilities(
            name="llama", n_vocab=model.n_vocab, n_ctx=n_ctx, max_block=max_block,
            rollback_window=ctx.n_rs_seq if recurrent else None, eog_ids=model.eog_ids(),
            features=frozenset(features), digest=digest, verify_capacity=verify_capacity,
            keep_prefix=_weakly(self.keep_prefix), counters=_weakly(self.counters),
            compute_seconds=_weakly(self.compute_seconds), memory=_weakly(self.memory),
            # the prompt cache: the sequence's whole memory, loadable into any sequence of the same format
            save_state=_weakly(self.save_state) if state_format else None,
            load_state=_weakly(self.load_state) if state_format else None, state_format=state_format,
            cancel=_weakly(self.cancel) if own else None, clear_abort=_weakly(self.clear_abort) if own else None,
            # padded passes keep their rows (decode_multi)
            sample_in_graph=_weakly(self.sample_in_graph) if own and not verify_capacity else None,
            graph_sampling_pays=offloaded)
        self._recurrent = recurrent
        # a recurrent target's checkpoints copy its state (every round, or once in JOURNAL_ROUNDS when
        # journaled). Offloaded (``device_states`` None: where the model runs), the copy stays in the
        # context's backend buffers (llama.cpp's ON_DEVICE: a copy between device buffers, not a
        # device-to-host transfer) and the host buffer holds only its header; llama.cpp keeps one such
        # copy per sequence, so only checkpoints on the newest copy can be restored. On the host: two
        # buffers taken in turn. Each buffer is owned by the last copy written to it.
        self.device_states = recurrent and (offloaded if device_states is None else device_states)
        self._state_flags = _llama.STATE_PARTIAL_ONLY | (_llama.STATE_ON_DEVICE if self.device_states else 0)
        self._states = [bytearray() for _ in range(1 if self.device_states else 2)]
        self._state_owner = [0] * len(self._states)
        self._checkpoints = 0  # copies taken (the serial of the newest)
        #: every rollback of a round fits the snapshots: copy once in JOURNAL_ROUNDS checkpoints
        self.journaled = recurrent and ctx.n_rs_seq >= max_block - 1
        self._base: LlamaCheckpoint | None = None  # the newest copy, while this epoch's journal extends it
        self._journal: list[tuple[int, np.ndarray]] = []  # (serial, tokens kept) of each verify decode since
        self._entries = 0  # journal serials
        self._last_entry = 0  # the serial of the last decode's block (0: not journaled)
        self._tainted = False  # a decode failed since the last success: the state is unknown
        #: a shared cache's compaction (LlamaBatch.compact), tried once when a decode finds no slot
        self._compact: Callable[[], bool] | None = None
        self._n_past = 0
        self._epoch = 0
        self._last_len = 0  # tokens of the last single llama_decode (0: none / not rollable)
        self._rs_used = True
        self._no_rows = np.zeros((0, model.n_vocab), dtype=np.float32)
        self._layers = sorted(lid for f in self._caps.features if (lid := _layer_of(f)) is not None)
        self._taps = tuple((layer_feature(lid), lid) for lid in self._layers)  # named once, read every pass
        unknown = {f for f in self._caps.features - TARGET_FEATURES if _layer_of(f) is None}
        if unknown:
            raise ConfigError("features", sorted(unknown), f"features of the llama target: {sorted(TARGET_FEATURES)} and layer_inp:<L>",
                              "the strategy asks for a hidden-state tap power-native does not provide")
        self._nextn = "h_nextn" in self._caps.features
        if self._nextn:
            # MTP graphs set the nextn hidden state, and so do the decoder graphs of NEXTN_TAP_ARCHS
            # (the final hidden state an EAGLE3 draft taps as layer n_layer)
            if model.n_layer_nextn == 0 and model.arch not in NEXTN_TAP_ARCHS:
                raise ArtifactError(f"{model.path}: the h_nextn tap needs a target with MTP (nextn) layers or one "
                                    f"whose graph publishes its final hidden state ({model.arch} does not)",
                                    reason="tap_unsupported", evidence="nextn_predict_layers")
            ctx.set_embeddings_nextn(True, False)  # unmasked: one row per batch token
        for lid in self._layers:
            ctx.set_embeddings_layer_inp(lid, True)  # refuses layers the arch does not record (abort in llama.cpp)
        #: rollback accounting over the target's life; receipts show each request's share (:meth:`counters`)
        self.stats = {"rollback_in_place": 0, "rollback_restored": 0, "restores": 0, "decodes": 0,
                      "state_copies": 0}

    # -- protocol ---------------------------------------------------------------------------------------
    @property
    def capabilities(self) -> TargetCapabilities:
        return self._caps

    def memory(self) -> dict[str, Any]:
        """``TargetCapabilities.memory``: the target context's bytes and each draft context's
        (:func:`context_memory`); a context shared by several sequences is counted once, whole."""
        return {"target": context_memory(self.ctx), "drafts": self.drafts.memory(self.model)}

    @property
    def n_past(self) -> int:
        return self._n_past

    @property
    def state_checkpoints(self) -> str | None:
        """Where a checkpoint's copy of the recurrent state lives: ``"device"`` (the context's backend
        buffers), ``"host"``, or ``None`` (an attention-only target rolls back by trimming its KV)."""
        return None if not self._recurrent else "device" if self.device_states else "host"

    def decode(self, tokens: TokenArray) -> DecodeResult:
        """Append ``tokens`` at ``n_past``; one logits row per token (zero-copy when one call)."""
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        n = toks.shape[0]
        self._room(n)
        if self._caps.verify_capacity:
            return self._decode_padded(toks)
        step = self.ctx.n_outputs_max
        greedy = self.ctx.greedy
        if n <= step:
            self._decode(toks)
            self._advance(toks, rollable=True)
            if greedy:
                return DecodeResult(tokens=toks, logits=self._no_rows, features=self._features(), kind="verify",
                                    greedy_ids=self.ctx.sampled_ids())
            return DecodeResult(tokens=toks, logits=self.ctx.logits(), features=self._features(), kind="verify")
        rows, feats = [], []  # longer than one output buffer: several calls, rows copied
        for s in range(0, n, step):
            part = toks[s:s + step]
            self._decode(part)
            self._advance(part, rollable=False)
            rows.append(self.ctx.sampled_ids() if greedy else np.array(self.ctx.logits()))
            feats.append({k: np.array(v) for k, v in self._features().items()})
        features = {k: np.concatenate([f[k] for f in feats]) for k in feats[0]}
        if greedy:
            return DecodeResult(tokens=toks, logits=self._no_rows, features=features, kind="verify",
                                greedy_ids=np.concatenate(rows))
        return DecodeResult(tokens=toks, logits=np.concatenate(rows), features=features, kind="verify")

    def _decode(self, toks: TokenArray, all_outputs: bool = True) -> None:
        try:
            or_compact(self._compact, self.ctx.decode, toks, self._n_past, self.seq_id, all_outputs)
        except BaseException:
            self._tainted = True  # an aborted or failed graph may have written part of the state
            raise

    def _decode_padded(self, toks: TokenArray) -> DecodeResult:
        """One pass of exactly ``verify_capacity`` tokens: ``toks``, then the last token repeated at
        the following positions without logits rows; the padding's KV cells are removed at once, so
        memory, rows and taps are those of the unpadded pass (causal attention: no real row sees
        the padding)."""
        n, b = toks.shape[0], self._caps.verify_capacity
        if n > b:
            raise CapacityError(f"decode of {n} tokens; verify_capacity pads every pass to {b}")
        pass_tokens = np.concatenate([toks, np.full(b - n, toks[-1], dtype=np.int32)])
        outputs = np.zeros(b, dtype=np.uint8)
        outputs[:n] = 1
        logits = self.ctx.decode_multi(pass_tokens, np.arange(self._n_past, self._n_past + b, dtype=np.int32),
                                       np.full(b, self.seq_id, dtype=np.int32), outputs)
        if b > n and not self.ctx.seq_rm(self.seq_id, self._n_past + n, -1):
            raise StateLost(f"llama_memory_seq_rm refused to remove the padding after {self._n_past + n} tokens")
        self._advance(toks, rollable=True)
        features = {k: v[:n] for k, v in self._features().items()}  # unmasked taps: one row per pass token
        return DecodeResult(tokens=toks, logits=logits, features=features, kind="verify")

    @property
    def graph_sampling_pays(self) -> bool:
        """True when the logits rows would cross from a device (GPU, rpc-server) to the host. On the
        CPU they are already in memory, and numpy's argmax of a row costs less than the sampler's
        per-row ggml ops (docs/numerics.md, "In-graph greedy sampling"). Declared once, as
        ``TargetCapabilities.graph_sampling_pays``."""
        return self.offloaded

    def sample_in_graph(self, on: bool) -> bool:
        """Greedy ids from the graph (``TargetCapabilities.sample_in_graph``): llama.cpp's
        backend sampling with Power's first-maximum sampler (``Context.set_greedy``), so no logits
        row crosses to the host. A sequence of a shared context (:class:`LlamaBatch`) stays on rows.
        Changing it rebuilds the graph once; it holds until the next call."""
        if self.shared or self._caps.verify_capacity:  # padded passes keep their rows (decode_multi)
            return False
        return self.ctx.set_greedy(on)

    def _features(self) -> dict[str, np.ndarray]:
        """The hidden-state taps of the last decode (zero-copy views, one row per token)."""
        ctx = self.ctx
        out = {"h_nextn": ctx.embeddings_nextn()} if self._nextn else {}
        for name, lid in self._taps:
            out[name] = ctx.embeddings_layer_inp(lid)
        return out

    def prefill(self, tokens: TokenArray,
                observe: Callable[[DecodeResult], None] | None = None) -> np.ndarray | DecodeResult:
        """Append the prompt in ``n_batch`` chunks with only the last row's logits, as llama-completion
        does, and return that row (a view valid until the next decode; with :meth:`sample_in_graph`
        on, the last token's :class:`DecodeResult` with its greedy id instead). ``observe`` sees each
        chunk with its hidden-state taps (no logits rows) right after it was decoded."""
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        self._room(toks.shape[0])
        for s in range(0, toks.shape[0], self.ctx.n_batch):
            part = toks[s:s + self.ctx.n_batch]
            self._decode(part, all_outputs=False)
            self._advance(part, rollable=False, verify=False)
            if observe is not None:
                observe(DecodeResult(tokens=part, logits=self._no_rows, features=self._features(), kind="prompt"))
        if self.ctx.greedy:
            return DecodeResult(tokens=toks[-1:], logits=self._no_rows, kind="prompt", greedy_ids=self.ctx.sampled_ids())
        return self.ctx.logits()[-1]

    def checkpoint(self) -> LlamaCheckpoint:
        if not self._recurrent:
            return LlamaCheckpoint(n_past=self._n_past, epoch=self._epoch)
        base, journal = self._base, self._journal
        if (base is not None and base.epoch == self._epoch and not self._tainted and len(journal) < JOURNAL_ROUNDS
                and self._state_owner[base.slot] == base.ident):
            return LlamaCheckpoint(self._n_past, base.epoch, base.state, base.slot, base.ident, base.copied_at,
                                   len(journal), journal[-1][0] if journal else 0)
        self._checkpoints += 1
        slot = self._checkpoints % len(self._states)
        self._state_owner[slot] = 0  # nobody's while it is overwritten (a failed copy leaves it so)
        state = self._states[slot] = self.ctx.state_get(self.seq_id, self._state_flags, out=self._states[slot])
        self._state_owner[slot] = self._checkpoints
        self.stats["state_copies"] += 1
        cp = LlamaCheckpoint(n_past=self._n_past, epoch=self._epoch, state=state, slot=slot, ident=self._checkpoints,
                             copied_at=self._n_past)
        self._base = cp if self.journaled else None
        journal.clear()
        return cp

    def rollback(self, checkpoint: LlamaCheckpoint, keep: int) -> bool:
        last = self._last_len
        if last == 0 or not 0 <= keep <= last:
            self.restore(checkpoint)
            self.stats["rollback_restored"] += 1
            return False
        depth = last - keep
        if depth == 0:
            return True
        pos = self._n_past - depth
        if self._recurrent:
            window = min(self.ctx.n_rs_seq, last - 1)
            if self._rs_used or depth > window or not self.ctx.seq_rm(self.seq_id, pos, -1):
                self.restore(checkpoint)
                self.stats["rollback_restored"] += 1
                return False
            self._rs_used = True
            if self._journal and self._journal[-1][0] == self._last_entry:  # the decode's block, as kept
                self._journal[-1] = (self._last_entry, self._journal[-1][1][:keep])
        elif not self.ctx.seq_rm(self.seq_id, pos, -1):
            self.restore(checkpoint)
            self.stats["rollback_restored"] += 1
            return False
        self._n_past = pos
        self._last_len = keep
        self.stats["rollback_in_place"] += 1
        return True

    def restore(self, checkpoint: LlamaCheckpoint) -> None:
        if not isinstance(checkpoint, LlamaCheckpoint) or checkpoint.epoch != self._epoch:
            raise StateLost(f"checkpoint {checkpoint!r} does not belong to this request of the llama target "
                            "(reset since); discard the session")
        if checkpoint.state is not None and self._state_owner[checkpoint.slot] != checkpoint.ident:
            kept = "newest state copy, on the device" if self.device_states else "two newest state copies"
            raise StateLost(f"checkpoint {checkpoint.ident} of the llama target was superseded: its state buffer "
                            f"holds checkpoint {self._state_owner[checkpoint.slot]}'s now (a recurrent target keeps "
                            f"the states of its {kept}); restore a checkpoint before taking newer ones")
        journal = self._journal
        if checkpoint.journal > len(journal) or (checkpoint.journal and journal[checkpoint.journal - 1][0] != checkpoint.entry):
            raise StateLost(f"checkpoint at {checkpoint.n_past} tokens of the llama target was superseded: a restore "
                            "to an older checkpoint discarded the blocks it was taken after")
        if checkpoint.n_past > self._n_past and checkpoint.state is None:
            raise StateLost(f"checkpoint at {checkpoint.n_past} tokens is ahead of the target "
                            f"({self._n_past} tokens); the tokens after it are gone")
        # nothing decoded since (a failure before the verify pass): the memory is the checkpoint's
        unchanged = (not self._tainted and self._n_past == checkpoint.n_past and len(journal) == checkpoint.journal)
        self.ctx.hold_abort(True)  # a cancel (often what this restore is for) stops no decode of it
        try:
            if checkpoint.state is not None and not unchanged:
                self.ctx.state_set(checkpoint.state, self.seq_id, self._state_flags)
                start = checkpoint.copied_at
            else:
                start = checkpoint.n_past
            ok = self.ctx.seq_rm(self.seq_id, start, -1)
            if ok and not unchanged:
                self._n_past = start
                for _, toks in journal[:checkpoint.journal]:  # each kept block alone, as it was verified
                    self._decode(toks)
                    self._n_past += toks.shape[0]
                    self.stats["decodes"] += 1
        except StateLost:
            raise
        except Exception as exc:
            raise StateLost(f"restoring the llama target to {checkpoint.n_past} tokens failed: {exc}") from exc
        finally:
            self.ctx.hold_abort(False)
        if not ok:
            raise StateLost(f"llama_memory_seq_rm refused to trim the target to {start} tokens")
        if self._n_past != checkpoint.n_past:
            raise StateLost(f"restoring the llama target to {checkpoint.n_past} tokens left it at {self._n_past}")
        del journal[checkpoint.journal:]
        self._last_len = 0
        self._rs_used = True
        self._tainted = False
        self.stats["restores"] += 1

    def reset(self) -> None:
        if self.shared:
            self.ctx.seq_rm(self.seq_id, 0, -1)
        else:
            self.ctx.clear_abort()
            self.ctx.clear(False)
        self._n_past = 0
        self._epoch += 1
        self._last_len = 0
        self._rs_used = True
        self._forget_journal()

    # -- extras -------------------------------------------------------------------------------------------
    def compute_seconds(self) -> float:
        """Seconds inside llama.cpp's decode calls on this context (``TargetCapabilities.compute_seconds``)."""
        return float(self.ctx.compute_ns) * 1e-9

    def counters(self) -> dict[str, int]:
        """A snapshot of :attr:`stats` (``TargetCapabilities.counters``: the core reports the
        difference over a request in its receipt's ``backend.rollback``)."""
        return dict(self.stats)

    def set_verify_cost(self, relative: tuple[float, ...]) -> None:
        """Publish the measured verify-cost curve in the capabilities (cost-aware scheduling)."""
        self._caps = attrs.evolve(self._caps, verify_cost=tuple(relative))

    def keep_prefix(self, n: int) -> bool:
        """Keep the first ``n`` tokens of memory (prompt reuse): attention KV trims to any depth;
        recurrent or hybrid memory cannot go back, so there only ``n == n_past`` succeeds."""
        if not 0 < n <= self._n_past:
            return False
        if not self.shared:
            self.ctx.clear_abort()  # a new request: a cancel left over from the previous one is void (as reset())
        if n < self._n_past:
            if self._recurrent or not self.ctx.seq_rm(self.seq_id, n, -1):
                return False
        self._n_past = n
        self._epoch += 1  # checkpoints taken before no longer describe this memory
        self._last_len = 0
        self._rs_used = True
        self._forget_journal()
        return True

    def save_state(self) -> bytes:
        """The sequence's whole memory for the ``n_past`` tokens it holds (attention KV and recurrent
        state: ``llama_state_seq_get_data_ext`` without flags; ``TargetCapabilities.save_state``)."""
        return self.ctx.state_get(self.seq_id, 0)

    def load_state(self, data: bytes, n: int) -> bool:
        """Replace the memory by a :meth:`save_state` of ``n`` tokens, from any sequence of a target of
        the same ``state_format`` (``llama_state_seq_set_data_ext`` into this ``seq_id``). False, with
        the memory empty, when llama.cpp refuses it (a shared cache without ``n`` free cells in a row
        is compacted once first) or it does not hold ``n`` tokens then."""
        self.reset()
        if not 0 < n <= self._caps.n_ctx:
            return False
        try:
            try:
                self.ctx.state_set(data, self.seq_id, 0)
            except StateLost:
                if self._compact is None or not self._compact():
                    raise
                self.ctx.state_set(data, self.seq_id, 0)  # the shared cache is packed now
            if self.ctx.pos_max(self.seq_id) != n - 1:  # (a recurrent cell holds only the last position)
                raise RuntimeFault(f"the loaded state ends at position {self.ctx.pos_max(self.seq_id)}, not {n - 1}")
        except (RuntimeFault, StateLost) as exc:
            log.warning("native.load_state_failed", seq_id=self.seq_id, tokens=n, error=str(exc))
            self.reset()
            return False
        self._n_past = n
        return True

    def cancel(self) -> None:
        """Abort a running decode (it raises Cancelled; the core restores its checkpoint). On a shared
        context this does nothing: the pass holds other requests' rows; the round driver stops the
        request between passes instead."""
        if not self.shared:
            self.ctx.abort()

    def clear_abort(self) -> None:
        """Withdraw a :meth:`cancel` that no decode consumed (the request resumes)."""
        if not self.shared:
            self.ctx.clear_abort()

    @property
    def cells(self) -> int:
        """The KV cells this sequence owns: the whole context's, or its share of a shared one (a draft
        context beside this sequence, e.g. MTP's or a block draft's, gets as many)."""
        return self._caps.n_ctx if self.shared else self.ctx.n_ctx

    def close(self) -> None:
        if self.shared:
            return  # the batch owns the context
        try:
            self.drafts.close()
        finally:
            self.ctx.close()
        release = getattr(self, "_release", None)
        if release is not None:
            release()

    def _room(self, n: int) -> None:
        if n == 0:
            raise CapacityError("decode: empty block")
        if self._n_past + n > self._caps.n_ctx:
            raise CapacityError(f"the llama target holds {self._n_past} tokens; {n} more overflow its context "
                                f"of {self._caps.n_ctx}; raise n_ctx or shorten the request")

    def _advance(self, toks: np.ndarray, *, rollable: bool, verify: bool = True) -> None:
        """After a successful decode of ``toks`` (``verify``: every row out, as a round's block; else a
        prompt chunk): the position, what a rollback may undo, and the journal."""
        n = toks.shape[0]
        self._n_past += n
        self._last_len = n if rollable else 0
        self._rs_used = not rollable
        self._tainted = False
        self.stats["decodes"] += 1
        self._last_entry = 0
        if self._base is None:
            return
        if not verify:
            self._forget_journal()  # the journal replays verify blocks only: the next checkpoint copies
            return
        self._entries += 1
        self._last_entry = self._entries
        self._journal.append((self._entries, toks.copy()))

    def _forget_journal(self) -> None:
        self._base = None
        self._journal.clear()
        self._last_entry = 0


def llama_target(target: object, what: str) -> LlamaTarget:
    """``target`` as the llama runtime a native proposer builds on (its model and context are what a
    draft context shares). Any other runtime raises :class:`~power_core.errors.StrategyNotFound`
    (the strategy has no execution path there); ``what`` says who needs it, e.g. ``"block drafters run"``."""
    if not isinstance(target, LlamaTarget):
        raise StrategyNotFound(f"{what} on the llama backend (power-native); this target is {type(target).__name__}")
    return target


def state_format(digest: str | None, *, numerics: str, flash_attn: str, n_gpu_layers: int,
                 devices: Sequence[str], rpc_servers: Sequence[str]) -> str | None:
    """Which targets may load each other's saved states (``TargetCapabilities.state_format``): those of
    the same model file whose memory holds the same numbers (kernels, flash attention, where the
    layers run). ``None`` (no digest): its states are never shared."""
    if not digest:
        return None
    return (f"llama/{digest}/{numerics}/fa={flash_attn}/ngl={n_gpu_layers}/dev={','.join(devices)}"
            f"/rpc={','.join(rpc_servers)}")


def context_shape(max_block: int, snapshots: int, n_ctx: int, recurrent: bool) -> dict[str, Any]:
    n_rs = snapshots if recurrent else 0
    need = max(max_block, n_rs + 2)  # llama.cpp asserts n_ubatch > n_rs_seq + 1
    n_batch = max(min(PREFILL_BATCH, n_ctx), need)
    return {"n_batch": n_batch, "n_ubatch": n_batch, "n_rs_seq": n_rs, "n_outputs_max": max(max_block, 1)}


def open_target(path: str | os.PathLike[str], *, n_ctx: int, max_block: int, snapshots: int,
                n_threads: int | None = None, features: frozenset[str] = frozenset(),
                digest: str | None = None, numerics: str = "exact", rpc_servers: tuple[str, ...] = (),
                n_gpu_layers: int = 0, devices: tuple[str, ...] = (), flash_attn: str = "auto",
                verify_capacity: int = 0, warmup: bool = False, device_states: bool | None = None) -> LlamaTarget:
    """Load ``path`` and create its target context (the pieces of :func:`open_llama`) with the
    given :data:`NUMERICS` and offload (:func:`offload` has checked it); ``verify_capacity`` B > 0
    pads every decode pass to B tokens (the context gets B cells more than ``n_ctx`` for the padding
    of a pass at the end)."""
    with contextlib.ExitStack() as undo:  # a failing step closes what the steps before it opened
        numerics_guard.acquire(numerics)
        undo.callback(numerics_guard.release, numerics)
        model = load_model(path, load_mtp="mtp_head" in features, rpc_servers=rpc_servers,
                           n_gpu_layers=n_gpu_layers, devices=devices)
        shape = context_shape(max_block, snapshots, n_ctx, model.is_recurrent or model.is_hybrid)
        # padded: the cells an unpadded context gets, plus the padding of a pass at the last position
        cells = -(-n_ctx // KV_CELLS_PAD) * KV_CELLS_PAD if verify_capacity else n_ctx
        ctx = _llama.Context(model, n_ctx=cells + verify_capacity, n_threads=n_threads or os.cpu_count(),
                             flash_attn=flash_attn, **shape)
        undo.callback(ctx.close)
        if warmup:
            warm_up(ctx)
        target = LlamaTarget(model, ctx, max_block=max_block, digest=digest, features=features, numerics=numerics,
                             n_ctx=cells if verify_capacity else None, verify_capacity=verify_capacity,
                             offloaded=is_offloaded(rpc_servers, n_gpu_layers), device_states=device_states,
                             state_format=state_format(digest, numerics=numerics, flash_attn=flash_attn,
                                                       n_gpu_layers=n_gpu_layers, devices=devices,
                                                       rpc_servers=rpc_servers))
        undo.pop_all()  # opened: the target owns its context and the numerics mode now
    # released once: by close(), or when a target nobody closed is collected
    target._release = weakref.finalize(target, numerics_guard.release, numerics)
    return target

def or_compact(compact: Callable[[], bool] | None, decode: Callable[..., _T], *args: Any) -> _T:
    """``decode(*args)``; when it finds no memory slot, ``compact()`` (a shared cache's
    :meth:`~power_native.batch.LlamaBatch.compact`) and ``decode(*args)`` once more. The failed call changed nothing:
    llama.cpp looks for the slots before it computes."""
    try:
        return decode(*args)
    except _llama.NoMemorySlot:
        if compact is None or not compact():
            raise
        return decode(*args)
