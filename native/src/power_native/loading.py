"""What exists before a llama.cpp context: the process's kernel mode (``numerics``), where layers go
(:func:`offload`), the loaded weights (one copy per file and options, shared) and the text codec."""

from __future__ import annotations

import os
import threading
import weakref

import attrs
import numpy as np

from power_core.artifacts import ArtifactView, check_architecture
from power_core.config import NUMERICS, PowerConfig
from power_core.errors import ArtifactError, ConfigError
from power_core.logs import get_logger
from power_core.runtime import TokenArray
from power_core.spec import Vocabulary
from power_native import _llama

log = get_logger(__name__)


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


numerics_guard = _NumericsGuard()


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
