"""``power serve`` on the reference backend: a real process on 127.0.0.1, the official ``openai`` client,
raw HTTP for malformed requests, and the slot pool's admission rules."""

from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest

from power_core.errors import Cancelled, Overloaded
from power_core.session import Session
from power_core.transaction import CancelToken
from tests.serve_helpers import asgi, power_cmd, served

pytestmark = pytest.mark.slow

MODE = ["--backend", "reference", "--mode", "ref-draft", "--n-ctx", "256"]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(template_file):
    with served(*MODE, "--parallel", "2", "--chat-template", str(template_file)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def _power_run(*args: str) -> dict:
    out = subprocess.run(power_cmd("run", *MODE, "--json", *args), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_completion_equals_power_run_digest_for_digest(client, model_name):
    prompt = "hello world"
    solo = _power_run("--prompt", prompt, "--max-tokens", "24")
    got = client.completions.create(model=model_name, prompt=prompt, max_tokens=24)
    power = got.model_extra["power"]
    assert got.choices[0].text == solo["text"]
    assert power["output_sha256"] == solo["receipt"]["output_sha256"]
    summary = solo["receipt"]["summary"]
    assert (power["strategy"], power["rounds"], power["acceptance"], power["tokens_per_target_pass"]) == (
        "ref-draft", summary["rounds"], summary["acceptance"], summary["verified_tokens_per_pass"])
    assert got.usage.completion_tokens == solo["receipt"]["output_tokens"] == 24
    assert got.choices[0].finish_reason == "length"


def test_seeded_stochastic_is_reproducible_and_equals_power_run(client, model_name):
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    a = client.completions.create(model=model_name, prompt="abc", max_tokens=20, **kw)
    b = client.completions.create(model=model_name, prompt="abc", max_tokens=20, **kw)
    c = client.completions.create(model=model_name, prompt="abc", max_tokens=20, temperature=0.9, top_p=0.95,
                                  seed=99)
    solo = _power_run("--prompt", "abc", "--max-tokens", "20", "--temperature", "0.9", "--top-p", "0.95",
                      "--seed", "1234")
    assert a.model_extra["power"]["output_sha256"] == b.model_extra["power"]["output_sha256"]
    assert a.model_extra["power"]["output_sha256"] == solo["receipt"]["output_sha256"]
    assert c.model_extra["power"]["output_sha256"] != a.model_extra["power"]["output_sha256"]


def test_chat_stream_concatenates_to_the_non_streamed_text(client, model_name):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "count"}]
    full = client.chat.completions.create(model=model_name, messages=messages, max_tokens=30)
    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=30, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.model_extra["power"]["output_sha256"] == full.model_extra["power"]["output_sha256"]


def test_stop_strings_end_the_text_before_them(client, model_name):
    free = client.completions.create(model=model_name, prompt="xyz", max_tokens=40).choices[0].text
    stop = free[10:12]
    assert stop and stop in free
    got = client.completions.create(model=model_name, prompt="xyz", max_tokens=40, stop=[stop, "never-there"])
    assert got.choices[0].text == free[: free.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name, prompt="xyz", max_tokens=40, stop=stop, stream=True))
    assert streamed == got.choices[0].text


def test_logprobs_come_from_the_rows_that_emitted_each_token(client, model_name):
    got = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=12, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == 12
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0.0
        # greedy: the emitted token is the row's most likely one
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
    comp = client.completions.create(model=model_name, prompt="hi", max_tokens=6, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0


def test_receipts_and_metrics(server, client, model_name):
    got = client.completions.create(model=model_name, prompt="receipt please", max_tokens=16)
    rid = got.model_extra["power"]["receipt_id"]
    assert rid == got.id
    body = httpx.get(f"{server.url}/v1/receipts/{rid}").json()
    assert body["receipt"]["output_sha256"] == got.model_extra["power"]["output_sha256"]
    assert body["receipt"]["receipt_sha256"] == got.model_extra["power"]["receipt_sha256"]
    assert body["receipt"]["status"] == "completed"
    missing = httpx.get(f"{server.url}/v1/receipts/cmpl-nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "receipt_not_found"
    text = httpx.get(f"{server.url}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["power:spec_decode_num_drafts_total"] > 0
    assert values["power:spec_decode_num_accepted_tokens_total"] <= values["power:spec_decode_num_draft_tokens_total"]
    assert values['power:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert values['power:request_success_total{finished_reason="length"}'] >= 1
    assert values["power:num_requests_running"] == 0 and values["power:num_requests_waiting"] == 0
    assert values["power:time_to_first_token_seconds_count"] >= 1
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["slots_idle"] == 2


BAD: list[tuple[str, object, int, str | None]] = [
    # (path, body (bytes: sent raw), status, param the error names)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'"text"', 400, None),
    ("/v1/completions", b'{"model": "M", "prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", b'{"model": "M", "prompt": "a", "temperature": NaN}', 400, None),
    ("/v1/completions", b'{"model": "M", "prompt": "a", "temperature": Infinity}', 400, None),
    ("/v1/completions", {"prompt": "a"}, 400, "model"),
    ("/v1/completions", {"model": "M"}, 400, "prompt"),
    ("/v1/completions", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/v1/completions", {"model": 7, "prompt": "a"}, 400, "model"),
    ("/v1/completions", {"model": "M", "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": [10**12]}, 400, "prompt"),
    ("/v1/completions", {"model": "M", "prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "a", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"model": "M", "prompt": "a", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "a", "temperature": 1e308}, 400, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": "M", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "M", "prompt": "a", "top_k": -3}, 400, "top_k"),
    ("/v1/completions", {"model": "M", "prompt": "a", "min_p": 1.0}, 400, "min_p"),
    ("/v1/completions", {"model": "M", "prompt": "a", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"model": "M", "prompt": "a", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"model": "M", "prompt": "a", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": "M", "prompt": "a", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": "M", "prompt": "a", "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": "M", "prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": "M", "prompt": "a", "stop": ["s"] * 17}, 400, "stop"),
    ("/v1/completions", {"model": "M", "prompt": "a", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"model": "M", "prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "M", "prompt": "a", "logit_bias": {"x5": 10}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "M", "prompt": "a", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "M", "prompt": "a", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": "M", "prompt": "a", "repeat_penalty": 0}, 400, "repeat_penalty"),
    ("/v1/completions", {"model": "M", "prompt": "a", "stream_options": {"include_usage": True}}, 400, None),
    ("/v1/completions", {"model": "M", "prompt": "a", "mystery": 1}, 400, "mystery"),
    ("/v1/completions", {"model": "M", "prompt": "a" * 400}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "M"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, None),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {}}}, 400, None),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, None),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 5, "max_completion_tokens": 6}, 400, None),
    ("/v1/chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x" * 400}]}, 400,
     "messages"),
    ("/v1/embeddings", {"model": "M", "input": "x"}, 404, None),
]


def test_malformed_requests_get_openai_shaped_4xx_and_the_server_keeps_serving(server, client, model_name):
    assert len(BAD) >= 40
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body, status, param in BAD:
            if isinstance(body, bytes):
                raw = body.replace(b'"M"', json.dumps(model_name).encode())
            else:
                body = dict(body)  # type: ignore[arg-type]
                if body.get("model") == "M":
                    body["model"] = model_name
                raw = json.dumps(body).encode()
            r = http.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == status, (path, body, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, r.text
            assert err["message"] and "Traceback" not in r.text
            if param is not None:
                assert err["param"] == param, (body, err)
        big = http.post("/v1/completions", content=b"x" * (10 << 20))
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        assert http.get("/v1/completions").status_code == 405
    before = _power_run("--prompt", "still fine", "--max-tokens", "8")
    after = client.completions.create(model=model_name, prompt="still fine", max_tokens=8)
    assert after.model_extra["power"]["output_sha256"] == before["receipt"]["output_sha256"]


def test_a_request_narrows_k_with_spec_draft_max(server, client, model_name):
    """``spec_draft_max`` (llama-server's ``speculative.n_max``): the request's rounds propose at most that
    many tokens, its text is the default request's (exactness), its receipt records the K it ran with; wider
    than the server's K is a 400 naming the field, before the request waits."""
    prompt = "narrow k"
    wide = client.completions.create(model=model_name, prompt=prompt, max_tokens=24)
    narrow = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, extra_body={"spec_draft_max": 1})
    assert narrow.choices[0].text == wide.choices[0].text
    receipts = [httpx.get(f"{server.url}/v1/receipts/{r.id}").json()["receipt"] for r in (wide, narrow)]
    k = client.models.list().data[0].model_extra["power"]["strategies"][0]["draft_max"]  # the server's K
    assert k > 1 and receipts[1]["config"]["spec_draft_max"] == 1
    assert max(r["proposed"] for r in receipts[1]["rounds"]) == 1 < max(r["proposed"] for r in receipts[0]["rounds"])
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for value, status in ((k + 1, 400), (0, 400), ("2", 400)):
            r = http.post("/v1/completions", json={"model": model_name, "prompt": prompt, "spec_draft_max": value})
            assert r.status_code == status, r.text
            assert r.json()["error"]["param"] == "spec_draft_max", r.text


def test_api_key_is_required_when_set():
    with served(*MODE, "--api-key", "s3cret") as s:
        good = openai.OpenAI(base_url=s.base_url, api_key="s3cret", max_retries=0)
        name = good.models.list().data[0].id
        assert good.completions.create(model=name, prompt="a", max_tokens=2).usage.completion_tokens == 2
        for key in ("wrong", "s3cre", "S3CRET", "s3cret2"):
            with pytest.raises(openai.AuthenticationError) as info:
                openai.OpenAI(base_url=s.base_url, api_key=key, max_retries=0).models.list()
            assert info.value.body["code"] == "invalid_api_key"
        r = httpx.post(f"{s.url}/v1/completions", json={"model": name, "prompt": "a"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        assert httpx.get(f"{s.url}/metrics").status_code == 401
        assert httpx.get(f"{s.url}/health").status_code == 200


@pytest.mark.parametrize("args, needle", [
    (["--host", "0.0.0.0"], "--api-key"),
    (["--model", "/nonexistent/model.gguf"], "model"),
    (["--mode", "no-such-mode"], "no-such-mode"),
    (["--temperature", "-1"], "temperature"),
    (["--chat-template", "/nonexistent.jinja"], "chat_template"),
])
def test_startup_errors_exit_2_before_binding(args, needle):
    out = subprocess.run(power_cmd("serve", *MODE, "--port", "0", *args), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "error[" in out.stderr and needle in out.stderr
    assert "listening" not in out.stderr and "Traceback" not in out.stderr


# -- admission -----------------------------------------------------------------------------------------
def test_engine_admission_is_fifo_bounded_and_passes_sequences_on():
    """The server asks the engine for a sequence: given at once while one is free, else queued first
    come first served up to queue_max, refused beyond; a waiter that gives up leaves the queue."""
    from tests.helpers import open_session

    s1, s2 = open_session("reference", "off"), open_session("reference", "off")
    engine = Session.independent_engine((s1, s2), queue_max=2)
    try:
        a, b = engine.reserve(), engine.reserve()
        assert a.ready and b.ready and {a.session, b.session} == {s1, s2} and engine.busy == 2
        w1, w2 = engine.reserve(), engine.reserve()
        assert not w1.ready and engine.waiting == 2
        with pytest.raises(Overloaded, match="queue limit 2"):
            engine.reserve()  # the queue is full: refused at once
        woken: list[str] = []
        w2.on_ready(lambda: woken.append("w2"))
        w1.withdraw()  # a client that gives up while waiting leaves the queue
        engine.release(a.session)
        assert w2.ready and w2.session is a.session and woken == ["w2"]  # the next waiter gets it
        late = engine.reserve()
        with pytest.raises(Overloaded, match="within 0.01 s"):
            late.wait(0.01)  # waited past its timeout: it left the queue
        token = CancelToken()
        token.cancel()
        with pytest.raises(Cancelled):
            engine.reserve().wait(None, token)
        assert engine.waiting == 0
        engine.release(b.session)
        engine.release(w2.session)
        assert engine.busy == 0
        out = engine.run(s1.start([1, 2, 3], max_tokens=4))  # a request on an admitted sequence runs
        assert out.receipt.status == "completed" and engine.busy == 0
    finally:
        engine.close()


def test_request_sampling_is_validated_like_config():
    from power_core.errors import ConfigError
    from tests.helpers import open_session

    with open_session("reference", "off") as s:
        with pytest.raises(ConfigError, match="sampling.n_ctx"):
            s.start([1, 2], sampling={"n_ctx": 5})
        with pytest.raises(ConfigError, match="logprobs"):
            s.start([1, 2], logprobs=99)
        gen = s.start([1, 2], sampling={"temperature": 0.5, "seed": 3}, logprobs=2)
        assert gen.config.temperature == 0.5 and gen.config.seed == 3 and s.config.temperature == 0.0
        gen.run()
        assert len(gen.logprobs) == len(gen.tokens) and all(len(lp.top) == 2 for lp in gen.logprobs)


def test_receipts_say_whether_requests_shared_target_passes(server, client, model_name):
    got = client.completions.create(model=model_name, prompt="shared?", max_tokens=8)
    batch = httpx.get(f"{server.url}/v1/receipts/{got.id}").json()["receipt"]["backend"]["batch"]
    assert batch["n_seq"] == 2 and batch["rows_identical_to_solo"] is True and batch["shared_passes"] >= 1
    with served(*MODE, "--parallel", "2", "--no-batch") as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        r = c.completions.create(model=model_name, prompt="shared?", max_tokens=8)
        assert r.model_extra["power"]["output_sha256"] == got.model_extra["power"]["output_sha256"]
        batch = httpx.get(f"{s.url}/v1/receipts/{r.id}").json()["receipt"]["backend"]["batch"]
        assert batch == {"shared_passes": 0, "independent_because": "--no-batch"}
        assert "independent: --no-batch" in s.stderr()


# -- faults: every client gets an answer (issue 44) ----------------------------------------------------


def _sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_a_stream_whose_request_crashes_ends_with_an_error_event(monkeypatch):
    """A defect (not a ``PowerError``) that the worker re-raises: a stream that has begun ends with an
    OpenAI-shaped error event, and a whole request is a 500; neither shows the internals (issue 44,
    item 3: the stream used to end with neither an error event nor ``[DONE]``)."""
    from power_core.serve import ServeOptions, create_app
    from power_core.session import Generation
    from tests.helpers import open_session

    def begin(self):
        raise RuntimeError("a defect with internals")

    monkeypatch.setattr(Generation, "begin", begin)
    with open_session("reference", "ref-draft") as s:
        app = create_app(s.driver(), ServeOptions(model_name="m"))
        body = {"model": "m", "prompt": "abc", "max_tokens": 8}
        streamed, whole, health = asgi(app, ("POST", "/v1/completions", {**body, "stream": True}),
                                        ("POST", "/v1/completions", body), ("GET", "/health", None))
        app.state.power.executor.shutdown(wait=True)
    assert streamed.status_code == 200
    last = json.loads(_sse_data(streamed.text)[-1])
    assert last["error"]["code"] == "internal_error" and last["error"]["type"] == "server_error"
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "internal_error"
    assert "internals" not in streamed.text + whole.text
    assert health.json()["slots_idle"] == 1  # the sequence went back


def test_health_is_unhealthy_and_requests_fail_fast_once_the_engine_failed():
    """A driver that died marks its engine failed: ``/health`` says so (503) and a request gets a typed
    error at once instead of waiting forever (issue 44, item 2)."""
    import threading

    from power_core.config import PowerConfig
    from power_core.errors import RuntimeFault
    from power_core.serve import ServeOptions, create_app
    from tests.helpers import core_plugins

    engine = Session.open_engine(1, PowerConfig(spec_mode="off", n_ctx=256), model="reference",
                                 plugins=core_plugins())
    try:
        def defect(*args):
            raise RuntimeError("driver defect")

        engine._driver._pass = defect  # the pass fails, and so does ending its requests: the driver thread ends
        engine._driver._leave = defect
        out: list = []
        gen = engine.submit([1, 2, 3], max_tokens=4)
        reader = threading.Thread(target=lambda: out.append(pytest.raises(RuntimeFault, engine.run, gen)),
                                  daemon=True)
        reader.start()
        reader.join(20)
        assert out and not reader.is_alive()
        app = create_app(engine, ServeOptions(model_name="m"))
        health, got = asgi(app, ("GET", "/health", None),
                            ("POST", "/v1/completions", {"model": "m", "prompt": "abc", "max_tokens": 4}))
        app.state.power.executor.shutdown(wait=True)
    finally:
        engine.close()
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert "driver defect" in health.json()["error"]
    assert got.status_code == 500 and got.json()["error"]["code"] == "runtime_fault"


def test_the_server_freezes_its_startup_heap_before_it_serves():
    """Once started, ``power serve`` moves what it holds for good (model tables, templates, the app) out of the
    cyclic collector's reach (``serve.heap_frozen``), so a full collection during serving scans only what
    requests made: unfrozen, one stalled every decoding request by 46 ms on the MTP fixture's server
    (docs/evidence/bench_drafts/served-2026-12-07). The freeze is the server's, never a library caller's."""
    import gc
    import re
    import time

    from power_core.serve import freeze_heap
    from tests.serve_helpers import listening

    with listening(power_cmd("-v", "serve", "--port", "0", *MODE)) as s:
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200
        deadline = time.monotonic() + 30
        while not any("serve.heap_frozen" in line for line in s.log) and time.monotonic() < deadline:
            time.sleep(0.05)
        found = [re.search(r"objects=(\d+)", line) for line in s.log if "serve.heap_frozen" in line]
    assert len(found) == 1 and found[0] is not None and int(found[0].group(1)) > 10_000, s.log[-20:]
    before = gc.get_freeze_count()
    try:
        assert freeze_heap() > before  # in process: everything alive now is frozen
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
