"""Tool calls: OpenAI function tools through a model's chat template, in the model's own format,
constrained and parsed.

What a model's tool-call format is lives in :mod:`power_core.tool_formats` (one table of formats and
:func:`detect_format`, which reads it off the chat template); the parser that takes calls out of the
output, whole or as it streams, in :mod:`power_core.tool_parser`. This module holds the request side:
tools as OpenAI defines them (:class:`Function`), how they reach a chat template (:func:`template_tools`,
:func:`template_tool_calls`) and one request's plan (:class:`ToolPlan`: the grammar that forces or
allows calls, and the parser). ``power serve`` uses it for ``tools`` / ``tool_choice``; a library user
does the same::

    from power_core import tools

    fmt = tools.detect_format(template_source) or tools.HERMES
    plan = tools.ToolPlan.make(my_tools, choice="auto", format=fmt)    # OpenAI tool definitions
    prompt = session.chat_prompt(messages, **plan.template_vars())
    result = session.generate(prompt, constraint=plan.constraint())
    message = plan.parse(result.text)                                   # .content, .tool_calls

``tool_choice``:

- ``required`` (or a named function): a grammar, active from the first token, that forces one call
  (with ``parallel_tool_calls``, one or more, where the format has several) whose arguments match that
  function's ``parameters``;
- ``auto``: a *lazy* grammar: free text, and from the format's trigger on, calls as above;
- ``none``: no tools reach the template and nothing is constrained.

A format Power cannot serve (``ToolFormat.unsupported``: GPT-OSS's harmony channels, Gemma 4's
notation, ...) refuses tools with a :class:`~power_core.errors.ConstraintError` saying why.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from power_core.constraint import ConstraintSpec
from power_core.errors import ConstraintError
from power_core.tool_formats import FORMATS, HERMES, ToolFormat, detect_format
from power_core.tool_parser import (
    ParsedDelta,
    ParsedMessage,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    new_call_id,
    parse,
)

__all__ = ["HERMES", "FORMATS", "TOOLS_MAX", "Function", "NamedChoice", "ParsedDelta", "ParsedMessage",
           "ToolCall", "ToolCallDelta", "ToolCallParser", "ToolChoice", "ToolFormat", "ToolPlan", "detect_format",
           "parse", "template_renders_tools", "template_tool_calls", "template_tools"]

#: tools one request may define (OpenAI's limit)
TOOLS_MAX = 128
#: a function's name (OpenAI's rule)
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: the characters of a function's parameter schema, as canonical JSON, at most
PARAMETERS_MAX_CHARS = 32768


@attrs.frozen
class NamedChoice:
    """``tool_choice`` naming one function: exactly one call of it."""

    name: str


#: ``none`` | ``auto`` | ``required`` | one named function
ToolChoice = Literal["none", "auto", "required"] | NamedChoice


@attrs.frozen
class Function:
    """One function tool: its name, description and the JSON schema of its arguments."""

    name: str
    parameters: Mapping[str, Any] = attrs.field(factory=lambda: {"type": "object", "properties": {}})
    description: str | None = None

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any], *, field: str = "tools[0]") -> Function:
        """A tool as OpenAI's API defines it: ``{"type": "function", "function": {"name", "description",
        "parameters", "strict"}}``. Raises :class:`ConstraintError` naming ``field`` (and the key)."""
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ConstraintError(f"{field}.type", 'a tool is {"type": "function", "function": {...}}')
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ConstraintError(f"{field}.function", "an object with the function's name and parameters")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ConstraintError(f"{field}.function.{unknown[0]}", "not a field of a function tool "
                                  "(name, description, parameters, strict)")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ConstraintError(f"{field}.function.name", f"a function's name is 1-64 letters, digits, '_' or "
                                  f"'-'; got {name!r}")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ConstraintError(f"{field}.function.description", "a string")
        if fn.get("strict") not in (None, True, False):
            raise ConstraintError(f"{field}.function.strict", "true or false")
        params = fn.get("parameters")
        if params is None:
            return cls(name=name, description=description)
        where = f"{field}.function.parameters"
        if not isinstance(params, Mapping):
            raise ConstraintError(where, f"the parameters are a JSON schema object, not {type(params).__name__}")
        if params.get("type", "object") != "object":
            raise ConstraintError(where, f"a function's arguments are an object: the schema's type is 'object', "
                                  f"not {params.get('type')!r}")
        if len(json.dumps(params)) > PARAMETERS_MAX_CHARS:
            raise ConstraintError(where, f"the schema has more than {PARAMETERS_MAX_CHARS} characters")
        return cls(name=name, parameters=params, description=description)

    def to_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters)
        return {"type": "function", "function": fn}

    def parameters_spec(self, field: str) -> ConstraintSpec:
        """The arguments' schema alone, to check that the grammar engine takes it (errors name ``field``)."""
        return ConstraintSpec.json_schema(self.parameters, field=field)


@functools.lru_cache(maxsize=16)
def template_renders_tools(template_source: str) -> bool:
    """Does the Jinja template read the ``tools`` variable (so tools given to it reach the prompt)?"""
    from jinja2 import Environment, meta

    try:
        return "tools" in meta.find_undeclared_variables(Environment().parse(template_source))
    except Exception:  # a template this plain environment cannot parse: judge by the text
        return "tools" in template_source


def template_tools(functions: Sequence[Function]) -> list[dict[str, Any]]:
    """``functions`` as the ``tools`` variable Hugging Face chat templates read (OpenAI's shape)."""
    return [f.to_openai() for f in functions]


def template_tool_calls(calls: Sequence[Mapping[str, Any]], *, field: str = "tool_calls") -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` as chat templates read them: ``function.arguments``
    (an opaque string in OpenAI's API) parsed into an object when it is one (templates write it with
    ``tojson``), else kept as the string the client sent — a call cut off by ``max_tokens``
    (``{"city": "Oslo``) or arguments that are no JSON object — as llama.cpp's templates get it; a
    template that tests ``arguments is string`` (Qwen 3's, ``docs/examples/hermes-tools.jinja``)
    writes it verbatim. ``field`` names the calls in errors (a call that is not an object)."""
    out = []
    for i, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise ConstraintError(f"{field}[{i}]", "a tool call is an object")
        fn = call.get("function") or {}
        raw = fn.get("arguments", "{}")
        args: Any = raw
        if isinstance(raw, str):
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None
            if isinstance(parsed, Mapping):
                args = dict(parsed)
        elif isinstance(raw, Mapping):
            args = dict(raw)
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn.get("name"),
                                                                            "arguments": args}})
    return out


@attrs.frozen
class ToolPlan:
    """One request's tools: the functions, the choice, whether calls may come several at once, and
    the model's format. ``choice == "none"`` renders no tools and constrains nothing."""

    functions: tuple[Function, ...]
    choice: ToolChoice = "auto"
    parallel: bool = True
    format: ToolFormat = HERMES
    #: the request field the tools came from (errors name it)
    field: str = "tools"

    @classmethod
    def make(cls, tools: Sequence[Mapping[str, Any] | Function], choice: ToolChoice | str | Mapping[str, Any] = "auto",
             *, parallel: bool = True, format: ToolFormat = HERMES, field: str = "tools",
             choice_field: str = "tool_choice") -> ToolPlan:
        """Validate OpenAI tool definitions and a ``tool_choice`` (a string or ``{"type": "function",
        "function": {"name": ...}}``). Raises :class:`ConstraintError` naming the field."""
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise ConstraintError(field, "a list of tools")
        if len(tools) > TOOLS_MAX:
            raise ConstraintError(field, f"at most {TOOLS_MAX} tools, not {len(tools)}")
        functions = tuple(t if isinstance(t, Function) else Function.from_openai(t, field=f"{field}[{i}]")
                          for i, t in enumerate(tools))
        seen: set[str] = set()
        for i, f in enumerate(functions):
            if f.name in seen:
                raise ConstraintError(f"{field}[{i}].function.name", f"two tools are named {f.name!r}")
            seen.add(f.name)
        parsed = cls._choice(choice, choice_field)
        if parsed != "none" and not functions:
            raise ConstraintError(choice_field, f"tool_choice {_shown(parsed)} needs tools")
        if isinstance(parsed, NamedChoice) and parsed.name not in seen:
            raise ConstraintError(choice_field, f"no tool is named {parsed.name!r} (tools: {', '.join(sorted(seen))})")
        if parsed != "none" and format.unsupported is not None:
            raise ConstraintError(field, f"this model's tool-call format ({format.name}: {format.models}) is not "
                                  f"supported: {format.unsupported}; send tool_choice \"none\", or give a chat "
                                  "template in a supported format (docs/tools.md)")
        return cls(functions=functions, choice=parsed, parallel=parallel, format=format, field=field)

    @staticmethod
    def _choice(choice: ToolChoice | str | Mapping[str, Any], field: str) -> ToolChoice:
        if isinstance(choice, NamedChoice):
            return choice
        if choice in ("none", "auto", "required"):
            return choice  # type: ignore[return-value]
        if isinstance(choice, Mapping) and choice.get("type") == "function" and set(choice) <= {"type", "function"}:
            fn = choice.get("function")
            if isinstance(fn, Mapping) and set(fn) == {"name"} and isinstance(fn["name"], str):
                return NamedChoice(fn["name"])
        raise ConstraintError(field, 'tool_choice is "none", "auto", "required" or {"type": "function", '
                              f'"function": {{"name": ...}}}}; got {choice!r}')

    @property
    def active(self) -> bool:
        """Tools reach the template and the output may carry calls (every choice but ``none``)."""
        return self.choice != "none"

    @property
    def callable(self) -> tuple[Function, ...]:
        """The functions the output may call (a named choice: that one)."""
        if isinstance(self.choice, NamedChoice):
            return tuple(f for f in self.functions if f.name == self.choice.name)
        return self.functions

    def template_vars(self) -> dict[str, Any]:
        """What the chat template gets besides the messages: ``tools`` (nothing for ``none``)."""
        return {"tools": template_tools(self.functions)} if self.active else {}

    def constraint(self) -> ConstraintSpec | None:
        """The grammar of the output: forced calls (``required``, named), a lazy one (``auto``), or none."""
        if not self.active:
            return None
        parallel = self.parallel and not isinstance(self.choice, NamedChoice)
        return self.format.constraint(self.callable, lazy=self.choice == "auto", parallel=parallel, field=self.field)

    def parameter_specs(self) -> list[ConstraintSpec]:
        """Each function's parameter schema alone, its errors naming its field (check these first, so
        a schema the engine refuses names its tool)."""
        return [f.parameters_spec(f"{self.field}[{i}].function.parameters") for i, f in enumerate(self.functions)]

    def parser(self, new_id: Callable[[int], str] = new_call_id) -> ToolCallParser:
        """A streaming parser of this request's output (its format; XML parameters typed by the tools)."""
        return ToolCallParser(self.format, new_id, self._strings())

    def parse(self, text: str, new_id: Callable[[int], str] = new_call_id) -> ParsedMessage:
        """A whole output's content and calls (the same as feeding it to :meth:`parser` piece by piece)."""
        return parse(self.format, text, new_id, self._strings())

    def _strings(self) -> dict[str, dict[str, bool]]:
        """Which parameters of each function are strings (XML formats read the others as JSON)."""
        return {f.name: self.format.string_params(f) for f in self.functions}


def _shown(choice: ToolChoice) -> str:
    return repr(choice.name) if isinstance(choice, NamedChoice) else repr(choice)
