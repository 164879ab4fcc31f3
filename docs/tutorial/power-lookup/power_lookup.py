"""A model-free proposer: find the latest earlier occurrence of the history's last n tokens and
propose what followed it (prompt lookup). It needs no draft model, works on every backend, and pays
off on copy-heavy prompts (code edits, quoting).

It keeps its own copy of the committed tokens, as a model-backed proposer keeps a draft model's
memory, to show how a proposer's state follows the transaction: ``begin`` starts it, ``commit``
extends it, ``checkpoint``/``restore`` undo a round. (A lookup could read ``ctx.history`` instead,
which holds the same tokens, and keep no state at all.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from power_core import (
    ConfigKey,
    DecodeResult,
    Proposal,
    ProposalContext,
    ProposerCapabilities,
    ProposerRequest,
    Strategy,
    hookimpl,
)

__version__ = "0.1.0"

#: the adapter's own configuration key, declared like the core's: validated (a ``ConfigError`` names it),
#: listed by ``power plugins --json``, offered as ``power run --lookup-max-ngram N``
MAX_NGRAM = ConfigKey(name="lookup_max_ngram", type=int, default=3, lo=1, hi=8,
                      flag="--lookup-max-ngram", help="the longest history tail the lookup matches")


class LookupProposer:
    features: frozenset[str] = frozenset()  # needs no hidden states from the target
    capabilities = ProposerCapabilities()  # nothing beyond the protocol: no draft model, nothing to close

    def __init__(self, n_vocab: int, max_ngram: int = 3) -> None:
        self.n_vocab = n_vocab  # every id it proposes is copied from the history, so below n_vocab
        self.max_ngram = max_ngram
        self.tokens = np.zeros(0, dtype=np.int32)  # committed tokens; the last one is the anchor

    def begin(self, prompt: np.ndarray) -> None:
        # a new request (one proposer serves every request of a session): forget the previous one
        self.tokens = np.array(prompt, dtype=np.int32)

    def checkpoint(self) -> Any:
        return len(self.tokens)

    def propose(self, ctx: ProposalContext) -> Proposal:
        hist = self.tokens  # the same ids as ctx.history
        for n in range(min(self.max_ngram, len(hist) - 1), 0, -1):
            tail = hist[-n:]
            # windows of length n ending before the tail itself
            windows = np.lib.stride_tricks.sliding_window_view(hist[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return Proposal(hist[start:start + ctx.k].astype(np.int32))
        return Proposal.none()  # no earlier occurrence: nothing worth verifying

    def observe(self, result: DecodeResult) -> None:
        pass  # a lookup needs no target rows

    def commit(self, n_accepted: int, emitted: np.ndarray) -> None:
        # emitted: the n_accepted proposals, then the correction or bonus token (the next anchor)
        self.tokens = np.concatenate((self.tokens, emitted)).astype(np.int32)

    def restore(self, checkpoint: Any) -> None:
        self.tokens = self.tokens[:checkpoint]


def make_proposer(request: ProposerRequest) -> LookupProposer:
    """Called once per session (``Session.open``), not per request."""
    n_vocab = request.opened.target.capabilities.n_vocab
    return LookupProposer(n_vocab, max_ngram=request.config.lookup_max_ngram)  # the key, as declared


@hookimpl
def power_register_strategies(register):
    register(Strategy(
        name="lookup", version=__version__, package="power-lookup", kind="model-free",
        summary="Prompt-lookup n-gram proposals (tutorial adapter).",
        proposer=make_proposer, config_keys=(MAX_NGRAM,),
    ))
