"""``power serve`` on SmolLM2-135M-Instruct (from PyPI): the official ``openai`` client against a real
process on 127.0.0.1 — digests equal to ``power run``, disconnects, timeouts, a full queue, SIGTERM
drain, and a bounded load test whose greedy outputs must each equal their solo run."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve_helpers import power_cmd, served

pytestmark = [pytest.mark.native, pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CODE_EDIT = (ROOT / "docs" / "examples" / "code-edit.txt").read_text(encoding="utf-8")


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _receipt(url: str, rid: str, wait_s: float = 30.0) -> dict:
    deadline = time.monotonic() + wait_s
    while True:
        r = httpx.get(f"{url}/v1/receipts/{rid}", timeout=10)
        if r.status_code == 200:
            return r.json()
        assert time.monotonic() < deadline, f"no receipt for {rid}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def suffix_server():
    with served("--mode", "suffix", "--threads", "2", "--parallel", "2") as s:
        yield s


@pytest.fixture(scope="module")
def client(suffix_server):
    return openai.OpenAI(base_url=suffix_server.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def name(client):
    return client.models.list().data[0].id


def _power_run(*args: str) -> dict:
    out = subprocess.run(power_cmd("run", "--mode", "suffix", "--threads", "2", "--json", *args),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_completion_and_chat_equal_power_run_digest_for_digest(client, name):
    solo = _power_run("--prompt", CODE_EDIT, "--max-tokens", "96")
    got = client.completions.create(model=name, prompt=CODE_EDIT, max_tokens=96)
    power = got.model_extra["power"]
    assert got.choices[0].text == solo["text"]
    assert power["output_sha256"] == solo["receipt"]["output_sha256"]
    assert power["strategy"] == "suffix" and power["numerics"] == "exact"
    assert power["accepted"] > 0  # the suffix proposer copies from the prompt

    question = "Name three primary colors."
    solo_chat = _power_run("--chat", "--prompt", question, "--max-tokens", "40")
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": question}],
                                          max_tokens=40)
    assert chat.choices[0].message.content == solo_chat["text"]
    assert chat.model_extra["power"]["output_sha256"] == solo_chat["receipt"]["output_sha256"]

    chunks = list(client.chat.completions.create(model=name, messages=[{"role": "user", "content": question}],
                                                 max_tokens=40, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == solo_chat["text"]
    assert chunks[-1].usage.completion_tokens == solo_chat["receipt"]["output_tokens"]
    assert chunks[-1].model_extra["power"]["output_sha256"] == solo_chat["receipt"]["output_sha256"]


def test_seeded_sampling_and_logprobs_on_smollm2(client, name):
    msgs = [{"role": "user", "content": "Write one sentence about rivers."}]
    kw = {"temperature": 0.8, "seed": 11, "max_tokens": 32}
    a = client.chat.completions.create(model=name, messages=msgs, **kw, extra_body={"top_k": 40})
    b = client.chat.completions.create(model=name, messages=msgs, **kw, extra_body={"top_k": 40})
    assert a.choices[0].message.content == b.choices[0].message.content
    solo = _power_run("--chat", "--prompt", msgs[0]["content"], "--max-tokens", "32", "--temperature", "0.8",
                      "--top-k", "40", "--seed", "11")
    assert a.model_extra["power"]["output_sha256"] == solo["receipt"]["output_sha256"]
    lp = client.chat.completions.create(model=name, messages=msgs, max_tokens=16, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(lp.choices[0].message.content[:8])
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)  # greedy


def test_a_client_that_disconnects_cancels_its_request_at_once(suffix_server, name):
    url = suffix_server.url
    before = _metrics(url).get('power:request_success_total{finished_reason="abort"}', 0.0)
    body = {"model": name, "prompt": "Count from one to one thousand: one, two,", "max_tokens": 1500,
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: "):
                seen += 1
            if seen == 3:
                break
    t0 = time.monotonic()
    receipt = _receipt(url, rid)
    assert receipt["cancel_reason"] == "disconnected"
    assert receipt["receipt"]["status"] == "cancelled"
    assert 0 < receipt["receipt"]["output_tokens"] < 1500
    assert time.monotonic() - t0 < 10
    health = httpx.get(f"{url}/health").json()
    assert health["slots_processing"] == 0
    assert _metrics(url)['power:request_success_total{finished_reason="abort"}'] == before + 1


def test_a_client_that_abandons_a_non_streamed_request_cancels_it(suffix_server, name):
    """No stream to write into: the server learns of the disconnect from the connection itself."""
    url = suffix_server.url
    before = _metrics(url).get('power:request_success_total{finished_reason="abort"}', 0.0)
    body = {"model": name, "prompt": "Count from one to one thousand: one, two,", "max_tokens": 1500}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    t0 = time.monotonic()
    while httpx.get(f"{url}/health").json()["slots_processing"] and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert httpx.get(f"{url}/health").json()["slots_processing"] == 0
    assert time.monotonic() - t0 < 10
    assert _metrics(url)['power:request_success_total{finished_reason="abort"}'] == before + 1


def test_the_contexts_memory_is_reported_at_startup(suffix_server):
    url = suffix_server.url
    power = httpx.get(f"{url}/v1/models").json()["data"][0]["power"]
    mem = power["memory"]
    assert mem["drafts"] == {}  # suffix drafts hold no llama.cpp context
    target = mem["target"]
    assert target["weights"] > 50e6 and target["context"] > 0 and target["compute"] > 0  # SmolLM2-135M
    m = _metrics(url)
    for part, n in target.items():
        assert m[f'power:memory_bytes{{context="target",part="{part}"}}'] == n


def test_timeout_and_a_full_queue():
    with served("--mode", "off", "--threads", "2", "--parallel", "1", "--queue", "0", "--timeout", "4") as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        long_req = {"model": name, "prompt": "Once upon a time", "max_tokens": 1800}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.completions.create, **long_req)
            deadline = time.monotonic() + 30
            while httpx.get(f"{s.url}/health").json()["slots_processing"] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            busy = httpx.post(f"{s.url}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
            assert busy.status_code == 503 and busy.headers["retry-after"]
            assert busy.json()["error"]["code"] == "server_overloaded"
            timed = running.result()
        power = timed.model_extra["power"]
        assert (power["status"], power["cancel_reason"]) == ("cancelled", "timeout")
        assert timed.choices[0].finish_reason == "length" and 0 < timed.usage.completion_tokens < 1800


def test_sigterm_drains_in_flight_streams_and_exits_0():
    with served("--mode", "suffix", "--threads", "2", "--parallel", "2", "--drain-timeout", "60") as s:
        name = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0).models.list().data[0].id
        body = {"model": name, "prompt": "Once upon a time", "max_tokens": 48, "stream": True}
        texts: list[str] = []
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{s.url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not texts:
                    s.proc.send_signal(signal.SIGTERM)
                texts.append(line)
        assert texts[-1] == "data: [DONE]"
        last = json.loads(texts[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length" and last["power"]["status"] == "completed", \
            last["power"]
        assert s.proc.wait(60) == 0
        assert "Traceback" not in s.stderr()


PROMPTS = [
    "Name three primary colors.",
    "What is 12 times 12?",
    "Write a haiku about the sea.",
    "Explain what a compiler does in one sentence.",
    "List the days of the week.",
    "Translate 'good morning' into French.",
    "What is the capital of Italy?",
    "Give two synonyms for 'fast'.",
]
N_REQUESTS, N_CLIENTS, N_DISCONNECT, MAX_TOKENS = 200, 8, 20, 24


def test_load_200_requests_8_clients_every_greedy_output_equals_its_solo_run():
    from power_core import PowerConfig, Session

    config = PowerConfig(spec_mode="suffix", n_threads=2, max_tokens=MAX_TOKENS)
    solo: dict[tuple[str, int], str] = {}
    with Session.open(config) as session:
        for i, p in enumerate(PROMPTS):
            msgs = [{"role": "user", "content": p}]
            solo[("chat", i)] = session.chat(msgs).text or ""
            solo[("text", i)] = session.generate(p).text or ""

    with served("--mode", "suffix", "--threads", "1", "--parallel", "4", "--queue", "256",
                "--max-tokens", str(MAX_TOKENS)) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        rss0 = _rss_kib(s.proc.pid)
        rng = random.Random(0)
        plan = [(k, rng.randrange(len(PROMPTS)), rng.random() < 0.5) for k in range(N_REQUESTS)]
        drop = set(rng.sample(range(N_REQUESTS), N_DISCONNECT))
        statuses: list[int] = []
        ttft: list[float] = []
        lock = threading.Lock()
        mismatches: list[tuple[int, str, str]] = []
        tokens = [0]

        def one(item: tuple[int, int, bool]) -> None:
            k, i, chat = item
            kind = "chat" if chat else "text"
            t0 = time.perf_counter()
            if k in drop:  # a stream abandoned after its first delta
                path = "/v1/chat/completions" if chat else "/v1/completions"
                body = ({"messages": [{"role": "user", "content": PROMPTS[i]}]} if chat else {"prompt": PROMPTS[i]})
                with httpx.Client(timeout=120) as http, http.stream(
                        "POST", f"{s.url}{path}", json={"model": name, "stream": True, **body}) as r:
                    with lock:
                        statuses.append(r.status_code)
                    for line in r.iter_lines():
                        if line.startswith("data: ") and '"content":""' not in line:
                            break
                return
            streaming = k % 2 == 0
            if chat:
                msgs = [{"role": "user", "content": PROMPTS[i]}]
                if streaming:
                    parts, first, n = [], None, None
                    for c in client.chat.completions.create(model=name, messages=msgs, stream=True,
                                                            stream_options={"include_usage": True}):
                        if c.choices and c.choices[0].delta.content:
                            first = first or time.perf_counter()
                            parts.append(c.choices[0].delta.content)
                        if c.usage is not None:
                            n = c.usage.completion_tokens
                    text, t_first = "".join(parts), first
                else:
                    r = client.chat.completions.create(model=name, messages=msgs)
                    text, t_first, n = r.choices[0].message.content or "", None, r.usage.completion_tokens
            else:
                if streaming:
                    parts, first, n = [], None, None
                    for c in client.completions.create(model=name, prompt=PROMPTS[i], stream=True,
                                                       stream_options={"include_usage": True}):
                        if c.choices and c.choices[0].text:
                            first = first or time.perf_counter()
                            parts.append(c.choices[0].text)
                        if c.usage is not None:
                            n = c.usage.completion_tokens
                    text, t_first = "".join(parts), first
                else:
                    r = client.completions.create(model=name, prompt=PROMPTS[i])
                    text, t_first, n = r.choices[0].text, None, r.usage.completion_tokens
            with lock:
                statuses.append(200)
                if t_first is not None:
                    ttft.append(t_first - t0)
                assert n is not None
                tokens[0] += n
                if text != solo[(kind, i)]:
                    mismatches.append((k, text, solo[(kind, i)]))

        t_start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(N_CLIENTS) as pool:
            for f in concurrent.futures.as_completed([pool.submit(one, item) for item in plan]):
                f.result()  # an openai error (any 4xx/5xx) fails the test here
        wall = time.perf_counter() - t_start
        assert len(statuses) == N_REQUESTS and all(code < 500 for code in statuses)
        assert not mismatches, mismatches[:3]
        deadline = time.monotonic() + 30
        while True:
            m = _metrics(s.url)
            if m["power:num_requests_running"] == 0 and m["power:num_requests_waiting"] == 0:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
        assert m['power:request_success_total{finished_reason="abort"}'] <= N_DISCONNECT
        rss1 = _rss_kib(s.proc.pid)
        q = statistics.quantiles(ttft, n=100)
        report = {"requests": N_REQUESTS, "clients": N_CLIENTS, "disconnected": N_DISCONNECT,
                  "wall_s": round(wall, 2), "aggregate_tok_s": round(tokens[0] / wall, 1),
                  "ttft_p50_s": round(statistics.median(ttft), 3), "ttft_p99_s": round(q[98], 3),
                  "rss_before_mib": rss0 // 1024, "rss_after_mib": rss1 // 1024}
        print("serve load:", json.dumps(report))
        out = os.environ.get("POWER_SERVE_LOAD_REPORT")
        if out:
            Path(out).write_text(json.dumps(report, indent=2) + "\n")
