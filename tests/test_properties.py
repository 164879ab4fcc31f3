"""Property-based exactness: random reference models, prompts, K, S, acceptance profiles and seeds."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from power_core.errors import Cancelled, PowerError
from power_core.testing.faults import FaultInjector
from power_core.transaction import PHASES, CancelToken
from tests.helpers import open_session, run

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scenarios(draw, stochastic: bool = False):
    vocab = draw(st.integers(8, 97))
    model = (f"reference:seed={draw(st.integers(0, 10_000))},vocab={vocab},dim={draw(st.integers(4, 16))},"
             f"recurrent={draw(st.integers(0, 1))},sharp={draw(st.sampled_from([1.0, 3.0, 8.0]))}")
    k = draw(st.integers(1, 16))
    s = draw(st.integers(1, k))
    profile = draw(st.sampled_from(["own", "noisy", "other"]))
    if profile == "own":
        draft = None
    elif profile == "noisy":
        draft = f"reference:accept={draw(st.sampled_from([0.0, 0.3, 0.7, 0.9]))}"
    else:
        draft = f"reference:seed={draw(st.integers(0, 10_000))},vocab={vocab},dim=8,recurrent=0"
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12))
    cfg = dict(spec_draft_max=k, spec_recurrent_snapshots=s, max_tokens=draw(st.integers(1, 40)),
               spec_adaptive=draw(st.booleans()))
    if stochastic:
        cfg.update(temperature=draw(st.floats(0.2, 1.5)), top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
                   top_k=draw(st.sampled_from([0, 5, 20])), seed=draw(st.integers(0, 2**32)))
    return model, draft, prompt, cfg


def _reference(model, prompt, cfg):
    base = {k: v for k, v in cfg.items() if k not in ("spec_recurrent_snapshots", "spec_adaptive")}
    return run(model, prompt, "off", **base)


@SETTINGS
@given(scenarios())
def test_greedy_parity(scenario):
    model, draft, prompt, cfg = scenario
    spec = run(model, prompt, "ref-draft", draft, **cfg)
    ref = _reference(model, prompt, cfg)
    assert spec.tokens == ref.tokens
    assert spec.receipt.output_sha256 == ref.receipt.output_sha256
    # every round emits exactly one correction/bonus beyond its accepted proposals
    for r in spec.receipt.rounds:
        assert r["emitted"] in (r["accepted"], r["accepted"] + 1)


@SETTINGS
@given(scenarios(stochastic=True))
def test_seeded_stochastic_parity(scenario):
    model, draft, prompt, cfg = scenario
    assert run(model, prompt, "ref-draft", draft, **cfg).tokens == _reference(model, prompt, cfg).tokens


@SETTINGS
@given(scenarios(), st.sampled_from(PHASES[:-1]), st.integers(0, 5), st.sampled_from(["before", "after"]),
       st.sampled_from(["raise", "cancel"]))
def test_fault_and_cancel_restore_exactly(scenario, phase, round_index, when, action):
    model, draft, prompt, cfg = scenario
    ref = _reference(model, prompt, cfg).tokens
    cancel = CancelToken()
    inj = FaultInjector(phase=phase, round_index=round_index, when=when, action=action, cancel=cancel)
    with open_session(model, "ref-draft", draft, inj, **cfg) as s:
        gen = s.start(prompt, cancel=cancel)
        try:
            gen.run()
        except (Cancelled, PowerError):
            assert inj.fired == 1
            assert gen.tokens == ref[: len(gen.tokens)]
            assert s.opened.target.n_past == len(prompt) - 1 + max(len(gen.tokens), 1)
            cancel.reset()
            assert gen.run().tokens == ref
        else:
            # the request finished before the injection point (or a cancel at emit hit the last round)
            assert gen.tokens == ref
            assert inj.fired == 0 or (action == "cancel" and phase == "emit")


@pytest.mark.parametrize("k,s", [(7, 7), (7, 6), (5, 1), (16, 3)])
def test_decode_work_accounts_for_replays(k, s):
    """Every replay re-decodes exactly the accepted prefix: decoded tokens = prompt-1 + shapes + replays."""
    model = "reference:seed=3,vocab=50,dim=8,recurrent=1"
    prompt = [1, 2, 3, 4]
    with open_session(model, "ref-draft", "reference:seed=4,vocab=50,dim=8,recurrent=0",
                      spec_draft_max=k, spec_recurrent_snapshots=s, max_tokens=30) as sess:
        res = sess.generate(prompt)
        rounds = res.receipt.rounds
        expected = len(prompt) - 1 + sum(r["shape"] for r in rounds) + sum(r["emitted"] for r in rounds
                                                                           if r["replayed"])
        assert sess.opened.target.decoded_tokens == expected
        assert res.receipt.replays <= 1
