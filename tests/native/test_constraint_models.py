"""Constrained output on real models: JSON schemas on SmolLM2 and Gemma-3, every strategy that
runs on them, greedy and seeded, alone and in shared passes. Speculative tokens equal constrained
``--mode off`` tokens, and every finished output validates against its schema (``jsonschema``)."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from test_models import _model_path

from power_core import PowerConfig, Session
from power_core.constraint import ConstraintSpec
from tests.bench.structured_workload import TASKS, prompt

N = 64
SEEDED = {"temperature": 0.8, "seed": 3}


def _runs(model: str, mode: str, names: list[str], sampling: dict, **cfg) -> list:
    config = PowerConfig(spec_mode=mode, max_tokens=N, n_ctx=1024, n_threads=2, **cfg)
    with Session.open(config, model=model, draft=model if mode == "draft-model" else None) as s:
        return [s.start(prompt(n), sampling=sampling, constraint=ConstraintSpec.json_schema(TASKS[n][0])).run()
                for n in names]


def _check(names: list[str], got: list, want: list, mode: str) -> None:
    for name, g, w in zip(names, got, want, strict=True):
        assert g.tokens == w.tokens, f"{mode}, task {name}: {g.text!r} != off's {w.text!r}"
        if w.receipt.finish_reason == "stop":
            jsonschema.validate(json.loads(w.text), TASKS[name][0])


@pytest.fixture(scope="module")
def smollm2_off():
    model = _model_path("smollm2")
    names = sorted(TASKS)
    return model, names, {k: _runs(model, "off", names, s) for k, s in (("greedy", {}), ("seeded", SEEDED))}


@pytest.mark.parametrize("mode", ["suffix", "draft-model"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_json_schemas_on_smollm2_equal_off(smollm2_off, mode, sampling):
    model, names, off = smollm2_off
    got = _runs(model, mode, names, SEEDED if sampling == "seeded" else {},
                **({"spec_draft_max": 4} if mode == "draft-model" else {}))
    _check(names, got, off[sampling], mode)
    finished = [w for w in off[sampling] if w.receipt.finish_reason == "stop"]
    assert len(finished) >= len(names) // 2, "most tasks should finish their JSON within the token budget"
    assert sum(g.receipt.summary()["accepted"] for g in got) > 0
    if mode == "suffix":  # it copies the example's JSON and what follows it: the grammar cuts after the end
        assert sum(g.receipt.constraint["cuts"] for g in got) > 0


def test_json_schemas_in_shared_passes_on_smollm2(smollm2_off):
    """Four concurrent constrained requests in shared target passes, greedy and seeded mixed, each
    with its own schema: each equals its solo constrained off run."""
    model, names, off = smollm2_off
    picks = names[:8]
    engine = Session.open_engine(4, PowerConfig(spec_mode="suffix", max_tokens=N, n_ctx=1024, n_threads=2),
                                 model=model)
    got: dict[int, object] = {}

    def go(i: int) -> None:
        sampling = SEEDED if i % 2 else {}
        gen = engine.submit(prompt(picks[i]), sampling=sampling,
                            constraint=ConstraintSpec.json_schema(TASKS[picks[i]][0]))
        got[i] = engine.run(gen)

    with engine:
        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(picks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    for i, name in enumerate(picks):
        want = off["seeded" if i % 2 else "greedy"][names.index(name)]
        assert got[i].tokens == want.tokens, f"task {name} in shared passes differs from its solo run"
        assert got[i].receipt.backend.get("batch") is not None


@pytest.mark.parametrize("mode", ["suffix", "draft-model"])
def test_json_schemas_on_gemma_equal_off(mode):
    model = _model_path("gemma3-270m")
    names = ["order", "person", "flags", "tool_args"]
    for sampling in ({}, SEEDED):
        want = _runs(model, "off", names, sampling)
        got = _runs(model, mode, names, sampling, **({"spec_draft_max": 4} if mode == "draft-model" else {}))
        _check(names, got, want, mode)


def test_penalties_and_bias_on_smollm2_equal_off():
    model = _model_path("smollm2")
    knobs = dict(repeat_penalty=1.15, repeat_last_n=64, frequency_penalty=0.3, presence_penalty=0.2,
                 logit_bias=((28, -2.0), (198, 1.0)))
    text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef"
    outs = {}
    for mode in ("off", "suffix"):
        with Session.open(PowerConfig(spec_mode=mode, max_tokens=N, n_threads=2), model=model) as s:
            outs[mode] = [s.generate(text, sampling=dict(knobs, **extra)).tokens for extra in ({}, SEEDED)]
    assert outs["suffix"] == outs["off"]
    with Session.open(PowerConfig(spec_mode="off", max_tokens=N, n_threads=2), model=model) as s:
        assert s.generate(text).tokens != outs["off"][0], "the penalties changed nothing: the check is vacuous"
