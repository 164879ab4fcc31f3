"""``power serve --mode a,b,c``: one server, several strategies on one target. A real process on
127.0.0.1 (reference backend) and the official ``openai`` client: a request picks its strategy
through the ``power`` extension (``extra_body``), runs it on any free slot in the shared target
passes, and equals ``power run --mode`` of that strategy: the same tokens and, on a fresh server,
round for round the same proposals (later, suffix's proposer has learnt from the server's earlier
requests, as it does under ``--mode suffix`` alone)."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess

import httpx
import openai
import pytest

from tests.serve_helpers import power_cmd, served

pytestmark = pytest.mark.slow

pytest.importorskip("power_suffix")  # the model-free strategy beside the reference's draft and off

BASE = ["--backend", "reference", "--n-ctx", "256", "--trace"]
MODES = "ref-draft,suffix,off"
PROMPTS = ["hello world", "the quick brown fox", "abcabcabcabc", "one two one two one"]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    with served(*BASE, "--mode", MODES, "--parallel", "2", "--chat-template", str(template)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def _power_run(mode: str, prompt: str, max_tokens: int, **sampling: object) -> dict:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in sampling.items()]
    out = subprocess.run(power_cmd("run", *BASE, "--mode", mode, "--json", "--prompt", prompt, "--max-tokens",
                                   str(max_tokens), *flags), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["receipt"]


def _served_receipt(server, rid: str) -> dict:
    return httpx.get(f"{server.url}/v1/receipts/{rid}", timeout=10).json()["receipt"]


def _rounds(receipt: dict) -> list[tuple]:
    """Each round's proposal (with ``--trace``) and how much of it was accepted."""
    return [(r.get("proposal"), r["accepted"], r["emitted"]) for r in receipt["rounds"]]


def _same_run(receipt: dict, solo: dict, *, fresh: bool) -> None:
    """``receipt`` (served) ran as ``solo`` (``power run``) did: the same strategy, configuration and
    tokens; round for round the same proposals (suffix's only from a ``fresh`` proposer: it learns
    across requests). A request that asked for ``auto`` ran in the lane of auto's pick: its configuration's
    ``spec_mode`` is that strategy (``strategy.requested`` says ``auto``)."""
    mode = solo["strategy"]["name"]
    assert receipt["strategy"]["name"] == mode
    assert receipt["config"]["spec_mode"] == mode and receipt["config"]["spec_draft_max"] == solo["config"][
        "spec_draft_max"]
    assert receipt["output_sha256"] == solo["output_sha256"]
    assert receipt["backend"]["batch"]["n_seq"] == 2  # on the shared target passes
    if fresh or mode != "suffix":
        assert _rounds(receipt) == _rounds(solo), mode


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"])
def test_a_request_s_strategy_equals_power_run_of_that_mode(sampling):
    """On a fresh server, one request of each strategy through the official client's ``extra_body``."""
    with served(*BASE, "--mode", MODES, "--parallel", "2") as s:
        assert "strategies 'ref-draft' (default), 'suffix', 'off'" in s.stderr()
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
        name = c.models.list().data[0].id
        for strategy, prompt in zip(MODES.split(","), PROMPTS[1:], strict=True):
            solo = _power_run(strategy, prompt, 32, **sampling)
            got = c.completions.create(model=name, prompt=prompt, max_tokens=32,
                                       extra_body={"power": {"strategy": strategy}}, **sampling)
            power = got.model_extra["power"]
            assert power["strategy"] == strategy
            assert power["output_sha256"] == solo["output_sha256"]
            assert (power["rounds"], power["proposed"], power["accepted"]) == (
                solo["summary"]["rounds"], solo["summary"]["proposed"], solo["summary"]["accepted"])
            receipt = _served_receipt(s, got.id)
            assert receipt["strategy"] == {**solo["strategy"], "requested": strategy}
            _same_run(receipt, solo, fresh=True)


def test_no_strategy_is_the_first_and_auto_is_the_library_s_pick(server, client, model_name):
    info = client.models.list().data[0].model_extra["power"]
    assert [s["name"] for s in info["strategies"]] == MODES.split(",")
    assert [s["kind"] for s in info["strategies"]] == ["model-backed", "model-free", "target-only"]
    assert info["strategy"] == "ref-draft"  # the default: the first
    # the library's auto on a model that is no GGUF file: target-only, which this server runs
    assert info["auto"]["name"] == "off" and info["auto"]["selection"].startswith("auto:")
    plain = client.completions.create(model=model_name, prompt="hello world", max_tokens=16)
    assert plain.model_extra["power"]["strategy"] == "ref-draft"
    assert "requested" not in _served_receipt(server, plain.id)["strategy"]
    auto = client.completions.create(model=model_name, prompt="hello world", max_tokens=16,
                                     extra_body={"power": {"strategy": "auto"}})
    receipt = _served_receipt(server, auto.id)
    assert receipt["strategy"]["name"] == "off" and receipt["strategy"]["requested"] == "auto"
    assert receipt["selection"] == info["auto"]["selection"]
    assert auto.model_extra["power"]["output_sha256"] == _power_run("auto", "hello world", 16)["output_sha256"]


def test_chat_streams_name_the_strategy_in_their_last_chunk(client, model_name):
    messages = [{"role": "user", "content": "count: one two one two"}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24,
                                           extra_body={"power": {"strategy": "suffix"}})
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, stream=True,
                                            extra_body={"power": {"strategy": "suffix"}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].model_extra["power"]["strategy"] == whole.model_extra["power"]["strategy"] == "suffix"


def test_mixed_strategies_at_once_each_equal_their_solo_run(server, client, model_name):
    """Eight requests of three strategies (and auto) on two slots at once: any slot runs any strategy,
    and each request equals ``power run --mode`` of its own, round for round."""
    jobs = [(["ref-draft", "suffix", "off", "auto"][i % 4], PROMPTS[(i + i // 4) % len(PROMPTS)]) for i in range(8)]
    solo = {(m, p): _power_run(m, p, 40) for m, p in set(jobs)}

    def go(i: int):
        mode, prompt = jobs[i]
        return client.completions.create(model=model_name, prompt=prompt, max_tokens=40,
                                         extra_body={"power": {"strategy": mode}})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(go, range(8)))
    for (mode, prompt), got in zip(jobs, results, strict=True):
        _same_run(_served_receipt(server, got.id), solo[(mode, prompt)], fresh=False)


def test_a_strategy_the_server_was_not_started_with_is_a_400_naming_it(server, client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="x", max_tokens=4,
                                  extra_body={"power": {"strategy": "mtp"}})
    err = info.value.body
    assert err["param"] == "power.strategy" and err["code"] == "strategy_not_available"
    assert "'mtp'" in err["message"] and "ref-draft, suffix, off, auto" in err["message"]
    for body, param in [({"power": {"strategy": "MTP"}}, "power.strategy"),
                        ({"power": {"strategy": 3}}, "power.strategy"),
                        ({"power": {"draft": "x.gguf"}}, "power.draft"),
                        ({"power": "suffix"}, "power")]:
        r = httpx.post(f"{server.base_url}/completions", json={"model": model_name, "prompt": "x", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    stream = httpx.post(f"{server.base_url}/chat/completions", json={
        "model": model_name, "messages": [{"role": "user", "content": "x"}], "stream": True,
        "power": {"strategy": "dflash"}})
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "power.strategy"  # before it streams
    ok = client.completions.create(model=model_name, prompt="x", max_tokens=4)  # and the server keeps serving
    assert ok.choices[0].finish_reason == "length"


def test_metrics_count_requests_by_strategy(server, client, model_name):
    def count(strategy: str) -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        line = f'power:requests_by_strategy_total{{strategy="{strategy}"}} '
        return next((float(x.removeprefix(line)) for x in text.splitlines() if x.startswith(line)), 0.0)

    before = {m: count(m) for m in MODES.split(",")}
    for m in ("suffix", "suffix", "off"):
        client.completions.create(model=model_name, prompt="x", max_tokens=4, extra_body={"power": {"strategy": m}})
    assert {m: count(m) - before[m] for m in before} == {"ref-draft": 0, "suffix": 2, "off": 1}


def test_one_mode_serves_as_it_always_did():
    with served(*BASE, "--mode", "ref-draft") as s:
        assert "strategy 'ref-draft')" in s.stderr()
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)
        name = c.models.list().data[0].id
        info = c.models.list().data[0].model_extra["power"]
        assert info["strategy"] == "ref-draft" and [x["name"] for x in info["strategies"]] == ["ref-draft"]
        plain = c.completions.create(model=name, prompt="hello world", max_tokens=16)
        named = c.completions.create(model=name, prompt="hello world", max_tokens=16,
                                     extra_body={"power": {"strategy": "ref-draft"}})
        assert plain.model_extra["power"]["output_sha256"] == named.model_extra["power"]["output_sha256"]
        assert plain.model_extra["power"]["strategy"] == named.model_extra["power"]["strategy"] == "ref-draft"
        with pytest.raises(openai.BadRequestError) as info_:
            c.completions.create(model=name, prompt="x", max_tokens=4, extra_body={"power": {"strategy": "off"}})
        assert info_.value.body["param"] == "power.strategy"


@pytest.mark.parametrize("args, needle", [
    (["--mode", "ref-draft,,off"], "an empty name"),
    (["--mode", "off,off"], "named twice"),
    (["--mode", "ref-draft,no-such-mode"], "no-such-mode"),
    (["--mode", "ref-draft,off", "--suffix-memory", "1000"], "spec_suffix_memory_tokens"),  # no listed one reads it
    (["--mode", "ref-draft,off", "--draft", "/some/draft.gguf"], "draft"),
])
def test_a_bad_mode_list_exits_2_before_binding(args, needle):
    out = subprocess.run(power_cmd("serve", *BASE, "--port", "0", *args), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr and "listening" not in out.stderr and "Traceback" not in out.stderr
