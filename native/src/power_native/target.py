"""``LlamaTarget``: the core's :class:`~power_core.runtime.TargetRuntime` over one llama.cpp context,
and the ``llama`` backend's ``open`` function.

Memory holds every committed token except the anchor. Rollback of the last decode is done in place
with ``llama_memory_seq_rm`` when llama.cpp allows it (always for attention KV; for recurrent or
hybrid memory only within the granted ``n_rs_seq`` snapshots, at most ``tokens_in_last_decode - 1``
deep and once per decode); otherwise the round's checkpoint (position + ``PARTIAL_ONLY`` state) is
restored and the core replays the accepted prefix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ParamSpec, Protocol, TypeVar

import attrs
import numpy as np

from power_core.artifacts import ArtifactView, check_architecture, file_digest
from power_core.artifacts.archs import NEXTN_TAP_ARCHS
from power_core.config import NUMERICS, PowerConfig
from power_core.errors import ArtifactError, CapacityError, ConfigError, RuntimeFault, StateLost, StrategyNotFound
from power_core.logs import get_logger
from power_core.runtime import BatchItem, DecodeResult, TargetCapabilities, TokenArray
from power_core.spec import Grammars, OpenedBatch, OpenedModel, OpenRequest, Vocabulary
from power_native import _llama, build_info
from power_native.models import resolve_model

__all__ = ["LlamaCheckpoint", "LlamaTarget", "LlamaTokenizer", "Offload", "open_llama", "load_model", "layer_feature",
           "llama_target", "offload", "PREFILL_BATCH", "TARGET_FEATURES", "NUMERICS", "CUDA_BUILD"]

log = get_logger(__name__)  # stdlib logging: an embedding host's configuration decides
_T = TypeVar("_T")

#: tokens per llama_decode call during prefill (llama-completion's n_ubatch default)
PREFILL_BATCH = 512
#: llama.cpp rounds a context's KV cells up to a multiple of this
KV_CELLS_PAD = 256
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


class _NumericsGuard:
    """The target's kernels (config ``numerics``). ``exact``: ggml-cpu's batch-invariant switch
    (``native/patches/0002-batch-invariant-cpu.patch`` and ``0005-batch-invariant-fast-paths.patch``) is
    on, so a verify row has the bits of a one-token decode (docs/numerics.md); it is on before a model
    loads, which then repacks only the layouts whose kernels keep that promise. ``stock``: llama.cpp's
    own kernels (tiled K-quant GEMM, n == 1 special cases), as its binaries run.

    The switch is process-wide, so targets of both numerics cannot be open at once (a stock decode
    would flip an exact one's kernels mid-pass): this counts the open targets per mode."""

    def __init__(self) -> None:
        # reentrant: a finalizer's release() may run from garbage collection inside acquire()
        self._lock = threading.RLock()
        self._open = {mode: 0 for mode in NUMERICS}

    def acquire(self, mode: str) -> None:
        if mode not in NUMERICS:
            raise ConfigError("numerics", mode, " or ".join(repr(m) for m in NUMERICS))
        with self._lock:
            other = next((m for m in NUMERICS if m != mode and self._open[m]), None)
            if other is not None:
                raise ConfigError("numerics", mode, f"{other!r} while a target with numerics {other!r} is open in "
                                  "this process", "ggml's batch-invariant switch is process-wide; close the other "
                                  "session first or open both with the same numerics")
            self._open[mode] += 1
            _llama.set_batch_invariant(mode == "exact")

    def release(self, mode: str) -> None:
        with self._lock:
            self._open[mode] = max(0, self._open[mode] - 1)
            if not any(self._open.values()):
                _llama.set_batch_invariant(False)  # back to stock: raw contexts see llama.cpp's kernels


_numerics = _NumericsGuard()


def _layer_of(name: str) -> int | None:
    rest = name[len(_LAYER_PREFIX):] if name.startswith(_LAYER_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


@attrs.frozen
class LlamaCheckpoint:
    """Position mark (+ recurrent ``PARTIAL_ONLY`` state) of one :class:`LlamaTarget`.

    The state lives in one of the target's two state buffers (``slot``), reused every round: it stays
    this checkpoint's until the target takes two more, and ``ident`` tells whether it still is."""

    n_past: int
    epoch: int
    state: bytes | bytearray | None = attrs.field(default=None, repr=lambda s: f"<{len(s)} bytes>" if s else "None")
    slot: int = 0
    ident: int = 0


#: the install that gives power-native llama.cpp's CUDA backend
CUDA_BUILD = "POWER_NATIVE_CUDA=1 pip install ./native"


@attrs.frozen
class Offload:
    """Where a session's layers go (config ``n_gpu_layers``, ``draft_gpu_layers``, ``devices``,
    ``rpc_servers``), checked against this build by :func:`offload`."""

    #: target layers offloaded (-1: all) to ``devices`` and the RPC servers
    n_gpu_layers: int
    #: this build's devices the target's offloaded layers go to (besides the RPC servers)
    devices: tuple[str, ...]
    draft_gpu_layers: int
    draft_devices: tuple[str, ...]
    #: every device that holds layers of the session: the CPU first
    used: tuple[str, ...]


def offload(cfg: PowerConfig) -> Offload:
    """``cfg``'s offload on this build, before any model loads. Named ``devices`` must be GPUs of the
    build; unnamed, offloaded layers go to every discrete GPU (integrated ones when there is none),
    as llama.cpp picks. A GPU asked of a build without one is a :class:`ConfigError` naming the key
    and :data:`CUDA_BUILD`, never a silent CPU run. ``n_gpu_layers = 0`` with ``rpc_servers`` puts
    every target layer on the servers."""
    found = _llama.backend_devices()
    cpu = tuple(name for name, kind in found if kind == "cpu")
    gpus = (tuple(name for name, kind in found if kind == "gpu")
            or tuple(name for name, kind in found if kind == "igpu"))
    local = cfg.n_gpu_layers != 0 and not cfg.rpc_servers  # target layers on this machine's GPUs
    asked = [(k, v) for k, v in (("devices", list(cfg.devices)), ("n_gpu_layers", cfg.n_gpu_layers if local else 0),
                                 ("draft_gpu_layers", cfg.draft_gpu_layers)) if v]
    if asked and not gpus:
        key, value = asked[0]
        allowed = "no device names" if key == "devices" else "0"
        raise ConfigError(key, value, f"{allowed} on this power-native build: it has no GPU device (its devices: "
                          f"{', '.join(name for name, _ in found)})",
                          f"reinstall it with llama.cpp's CUDA backend: {CUDA_BUILD}")
    offloadable = {name for name, kind in found if kind in ("gpu", "igpu")}
    unknown = [d for d in cfg.devices if d not in offloadable]
    if unknown:
        raise ConfigError("devices", list(cfg.devices),
                          f"names of this build's GPU devices: {', '.join(sorted(offloadable))}",
                          f"{', '.join(unknown)} is not one of them")
    chosen = cfg.devices or gpus
    devices = cfg.devices if cfg.rpc_servers else chosen if cfg.n_gpu_layers or cfg.devices else ()
    draft_devices = chosen if cfg.draft_gpu_layers else ()
    layers = cfg.n_gpu_layers or (-1 if cfg.rpc_servers else 0)
    return Offload(n_gpu_layers=layers, devices=devices, draft_gpu_layers=cfg.draft_gpu_layers,
                   draft_devices=draft_devices, used=cpu + tuple(dict.fromkeys(devices + draft_devices)))


def warm_up(ctx: _llama.Context) -> None:
    """One throwaway decode of ``[BOS, EOS]`` on ``ctx``, as llama.cpp's ``common_init_from_params``
    does at load (``--warmup``): a context's first pass pages the weights in and sizes its compute
    buffers, which no request should pay for (config ``warmup``). The memory is cleared after."""
    model = ctx.model
    toks = [t for t in (model.bos, model.eos) if 0 <= t < ctx.n_vocab] or [0]
    ctx.decode(np.asarray(toks[: ctx.n_batch], dtype=np.int32), 0, all_outputs=False)
    ctx.clear(False)


def is_offloaded(rpc_servers: tuple[str, ...] | list[str], n_gpu_layers: int) -> bool:
    """A target's layers run off the host (a GPU or rpc-server): its rows and state live there."""
    return bool(rpc_servers) or n_gpu_layers != 0


def draft_graph_sampling(cfg: PowerConfig, offloaded: bool) -> bool:
    """Whether a drafter whose proposals are its rows' argmax samples them in its graph (config
    ``sampling_in_graph``): ``on``, or ``auto`` where its rows would leave a device (``offloaded``).
    Drafts are greedy whatever the request samples, so this is decided once, when the proposer opens."""
    return cfg.sampling_in_graph == "on" or (cfg.sampling_in_graph == "auto" and offloaded)


#: loaded models by (real path, size, mtime, load_mtp, repack, batch-invariant switch at load (it picks the
#: repacked layouts), rpc servers, offload): sessions on the
#: same file share one set of weights (each has its own contexts); an entry goes when its last context
#: and session do
_MODELS: weakref.WeakValueDictionary[tuple, _llama.Model] = weakref.WeakValueDictionary()
_MODELS_LOCK = threading.Lock()


def load_model(path: str | os.PathLike[str], *, role: str = "model", load_mtp: bool = False,
               view: ArtifactView | None = None, repack: bool = True, rpc_servers: tuple[str, ...] = (),
               n_gpu_layers: int = 0, devices: tuple[str, ...] = ()) -> _llama.Model:
    """Inspect the file with the core's bounded GGUF parser (missing, directory, not GGUF, truncated,
    lying tensor table: typed errors before llama.cpp sees it), then load it — or return the model
    already loaded from the same unchanged file with the same options (``POWER_NATIVE_SHARED_WEIGHTS=0``
    loads a private copy each time, e.g. to measure what sharing saves). ``n_gpu_layers`` layers go to
    ``devices`` and ``rpc_servers`` (:class:`Offload`); none: every layer on the CPU."""
    share = os.environ.get("POWER_NATIVE_SHARED_WEIGHTS", "1") not in ("0", "false", "no")
    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, load_mtp, repack, _llama.batch_invariant(),
               tuple(rpc_servers), n_gpu_layers, tuple(devices))
    except OSError:
        key = None  # missing or unreadable: _load says so with its typed error
    if share and key is not None:
        with _MODELS_LOCK:
            model = _MODELS.get(key)
            if model is None:
                model = _MODELS[key] = _load(path, role=role, load_mtp=load_mtp, view=view, repack=repack,
                                             rpc_servers=rpc_servers, n_gpu_layers=n_gpu_layers, devices=devices)
        return model
    return _load(path, role=role, load_mtp=load_mtp, view=view, repack=repack, rpc_servers=rpc_servers,
                 n_gpu_layers=n_gpu_layers, devices=devices)


def _load(path: str | os.PathLike[str], *, role: str, load_mtp: bool, view: ArtifactView | None,
          repack: bool, rpc_servers: tuple[str, ...], n_gpu_layers: int, devices: tuple[str, ...]) -> _llama.Model:
    try:
        view = view or ArtifactView.from_gguf(path)
    except ArtifactError as exc:
        raise ArtifactError(f"{role} file: {exc}", reason=exc.reason, evidence=exc.evidence) from None
    check_architecture(view, role)  # the core's table of the pinned build: arch_missing / arch_unknown
    try:
        if not rpc_servers:
            return _llama.Model.load(os.fspath(path), load_mtp=load_mtp, repack=repack, n_gpu_layers=n_gpu_layers,
                                     devices=devices)
        from power_native import rpc

        for endpoint in rpc_servers:
            # ggml-rpc aborts the process on an unreachable server: fail typed first (a server this
            # process already holds a connection to serves it, and would not answer a second one)
            if not rpc.connected(endpoint):
                rpc.probe(endpoint)
        model = _llama.Model.load(os.fspath(path), load_mtp=load_mtp, repack=repack, rpc_servers=tuple(rpc_servers),
                                  n_gpu_layers=n_gpu_layers, devices=devices)
        rpc.hold(rpc_servers, model)
        return model
    except ArtifactError as exc:
        said = " | ".join(_llama.last_errors()) or str(exc)
        if "unknown model architecture" in said:
            raise ArtifactError(f"{role} file {os.fspath(path)!r} declares architecture {view.architecture!r}, "
                                "which the pinned llama.cpp does not know", reason="arch_unknown",
                                evidence="general.architecture") from None
        raise ArtifactError(f"llama.cpp could not load {role} file {os.fspath(path)!r} "
                            f"(arch {view.architecture!r}): {said}", reason="gguf_load_failed") from None


class LlamaTokenizer:
    """Text codec through llama_tokenize / llama_token_to_piece (BOS as llama-completion adds it)."""

    def __init__(self, model: _llama.Model) -> None:
        self.model = model

    def encode(self, text: str) -> TokenArray:
        return self.model.tokenize(text, add_special=True, parse_special=True)

    def decode(self, tokens: TokenArray) -> str:
        return self.model.detokenize(np.asarray(tokens, dtype=np.int32)).decode("utf-8", "replace")

    def vocabulary(self) -> Vocabulary:
        """Every id's piece as llama.cpp renders it with special tokens shown; a control token (one
        that renders empty without them) is prefixed by ``0xff`` as llama.cpp's llguidance glue marks
        it, so no text spells it. Generation ends at any end-of-generation id."""
        model = self.model
        pieces = []
        for t in range(model.n_vocab):
            piece = model.token_to_piece(t, special=True)
            if piece and not model.token_to_piece(t, special=False):
                piece = b"\xff" + piece
            pieces.append(piece)
        return Vocabulary(tuple(pieces), tuple(sorted(model.eog_ids())),
                          lambda text: model.tokenize(text, add_special=False, parse_special=False).tolist())


class SharedDraft(Protocol):
    """What a :class:`DraftPool` holds: a draft context (and its state) that the proposers of several
    sequences share; closed once, with the pool."""

    @property
    def ctx(self) -> _llama.Context: ...

    def close(self) -> None: ...


def context_memory(ctx: _llama.Context, *, weights: bool = True) -> dict[str, int]:
    """Bytes ``ctx`` holds, summed over its buffer types: ``weights`` (its model's; 0 when
    ``weights`` is False, for a context on a model counted elsewhere), ``context`` (KV cells,
    recurrent states and their rollback snapshots, for every sequence) and ``compute`` (llama.cpp
    reserves the widest pass's buffers when the context is made)."""
    total = {"weights": 0, "context": 0, "compute": 0}
    for part in ctx.memory().values():
        total["weights"] += part["model"] if weights else 0
        total["context"] += part["context"]
        total["compute"] += part["compute"]
    return total


_D = TypeVar("_D", bound=SharedDraft)


class DraftPool:
    """The draft contexts of one target's sequences: one per kind of draft (``key``), each holding a
    sequence per target sequence (``n_seq``), so one draft pass decodes every request's draft tokens
    (:class:`power_core.runtime.ProposalBatch`; llama.cpp's server drafts all its slots in one batch
    the same way). A target of its own has a pool of one sequence; a :class:`LlamaBatch` shares one
    pool among its sequences and closes it before its own context."""

    def __init__(self, n_seq: int) -> None:
        self.n_seq = n_seq
        self._shared: dict[tuple[object, ...], SharedDraft] = {}
        self._lock = threading.Lock()
        self._closed = False

    def shared(self, key: tuple[object, ...], make: Callable[[int], _D], kind: type[_D]) -> _D:
        """The pool's draft for ``key``, made by ``make(n_seq)`` the first time it is asked for; every
        setting that changes what the draft computes belongs in ``key`` (sequences configured apart
        get drafts apart)."""
        with self._lock:
            if self._closed:
                raise RuntimeFault("the target's draft pool is closed")
            found = self._shared.get(key)
            if found is None:
                found = self._shared[key] = make(self.n_seq)
        if not isinstance(found, kind):
            raise RuntimeFault(f"draft pool key {key!r} holds a {type(found).__name__}, not a {kind.__name__}")
        return found

    def memory(self, target_model: _llama.Model) -> dict[str, dict[str, int]]:
        """:func:`context_memory` of each draft context, by kind (the key's first part); a draft on the
        target's own model (an MTP head) counts no weights."""
        with self._lock:
            drafts = list(self._shared.items())
        out: dict[str, dict[str, int]] = {}
        for key, draft in drafts:
            name = str(key[0])
            name = name if name not in out else f"{name}#{len(out)}"
            out[name] = context_memory(draft.ctx, weights=draft.ctx.model is not target_model)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            shared, self._shared = list(self._shared.values()), {}
        failure: BaseException | None = None
        for draft in shared:
            try:
                draft.close()
            except BaseException as exc:  # close every one; report the first failure
                failure = failure or exc
        if failure is not None:
            raise failure


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
        # a recurrent target's checkpoints copy its state every round. Offloaded (``device_states``
        # None: where the model runs), the copy stays in the context's backend buffers (llama.cpp's
        # ON_DEVICE: a copy between device buffers, not a device-to-host transfer every round) and the
        # host buffer holds only its header; llama.cpp keeps one such copy per sequence, so only the
        # newest checkpoint can be restored. On the host: two buffers taken in turn (a round's
        # checkpoint and its predecessor's). Each buffer is owned by the last checkpoint written to it.
        self.device_states = recurrent and (offloaded if device_states is None else device_states)
        self._state_flags = _llama.STATE_PARTIAL_ONLY | (_llama.STATE_ON_DEVICE if self.device_states else 0)
        self._states = [bytearray() for _ in range(1 if self.device_states else 2)]
        self._state_owner = [0] * len(self._states)
        self._checkpoints = 0
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
        self.stats = {"rollback_in_place": 0, "rollback_restored": 0, "restores": 0, "decodes": 0}

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
            self._advance(n, rollable=True)
            if greedy:
                return DecodeResult(tokens=toks, logits=self._no_rows, features=self._features(), kind="verify",
                                    greedy_ids=self.ctx.sampled_ids())
            return DecodeResult(tokens=toks, logits=self.ctx.logits(), features=self._features(), kind="verify")
        rows, feats = [], []  # longer than one output buffer: several calls, rows copied
        for s in range(0, n, step):
            part = toks[s:s + step]
            self._decode(part)
            self._advance(part.shape[0], rollable=False)
            rows.append(self.ctx.sampled_ids() if greedy else np.array(self.ctx.logits()))
            feats.append({k: np.array(v) for k, v in self._features().items()})
        features = {k: np.concatenate([f[k] for f in feats]) for k in feats[0]}
        if greedy:
            return DecodeResult(tokens=toks, logits=self._no_rows, features=features, kind="verify",
                                greedy_ids=np.concatenate(rows))
        return DecodeResult(tokens=toks, logits=np.concatenate(rows), features=features, kind="verify")

    def _decode(self, toks: TokenArray, all_outputs: bool = True) -> None:
        _or_compact(self._compact, self.ctx.decode, toks, self._n_past, self.seq_id, all_outputs)

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
        self._advance(n, rollable=True)
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
            self._advance(part.shape[0], rollable=False)
            if observe is not None:
                observe(DecodeResult(tokens=part, logits=self._no_rows, features=self._features(), kind="prompt"))
        if self.ctx.greedy:
            return DecodeResult(tokens=toks[-1:], logits=self._no_rows, kind="prompt", greedy_ids=self.ctx.sampled_ids())
        return self.ctx.logits()[-1]

    def checkpoint(self) -> LlamaCheckpoint:
        if not self._recurrent:
            return LlamaCheckpoint(n_past=self._n_past, epoch=self._epoch)
        self._checkpoints += 1
        slot = self._checkpoints % len(self._states)
        self._state_owner[slot] = 0  # nobody's while it is overwritten (a failed copy leaves it so)
        state = self._states[slot] = self.ctx.state_get(self.seq_id, self._state_flags, out=self._states[slot])
        self._state_owner[slot] = self._checkpoints
        return LlamaCheckpoint(n_past=self._n_past, epoch=self._epoch, state=state, slot=slot,
                               ident=self._checkpoints)

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
            kept = "newest checkpoint, on the device" if self.device_states else "two newest checkpoints"
            raise StateLost(f"checkpoint {checkpoint.ident} of the llama target was superseded: its state buffer "
                            f"holds checkpoint {self._state_owner[checkpoint.slot]}'s now (a recurrent target keeps "
                            f"the states of its {kept}); restore a checkpoint before taking newer ones")
        if checkpoint.n_past > self._n_past and checkpoint.state is None:
            raise StateLost(f"checkpoint at {checkpoint.n_past} tokens is ahead of the target "
                            f"({self._n_past} tokens); the tokens after it are gone")
        try:
            if checkpoint.state is not None:
                self.ctx.state_set(checkpoint.state, self.seq_id, self._state_flags)
            ok = self.ctx.seq_rm(self.seq_id, checkpoint.n_past, -1)
        except StateLost:
            raise
        except Exception as exc:
            raise StateLost(f"restoring the llama target to {checkpoint.n_past} tokens failed: {exc}") from exc
        if not ok:
            raise StateLost(f"llama_memory_seq_rm refused to trim the target to {checkpoint.n_past} tokens")
        self._n_past = checkpoint.n_past
        self._last_len = 0
        self._rs_used = True
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

    def _advance(self, n: int, *, rollable: bool) -> None:
        self._n_past += n
        self._last_len = n if rollable else 0
        self._rs_used = False if rollable else True
        self.stats["decodes"] += 1


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


def _context_shape(max_block: int, snapshots: int, n_ctx: int, recurrent: bool) -> dict[str, Any]:
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
        _numerics.acquire(numerics)
        undo.callback(_numerics.release, numerics)
        model = load_model(path, load_mtp="mtp_head" in features, rpc_servers=rpc_servers,
                           n_gpu_layers=n_gpu_layers, devices=devices)
        shape = _context_shape(max_block, snapshots, n_ctx, model.is_recurrent or model.is_hybrid)
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
    target._release = weakref.finalize(target, _numerics.release, numerics)
    return target


def _cost_cache(digest: str, n_threads: int, max_block: int, numerics: str, verify_capacity: int) -> Path:
    info = build_info()
    padded = [verify_capacity] if verify_capacity else []  # a padded target's curve is its own (flat)
    key = hashlib.sha256(json.dumps([digest, n_threads, max_block, numerics, info, *padded],
                                    sort_keys=True).encode()).hexdigest()[:20]
    root = Path(os.environ.get("POWER_NATIVE_CACHE", Path.home() / ".cache" / "power-native"))
    return root / "verify-cost" / f"{key}.json"


def verify_cost_curve(target: LlamaTarget, *, n_threads: int, reps: int = 3) -> tuple[float, ...]:
    """The cost of a verify pass of 1..max_block tokens relative to one token, on this model,
    build and thread count: measured once (median of ``reps`` timed passes per width after a
    warm-up, at a context position of about 200 tokens, like a request in progress) and cached
    under the model's digest (``POWER_VERIFY_COST_REFRESH=1`` measures again, e.g. after a
    measurement on a busy machine)."""
    b_max = target.capabilities.max_block
    path = _cost_cache(target.capabilities.digest or "", n_threads, b_max, target.numerics,
                       target.capabilities.verify_capacity)
    try:
        if os.environ.get("POWER_VERIFY_COST_REFRESH", "") in ("1", "true", "yes"):
            raise OSError("refresh requested")
        cached = json.loads(path.read_text())
        if len(cached["relative"]) == b_max:
            return tuple(float(x) for x in cached["relative"])
    except (OSError, ValueError, KeyError):
        pass
    n_vocab = target.capabilities.n_vocab
    base = max(1, min(200, target.capabilities.n_ctx - b_max - 1))
    rng = np.random.default_rng(0)
    target.reset()
    target.prefill(rng.integers(0, n_vocab, base).astype(np.int32))
    seconds = []
    for b in range(1, b_max + 1):
        block = rng.integers(0, n_vocab, b).astype(np.int32)
        times = []
        for _ in range(reps + 1):  # the first pass warms up (graph allocation for this shape)
            cp = target.checkpoint()
            t0 = time.perf_counter()
            target.decode(block)
            times.append(time.perf_counter() - t0)
            target.restore(cp)
        seconds.append(float(np.median(times[1:])))
    target.reset()
    relative = tuple(t / seconds[0] for t in seconds)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"digest": target.capabilities.digest, "n_threads": n_threads,
                                "one_token_s": seconds[0], "relative": relative}))
    return relative


def _or_compact(compact: Callable[[], bool] | None, decode: Callable[..., _T], *args: Any) -> _T:
    """``decode(*args)``; when it finds no memory slot, ``compact()`` (a shared cache's
    :meth:`LlamaBatch.compact`) and ``decode(*args)`` once more. The failed call changed nothing:
    llama.cpp looks for the slots before it computes."""
    try:
        return decode(*args)
    except _llama.NoMemorySlot:
        if compact is None or not compact():
            raise
        return decode(*args)


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
        #: a sequence may decode alone between the shared passes (a recurrent rollback past its snapshots)
        self._replays = model.is_recurrent or model.is_hybrid

    @property
    def token_budget(self) -> int:
        """The most tokens one pass takes (the context's ``n_batch``)."""
        return self.ctx.n_batch

    def compute_seconds(self) -> float:
        """Seconds inside llama.cpp's decode calls on the shared context (``BatchRuntime.compute_seconds``)."""
        return float(self.ctx.compute_ns) * 1e-9

    def decode_batch(self, items: Sequence[BatchItem]) -> list[DecodeResult]:
        index = self._index
        placed: list[tuple[LlamaTarget, np.ndarray, int, int]] = []  # target, tokens, length, output rows
        for item in items:
            target = index.get(id(item.target))
            if target is None or any(p[0] is target for p in placed):
                raise ConfigError("decode_batch", item.target, "each a distinct sequence of this batch")
            toks = np.ascontiguousarray(item.tokens, dtype=np.int32)
            n = toks.shape[0]
            if n == 0:
                raise CapacityError("decode_batch: an item without tokens")
            target._room(n)
            placed.append((target, toks, n, item.n_rows))
        # the pass holds the sequences in id order: with a KV stream per sequence llama.cpp cuts a pass
        # into ubatches at every sequence id that is not the previous one + 1 (a graph each, no reuse)
        order = sorted(range(len(placed)), key=lambda i: placed[i][0].seq_id)
        placed = [placed[i] for i in order]
        total = sum(p[2] for p in placed)
        pos = np.empty(total, dtype=np.int32)
        seq = np.empty(total, dtype=np.int32)
        out = np.zeros(total, dtype=np.uint8)
        at = 0
        for target, _, n, k in placed:
            pos[at:at + n] = range(target.n_past, target.n_past + n)
            seq[at:at + n] = target.seq_id
            if k:
                out[at + n - k:at + n] = 1  # every row ("all") or the last one ("last")
            at += n
        tokens = placed[0][1] if len(placed) == 1 else np.concatenate([p[1] for p in placed])
        rows = _or_compact(self.compact, self.ctx.decode_multi, tokens, pos, seq, out)
        self.passes += 1
        # the taps hold one row per pass token, in batch order (llama.cpp undoes its ubatch split)
        taps = self.sequences[0]._features()
        if self._replays:
            # a recurrent sequence whose rejection runs deeper than its snapshots replays alone on this
            # context while the other rounds of the pass still read their rows: they get copies
            rows = np.array(rows)
            taps = {name: np.array(v) for name, v in taps.items()}
        results: dict[int, DecodeResult] = {}  # by the item's index
        at, t_at = 0, 0
        for (target, toks, n, k), i in zip(placed, order, strict=True):
            item = items[i]
            target._advance(n, rollable=item.rows == "all")
            results[i] = DecodeResult(tokens=toks, logits=rows[at:at + k],
                                      features={name: v[t_at:t_at + n] for name, v in taps.items()} if taps else {},
                                      kind="verify" if item.rows == "all" else "prompt")
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


def _offload_info(placed: Offload, cfg: PowerConfig) -> dict[str, Any]:
    """The receipt's ``backend`` facts of where layers ran."""
    return {"devices": list(placed.used), "n_gpu_layers": placed.n_gpu_layers,
            "draft_gpu_layers": placed.draft_gpu_layers, "flash_attn": cfg.flash_attn}


def open_llama_batch(req: OpenRequest, n: int) -> OpenedBatch:
    """The ``llama`` backend's batch: ``n`` sequences of ``req.model`` on one context whose passes
    hold every active request's verify block (and prompt chunks)."""
    cfg = req.config
    placed = offload(cfg)
    path = resolve_model(req.model)
    digest = file_digest(path).sha256
    with contextlib.ExitStack() as undo:  # a failing step (the cost curve too) closes what was opened
        _numerics.acquire(cfg.numerics)
        undo.callback(_numerics.release, cfg.numerics)
        model = load_model(path, load_mtp="mtp_head" in req.features, rpc_servers=cfg.rpc_servers,
                           n_gpu_layers=placed.n_gpu_layers, devices=placed.devices)
        # recurrent state: one cell per sequence, each with its own n_rs_seq rollback snapshots
        # (llama.cpp keeps a sequence's trailing 1 + n_rs_seq tokens of a pass in one ubatch)
        recurrent = model.is_recurrent or model.is_hybrid
        shape = _context_shape(req.max_block, req.snapshots, PREFILL_BATCH, recurrent)
        n_batch = max(shape["n_batch"], n * req.max_block)
        # n x n_ctx cells, so each request gets the configured context, as a session of its own would.
        # Attention-only targets with flash attention: one cache for every sequence (one ubatch per
        # pass; with one stream per sequence llama.cpp cuts a pass into ubatches holding as many
        # tokens of each sequence, one per distinct block length, and each reads all the weights
        # again). Batch-invariant kernels keep each sequence's cells in position order there
        # (native/patches/0003-kv-cache-ordered-cells.patch), so its rows stay its solo rows.
        # Recurrent state and attention without flash attention keep one stream per sequence.
        unified = not recurrent and cfg.flash_attn != "off"
        ctx = _llama.Context(model, n_ctx=cfg.n_ctx * n, n_threads=cfg.n_threads or os.cpu_count(), n_batch=n_batch,
                             n_ubatch=n_batch, n_outputs_max=n_batch, n_seq_max=n, kv_unified=unified,
                             n_rs_seq=shape["n_rs_seq"], flash_attn=cfg.flash_attn)
        undo.callback(ctx.close)
        if cfg.warmup:
            warm_up(ctx)
        per_seq = ctx.n_ctx // n
        formats = state_format(digest, numerics=cfg.numerics, flash_attn=cfg.flash_attn,
                               n_gpu_layers=placed.n_gpu_layers, devices=placed.devices, rpc_servers=cfg.rpc_servers)
        drafts = DraftPool(n)
        targets = tuple(LlamaTarget(model, ctx, max_block=req.max_block, digest=digest, features=req.features,
                                    numerics=cfg.numerics, seq_id=i, shared=True, n_ctx=per_seq, drafts=drafts,
                                    offloaded=is_offloaded(cfg.rpc_servers, placed.n_gpu_layers),
                                    state_format=formats) for i in range(n))
        batch = LlamaBatch(model, ctx, targets, unified=unified)
        if req.verify_cost:
            relative = verify_cost_curve(targets[0], n_threads=cfg.n_threads or os.cpu_count() or 1)
            for t in targets:
                t.set_verify_cost(relative)
        info = dict(build_info())
        info.update(backend="llama", numerics=cfg.numerics, rpc_servers=list(cfg.rpc_servers),
                    **_offload_info(placed, cfg), arch=model.arch, desc=model.desc, n_ctx=per_seq,
                    n_ctx_total=ctx.n_ctx, n_batch=ctx.n_batch, n_ubatch=ctx.n_ubatch, n_rs_seq=ctx.n_rs_seq,
                    rollback_window=targets[0].capabilities.rollback_window,
                    state_checkpoints=targets[0].state_checkpoints,
                    n_threads=cfg.n_threads or os.cpu_count(), n_seq=n, kv_unified=unified,
                    verify_cost=list(targets[0].capabilities.verify_cost) if targets[0].capabilities.verify_cost
                    else None)
        tokenizer = LlamaTokenizer(model)
        grammars = Grammars(tokenizer.vocabulary)
        models = tuple(OpenedModel(target=t, tokenizer=tokenizer, grammars=grammars, model_path=str(path),
                                   artifacts={"target": digest},
                                   backend_info={**info, "seq_id": t.seq_id}) for t in targets)
        undo.pop_all()  # opened: the batch owns its context and the numerics mode now
    # released once: by close(), or when a batch nobody closed is collected
    batch._release = weakref.finalize(batch, _numerics.release, cfg.numerics)
    return OpenedBatch(runtime=batch, models=models, close=batch.close)


def open_llama(req: OpenRequest) -> OpenedModel:
    """The ``llama`` backend: open ``req.model`` (``None``: embedded SmolLM2) as a :class:`LlamaTarget`."""
    cfg = req.config
    placed = offload(cfg)
    path = resolve_model(req.model)
    digest = file_digest(path).sha256
    target = open_target(path, n_ctx=cfg.n_ctx, max_block=req.max_block, snapshots=req.snapshots,
                         n_threads=cfg.n_threads, features=req.features, digest=digest, numerics=cfg.numerics,
                         rpc_servers=cfg.rpc_servers, n_gpu_layers=placed.n_gpu_layers, devices=placed.devices,
                         flash_attn=cfg.flash_attn, verify_capacity=cfg.verify_capacity, warmup=cfg.warmup)
    try:  # a failing step (the cost curve too) closes the target
        if req.verify_cost:
            target.set_verify_cost(verify_cost_curve(target, n_threads=cfg.n_threads or os.cpu_count() or 1))
        info = dict(build_info())
        info.update(backend="llama", numerics=cfg.numerics, rpc_servers=list(cfg.rpc_servers),
                    **_offload_info(placed, cfg), arch=target.model.arch, desc=target.model.desc,
                    n_ctx=target.capabilities.n_ctx, n_batch=target.ctx.n_batch, n_ubatch=target.ctx.n_ubatch,
                    n_rs_seq=target.ctx.n_rs_seq, snapshots_requested=req.snapshots,
                    rollback_window=target.capabilities.rollback_window, state_checkpoints=target.state_checkpoints,
                    n_threads=cfg.n_threads or os.cpu_count(),
                    verify_cost=list(target.capabilities.verify_cost) if target.capabilities.verify_cost else None)
        tokenizer = LlamaTokenizer(target.model)
    except BaseException:
        target.close()
        raise
    log.info("native.open", model=str(path), arch=target.model.arch, n_ctx=target.ctx.n_ctx,
             n_rs_seq=target.ctx.n_rs_seq)
    return OpenedModel(target=target, tokenizer=tokenizer, grammars=Grammars(tokenizer.vocabulary), model_path=str(path),
                       artifacts={"target": digest}, backend_info=info, close=target.close)
