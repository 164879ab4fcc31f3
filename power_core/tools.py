"""Tool calls: OpenAI function tools through a model's chat template, constrained and parsed.

One place holds what a model's tool-call format is (:class:`ToolFormat`: the tags around a call and
the keys of its JSON), how tools reach a chat template (:func:`template_tools`,
:func:`template_tool_calls`), the grammar that forces or allows calls (:meth:`ToolPlan.constraint`)
and the parser that takes calls out of the output, whole or as it streams (:class:`ToolCallParser`).
``power serve`` uses it for ``tools`` / ``tool_choice``; a library user does the same::

    from power_core import tools

    plan = tools.ToolPlan.make(my_tools, choice="auto")          # OpenAI tool definitions
    prompt = session.chat_prompt(messages, **plan.template_vars())
    result = session.generate(prompt, constraint=plan.constraint())
    message = plan.parse(result.text)                             # .content, .tool_calls

Formats: Hermes / Qwen (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``), which is
also what :func:`detect_format` returns for a template that writes those tags. ``tool_choice``:

- ``required`` (or a named function): a grammar, active from the first token, that forces one call
  (with ``parallel_tool_calls``, one or more) whose ``arguments`` match that function's ``parameters``;
- ``auto``: a *lazy* grammar: free text, and from the opening tag on, a call as above;
- ``none``: no tools reach the template and nothing is constrained.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs

from power_core.constraint import FREE_TEXT, JSON_STYLE, ConstraintSpec, close_objects
from power_core.errors import ConstraintError

__all__ = ["HERMES", "FORMATS", "TOOLS_MAX", "Function", "NamedChoice", "ParsedDelta", "ParsedMessage",
           "ToolCall", "ToolCallDelta", "ToolCallParser", "ToolChoice", "ToolFormat", "ToolPlan", "detect_format",
           "template_renders_tools", "template_tool_calls", "template_tools"]

#: tools one request may define (OpenAI's limit)
TOOLS_MAX = 128
#: a function's name (OpenAI's rule)
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: the characters of a function's parameter schema, as canonical JSON, at most
PARAMETERS_MAX_CHARS = 32768
#: free text before, between or after calls


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


@attrs.frozen
class ToolCall:
    """A call the model made: ``arguments`` is JSON text, as OpenAI's ``function.arguments``."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class ToolCallDelta:
    """One piece of a streamed call, as OpenAI's ``delta.tool_calls[i]``: the first piece of a call
    has its ``id`` and ``name``; every piece may carry a fragment of ``arguments``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class ParsedDelta:
    """What a piece of output adds: content text and tool-call pieces (empty: nothing yet)."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@attrs.frozen
class ParsedMessage:
    """A whole answer: its content without the tool-call markup (``None`` when it made calls and said
    nothing else) and its calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]


def _new_id(index: int) -> str:
    return "call_" + uuid.uuid4().hex[:24]


@attrs.frozen
class ToolFormat:
    """How a model writes one tool call: ``open``, a JSON object ``{name_key: NAME, arguments_key:
    {...}}`` on its own line, ``close``. Calls follow each other on separate lines."""

    name: str
    open: str
    close: str
    name_key: str = "name"
    arguments_key: str = "arguments"

    def call_schema(self, functions: Sequence[Function]) -> dict[str, Any]:
        """The JSON schema of one call's object: the name first, then arguments matching its function's
        (whose objects are closed unless they say otherwise, :func:`~power_core.constraint.close_objects`)."""
        options = [{"type": "object",
                    "properties": {self.name_key: {"const": f.name},
                                   self.arguments_key: close_objects(f.parameters)},
                    "required": [self.name_key, self.arguments_key], "additionalProperties": False}
                   for f in functions]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        # JSON spelled as every constraint spells it (one line, json.dumps separators: as templates write
        # past calls with ``tojson``, so a model copies its own format and cannot pad a call)
        return {"x-guidance": dict(JSON_STYLE), **schema}

    def grammar(self, functions: Sequence[Function], *, lazy: bool, parallel: bool) -> str:
        """An llguidance Lark grammar: calls of ``functions`` (one, or with ``parallel`` one or more on
        separate lines); ``lazy``: free text until the opening tag, which starts the constrained call,
        and free text instead of any call."""
        nl = json.dumps("\n")
        rest = f"{nl} %json {json.dumps(self.call_schema(functions))} {json.dumps(chr(10) + self.close)}"
        if not lazy:
            start = f"start: call ({nl} call)*" if parallel else "start: call"
            return f"%llguidance {{}}\n{start}\ncall: {json.dumps(self.open)} {rest}\n"
        # the trigger is a lazy lexeme: free text that ends as soon as the opening tag is written; text
        # after the last call (or instead of any) never contains the tag
        import llguidance

        tag = llguidance.regex_to_lark(re.escape(self.open))
        start = "start: call* free" if parallel else "start: free | call"
        return (f"%llguidance {{}}\n{start}\ncall: trigger {rest}\n"
                f"trigger[lazy]: FREE_TEXT {json.dumps(self.open)}\nfree: TAIL\n"
                f"FREE_TEXT: /{FREE_TEXT}/\nTAIL: /{FREE_TEXT}/ & ~/{FREE_TEXT}{tag}{FREE_TEXT}/\n")

    def parser(self, new_id: Callable[[int], str] = _new_id) -> ToolCallParser:
        return ToolCallParser(self, new_id)

    def parse(self, text: str, new_id: Callable[[int], str] = _new_id) -> ParsedMessage:
        """A whole output's content and calls (the same as feeding it to :meth:`parser` piece by piece)."""
        p = self.parser(new_id)
        p.feed(text)
        p.finish()
        return p.message()

    def render_call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """One call as the model writes it (e.g. to show it a past call in a template-less prompt)."""
        obj = {self.name_key: name, self.arguments_key: dict(arguments)}
        return f"{self.open}\n{json.dumps(obj, ensure_ascii=False)}\n{self.close}"


#: Hermes / Qwen 2.5 / Qwen 3 style: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``
HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
#: the formats :func:`detect_format` recognises in a chat template
FORMATS: tuple[ToolFormat, ...] = (HERMES,)


def detect_format(template_source: str) -> ToolFormat | None:
    """The tool-call format a chat template declares (it writes the format's opening tag), or ``None``."""
    for fmt in FORMATS:
        if fmt.open in template_source and fmt.close in template_source:
            return fmt
    return None


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
        forced = self.choice != "auto"
        parallel = self.parallel and not isinstance(self.choice, NamedChoice)
        text = self.format.grammar(self.callable, lazy=not forced, parallel=parallel)
        # every call's JSON follows its opening tag: no object of it repeats a key
        return ConstraintSpec.grammar(text, field=self.field, json_after=self.format.open)

    def parameter_specs(self) -> list[ConstraintSpec]:
        """Each function's parameter schema alone, its errors naming its field (check these first, so
        a schema the engine refuses names its tool)."""
        return [f.parameters_spec(f"{self.field}[{i}].function.parameters") for i, f in enumerate(self.functions)]

    def parser(self, new_id: Callable[[int], str] = _new_id) -> ToolCallParser:
        return self.format.parser(new_id)

    def parse(self, text: str, new_id: Callable[[int], str] = _new_id) -> ParsedMessage:
        return self.format.parse(text, new_id)


def _shown(choice: ToolChoice) -> str:
    return repr(choice.name) if isinstance(choice, NamedChoice) else repr(choice)


_TEXT, _HEAD, _ARGS, _TAIL, _WHOLE = "text", "head", "args", "tail", "whole"


class ToolCallParser:
    """Takes tool calls out of output text as it arrives (committed deltas, in order).

    :meth:`feed` returns what the new text adds: content (the text outside calls, without the markup)
    and :class:`ToolCallDelta` pieces — a call's ``id`` and ``name`` as soon as its name is written,
    then its ``arguments`` text as it arrives (exactly the text the model wrote for them, so the
    fragments join into the same JSON the whole-output parse gives). Text that may be the start of an
    opening tag is held back until it is resolved; whitespace just before a call (or after the last
    one) is not content. :meth:`finish` flushes; :meth:`message` is the whole answer.
    """

    def __init__(self, fmt: ToolFormat, new_id: Callable[[int], str] = _new_id) -> None:
        self.format = fmt
        self._new_id = new_id
        self._buf = ""
        self._state = _TEXT
        self._pending_ws = ""
        self._content: list[str] = []
        self._calls: list[list[str]] = []  # [id, name, arguments]
        self._header = re.compile(r"\s*\{\s*" + re.escape(json.dumps(fmt.name_key)) + r"\s*:\s*\"((?:[^\"\\]|\\.)*)\"\s*,"
                                  r"\s*" + re.escape(json.dumps(fmt.arguments_key)) + r"\s*:\s*")
        # the arguments' JSON value as it is scanned: nesting depth, inside a string, after a backslash
        self._depth = 0
        self._in_str = False
        self._escape = False
        self._started = False

    # -- public --------------------------------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._step(content, calls):
            pass
        return self._delta(content, calls)

    def finish(self) -> ParsedDelta:
        """The output ended: held-back text is content; a call cut off before its name is dropped (one
        cut off in its arguments keeps what it has)."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self._state == _TEXT:
            self._emit(self._buf, content)
        self._buf = ""
        if self._pending_ws and not self._calls:
            content.append(self._pending_ws)
            self._content.append(self._pending_ws)
        self._pending_ws = ""
        return self._delta(content, calls)

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(id=c[0], name=c[1], arguments=c[2]) for c in self._calls)

    @property
    def content(self) -> str:
        return "".join(self._content)

    def message(self) -> ParsedMessage:
        content = self.content
        return ParsedMessage(content=None if self._calls and not content else content, tool_calls=self.calls)

    # -- the states ----------------------------------------------------------------------------
    def _delta(self, content: list[str], calls: list[ToolCallDelta]) -> ParsedDelta:
        merged: list[ToolCallDelta] = []
        for d in calls:  # consecutive argument fragments of one call travel as one piece
            if merged and merged[-1].index == d.index and d.id is None:
                last = merged[-1]
                merged[-1] = attrs.evolve(last, arguments=last.arguments + d.arguments)
            else:
                merged.append(d)
        return ParsedDelta("".join(content), tuple(merged))

    def _emit(self, text: str, out: list[str]) -> None:
        """Content, with a trailing whitespace run held back (it is dropped if a call follows)."""
        if not text:
            return
        text = self._pending_ws + text
        stripped = text.rstrip()
        self._pending_ws = text[len(stripped):]
        if stripped:
            out.append(stripped)
            self._content.append(stripped)

    def _step(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """Advance over the buffer once; False when it needs more text."""
        fmt = self.format
        buf = self._buf
        if self._state == _TEXT:
            at = buf.find(fmt.open)
            if at < 0:
                keep = _partial_suffix(buf, fmt.open)
                self._emit(buf[: len(buf) - keep], content)
                self._buf = buf[len(buf) - keep:]
                return False
            self._emit(buf[:at], content)
            self._pending_ws = ""  # whitespace before a call is not content
            self._buf = buf[at + len(fmt.open):]
            self._state = _HEAD
            return True
        if self._state == _HEAD:
            m = self._header.match(buf)
            if m is not None:
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except json.JSONDecodeError:
                    name = m.group(1)
                index = len(self._calls)
                call_id = self._new_id(index)
                self._calls.append([call_id, name, ""])
                calls.append(ToolCallDelta(index=index, id=call_id, name=name))
                self._buf = buf[m.end():]
                self._state = _ARGS
                self._depth, self._in_str, self._escape, self._started = 0, False, False, False
                return True
            if fmt.close in buf:  # another shape (keys in another order): parse the call whole
                self._state = _WHOLE
                return True
            return False
        if self._state == _ARGS:
            return self._scan_arguments(calls)
        if self._state == _TAIL:
            at = buf.find(fmt.close)
            if at < 0:
                return False
            self._buf = buf[at + len(fmt.close):]
            self._state = _TEXT
            return True
        # _WHOLE: the call between the tags, parsed at once
        at = buf.find(fmt.close)
        if at < 0:
            return False
        raw, self._buf, self._state = buf[:at], buf[at + len(fmt.close):], _TEXT
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get(fmt.name_key), str):
            return True  # not a call this format knows: the markup is dropped, not shown as content
        args = obj.get(fmt.arguments_key, {})
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        index = len(self._calls)
        call_id = self._new_id(index)
        self._calls.append([call_id, obj[fmt.name_key], text])
        calls.append(ToolCallDelta(index=index, id=call_id, name=obj[fmt.name_key], arguments=text))
        return True

    def _scan_arguments(self, calls: list[ToolCallDelta]) -> bool:
        """The arguments' JSON value, character by character, until it is complete."""
        buf = self._buf
        if not self._started:  # whitespace before the value is not part of it
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return False
        end = None
        for i, ch in enumerate(buf):
            if not self._started:
                self._started = True
                if ch in "{[":
                    self._depth = 1
                    continue
                if ch == '"':
                    self._in_str = True
                    continue
                self._depth = 0  # a bare scalar: it ends at a delimiter
            if self._in_str:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_str = False
                    if self._depth == 0:
                        end = i + 1
                        break
                continue
            if ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                if self._depth == 0:  # the scalar ended at the call object's brace
                    end = i
                    break
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
            elif self._depth == 0 and (ch == "," or ch.isspace()):
                end = i
                break
        piece = buf if end is None else buf[:end]
        if piece:
            index = len(self._calls) - 1
            self._calls[index][2] += piece
            calls.append(ToolCallDelta(index=index, arguments=piece))
        self._buf = "" if end is None else buf[end:]
        if end is None:
            return False
        self._state = _TAIL
        return True


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
