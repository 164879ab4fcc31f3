"""A served request does its per-request work once (issue 46): its output constraint is compiled once, when
the request is checked, and its decode uses that one (the audit's re-decode compiles its own, fresh); its
text comes from one assembler on the reader's side (the request's, :meth:`Generation.take_text`); its
latency metrics are taken once, from the driver's clocks, the same way streamed or not. On the
reference backend, in process."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from power_core.constraint import ConstraintSpec, Grammars
from power_core.errors import ConstraintError
from power_core.text import TextAssembler

HERMES = (Path(__file__).resolve().parent.parent / "docs" / "examples" / "hermes-tools.jinja").read_text()
GRAMMAR = 'start: /[0-9]{3}/ "!"'
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    for name in ("f", "g")]


@pytest.fixture
def compiles(monkeypatch):
    """Every constraint :class:`Grammars` compiles, in order."""
    made: list = []
    compile_ = Grammars.compile

    def spy(self, spec):
        made.append(compile_(self, spec))
        return made[-1]

    monkeypatch.setattr(Grammars, "compile", spy)
    return made


def _serve(app, calls, wait_audits: int = 0) -> list:
    """``calls`` (``(path, json)``) posted to ``app`` in process, one after another, with its audit running
    (as the app's lifespan starts it), until ``wait_audits`` audits were checked; the workers end with it."""
    state = app.state.power

    async def go() -> list:
        audits = state.auditor.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                out = [await asyncio.wait_for(client.request("POST", path, json=body), 60) for path, body in calls]
            deadline = time.monotonic() + 60
            while state.metrics.audit_checked._value.get() < wait_audits and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return out
        finally:
            if audits is not None:
                audits.cancel()

    try:
        return asyncio.run(go())
    finally:
        state.executor.shutdown(wait=True)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_served_constraint_is_compiled_once_and_the_audit_compiles_a_fresh_one(compiles, stream):
    from power_core.serve import ServeOptions, create_app
    from tests.helpers import open_session

    with open_session("reference", "ref-draft", n_ctx=256) as s:
        app = create_app(s.driver(), ServeOptions(model_name="m", audit_rate=1.0))
        state = app.state.power
        body = {"model": "m", "prompt": "n", "max_tokens": 12, "grammar": GRAMMAR, "stream": stream}
        (r,) = _serve(app, [("/v1/completions", body)], wait_audits=1)
        assert r.status_code == 200
        if stream:
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]
            rid = json.loads(events[0])["id"]
            text = "".join(json.loads(e)["choices"][0]["text"] for e in events if json.loads(e)["choices"])
        else:
            rid, text = r.json()["id"], r.json()["choices"][0]["text"]
        assert text[:3].isdigit() and text[3] == "!"
        envelope = state.receipts.get(rid)
    # one compile for the request (checked before admission, decoded with), one fresh for its audit
    assert len(compiles) == 2 and compiles[0] is not compiles[1]
    assert compiles[0].consumed > 0 and compiles[1].consumed == compiles[0].consumed
    assert envelope["audit"]["identical"] is True
    assert envelope["receipt"].constraint["kind"] == "grammar"


def test_tool_schemas_are_compiled_to_check_them_and_the_output_constraint_once(compiles):
    from power_core.serve import ServeOptions, create_app
    from tests.helpers import open_session

    with open_session("reference", "ref-draft", n_ctx=2048) as s:
        app = create_app(s.driver(), ServeOptions(model_name="m", chat_template=HERMES))
        body = {"model": "m", "messages": [{"role": "user", "content": "call f"}], "max_tokens": 40, "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "f"}}}
        (r,) = _serve(app, [("/v1/chat/completions", body)])
    assert r.status_code == 200, r.text
    assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == ["f"]
    # each tool's parameters alone (so that an error names its tool), then the call constraint, once
    assert [c.spec.field for c in compiles] == ["tools[0].function.parameters", "tools[1].function.parameters",
                                                compiles[2].spec.field] and len(compiles) == 3
    assert compiles[2].consumed > 0 and compiles[0].consumed == compiles[1].consumed == 0


def test_session_start_takes_a_fresh_compiled_constraint_and_refuses_a_used_one():
    from tests.helpers import open_session

    with open_session("reference", "ref-draft", n_ctx=256) as s:
        spec = ConstraintSpec.grammar(GRAMMAR)
        by_spec = s.start([1, 2, 3], max_tokens=12, constraint=spec).run()
        compiled = s.compile(spec)
        gen = s.start([1, 2, 3], max_tokens=12, constraint=compiled)
        assert gen.constraint is compiled  # used as it is, not compiled again
        assert gen.run().tokens == by_spec.tokens
        with pytest.raises(ConstraintError, match="fresh one"):
            s.start([1, 2, 3], max_tokens=12, constraint=compiled)


@pytest.mark.parametrize("shared", [False, True], ids=["solo", "shared"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_served_request_has_one_text_assembler_and_latency_from_the_driver(monkeypatch, stream, shared):
    """Streamed, the chunks come from the request's own assembler (with the transaction's stop check, two
    in all, where there were three); whole, one. Either way, the time to the first token is the driver's
    stamp and each later token's latency its round's own seconds (one observation per emitted token), on
    a sequence that decodes alone and on shared passes alike."""
    from power_core.config import PowerConfig
    from power_core.serve import ServeOptions, create_app
    from power_core.session import Session
    from tests.helpers import core_plugins, open_session

    made: list[TextAssembler] = []
    init = TextAssembler.__init__

    def spy(self, *a, **kw):
        made.append(self)
        init(self, *a, **kw)

    monkeypatch.setattr(TextAssembler, "__init__", spy)
    engine = Session.open_engine(2, PowerConfig(spec_mode="ref-draft", n_ctx=256), model="reference",
                                 plugins=core_plugins()) if shared else open_session("reference", "ref-draft").driver()
    try:
        reference = engine.sessions[0].generate("hello there, world", max_tokens=24)
        stop = reference.text[5:7]
        made.clear()
        app = create_app(engine, ServeOptions(model_name="m"))
        (got,) = _serve(app, [("/v1/completions", {"model": "m", "prompt": "hello there, world", "max_tokens": 24,
                                                   "stop": [stop], "stream": stream})])
        state = app.state.power
    finally:
        engine.close()
    assert got.status_code == 200, got.text
    if stream:
        events = [json.loads(line[6:]) for line in got.text.splitlines() if line.startswith("data: {")]
        text = "".join(c["text"] for e in events for c in e["choices"])
        rid = events[-1]["id"]
    else:
        text, rid = got.json()["choices"][0]["text"], got.json()["id"]
    assert text == reference.text[:reference.text.index(stop)]
    assert len(made) == 2  # the request's, and the transaction's stop check (driver side)
    rounds = state.receipts.get(rid)["receipt"].rounds
    metrics = state.metrics
    assert metrics.ttft._sum.get() > 0 and _count(metrics.ttft) == 1
    later = [r for r in rounds[1:] if r["emitted"]]
    assert _count(metrics.itl) == sum(r["emitted"] for r in later)
    assert metrics.itl._sum.get() == pytest.approx(sum(r["seconds"] for r in later), rel=1e-9, abs=1e-12)


def _count(histogram) -> int:
    return int(next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_count")))
