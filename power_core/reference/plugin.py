"""The reference backend and its toy strategy, registered as Power's built-in ``power.reference`` plugin.

Models are spec strings, ``reference[:seed=N,vocab=V,dim=D,recurrent=0|1,eos=ID,sharp=X]``; with a
vocabulary of at least 257 ids a byte tokenizer turns text into ids (id 256 is end of text).
The ``ref-draft`` strategy drafts with a second reference model given by ``--draft`` (default: the
target's own weights, 100 % greedy acceptance), optionally with ``accept=P`` to corrupt proposals.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from power_core.errors import ConfigError
from power_core.plugins import (
    Backend,
    OpenedModel,
    OpenRequest,
    ProposerRequest,
    Strategy,
    _own_version,
    hookimpl,
)
from power_core.reference.model import ReferenceModel, ReferenceTarget, parse_spec
from power_core.reference.proposers import DraftModelProposer, NoisyProposer
from power_core.runtime import TokenArray

DEFAULT_SPEC = "reference:seed=0,vocab=288,dim=24,recurrent=1,eos=256"
BYTE_EOS = 256


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; other ids render as ``<|id|>`` (256 is end of text)."""

    def encode(self, text: str) -> TokenArray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, tokens: TokenArray) -> str:
        parts: list[str] = []
        buf = bytearray()
        for t in np.asarray(tokens).tolist():
            if t < 256:
                buf.append(t)
                continue
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            parts.append("" if t == BYTE_EOS else f"<|{t}|>")
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)


def model_digest(model: ReferenceModel) -> str:
    h = hashlib.sha256()
    for arr in (model.emb, model.wq, model.wk, model.wv, model.wa, model.wb, model.out):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update(f"{model.recurrent}:{model.eos}".encode())
    return h.hexdigest()


def _accepts(model: str | None) -> bool:
    return model is None or model.startswith("reference")


def open_reference(request: OpenRequest) -> OpenedModel:
    spec = request.model or DEFAULT_SPEC
    if getattr(request.config, "rpc_servers", ()):
        raise ConfigError("rpc_servers", list(request.config.rpc_servers), "empty for the reference backend",
                          "it runs in-process; RPC servers serve GGUF targets of the llama backend")
    model = ReferenceModel.from_spec(spec)
    max_block = max(64, request.max_block)
    costs = tuple(1.0 + 0.5 * b for b in range(max_block)) if request.verify_cost else None
    target = ReferenceTarget(model, n_ctx=request.config.n_ctx, snapshots=request.snapshots, max_block=max_block,
                             verify_cost=costs)
    return OpenedModel(
        target=target,
        tokenizer=ByteTokenizer() if model.vocab > BYTE_EOS else None,
        model_path=spec,
        artifacts={"target": model_digest(model)},
        backend_info={"model": spec},
    )


def make_ref_draft(request: ProposerRequest) -> NoisyProposer | DraftModelProposer:
    target = request.opened.target
    assert isinstance(target, ReferenceTarget)
    _validate_draft_spec(request.draft)
    spec = request.draft or "reference"
    parts = [p for p in (spec.partition(":")[2]).split(",") if p]
    accept = 1.0
    keys = []
    for p in parts:
        if p.startswith("accept="):
            accept = float(p.partition("=")[2])
        else:
            keys.append(p)
    own = not keys
    model = target.model if own else ReferenceModel.from_spec("reference:" + ",".join(keys))
    if model.vocab != target.model.vocab:
        from power_core.errors import ArtifactMismatch

        raise ArtifactMismatch(f"draft {spec!r} has {model.vocab} tokens but the target has {target.model.vocab}; "
                               "a draft model must share the target's vocabulary", reason="vocab_mismatch",
                               evidence="vocab")
    draft = ReferenceTarget(model, n_ctx=target.n_ctx, snapshots=0, max_block=target.max_block)
    proposer = DraftModelProposer(draft)
    if accept >= 1.0:
        return proposer
    return NoisyProposer(proposer, vocab=model.vocab, acceptance=accept, seed=request.config.seed)


def _validate_draft_spec(draft: str | None) -> None:
    if draft is not None and not draft.startswith("reference"):
        from power_core.errors import ArtifactError

        raise ArtifactError(f"ref-draft drafts are reference specs, got {draft!r}", reason="draft_unsupported")
    if draft:
        spec = ",".join(p for p in draft.partition(":")[2].split(",") if p and not p.startswith("accept="))
        parse_spec("reference:" + spec if spec else "reference")


@hookimpl
def power_register_backends(register: Callable[[Backend], None]) -> None:
    register(Backend(name="reference", version=_own_version(), package="power-core", open=open_reference,
                     accepts=_accepts, priority=0,
                     summary="Pure-numpy reference decoder with KV and recurrent rollback semantics."))


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="ref-draft", version=_own_version(), package="power-core", kind="model-backed",
        summary="Toy draft-model proposer on the reference backend (acceptance controllable with accept=P).",
        proposer=make_ref_draft,
        backends=frozenset({"reference"}),
    ))
