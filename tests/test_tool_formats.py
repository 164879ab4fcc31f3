"""Each model's own tool-call format (:mod:`power_core.tool_formats`, :mod:`power_core.tool_parser`).

- The corpus: every chat template in the pinned llama.cpp sdist's ``models/templates/`` (read at test
  time from the native build's cache: its extracted source tree, else the sdist; absent, the tests skip
  with the reason, or fail under ``CI``) that takes tools or writes tool calls either round-trips
  — its format is detected, the tools reach its prompt, the format's own spelling of a call is the
  template's spelling of a past call, the template's past calls parse back, the call grammar accepts
  them (forced and lazy) and refuses bad arguments, and a call sampled under the grammar parses back to
  a valid call — or is listed in ``docs/tools.md`` with the reason it cannot.
- llama.cpp's own parser cases (``tests/test-chat.cpp``), ported as data
  (``tests/data/llama_cpp_tool_cases.json``): the same model text gives the same calls, whole and
  streamed in pieces.
- Parameters with ``$ref: "#/$defs/..."`` (pydantic's nested models) compile in every call grammar.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import tarfile
from pathlib import Path

import attrs
import jsonschema
import pytest

from power_core import tools
from power_core.chat import ChatTemplate
from power_core.errors import ConfigError, ConstraintError
from power_core.tool_formats import FORMATS, HERMES, detect_format, format_named
from tests.helpers import build_tools, open_session

ROOT = Path(__file__).resolve().parents[1]
CASES = json.loads((ROOT / "tests" / "data" / "llama_cpp_tool_cases.json").read_text())
DOC = ROOT / "docs" / "tools.md"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
                   "required": ["city"], "additionalProperties": False}}}
STRINGS = {"get_weather": {"city": True, "days": False}, "get_time": {"city": True}}


# -- the corpus: the pinned sdist's templates ------------------------------------------------------------
def _sdist() -> Path:
    bt = build_tools()
    return bt.cache_root() / "dist" / bt.SDIST_FILE


@functools.cache
def _templates() -> dict[str, str]:
    """``models/templates/*.jinja`` of the pinned sdist: from a source tree the native build extracted
    (patches touch no template), else from the sdist itself; empty when neither is in the cache."""
    bt = build_tools()
    for tree in sorted(bt.cache_root().glob(f"src-{bt.SDIST_SHA256[:12]}-*/llama.cpp/models/templates")):
        return {p.name: p.read_text() for p in sorted(tree.glob("*.jinja"))}
    path = _sdist()
    if not path.is_file():
        return {}
    prefix = f"llama_cpp_python-{bt.SDIST_VERSION}/vendor/llama.cpp/models/templates/"
    out = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            if m.name.startswith(prefix) and m.name.endswith(".jinja") and m.isfile():
                f = tf.extractfile(m)
                assert f is not None
                out[m.name[len(prefix):]] = f.read().decode()
    return out


def _need_templates() -> dict[str, str]:
    found = _templates()
    if not found:  # a developer without the native build may skip; CI (which builds it) may not
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            f"the pinned sdist is not at {_sdist()} (python native/tools/build_llama.py fetches it)")
    return found


def _listed() -> dict[str, str]:
    """docs/tools.md's templates that do not round-trip: file name -> reason."""
    text = DOC.read_text()
    section = text.split("## Templates that do not round-trip", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `([^`]+\.jinja)` \| (.+?) \|$", section, re.M))


def _tool_capable(source: str) -> bool:
    """The template takes tools or writes tool calls."""
    return tools.template_renders_tools(source) or "tool_calls" in source


def _call_id(fmt: tools.ToolFormat, index: int) -> str:
    return str(index) if fmt.id_pattern.startswith("[0-9]") else f"abc{index}23def"


def _past(fmt: tools.ToolFormat, calls: list[tuple[str, dict]]) -> list[dict]:
    return [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": _call_id(fmt, i), "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)]}]


def _accepts(session, spec, text: str) -> bool:
    ids = list(session.encode(text))
    return session.compile(spec).allows(ids) == len(ids)


@functools.cache
def _reference():
    return open_session("reference", "off", n_ctx=4096)


@functools.cache
def _sampled(fmt_name: str) -> tools.ParsedMessage:
    """A call of ``get_time`` sampled by the reference model under the format's forced grammar, parsed."""
    plan = tools.ToolPlan.make([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                               format=format_named(fmt_name))
    s = _reference()
    out = s.generate("call it", constraint=plan.constraint(), max_tokens=400)
    # (once the grammar is complete it allows only end-of-generation ids; the reference vocabulary has two,
    # and the session stops at one of them)
    return plan.parse(s.opened.tokenizer.decode([t for t in out.tokens if t not in s.stop_ids]))


def _round_trip(source: str) -> None:
    """Everything a template's format must do; raises (AssertionError, ConfigError, ConstraintError) where
    it does not."""
    fmt = detect_format(source) or HERMES
    plan = tools.ToolPlan.make([WEATHER, TIME], "required", format=fmt)  # refuses an unsupported format
    assert tools.template_renders_tools(source), "the template renders no tools"
    template = ChatTemplate(source=source, bos_token="<s>", eos_token="</s>")
    prompt = template.render([{"role": "user", "content": "Weather in Oslo?"}], **plan.template_vars())
    assert "get_weather" in prompt and "Get the current weather in a city" in prompt, "the tools miss the prompt"
    # the format's spelling of a call is the template's spelling of a past call
    one = [("get_time", {"city": "Paris"})]
    past = template.render(_past(fmt, one), add_generation_prompt=False)
    answer = past[past.index("Weather in Oslo?") + len("Weather in Oslo?"):]
    mine = fmt.render_calls([(n, a, _call_id(fmt, i)) for i, (n, a) in enumerate(one)])
    assert mine in answer, f"{fmt.name} writes {mine!r}; the template wrote {answer!r}"
    # the template's own past calls parse back (several where the format has several)
    calls = [("get_weather", {"city": "Oslo", "days": 3}), *one] if fmt.parallel else one
    past = template.render(_past(fmt, calls), add_generation_prompt=False)
    answer = past[past.index("Weather in Oslo?") + len("Weather in Oslo?"):]
    parsed = tools.parse(fmt, answer, strings=STRINGS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls, parsed
    # the grammar takes the format's calls, forced and lazily, and refuses bad arguments
    s = _reference()
    text = fmt.render_calls([(n, a, _call_id(fmt, i)) for i, (n, a) in enumerate(calls)])
    assert _accepts(s, plan.constraint(), text), text
    auto = tools.ToolPlan.make([WEATHER, TIME], "auto", format=fmt).constraint()
    assert _accepts(s, auto, "Let me check. " + text) and _accepts(s, auto, "No call needed.")
    bad = fmt.render_calls([("get_weather", {"days": 3}, _call_id(fmt, 0))])  # no city
    assert not _accepts(s, plan.constraint(), bad) and not _accepts(s, auto, "Checking. " + bad)
    # a call sampled under the grammar parses back to a valid call
    sampled = _sampled(fmt.name)
    assert [c.name for c in sampled.tool_calls] == ["get_time"], sampled
    jsonschema.validate(json.loads(sampled.tool_calls[0].arguments), TIME["function"]["parameters"])


NAMES = sorted(_templates()) or ["(the pinned sdist is not in the cache)"]


@pytest.mark.parametrize("name", NAMES)
def test_every_tool_template_round_trips_or_is_listed_with_its_reason(name):
    source = _need_templates()[name]
    listed = _listed()
    if not _tool_capable(source):
        assert name not in listed, f"{name} takes no tools: docs/tools.md need not list it"
        return
    if name in listed:  # the listing stays true: it still does not round-trip
        with pytest.raises((AssertionError, ConfigError, ConstraintError)):
            _round_trip(source)
        return
    _round_trip(source)


def test_the_docs_list_only_templates_of_the_corpus():
    found = _need_templates()
    assert set(_listed()) <= set(found), set(_listed()) - set(found)


def test_detection_covers_the_families_of_the_brief():
    found = _need_templates()
    expect = {"Qwen-Qwen2.5-7B-Instruct.jinja": "hermes", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja": "hermes",
              "mistralai-Mistral-Nemo-Instruct-2407.jinja": "mistral-nemo",
              "meta-llama-Llama-3.1-8B-Instruct.jinja": "llama3-json", "meta-llama-Llama-3.3-70B-Instruct.jinja":
              "llama3-json", "meetkai-functionary-medium-v3.1.jinja": "functionary-v3.1",
              "Qwen3-Coder.jinja": "qwen3-coder", "openai-gpt-oss-120b.jinja": "gpt-oss",
              "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "deepseek-r1",
              "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek-v3.1",
              "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": "cohere",
              "ibm-granite-granite-3.3-2B-Instruct.jinja": "granite-3", "ibm-granite-granite-4.0.jinja": "hermes"}
    got = {name: (detect_format(found[name]) or HERMES).name for name in expect}
    assert got == expect
    assert detect_format("{{ messages }}") is None  # unknown: callers fall back to Hermes


def test_every_format_is_documented():
    text = DOC.read_text()
    for fmt in FORMATS:
        assert f"`{fmt.name}`" in text, fmt.name
        if fmt.unsupported is not None:
            assert fmt.unsupported in text, fmt.name


def test_an_unsupported_format_refuses_tools_with_its_reason():
    gpt = format_named("gpt-oss")
    with pytest.raises(ConstraintError, match="harmony") as info:
        tools.ToolPlan.make([WEATHER], "auto", format=gpt)
    assert info.value.field == "tools"
    assert not tools.ToolPlan.make([WEATHER], "none", format=gpt).active  # no tools: nothing to refuse


# -- llama.cpp's own parser cases ------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES["cases"], ids=lambda c: f"{c['template']}:{c['line']}")
def test_llama_cpp_parser_cases_give_the_same_calls(case):
    source = _need_templates()[case["template"]]
    fmt = detect_format(source) or HERMES
    strings = {name: fmt.string_params(tools.Function(name, params)) for name, params in CASES["tools"].items()}
    whole = tools.parse(fmt, case["text"], strings=strings)
    assert [[c.name, json.loads(c.arguments)] for c in whole.tool_calls] == case["calls"]
    if case["content"] is not None:
        assert (whole.content or "") == case["content"]
    rng = random.Random(case["text"])  # streamed in pieces: the same calls
    for _ in range(10):
        p = tools.ToolCallParser(fmt, lambda i: f"call_{i}", strings)
        at, args, content = 0, {}, ""
        while at < len(case["text"]):
            n = rng.randint(1, 9)
            deltas = [p.feed(case["text"][at:at + n])]
            at += n
            if at >= len(case["text"]):
                deltas.append(p.finish())
            for delta in deltas:
                content += delta.content
                for d in delta.tool_calls:
                    args[d.index] = args.get(d.index, "") + d.arguments
        assert [args[i] for i in sorted(args)] == [c.arguments for c in whole.tool_calls]
        assert (content or None) == whole.content


@pytest.mark.parametrize("fmt_name, text, content, calls", [
    ("mistral-v11", "[TOOL_CALLS] is how I call tools.", "[TOOL_CALLS] is how I call tools.", []),
    ("mistral-v11", 'Sure.[TOOL_CALLS]get_time[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
     "Sure.", [("get_time", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')]),
    ("qwen3-coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2",
     None, [("get_weather", '{"city": "Oslo"}')]),  # cut off in a parameter: the complete ones
    ("qwen3-coder", "<tool_call>\n<funktion=get_time>", "<tool_call>\n<funktion=get_time>", []),  # no call: text
    ("mistral-nemo", '[TOOL_CALLS][{"arguments": {"city": "Oslo"}, "name": "get_time", "id": "abcdefghi"}]', None,
     [("get_time", '{"city": "Oslo"}')]),  # keys in another order: parsed whole
    ("mistral-nemo", '[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Oslo"}, "extra": [1, "]"]}, '
     '{"name": "get_weather", "arguments": {}, "id": "abcdefghi"}]', None,
     [("get_time", '{"city": "Oslo"}'), ("get_weather", "{}")]),  # an unknown key after the arguments: skipped
    ("mistral-nemo", '[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Oslo"}, "id": "abcdefghi"}, '
     '{"id": "bcdefghij", "name": "get_weather", "arguments": {"city": "Rome"}}]', None,
     [("get_time", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')]),  # the second in another order
    ("llama3-json", 'I will call it: {"name": "get_time", "parameters": {"city": "Oslo"}}', "I will call it:",
     [("get_time", '{"city": "Oslo"}')]),
])
def test_the_parser_on_text_that_departs_from_the_pattern(fmt_name, text, content, calls):
    fmt = format_named(fmt_name)
    got = tools.parse(fmt, text, strings=STRINGS)
    assert got.content == content and [(c.name, c.arguments) for c in got.tool_calls] == calls
    for n in range(1, 6):  # the same, streamed in pieces of n characters
        p = tools.ToolCallParser(fmt, strings=STRINGS)
        for at in range(0, len(text), n):
            p.feed(text[at:at + n])
        p.finish()
        assert p.message() == attrs.evolve(got, tool_calls=p.message().tool_calls)
        assert [(c.name, c.arguments) for c in p.message().tool_calls] == calls


# -- $defs: pydantic's nested models -----------------------------------------------------------------------
ORDER = {"type": "function", "function": {"name": "place_order", "parameters": {
    "$defs": {"Address": {"properties": {"city": {"title": "City", "type": "string"},
                                         "zip": {"title": "Zip", "type": "string"}},
                          "required": ["city", "zip"], "title": "Address", "type": "object"},
              "Size": {"enum": ["S", "M"], "title": "Size", "type": "string"}},
    "properties": {"address": {"$ref": "#/$defs/Address"}, "sizes": {"items": {"$ref": "#/$defs/Size"},
                                                                       "title": "Sizes", "type": "array"},
                   "gift": {"$ref": "#/$defs/Size"}},
    "required": ["address", "sizes"], "title": "Order", "type": "object"}}}


@pytest.mark.parametrize("fmt_name", ["hermes", "mistral-nemo", "qwen3-coder"])
def test_parameters_with_refs_to_defs_compile_and_constrain(fmt_name):
    fmt = format_named(fmt_name)
    plan = tools.ToolPlan.make([ORDER], "required", format=fmt)
    s = _reference()
    args = {"address": {"city": "Oslo", "zip": "0150"}, "sizes": ["S", "M"], "gift": "M"}
    good = fmt.render_calls([("place_order", args, "abc123def")])
    bad = fmt.render_calls([("place_order", {"address": {"city": "Oslo"}, "sizes": ["XL"]}, "abc123def")])
    assert _accepts(s, plan.constraint(), good) and not _accepts(s, plan.constraint(), bad)
    parsed = plan.parse(good)
    assert json.loads(parsed.tool_calls[0].arguments) == args
    if fmt.param is not None:  # an XML parameter whose $ref names a string enum is written as text
        assert "<parameter=gift>\nM\n</parameter>" in good


# -- power serve: the template's own format, end to end ------------------------------------------------------
def _sse(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_power_serve_calls_in_the_templates_own_format_and_refuses_an_unsupported_one():
    """Issue 45: with Mistral Nemo's template a named call came out in Hermes tags. Now the server detects
    ``[TOOL_CALLS]`` from its template, the grammar writes that format, and the response (whole and
    streamed) carries the call; GPT-OSS's template is a 400 naming ``tools`` that says why."""
    pytest.importorskip("starlette")
    from power_core.serve import ServeOptions, create_app
    from tests.serve_helpers import asgi

    found = _need_templates()
    body = {"model": "m", "messages": [{"role": "user", "content": "Time in Oslo?"}], "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 300}
    with open_session("reference", "ref-draft", n_ctx=4096) as s:
        app = create_app(s.driver(), ServeOptions(model_name="m",
                                                  chat_template=found["mistralai-Mistral-Nemo-Instruct-2407.jinja"]))
        whole, streamed = asgi(app, ("POST", "/v1/chat/completions", body),
                               ("POST", "/v1/chat/completions", {**body, "stream": True}), timeout=120)
        assert app.state.power.tool_format.name == "mistral-nemo"
        app.state.power.executor.shutdown(wait=True)
        app = create_app(s.driver(), ServeOptions(model_name="m", chat_template=found["openai-gpt-oss-120b.jinja"]))
        refused, = asgi(app, ("POST", "/v1/chat/completions", body))
        app.state.power.executor.shutdown(wait=True)
    assert whole.status_code == 200, whole.text
    msg = whole.json()["choices"][0]["message"]
    # (the reference byte tokenizer spells its end-of-generation ids, ``<|287|>``; a GGUF's renders nothing)
    assert re.fullmatch(r"(<\|\d+\|>)*", msg["content"] or "") and \
        [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]
    jsonschema.validate(json.loads(msg["tool_calls"][0]["function"]["arguments"]), TIME["function"]["parameters"])
    calls: dict[int, dict] = {}
    for chunk in _sse(streamed.text):
        for d in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk["choices"] else []:
            got = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            got["name"] = d["function"].get("name") or got["name"]
            got["arguments"] += d["function"]["arguments"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert "harmony" in refused.json()["error"]["message"]


@pytest.mark.parametrize("fmt_name", ["mistral-nemo", "qwen3-coder", "deepseek-r1"])
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_speculative_equals_target_only_under_each_formats_grammar(fmt_name, choice):
    """The call grammar masks the target's rows as any constraint does: drafts are cut where it forbids
    them, and the output equals the target-only output token for token."""
    plan = tools.ToolPlan.make([WEATHER, TIME], choice, format=format_named(fmt_name))
    outs = {}
    for mode in ("off", "ref-draft"):
        with open_session("reference", mode, n_ctx=1024) as s:
            outs[mode] = s.generate("call it", constraint=plan.constraint(), max_tokens=160).tokens
    assert outs["ref-draft"] == outs["off"]


@pytest.mark.parametrize("fmt_name", ["hermes", "qwen3-coder", "minimax-m2", "glm-xml"])
def test_functions_without_parameters_or_with_open_ones(fmt_name):
    """A function with no parameters writes none; one whose object names no keys takes any (XML: any
    key, its text a string)."""
    fmt = format_named(fmt_name)
    empty = {"type": "function", "function": {"name": "empty_args", "parameters": {"type": "object", "properties": {}}}}
    open_ = {"type": "function", "function": {"name": "no_props", "parameters": {"type": "object"}}}
    plan = tools.ToolPlan.make([empty, open_], "required", format=fmt)
    s = _reference()
    for name, args in [("empty_args", {}), ("no_props", {"note": "hi there"}), ("no_props", {})]:
        text = fmt.render_calls([(name, args, "")])
        assert _accepts(s, plan.constraint(), text), text
        assert [(c.name, json.loads(c.arguments)) for c in plan.parse(text).tool_calls] == [(name, args)]
    assert not _accepts(s, plan.constraint(), fmt.render_calls([("empty_args", {"x": "1"}, "")]))
