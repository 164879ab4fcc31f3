"""Tool-call formats: how each model family writes a call, how a chat template says which one it is,
and the grammar that makes a model write one.

One table (:data:`FORMATS`) holds every format Power knows, in the order :func:`detect_format` tries
them (the first whose ``detect`` texts all occur in the template source, and none of its ``unless``
texts, wins; the markers follow the pinned llama.cpp's ``common/chat.cpp``). A format is data:

- ``call``: one call as the model writes it, with slots ``⟨name⟩`` (the function's name),
  ``⟨args⟩`` (its arguments as one JSON object), ``⟨id⟩`` (a call id the model writes, matching
  ``id_pattern``) and ``⟨params⟩`` (the arguments as XML-like parameters, each written as ``param``
  with ``⟨key⟩`` and ``⟨value⟩``: a string parameter's text as it is, any other value as JSON);
- ``begin`` / ``sep`` / ``end``: around the calls of one answer and between them;
- ``keys``: for a call that is one JSON object, its name and arguments keys (a call written with its
  keys in another order is still parsed, whole);
- ``unsupported``: why Power cannot serve this format (a request with tools gets a typed error).

From that, :meth:`ToolFormat.grammar` builds the llguidance grammar (forced calls, or *lazy*: free
text until ``trigger``, then calls) and :mod:`power_core.tool_parser` parses calls back out of text.
A marker of the markup that the model's vocabulary holds as one control token (Mistral's
``[TOOL_CALLS]``) is that token in the grammar, and the output's text shows it
(:class:`~power_core.constraint.PreservedTokens`, found when the constraint compiles:
:meth:`ToolFormat.constraint`), so the parser reads the same text either way.
A template no row recognises gets :data:`HERMES` (``<tool_call>`` JSON), the documented fallback.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import attrs

from power_core.constraint import (
    FREE_TEXT,
    JSON_STYLE,
    NO_PRESERVED,
    ConstraintSpec,
    Markers,
    PreservedTokens,
    close_objects,
    hoist_defs,
)

__all__ = ["FORMATS", "HERMES", "FunctionLike", "Part", "ToolFormat", "detect_format", "format_named", "parts"]

#: a piece of a call pattern: ``("lit", text)`` or a slot ``("name" | "args" | "id" | "params" | "key" |
#: "value", "")``
Part = tuple[str, str]
SLOTS = ("name", "args", "id", "params", "key", "value")
_SLOT_RE = re.compile("⟨(" + "|".join(SLOTS) + ")⟩")


class FunctionLike(Protocol):
    """What a grammar needs of a function tool (:class:`power_core.tools.Function` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def parameters(self) -> Mapping[str, Any]: ...


def parts(pattern: str) -> tuple[Part, ...]:
    """``pattern`` split into literals and slots (empty literals left out)."""
    out: list[Part] = []
    at = 0
    for m in _SLOT_RE.finditer(pattern):
        if m.start() > at:
            out.append(("lit", pattern[at:m.start()]))
        out.append((m.group(1), ""))
        at = m.end()
    if at < len(pattern):
        out.append(("lit", pattern[at:]))
    return tuple(out)


def _lit(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _until(name: str, free: str, close: str, preserved: PreservedTokens, rules: list[str]) -> None:
    """Adds rule ``name`` to ``rules``: any text (the terminal ``free``) up to the first ``close``, then
    ``close``. Where ``close`` starts with a preserved token, the text is any text that does not spell
    ``close`` (the output's text shows the token as that spelling), then the token."""
    split = preserved.split(close)
    head = split[0] if split else close
    if isinstance(head, int):
        import llguidance

        text = f"{name.upper()}_TEXT"
        rules.append(f"{name}: {text} {preserved.lark(close)}")
        rules.append(f"{text}: /{FREE_TEXT}/ & ~/{FREE_TEXT}{llguidance.regex_to_lark(re.escape(close))}{FREE_TEXT}/")
        return
    if head == close:
        rules.append(f"{name}[lazy]: {free} {_lit(close)}")
        return
    rules.append(f"{name}: {name}_head {preserved.lark(close[len(head):])}")
    rules.append(f"{name}_head[lazy]: {free} {_lit(head)}")


@attrs.frozen
class ToolFormat:
    """How one model family writes tool calls (see the module docstring for the slots)."""

    name: str
    #: one call, with ``⟨name⟩``, ``⟨args⟩`` or ``⟨params⟩``, and optionally ``⟨id⟩``
    call: str
    begin: str = ""
    sep: str = ""
    end: str = ""
    #: one parameter of ``⟨params⟩``: ``⟨key⟩`` and ``⟨value⟩``
    param: str | None = None
    #: a call that is one JSON object: its name key and arguments key
    keys: tuple[str, str] | None = None
    #: the text whose first occurrence starts the calls (a prefix of ``begin + call``; default: ``begin``,
    #: else the call's literal text before its first slot, without a JSON object's start or trailing
    #: whitespace)
    trigger_text: str | None = None
    id_pattern: str = "[A-Za-z0-9]{9}"
    #: several calls per answer
    parallel: bool = True
    #: texts a template of this format holds (all), and texts it does not hold (none)
    detect: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    #: the models that write it (docs)
    models: str = ""
    #: why Power cannot serve it (``None``: it can)
    unsupported: str | None = None

    def __attrs_post_init__(self) -> None:
        ps = self.call_parts
        if not ps or ps[0][0] != "lit":
            raise ValueError(f"tool format {self.name}: a call starts with literal text")
        if ("args", "") not in ps and ("params", "") not in ps:
            raise ValueError(f"tool format {self.name}: a call has ⟨args⟩ or ⟨params⟩")
        if ("params", "") in ps and self.param is None:
            raise ValueError(f"tool format {self.name}: ⟨params⟩ needs a param pattern")
        if not (self.begin + self.prefix).startswith(self.trigger):
            raise ValueError(f"tool format {self.name}: the trigger {self.trigger!r} does not start its calls")

    # -- the pattern, in pieces ----------------------------------------------------------------------
    @property
    def call_parts(self) -> tuple[Part, ...]:
        return parts(self.call)

    @property
    def param_parts(self) -> tuple[Part, ...]:
        return parts(self.param) if self.param is not None else ()

    @property
    def markup(self) -> tuple[str, ...]:
        """Every literal text of the format (where a marker may be a control token of a vocabulary)."""
        lits = [t for kind, t in self.call_parts + self.param_parts if kind == "lit"]
        return tuple(dict.fromkeys(t for t in (*lits, self.begin, self.sep, self.end) if t))

    @property
    def prefix(self) -> str:
        """The literal text every call starts with."""
        return self.call_parts[0][1]

    @property
    def trigger(self) -> str:
        """The text that starts the calls (what a lazy grammar waits for, what the parser looks for)."""
        if self.trigger_text is not None:
            return self.trigger_text
        head = self.begin or self.prefix
        cut = head.find('{"')  # a JSON call object may write its keys in another order: not part of it
        head = head[:cut] if cut > 0 else head
        return head.rstrip() or head

    @property
    def args_marker(self) -> str | None:
        """The literal text right before a call's JSON arguments (the output's JSON values start after
        it: no object of theirs may repeat a key); ``None`` for XML parameters."""
        ps = self.call_parts
        for i, (kind, _) in enumerate(ps):
            if kind == "args":
                return ps[i - 1][1] if i and ps[i - 1][0] == "lit" else None
        return None

    # -- writing calls -------------------------------------------------------------------------------
    def render_call(self, name: str, arguments: Mapping[str, Any], call_id: str = "") -> str:
        """One call as this format writes it (an XML parameter: a string as it is, anything else as JSON)."""
        out = []
        for kind, text in self.call_parts:
            if kind == "lit":
                out.append(text)
            elif kind == "name":
                out.append(name)
            elif kind == "id":
                out.append(call_id)
            elif kind == "args":
                out.append(json.dumps(dict(arguments), ensure_ascii=False))
            else:
                out.append("".join(self._render_param(k, v) for k, v in arguments.items()))
        return "".join(out)

    def _render_param(self, key: str, value: Any) -> str:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return "".join(t if kind == "lit" else key if kind == "key" else text for kind, t in self.param_parts)

    def render_calls(self, calls: Sequence[tuple[str, Mapping[str, Any], str]]) -> str:
        """Several calls ``(name, arguments, id)`` as one answer writes them."""
        return self.begin + self.sep.join(self.render_call(n, a, i) for n, a, i in calls) + self.end

    # -- the grammar ---------------------------------------------------------------------------------
    def constraint(self, functions: Sequence[FunctionLike], *, lazy: bool, parallel: bool,
                   field: str = "tools") -> ConstraintSpec:
        """:meth:`grammar` as a constraint: its markup (:attr:`markup`) looked up in the model's vocabulary
        when it compiles, so a marker that is one control token there is that token (and shown in the
        output's text); no object of a call's JSON arguments repeats a key."""
        def grammar(preserved: PreservedTokens) -> str:
            return self.grammar(functions, lazy=lazy, parallel=parallel, preserved=preserved)

        return ConstraintSpec.grammar(grammar(NO_PRESERVED), field=field, json_after=self.args_marker,
                                      markers=Markers(self.markup, grammar))

    def grammar(self, functions: Sequence[FunctionLike], *, lazy: bool, parallel: bool,
                preserved: PreservedTokens = NO_PRESERVED) -> str:
        """An llguidance Lark grammar: calls of ``functions`` (one, or with ``parallel`` one or more),
        each function's arguments matching its ``parameters`` (objects closed unless they say otherwise,
        :func:`~power_core.constraint.close_objects`); ``lazy``: free text until :attr:`trigger`, which
        starts the calls, or free text without it and no call. The markup's ``preserved`` tokens are
        taken as those tokens (none: all of it is text)."""
        lit = preserved.lark
        rules: list[str] = []
        bodies = [self._body(f, i, rules, preserved) for i, f in enumerate(functions)]
        rules.append("body: " + " | ".join(bodies))
        head = self.begin + self.prefix
        many = parallel and self.parallel
        more = f' ({lit(self.sep + self.prefix)} body)*' if many else ""
        end = f" {lit(self.end)}" if self.end else ""
        if not lazy:
            start = f"start: {lit(head)} body{more}{end}"
            return "%llguidance {}\n" + start + "\n" + "\n".join(rules) + "\n" + _any(rules)
        import llguidance

        rest = head[len(self.trigger):]
        rest_lit = f" {lit(rest)}" if rest else ""
        tag = llguidance.regex_to_lark(re.escape(self.trigger))
        trigger: list[str] = []
        _until("trigger", "FREE_TEXT", self.trigger, preserved, trigger)
        return ("%llguidance {}\n"
                f"start: TAIL | trigger{rest_lit} body{more}{end}\n" + "\n".join(trigger + rules) + "\n"
                f"FREE_TEXT: /{FREE_TEXT}/\nTAIL: /{FREE_TEXT}/ & ~/{FREE_TEXT}{tag}{FREE_TEXT}/\n" + _any(rules))

    def _body(self, fn: FunctionLike, index: int, rules: list[str], preserved: PreservedTokens) -> str:
        """The rule of one call of ``fn`` after the literal prefix (added to ``rules``); its name."""
        items: list[str] = []
        for kind, text in self.call_parts[1:]:
            if kind == "lit":
                items.append(preserved.lark(text))
            elif kind == "name":
                items.append(_lit(fn.name))
            elif kind == "id":
                items.append(f"/{self.id_pattern}/")
            elif kind == "args":
                items.append(f"%json {json.dumps(_styled(close_objects(fn.parameters)), ensure_ascii=False)}")
            else:
                items.append(self._params(fn, index, rules, preserved))
        rule = f"call_{index}"
        items = [i for i in items if i]  # (a function without parameters writes none)
        rules.append(f"{rule}: " + " ".join(items))
        return rule

    def _params(self, fn: FunctionLike, index: int, rules: list[str], preserved: PreservedTokens) -> str:
        """XML parameters of ``fn``: its properties in order, the required ones always, the others
        optionally; a string's text ends at the parameter's closing text, anything else is JSON."""
        schema = fn.parameters
        props = schema.get("properties")
        required = set(schema.get("required") or ())
        pp = self.param_parts
        lit = preserved.lark
        at = [k for k, _ in pp].index("value")
        close = "".join(t for _, t in pp[at + 1:])
        if not isinstance(props, Mapping) or not props:
            if isinstance(props, Mapping) or schema.get("additionalProperties") is False:
                return ""  # no parameters
            # an object that names no keys: any keys, string values
            rule = f"anyparam_{index}"
            rules.append(f"{rule}: " + " ".join(lit(t) if k == "lit" else "/[A-Za-z0-9_.-]+/" if k == "key"
                                                 else f"vclose_{index}_any" for k, t in pp[:at + 1]))
            _until(f"vclose_{index}_any", "ANY", close, preserved, rules)
            return f"{rule}*"
        items = []
        for j, (key, sub) in enumerate(props.items()):
            rule = f"param_{index}_{j}"
            sub = _deref(sub, schema)
            choices = _string_choices(sub)
            if choices is not None:  # an enum (or const) of strings: one of them, as written
                value = "(" + " | ".join(_lit(c) for c in choices) + f") {lit(close)}"
            elif _is_string(sub):  # any text up to the parameter's closing text
                value = f"vstr_{index}_{j}"
                _until(value, "ANY", close, preserved, rules)
            else:
                value = f"%json {json.dumps(_styled(close_objects(hoist_defs(sub, schema))), ensure_ascii=False)} " \
                    f"{lit(close)}"
            rules.append(f"{rule}: " + " ".join([lit(t) if k == "lit" else _lit(key) for k, t in pp[:at]] + [value]))
            items.append(rule if key in required else f"{rule}?")
        return " ".join(items)

    def string_params(self, fn: FunctionLike) -> dict[str, bool]:
        """Which of ``fn``'s parameters are strings (their XML text is the value as written)."""
        props = fn.parameters.get("properties")
        if not isinstance(props, Mapping):
            return {}
        return {k: _is_string(_deref(v, fn.parameters)) for k, v in props.items()}


def _any(rules: Sequence[str]) -> str:
    """The ``ANY`` terminal (any text), where an XML parameter's text uses it."""
    return "ANY: /(.|\\n)*/\n" if any(" ANY " in r for r in rules) else ""


def _styled(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A schema spelled as every constraint spells JSON (one line, ``json.dumps`` separators: as
    templates write past calls with ``tojson``, so a model copies its own format and cannot pad it)."""
    return {**schema, "x-guidance": {**JSON_STYLE, **schema.get("x-guidance", {})}}


def _deref(schema: Any, root: Mapping[str, Any]) -> Any:
    """A parameter's schema that is only a local ``$ref`` (``#/$defs/X``, ``#/definitions/X``), as the
    definition it names (so an XML parameter whose type is a string enum is written as text)."""
    ref = schema.get("$ref") if isinstance(schema, Mapping) else None
    if isinstance(ref, str):
        m = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
        defs = root.get(m.group(1)) if m else None
        if m and isinstance(defs, Mapping) and isinstance(defs.get(m.group(2)), Mapping):
            return defs[m.group(2)]
    return schema


def _is_string(schema: Any) -> bool:
    """A string parameter: its XML text is its value (an enum or const of strings counts)."""
    return isinstance(schema, Mapping) and (schema.get("type") == "string" or _string_choices(schema) is not None)


def _string_choices(schema: Any) -> list[str] | None:
    """The values of a string ``enum`` / ``const`` (``None``: not one)."""
    if not isinstance(schema, Mapping):
        return None
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return values
    return None


#: Hermes / Qwen 2.5 / Qwen 3: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``; also
#: the fallback for a template no row recognises
HERMES = ToolFormat(
    "hermes", '<tool_call>\n{"name": "⟨name⟩", "arguments": ⟨args⟩}\n</tool_call>', sep="\n",
    keys=("name", "arguments"), detect=("<tool_call>",),
    models="Qwen 2.5, Qwen 3, QwQ, Hermes 2 Pro / 3, Granite 4, MiMo-VL, Bielik, Reka; the fallback")

_JSON_CALL = '{"name": "⟨name⟩", "arguments": ⟨args⟩}'
_HARMONY = ("harmony channels: the recipient comes before or after the channel, a call follows reasoning on "
            "another channel, and a call ends with `<|call|>`, which ends generation (an end-of-generation "
            "token is never preserved)")

#: every format Power knows, in detection order (more specific markers first)
FORMATS: tuple[ToolFormat, ...] = (
    ToolFormat("gpt-oss", "<|channel|>commentary to=functions.⟨name⟩ <|constrain|>json<|message|>⟨args⟩<|call|>",
               detect=("<|channel|>",), models="GPT-OSS", unsupported=_HARMONY),
    ToolFormat("muse-glimmer", '<atem:function_calls>\n<atem:invoke name="⟨name⟩">\n⟨params⟩</atem:invoke>\n'
               "</atem:function_calls>", param='<atem:parameter name="⟨key⟩">⟨value⟩</atem:parameter>\n', detect=("<atem:function_calls>", "<|eom|>"),
               models="Muse Glimmer", unsupported="recipients in the turn header (` to=<recipient>`) decide "
               "what the message is; no grammar of one call covers them"),
    ToolFormat("functionary-v3.2", ">>>⟨name⟩\n⟨args⟩", detect=(">>>all",), models="Functionary v3.2",
               unsupported="every message starts with a recipient (`>>>all` for text), so a free answer is no "
               "free text"),
    ToolFormat("kimi-k2", "<|tool_call_begin|>functions.⟨name⟩:⟨id⟩<|tool_call_argument_begin|>⟨args⟩"
               "<|tool_call_end|>", begin="<|tool_calls_section_begin|>", end="<|tool_calls_section_end|>",
               id_pattern="[0-9]{1,3}", detect=("<|tool_calls_section_begin|>", "<|tool_call_begin|>"),
               models="Kimi K2"),
    ToolFormat("kimi-k3", '<|open|>call tool="⟨name⟩" index="⟨id⟩"<|sep|>⟨params⟩<|close|>call<|sep|>',
               param='<|open|>argument key="⟨key⟩" type="string"<|sep|>⟨value⟩<|close|>argument<|sep|>', detect=("<|open|>", "<|close|>", "<|end_of_msg|>"),
               models="Kimi K3", unsupported="each argument carries its type in the markup "
               '(`<|open|>argument key="city" type="string"`)'),
    ToolFormat("glm-xml-ling", "<tool_call>⟨name⟩\n⟨params⟩</tool_call>",
               param="<arg_key>⟨key⟩</arg_key>\n<arg_value>⟨value⟩</arg_value>\n", sep="\n",
               detect=("<role>ASSISTANT</role>", "<arg_key>"), models="Ling 3.0"),
    ToolFormat("cohere", '{"tool_call_id": "⟨id⟩", "tool_name": "⟨name⟩", "parameters": ⟨args⟩}',
               begin="<|START_ACTION|>[\n    ", sep=",\n    ", end="\n]<|END_ACTION|>", id_pattern="[0-9]{1,3}",
               keys=("tool_name", "parameters"), detect=("<|START_ACTION|>",),
               models="Command R7B, Command A (Cohere2 MoE)"),
    ToolFormat("lfm2", "<|tool_call_start|>[⟨name⟩(⟨args⟩)]<|tool_call_end|>", detect=("<|tool_list_start|>",), models="LFM2",
               unsupported="calls are Python expressions (`[f(city=\"Oslo\")]`), not JSON or XML"),
    ToolFormat("lfm2.5", "[⟨name⟩(⟨args⟩)]", detect=("List of tools: [",), models="LFM2.5",
               unsupported="calls are Python expressions (`[f(city=\"Oslo\")]`), not JSON or XML"),
    ToolFormat("gigachat3.1", '<|function_call|>{"name": "⟨name⟩", "arguments": ⟨args⟩}', keys=("name", "arguments"),
               parallel=False, detect=("<|function_call|>",), models="GigaChat 3.1"),
    ToolFormat("gigachat3", '<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "⟨name⟩", "arguments": ⟨args⟩}',
               keys=("name", "arguments"), parallel=False, detect=("<|role_sep|>", "<|message_sep|>"),
               models="GigaChat 3"),
    ToolFormat("minimax-m3", ']<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="⟨name⟩">⟨params⟩]<]minimax[>[</invoke>'
               '\n]<]minimax[>[</tool_call>', param="]<]minimax[>[<⟨key⟩>⟨value⟩]<]minimax[>[</⟨key⟩>",
               detect=("]<]minimax[>[", "<invoke name="), models="MiniMax M3",
               unsupported="each parameter is a tag of its own name (`<city>Oslo</city>`) behind a namespace "
               "token"),
    ToolFormat("deepseek-dsml", '<｜DSML｜invoke name="⟨name⟩">\n⟨params⟩</｜DSML｜invoke>\n',
               param='<｜DSML｜parameter name="⟨key⟩" string="true">⟨value⟩</｜DSML｜parameter>\n', detect=("dsml_token", "DSML"),
               models="DeepSeek V3.2, V4", unsupported='each parameter says in its markup whether it is a '
               'string (`string="true"`)'),
    ToolFormat("gemma4", "<|tool_call>call:⟨name⟩⟨args⟩<tool_call|>", detect=("'<|tool_call>call:'",),
               models="Gemma 4", unsupported='arguments are Gemma\'s own notation (`{city:<|"|>Oslo<|"|>}`), '
               "not JSON"),
    ToolFormat("minicpm5", '<function name="⟨name⟩">⟨params⟩</function>', param='<param name="⟨key⟩">⟨value⟩</param>', sep="\n",
               detect=("Tool usage guidelines:", '<function name="', '<param name="'), models="MiniCPM 5"),
    ToolFormat("seed-oss", "<seed:tool_call>\n<function=⟨name⟩>\n⟨params⟩</function>\n</seed:tool_call>",
               param="<parameter=⟨key⟩>⟨value⟩</parameter>\n", sep="\n", trigger_text="<seed:tool_call>",
               detect=("<seed:tool_call>",),
               models="Seed-OSS"),
    ToolFormat("qwen3-coder", "<tool_call>\n<function=⟨name⟩>\n⟨params⟩</function>\n</tool_call>",
               param="<parameter=⟨key⟩>\n⟨value⟩\n</parameter>\n", sep="\n", trigger_text="<tool_call>",
               detect=("<tool_call>", "<function=", "<parameter="),
               models="Qwen3-Coder, Qwen 3.5, Nemotron 3 Nano, StepFun 3.5"),
    ToolFormat("glm-xml-compact", "<tool_call>⟨name⟩⟨params⟩</tool_call>",
               param="<arg_key>⟨key⟩</arg_key><arg_value>⟨value⟩</arg_value>", detect=("</arg_key><arg_value>",),
               models="GLM 4.7, Spark 2.5"),
    ToolFormat("laguna", "<tool_call>⟨name⟩⟨params⟩</tool_call>",
               param="<arg_key>⟨key⟩</arg_key><arg_value>⟨value⟩</arg_value>",
               detect=('"<arg_key>" ~ k ~ "</arg_key>"',), models="Poolside Laguna"),
    ToolFormat("glm-xml", "<tool_call>⟨name⟩\n⟨params⟩</tool_call>",
               param="<arg_key>⟨key⟩</arg_key>\n<arg_value>⟨value⟩</arg_value>\n", sep="\n",
               detect=("<tool_call>", "<arg_key>"), models="GLM 4.5, 4.6"),
    ToolFormat("hy3", "<tool_call:opensource>⟨name⟩<tool_sep:opensource>\n⟨params⟩</tool_call:opensource>",
               param="<arg_key:opensource>⟨key⟩</arg_key:opensource>\n<arg_value:opensource>⟨value⟩"
               "</arg_value:opensource>\n", begin="<tool_calls:opensource>\n", sep="\n",
               end="\n</tool_calls:opensource>", detect=("'<tool_call{}>'.format(HYTK)", ":opensource"), models="Hunyuan 3"),
    ToolFormat("minimax-m2", '<invoke name="⟨name⟩">\n⟨params⟩</invoke>\n', param='<parameter name="⟨key⟩">⟨value⟩'
               "</parameter>\n", begin="<minimax:tool_call>\n", end="</minimax:tool_call>",
               detect=("<minimax:tool_call>",), models="MiniMax M2"),
    ToolFormat("mistral-v11-call-id", "[TOOL_CALLS]⟨name⟩[CALL_ID]⟨id⟩[ARGS]⟨args⟩",
               detect=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), models="Mistral Small 3.2"),
    ToolFormat("mistral-v11", "[TOOL_CALLS]⟨name⟩[ARGS]⟨args⟩", detect=("[TOOL_CALLS]", "[ARGS]"),
               models="Ministral 3, Magistral, Devstral"),
    ToolFormat("mistral-nemo", '{"name": "⟨name⟩", "arguments": ⟨args⟩, "id": "⟨id⟩"}', begin="[TOOL_CALLS][",
               sep=", ", end="]", keys=("name", "arguments"), detect=("[TOOL_CALLS]",), models="Mistral Nemo"),
    ToolFormat("apertus", '{"⟨name⟩": ⟨args⟩}', begin="<|tools_prefix|>[", sep=", ", end="]<|tools_suffix|>",
               detect=("<|tools_prefix|>",), models="Apertus"),
    ToolFormat("apriel", _JSON_CALL, begin="<tool_calls>[", sep=", ", end="]</tool_calls>", keys=("name", "arguments"),
               detect=("<tool_calls>[",), models="Apriel 1.5, 1.6"),
    ToolFormat("nemotron-v2", _JSON_CALL, begin="<TOOLCALL>[", sep=", ", end="]</TOOLCALL>",
               keys=("name", "arguments"), detect=("<TOOLCALL>",), models="Nemotron Nano v2"),
    ToolFormat("minimax-m1", _JSON_CALL, begin="<tool_calls>\n", sep="\n", end="\n</tool_calls>",
               keys=("name", "arguments"), detect=("<tool_calls>", "<beginning_of_sentence>"), models="MiniMax M1"),
    ToolFormat("granite-3", _JSON_CALL, begin="<|tool_call|>[", sep=", ", end="]", keys=("name", "arguments"),
               detect=("<|tool_call|>",), models="Granite 3.x"),
    ToolFormat("solar-open", "<|tool_call:begin|>⟨id⟩<|tool_call:name|>⟨name⟩<|tool_call:args|>⟨args⟩"
               "<|tool_call:end|>", begin="<|tool_calls|>", end="<|calls|>", id_pattern="[A-Za-z0-9_-]{1,40}",
               detect=("<|tool_call:begin|>",), models="Solar Open"),
    ToolFormat("deepseek-r1", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>⟨name⟩\n```json\n⟨args⟩\n```<｜tool▁call▁end｜>",
               begin="<｜tool▁calls▁begin｜>", sep="\n", end="<｜tool▁calls▁end｜>",
               detect=("<｜tool▁calls▁begin｜>", "```json"), models="DeepSeek R1 (and its distills)"),
    ToolFormat("deepseek-v3.1", "<｜tool▁call▁begin｜>⟨name⟩<｜tool▁sep｜>⟨args⟩<｜tool▁call▁end｜>",
               begin="<｜tool▁calls▁begin｜>", end="<｜tool▁calls▁end｜>", detect=("<｜tool▁calls▁begin｜>",),
               models="DeepSeek V3, V3.1"),
    ToolFormat("functionary-v3.1", "<function=⟨name⟩>⟨args⟩</function>", detect=("<function=", "</function>"),
               models="Functionary v3.1 (Llama 3.1)"),
    ToolFormat("firefunction-v2", _JSON_CALL, begin=" functools[", sep=", ", end="]", keys=("name", "arguments"),
               detect=("functools[",), models="FireFunction v2"),
    ToolFormat("command-r-plus", '{"tool_name": "⟨name⟩", "parameters": ⟨args⟩}', begin="Action: ```json\n[\n    ",
               sep=",\n    ", end="\n]\n```", keys=("tool_name", "parameters"), detect=("parameter_definitions",),
               models="Command R+", unsupported="its template reads Cohere's own tool shape "
               "(`parameter_definitions`), not OpenAI's `parameters`"),
    ToolFormat("llama3-json", '{"name": "⟨name⟩", "parameters": ⟨args⟩}', keys=("name", "parameters"),
               parallel=False, detect=("<|start_header_id|>", "ipython", '"parameters"'),
               models="Llama 3.1, 3.2, 3.3 (JSON calls; `<|python_tag|>` built-in tools are not supported)"),
    HERMES,
)


@functools.lru_cache(maxsize=32)
def detect_format(template_source: str) -> ToolFormat | None:
    """The tool-call format a chat template declares (the first row of :data:`FORMATS` whose markers
    it holds), or ``None`` (callers fall back to :data:`HERMES`)."""
    for fmt in FORMATS:
        if all(d in template_source for d in fmt.detect) and not any(u in template_source for u in fmt.unless):
            return fmt
    return None


def format_named(name: str) -> ToolFormat:
    """The row of :data:`FORMATS` called ``name`` (``KeyError`` naming the known ones)."""
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise KeyError(f"no tool-call format {name!r}; known: {', '.join(f.name for f in FORMATS)}")
