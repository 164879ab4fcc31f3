"""The ``power.adapters`` entry point of power-suffix: registers the ``suffix`` strategy and its keys."""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from power_core.config import PowerConfig
from power_core.errors import ConfigError
from power_core.spec import ConfigKey, OpenedModel, ProposerRequest, Strategy, hookimpl, package_version

if TYPE_CHECKING:
    from power_suffix.memory import SuffixMemory
    from power_suffix.proposer import SuffixProposer

__all__ = ["DEFAULT_DRAFT_MAX", "CONFIG_KEYS", "SERVE_MEMORY_TOKENS", "MemorySpec", "memory_for", "vocabulary_digest"]

#: without an explicit --draft-max a round may draft this far (copying pays only for long drafts;
#: the scheduler's cost-aware width decides how much of it is verified)
DEFAULT_DRAFT_MAX = 32
#: the largest cross-request budget (tokens)
MEMORY_TOKENS_MAX = 1 << 26
#: the cross-request budget under ``power serve`` (tokens, every tenant together): a server outlives its
#: requests, as llama-server's n-gram cache does (an index of about 170 MiB for text that never repeats, measured)
SERVE_MEMORY_TOKENS = 1 << 18


def _paths(value: Any) -> Any:
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, os.PathLike)) for v in value):
        return tuple(os.fspath(v) for v in value)
    return value


def _check_paths(key: ConfigKey, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(key.name, value, "a list of file or directory paths")


MEMORY_TOKENS = ConfigKey(
    name="spec_suffix_memory_tokens", type=int, default=0, lo=0, hi=MEMORY_TOKENS_MAX, flag="--suffix-memory",
    serve_default=SERVE_MEMORY_TOKENS,
    help="tokens of earlier requests' outputs the cross-request index keeps, every tenant together "
         "(oldest evicted first; 0: off). Sessions of one process with the same model and suffix keys share it")
LEARN_PROMPTS = ConfigKey(
    name="spec_suffix_learn_prompts", type=bool, default=False, flag="--suffix-learn-prompts",
    help="the cross-request index learns requests' prompts too, not only their outputs")
SHARE_TENANTS = ConfigKey(
    name="spec_suffix_share_tenants", type=bool, default=False, flag="--suffix-share-tenants",
    help="a request may be offered continuations from other tenants' requests. A timing channel: a "
         "request that copies another tenant's text runs faster, so a tenant could learn, by timing its "
         "own requests, what others sent; only where every tenant may read every other's text")
CORPUS = ConfigKey(
    name="spec_suffix_corpus", type=tuple, default=(), flag="--suffix-corpus", convert=_paths,
    validate=_check_paths,
    help="files or directories (a codebase, docs) tokenized when the session opens, drafted from "
         "for every tenant (llama.cpp's static lookup cache, over suffixes)")
STORE = ConfigKey(
    name="spec_suffix_store", type=str, default="", flag="--suffix-store",
    help="a directory the cross-request index is loaded from when the session opens and kept in: every "
         "learned request is appended to a checksummed log, compacted to a snapshot (versioned, bound to the "
         "model's vocabulary; a damaged store is moved aside and the index starts empty; empty: not kept)")
STORE_SYNC_S = ConfigKey(
    name="spec_suffix_store_sync_s", type=float, default=1.0, lo=0.01, hi=60.0, flag="--suffix-store-sync",
    help="the suffix store's log is fsynced at least this often (seconds; a power cut loses at most this "
         "much learning, a killed process none)")
STORE_SYNC_REQUESTS = ConfigKey(
    name="spec_suffix_store_sync_requests", type=int, default=32, lo=1, hi=1_000_000,
    flag="--suffix-store-sync-requests",
    help="the suffix store's log is fsynced once this many learned requests wait, if that comes before "
         "spec_suffix_store_sync_s")
TENANTS = ConfigKey(
    name="spec_suffix_tenants", type=int, default=1024, lo=1, hi=1 << 20, flag="--suffix-tenants",
    help="tenants whose learned requests the cross-request index holds at once; past it the least recently "
         "used tenant's are dropped (from the store too)")
CONFIG_KEYS = (MEMORY_TOKENS, LEARN_PROMPTS, SHARE_TENANTS, CORPUS, STORE, STORE_SYNC_S, STORE_SYNC_REQUESTS, TENANTS)


@attrs.frozen
class MemorySpec:
    """What a session's configuration asks of its suffix memory (sessions with equal specs share one)."""

    vocab_digest: str
    budget_tokens: int
    learn_prompts: bool
    share_tenants: bool
    corpus: tuple[str, ...]
    store: str
    tenants_max: int = 1024
    sync_s: float = 1.0
    sync_requests: int = 32

    @classmethod
    def of(cls, config: PowerConfig, vocab_digest: str) -> MemorySpec | None:
        """The spec of ``config`` (``None``: no memory: nothing learned, no corpus)."""
        budget, corpus, store = config.spec_suffix_memory_tokens, config.spec_suffix_corpus, config.spec_suffix_store
        if store and not budget:
            raise ConfigError("spec_suffix_store", store, "a directory, with spec_suffix_memory_tokens > 0",
                              "the store holds what the cross-request index learned; give it a budget "
                              "(--suffix-memory N)")
        if not budget and not corpus:
            return None
        return cls(vocab_digest=vocab_digest, budget_tokens=budget, learn_prompts=config.spec_suffix_learn_prompts,
                   share_tenants=config.spec_suffix_share_tenants,
                   corpus=tuple(str(Path(p).resolve()) for p in corpus),
                   store=str(Path(store).resolve()) if store else "", tenants_max=config.spec_suffix_tenants,
                   sync_s=config.spec_suffix_store_sync_s, sync_requests=config.spec_suffix_store_sync_requests)


_memories: weakref.WeakValueDictionary[MemorySpec, SuffixMemory] = weakref.WeakValueDictionary()
_memories_lock = threading.Lock()


def memory_for(spec: MemorySpec, encode: Callable[[str], np.ndarray] | None) -> SuffixMemory:
    """The process's memory for ``spec``: the one a live session already uses, else a new one (its
    corpus tokenized with ``encode``, its store opened: loaded, then appended to as it learns)."""
    from power_suffix.memory import SuffixMemory

    with _memories_lock:
        memory = _memories.get(spec)
        if memory is not None:
            return memory
        memory = SuffixMemory(spec.vocab_digest, budget_tokens=spec.budget_tokens, learn_prompts=spec.learn_prompts,
                              share_tenants=spec.share_tenants, tenants_max=spec.tenants_max)
        if spec.corpus:
            if encode is None:
                raise ConfigError("spec_suffix_corpus", list(spec.corpus), "a model with a tokenizer",
                                  "the corpus is text; this model has none")
            memory.add_corpus(spec.corpus, encode)
        if spec.store:
            store = Path(spec.store)
            try:
                store.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError("spec_suffix_store", spec.store, "a directory this process can write",
                                  str(exc)) from None
            if not os.access(store, os.W_OK | os.X_OK):
                raise ConfigError("spec_suffix_store", spec.store, "a directory this process can write")
            memory.open_store(store, sync_s=spec.sync_s, sync_requests=spec.sync_requests)
        _memories[spec] = memory
        return memory


def vocabulary_digest(opened: OpenedModel) -> str:
    """The model's vocabulary digest: a GGUF's (:func:`power_core.artifacts.vocab_digest`: token texts,
    types, special ids), else one over the vocabulary size and every id's decoded text."""
    from power_core.artifacts import inspect_gguf, vocab_digest

    path = opened.model_path
    if path and os.path.isfile(path):
        return vocab_digest(inspect_gguf(path).vocab)
    n_vocab = opened.target.capabilities.n_vocab
    h = hashlib.sha256(b"power-suffix.vocab/1\0" + struct.pack("<Q", n_vocab))
    tok = opened.tokenizer
    if tok is not None:
        for i in range(n_vocab):
            b = tok.decode(np.asarray([i], dtype=np.int32)).encode("utf-8", "surrogatepass")
            h.update(struct.pack("<Q", len(b)) + b)
    return h.hexdigest()


def _proposer(req: ProposerRequest) -> SuffixProposer:
    from power_suffix.proposer import SuffixProposer

    config = req.config
    if not (config.spec_suffix_memory_tokens or config.spec_suffix_corpus or config.spec_suffix_store):
        return SuffixProposer()
    spec = MemorySpec.of(config, vocabulary_digest(req.opened))
    tok = req.opened.tokenizer
    return SuffixProposer(memory_for(spec, tok.encode if tok is not None else None) if spec else None)


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="suffix", version=package_version("power-suffix"), package="power-suffix", kind="model-free",
        summary="Model-free drafts from suffix indexes over the request, earlier requests of its tenant and a "
                "corpus; the draft length is chosen per round from the match and the verify-cost curve.",
        proposer=_proposer, default_draft_max=DEFAULT_DRAFT_MAX, cost_aware=True, config_keys=CONFIG_KEYS,
    ))
