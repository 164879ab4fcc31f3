"""``power serve`` where OpenAI's clients rely on OpenAI's behaviour (issue 45, points 1-3), in process on
the reference backend: a past tool call whose ``arguments`` is no JSON object goes back through the
template; every request field has one rule (honoured, neutral, no-op or refused) from one table, which
``docs/serving.md`` lists (``tests/test_docs.py``); an unset ``max_tokens`` is the rest of the context,
capped only by the operator's ``--max-tokens``."""

from __future__ import annotations

import argparse
import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from power_core.serve import ServeOptions, create_app, protocol
from tests.helpers import open_session
from tests.serve_helpers import asgi

ROOT = Path(__file__).resolve().parents[1]
HERMES = (ROOT / "docs" / "examples" / "hermes-tools.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}


@contextlib.contextmanager
def _served(n_ctx: int = 256, **options: Any) -> Iterator[tuple[Any, Any]]:
    """An app over one reference session (a byte tokenizer, the Hermes tools template)."""
    with open_session("reference", "ref-draft", n_ctx=n_ctx) as s:
        app = create_app(s.driver(), ServeOptions(model_name="m", chat_template=HERMES, **options))
        try:
            yield app, s
        finally:
            app.state.power.executor.shutdown(wait=True)


def _post(app: Any, *calls: tuple[str, dict[str, Any]]) -> list[httpx.Response]:
    """POST each ``(path, body)`` to ``app`` in process, one after another, each within 60 s."""
    return asgi(app, *(("POST", path, body) for path, body in calls), timeout=60)


# -- 1. a tool call's arguments is an opaque string ------------------------------------------------------
def test_a_cut_off_tool_call_sent_back_is_taken_and_rendered_as_written():
    """The openai-agents SDK got ``finish_reason: length`` with a call cut off (``{"city": "Oslo``) and
    sent the history back unchanged: OpenAI takes it; power serve answered 400 ``not JSON``."""
    cut = '{"city": "Oslo'
    messages = [{"role": "user", "content": "Weather in Paris and Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": cut}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "error: the call was cut off"}]
    with _served(n_ctx=2048) as (app, s):
        got, stream = _post(app, ("/v1/chat/completions", {"model": "m", "messages": messages, "tools": [WEATHER],
                                                          "max_tokens": 4}),
                            ("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 4,
                                                      "stream": True}))
        # the template saw the object, and the cut-off string as the client sent it
        seen = [dict(messages[0]), {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": cut}}]},
            {**messages[2], "name": "get_weather"}, {**messages[3], "name": "get_weather"}]
        tools = [{"type": "function", "function": {"name": "get_weather",
                                                   "parameters": WEATHER["function"]["parameters"]}}]
        prompt = s.chat_prompt(seen, chat_template=HERMES, tools=tools)
    assert got.status_code == 200, got.text
    assert stream.status_code == 200 and "data: [DONE]" in stream.text, stream.text
    assert got.json()["usage"]["prompt_tokens"] == len(prompt)
    assert f'"arguments": {cut}}}\n</tool_call>' in s.opened.tokenizer.decode(prompt)


# -- 2. every field has a rule ----------------------------------------------------------------------------
NO_OPS = {"store": False, "metadata": {"run": "bfcl-7"}, "service_tier": "auto", "prompt_cache_key": "agent-1",
          "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "prompt_cache_retention": "24h",
          "safety_identifier": "u-42"}


def test_fields_that_cannot_change_the_output_are_taken_and_change_nothing():
    """BFCL's own OpenAI handler sends ``"store": false``: it was ``400 unsupported field 'store'``."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}
    text = {"model": "m", "prompt": "hello", "max_tokens": 12}
    with _served() as (app, _):
        plain_chat, plain_text, chat_noop, text_noop, one = _post(
            app, ("/v1/chat/completions", chat), ("/v1/completions", text),
            ("/v1/chat/completions", {**chat, **NO_OPS, "store": True, "modalities": ["text"]}),
            ("/v1/completions", {**text, **NO_OPS}),
            ("/v1/chat/completions", {**chat, "store": False}))
    for plain, noop in ((plain_chat, chat_noop), (plain_text, text_noop), (plain_chat, one)):
        assert noop.status_code == 200, noop.text
        assert noop.json()["power"]["output_sha256"] == plain.json()["power"]["output_sha256"]
        assert noop.json()["choices"] == plain.json()["choices"]
    assert set(NO_OPS) == {f.name for f in protocol.FIELDS if f.rule == "no-op"}  # every no-op was sent


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", "auto"),
    ("moderation", {"model": "omni-moderation-latest"}),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("web_search_options", {}),
])
def test_fields_that_would_change_the_output_are_refused_saying_why(field, value):
    rule = next(f for f in protocol.FIELDS if f.name == field)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value}
    with _served() as (app, _):
        (r,) = _post(app, ("/v1/chat/completions", body))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field and err["code"] == "unsupported_field", r.text
    assert rule.note in err["message"] and set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("field, value, param", [
    ("store", "no", "store"),
    ("metadata", {"k": 1}, "metadata"),
    ("service_tier", 3, "service_tier"),
    ("prediction", {"type": "content"}, "prediction.content"),
    ("modalities", ["text", "audio"], "modalities[1]"),
    ("mystery", 1, "mystery"),  # in no row: named, never ignored
])
def test_a_bad_value_of_a_no_op_or_neutral_field_is_a_400_naming_it(field, value, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, field: value}
    with _served() as (app, _):
        (r,) = _post(app, ("/v1/chat/completions", body))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def _client_fields(create: Any) -> set[str]:
    return {p for p in inspect.signature(create).parameters
            if p not in ("self", "extra_headers", "extra_query", "extra_body", "timeout")}


def test_one_table_rules_every_field_the_models_and_the_openai_client_know():
    """The table is the one list: its honoured and neutral rows are the request models' fields, each
    endpoint's; every field the installed ``openai`` client can send has a row; no field has two."""
    openai = pytest.importorskip("openai")
    names = [f.name for f in protocol.FIELDS]
    assert len(names) == len(set(names))
    for model in (protocol.ChatRequest, protocol.CompletionRequest):
        declared = {info.alias or name for name, info in model.model_fields.items()}
        ruled = {f.name for f in protocol.FIELDS
                 if f.rule in ("honoured", "neutral") and model.endpoint in f.endpoints}
        assert declared == ruled, model.__name__
    assert all(f.note and (f.accepts is not None) == (f.rule == "no-op") for f in protocol.FIELDS)
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
    sent = _client_fields(client.chat.completions.create) | _client_fields(client.completions.create)
    assert sent <= set(names), sorted(sent - set(names))


# -- 3. an unset max_tokens is the rest of the context ----------------------------------------------------
def _no_end(session: Any) -> dict[str, float]:
    """A logit bias that keeps the reference model from ending its answer."""
    return {str(t): -100.0 for t in session.stop_ids}


def test_an_unset_max_tokens_is_the_rest_of_the_context():
    """instructor, the agents SDK and langchain send no ``max_tokens``: they were cut at the server's
    default (128); OpenAI and llama-server (``n_predict = -1``) write up to the context."""
    with _served(n_ctx=256) as (app, s):
        bias = _no_end(s)
        text, chat, capped = _post(
            app, ("/v1/completions", {"model": "m", "prompt": "hello", "logit_bias": bias}),
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "logit_bias": bias}),
            ("/v1/completions", {"model": "m", "prompt": "hello", "logit_bias": bias, "max_tokens": 1000}))
    for r in (text, chat, capped):
        usage = r.json()["usage"]
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 256 and usage["completion_tokens"] > 128


def test_the_operators_max_tokens_caps_every_answer():
    with _served(n_ctx=256, max_tokens=10) as (app, s):
        bias = _no_end(s)
        unset, above, below, chat = _post(
            app, ("/v1/completions", {"model": "m", "prompt": "hello", "logit_bias": bias}),
            ("/v1/completions", {"model": "m", "prompt": "hello", "logit_bias": bias, "max_tokens": 50}),
            ("/v1/completions", {"model": "m", "prompt": "hello", "logit_bias": bias, "max_tokens": 4}),
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "logit_bias": bias, "max_completion_tokens": 500}))
    assert [r.json()["usage"]["completion_tokens"] for r in (unset, above, below, chat)] == [10, 10, 4, 10]
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in (unset, above, below, chat))
    with pytest.raises(ValueError):
        ServeOptions(model_name="m", max_tokens=0)


def test_serve_max_tokens_is_the_flag_or_the_config_files_key(tmp_path):
    from power_core.commands import _serve_max_tokens

    def args(max_tokens: int | None = None, config: str | None = None) -> argparse.Namespace:
        return argparse.Namespace(max_tokens=max_tokens, config=config)

    plain = tmp_path / "plain.toml"
    plain.write_text("temperature = 0.5\n")
    capped = tmp_path / "capped.toml"
    capped.write_text("[power]\nmax_tokens = 64\n")
    assert _serve_max_tokens(args(), 128) is None  # the library's default is no cap
    assert _serve_max_tokens(args(config=str(plain)), 128) is None
    assert _serve_max_tokens(args(32), 32) == 32
    assert _serve_max_tokens(args(config=str(capped)), 64) == 64
