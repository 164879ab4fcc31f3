"""Constraints: what a grammar lets the target emit, checked at every verified position.

A request may carry a :class:`ConstraintSpec` (a JSON schema, a regular expression, a GBNF or Lark
grammar, optionally *lazy*: free text until a trigger, then the grammar). The session compiles it
with the model's own vocabulary (:class:`Vocabulary`, read from the GGUF by the backend) into a
:class:`Constraint`, which the transaction drives:

- before verification, :meth:`Constraint.allows` cuts a proposal at the first token the grammar
  forbids after everything before it, so that token is never verified (the receipt counts the cuts);
- at every sampled row, :meth:`Constraint.mask` removes what the grammar forbids after the emitted
  tokens and the row's accepted proposals;
- every emitted token advances it (:meth:`Constraint.advance`), and a round that is restored rolls
  it back (:meth:`Constraint.rollback`) with the target, proposer and sampler, so a rejected suffix
  never advances it.

Speculative output therefore equals constrained target-only output token for token: each row is
masked by the state an autoregressive run would have at that position.

The grammar engine is llguidance (no dependencies, built for speculative decoding: ``validate_tokens``
and ``rollback``). A grammar or schema it cannot compile, or a schema keyword it does not implement,
is a :class:`~power_core.errors.ConstraintError` naming it, never ignored.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from power_core.errors import ConstraintError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["Constraint", "ConstraintSpec", "ConstraintStats", "Grammars", "GrammarConstraint", "Vocabulary",
           "KINDS", "FREE_TEXT", "JSON_STYLE"]

#: what a :class:`ConstraintSpec` may hold
KINDS = ("json_schema", "regex", "grammar")
Kind = Literal["json_schema", "regex", "grammar"]
#: how JSON output is spelled (a schema's own ``x-guidance`` overrides it): properties in the schema's
#: order, and Python's ``json.dumps`` separators with no other whitespace — one spelling per value, so
#: the model cannot wander into runs of newlines inside an object
JSON_STYLE: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: the text a lazy constraint leaves free before its trigger (any text; no control token but the end)
FREE_TEXT = r"(.|\n)*"


@attrs.frozen
class Vocabulary:
    """A model's tokens as a grammar engine needs them: each id's bytes (a control or special token
    is its text prefixed by ``0xff``, llguidance's convention, so that no text can spell it), the ids
    that end generation, and the model's own tokenizer for bytes (no BOS, no special parsing)."""

    pieces: tuple[bytes, ...]
    eos: tuple[int, ...]
    encode: Callable[[bytes], list[int]] = attrs.field(eq=False, repr=False)

    @property
    def n_vocab(self) -> int:
        return len(self.pieces)

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for p in self.pieces:
            h.update(len(p).to_bytes(4, "little"))
            h.update(p)
        h.update(json.dumps(list(self.eos)).encode())
        return h.hexdigest()


def _canonical(source: str | Mapping[str, Any]) -> str:
    # key order kept: a schema's ``properties`` order is the order the output writes them in
    return json.dumps(source, separators=(",", ":")) if isinstance(source, Mapping) else source


@attrs.frozen
class ConstraintSpec:
    """What one request asks the output to match.

    ``kind``: ``json_schema`` (a JSON Schema, as an object or its JSON text), ``regex`` (Rust regex
    syntax, matched against the whole output) or ``grammar`` (a GBNF grammar as llama.cpp takes it, or
    an llguidance Lark grammar). ``trigger``: a lazy constraint — the output is free text until it
    contains ``trigger``, and from there (the trigger included) it must match the grammar; the
    trigger may complete anywhere, also inside a speculated block.
    """

    kind: Kind = attrs.field(validator=attrs.validators.in_(KINDS))
    source: str = attrs.field(converter=_canonical)
    trigger: str | None = None
    #: where the spec came from, for error messages (``response_format``, ``--grammar``, ...)
    field: str = attrs.field(default="constraint", eq=False)

    def __attrs_post_init__(self) -> None:
        if not self.source.strip():
            raise ConstraintError(self.field, f"an empty {self.kind}; give a schema, regex or grammar")
        if self.trigger is not None and not self.trigger:
            raise ConstraintError(self.field, "an empty trigger; give the text that starts the constraint or none")

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any], *, trigger: str | None = None,
                    field: str = "json_schema") -> ConstraintSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(field, f"the schema is not JSON: {exc}") from None
        if not isinstance(schema, Mapping):
            raise ConstraintError(field, f"a JSON schema is an object, not {type(schema).__name__}")
        return cls("json_schema", schema, trigger, field)

    @classmethod
    def regex(cls, pattern: str, *, trigger: str | None = None, field: str = "regex") -> ConstraintSpec:
        return cls("regex", pattern, trigger, field)

    @classmethod
    def grammar(cls, text: str, *, trigger: str | None = None, field: str = "grammar") -> ConstraintSpec:
        return cls("grammar", text, trigger, field)

    @property
    def digest(self) -> str:
        """sha256 of the kind, the canonical source and the trigger (the receipt's ``constraint.digest``)."""
        return hashlib.sha256(json.dumps([self.kind, self.source, self.trigger]).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "digest": self.digest, "lazy": self.trigger is not None}


class Constraint(Protocol):
    """A compiled constraint with its parse state, as the transaction drives it."""

    @property
    def spec(self) -> ConstraintSpec: ...

    @property
    def consumed(self) -> int:
        """Tokens advanced over so far (what :meth:`rollback` counts back from)."""

    @property
    def stats(self) -> ConstraintStats:
        """What it cost and cut so far (the transaction counts the cuts here)."""

    def allows(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar accepts in order from the current state (no advance)."""

    def mask(self, row: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.float32]:
        """A copy of ``row`` with every token the grammar forbids now set to ``-inf``."""

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume emitted tokens (each one the grammar allows)."""

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` advanced tokens."""


@attrs.define
class ConstraintStats:
    """What a request's constraint cost and cut (the receipt's ``constraint``)."""

    spec: ConstraintSpec
    cuts: int = 0  # rounds whose proposal was cut
    cut_tokens: int = 0  # proposed tokens removed by the cuts
    masks: int = 0  # rows masked in full (the greedy fast path needs none when the argmax is allowed)
    seconds: float = 0.0  # host time in the constraint

    def to_dict(self, rounds: int) -> dict[str, Any]:
        """The receipt's ``constraint`` (its host time is ``timings.constraint_us_per_round``)."""
        return {**self.spec.to_dict(), "cuts": self.cuts, "cut_tokens": self.cut_tokens,
                "cuts_per_round": self.cuts / max(1, rounds), "masks": self.masks}


class GrammarConstraint:
    """A :class:`Constraint` over an llguidance matcher."""

    def __init__(self, spec: ConstraintSpec, matcher: Any, n_vocab: int, eos: frozenset[int],
                 stats: ConstraintStats) -> None:
        self._spec = spec
        self._m = matcher
        self._n_vocab = n_vocab
        self._eos = eos
        self._consumed = 0
        #: tokens advanced over after the grammar stopped (only an end-of-generation id is allowed there;
        #: the engine does not consume it): rolled back first
        self._past_stop = 0
        self._stats = stats

    @property
    def stats(self) -> ConstraintStats:
        return self._stats

    @property
    def spec(self) -> ConstraintSpec:
        return self._spec

    @property
    def consumed(self) -> int:
        return self._consumed

    def _fail(self, what: str) -> ConstraintError:
        return ConstraintError(self._spec.field, f"the grammar engine failed while {what}: {self._m.get_error()}")

    def allows(self, tokens: Sequence[int]) -> int:
        if not tokens or self._past_stop:
            return 0
        t0 = time.perf_counter()
        if self._m.is_stopped():  # complete: only an end of generation may follow
            n = int(tokens[0] in self._eos)
        else:
            n = int(self._m.validate_tokens(list(tokens)))
        self.stats.seconds += time.perf_counter() - t0
        return n

    def allowed_ids(self) -> npt.NDArray[np.bool_]:
        """Which ids the grammar allows now (one bool per id of the model's vocabulary)."""
        t0 = time.perf_counter()
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        if self._m.is_error():
            raise self._fail("computing the token mask")
        allowed = np.unpackbits(bits, bitorder="little")[: self._n_vocab].astype(bool)
        self.stats.masks += 1
        self.stats.seconds += time.perf_counter() - t0
        return allowed

    def mask(self, row: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.float32]:
        allowed = self.allowed_ids()
        x = np.asarray(row, dtype=np.float32)
        if not allowed.any():
            raise ConstraintError(self._spec.field, "the grammar allows no token here (an unsatisfiable grammar)")
        return np.where(allowed[: x.shape[0]], x, np.float32(-np.inf)).astype(np.float32, copy=False)

    def advance(self, tokens: Sequence[int]) -> None:
        t0 = time.perf_counter()
        for tok in tokens:
            if self._past_stop or self._m.is_stopped():
                self._past_stop += 1  # the end-of-generation id the stopped grammar allowed
            elif not self._m.consume_token(tok):
                raise self._fail(f"advancing over token {tok}")
            self._consumed += 1
        self.stats.seconds += time.perf_counter() - t0

    def rollback(self, n: int) -> None:
        if n <= 0:
            return
        if n > self._consumed:
            raise self._fail(f"rolling back {n} of {self._consumed} tokens")
        virtual = min(n, self._past_stop)
        self._past_stop -= virtual
        if n > virtual and not self._m.rollback(n - virtual):
            raise self._fail(f"rolling back {n} of {self._consumed} tokens")
        self._consumed -= n


def _lark_literal(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    import llguidance

    return str(llguidance.regex_to_lark(re.escape(text)))


def _lark_of(spec: ConstraintSpec) -> str:
    """The spec as one llguidance grammar (a lazy spec: free text, the trigger, then the body)."""
    import llguidance

    if spec.trigger is None:
        if spec.kind == "json_schema":
            return str(llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_STYLE))
        if spec.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(spec.source))
        return str(llguidance.grammar_from("grammar", spec.source))
    if spec.kind == "json_schema":
        styled = {**JSON_STYLE, **json.loads(spec.source).get("x-guidance", {})}
        body = f"%json {json.dumps({**json.loads(spec.source), 'x-guidance': styled})}"
        side: list[dict[str, str]] = []
    elif spec.kind == "regex":
        body, side = f"/{llguidance.regex_to_lark(spec.source)}/", []
    else:
        lark = llguidance.gbnf_to_lark.any_to_lark(spec.source)
        body, side = "@body", [{"name": "body", "lark_grammar": lark}]
    # either text without the trigger (and the end), or free text up to the trigger's first
    # occurrence (a lazy lexeme) and the body from there to the end
    trig = json.dumps(spec.trigger)
    head = (f"%llguidance {{}}\nstart: TAIL | lazy_head body\nlazy_head[lazy]: FREE_TEXT {trig}\n"
            f"body: {body}\nFREE_TEXT: /{FREE_TEXT}/\nTAIL: /{FREE_TEXT}/ & ~/{FREE_TEXT}{_lark_literal(spec.trigger)}"
            f"{FREE_TEXT}/\n")
    if not side:
        return str(llguidance.LLMatcher.grammar_from_lark(head))
    return json.dumps({"grammars": [{"name": "start", "lark_grammar": head}, *side]})


class Grammars:
    """Compiles :class:`ConstraintSpec` values against one model's vocabulary (its llguidance
    tokenizer is built once, on first use, from ``vocabulary``)."""

    def __init__(self, vocabulary: Callable[[], Vocabulary]) -> None:
        self._vocabulary = vocabulary
        self._lock = threading.Lock()
        self._tokenizer: Any = None
        self._vocab: Vocabulary | None = None
        self._n_vocab = 0
        self._eos: frozenset[int] = frozenset()

    def vocabulary(self) -> Vocabulary:
        """The model's vocabulary (read once)."""
        with self._lock:
            if self._vocab is None:
                self._vocab = self._vocabulary()
            return self._vocab

    def _llg_tokenizer(self) -> Any:
        vocab = self.vocabulary()
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                pieces = vocab.pieces

                class _Wrapped:
                    eos_token_id = vocab.eos[0] if vocab.eos else None
                    bos_token_id = None
                    tokens = list(pieces)
                    special_token_ids = [i for i, p in enumerate(pieces) if p[:1] == b"\xff"]

                    def __call__(self, text: bytes) -> list[int]:
                        return list(vocab.encode(text))

                self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped()),
                                                         n_vocab=len(pieces), eos_token=list(vocab.eos) or None)
                self._n_vocab = len(pieces)
                self._eos = frozenset(vocab.eos)
            return self._tokenizer

    def compile(self, spec: ConstraintSpec) -> GrammarConstraint:
        """A fresh :class:`GrammarConstraint` at the start of the output, or a :class:`ConstraintError`
        naming what the engine refused (a syntax error, an unsupported schema keyword)."""
        import llguidance

        try:
            grammar = _lark_of(spec)
        except (ValueError, TypeError, KeyError) as exc:
            raise ConstraintError(spec.field, f"the {spec.kind} does not compile: {exc}") from None
        tok = self._llg_tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            raise ConstraintError(spec.field, f"the {spec.kind} does not compile: {messages[0]}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(spec.field, f"the {spec.kind} does not compile: {matcher.get_error()}")
        return GrammarConstraint(spec, matcher, self._n_vocab, self._eos, ConstraintStats(spec))
