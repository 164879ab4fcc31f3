"""The lean request path (issue 46): on shared passes no thread waits for a request. The driver hands each
commit straight to the event loop (:meth:`Engine.feed`), which streams its text; a worker only begins the
request (its ``power_request_start`` observers) and makes its receipt at the end, once each. On the
reference backend, in process."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from power_core.config import PowerConfig
from power_core.engine import Engine
from power_core.errors import ConfigError
from power_core.passes import Commit, Ended
from power_core.serve import ServeOptions, create_app
from power_core.session import Generation, Session
from tests.helpers import core_plugins, open_session

BODY = {"model": "m", "prompt": "hello there, world", "max_tokens": 24}


def _shared(n: int = 2, mode: str = "ref-draft") -> Engine[Session]:
    return Session.open_engine(n, PowerConfig(spec_mode=mode, n_ctx=256), model="reference", plugins=core_plugins())


def _post(app, *bodies: dict) -> list[httpx.Response]:
    """``bodies`` posted to ``/v1/completions`` of ``app`` in process, one after another; returns once every
    request has ended (its receipt kept), and the app's workers have stopped."""
    state = app.state.power

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            out = [await asyncio.wait_for(client.post("/v1/completions", json=body), 30) for body in bodies]
        await asyncio.wait_for(asyncio.gather(*state.jobs.values(), return_exceptions=True), 30)
        return out

    try:
        return asyncio.run(go())
    finally:
        state.executor.shutdown(wait=True)


def _stream_text(response: httpx.Response) -> tuple[str, list[dict]]:
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return "".join(c["text"] for e in events for c in e["choices"]), events


def test_a_request_on_shared_passes_has_no_worker_for_its_rounds(monkeypatch):
    """Streamed, every chunk's text is taken on the event loop's thread, from commits the driver handed
    over: no ``power-slot`` worker reads the request's rounds (``run_job`` never runs) and the engine hands
    each request to the driver once (``Engine.feed``). The stream equals the whole answer, and both keep
    their receipts and metrics."""
    import power_core.serve.app as app_module

    took: list[str] = []
    take_text = Generation.take_text

    def spy_take(self, committed, final):
        took.append(threading.current_thread().name)
        return take_text(self, committed, final)

    fed: list[bool] = []
    feed = Engine.feed

    def spy_feed(self, gen, deliver, *, quiet=False):
        fed.append(quiet)
        return feed(self, gen, deliver, quiet=quiet)

    def no_worker(*args):
        raise AssertionError("a worker ran the rounds of a request on shared passes")

    monkeypatch.setattr(Generation, "take_text", spy_take)
    monkeypatch.setattr(Engine, "feed", spy_feed)
    monkeypatch.setattr(app_module, "run_job", no_worker)
    with _shared() as engine:
        app = create_app(engine, ServeOptions(model_name="m"))
        streamed, whole = _post(app, {**BODY, "stream": True}, BODY)
    state = app.state.power
    assert streamed.status_code == 200 and whole.status_code == 200, (streamed.text, whole.text)
    text, events = _stream_text(streamed)
    assert text and text == whole.json()["choices"][0]["text"]
    assert fed == [False, True]  # the stream's commits, the whole answer's end only
    # (asyncio.run's loop; how many takes depends on how many commits the loop found waiting at once)
    assert len(took) >= 2 and set(took) == {threading.main_thread().name}
    assert events[-1]["power"]["status"] == "completed"
    for rid in (events[-1]["id"], whole.json()["id"]):
        assert state.receipts.get(rid)["receipt"].status == "completed"
    assert state.metrics.e2e._sum.get() > 0
    assert state.metrics.requests.labels(finished_reason="length")._value.get() == 2


@pytest.mark.parametrize("behind", [False, True])
def test_commits_waiting_for_the_loop_leave_as_one_chunk(monkeypatch, behind):
    """A loop that falls behind the driver (``behind``: every commit of the request reaches the loop in one
    callback, after the last round) sends the waiting commits as one chunk: the same text and one logprob per
    token, as the whole answer has. A loop that keeps up sends a chunk per commit that adds text."""
    from power_core.serve import responses

    post = responses.StreamAnswer.post
    held: list[Commit] = []

    def post_behind(self, commit):
        held.append(commit)
        if commit.finished:
            batch = list(held)

            def arrive_together():
                self.arrived.extend(batch)
                self._wake()
            self.loop.call_soon_threadsafe(arrive_together)

    read = threading.Event()
    take = responses.StreamAnswer._commit

    def take_and_tell(self, commits):
        try:
            return take(self, commits)
        finally:
            read.set()

    def post_in_step(self, commit):  # the driver waits until the loop has made the commit's chunk
        held.append(commit)
        read.clear()
        post(self, commit)
        assert read.wait(10)

    monkeypatch.setattr(responses.StreamAnswer, "post", post_behind if behind else post_in_step)
    monkeypatch.setattr(responses.StreamAnswer, "_commit", take_and_tell)
    with _shared() as engine:
        app = create_app(engine, ServeOptions(model_name="m"))
        streamed, whole = _post(app, {**BODY, "stream": True, "logprobs": 1}, {**BODY, "logprobs": 1})
    assert streamed.status_code == 200 and whole.status_code == 200, (streamed.text, whole.text)
    text, events = _stream_text(streamed)
    answer = whole.json()["choices"][0]
    assert text and text == answer["text"]
    chunks = [e for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    streamed_lps = [t for e in chunks for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed_lps == answer["logprobs"]["tokens"] and len(streamed_lps) == whole.json()["usage"]["completion_tokens"]
    assert len(held) > 2  # the request committed in several rounds
    assert len(chunks) == (1 if behind else len(held))


def _openai_chunk(rid: str, model: str, chat: bool):
    def render(text: str) -> str:
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        return json.dumps({"id": rid, "object": "chunk", "created": 1, "model": model,
                           "choices": [{**choice, "logprobs": None, "finish_reason": None}]}, separators=(",", ":"))
    return render


@given(text=st.text(), rid=st.text(), model=st.text(), chat=st.booleans())
def test_a_text_chunk_is_its_json_around_the_text(text, rid, model, chat):
    """A stream's hot path writes a text chunk as the JSON before and after its text, split once from the
    general path's own output: for any text (quotes, backslashes, control and non-ASCII characters, lone
    surrogates) and any id and model name, the same characters as ``json.dumps`` of the whole chunk; where the
    rest of the chunk spells the split's probe there is no template (the general path writes every chunk)."""
    from json.encoder import encode_basestring_ascii

    from power_core.serve.responses import around_text

    probe = encode_basestring_ascii("\x00\x01\x02")
    render = _openai_chunk(rid, model, chat)
    split = around_text(render)
    if split is None:
        assert render("\x00\x01\x02").count(probe) > 1
        return
    assert split[0] + encode_basestring_ascii(text) + split[1] == render(text)
    assert around_text(_openai_chunk("chatcmpl-1", "m", chat)) is not None  # the usual request has a template
    assert around_text(_openai_chunk("x", "\x00\x01\x02", chat)) is None  # a name that is the probe


def _comparable(response: httpx.Response) -> list[str]:
    """A stream's text chunks as written (its bytes), less what differs between two requests: the id, the
    time of creation, the last chunk (the receipt's)."""
    return [re.sub(r'^data: \{"id":"[^"]*","object":"([^"]*)","created":\d+,', r"\1 ", line)
            for line in response.text.splitlines() if line.startswith("data: {") and '"power":' not in line]


def _chunk_per_commit(monkeypatch) -> None:
    """The driver waits, after each commit, until the loop has made its chunk: a chunk per commit."""
    from power_core.serve import responses

    post, take = responses.StreamAnswer.post, responses.StreamAnswer._commit
    read = threading.Event()

    def take_and_tell(self, commits):
        try:
            return take(self, commits)
        finally:
            read.set()

    def post_in_step(self, commit):
        read.clear()
        post(self, commit)
        assert read.wait(10)

    monkeypatch.setattr(responses.StreamAnswer, "post", post_in_step)
    monkeypatch.setattr(responses.StreamAnswer, "_commit", take_and_tell)


def test_the_hot_path_streams_the_general_paths_chunks(monkeypatch):
    """A stream without logprobs or tools writes its text chunks through the split template; the same
    request with the template off (every chunk built and dumped whole) streams the same events."""
    from power_core.serve import responses

    _chunk_per_commit(monkeypatch)
    with _shared() as engine:
        app = create_app(engine, ServeOptions(model_name="m"))
        (hot,) = _post(app, {**BODY, "stream": True, "max_tokens": 40})
    monkeypatch.setattr(responses.StreamAnswer, "_plain_template", lambda self: None)
    with _shared() as engine:
        app = create_app(engine, ServeOptions(model_name="m"))
        (general,) = _post(app, {**BODY, "stream": True, "max_tokens": 40})
    assert hot.status_code == general.status_code == 200
    text, events = _stream_text(hot)
    assert text and len(events) > 5
    assert _comparable(hot) == _comparable(general)
    assert all(line.startswith("text_completion ") for line in _comparable(hot))


def test_feed_hands_commits_then_the_end_from_the_driver_thread():
    """``Engine.feed`` returns once the request joined; the driver hands every commit, then one ``Ended``,
    to the callable on its own thread; the reader makes the receipt. Quiet: the end only."""
    with _shared(mode="off") as engine:
        solo = engine.sessions[0].generate([1, 2, 3], max_tokens=12)
        for quiet in (False, True):
            got: list[tuple[object, str]] = []
            ended = threading.Event()

            def deliver(item, got=got, ended=ended):
                got.append((item, threading.current_thread().name))
                if isinstance(item, Ended):
                    ended.set()

            ticket = engine.reserve()
            assert ticket.session is not None
            gen = ticket.session.start([1, 2, 3], max_tokens=12)
            engine.feed(gen, deliver, quiet=quiet)
            assert ended.wait(20)
            assert {name for _, name in got} == {"power-engine"}
            assert isinstance(got[-1][0], Ended) and got[-1][0].failure is None
            commits = [item for item, _ in got[:-1]]
            assert all(isinstance(c, Commit) for c in commits) and len(commits) == (0 if quiet else len(commits))
            if not quiet:
                assert [t for c in commits for t in c.tokens] == list(solo.tokens)
            assert gen.receipt is None  # the reader's to make
            receipt = gen.report()
            assert receipt is not None and receipt.status == "completed" and gen.tokens == solo.tokens
        assert engine.busy == 0


def test_feed_is_for_shared_passes_only():
    """A solo sequence has no driver but its reader: ``feed`` refuses, naming what to do instead."""
    with open_session("reference", "off") as s:
        engine = s.driver()
        with pytest.raises(ConfigError, match="rounds"):
            engine.feed(s.start([1, 2, 3], max_tokens=4), lambda item: None)
        assert engine.busy == 0


def test_a_request_whose_begin_fails_on_feed_gives_its_sequence_back_once(monkeypatch):
    """``Generation.begin`` raises on a sequence a ticket waits for: ``feed`` raises having delivered
    nothing, and the sequence goes to the waiting ticket once."""
    real = Generation.begin

    def begin(self):
        if self.prompt.tolist() == [6, 6, 6]:
            raise RuntimeError("begin failed")
        return real(self)

    monkeypatch.setattr(Generation, "begin", begin)
    with _shared(1, "off") as engine:
        first = engine.reserve()
        queued = engine.reserve()
        assert first.ready and not queued.ready and first.session is not None
        got: list = []
        with pytest.raises(RuntimeError, match="begin failed"):
            engine.feed(first.session.start([6, 6, 6], max_tokens=4), got.append)
        assert not got
        assert queued.ready and queued.session is first.session and engine.busy == 1
        late = engine.reserve()
        assert not late.ready, "a new request got the sequence the waiting ticket holds"
        engine.release(queued.session)
        assert late.ready
        engine.release(late.session)


@pytest.mark.parametrize("observed", [False, True], ids=["no-observer", "observer"])
def test_begin_and_end_run_on_the_loop_unless_an_observer_listens(monkeypatch, observed):
    """With no ``power_request_start``/``power_request_end`` observer, a request's begin (``Engine.feed``) and
    its end (``finish_job``: receipt, metrics) run on the event loop's thread: no worker hand-off at either end.
    With one (it may be slow), both run on a ``power-slot`` worker, and the observer hears both there.
    Either way the answer and its receipt are the same."""
    import power_core.serve.jobs as jobs_module
    from power_core.plugins import hookimpl

    where: dict[str, list[str]] = {"feed": [], "finish": [], "observer": []}
    feed, finish = Engine.feed, jobs_module.finish_job

    def spy_feed(self, gen, deliver, *, quiet=False):
        where["feed"].append(threading.current_thread().name)
        return feed(self, gen, deliver, quiet=quiet)

    def spy_finish(*args):
        where["finish"].append(threading.current_thread().name)
        return finish(*args)

    class Observer:
        @hookimpl
        def power_request_start(self, request):
            where["observer"].append(threading.current_thread().name)

        @hookimpl
        def power_request_end(self, receipt):
            where["observer"].append(threading.current_thread().name)

    monkeypatch.setattr(Engine, "feed", spy_feed)
    monkeypatch.setattr(jobs_module, "finish_job", spy_finish)
    plugins = core_plugins(Observer()) if observed else core_plugins()
    with Session.open_engine(2, PowerConfig(spec_mode="ref-draft", n_ctx=256), model="reference",
                             plugins=plugins) as engine:
        app = create_app(engine, ServeOptions(model_name="m"))
        whole, streamed = _post(app, BODY, {**BODY, "stream": True})
    assert whole.status_code == 200 and streamed.status_code == 200
    assert _stream_text(streamed)[0] == whole.json()["choices"][0]["text"]
    loop_thread = threading.main_thread().name  # asyncio.run's loop runs on the calling thread
    expected = ["power-slot"] * 2 if observed else [loop_thread] * 2
    assert [name.split("_")[0] for name in where["feed"]] == expected
    assert [name.split("_")[0] for name in where["finish"]] == expected
    assert [name.split("_")[0] for name in where["observer"]] == (["power-slot"] * 4 if observed else [])
    assert [kept[0]["receipt"].status for kept in app.state.power.receipts._items.values()] == ["completed"] * 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_request_on_shared_passes_whose_begin_crashes_answers_an_error(monkeypatch, stream):
    """A defect when the worker begins the request: a stream ends with an OpenAI-shaped error event, a
    whole request is a 500, neither shows the internals, and the sequence goes back."""

    def begin(self):
        raise RuntimeError("a defect with internals")

    monkeypatch.setattr(Generation, "begin", begin)
    with _shared() as engine:
        app = create_app(engine, ServeOptions(model_name="m"))
        (got,) = _post(app, {**BODY, "stream": stream})
        assert engine.busy == 0
    assert "internals" not in got.text
    if stream:
        assert got.status_code == 200
        last = json.loads([line[6:] for line in got.text.splitlines() if line.startswith("data: ")][-1])
        assert last["error"]["code"] == "internal_error"
    else:
        assert got.status_code == 500 and got.json()["error"]["code"] == "internal_error"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_request_in_flight_when_the_driver_dies_gets_an_error_not_a_hang(stream):
    """The driver thread dies with the request in its passes: the driver hands it its end with the engine's
    failure, so the client gets a typed error (an error event, or a 500), never a wait for a pass that
    never comes, and the request's receipt says it failed."""
    engine = _shared(1, "off")
    try:
        def defect(*args):
            raise RuntimeError("driver defect")

        assert engine._driver is not None
        engine._driver._pass = defect  # the pass fails, and so does ending its requests: the driver thread ends
        engine._driver._leave = defect
        app = create_app(engine, ServeOptions(model_name="m"))
        (got,) = _post(app, {**BODY, "stream": stream})
    finally:
        engine.close()
    assert engine.failure is not None and "driver defect" in engine.failure
    if stream:
        last = json.loads([line[6:] for line in got.text.splitlines() if line.startswith("data: ")][-1])
        assert last["error"]["code"] == "runtime_fault"
    else:
        assert got.status_code == 500 and got.json()["error"]["code"] == "runtime_fault"
    (kept,) = [v for v in app.state.power.receipts._items.values()]
    assert kept[0]["receipt"].status == "failed"


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_stream_on_shared_passes_whose_client_leaves_is_cancelled_and_kept(spec):
    """The client goes away after the first event: the request is cancelled at the next pass (its cancel
    token), its receipt is kept saying why, and the sequence goes back. Under ASGI 2.4 (the server's next
    write raises) the stream ends quietly too: the app returns, no error reaches the server."""
    from tests.test_soak_findings import _asgi_stream_then_disconnect, _SlowRounds

    engine = Session.open_engine(1, PowerConfig(spec_mode="off", n_ctx=256), model="reference",
                                 plugins=core_plugins(_SlowRounds()))
    try:
        app = create_app(engine, ServeOptions(model_name="m"))
        state = app.state.power

        async def outcome() -> None:
            await asyncio.wait_for(asyncio.gather(*state.jobs.values(), return_exceptions=True), 30)

        t0 = time.monotonic()
        events, pending = _asgi_stream_then_disconnect(app, {**BODY, "max_tokens": 200, "stream": True}, outcome, spec)
        assert events and pending == 0
        assert time.monotonic() - t0 < 200 * 0.02, "the request ran to its end"
        state.executor.shutdown(wait=True)
        assert engine.busy == 0
    finally:
        engine.close()
    (kept,) = [v for v in state.receipts._items.values()]
    assert kept[0]["cancel_reason"] == "disconnected" and kept[0]["receipt"].status == "cancelled"
