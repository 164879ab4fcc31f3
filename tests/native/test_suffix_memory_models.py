"""power-suffix's memory on a real model (SmolLM2-135M-Instruct, exact numerics): the output equals
``--mode off`` with the cross-request memory cold, warm, shared by four concurrent requests and with
a corpus; the warm memory drafts from earlier requests (receipt ``proposer.sources``)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("power_native._llama")
pytest.importorskip("power_suffix")

from test_models import _model_path  # noqa: E402

from power_core.config import PowerConfig  # noqa: E402
from power_core.session import Session  # noqa: E402

pytestmark = [pytest.mark.native, pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "List the first five planets of the solar system, one per line.",
    "Write a Python function that adds two numbers.",
    "List the first five planets of the solar system, one per line.",
    "Write a Python function that adds two numbers.",
]
BASE = dict(max_tokens=40, n_threads=2, n_ctx=512)


@pytest.fixture(scope="module")
def smollm2() -> str:
    return _model_path("smollm2")


@pytest.fixture(scope="module")
def off(smollm2) -> list[tuple[int, ...]]:
    with Session.open(PowerConfig(spec_mode="off", **BASE), model=smollm2) as s:
        return [s.chat([{"role": "user", "content": p}]).tokens for p in PROMPTS]


def test_cold_and_warm_memory_equal_off(smollm2, off):
    cfg = PowerConfig(spec_mode="suffix", spec_suffix_memory_tokens=1 << 16, **BASE)
    with Session.open(cfg, model=smollm2) as s:
        got = [s.chat([{"role": "user", "content": p}]) for p in PROMPTS]
    assert [g.tokens for g in got] == off
    # the repeated prompts find their earlier answers in the memory (the first two run cold)
    warm = [g.receipt.to_dict()["proposer"]["sources"] for g in got[2:]]
    assert any(s.get("shared", {}).get("accepted", 0) > 0 for s in warm), warm


def test_four_concurrent_requests_and_a_corpus_equal_off(smollm2, off):
    cfg = PowerConfig(spec_mode="suffix", spec_suffix_memory_tokens=1 << 16,
                      spec_suffix_corpus=[str(ROOT / "docs" / "examples")], **BASE)
    engine = Session.open_engine(4, cfg, model=smollm2)  # four sequences sharing target passes
    try:
        assert len({id(s.proposer.memory) for s in engine.sessions}) == 1
        assert engine.sessions[0].proposer.memory.stats().corpus_tokens > 0
        got: list = [None] * len(PROMPTS)

        def run(i: int) -> None:
            s = engine.sessions[0]
            prompt = s.chat_prompt([{"role": "user", "content": PROMPTS[i]}])
            got[i] = engine.run(engine.submit(prompt))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [g.tokens for g in got] == off
    finally:
        engine.close()
