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

JSON objects, two rules (:func:`close_objects`, :class:`JsonKeys`):

- **closed by default**, as llama.cpp's schema converter (llama-server's ``json_schema``) makes them: an
  object schema that declares its keys (``properties`` or ``patternProperties``) and says nothing of
  others takes no others, as if it said ``"additionalProperties": false``. ``additionalProperties``
  (``true`` or a schema) opens it, as JSON Schema reads it; an object that declares no keys
  (``{"type": "object"}``, ``json_object``) is any object. Objects combined by ``allOf`` are left as
  written (closing each part would refuse the other parts' keys);
- **no key twice** in one object, whatever the schema: a JSON schema's output and every tool call's
  JSON are watched as they are written, and a token that would complete a key its object already
  holds is masked (and cuts a proposal) like a token the grammar forbids.
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
from power_core.json_keys import JsonKeys, KeyTables
from power_core.runtime import TokenArray

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["Constraint", "ConstraintSpec", "ConstraintStats", "Grammars", "GrammarConstraint", "Markers",
           "PreservedTokens", "Vocabulary", "KINDS", "FREE_TEXT", "JSON_STYLE", "NO_PRESERVED", "close_objects",
           "hoist_defs"]

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


@attrs.frozen
class PreservedTokens:
    """Control tokens that a grammar takes as the tokens they are and an output's text shows (llama.cpp's
    ``preserved_tokens``): the markers of a tool-call format (Mistral's ``[TOOL_CALLS]``, ``[ARGS]``) that
    the model's vocabulary holds as one control token each. Its other control tokens (the end of
    generation, ...) stay out of the text. Found once per compiled constraint
    (:meth:`Grammars.preserved`, from the spec's :class:`Markers`); empty where every marker is text."""

    #: (marker text, token id), longest text first
    tokens: tuple[tuple[str, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.tokens)

    @property
    def ids(self) -> frozenset[int]:
        return frozenset(i for _, i in self.tokens)

    @classmethod
    def find(cls, texts: Sequence[str], controls: Mapping[str, int]) -> PreservedTokens:
        """The control tokens (``controls``: text -> id) whose text occurs in ``texts``."""
        longest = max(map(len, controls), default=0)
        found: dict[str, int] = {}
        for text in texts:
            at = 0
            while at < len(text):  # left to right, the longest control text at each place (as split reads it)
                n = next((n for n in range(min(longest, len(text) - at), 0, -1) if text[at:at + n] in controls), 0)
                if n:
                    found[text[at:at + n]] = controls[text[at:at + n]]
                at += n or 1
        return cls(tuple(sorted(found.items(), key=lambda kv: (-len(kv[0]), kv[0]))))

    def split(self, text: str) -> list[str | int]:
        """``text`` as plain runs and the ids of the preserved tokens it spells (longest first, left to right)."""
        if not self.tokens:
            return [text] if text else []
        ids = dict(self.tokens)
        out: list[str | int] = []
        at = 0
        for m in re.finditer("|".join(re.escape(t) for t, _ in self.tokens), text):
            if m.start() > at:
                out.append(text[at:m.start()])
            out.append(ids[m.group()])
            at = m.end()
        if at < len(text):
            out.append(text[at:])
        return out

    def lark(self, text: str) -> str:
        """``text`` as Lark items in sequence: string literals, and ``<[id]>`` for each preserved token."""
        return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p, ensure_ascii=False)
                        for p in self.split(text))

    def shown(self, pieces: Sequence[bytes]) -> tuple[bytes, ...]:
        """A vocabulary's pieces with each preserved token's piece its text (no ``0xff`` prefix)."""
        out = list(pieces)
        for text, tok in self.tokens:
            out[tok] = text.encode()
        return tuple(out)

    def decoder(self, decode: Callable[[TokenArray], str]) -> Callable[[TokenArray], str]:
        """``decode`` (a tokenizer's, which leaves control tokens out) with each preserved token shown as
        its text; ``decode`` itself when there is none. Runs between them decode on their own (decoding
        is concatenative at a control token, which never splits a character)."""
        if not self.tokens:
            return decode
        texts = {i: t for t, i in self.tokens}
        ids = np.fromiter(texts, dtype=np.int32)

        def decode_preserving(tokens: TokenArray) -> str:
            arr = np.asarray(tokens, dtype=np.int32)
            hits = np.flatnonzero(np.isin(arr, ids)).tolist()
            if not hits:
                return decode(arr)
            out, at = [], 0
            for h in hits:
                if h > at:
                    out.append(decode(arr[at:h]))
                out.append(texts[int(arr[h])])
                at = h + 1
            if at < arr.shape[0]:
                out.append(decode(arr[at:]))
            return "".join(out)

        return decode_preserving


#: no preserved tokens: every marker is text
NO_PRESERVED = PreservedTokens()


@attrs.frozen
class Markers:
    """A grammar's markup that a model's vocabulary may hold as control tokens (a tool-call format's
    literals: ``texts``), and the grammar again given those it does hold (``grammar``: each of their
    literals takes the token, :meth:`PreservedTokens.lark`). :meth:`Grammars.compile` looks them up."""

    texts: tuple[str, ...]
    grammar: Callable[[PreservedTokens], str] = attrs.field(eq=False, repr=False)


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
    trigger may complete anywhere, also inside a speculated block. ``json_after``: a grammar whose
    output holds JSON values, each right after this text (a tool call's opening tag): no object of
    theirs repeats a key (a JSON schema's output is watched from its start, or from its trigger).
    ``markers``: the grammar's markup that may be control tokens of the model's vocabulary (tool-call
    markers): where they are, the grammar takes those tokens and the output's text shows them.
    """

    kind: Kind = attrs.field(validator=attrs.validators.in_(KINDS))
    source: str = attrs.field(converter=_canonical)
    trigger: str | None = None
    #: where the spec came from, for error messages (``response_format``, ``--grammar``, ...)
    field: str = attrs.field(default="constraint", eq=False)
    json_after: str | None = attrs.field(default=None, kw_only=True)
    markers: Markers | None = attrs.field(default=None, kw_only=True)

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
    def grammar(cls, text: str, *, trigger: str | None = None, field: str = "grammar",
                json_after: str | None = None, markers: Markers | None = None) -> ConstraintSpec:
        return cls("grammar", text, trigger, field, json_after=json_after, markers=markers)

    @property
    def json_from(self) -> str | None:
        """The text after which the output's JSON values start (``""``: at the start), or ``None``: the
        output is not watched for repeated keys (a regex, a grammar of the user's own)."""
        if self.kind == "json_schema":
            return self.trigger or ""
        return self.json_after

    @property
    def digest(self) -> str:
        """sha256 of the kind, the canonical source and the trigger (the receipt's ``constraint.digest``)."""
        parts = [self.kind, self.source, self.trigger] + ([self.json_after] if self.json_after is not None else [])
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

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

    @property
    def preserved(self) -> PreservedTokens:
        """The control tokens its grammar takes as markers, which the output's text shows."""

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


# -- JSON objects: closed by default, no key twice ------------------------------------------------------
#: keywords whose value is one subschema, a list of them, or a mapping of names to them
_ONE_SCHEMA = ("additionalItems", "contains", "additionalProperties", "propertyNames", "not", "if", "then", "else",
               "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", "$defs", "definitions")
_COMBINATORS = ("allOf", "anyOf", "oneOf")


def _declares_keys(node: Mapping[str, Any]) -> bool:
    return isinstance(node.get("properties"), Mapping) or isinstance(node.get("patternProperties"), Mapping)


def _composed(node: Mapping[str, Any]) -> bool:
    """An object put together from parts: an ``allOf`` of several, or keys of its own beside a combinator."""
    all_of = node.get("allOf")
    return (isinstance(all_of, list) and len(all_of) > 1) or \
        (_declares_keys(node) and any(isinstance(node.get(k), list) for k in _COMBINATORS))


def _part_refs(node: Any, out: set[str]) -> set[str]:
    """The ``$ref`` of every part of a composed object (:func:`_composed`), anywhere in ``node``."""
    if isinstance(node, Mapping):
        if _composed(node):
            out.update(str(p["$ref"]) for k in _COMBINATORS if isinstance(node.get(k), list)
                       for p in node[k] if isinstance(p, Mapping) and "$ref" in p)
        for v in node.values():
            _part_refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _part_refs(v, out)
    return out


def close_objects(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` with every object that declares its keys (``properties`` or ``patternProperties``) and
    says nothing of others (no ``additionalProperties``, ``unevaluatedProperties``) closed:
    ``"additionalProperties": false``, as llama.cpp's converter reads such a schema. An object that
    declares no keys stays any object; the parts of an object composed with ``allOf`` (or with keys of
    its own beside ``anyOf``/``oneOf``), and the definitions they refer to, are left as written. Key
    order is kept (it is the order the output writes properties in)."""
    return dict(_close(schema, _part_refs(schema, set()), part=False))


def hoist_defs(schema: Mapping[str, Any], root: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` (a part of ``root``, e.g. one property's) as a schema of its own: ``root``'s
    definitions (``$defs``, ``definitions``) travel with it, so its ``$ref: "#/$defs/..."`` (as pydantic
    writes nested models) still resolve once it is compiled alone. Its own definitions win."""
    out = dict(schema)
    for key in ("$defs", "definitions"):
        defs = root.get(key)
        if isinstance(defs, Mapping) and defs:
            mine = out.get(key)
            out[key] = {**defs, **(mine if isinstance(mine, Mapping) else {})}
    return out


def _close(node: Any, parts: set[str], *, part: bool) -> Any:
    if not isinstance(node, Mapping):
        return node
    composed = _composed(node)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {name: _close(sub, parts, part=key in ("$defs", "definitions") and
                                     f"#/{key}/{name}" in parts) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_close(sub, parts, part=composed and key in _COMBINATORS) for sub in value]
        elif key == "items" and isinstance(value, list):  # draft 4-2019's tuple form
            out[key] = [_close(sub, parts, part=False) for sub in value]
        elif key in _ONE_SCHEMA or key == "items":
            out[key] = _close(value, parts, part=False)
        else:  # const, enum, default, examples, x-guidance, ...: values, not schemas
            out[key] = value
    if _declares_keys(node) and not part and not composed and "additionalProperties" not in node \
            and "unevaluatedProperties" not in node:
        out["additionalProperties"] = False
    return out


class GrammarConstraint:
    """A :class:`Constraint` over an llguidance matcher."""

    def __init__(self, spec: ConstraintSpec, matcher: Any, n_vocab: int, eos: frozenset[int],
                 stats: ConstraintStats, keys: JsonKeys | None = None,
                 preserved: PreservedTokens = NO_PRESERVED) -> None:
        self._spec = spec
        self._preserved = preserved
        self._m = matcher
        self._n_vocab = n_vocab
        self._eos = eos
        #: the output's JSON objects, watched so that none repeats a key (None: not JSON)
        self._keys = keys
        self._keys_took_all = False  # the last mask: the grammar allowed tokens, but each repeated a key
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
    def preserved(self) -> PreservedTokens:
        return self._preserved

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
            if n and self._keys is not None:
                n = self._keys.allows(tokens[:n], self._m)
        self.stats.seconds += time.perf_counter() - t0
        return n

    def allowed_ids(self) -> npt.NDArray[np.bool_]:
        """Which ids the grammar allows now (one bool per id of the model's vocabulary)."""
        t0 = time.perf_counter()
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        if self._m.is_error():
            raise self._fail("computing the token mask")
        allowed = np.unpackbits(bits, bitorder="little")[: self._n_vocab].astype(bool)
        if self._keys is not None and not self._m.is_stopped():
            self._keys_took_all = not self._keys.restrict(allowed, self._m)
        self.stats.masks += 1
        self.stats.seconds += time.perf_counter() - t0
        return allowed

    def mask(self, row: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.float32]:
        allowed = self.allowed_ids()
        x = np.asarray(row, dtype=np.float32)
        if not allowed.any():
            if self._keys_took_all:  # (the look-ahead keeps an output from reaching this)
                raise ConstraintError(self._spec.field, "every token the grammar allows here would repeat a key "
                                      "of a JSON object")
            raise ConstraintError(self._spec.field, "the grammar allows no token here (an unsatisfiable grammar)")
        return np.where(allowed[: x.shape[0]], x, np.float32(-np.inf)).astype(np.float32, copy=False)

    def advance(self, tokens: Sequence[int]) -> None:
        t0 = time.perf_counter()
        for tok in tokens:
            if self._past_stop or self._m.is_stopped():
                self._past_stop += 1  # the end-of-generation id the stopped grammar allowed
                if self._keys is not None:
                    self._keys.hold()
            else:
                if self._keys is not None and not self._keys.advance((tok,)):
                    raise ConstraintError(self._spec.field, f"token {tok} would repeat a key of a JSON object")
                if not self._m.consume_token(tok):
                    if self._keys is not None:
                        self._keys.rollback(1)
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
        if self._keys is not None:
            self._keys.rollback(n)
        self._consumed -= n


def _lark_literal(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/``."""
    import llguidance

    return str(llguidance.regex_to_lark(re.escape(text)))


def _closed(source: str) -> Any:
    schema = json.loads(source)
    return close_objects(schema) if isinstance(schema, Mapping) else schema


def _lark_of(spec: ConstraintSpec) -> str:
    """The spec as one llguidance grammar (a lazy spec: free text, the trigger, then the body)."""
    import llguidance

    if spec.trigger is None:
        if spec.kind == "json_schema":
            closed = json.dumps(_closed(spec.source))
            return str(llguidance.LLMatcher.grammar_from_json_schema(closed, defaults=JSON_STYLE))
        if spec.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(spec.source))
        return str(llguidance.grammar_from("grammar", spec.source))
    if spec.kind == "json_schema":
        schema = _closed(spec.source)
        styled = {**JSON_STYLE, **schema.get("x-guidance", {})}
        body = f"%json {json.dumps({**schema, 'x-guidance': styled})}"
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
        self._keys: dict[PreservedTokens, KeyTables] = {}
        self._controls: dict[str, int] | None = None

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

        preserved = self.preserved(spec.markers.texts) if spec.markers is not None else NO_PRESERVED
        try:
            grammar = _lark_of(spec if spec.markers is None or not preserved
                               else attrs.evolve(spec, source=spec.markers.grammar(preserved)))
        except (ValueError, TypeError, KeyError) as exc:
            raise ConstraintError(spec.field, f"the {spec.kind} does not compile: {exc}") from None
        tok = self._llg_tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            raise ConstraintError(spec.field, f"the {spec.kind} does not compile: {messages[0]}")
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(spec.field, f"the {spec.kind} does not compile: {matcher.get_error()}")
        marker = spec.json_from
        keys = None if marker is None else JsonKeys(marker, self._key_tables(preserved))
        return GrammarConstraint(spec, matcher, self._n_vocab, self._eos, ConstraintStats(spec), keys, preserved)

    def preserved(self, texts: Sequence[str]) -> PreservedTokens:
        """The control tokens of the vocabulary whose text occurs in ``texts`` (a grammar's markers),
        but no end of generation: llama.cpp's ``preserved_tokens`` (none where every marker is text)."""
        vocab = self.vocabulary()
        with self._lock:
            if self._controls is None:
                ends = set(vocab.eos)
                controls: dict[str, int] = {}
                for i, p in enumerate(vocab.pieces):
                    if p[:1] == b"\xff" and len(p) > 1 and i not in ends:
                        controls.setdefault(p[1:].decode("utf-8", errors="replace"), i)
                self._controls = controls
            return PreservedTokens.find(texts, self._controls)

    def _key_tables(self, preserved: PreservedTokens) -> KeyTables:
        """The vocabulary's tables for :class:`JsonKeys`, its preserved tokens read as their text (built
        once for each set)."""
        vocab = self.vocabulary()
        with self._lock:
            if preserved not in self._keys:
                self._keys[preserved] = KeyTables.of(preserved.shown(vocab.pieces))
            return self._keys[preserved]
