"""The OpenAI request format as ``power serve`` takes it: every field's rule, the typed requests, their parsing.

Every request field has one rule, in one table (:data:`FIELDS`, which ``docs/serving.md`` lists):
*honoured* (it does what OpenAI's does), *neutral* (accepted at the one value that changes nothing
here: ``n`` 1, ``echo`` false, ...), *no-op* (it cannot change the output: ``store``, ``metadata``,
``service_tier``, ...; its value is checked, then dropped) or *refused* (it would change the output
and Power cannot do it: a 400 that says why). A field in no row is a 400 naming it, never silently
ignored. Requests are validated by pydantic in strict mode (a string where a number belongs is an
error, not a conversion; NaN and infinities are refused); the honoured and neutral fields are the
request models' fields, and a test keeps the two in step.

What constrains the output (``response_format``, llama-server's ``grammar`` and ``json_schema``,
``tools`` with ``tool_choice``) becomes one :class:`~power_core.constraint.ConstraintSpec` and, for
tools, a :class:`~power_core.tools.ToolPlan` (:meth:`ChatRequest.structure`,
:meth:`CompletionRequest.structure`); two that would both constrain it are a 400 naming the second.

Power's own request fields live in one extension object, ``power`` (:class:`PowerOptions`; the
official clients send it through ``extra_body``), as every response's ``power`` object carries the
receipt's summary.

A bad request is an :class:`~power_core.serve.errors.APIError` (a 400 naming the field).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

import attrs
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from power_core.config import LOGPROBS_MAX, SAMPLING_KEYS, STOP_MAX
from power_core.constraint import ConstraintSpec
from power_core.errors import ConstraintError
from power_core.serve.errors import APIError, constraint_error
from power_core.tools import (
    HERMES,
    TOOLS_MAX,
    NamedChoice,
    ToolChoice,
    ToolFormat,
    ToolPlan,
    template_tool_calls,
)

__all__ = ["ChatRequest", "CompletionRequest", "FIELDS", "FieldRule", "PowerOptions", "Structure", "fields_markdown",
           "parse_request"]

#: the roles a chat message may have; ``developer`` is OpenAI's newer name for ``system``
ROLES = ("system", "developer", "user", "assistant", "tool")
#: a grammar's or a schema's characters (a schema as compact JSON) at most
CONSTRAINT_MAX_CHARS = 1 << 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


# -- the request fields: one rule each -------------------------------------------------------------------
CHAT, COMPLETIONS = "chat", "completions"
BOTH = (CHAT, COMPLETIONS)
Rule = Literal["honoured", "neutral", "no-op", "refused"]


#: a prediction's characters at most (its text parts together); its tokens are bounded by the context
PREDICTION_MAX_CHARS = 1 << 18


class PredictionText(_Strict):
    type: Literal["text"]
    text: str


class Prediction(_Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat. Power drafts from it and
    verifies every token, so it never changes the answer (:mod:`power_core.prediction`)."""

    type: Literal["content"]
    content: str | list[PredictionText]

    @field_validator("content")
    @classmethod
    def _bounded(cls, v: str | list[PredictionText]) -> str | list[PredictionText]:
        if isinstance(v, list) and not v:
            raise ValueError("at least one text part (or a string)")
        n = len(v) if isinstance(v, str) else sum(len(p.text) for p in v)
        if n > PREDICTION_MAX_CHARS:
            raise ValueError(f"a prediction of at most {PREDICTION_MAX_CHARS} characters, not {n}")
        return v

    @property
    def text(self) -> str:
        """The predicted text (text parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


@attrs.frozen
class FieldRule:
    """What ``power serve`` does with one request field: one row of :data:`FIELDS`."""

    name: str
    rule: Rule
    #: the endpoints the field belongs to (a no-op or refused field: both, whichever OpenAI defines it for)
    endpoints: tuple[str, ...]
    #: what it does here, or why it is a no-op or refused (a refused field's 400 says this)
    note: str
    #: a no-op's values (checked strictly: another is a 400 naming it), or None
    accepts: Any = None


#: Every request field of OpenAI's chat completions and completions (and llama-server's and Power's own
#: that ``power serve`` takes), with its rule. The honoured and neutral fields are the request models'
#: fields (:class:`ChatRequest`, :class:`CompletionRequest`); no-op fields are checked and dropped before
#: the models see the body; refused fields are a 400 with the note.
FIELDS: tuple[FieldRule, ...] = (
    FieldRule("model", "honoured", BOTH, "the served name (`--served-model-name`); another is `404 model_not_found`"),
    FieldRule("prompt", "honoured", (COMPLETIONS,), "text, a one-element list of text, or token ids"),
    FieldRule("messages", "honoured", (CHAT,),
              "roles `system`, `developer` (rendered as `system`), `user`, `assistant` (`content`, `tool_calls` or "
              "both), `tool` (`tool_call_id`); content a string or `text` parts; a past call's `arguments` is an "
              "opaque string, as OpenAI's ([tools](#structured-output-and-tools))"),
    FieldRule("max_tokens", "honoured", BOTH,
              "tokens to write at most; unset: the rest of the context (as OpenAI's and llama-server's), both "
              "capped by `--max-tokens` where the operator sets it and by the room the context has left"),
    FieldRule("max_completion_tokens", "honoured", (CHAT,), "`max_tokens`' newer name (both given: equal)"),
    FieldRule("temperature", "honoured", BOTH, "0–2"),
    FieldRule("top_p", "honoured", BOTH, "(0, 1]"),
    FieldRule("top_k", "honoured", BOTH, "llama-server's; 0: off"),
    FieldRule("min_p", "honoured", BOTH, "llama-server's; [0, 1)"),
    FieldRule("seed", "honoured", BOTH, "a seeded stochastic answer is reproducible, speculative or not"),
    FieldRule("stop", "honoured", BOTH, "a string or up to 16"),
    FieldRule("frequency_penalty", "honoured", BOTH, "−2–2"),
    FieldRule("presence_penalty", "honoured", BOTH, "−2–2"),
    FieldRule("repeat_penalty", "honoured", BOTH, "llama-server's; 1: off"),
    FieldRule("repeat_last_n", "honoured", BOTH, "llama-server's: the penalties' window; 0: off, −1: the context"),
    FieldRule("logit_bias", "honoured", BOTH, "token id → bias in −100–100"),
    FieldRule("spec_draft_max", "honoured", BOTH, "Power's: the request's own K, at most its strategy's (`GET "
              "/v1/models` lists each one's `draft_max`), as llama-server's `speculative.n_max`: a round verifies at most "
              "that many proposals; the output is the same"),
    FieldRule("stream", "honoured", BOTH, "server-sent events"),
    FieldRule("stream_options", "honoured", BOTH, "`include_usage` (with `stream`)"),
    FieldRule("logprobs", "honoured", BOTH, "completions: the number of alternatives, ≤ 20; chat: `true`"),
    FieldRule("top_logprobs", "honoured", (CHAT,), "≤ 20, with `logprobs`"),
    FieldRule("user", "honoured", BOTH, "the tenant within the API key: whose cached prompts and drafts a "
              "request may use ([tenants](#tenants))"),
    FieldRule("response_format", "honoured", (CHAT,), "`json_schema`, `json_object`, `text`"),
    FieldRule("grammar", "honoured", BOTH, "llama-server's: GBNF or Lark"),
    FieldRule("json_schema", "honoured", BOTH, "llama-server's"),
    FieldRule("tools", "honoured", (CHAT,), "function tools, rendered through the chat template; calls in the "
              "model's own format ([tools.md](tools.md))"),
    FieldRule("tool_choice", "honoured", (CHAT,), "`none`, `auto`, `required`, a named function"),
    FieldRule("parallel_tool_calls", "honoured", (CHAT,), "with tools: `false` allows one call"),
    FieldRule("prediction", "honoured", BOTH, "Predicted Outputs: `{\"type\": \"content\", \"content\": text or "
              "text parts}`, drafted from first and verified token by token, so the answer is unchanged; counted "
              "in `usage.completion_tokens_details` ([predicted outputs](#predicted-outputs))"),
    FieldRule("power", "honoured", BOTH, "Power's extension: `power.strategy`"),
    FieldRule("n", "neutral", BOTH, "1: one choice per request"),
    FieldRule("best_of", "neutral", (COMPLETIONS,), "1"),
    FieldRule("echo", "neutral", (COMPLETIONS,), "false"),
    FieldRule("suffix", "neutral", (COMPLETIONS,), "null: no insertion"),
    FieldRule("modalities", "neutral", (CHAT,), '`["text"]`: text is all it writes'),
    FieldRule("store", "no-op", BOTH, "nothing is stored for later retrieval (receipts are kept: "
              "`--receipts`)", bool | None),
    FieldRule("metadata", "no-op", BOTH, "tags for stored completions: nothing is stored",
              dict[str, str] | None),
    FieldRule("service_tier", "no-op", BOTH, "one tier here; the response carries none", str | None),
    FieldRule("prompt_cache_key", "no-op", BOTH, "the prompt cache matches prompts by their tokens, within "
              "a tenant ([the prompt cache](#the-prompt-cache))", str | None),
    FieldRule("prompt_cache_options", "no-op", BOTH, "the prompt cache keeps what `--cache-ram` holds, "
              "least recently used out first", dict[str, Any] | None),
    FieldRule("prompt_cache_retention", "no-op", BOTH, "as `prompt_cache_options`", str | None),
    FieldRule("safety_identifier", "no-op", BOTH, "an end user's id for abuse checks, which do not run "
              "here; it is no tenant (`user` is)", str | None),
    FieldRule("audio", "refused", BOTH, "power serve writes text only"),
    FieldRule("functions", "refused", BOTH, "OpenAI's deprecated function calling: send `tools`"),
    FieldRule("function_call", "refused", BOTH, "OpenAI's deprecated function calling: send `tool_choice`"),
    FieldRule("moderation", "refused", BOTH, "no moderation model runs here"),
    FieldRule("reasoning_effort", "refused", BOTH, "it would change a reasoning model's answer, and Power "
              "does not map it onto a chat template's thinking switch"),
    FieldRule("verbosity", "refused", BOTH, "it would change the answer, and no model here takes it"),
    FieldRule("web_search_options", "refused", BOTH, "no web search here"),
)

_BY_NAME = {f.name: f for f in FIELDS}


@functools.cache
def _accepts(name: str) -> TypeAdapter[Any]:
    return TypeAdapter(_BY_NAME[name].accepts, config=ConfigDict(strict=True))


def _apply_rules(body: dict[str, Any]) -> dict[str, Any]:
    """The body without its no-op fields (their values checked); a 400 for a refused field."""
    out = dict(body)
    for name in body:
        rule = _BY_NAME.get(name)
        if rule is None or rule.rule in ("honoured", "neutral"):
            continue  # the request model's (a field in no row: its 400 names it)
        if rule.rule == "refused":
            raise APIError(400, f"unsupported field {name!r}: {rule.note} (docs/serving.md lists what each "
                           "field does here)", param=name, code="unsupported_field")
        try:
            _accepts(name).validate_python(out.pop(name))
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            raise APIError(400, f"invalid value for {name!r}: {err['msg']} (it changes nothing here: "
                           f"{rule.note})", param=name, code="invalid_value") from None
    return out


def fields_markdown() -> str:
    """:data:`FIELDS` as the Markdown table ``docs/serving.md`` shows (a test keeps them equal)."""
    rows = ["| field | endpoints | rule | what it does here |", "|---|---|---|---|"]
    for f in FIELDS:
        where = "both" if set(f.endpoints) == set(BOTH) else ", ".join(f.endpoints)
        rows.append(f"| `{f.name}` | {where} | {f.rule} | {f.note} |")
    return "\n".join(rows) + "\n"


def _bounded_schema(v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v is not None and len(json.dumps(v, separators=(",", ":"))) > CONSTRAINT_MAX_CHARS:
        raise ValueError(f"a schema of at most {CONSTRAINT_MAX_CHARS} characters (as compact JSON)")
    return v


def _bounded_grammar(v: str | None) -> str | None:
    if v is not None and len(v) > CONSTRAINT_MAX_CHARS:
        raise ValueError(f"a grammar of at most {CONSTRAINT_MAX_CHARS} characters, not {len(v)}")
    if v is not None and not v.strip():
        raise ValueError("an empty grammar")
    return v


class TextFormat(_Strict):
    type: Literal["text"]


class JSONObjectFormat(_Strict):
    """Any JSON object; llama-server's ``schema`` narrows it to a schema."""

    type: Literal["json_object"]
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    _size = field_validator("schema_")(_bounded_schema)


class JSONSchema(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    #: accepted either way: the output always matches the schema
    strict: bool | None = None

    _size = field_validator("schema_")(_bounded_schema)


class JSONSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchema


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


@attrs.frozen
class Structure:
    """What a request asks of its output's shape: a constraint, and for tools their plan."""

    constraint: ConstraintSpec | None = None
    tools: ToolPlan | None = None

    def specs(self) -> list[ConstraintSpec]:
        """Every spec to compile before the request is admitted: each tool's parameter schema alone
        (so an error names its tool), then the constraint itself."""
        out = self.tools.parameter_specs() if self.tools is not None and self.tools.active else []
        return out + ([self.constraint] if self.constraint is not None else [])


class PowerOptions(_Strict):
    """The request's ``power`` extension: what Power decides per request beyond OpenAI's fields."""

    #: which of the server's strategies runs the request (``power serve --mode a,b,c``; ``GET /v1/models``
    #: lists them): one of their names, or ``auto`` (the library's ``auto`` rules among them); unset: the
    #: server's default, the first
    strategy: str | None = Field(default=None, pattern=r"^[a-z][a-z0-9_.-]{0,63}$")


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, lt=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    #: llama-server's names for llama.cpp's repeat penalty and the penalties' window
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(default=None, ge=-1)
    logit_bias: dict[str, float] | None = None
    #: the request's own K (config ``spec_draft_max``; llama-server's ``speculative.n_max``): at most its
    #: strategy's, whose K sized the server's verify passes
    spec_draft_max: int | None = Field(default=None, ge=1)
    user: str | None = None
    #: llama-server's: a GBNF (or llguidance Lark) grammar, and a JSON schema, the output must match
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    #: OpenAI's Predicted Outputs (:class:`Prediction`)
    prediction: Prediction | None = None
    #: Power's extension (:class:`PowerOptions`)
    power: PowerOptions | None = None

    _grammar_size = field_validator("grammar")(_bounded_grammar)
    _schema_size = field_validator("json_schema")(_bounded_schema)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > STOP_MAX or not all(stops):
            raise ValueError(f"at most {STOP_MAX} non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids (decimal strings); got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values are in [-100, 100]; got {bias} for token {key}")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self) -> dict[str, Any]:
        # the request-scoped keys of the configuration: the library's and the server's come from one declaration
        return {k: getattr(self, k) for k in SAMPLING_KEYS if getattr(self, k) is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _constraints(self) -> list[tuple[str, ConstraintSpec]]:
        """The request's constraints, each with the field it came from (in the order fields are checked)."""
        out: list[tuple[str, ConstraintSpec]] = []
        if self.json_schema is not None:
            out.append(("json_schema", ConstraintSpec.json_schema(self.json_schema, field="json_schema")))
        if self.grammar is not None:
            out.append(("grammar", ConstraintSpec.grammar(self.grammar, field="grammar")))
        return out


def _one(found: Sequence[tuple[str, ConstraintSpec]]) -> ConstraintSpec | None:
    if len(found) > 1:
        (first, _), (second, _) = found[0], found[1]
        raise APIError(400, f"{first} and {second} both constrain the output; give one", param=second,
                       code="conflicting_fields")
    return found[0][1] if found else None


class CompletionRequest(_Sampling):
    endpoint: ClassVar[str] = COMPLETIONS

    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=LOGPROBS_MAX)
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("an empty prompt; give text or at least one token id")
        if isinstance(v, list) and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("one prompt per request (a list of several prompts is n > 1)")
        return v

    @property
    def prompt_value(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return self.prompt  # type: ignore[return-value]

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs

    def structure(self) -> Structure:
        """The output's constraint (``grammar`` or ``json_schema``; a 400 when both are given)."""
        try:
            return Structure(constraint=_one(self._constraints()))
        except ConstraintError as exc:
            raise constraint_error(exc) from None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


def _text(content: str | list[TextPart] | None) -> str:
    return "" if content is None else content if isinstance(content, str) else "".join(p.text for p in content)


class SystemMessage(_Strict):
    role: Literal["system", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:  # ``developer`` is OpenAI's newer name for ``system``
        return {"role": "system", "content": _text(self.content)}


class UserMessage(_Strict):
    role: Literal["user"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        return {"role": "user", "content": _text(self.content)}


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    """A call of an earlier assistant turn, as the client sends it back."""

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=TOOLS_MAX)
    #: what the server's own responses carry; accepted back at the value it sends
    refusal: None = None

    @model_validator(mode="after")
    def _said_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message has content or tool_calls")
        return self

    def as_template_message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": _text(self.content)}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str = Field(min_length=1)

    def as_template_message(self) -> dict[str, Any]:
        return {"role": "tool", "content": _text(self.content), "tool_call_id": self.tool_call_id}


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    #: accepted either way: a call's arguments always match the parameters
    strict: bool | None = None

    _size = field_validator("parameters")(_bounded_schema)


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    endpoint: ClassVar[str] = CHAT

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=LOGPROBS_MAX)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=TOOLS_MAX)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None

    @model_validator(mode="after")
    def _limits(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise ValueError("max_tokens and max_completion_tokens disagree; give one")
        return self

    def structure(self, tool_format: ToolFormat | None = None) -> Structure:
        """The output's constraint and the request's tools (``tool_format``: how the model writes a
        call). A 400 naming the field when two constraints are given, or tools are malformed."""
        try:
            return self._structure(tool_format)
        except ConstraintError as exc:
            raise constraint_error(exc) from None

    def _structure(self, tool_format: ToolFormat | None) -> Structure:
        found: list[tuple[str, ConstraintSpec]] = []
        rf = self.response_format
        if isinstance(rf, JSONSchemaFormat):
            found.append(("response_format", ConstraintSpec.json_schema(
                rf.json_schema.schema_, field="response_format.json_schema.schema")))
        elif isinstance(rf, JSONObjectFormat):
            found.append(("response_format", ConstraintSpec.json_schema(
                rf.schema_ if rf.schema_ is not None else {"type": "object"},
                field="response_format.schema" if rf.schema_ is not None else "response_format")))
        found += self._constraints()
        constraint = _one(found)
        plan = self.tool_plan(tool_format)
        if plan is not None and plan.active and constraint is not None:
            field = found[0][0]
            raise APIError(400, f"tools and {field} both constrain the output; give one (or tool_choice "
                           '"none")', param=field, code="conflicting_fields")
        if plan is not None and plan.active:
            constraint = plan.constraint()
        return Structure(constraint=constraint, tools=plan)

    def tool_plan(self, tool_format: ToolFormat | None = None) -> ToolPlan | None:
        if not self.tools:
            for field in ("tool_choice", "parallel_tool_calls"):
                value = getattr(self, field)
                if value is not None and not (field == "tool_choice" and value == "none"):
                    raise APIError(400, f"{field} is only allowed when tools are given", param=field,
                                   code="invalid_value")
            return None
        choice: ToolChoice = "auto"
        if isinstance(self.tool_choice, NamedToolChoice):
            choice = NamedChoice(self.tool_choice.function.name)
        elif self.tool_choice is not None:
            choice = self.tool_choice
        functions = [t.model_dump(exclude_none=True) for t in self.tools]  # checked once, by ToolPlan.make
        return ToolPlan.make(functions, choice, parallel=self.parallel_tool_calls is not False,
                             format=tool_format or HERMES)

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: ``developer`` as ``system``, an assistant's
        ``tool_calls`` with their arguments as objects, a ``tool`` result with the called function's
        ``name``. A 400 naming the message when a tool result answers no earlier call."""
        out: list[dict[str, Any]] = []
        names: dict[str, str] = {}
        for i, m in enumerate(self.messages):
            msg = m.as_template_message()
            if isinstance(m, AssistantMessage) and m.tool_calls:
                try:
                    msg["tool_calls"] = template_tool_calls(msg["tool_calls"], field=f"messages[{i}].tool_calls")
                except ConstraintError as exc:
                    raise APIError(400, str(exc), param=exc.field, code="invalid_value") from None
                names.update({c.id: c.function.name for c in m.tool_calls})
            elif isinstance(m, ToolMessage):
                if m.tool_call_id not in names:
                    raise APIError(400, f"messages[{i}] answers tool call {m.tool_call_id!r}, which no earlier "
                                   "assistant message made", param=f"messages[{i}].tool_call_id",
                                   code="invalid_value")
                msg["name"] = names[m.tool_call_id]
            out.append(msg)
        return out

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _param(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _body_path(body: Any, loc: Sequence[int | str], *, missing: bool) -> list[int | str]:
    """``loc`` without the tags and member names a union puts in it: the parts that are keys (or
    indices) in the body, and a last part that names a missing field (``missing``)."""
    out: list[int | str] = []
    cur = body
    for i, part in enumerate(loc):
        if isinstance(cur, Mapping) and isinstance(part, str) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            cur = cur[part]
        elif i < len(loc) - 1 or not missing:
            continue
        out.append(part)
    return out


def parse_request(kind: type[_Sampling], body: Any) -> Any:
    """Validate a decoded JSON body as ``kind``, or raise :class:`APIError` naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    body = _apply_rules(body)
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        # a union reports each member's failure; the field is the path before the member's name
        loc = [p for p in err["loc"] if not (isinstance(p, str) and (p in ("str", "int", "list[int]", "list[str]")
                                                                     or p.startswith(("list[", "function-"))))]
        loc = _body_path(body, loc, missing=err["type"] == "missing")
        if err["type"] in ("union_tag_invalid", "union_tag_not_found"):  # a tagged union: the tag's field
            loc.append(str(err.get("ctx", {}).get("discriminator", "type")).strip("'"))
        param = _param(loc) or None
        if err["type"] == "extra_forbidden":
            message = (f"unsupported field {param!r}: power serve does not implement it (see docs/serving.md "
                       "for the fields it takes)")
            raise APIError(400, message, param=param, code="unsupported_field") from None
        if err["type"] == "missing":
            raise APIError(400, f"missing required field {param!r}", param=param, code="missing_field") from None
        where = f"invalid value for {param!r}: " if param else "invalid request: "
        msg = str(err["msg"]).removeprefix("Value error, ")
        got = err.get("input")
        shown = repr(got)[:80] if not isinstance(got, dict) else "an object"
        raise APIError(400, f"{where}{msg} (got {shown})", param=param, code="invalid_value") from None
