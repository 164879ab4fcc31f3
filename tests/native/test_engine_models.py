"""The round driver on llama.cpp: requests sharing target passes (one sequence each, per-sequence
KV streams) give exactly their solo outputs on SmolLM2 and Gemma-3, greedy and seeded."""

from __future__ import annotations

import threading

import pytest

from power_core import PowerConfig, Session
from power_core.numerics import batch_probe
from tests.helpers import check_host_split

pytestmark = [pytest.mark.native, pytest.mark.model, pytest.mark.slow]

QUESTIONS = ["Name three primary colors.", "What is 12 times 12?", "Write a haiku about the sea.",
             "List the days of the week.", "Give two synonyms for 'fast'."]


def _jobs() -> list[tuple[str, dict]]:
    return [(q, {"temperature": 0.8, "seed": 5} if i % 2 else {}) for i, q in enumerate(QUESTIONS)]


@pytest.mark.parametrize("model, mode", [(None, "off"), (None, "suffix"), (None, "draft-model"),
                                         ("gemma3-270m", "suffix")])
def test_shared_passes_give_every_request_its_solo_output(model, mode):
    cfg = PowerConfig(spec_mode=mode, n_threads=2, max_tokens=40, n_ctx=1024)

    def prompt(session: Session, q: str):  # Gemma-3's GGUF ships no chat template: plain text there
        return session.chat_prompt([{"role": "user", "content": q}]) if model is None else session.encode(q)

    with Session.open(cfg, model=model) as s:
        solo = [s.start(prompt(s, q), sampling=kw).run().tokens for q, kw in _jobs()]
    with Session.open_engine(3, cfg, model=model) as engine:
        assert engine.probe is not None and engine.probe.identical, engine.probe
        out: list = [None] * len(QUESTIONS)

        def go(i: int) -> None:
            q, kw = _jobs()[i]
            gen = engine.submit(prompt(engine.sessions[0], q), sampling=kw)
            out[i] = engine.run(gen)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(QUESTIONS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    for i, res in enumerate(out):
        assert res.tokens == solo[i], (i, QUESTIONS[i])
        batch = res.receipt.backend["batch"]
        assert batch["rows_identical_to_solo"] is True and batch["n_seq"] == 3
    assert max(r.receipt.backend["batch"]["peak_concurrent"] for r in out) >= 2


def test_mixed_strategies_at_random_arrivals_give_every_request_its_solo_output():
    """Eight requests on SmolLM2 over four sequences that each run off, suffix and draft-model (the target
    drafting for itself), greedy and seeded, arriving at random times: each equals its solo run."""
    import random
    import time

    cfg = PowerConfig(spec_mode="off", n_threads=2, max_tokens=32, n_ctx=1024)
    layout = ["off", "suffix", "draft-model", "suffix"]
    rng = random.Random(7)
    jobs = [(layout[i % 4], QUESTIONS[i % len(QUESTIONS)], {"temperature": 0.8, "seed": i} if i % 3 == 1 else {},
             rng.uniform(0.0, 1.5)) for i in range(8)]
    solo = {}
    for mode in set(layout):
        with Session.open(cfg, spec_mode=mode) as s:
            for i, (m, q, kw, _) in enumerate(jobs):
                if m == mode:
                    solo[i] = s.start(s.chat_prompt([{"role": "user", "content": q}]), sampling=kw).run().tokens
    with Session.open_engine(4, cfg, strategies=sorted(set(layout))) as engine:
        out: list = [None] * len(jobs)

        def go(i: int) -> None:
            mode, q, kw, delay = jobs[i]
            time.sleep(delay)
            session = engine.sessions[0]
            gen = engine.submit(session.chat_prompt([{"role": "user", "content": q}]), sampling=kw, strategy=mode)
            out[i] = engine.run(gen)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    for i, res in enumerate(out):
        assert res.receipt.strategy["name"] == jobs[i][0]
        assert res.tokens == solo[i], (i, jobs[i])
        # its share of the shared passes is target compute; a draft-model request's draft context is timed too
        check_host_split(res.receipt, draft_timed=jobs[i][0] == "draft-model")
    assert max(r.receipt.backend["batch"]["peak_concurrent"] for r in out) >= 2


@pytest.mark.parametrize("model", [None, "gemma3-270m"])
def test_batch_probe_exact_numerics_is_bit_identical(model):
    cfg = PowerConfig(spec_mode="suffix", n_threads=2, n_ctx=1024)  # verify blocks up to 33 tokens
    with Session.open_batch(3, cfg, model=model) as batch:
        report = batch_probe(batch.runtime)
    assert report.identical, report.reason()
    assert report.rows_compared >= 19


def test_each_sequence_gets_the_configured_context():
    # llama.cpp splits a non-unified context between its sequences: the batch asks for n x n_ctx
    cfg = PowerConfig(spec_mode="off", n_threads=2, n_ctx=512, max_tokens=4)
    with Session.open(cfg) as s:
        prompt = s.encode("word " * 400)
        solo = s.generate(prompt).tokens
    assert 380 < len(prompt) < 500
    with Session.open_engine(4, cfg) as engine:
        assert all(x.opened.target.capabilities.n_ctx == 512 for x in engine.sessions)
        assert engine.run(engine.submit(prompt)).tokens == solo
