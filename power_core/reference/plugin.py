"""The reference backend and its toy strategy, registered as Power's built-in ``power.reference`` plugin.

Models are spec strings, ``reference[:seed=N,vocab=V,dim=D,recurrent=0|1,eos=ID,sharp=X]``; with a
vocabulary of at least 257 ids a byte tokenizer turns text into ids (id 256 is end of text).
The ``ref-draft`` strategy drafts with a second reference model given by ``--draft`` (default: the
target's own weights, 100 % greedy acceptance), optionally with ``accept=P`` to corrupt proposals.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from power_core.constraint import Grammars, Vocabulary
from power_core.errors import CapacityError, ConfigError, RuntimeFault
from power_core.reference.model import ReferenceModel, ReferenceTarget, parse_spec
from power_core.reference.proposers import DraftModelProposer, NoisyProposer
from power_core.runtime import BatchItem, DecodeResult, TokenArray
from power_core.spec import (
    Backend,
    OpenedBatch,
    OpenedModel,
    OpenRequest,
    ProposerRequest,
    Strategy,
    hookimpl,
    package_version,
)

DEFAULT_SPEC = "reference:seed=0,vocab=288,dim=24,recurrent=1,eos=256"
BYTE_EOS = 256


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; other ids render as ``<|id|>`` (256 is end of text)."""

    def __init__(self, n_vocab: int = BYTE_EOS + 1, eos: int = BYTE_EOS) -> None:
        self.n_vocab = n_vocab
        self.eos = eos

    def vocabulary(self) -> Vocabulary:
        return byte_vocabulary(self.n_vocab, self.eos)


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


def byte_vocabulary(n_vocab: int, eos: int) -> Vocabulary:
    """A reference model's vocabulary for the grammar engine: ids below 256 are bytes, every other id
    a special token (``<|endoftext|>``, ``<|id|>``), and the model's end of text (``eos``; also 256
    when the vocabulary has it) is special too. Models of at most 256 ids have no text codec
    (:class:`ByteTokenizer`) but still a vocabulary, so constraints run on every reference model."""
    ends = {eos, BYTE_EOS} & set(range(n_vocab))
    pieces = [b"\xff<|endoftext|>" if i in ends else bytes([i]) if i < 256 else b"\xff<|%d|>" % i
              for i in range(n_vocab)]
    return Vocabulary(tuple(pieces), tuple(sorted(ends)), lambda text: [b for b in text if b < n_vocab])


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
    cfg = request.config
    for key, value in (("devices", list(cfg.devices)), ("n_gpu_layers", cfg.n_gpu_layers),
                       ("draft_gpu_layers", cfg.draft_gpu_layers)):
        if value:  # no silent CPU run of what asked for a GPU
            raise ConfigError(key, value, f"{'no device names' if key == 'devices' else '0'} on the reference backend",
                              "it runs in numpy on the CPU; GPU offload is the llama backend's (power-native)")
    model = ReferenceModel.from_spec(spec)
    padded = request.config.verify_capacity
    max_block = padded or max(64, request.max_block)  # a padded pass is never wider than B
    # padded, every pass costs what a B-token pass costs: a flat curve
    costs = tuple(1.0 if padded else 1.0 + 0.5 * b for b in range(max_block)) if request.verify_cost else None
    stock = request.config.numerics == "stock"
    target = ReferenceTarget(model, n_ctx=request.config.n_ctx, snapshots=request.snapshots, max_block=max_block,
                             verify_cost=costs, verify_capacity=padded, stock=stock,
                             state_format=f"reference/{model_digest(model)}/{request.config.numerics}")
    tokenizer = ByteTokenizer(model.vocab, model.eos) if model.vocab > BYTE_EOS else None
    return OpenedModel(
        target=target,
        tokenizer=tokenizer,
        grammars=Grammars(functools.partial(byte_vocabulary, model.vocab, model.eos)),
        model_path=spec,
        artifacts={"target": model_digest(model)},
        backend_info={"model": spec, "devices": ["CPU"], "numerics": request.config.numerics},
    )


@attrs.define(eq=False)
class ReferenceBatch:
    """:class:`~power_core.runtime.BatchRuntime` of the reference backend: ``n`` sequences of one
    reference model. A shared pass decodes each item on its own sequence — rows are exactly the solo
    rows by construction, so property tests of the round driver run here on any schedule."""

    sequences: tuple[ReferenceTarget, ...]
    token_budget: int = 256
    passes: int = 0
    #: tests: fail the n-th shared pass with a RuntimeFault
    fail_on: int | None = None

    def compute_seconds(self) -> float:
        """The sequences' compute (:meth:`~power_core.runtime.BatchRuntime.compute_seconds`)."""
        return sum(t.compute_seconds() for t in self.sequences)

    def decode_batch(self, items: Sequence[BatchItem]) -> list[DecodeResult]:
        targets = [item.target for item in items]
        if len({id(t) for t in targets}) != len(targets) or not all(
                any(t is s for s in self.sequences) for t in targets):
            raise ConfigError("decode_batch", len(items), "items on distinct sequences of this batch")
        if sum(int(i.tokens.shape[0]) for i in items) > self.token_budget:
            raise CapacityError(f"a shared pass of more than {self.token_budget} tokens")
        self.passes += 1
        if self.fail_on is not None and self.passes == self.fail_on:
            raise RuntimeFault(f"injected failure of shared pass {self.passes}")
        out = []
        for item in items:
            target = item.target
            assert isinstance(target, ReferenceTarget)
            if item.rows == "all":
                res = target.decode(item.tokens)
                if target.stock and len(items) > 1:  # stock kernels: rows depend on the rest of the pass
                    res = attrs.evolve(res, logits=_perturbed(res.logits, target.n_past, len(items)))
                out.append(res)
                continue
            row = target.prefill(item.tokens)
            logits = np.asarray(row).reshape(1, -1) if item.rows == "last" else np.zeros((0, target.model.vocab),
                                                                                        dtype=np.float32)
            out.append(DecodeResult(tokens=np.asarray(item.tokens, dtype=np.int32), logits=logits, kind="prompt"))
        return out

    def close(self) -> None:
        pass


def open_reference_batch(request: OpenRequest, n: int) -> OpenedBatch:
    """``n`` sequences of the reference model sharing passes (:class:`ReferenceBatch`)."""
    opened = [open_reference(request) for _ in range(n)]
    model = opened[0].target
    assert isinstance(model, ReferenceTarget)
    targets = []
    for o in opened:  # one model's weights for every sequence, as llama.cpp's sequences share theirs
        t = o.target
        assert isinstance(t, ReferenceTarget)
        t.model = model.model
        targets.append(t)
    batch = ReferenceBatch(sequences=tuple(targets), token_budget=max(256, n * model.max_block))
    grammars = opened[0].grammars  # one vocabulary: its grammar engine's tokenizer is built once
    models = tuple(attrs.evolve(o, backend_info={**o.backend_info, "seq_id": i}, grammars=grammars)
                   for i, o in enumerate(opened))
    return OpenedBatch(runtime=batch, models=models, close=batch.close)


def _perturbed(logits: np.ndarray, n_past: int, n_items: int) -> np.ndarray:
    """``logits`` with a deterministic difference that depends on the pass, of the size that flips
    near-ties (the reference model's stand-in for stock kernels' batch-dependent rounding)."""
    rng = np.random.default_rng((n_past, n_items, logits.shape[0]))
    scale = 0.3 * float(logits.std()) if logits.size else 0.0
    return (logits + scale * rng.standard_normal(logits.shape)).astype(np.float32)


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
    register(Backend(name="reference", version=package_version("power-core"), package="power-core", open=open_reference,
                     accepts=_accepts, priority=0, open_batch=open_reference_batch,
                     summary="Pure-numpy reference decoder with KV and recurrent rollback semantics."))


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="ref-draft", version=package_version("power-core"), package="power-core", kind="model-backed",
        summary="Toy draft-model proposer on the reference backend (acceptance controllable with accept=P).",
        proposer=make_ref_draft,
        backends=frozenset({"reference"}),
    ))
