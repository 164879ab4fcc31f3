"""A tool-call marker that is a control token of a real GGUF vocabulary (issue 45, item 2), through
power-native's own vocabulary (control pieces ``0xff``-prefixed) and detokenizer (control tokens
rendered empty): Gemma-3's ``<start_of_turn>`` as the marker of a format. The constrained call emits
that one token, the request's text shows it, whole and streamed, and the parser reads the call; the
tokenizer alone would have dropped it. (The tiny test models have no Mistral-style marker; the format
is made up, the vocabulary and detokenizer are the real ones.)"""

from __future__ import annotations

import json

from test_models import _model_path

from power_core import PowerConfig, Session, tools
from power_core.tool_formats import ToolFormat

UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}
FORMAT = ToolFormat("start-of-turn-json", '<start_of_turn>{"name": "⟨name⟩", "arguments": ⟨args⟩}',
                    keys=("name", "arguments"), parallel=False)


def test_gemma3s_control_token_marker_is_emitted_shown_and_parsed():
    plan = tools.ToolPlan.make([UNIT], "required", format=FORMAT, parallel=False)
    spec = plan.constraint()
    assert spec is not None
    config = PowerConfig(spec_mode="off", max_tokens=40, n_ctx=512, n_threads=1)
    with Session.open(config, model=_model_path("gemma3-270m")) as s:
        marker = s.compile(spec).preserved
        [(text, tok)] = marker.tokens
        assert text == "<start_of_turn>"
        result = s.generate("Use celsius.", constraint=spec)
        streamed = list(s.start("Use celsius.", constraint=spec).stream())
        alone = s.opened.tokenizer.decode(result.tokens)  # type: ignore[union-attr]
    assert result.receipt.finish_reason == "stop", result.text
    assert result.tokens[0] == tok and result.tokens.count(tok) == 1
    assert result.text is not None and result.text.startswith("<start_of_turn>{")
    assert "".join(streamed) == result.text
    message = plan.parse(result.text)
    assert [c.name for c in message.tool_calls] == ["set_unit"] and message.content is None
    assert json.loads(message.tool_calls[0].arguments) in ({"unit": "c"}, {"unit": "f"})
    assert "<start_of_turn>" not in alone and not plan.parse(alone).tool_calls
