"""A model-free proposer: find the latest earlier occurrence of the history's last n tokens and
propose what followed it (prompt lookup). It needs no draft model, works on every backend, and pays
off on copy-heavy prompts (code edits, quoting)."""

from __future__ import annotations

import numpy as np

from power_core import ProposalContext, Strategy, hookimpl

__version__ = "0.1.0"


class LookupProposer:
    features: frozenset[str] = frozenset()  # needs no hidden states from the target

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    # stateless: nothing to begin, checkpoint, commit or restore
    def begin(self, prompt):
        pass

    def checkpoint(self):
        return None

    def propose(self, ctx: ProposalContext):
        hist = ctx.history  # committed tokens; its last element is the anchor
        for n in range(min(self.max_ngram, len(hist) - 1), 0, -1):
            tail = hist[-n:]
            # windows of length n ending before the tail itself
            windows = np.lib.stride_tricks.sliding_window_view(hist[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return hist[start:start + ctx.k].astype(np.int32)
        return np.zeros(0, dtype=np.int32)

    def observe(self, result):
        pass

    def commit(self, n_accepted, emitted):
        pass

    def restore(self, checkpoint):
        pass


@hookimpl
def power_register_strategies(register):
    register(Strategy(
        name="lookup", version=__version__, package="power-lookup", kind="model-free",
        summary="Prompt-lookup n-gram proposals (tutorial adapter).",
        proposer=lambda request: LookupProposer(),
    ))
