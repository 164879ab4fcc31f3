"""Each sentence of the seed's scheduling section, reproduced."""

from __future__ import annotations

from power_core.config import PowerConfig
from power_core.scheduler import RoundOutcome, Scheduler
from tests.helpers import open_session, run

MODEL = "reference:seed=21,vocab=64,dim=12,recurrent=1"
PROMPT = [5, 9, 2, 7]
OTHER = "reference:seed=99,vocab=64,dim=8,recurrent=0"  # a poor draft: mostly rejected at 0


def scheduled(res):
    """Rounds the scheduler planned (round 0 emits from the prefill's row and proposes nothing)."""
    assert res.receipt.rounds[0]["reason"] == "prefill" and res.receipt.rounds[0]["proposed"] == 0
    return res.receipt.rounds[1:]


def sched(k=7, s=7, adaptive=False, window="s", **kw):
    cfg = PowerConfig(spec_mode="ref-draft", spec_draft_max=k, spec_recurrent_snapshots=s,
                      spec_adaptive=adaptive, **kw)
    return Scheduler.for_request(cfg, s if window == "s" else window)


def test_spec_draft_max_bounds_width_and_snapshots_bound_rollback():
    """spec_draft_max bounds proposal width. spec_recurrent_snapshots bounds resident rollback state."""
    res = run(MODEL, PROMPT, "ref-draft", spec_draft_max=3, spec_recurrent_snapshots=2, max_tokens=30)
    assert max(r["proposed"] for r in res.receipt.rounds) <= 3
    with open_session(MODEL, "ref-draft", spec_draft_max=3, spec_recurrent_snapshots=2) as s:
        assert s.opened.target.capabilities.rollback_window == 2


def test_k7_s7_keeps_a_rollback_point_for_every_proposed_token():
    """K7/S7 keeps a rollback point for every proposed token ... avoids the replay condition entirely."""
    res = run(MODEL, PROMPT, "ref-draft", OTHER, spec_draft_max=7, spec_recurrent_snapshots=7, max_tokens=40)
    assert res.receipt.replays == 0
    assert any(r["shape"] - r["emitted"] == 7 for r in res.receipt.rounds)  # full-depth rollbacks happened
    assert res.receipt.scheduler["mode"] == "balanced"


def test_k7_s7_is_the_balanced_default():
    cfg = PowerConfig()  # K unset: the strategy's default, else 7
    assert (cfg.spec_draft_max, cfg.draft_max, cfg.snapshots, cfg.spec_adaptive) == (None, 7, 7, False)


def test_k7_s6_rejected_suffix_may_exceed_window_and_replays_once_then_clamps_to_six():
    """K7/S6: a rejected suffix may exceed the resident window. Power's guarded K7/S6 path permits one
    exact replay, then clamps all later rounds in that request to six proposals."""
    res = run(MODEL, PROMPT, "ref-draft", OTHER, spec_draft_max=7, spec_recurrent_snapshots=6, max_tokens=40)
    rounds = scheduled(res)
    first = next(i for i, r in enumerate(rounds) if r["replayed"])
    assert rounds[first]["shape"] - rounds[first]["emitted"] == 7  # depth 7 > S=6
    assert res.receipt.replays == 1
    assert all(r["planned"] == 7 for r in rounds[: first + 1])
    assert all(r["planned"] == 6 and r["reason"] == "clamped-after-replay" for r in rounds[first + 1:])
    assert res.receipt.scheduler["events"][0]["event"] == "clamp"
    assert res.tokens == run(MODEL, PROMPT, "off", max_tokens=40).tokens


def test_guard_leaves_high_acceptance_requests_unchanged():
    """The guard bounds replay without changing requests that remain on the high-acceptance path."""
    res = run(MODEL, PROMPT, "ref-draft", None, spec_draft_max=7, spec_recurrent_snapshots=6, max_tokens=40)
    assert res.receipt.replays == 0 and res.receipt.scheduler["clamp"] is None
    assert all(r["planned"] == 7 for r in scheduled(res)[:-1])


def test_adaptive_starts_at_min_k_s():
    """The opt-in request-local controller ... starts at min(K, S)."""
    s = sched(7, 6, adaptive=True)
    assert s.plan().k == 6 and s.plan().reason == "probe"
    s = sched(4, 4, adaptive=True)
    assert s.plan().k == 4


def test_adaptive_opens_wide_only_after_fully_accepted_probe():
    s = sched(7, 6, adaptive=True)
    p = s.plan()
    s.record(p, RoundOutcome(proposed=6, accepted=6, replayed=False))
    assert s.plan().k == 7 and s.wide_open is True
    assert s.events[-1]["event"] == "open-wide"


def test_adaptive_closes_wide_path_after_partial_first_round():
    s = sched(7, 6, adaptive=True)
    p = s.plan()
    s.record(p, RoundOutcome(proposed=6, accepted=4, replayed=False))
    assert s.wide_open is False and s.events[-1]["event"] == "close-wide"
    for _ in range(5):  # later full rounds never reopen it
        q = s.plan()
        assert q.k == 6
        s.record(q, RoundOutcome(proposed=6, accepted=6, replayed=False))


def test_adaptive_does_not_use_replay_as_first_signal():
    """It avoids using replay as its first signal: the probe at min(K,S) can never replay."""
    res = run(MODEL, PROMPT, "ref-draft", OTHER, spec_draft_max=7, spec_recurrent_snapshots=6,
              spec_adaptive=True, max_tokens=40)
    assert res.receipt.replays == 0
    assert scheduled(res)[0]["planned"] == 6


def test_healthy_partial_rounds_retain_shape():
    """Healthy partial rounds retain their graph shape."""
    s = sched(7, 6, adaptive=True, spec_adaptive_low_yield=0.25)
    s.record(s.plan(), RoundOutcome(6, 6, False))  # open wide
    for accepted in (3, 5, 2, 4, 6, 3):
        p = s.plan()
        assert p.k == 7 and p.reason == "wide"
        s.record(p, RoundOutcome(7, accepted, False))
    assert not s.circuit_open


def test_sustained_low_yield_opens_one_way_target_only_circuit():
    """Sustained low-yield rounds open a one-way target-only circuit."""
    s = sched(7, 7, adaptive=True, spec_adaptive_low_yield=0.25, spec_adaptive_low_yield_rounds=3)
    s.record(s.plan(), RoundOutcome(7, 0, False))
    s.record(s.plan(), RoundOutcome(7, 1, False))
    assert not s.circuit_open
    s.record(s.plan(), RoundOutcome(7, 0, False))
    assert s.circuit_open and s.plan().k == 0 and s.plan().reason == "circuit-open"
    s.record(s.plan(), RoundOutcome(0, 0, False))
    assert s.plan().k == 0  # one-way


def test_low_yield_streak_resets_on_a_good_round():
    s = sched(7, 7, adaptive=True, spec_adaptive_low_yield_rounds=3)
    for accepted in (0, 0, 6, 0, 0):
        s.record(s.plan(), RoundOutcome(7, accepted, False))
    assert not s.circuit_open


def test_circuit_end_to_end_and_exact():
    res = run(MODEL, PROMPT, "ref-draft", OTHER, spec_draft_max=7, spec_adaptive=True, max_tokens=40,
              spec_adaptive_low_yield_rounds=2)
    assert res.receipt.scheduler["circuit_open"]
    reasons = [r["reason"] for r in res.receipt.rounds]
    first = reasons.index("circuit-open")
    assert all(x == "circuit-open" for x in reasons[first:])
    assert all(r["proposed"] == 0 for r in res.receipt.rounds[first:])
    assert res.tokens == run(MODEL, PROMPT, "off", max_tokens=40).tokens


def test_legacy_key_spec_mtp_adaptive_selects_the_controller(tmp_path):
    """The legacy ACL key remains spec_adaptive."""
    f = tmp_path / "power.toml"
    f.write_text('spec_mode = "mtp"\nspec_draft_max = 7\nspec_mtp_recurrent_snapshots = 6\nspec_mtp_adaptive = true\n')
    cfg = PowerConfig.from_toml(f)
    assert Scheduler.for_request(cfg, 6).adaptive


def test_attention_only_target_never_replays_and_window_zero_never_clamps():
    s = sched(7, 6, window=None)
    assert not s.guarded and s.plan().k == 7
    z = sched(7, 6, window=0)
    z.record(z.plan(), RoundOutcome(7, 0, True))
    assert z.clamp is None and z.replays == 1


def test_one_scheduler_for_every_model_backed_strategy():
    """The same scheduler is shared by every model-backed adapter: the session builds it, not the adapter."""
    with open_session(MODEL, "ref-draft", spec_draft_max=5) as s:
        gen = s.start(PROMPT)
        gen.run()
        assert type(gen.txn.scheduler) is Scheduler


# -- cost-aware width --------------------------------------------------------------------------------
def _cost_aware(costs):
    from power_core.config import PowerConfig
    from power_core.scheduler import Scheduler

    return Scheduler.for_request(PowerConfig(spec_mode="suffix", spec_draft_max=32), None, costs=costs)


def test_choose_width_maximizes_expected_tokens_per_cost():
    costs = (1.0, 2.05, 2.5, 3.0, 4.3, 3.9)  # some widths are cheaper than smaller ones
    s = _cost_aware(costs)
    w, info = s.choose_width([0.99] * 5, 5)
    # brute force over the same objective
    best = max(range(6), key=lambda w: sum(0.99 ** i for i in range(w + 1)) / costs[w])
    assert w == best == 5 and info["chosen"] == 5 and info["offered"] == 5
    assert abs(info["gain"] - sum(0.99 ** i for i in range(6)) / costs[5]) < 1e-3


def test_choose_width_zero_when_nothing_pays_then_backs_off():
    from power_core.scheduler import RoundOutcome

    s = _cost_aware((1.0, 2.05, 3.0, 4.5))
    w, info = s.choose_width([0.6, 0.6, 0.6], 3)
    assert w == 0 and info["expected_tokens"] == 1.0
    plans = []
    for _ in range(6):
        plan = s.plan()
        plans.append(plan.reason)
        s.record(plan, RoundOutcome(proposed=0, accepted=0, replayed=False, offered=3 if plan.k else 0))
    assert plans == ["balanced", "backoff", "balanced", "backoff", "backoff", "backoff"]


def test_choose_width_without_costs_keeps_everything():
    s = _cost_aware(None)
    assert s.costs is None


def test_width_under_load_weighs_the_whole_shared_pass():
    from power_core.scheduler import PassLoad, Scheduler

    # a CPU-like curve: flat while memory-bound, then one token's cost per token
    costs = (1.0, 1.05, 1.1, 1.15, 1.2, 2.2, 3.2, 4.2)
    sched = Scheduler(k_max=7, window=None, costs=costs)
    conf = [0.6] * 7
    solo, info = sched.choose_width(conf, 7)
    assert solo == 4 and "shared_pass" not in info
    loaded, info = sched.choose_width(conf, 7, PassLoad(tokens=20, requests=5))
    assert loaded == 1 and info["shared_pass"] == {"tokens": 20, "requests": 5}
    # a pass that only holds one other anchor is still nearly flat: speculation still pays
    light, _ = sched.choose_width(conf, 7, PassLoad(tokens=1, requests=1))
    assert 1 <= light <= solo
    # hopeless proposals are not verified under load
    none, _ = sched.choose_width([0.05] * 7, 7, PassLoad(tokens=20, requests=5))
    assert none == 0


def test_passes_wider_than_the_curve_follow_its_widest_half_not_its_last_step():
    """A CPU curve is not smooth in the width (a multiple of 8 tokens can cost less than 7) and its
    last step may be an outlier: wider passes are priced by the line through the widest half."""
    from power_core.scheduler import PassLoad, Scheduler, _tail_line

    # Gemma-3-270M on a 2-core CPU (measured): cheap at multiples of 8, the last step 1.59
    costs = (1.0, 2.14, 2.85, 2.98, 4.27, 4.83, 5.46, 3.94, 5.22, 5.63, 6.34, 4.96, 6.18, 6.63, 7.4, 5.49,
             6.87, 7.11, 7.86, 6.43, 11.23, 8.5, 9.06, 7.77, 9.18, 9.55, 10.0, 8.82, 10.18, 10.77, 11.0, 9.77, 11.36)
    intercept, slope = _tail_line(costs)
    assert 0.15 < slope < 0.4  # about a quarter of a one-token pass per token, not 1.59
    sched = Scheduler(k_max=32, window=None, costs=costs)
    # 40 tokens of other requests already in the pass; proposals that are nearly sure to be accepted
    w, info = sched.choose_width([0.95] * 16, 16, PassLoad(tokens=40, requests=3))
    assert w >= 8, info
    assert info["relative_cost"] == round(intercept + slope * (40 + w), 4)
    # alone, the dips are real: a pass of 8 tokens is cheaper than one of 7
    solo, _ = sched.choose_width([0.9] * 6 + [0.5] * 10, 16)
    assert solo + 1 in (8, 16, 24, 32)
    assert _tail_line((1.0,)) == (0.0, 1.0) and _tail_line((1.0, 3.0)) == (1.0, 2.0)
