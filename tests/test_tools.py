"""Tool calls (:mod:`power_core.tools`): the parser whole and streamed, the plans and their grammars, the
chat template round trip, and ``power serve`` with the official ``openai`` client on SmolLM2 (a
Hermes-style template through ``--chat-template``): ``required`` / named / ``auto``, streamed deltas that
assemble to the non-streamed ``tool_calls``, a ``role: tool`` message back, and speculative ≡ target-only
through the online audit."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from power_core import tools
from power_core.chat import ChatTemplate
from power_core.errors import ConstraintError
from tests.serve_helpers import served

ROOT = Path(__file__).resolve().parents[1]
HERMES_TEMPLATE = ROOT / "docs" / "examples" / "hermes-tools.jinja"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}


def _ids():
    n = iter(range(1000))
    return lambda index: f"call_{next(n)}"


def _assemble(deltas: list[tools.ParsedDelta]) -> tuple[str, list[dict]]:
    """Content and calls as the openai client assembles streamed deltas (by index, arguments appended)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.tool_calls:
            got = calls.setdefault(c.index, {"id": None, "name": None, "arguments": ""})
            if c.id is not None:
                got["id"], got["name"] = c.id, c.name
            got["arguments"] += c.arguments
    return content, [calls[i] for i in sorted(calls)]


# -- the parser --------------------------------------------------------------------------------------
OUTPUTS = [
    "plain text, no calls",
    "ends in a partial tag <tool",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "P\\"a}r{is", "unit": "celsius"}}'
    '\n</tool_call>\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
    '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_time"}\n</tool_call>',  # keys in another order
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ber',  # cut off in its arguments
    "text\n\n<tool_call>\n{\"name\": \"get_we",  # cut off before its arguments
    "a < b and <tool_ca is not a tag",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_pieces_assemble_to_the_whole_parse(text):
    whole = tools.parse(tools.HERMES, text, _ids())
    rng = random.Random(text)
    for trial in range(20):
        p = tools.ToolCallParser(tools.HERMES, _ids())
        deltas, at = [], 0
        while at < len(text):
            n = 1 if trial == 0 else rng.randint(1, 12)
            deltas.append(p.feed(text[at:at + n]))
            at += n
        deltas.append(p.finish())
        content, calls = _assemble(deltas)
        assert (content or None if whole.tool_calls else content) == whole.content
        assert calls == [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in whole.tool_calls]
        assert p.message() == whole
    assert "<tool_call>" not in (whole.content or "") and "</tool_call>" not in (whole.content or "")


def test_parse_takes_calls_out_and_keeps_the_text():
    assert tools.parse(tools.HERMES, OUTPUTS[0]) == tools.ParsedMessage(OUTPUTS[0], ())
    assert tools.parse(tools.HERMES, OUTPUTS[1]).content == OUTPUTS[1]
    two = tools.parse(tools.HERMES, OUTPUTS[3], _ids())
    assert two.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in two.tool_calls] == [
        ("get_weather", {"city": 'P"a}r{is', "unit": "celsius"}), ("get_time", {})]
    assert [c.id for c in two.tool_calls] == ["call_0", "call_1"]
    other = tools.parse(tools.HERMES, OUTPUTS[4])
    assert other.content is None and other.tool_calls[0].name == "get_time"
    assert json.loads(other.tool_calls[0].arguments) == {"city": "Oslo"}
    cut = tools.parse(tools.HERMES, OUTPUTS[5])
    assert cut.tool_calls[0].arguments == '{"city": "Ber' and cut.content is None
    assert tools.parse(tools.HERMES, OUTPUTS[6]) == tools.ParsedMessage("text", ())
    assert tools.parse(tools.HERMES, OUTPUTS[7]).content == OUTPUTS[7]
    assert two.tool_calls[0].to_openai() == {"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "P\\"a}r{is", "unit": "celsius"}'}}


# -- plans, grammars, templates -------------------------------------------------------------------------
@pytest.mark.parametrize("tool_defs, choice, field", [
    ([{"type": "function", "function": {"name": "a b"}}], "auto", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "auto",
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "auto", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "oops": 1}}], "auto", "tools[0].function.oops"),
    ([{"type": "retrieval"}], "auto", "tools[0].type"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
    ([WEATHER] * (tools.TOOLS_MAX + 1), "auto", "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([], "required", "tool_choice"),
])
def test_plans_refuse_malformed_tools_naming_the_field(tool_defs, choice, field):
    with pytest.raises(ConstraintError) as info:
        tools.ToolPlan.make(tool_defs, choice)
    assert info.value.field == field


def test_plans_and_their_grammars():
    auto = tools.ToolPlan.make([WEATHER, TIME], "auto")
    assert auto.active and auto.template_vars() == {"tools": [WEATHER, TIME]}
    assert "[lazy]" in auto.constraint().source and '"<tool_call>"' in auto.constraint().source
    required = tools.ToolPlan.make([WEATHER, TIME], "required", parallel=False)
    assert "[lazy]" not in required.constraint().source
    named = tools.ToolPlan.make([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert [f.name for f in named.callable] == ["get_time"] and "get_weather" not in named.constraint().source
    none = tools.ToolPlan.make([WEATHER], "none")
    assert not none.active and none.constraint() is None and none.template_vars() == {}
    assert [s.field for s in auto.parameter_specs()] == ["tools[0].function.parameters",
                                                         "tools[1].function.parameters"]


def _accepts(session, spec, text: str) -> bool:
    ids = list(session.encode(text))
    return session.compile(spec).allows(ids) == len(ids)


def test_grammars_force_calls_with_valid_arguments_and_auto_starts_at_the_tag():
    from tests.helpers import open_session

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    bad_args = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'
    with open_session("reference", "off") as s:
        required = tools.ToolPlan.make([WEATHER, TIME], "required").constraint()
        assert _accepts(s, required, call) and _accepts(s, required, call + "\n" + call)
        assert not _accepts(s, required, "Sure, " + call) and not _accepts(s, required, bad_args)
        single = tools.ToolPlan.make([WEATHER, TIME], "required", parallel=False).constraint()
        assert not _accepts(s, single, call + "\n" + call)
        named = tools.ToolPlan.make([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
        assert not _accepts(s, named.constraint(), call)
        auto = tools.ToolPlan.make([WEATHER], "auto").constraint()
        assert _accepts(s, auto, "No call needed: <tool_ and < are fine.")
        assert _accepts(s, auto, "Checking. " + call)
        assert not _accepts(s, auto, "Checking. " + bad_args)  # constrained from the opening tag on
        assert not _accepts(s, auto, call + " then <tool_call>\nfree text")  # every call is one
        assert not _accepts(s, auto, call + "\nDone.")  # after the calls: the end of the answer
        single = tools.ToolPlan.make([WEATHER], "auto", parallel=False).constraint()
        assert _accepts(s, single, "Checking. " + call) and not _accepts(s, single, call + "\n" + call)


def test_the_template_renders_tools_calls_and_results():
    source = HERMES_TEMPLATE.read_text()
    assert tools.template_renders_tools(source) and tools.detect_format(source) is tools.HERMES
    assert not tools.template_renders_tools("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert tools.detect_format("{{ messages }}") is None
    template = ChatTemplate(source=source)
    calls = tools.template_tool_calls([{"id": "c1", "type": "function",
                                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "-3 C", "tool_call_id": "c1", "name": "get_weather"}]
    text = template.render(messages, tools=tools.template_tools([tools.Function.from_openai(WEATHER)]))
    assert json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n-3 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("arguments", ['{"city": "Oslo', "{oops", "[1, 2]", "7", ""])
def test_a_past_call_whose_arguments_are_no_json_object_goes_back_as_written(arguments):
    """OpenAI's ``arguments`` is an opaque string: a call cut off by ``max_tokens`` comes back as the
    client got it (issue 45, point 1: the openai-agents SDK resends it; it was a 400). The template gets
    the string, and Hermes' writes it verbatim, so the model reads its own words."""
    calls = tools.template_tool_calls([
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}])
    assert calls[0]["function"]["arguments"] == {"city": "Paris"} and calls[1]["function"]["arguments"] == arguments
    messages = [{"role": "user", "content": "Weather in Paris and Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "-3 C", "tool_call_id": "c2", "name": "get_weather"}]
    text = ChatTemplate(source=HERMES_TEMPLATE.read_text()).render(messages)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' in text
    with pytest.raises(ConstraintError, match=r"tool_calls\[0\]"):
        tools.template_tool_calls(["not a call"])  # type: ignore[list-item]


def test_library_forced_call_matches_the_schema_on_the_reference_model():
    from tests.helpers import open_session

    enum_tool = {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}}}
    plan = tools.ToolPlan.make([enum_tool], "required", parallel=False)
    with open_session("reference", "ref-draft") as s:
        out = s.generate("call it", constraint=plan.constraint(), max_tokens=120)
        # (the byte tokenizer spells its end-of-text id; a GGUF's renders nothing for it)
        message = plan.parse(s.opened.tokenizer.decode([t for t in out.tokens if t not in s.stop_ids]))
    assert out.receipt.finish_reason == "stop", out.text
    assert [c.name for c in message.tool_calls] == ["set_unit"] and message.content is None
    jsonschema.validate(json.loads(message.tool_calls[0].arguments), enum_tool["function"]["parameters"])


def test_session_chat_renders_tools_and_forces_the_call():
    """``Session.chat(..., tools=plan)``: the tools reach the template, the choice constrains the answer,
    and a named choice's call validates against its schema (speculative equals target-only)."""
    from tests.helpers import open_session

    template = (Path(__file__).resolve().parent.parent / "docs" / "examples" / "hermes-tools.jinja").read_text()
    tool = {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}}}
    plan = tools.ToolPlan.make([tool], {"type": "function", "function": {"name": "set_unit"}})
    messages = [{"role": "user", "content": "use celsius"}]
    outs = {}
    for mode in ("off", "ref-draft"):
        with open_session("reference", mode, max_tokens=120, n_ctx=2048) as s:
            outs[mode] = s.chat(messages, chat_template=template, tools=plan)
            rendered = s.opened.tokenizer.decode(s.chat_prompt(messages, chat_template=template,
                                                               **plan.template_vars()))
    assert "set_unit" in rendered  # the template saw the tools
    assert outs["ref-draft"].tokens == outs["off"].tokens
    message = plan.parse(outs["off"].text)
    assert [c.name for c in message.tool_calls] == ["set_unit"]
    jsonschema.validate(json.loads(message.tool_calls[0].arguments), tool["function"]["parameters"])
    with open_session("reference", n_ctx=2048) as s, pytest.raises(ConstraintError, match="either a constraint"):
        s.chat(messages, chat_template=template, tools=plan, constraint=plan.constraint())


# -- power serve on SmolLM2 -----------------------------------------------------------------------------
def _call(i: int, city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": json.dumps({"city": city})}}]}


#: earlier turns that call the tool, so that the small model calls it again on its own (``auto``)
FEW_SHOT = [{"role": "user", "content": "Weather in London?"}, _call(1, "London"),
            {"role": "user", "content": "Weather in Rome?"}, _call(2, "Rome"),
            {"role": "user", "content": "Weather in Paris?"}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("power_native")
    from tests.native.test_models import _model_path

    model = _model_path("smollm2")
    with served("--model", model, "--mode", "suffix", "--threads", "1", "--parallel", "2", "--audit-rate", "1",
                "--chat-template", str(HERMES_TEMPLATE)) as s:
        yield s


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=smol.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def name(client):
    return client.models.list().data[0].id


def _streamed(client, **kw):
    """Content, calls and finish reason assembled from a stream the way the openai client's helpers do."""
    content, calls, finish, last = "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        last = chunk
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            got = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                got["id"], got["name"] = tc.id, tc.function.name
                assert tc.type == "function"
            got["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, last


def _audited(server, rid: str) -> bool:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = httpx.get(f"{server.url}/v1/receipts/{rid}", timeout=10).json()
        if "audit" in got:
            return bool(got["audit"]["identical"])
        time.sleep(0.2)
    raise AssertionError(f"no audit of {rid}")


@pytest.mark.native
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("choice, messages", [
    ("required", ASK),
    ({"type": "function", "function": {"name": "get_weather"}}, ASK),
    ("auto", FEW_SHOT),
])
def test_tool_calls_round_trip_with_the_official_client(smol, client, name, choice, messages):
    kw = {"model": name, "messages": messages, "tools": [WEATHER, TIME], "tool_choice": choice,
          "parallel_tool_calls": False, "max_tokens": 48}
    got = client.chat.completions.create(**kw)
    msg = got.choices[0].message
    assert got.choices[0].finish_reason == "tool_calls", msg
    assert msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert args["city"] == "Paris"
    assert _audited(smol, got.id)  # its target-only re-decode (the same constraint) is identical
    if choice == "auto":  # drafts copied from the earlier calls, the lazy trigger among them, were accepted
        assert got.model_extra["power"]["accepted"] > 0

    content, calls, finish, last = _streamed(client, **kw)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert last.model_extra["power"]["output_sha256"] == got.model_extra["power"]["output_sha256"]

    # the assistant's call and the tool's result go back through the template
    back = [*messages, msg, {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model=name, messages=back, tools=[WEATHER, TIME], tool_choice="none",
                                            max_tokens=16)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    before = client.chat.completions.create(model=name, messages=messages, tools=[WEATHER, TIME], tool_choice="none",
                                            max_tokens=1)
    assert answer.usage.prompt_tokens > before.usage.prompt_tokens + 10


@pytest.mark.native
@pytest.mark.model
@pytest.mark.slow
def test_auto_streams_text_as_content_and_no_markup_leaks(client, name):
    kw = {"model": name, "messages": [{"role": "user", "content": "Say hello to Ann."}], "tools": [WEATHER],
          "max_tokens": 24}
    got = client.chat.completions.create(**kw)
    msg = got.choices[0].message
    assert msg.content and "<tool_call>" not in msg.content and "</tool_call>" not in msg.content
    content, calls, finish, _ = _streamed(client, **kw)
    assert content == msg.content and finish == got.choices[0].finish_reason
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in msg.tool_calls or []]


@pytest.mark.native
@pytest.mark.model
@pytest.mark.slow
def test_parallel_calls_stream_by_index_with_usage(client, name):
    kw = {"model": name, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 64}
    got = client.chat.completions.create(**kw)
    calls = got.choices[0].message.tool_calls
    assert len(calls) >= 2 and len({c.id for c in calls}) == len(calls)  # one or more, one per line
    for c in calls[:-1]:  # (the last may be cut off by max_tokens)
        jsonschema.validate(json.loads(c.function.arguments), {t["function"]["name"]: t for t in (WEATHER, TIME)}[
            c.function.name]["function"]["parameters"])
    content, streamed, finish, last = _streamed(client, **kw, stream_options={"include_usage": True})
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments) for c in calls]
    assert finish == got.choices[0].finish_reason and content == ""
    assert last.usage.completion_tokens == got.usage.completion_tokens
