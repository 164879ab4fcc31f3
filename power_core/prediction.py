"""Predicted outputs: text a request expects its answer to repeat, as a source of proposals.

OpenAI's ``prediction`` field (Predicted Outputs) carries it: typically the file being edited, whose
new version repeats most of it. A :class:`Prediction` is the text tokenized once, with the target's
tokenizer. :class:`Alignment` follows the output through it, token by token: while the output repeats
the prediction it stays aligned (the next predicted token is the one after the last it repeated);
after a token the prediction does not have next, it re-anchors where the output's recent tail occurs
in the prediction (the longest tail of at least :data:`MATCH_MIN` tokens, at the first such place at or
after where it was last aligned, else the first), as llama.cpp's lookup decoding and prompt-lookup
decoding do over a text. Where the alignment stands depends only on the prediction and the output.

:class:`PredictedProposer` is the request's proposer while it has a prediction: a round where the output
is aligned drafts the prediction's continuation (at most the round's ``k``; ``Proposal.source``
``"prediction"``), any other round is the request's strategy's (the proposer it wraps). The wrapped
proposer takes part in every round (``begin``, ``observe`` of every target pass, ``commit`` of every
committed token, ``restore``), as in a round where it proposed nothing; the target verifies every
token either way, so the output is the target's alone.

:meth:`Prediction.usage` counts OpenAI's ``accepted_prediction_tokens`` and
``rejected_prediction_tokens`` from the finished output: the prediction's tokens that the alignment
found in the output (each prediction position once), and the rest. The count depends on the
prediction and the output only, never on the strategy, the width or the round boundaries.

The core, not a plugin: the prediction is the request's (like its stop strings or its constraint), it
needs no model and no native code, and it must serve whichever strategy the request runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from power_core.errors import ConfigError
from power_core.runtime import (
    DecodeResult,
    Proposal,
    ProposalContext,
    Proposer,
    ProposerCapabilities,
    TokenArray,
)
from power_core.spec import Tokenizer

__all__ = ["SOURCE", "MATCH_MIN", "MATCH_MAX", "Prediction", "PredictionUsage", "Alignment", "PredictedProposer"]

#: ``Proposal.source`` of the prediction's drafts (receipt ``proposer.sources``, ``/metrics``)
SOURCE = "prediction"
#: tokens of the output's tail a re-anchor needs at least (one token recurs too often in code to locate anything)
MATCH_MIN = 2
#: the longest tail a re-anchor compares (longer ones are located already)
MATCH_MAX = 32
#: the acceptance model's prior (a prediction's next token is usually right: it is what the client
#: expects), worth this many verified rounds
PRIOR = 0.9
PRIOR_WEIGHT = 4.0


@attrs.frozen
class PredictionUsage:
    """How much of a prediction the output repeated (OpenAI's ``usage.completion_tokens_details``)."""

    #: the prediction's tokens
    tokens: int
    #: prediction tokens that appeared in the output (``accepted_prediction_tokens``)
    accepted: int
    #: prediction tokens that did not (``rejected_prediction_tokens``): ``tokens - accepted``
    rejected: int

    def to_dict(self) -> dict[str, int]:
        return attrs.asdict(self)


@attrs.frozen(eq=False)
class Prediction:
    """A request's predicted output as token ids (:meth:`from_text`: tokenized once per request)."""

    tokens: TokenArray = attrs.field(converter=lambda t: np.ascontiguousarray(np.asarray(t, dtype=np.int32)))
    #: the positions right after each pair of consecutive tokens, by the pair (where a tail ending in it
    #: may continue)
    _ends: dict[tuple[int, int], np.ndarray] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.tokens.ndim != 1:
            raise ConfigError("prediction", list(self.tokens.shape), "a 1-D sequence of token ids")
        self.tokens.flags.writeable = False
        ends: dict[tuple[int, int], list[int]] = {}
        ids = self.tokens.tolist()
        for i in range(len(ids) - 1):
            ends.setdefault((ids[i], ids[i + 1]), []).append(i + 2)
        object.__setattr__(self, "_ends", {k: np.asarray(v, dtype=np.int64) for k, v in ends.items()})

    @classmethod
    def from_text(cls, text: str, tokenizer: Tokenizer | None, n_ctx: int) -> Prediction:
        """``text`` tokenized with the target's ``tokenizer`` as output text (without the special tokens
        the tokenizer puts before any text, e.g. BOS). :class:`ConfigError` naming ``prediction`` when the
        model has no tokenizer or the prediction has more tokens than the context (``n_ctx``) holds."""
        if not isinstance(text, str):
            raise ConfigError("prediction", type(text).__name__, "text")
        if tokenizer is None:
            raise ConfigError("prediction", text[:40], "no prediction for a model without a tokenizer",
                              "a prediction is text; this model has none")
        ids = np.asarray(tokenizer.encode(text), dtype=np.int32) if text else np.zeros(0, dtype=np.int32)
        lead = np.asarray(tokenizer.encode(""), dtype=np.int32)  # what the tokenizer adds before any text
        if lead.size and ids.size >= lead.size and np.array_equal(ids[: lead.size], lead):
            ids = ids[lead.size:]
        if ids.size > n_ctx:
            raise ConfigError("prediction", f"{ids.size} tokens", f"at most the context's {n_ctx} tokens",
                              "an answer never outgrows the context, so no more of a prediction can be used")
        return cls(ids)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def ends(self, a: int, b: int) -> np.ndarray | None:
        """The positions right after each occurrence of ``a, b`` in the prediction (ascending), or ``None``."""
        return self._ends.get((a, b))

    def usage(self, output: Sequence[int]) -> PredictionUsage:
        """How much of the prediction ``output`` repeated: each prediction position the alignment found
        in the output counts once (accepted), every other one is rejected."""
        align = Alignment(self, record=True)
        for token in output:
            align.feed(int(token))
        accepted = align.matched
        return PredictionUsage(tokens=len(self), accepted=accepted, rejected=len(self) - accepted)


class Alignment:
    """Where the output stands in a :class:`Prediction`, fed one emitted token at a time.

    ``pos``: the prediction position of the next token the output is expected to repeat (``0``
    before any output: an answer is expected to start with its prediction), or ``None`` where the
    output is not aligned. ``record``: keep which prediction positions were found in the output
    (:attr:`matched`)."""

    def __init__(self, prediction: Prediction, *, record: bool = False) -> None:
        self.prediction = prediction
        self.out: list[int] = []
        self.pos: int | None = 0
        #: where it was last aligned: a re-anchor prefers a place at or after it (an edit moves forward)
        self.last = 0
        self._seen = np.zeros(len(prediction), dtype=bool) if record else None

    @property
    def matched(self) -> int:
        """Prediction positions found in the output so far (``record`` only)."""
        assert self._seen is not None, "an Alignment made with record=True counts its matches"
        return int(self._seen.sum())

    def state(self) -> tuple[int, int | None, int]:
        """What :meth:`restore` returns to (a proposer's checkpoint); not for a recording alignment."""
        return len(self.out), self.pos, self.last

    def restore(self, state: tuple[int, int | None, int]) -> None:
        assert self._seen is None, "a recording alignment only moves forward"
        n, self.pos, self.last = state
        del self.out[n:]

    def feed(self, token: int) -> None:
        """The output's next token."""
        self.out.append(token)
        p, pos = self.prediction.tokens, self.pos
        if pos is not None and pos < p.shape[0] and int(p[pos]) == token:
            if self._seen is not None:
                self._seen[pos] = True
            self.pos = self.last = pos + 1
            return
        self.pos = self._reanchor()

    def _reanchor(self) -> int | None:
        """The position after the longest tail of the output (at least :data:`MATCH_MIN` tokens) that
        occurs in the prediction: the first such place at or after :attr:`last`, else the first."""
        out = self.out
        if len(out) < MATCH_MIN:
            return None
        ends = self.prediction.ends(out[-2], out[-1])
        if ends is None:
            return None
        p = self.prediction.tokens
        length, found = MATCH_MIN, ends
        while length < MATCH_MAX and length < len(out):
            more = found[found > length]  # room for one more token before the match
            more = more[p[more - length - 1] == out[-length - 1]]
            if more.size == 0:
                break
            found, length = more, length + 1
        ahead = found[found >= self.last]
        end = int(ahead[0] if ahead.size else found[0])
        if self._seen is not None:
            self._seen[end - length:end] = True
        self.last = end
        return end


class PredictedProposer:
    """A request's proposer while it has a :class:`Prediction`: the prediction's continuation where the
    output is aligned with it, else ``fallback``'s proposal (the request's strategy). ``fallback`` takes
    part in every round, so it proposes from the state it would have had without the prediction's
    rounds (the tokens and target passes all the same). Its abilities are ``fallback``'s, but for
    ``close`` (the session closes its own proposer) and ``batch`` (a batch asks the proposers it
    made: this one drafts alone).

    Its drafts carry a confidence, the request's estimate that the prediction's next token is accepted
    (a Beta prior of :data:`PRIOR`, updated with every verified prediction draft), which a cost-aware
    strategy's width reads."""

    def __init__(self, prediction: Prediction, fallback: Proposer) -> None:
        self.prediction = prediction
        self.fallback = fallback
        self.features: frozenset[str] = fallback.features
        inner = ProposerCapabilities.of(fallback)
        self._caps = ProposerCapabilities(
            reads_target_rows=inner.reads_target_rows, samples_in_graph=inner.samples_in_graph,
            compute_seconds=inner.compute_seconds, request_scope=inner.request_scope, request_end=inner.request_end)
        self._align = Alignment(prediction)
        self._prompt_len = 0
        self._continued = self._stopped = 0.0
        self._offered = 0  # prediction tokens offered this round (0: the fallback's round, or none)
        self._verified = 0  # of them, verified

    @property
    def capabilities(self) -> ProposerCapabilities:
        """``fallback``'s, without ``close`` and ``batch``."""
        return self._caps

    def begin(self, prompt: TokenArray) -> None:
        self.fallback.begin(prompt)
        self._align = Alignment(self.prediction)
        self._prompt_len = int(np.asarray(prompt).shape[0])
        self._offered = self._verified = 0

    def checkpoint(self) -> Any:
        return self.fallback.checkpoint(), self._align.state(), self._continued, self._stopped

    def propose(self, ctx: ProposalContext) -> Proposal:
        self._sync(ctx.history)
        self._offered = self._verified = 0
        pos = self._align.pos
        if pos is not None and ctx.k > 0:
            ids = self.prediction.tokens[pos: pos + ctx.k]
            if ids.size:
                q = (PRIOR_WEIGHT * PRIOR + self._continued) / (PRIOR_WEIGHT + self._continued + self._stopped)
                self._offered = int(ids.size)
                return Proposal(ids.copy(), confidence=np.full(ids.size, q), source=SOURCE)
        return self.fallback.propose(ctx)

    def observe(self, result: DecodeResult) -> None:
        self.fallback.observe(result)
        if self._offered and result.kind == "verify":  # a cost-aware width may verify a prefix only
            self._verified = int(result.tokens.shape[0]) - 1

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        self.fallback.commit(n_accepted, emitted)
        if self._verified > 0:
            self._continued += n_accepted
            self._stopped += 1.0 if n_accepted < self._verified else 0.0
        self._offered = self._verified = 0
        for token in np.asarray(emitted).tolist():
            self._align.feed(int(token))

    def restore(self, checkpoint: Any) -> None:
        inner, state, self._continued, self._stopped = checkpoint
        self._align.restore(state)
        self._offered = self._verified = 0
        self.fallback.restore(inner)

    def _sync(self, history: TokenArray) -> None:
        """Follow ``history``'s output (the transaction's history only extends what was committed; a
        history this alignment did not see grow is followed afresh)."""
        out = np.asarray(history)[self._prompt_len:]
        have = self._align.out
        if len(have) == out.shape[0] and (not have or have[-1] == int(out[-1])):
            return
        self._align = Alignment(self.prediction)
        for token in out.tolist():
            self._align.feed(int(token))
