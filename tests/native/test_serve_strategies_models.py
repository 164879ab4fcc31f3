"""Several strategies on one llama.cpp target (``power serve --mode a,b,c``; :meth:`Session.open`'s
``strategies``). On the tiny hybrid MTP target, every sequence of a shared-pass engine carries MTP,
suffix, off and draft-model, and requests of any of them at random arrivals each emit, and their
drafters offer, what they do in a session of that strategy alone. On SmolLM2 a real ``power serve``
process answers the official client's per-request strategy (``extra_body``) as ``power run --mode``
of that strategy does."""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time

import httpx
import openai
import pytest

pytest.importorskip("power_native._llama")

from power_core import PowerConfig, Session  # noqa: E402
from tests.serve_helpers import power_cmd, served  # noqa: E402

pytestmark = pytest.mark.native

PROMPTS = [[1, 5, 9, 3, 7, 2, 8, 4], [17], [100, 3, 3, 3, 3, 64, 2, 90, 11, 45, 12, 9, 70], [5] * 30, [9, 8, 7]]


def _proposals(result) -> list:
    return [r.get("proposal") for r in result.receipt.to_dict()["rounds"]]


def test_every_sequence_runs_any_strategy_of_an_mtp_target_at_random_arrivals(tiny_qwen35_mtp):
    pytest.importorskip("power_mtp._mtp")
    pytest.importorskip("power_suffix")
    model = str(tiny_qwen35_mtp)
    modes = ["mtp", "suffix", "off", "draft-model"]  # draft-model: the target drafting for itself
    cfg = PowerConfig(max_tokens=24, n_ctx=256, n_threads=2, trace=True)
    rng = random.Random(5)
    jobs = [(modes[(i + i // 4) % 4], PROMPTS[i % len(PROMPTS)], {"temperature": 0.7, "seed": i} if i % 3 == 1
             else {}, rng.uniform(0.0, 0.3)) for i in range(8)]
    solo: dict[int, object] = {}
    for mode in modes:
        with Session.open(cfg, model=model, spec_mode=mode, draft=model if mode == "draft-model" else None) as s:
            for i, (own, prompt, kw, _) in enumerate(jobs):
                if own == mode:
                    solo[i] = s.start(prompt, sampling=kw).run()
    with Session.open_engine(4, cfg, model=model, draft=model, strategies=modes, cache_prompt=True) as engine:
        s0 = engine.sessions[0]
        assert [lane.name for lane in s0.lanes] == modes
        assert s0.lane("auto").name == "mtp" and "MTP" in s0.auto_reason  # the library's auto on this target
        assert not s0.lane("mtp").reuses_prompts and s0.lane("suffix").reuses_prompts
        out: list = [None] * len(jobs)
        ran_on: list = [None] * len(jobs)

        def go(i: int) -> None:
            mode, prompt, kw, delay = jobs[i]
            time.sleep(delay)
            session = engine.acquire()
            ran_on[i] = session
            out[i] = engine.run(session.start(prompt, sampling=kw, strategy=mode))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    for i, res in enumerate(out):
        assert res.receipt.strategy["name"] == jobs[i][0]
        assert res.tokens == solo[i].tokens, (i, jobs[i][0])
        if jobs[i][0] != "suffix":  # suffix's proposer learns across requests: its order differs
            assert _proposals(res) == _proposals(solo[i]), (i, jobs[i][0])
    assert max(r.receipt.backend["batch"]["peak_concurrent"] for r in out) >= 2
    assert len({id(s) for s in ran_on}) > 1


def test_auto_among_the_strategies_falls_back_to_target_only(tiny_qwen35_mtp):
    pytest.importorskip("power_suffix")
    with Session.open(PowerConfig(n_ctx=256, n_threads=2), model=str(tiny_qwen35_mtp),
                      strategies=["suffix", "off"]) as s:
        assert s.lane("auto").name == "off" and s.auto_reason.startswith("auto:")


@pytest.mark.model
@pytest.mark.slow
def test_a_served_request_s_strategy_equals_power_run_on_smollm2():
    pytest.importorskip("power_suffix")
    base = ["--threads", "2", "--n-ctx", "512", "--trace"]
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    with served(*base, "--mode", "suffix,draft-model,off", "--parallel", "2") as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=120)
        name = c.models.list().data[0].id
        listed = [x["name"] for x in c.models.list().data[0].model_extra["power"]["strategies"]]
        assert listed == ["suffix", "draft-model", "off"]
        for mode in listed:
            out = subprocess.run(power_cmd("run", *base, "--mode", mode, "--json", "--prompt", prompt,
                                           "--max-tokens", "24"), capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr
            solo = json.loads(out.stdout)
            got = c.completions.create(model=name, prompt=prompt, max_tokens=24,
                                       extra_body={"power": {"strategy": mode}})
            assert got.choices[0].text == solo["text"], mode
            power = got.model_extra["power"]
            assert power["strategy"] == mode and power["output_sha256"] == solo["receipt"]["output_sha256"]
            receipt = httpx.get(f"{s.url}/v1/receipts/{got.id}", timeout=10).json()["receipt"]
            assert receipt["strategy"]["requested"] == mode
            assert [r.get("proposal") for r in receipt["rounds"]] == [
                r.get("proposal") for r in solo["receipt"]["rounds"]], mode
