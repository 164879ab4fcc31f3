"""The OpenAI wire format as ``power serve`` speaks it: typed requests, errors and response bodies.

Requests are validated by pydantic in strict mode (a string where a number belongs is an error, not
a conversion; NaN and infinities are refused) and every field is declared: a field Power does not
implement is a 400 naming it, never silently ignored. Fields that only have a neutral value here
(``n``, ``best_of``, ``echo``, penalties, ``logit_bias``, ``response_format``, ``tool_choice``)
are accepted at that value and refused otherwise.

Every error body has OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from power_core.config import SAMPLING_KEYS
from power_core.transaction import TokenLogprob

__all__ = ["APIError", "ChatRequest", "CompletionRequest", "parse_request", "finish_reason"]

#: the stop strings one request may give (OpenAI allows 4; Power's configuration allows 64)
STOP_MAX = 16
#: completions' ``logprobs`` and chat's ``top_logprobs`` upper bound (OpenAI: 5 and 20)
LOGPROBS_MAX = 20
#: the roles a chat message may have; ``developer`` is OpenAI's newer name for ``system``
ROLES = ("system", "developer", "user", "assistant")


@attrs.frozen
class APIError(Exception):
    """An error answered with an OpenAI-shaped body."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __str__(self) -> str:
        return self.message


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text"]


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
    user: str | None = None

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


class CompletionRequest(_Sampling):
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


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=LOGPROBS_MAX)
    response_format: ResponseFormat | None = None
    tool_choice: Literal["none"] | None = None
    tools: list[Any] | None = Field(default=None, max_length=0)
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _limits(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise ValueError("max_tokens and max_completion_tokens disagree; give one")
        return self

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


def parse_request(kind: type[_Sampling], body: Any) -> Any:
    """Validate a decoded JSON body as ``kind``, or raise :class:`APIError` naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(body).__name__}")
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        # a union reports each member's failure; the field is the path before the member's name
        loc = [p for p in err["loc"] if not (isinstance(p, str) and (p in ("str", "int", "list[int]", "list[str]")
                                                                     or p.startswith(("list[", "function-"))))]
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


def finish_reason(power_finish: str | None, status: str) -> str | None:
    """OpenAI's finish reason for the transaction's: a stop token or string -> ``stop``; the token
    limit or the context -> ``length``; a cancelled request (timeout, drain) -> ``length`` too (the
    ``power`` extension's ``status`` says it was cancelled)."""
    if power_finish == "stop":
        return "stop"
    if power_finish in ("max_tokens", "context") or status == "cancelled":
        return "length"
    return None


def _piece(decode: Any, token: int) -> str:
    return str(decode([token]))


def chat_logprobs(items: Sequence[TokenLogprob], decode: Any) -> dict[str, Any]:
    """Chat's ``choices[0].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        piece = _piece(decode, token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in items], "refusal": None}


def completion_logprobs(items: Sequence[TokenLogprob], decode: Any, offset: int = 0) -> dict[str, Any]:
    """Completions' ``choices[0].logprobs``: parallel lists of tokens, their log-probabilities,
    the top alternatives (a mapping per token) and each token's character offset in the text."""
    tokens, offsets = [], []
    for lp in items:
        piece = _piece(decode, lp.token)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{_piece(decode, t): v for t, v in lp.top} for lp in items],
            "text_offset": offsets}
