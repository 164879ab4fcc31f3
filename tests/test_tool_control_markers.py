"""Tool-call markers that are control tokens of the model's vocabulary (issue 45, item 2): Mistral's
``[TOOL_CALLS]`` / ``[ARGS]`` / ``[CALL_ID]``, Kimi K2's section tokens, ``<|python_tag|>``. llama.cpp's
``preserved_tokens``: the call grammar takes such a marker as its one token (never a spelling of its
text), and the output's text shows it (the tokenizer's own decode leaves control tokens out), so the
tool parser finds the calls, whole and streamed. A vocabulary where the markers are text (the byte
vocabulary of the reference model, SmolLM2's) gets the same grammar as before.

The model: the reference backend's weights with a stand-in tokenizer (bytes, the end of text, then
control tokens), as power-native reads a GGUF: each control token's piece ``0xff``-prefixed, and a
decode that renders control tokens empty."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import pytest

from power_core import tools
from power_core.config import PowerConfig
from power_core.constraint import NO_PRESERVED, ConstraintSpec, Grammars, PreservedTokens, Vocabulary
from power_core.reference import plugin as reference
from power_core.runtime import TokenArray
from power_core.session import Session
from power_core.spec import Backend, OpenedModel, OpenRequest, Strategy, hookimpl
from power_core.text import TextAssembler
from power_core.tool_formats import ToolFormat, format_named
from tests.helpers import core_plugins

EOS = 256
CONTROL = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<|tool_calls_section_begin|>",
           "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>",
           "[INST]", "[/INST]")
ID = {text: EOS + 1 + i for i, text in enumerate(CONTROL)}
N_VOCAB = 288  # the reference model's

UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
#: a format whose call starts with Llama 3's ``<|python_tag|>`` (any format's markers are looked up)
PYTHON_TAG = ToolFormat("python-tag-json", '<|python_tag|>{"name": "⟨name⟩", "parameters": ⟨args⟩}',
                        keys=("name", "parameters"), parallel=False)


def control_vocabulary() -> Vocabulary:
    pieces = [bytes([i]) for i in range(256)] + [b"\xff<|endoftext|>"]
    pieces += [b"\xff" + text.encode() for text in CONTROL]
    pieces += [b"\xff<|%d|>" % i for i in range(len(pieces), N_VOCAB)]
    return Vocabulary(tuple(pieces), (EOS,), lambda text: list(text))


class ControlTokenizer:
    """UTF-8 bytes as ids 0..255; every other id a control token, which the decode leaves out (as
    llama.cpp's detokenizer does without ``special``)."""

    def encode(self, text: str) -> TokenArray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, tokens: TokenArray) -> str:
        return bytes(t for t in np.asarray(tokens).tolist() if t < 256).decode("utf-8", errors="replace")


class ControlVocabBackend:
    """``control-vocab``: the reference model with :class:`ControlTokenizer`, and ``ctl-draft``, the
    reference's own draft on it (``draft="reference:accept=P"`` corrupts proposals)."""

    @hookimpl
    def power_register_backends(self, register: Callable[[Backend], None]) -> None:
        def open_(req: OpenRequest) -> OpenedModel:
            return attrs.evolve(reference.open_reference(req), tokenizer=ControlTokenizer(),
                                grammars=Grammars(control_vocabulary))

        register(Backend(name="control-vocab", version="0", package="tests", open=open_, accepts=lambda m: False))

    @hookimpl
    def power_register_strategies(self, register: Callable[[Strategy], None]) -> None:
        register(Strategy(name="ctl-draft", version="0", package="tests", kind="model-backed",
                          proposer=reference.make_ref_draft, backends=frozenset({"control-vocab"})))


def control_session(mode: str = "off", draft: str | None = None) -> Session:
    return Session.open(PowerConfig(spec_mode=mode, n_ctx=1024), model=reference.DEFAULT_SPEC, draft=draft,
                        backend="control-vocab", plugins=core_plugins(ControlVocabBackend()))


def spec(plan: tools.ToolPlan) -> ConstraintSpec:
    """The plan's constraint (it has one: its choice is not ``none``)."""
    found = plan.constraint()
    assert found is not None
    return found


def toks(*parts: str | int) -> list[int]:
    """Text as byte ids, an int as that token."""
    out: list[int] = []
    for p in parts:
        out += [p] if isinstance(p, int) else list(p.encode())
    return out


def _assemble(deltas: Sequence[tools.ParsedDelta]) -> tuple[str, list[tuple[str, str]]]:
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.tool_calls:
            got = calls.setdefault(c.index, ["", ""])
            if c.name is not None:
                got[0] = c.name
            got[1] += c.arguments
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))]


# -- which markers are preserved ------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "expected"), [
    ("mistral-v11", {"[TOOL_CALLS]", "[ARGS]"}),
    ("mistral-v11-call-id", {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"}),
    ("mistral-nemo", {"[TOOL_CALLS]"}),
    ("kimi-k2", {"<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                 "<|tool_call_end|>", "<|tool_calls_section_end|>"}),
    ("hermes", set()),
    ("llama3-json", set()),
])
def test_the_markers_that_are_one_control_token_are_preserved(name, expected):
    grammars = Grammars(control_vocabulary)
    preserved = grammars.preserved(format_named(name).markup)
    assert {text for text, _ in preserved.tokens} == expected
    assert all(ID[text] == tok for text, tok in preserved.tokens)
    assert grammars.preserved(PYTHON_TAG.markup).tokens == (("<|python_tag|>", ID["<|python_tag|>"]),)
    # an end of generation is never preserved: it ends the answer and stays out of its text
    assert not Grammars(control_vocabulary).preserved(("<|endoftext|>",))


def test_text_markers_change_nothing():
    """The reference model's byte vocabulary (and SmolLM2's) spells every marker: nothing is preserved,
    the grammar is the spec's own text, and the spelled call is what it takes."""
    grammars = Grammars(lambda: reference.byte_vocabulary(N_VOCAB, EOS))
    fmt = format_named("mistral-v11")
    assert grammars.preserved(fmt.markup) is not None and not grammars.preserved(fmt.markup)
    plan = tools.ToolPlan.make([UNIT], "required", format=fmt, parallel=False)
    text = spec(plan).source
    assert text == fmt.grammar(plan.callable, lazy=False, parallel=False) and '"[TOOL_CALLS]"' in text
    c = grammars.compile(spec(plan))
    assert c.preserved == NO_PRESERVED
    spelled = toks('[TOOL_CALLS]set_unit[ARGS]{"unit": "c"}')
    assert c.allows(spelled) == len(spelled)
    tok = ControlTokenizer()
    assert NO_PRESERVED.decoder(tok.decode) == tok.decode  # the tokenizer's own


# -- the grammar takes the token -------------------------------------------------------------------------------
CALLS = {
    "mistral-v11": (toks(ID["[TOOL_CALLS]"], "get_weather", ID["[ARGS]"], '{"city": "Oslo"}'),
                    '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
    "mistral-v11-call-id": (toks(ID["[TOOL_CALLS]"], "get_weather", ID["[CALL_ID]"], "a1b2c3d4e",
                                 ID["[ARGS]"], '{"city": "Oslo"}'),
                            '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Oslo"}'),
    "mistral-nemo": (toks(ID["[TOOL_CALLS]"], '[{"name": "get_weather", "arguments": {"city": "Oslo"}, '
                          '"id": "a1b2c3d4e"}]'),
                     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}]'),
    "kimi-k2": (toks(ID["<|tool_calls_section_begin|>"], ID["<|tool_call_begin|>"], "functions.get_weather:0",
                     ID["<|tool_call_argument_begin|>"], '{"city": "Oslo"}', ID["<|tool_call_end|>"],
                     ID["<|tool_calls_section_end|>"]),
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'),
}


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_the_grammar_takes_the_control_token_not_its_spelling(name, choice):
    grammars = Grammars(control_vocabulary)
    fmt = format_named(name)
    call, spelled = CALLS[name]
    lead = toks("Checking. ") if choice == "auto" else []
    c = grammars.compile(spec(tools.ToolPlan.make([WEATHER], choice, format=fmt, parallel=False)))
    assert c.preserved
    assert c.allows(lead + call + [EOS]) == len(lead + call) + 1
    spelled_ids = lead + toks(spelled)
    assert c.allows(spelled_ids) < len(spelled_ids)  # off the model's training: refused
    # the parser reads the call from the text the output shows
    message = tools.parse(fmt, "Checking. " + spelled if choice == "auto" else spelled)
    assert [(t.name, json.loads(t.arguments)) for t in message.tool_calls] == [("get_weather", {"city": "Oslo"})]
    if choice == "auto":  # free text without the trigger, and no spelled trigger in it
        assert c.allows(toks("No call needed.", EOS)) == len(toks("No call needed.")) + 1
        text = toks("No call, but " + spelled)
        assert c.allows(text) < len(text)


def test_an_object_of_the_arguments_after_a_control_token_holds_no_key_twice():
    """The watcher of repeated keys reads a preserved ``[ARGS]`` as its text (its JSON starts there)."""
    fmt = format_named("mistral-v11")
    any_args = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    c = Grammars(control_vocabulary).compile(spec(tools.ToolPlan.make([any_args], "required", format=fmt)))
    ok = toks(ID["[TOOL_CALLS]"], "f", ID["[ARGS]"], '{"a": 1, "b": 2}')
    twice = toks(ID["[TOOL_CALLS]"], "f", ID["[ARGS]"], '{"a": 1, "a": 2}')
    assert c.allows(ok) == len(ok)
    # refused at the quote that completes the second "a"
    assert c.allows(twice) == len(toks(ID["[TOOL_CALLS]"], "f", ID["[ARGS]"], '{"a": 1, "a'))


def test_a_marker_that_closes_free_text_is_the_token_there_too():
    """An XML format's parameter text ends at its closing markup: where that is a control token, the
    text runs up to the token (and may not spell it)."""
    fmt = ToolFormat("ctl-xml", "[TOOL_CALLS]⟨name⟩⟨params⟩[/INST]", param="[ARGS]⟨key⟩=⟨value⟩[INST]")
    grammars = Grammars(control_vocabulary)
    c = grammars.compile(spec(tools.ToolPlan.make([WEATHER], "required", format=fmt, parallel=False)))
    call = toks(ID["[TOOL_CALLS]"], "get_weather", ID["[ARGS]"], "city=Oslo", ID["[INST]"], ID["[/INST]"], EOS)
    assert c.allows(call) == len(call)
    spelled = toks(ID["[TOOL_CALLS]"], "get_weather", ID["[ARGS]"], "city=Os[INST]")
    assert c.allows(spelled) < len(spelled)
    assert tools.parse(fmt, "[TOOL_CALLS]get_weather[ARGS]city=Oslo[INST][/INST]").tool_calls[0].arguments \
        == '{"city": "Oslo"}'


# -- the text shows the token ------------------------------------------------------------------------------------
def test_the_text_shows_preserved_tokens_and_hides_the_other_control_tokens():
    preserved = Grammars(control_vocabulary).preserved(format_named("mistral-v11").markup)
    decode = preserved.decoder(ControlTokenizer().decode)
    ids = toks("ok ", ID["[TOOL_CALLS]"], "f", ID["[ARGS]"], "{}", ID["[INST]"], EOS)
    assert ControlTokenizer().decode(np.asarray(ids)) == "ok f{}"  # the tokenizer alone: markers gone
    assert decode(np.asarray(ids)) == "ok [TOOL_CALLS]f[ARGS]{}"
    # streamed one token at a time, with a character split across tokens
    stream = TextAssembler(decode)
    ids = toks("é", ID["[TOOL_CALLS]"], "f", ID["[ARGS]"], "{}")
    out = []
    for n in range(1, len(ids) + 1):
        stream.sync(ids[:n])
        out.append(stream.take(final=n == len(ids)))
    assert "".join(out) == "é[TOOL_CALLS]f[ARGS]{}"
    assert PreservedTokens((("[ARGS]", 5),)).split("a[ARGS]b") == ["a", 5, "b"]


# -- a request, end to end ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "markers"), [("mistral-v11", ("[TOOL_CALLS]", "[ARGS]")),
                                               ("mistral-v11-call-id", ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]")),
                                               ("mistral-nemo", ("[TOOL_CALLS]",))])
def test_a_constrained_call_emits_the_control_tokens_and_parses_whole_and_streamed(name, markers):
    fmt = format_named(name)
    plan = tools.ToolPlan.make([UNIT], {"type": "function", "function": {"name": "set_unit"}}, format=fmt)
    outs = {}
    for mode, draft in (("off", None), ("ctl-draft", "reference:accept=0.5")):
        with control_session(mode, draft) as s:
            result = s.generate("[INST]use celsius[/INST]", constraint=plan.constraint(), max_tokens=80)
            gen = s.start("[INST]use celsius[/INST]", constraint=plan.constraint(), max_tokens=80)
            deltas = list(gen.stream())
            outs[mode] = (result, deltas, gen.tokens)
    result, deltas, streamed_tokens = outs["off"]
    assert result.receipt.finish_reason == "stop", result.text
    for marker in markers:  # the marker is its one token, never spelled
        assert result.tokens.count(ID[marker]) == 1
    assert marker.encode() not in bytes(t for t in result.tokens if t < 256)
    assert result.text is not None and result.text.startswith("[TOOL_CALLS]")
    message = plan.parse(result.text)
    assert message.content is None and [c.name for c in message.tool_calls] == ["set_unit"]
    assert json.loads(message.tool_calls[0].arguments) in ({"unit": "c"}, {"unit": "f"})
    # streamed: the same text, and the parser fed its deltas gives the same call
    assert "".join(deltas) == result.text and streamed_tokens == result.tokens
    parser = plan.parser()
    pieces = [parser.feed(d) for d in deltas] + [parser.finish()]
    content, calls = _assemble(pieces)
    assert content == "" and calls == [("set_unit", message.tool_calls[0].arguments)]
    # the tokenizer alone would have lost the markers, and the parser the call
    assert not plan.parse(ControlTokenizer().decode(np.asarray(result.tokens))).tool_calls
    # speculative (noisy proposals, the control tokens among them) equals target-only
    assert outs["ctl-draft"][0].tokens == result.tokens and outs["ctl-draft"][0].text == result.text


MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{%- endif %}"
    "{%- endfor %}")


def test_power_serve_returns_the_call_whole_and_streamed():
    """The server path (jobs' streamed text, the app's parser): a Mistral template's format, a named
    call, ``tool_calls`` in the message and in the streamed deltas, the markup in neither's content."""
    pytest.importorskip("starlette")
    from power_core.serve import ServeOptions, create_app
    from tests.serve_helpers import asgi

    assert tools.detect_format(MISTRAL_TEMPLATE) is format_named("mistral-v11")
    body = {"model": "m", "messages": [{"role": "user", "content": "use celsius"}], "tools": [UNIT],
            "tool_choice": {"type": "function", "function": {"name": "set_unit"}}, "max_tokens": 80}
    with control_session() as s:
        app = create_app(s.driver(), ServeOptions(model_name="m", chat_template=MISTRAL_TEMPLATE))
        whole, streamed = asgi(app, ("POST", "/v1/chat/completions", {**body, "logprobs": True}),
                               ("POST", "/v1/chat/completions", {**body, "stream": True}))
        app.state.power.executor.shutdown(wait=True)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "set_unit"
    assert json.loads(call["function"]["arguments"]) in ({"unit": "c"}, {"unit": "f"})
    # one logprob per token (the end of text's included): each marker is one token (spelled, the call
    # would be 16 tokens longer)
    assert len(choice["logprobs"]["content"]) == len(toks(ID["[TOOL_CALLS]"], "set_unit", ID["[ARGS]"],
                                                          call["function"]["arguments"], EOS))
    # and each marker's logprob entry shows its text, as the output does
    shown = [e["token"] for e in choice["logprobs"]["content"]]
    assert shown[0] == "[TOOL_CALLS]" and "[ARGS]" in shown
    assert streamed.status_code == 200, streamed.text
    events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert not "".join(d.get("content") or "" for d in deltas)
    pieces = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in pieces if "id" in c] == ["set_unit"]
    assert "".join(c["function"]["arguments"] for c in pieces) == call["function"]["arguments"]
