"""Model-backed drafters in shared target passes (the round driver on llama.cpp): MTP and the DFlash
family read the target's hidden-state taps, which a shared pass gives per sequence (one row per pass
token, in batch order), and each sequence has its own draft context; hybrid targets keep one
recurrent state per sequence, rolled back in place through its own ``n_rs_seq`` snapshots or
restored and replayed alone. Every request emits, and its drafter offers, exactly what it does
in a session of its own — greedy and seeded, at random arrival times, with strategies mixed, and
when a neighbour is cancelled or its proposer fails."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import attrs
import pytest

pytest.importorskip("power_native._llama")
pytest.importorskip("power_mtp._mtp")

from native_helpers import make_tiny_draft, make_tiny_mtp  # noqa: E402

from power_core import PowerConfig, Session  # noqa: E402
from power_core.errors import AdapterFault, Cancelled  # noqa: E402
from tests.helpers import Flaky  # noqa: E402

pytestmark = pytest.mark.native

PROMPTS = [[1, 5, 9, 3, 7, 2, 8, 4], [17], [100, 3, 3, 3, 3, 64, 2, 90, 11, 45, 12, 9, 70], [5] * 30, [9, 8, 7]]
SAMPLING = [{} if i % 2 == 0 else {"temperature": 0.8, "seed": i} for i in range(len(PROMPTS))]
BLOCK_KINDS = {"dflash": dict(kind="dflash", d2t=96), "dflash2": dict(kind="dflash2", borrow=True),
               "dspark": dict(kind="dspark", block_size=16)}


def _proposals(result) -> list:
    return [r["proposal"] for r in result.receipt.to_dict()["rounds"]]


def _solo(cfg: PowerConfig, model: Path, draft: Path | None = None) -> list:
    with Session.open(cfg, model=str(model), draft=str(draft) if draft else None) as s:
        return [s.start(p, sampling=kw).run() for p, kw in zip(PROMPTS, SAMPLING, strict=True)]


def _shared(cfg: PowerConfig, model: Path, draft: Path | None = None, n: int = 3) -> list:
    with Session.open_engine(n, cfg, model=str(model), draft=str(draft) if draft else None) as engine:
        assert engine.probe is not None and engine.probe.identical, engine.probe
        out: list = [None] * len(PROMPTS)

        def go(i: int) -> None:
            out[i] = engine.run(engine.submit(PROMPTS[i], sampling=SAMPLING[i]))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    return out


def _check(shared: list, solo: list, strategy: str) -> None:
    for i, (res, alone) in enumerate(zip(shared, solo, strict=True)):
        assert res is not None, i
        assert res.receipt.strategy["name"] == strategy
        assert res.tokens == alone.tokens, (i, PROMPTS[i])
        assert _proposals(res) == _proposals(alone), i  # its drafter saw its own taps, not a neighbour's
        assert res.receipt.backend["batch"]["rows_identical_to_solo"] is True
    assert max(r.receipt.backend["batch"]["peak_concurrent"] for r in shared) >= 2


@pytest.fixture(scope="module")
def mtp_targets(tiny_dir, tiny_qwen35_mtp, tiny_qwen3next_mtp) -> dict[str, Path]:
    return {"qwen35": tiny_qwen35_mtp, "qwen3next": tiny_qwen3next_mtp, "glm4moe": make_tiny_mtp(tiny_dir, "glm4moe"),
            "qwen35-predictable": make_tiny_mtp(tiny_dir, "qwen35", predictable=True, name="qwen35-mtp-predictable")}


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next", "glm4moe", "qwen35-predictable"])
def test_mtp_in_shared_passes_equals_its_solo_run(mtp_targets, arch):
    """qwen35: hybrid, rolled back in place per sequence; qwen3next: hybrid without ``n_rs_seq``
    (every rejection restores its sequence and replays it alone, while the other rounds of that pass
    still read their rows); glm4moe: attention only; predictable: most drafts accepted."""
    cfg = PowerConfig(spec_mode="mtp", max_tokens=40, n_ctx=256, n_threads=2, trace=True)
    solo = _solo(cfg, mtp_targets[arch])
    shared = _shared(cfg, mtp_targets[arch])
    _check(shared, solo, "mtp")
    rounds = [r for res in shared for r in res.receipt.to_dict()["rounds"]]
    replayed = sum(r["replayed"] for r in rounds)
    accepted = sum(r["accepted"] for r in rounds)
    if arch == "qwen3next":
        assert replayed > 0
    elif arch == "qwen35":
        assert replayed == 0 and sum(res.receipt.backend["rollback"]["rollback_in_place"] for res in shared) > 0
    if arch == "qwen35-predictable":
        assert accepted > len(rounds)  # several accepted drafts per round


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("mode", sorted(BLOCK_KINDS))
def test_block_drafts_in_shared_passes_equal_their_solo_run(tiny_dir, tiny_llama, tiny_qwen35, arch, mode):
    target = {"llama": tiny_llama, "qwen35": tiny_qwen35}[arch]
    draft = make_tiny_draft(tiny_dir, target, name=f"{arch}-{mode}", **BLOCK_KINDS[mode])
    cfg = PowerConfig(spec_mode=mode, max_tokens=40, n_ctx=256, n_threads=2, trace=True)
    _check(_shared(cfg, target, draft), _solo(cfg, target, draft), mode)


def test_mixed_strategies_on_a_hybrid_mtp_target_at_random_arrivals(tiny_qwen35_mtp):
    """Eight requests over four sequences of one hybrid MTP target that each run off, suffix, MTP and
    draft-model (the target drafting for itself), greedy and seeded, arriving at random times."""
    cfg = PowerConfig(spec_mode="off", max_tokens=32, n_ctx=256, n_threads=2, trace=True)
    model = str(tiny_qwen35_mtp)
    layout = ["off", "suffix", "mtp", "draft-model"]
    rng = random.Random(11)
    jobs = [(layout[i % 4], PROMPTS[i % len(PROMPTS)], {"temperature": 0.7, "seed": i} if i % 3 == 1 else {},
             rng.uniform(0.0, 0.4)) for i in range(8)]
    solo: dict[int, object] = {}
    for mode in layout:
        with Session.open(cfg, model=model, spec_mode=mode) as s:
            for i, (own, prompt, kw, _) in enumerate(jobs):
                if own == mode:
                    solo[i] = s.start(prompt, sampling=kw).run()
    with Session.open_engine(4, cfg, model=model, strategies=layout) as engine:
        assert engine.probe is not None and engine.probe.identical
        out: list = [None] * len(jobs)

        def go(i: int) -> None:
            mode, prompt, kw, delay = jobs[i]
            time.sleep(delay)
            out[i] = engine.run(engine.submit(prompt, sampling=kw, strategy=mode))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for i, res in enumerate(out):
        assert res.receipt.strategy["name"] == jobs[i][0]
        assert res.tokens == solo[i].tokens, (i, jobs[i])
        if jobs[i][0] != "suffix":  # suffix's tree also holds earlier requests' outputs: their order differs
            assert _proposals(res) == _proposals(solo[i]), i
    assert max(r.receipt.backend["batch"]["peak_concurrent"] for r in out) >= 2


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_a_cancelled_and_a_faulted_mtp_request_leave_the_others_unchanged(mtp_targets, arch):
    cfg = PowerConfig(spec_mode="mtp", max_tokens=40, n_ctx=256, n_threads=2)
    model = mtp_targets[arch]
    prompts = PROMPTS[:4]
    with Session.open(cfg, model=str(model)) as s:
        solo = [s.generate(p).tokens for p in prompts]
    with Session.open_engine(4, cfg, model=str(model)) as engine:
        gens = [engine.submit(p) for p in prompts]
        victim, faulty = gens[1], gens[2]
        faulty.session.proposer = Flaky(faulty.session.proposer, fail_at=4)
        results: list = [None] * len(gens)

        def go(i: int) -> None:
            try:
                for k, _ in enumerate(engine.rounds(gens[i])):
                    if gens[i] is victim and k == 3:
                        victim.cancel.cancel()
                results[i] = gens[i].result()
            except (Cancelled, AdapterFault) as exc:
                results[i] = exc

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(gens))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert isinstance(results[1], Cancelled) and victim.receipt.status == "cancelled"
    assert victim.tokens == solo[1][: len(victim.tokens)]  # what it committed is its solo prefix
    assert isinstance(results[2], AdapterFault) and faulty.receipt.status == "failed"
    for i in (0, 3):
        assert results[i].tokens == solo[i], i


def _batched_rounds(shared: list, k: int) -> list:
    """The rounds whose draft ran in a batch of several requests: each ran at most K draft passes (one
    per step for all of them), never one per request and step."""
    batched = [r for res in shared for r in res.receipt.to_dict()["rounds"]
               if (r.get("stats") or {}).get("draft_batch", 1) > 1]
    for r in batched:
        assert r["stats"]["draft_passes"] <= k, r
    return batched


def _run_together(engine, gens: list, order: tuple[int, ...] | None = None) -> list:
    """Run every request of ``gens`` on its own thread (started in ``order``), all joining the same first
    pass whatever the machine's load; their results in ``gens``' order."""
    out: list = [None] * len(gens)

    def go(i: int) -> None:
        out[i] = engine.run(gens[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in (order or range(len(gens)))]
    with engine.held():
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while engine.running < len(gens) and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(120)
    return out


@pytest.mark.parametrize("arch", ["qwen35", "qwen35-predictable"])
def test_mtp_drafts_of_concurrent_requests_share_one_pass_per_step(mtp_targets, arch):
    """Four requests of mixed widths (their own ``draft_max``), leaving at different rounds: each
    draft step is one pass over every drafting request (draft passes per round <= K, not 4K), and every
    request's tokens and per-round proposals equal its solo run."""
    model = mtp_targets[arch]
    widths = [7, 3, 5, 1]
    base = PowerConfig(spec_mode="mtp", max_tokens=40, n_ctx=256, n_threads=2, trace=True)
    prompts = PROMPTS[:4]
    with Session.open_engine(4, base, model=str(model)) as engine:
        assert engine.probe is not None and engine.probe.identical
        gens = [engine.submit(p, draft_max=w) for p, w in zip(prompts, widths, strict=True)]
        out = [(g.config.spec_draft_max, res) for g, res in zip(gens, _run_together(engine, gens), strict=True)]
    assert [w for w, _ in out] == widths  # every width ran
    with Session.open(base, model=str(model)) as s:
        alone_all = [s.start(p, draft_max=w).run() for p, w in zip(prompts, widths, strict=True)]
    for i, ((width, res), alone) in enumerate(zip(out, alone_all, strict=True)):
        assert res.tokens == alone.tokens, (i, width)
        assert _proposals(res) == _proposals(alone), (i, width)
    out = [res for _, res in out]
    assert max(r["stats"]["draft_batch"] for r in _batched_rounds(out, max(widths))) >= 3


@pytest.mark.parametrize("p_min", [0.105, 0.11])
def test_mtp_drafts_cut_by_p_min_leave_the_draft_batch_where_their_solo_drafts_stop(mtp_targets, p_min):
    """Four requests on one MTP context whose ``p_min`` (the random head's top-10 softmax sits near 0.1,
    so 0.105 and 0.11 cut drafts at mixed lengths) cuts their drafts at lengths of their own, one of them
    at a narrower K of its own: a request whose draft is cut leaves the step batch while the others go on,
    and every request's tokens and per-round proposals equal its solo run."""
    model = mtp_targets["qwen35"]
    widths = [7, 7, 4, 7]
    base = PowerConfig(spec_mode="mtp", spec_draft_max=7, spec_draft_p_min=p_min, max_tokens=40, n_ctx=256,
                       n_threads=2, trace=True)
    with Session.open_engine(4, base, model=str(model)) as engine:
        gens = [engine.submit(PROMPTS[i], draft_max=widths[i]) for i in range(4)]
        out = list(_run_together(engine, gens))
    with Session.open(base, model=str(model)) as s:
        solo = [s.start(PROMPTS[i], draft_max=widths[i]).run() for i in range(4)]
    cut = 0
    for i, (res, alone) in enumerate(zip(out, solo, strict=True)):
        assert res.tokens == alone.tokens, i
        assert _proposals(res) == _proposals(alone), i
        cut += sum(1 for r in res.receipt.rounds if r["index"] > 0 and 0 < r["proposed"] < widths[i])
    assert cut >= 3, "no p_min cut a draft short: the test proves nothing"
    assert max(r["stats"]["draft_batch"] for r in _batched_rounds(out, 7)) >= 3


def test_mtp_draft_steps_of_requests_out_of_sequence_order_reuse_one_graph(mtp_targets):
    """Four lockstep requests (the predictable head accepts every draft, so every round is the same
    shape), started last sequence first: each draft step still runs as one ubatch (heads in sequence
    order; llama.cpp cuts a pass over one KV stream per sequence at every id that is not the previous
    one + 1), so of a round's 8 MTP passes (the kept pairs, then 7 steps) the last 6 reuse the step
    graph, and every verify pass after the first reuses the target's."""
    model = mtp_targets["qwen35-predictable"]
    cfg = PowerConfig(spec_mode="mtp", spec_draft_max=7, max_tokens=64, n_ctx=256, n_threads=2)
    with Session.open_engine(4, cfg, model=str(model)) as engine:
        target = engine.sessions[0].opened.target
        head_ctx = engine.sessions[0].proposer.head.ctx
        gens = [engine.submit(PROMPTS[0], strategy="mtp") for _ in range(4)]
        draft_before, target_before = head_ctx.graphs_reused, target.ctx.graphs_reused
        out = _run_together(engine, gens, (3, 2, 1, 0))
        draft_reused = head_ctx.graphs_reused - draft_before
        target_reused = target.ctx.graphs_reused - target_before
    rounds = [r for r in out[0].receipt.to_dict()["rounds"] if r["proposed"] == 7]
    assert all(r["stats"]["draft_batch"] == 4 for r in rounds)
    assert draft_reused >= 6 * (len(rounds) - 1), (draft_reused, len(rounds))
    assert target_reused >= len(rounds) - 2, (target_reused, len(rounds))


def _eight_at_random_arrivals(cfg: PowerConfig, model: Path, draft: Path | None, widths: tuple[int, ...],
                              seed: int) -> list:
    """Eight requests over ``len(widths)`` sequences, the i-th with ``draft_max = widths[i % len(widths)]`` (the
    session's K the widest), arriving at random times with budgets of their own, greedy and seeded; asserts
    each one's tokens and per-round proposals equal its solo run at its width (a session of the same K, the
    request's ``draft_max``: a block draft decodes the session's block and proposes at most the request's K
    of it, as llama.cpp's per-request ``n_max``), and returns the results. The
    first three arrive together and join one first pass whatever the machine's load (so some draft step is
    shared); the other five at random times."""
    rng = random.Random(seed)
    jobs = [(PROMPTS[i % len(PROMPTS)], {"temperature": 0.7, "seed": i} if i % 3 == 1 else {},
             rng.choice((9, 24, 40)), 0.0 if i < 3 else rng.uniform(0.0, 0.3)) for i in range(8)]
    opened = dict(model=str(model), draft=str(draft) if draft else None)
    with Session.open_engine(len(widths), attrs.evolve(cfg, spec_draft_max=max(widths)), **opened) as engine:
        out: list = [None] * len(jobs)
        width: list = [None] * len(jobs)

        def go(i: int) -> None:
            prompt, kw, mt, delay = jobs[i]
            time.sleep(delay)
            gen = engine.submit(prompt, sampling=kw, max_tokens=mt, draft_max=widths[i % len(widths)])
            width[i] = gen.config.draft_max
            out[i] = engine.run(gen)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
        with engine.held():
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while engine.running < 3 and time.monotonic() < deadline:
                time.sleep(0.001)
        for t in threads:
            t.join(120)
    with Session.open(attrs.evolve(cfg, spec_draft_max=max(widths)), **opened) as s:
        for i, (prompt, kw, mt, _) in enumerate(jobs):
            alone = s.start(prompt, sampling=kw, max_tokens=mt, draft_max=width[i]).run()
            assert out[i].tokens == alone.tokens, (i, width[i])
            assert _proposals(out[i]) == _proposals(alone), (i, width[i])
            assert all(len(p or ()) <= width[i] for p in _proposals(alone)), (i, width[i])
    return out


@pytest.mark.parametrize("arch", ["qwen35", "qwen35-predictable"])
def test_eight_mtp_requests_of_mixed_widths_at_random_arrivals_propose_their_solo_drafts(mtp_targets, arch):
    """Eight requests of widths 7, 2, 5 and 3 (their ``draft_max``) over four sequences of one MTP context,
    arriving at random times with budgets of their own, greedy and seeded: tokens and per-round proposals
    equal each one's solo run at its width."""
    cfg = PowerConfig(spec_mode="mtp", max_tokens=40, n_ctx=256, n_threads=2, trace=True)
    out = _eight_at_random_arrivals(cfg, mtp_targets[arch], None, (7, 2, 5, 3), seed=7)
    assert max(st["draft_batch"] for res in out for st in _draft_stats(res)) >= 2


def test_a_failed_mtp_draft_batch_lets_each_request_draft_alone(mtp_targets, monkeypatch):
    """A shared draft pass that fails leaves every proposer as it was; each request of it drafts alone
    that round, and every output (and proposal) equals its solo run."""
    from power_mtp.proposer import MtpDraft

    cfg = PowerConfig(spec_mode="mtp", max_tokens=40, n_ctx=256, n_threads=2, trace=True)
    model = mtp_targets["qwen35"]
    solo = _solo(cfg, model)
    real = MtpDraft.propose_many
    calls = {"n": 0}

    def flaky(self, asks):
        calls["n"] += 1
        if calls["n"] in (2, 5):
            real(self, asks)  # the native passes run, then the batch fails: the draft chains must be gone
            raise ValueError("boom")
        return real(self, asks)

    monkeypatch.setattr(MtpDraft, "propose_many", flaky)
    shared = _shared(cfg, model)
    assert calls["n"] >= 5
    _check(shared, solo, "mtp")


# -- draft passes shared across requests (issue #32): one draft context per target, one pass per step ------
DRAFT_KINDS = {**BLOCK_KINDS, "draft-model": {}}


def _draft_for(tiny_dir: Path, target: Path, mode: str) -> Path:
    """The draft file of ``mode``: a tiny DFlash-family draft, or for draft-model another tiny llama
    (seeded apart, so some drafts are rejected)."""
    from native_helpers import make_tiny

    if mode == "draft-model":
        return make_tiny(tiny_dir, "llama", seed=7, name="llama-seed7")
    return make_tiny_draft(tiny_dir, target, name=f"llama-{mode}", **BLOCK_KINDS[mode])


def _draft_stats(result) -> list[dict]:
    return [r["stats"] for r in result.receipt.to_dict()["rounds"] if r.get("stats")]


@pytest.mark.parametrize("mode", sorted(DRAFT_KINDS))
def test_draft_passes_are_shared_by_concurrent_requests_and_propose_their_solo_drafts(tiny_dir, tiny_llama, mode):
    """Four requests at once on four sequences: each round's drafts of every drafting request come from
    one draft pass per step (a block draft: one pass; draft-model: at most K), and every request's
    tokens and per-round proposals are its solo run's (widths cut by its own remaining budget)."""
    draft = _draft_for(tiny_dir, tiny_llama, mode)
    k = 5
    cfg = PowerConfig(spec_mode=mode, spec_draft_max=k, max_tokens=40, n_ctx=256, n_threads=2, trace=True)
    jobs = [(PROMPTS[i], SAMPLING[i], mt) for i, mt in enumerate((40, 17, 29, 40))]
    with Session.open(cfg, model=str(tiny_llama), draft=str(draft)) as s:
        solo = [s.start(p, sampling=kw, max_tokens=mt).run() for p, kw, mt in jobs]
    with Session.open_engine(4, cfg, model=str(tiny_llama), draft=str(draft)) as engine:
        assert engine.probe is not None and engine.probe.identical, engine.probe
        gens = [engine.submit(p, sampling=kw, max_tokens=mt) for p, kw, mt in jobs]
        out: list = [None] * len(gens)

        def go(i: int) -> None:
            out[i] = engine.run(gens[i])

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(gens))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for i, (res, alone) in enumerate(zip(out, solo, strict=True)):
        assert res is not None, i
        assert res.tokens == alone.tokens, i
        assert _proposals(res) == _proposals(alone), i
    stats = [st for res in out for st in _draft_stats(res)]
    batched = [st for st in stats if st["draft_batch"] == 4]
    assert batched, stats  # the four requests drafted in shared passes
    assert all(st["draft_passes"] <= k for st in batched), batched  # not 4 x K
    if mode != "draft-model":
        assert all(st["draft_passes"] == 1 for st in stats)  # one noise-block pass, shared or alone
    solo_stats = [st for res in solo for st in _draft_stats(res)]
    assert all(st["draft_batch"] == 1 for st in solo_stats)
    # each request's draft clock counts the shared passes it took part in: the host split still adds up
    for res in out:
        t = res.receipt.timings
        assert t["draft_compute_s"] > 0
        assert t["target_compute_s"] + t["draft_compute_s"] + t["host_s"] == pytest.approx(t["decode_s"], abs=1e-9)


@pytest.mark.parametrize("mode", sorted(BLOCK_KINDS))
def test_block_drafts_inject_the_kept_rows_of_a_shared_pass_in_one_decode(tiny_dir, tiny_qwen35, mode):
    """Four lockstep requests on a hybrid target: each round's kept verify rows of all four are injected
    into the draft's KV in one decode after the last of their rounds closes (llama.cpp's drafter
    injects each slot alone), so the draft context runs about two passes per shared pass (the noise
    blocks, the injections) where four injections made it five; tokens and proposals stay solo."""
    draft = make_tiny_draft(tiny_dir, tiny_qwen35, name=f"qwen35-{mode}", **BLOCK_KINDS[mode])
    cfg = PowerConfig(spec_mode=mode, spec_draft_max=5, max_tokens=24, n_ctx=256, n_threads=2, trace=True)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[1]]
    with Session.open(cfg, model=str(tiny_qwen35), draft=str(draft)) as s:
        solo = [s.start(p).run() for p in prompts]
    with Session.open_engine(4, cfg, model=str(tiny_qwen35), draft=str(draft)) as engine:
        ctx = engine.sessions[0].proposer.shared.ctx
        gens = [engine.submit(p) for p in prompts]
        before = ctx.passes
        out = _run_together(engine, gens, (2, 0, 3, 1))
        passes = ctx.passes - before
    for i, (res, alone) in enumerate(zip(out, solo, strict=True)):
        assert res.tokens == alone.tokens, i
        assert _proposals(res) == _proposals(alone), i
    shared = max(res.receipt.backend["batch"]["shared_passes"] for res in out)
    # one noise decode and one injection per shared pass, and each prompt's own injection
    assert passes <= 2 * shared + len(prompts), (passes, shared)


@pytest.mark.parametrize("mode", sorted(DRAFT_KINDS))
def test_mixed_widths_at_random_arrivals_propose_their_solo_drafts(tiny_dir, tiny_llama, mode):
    """Eight requests over four sequences, of two widths (K 5, and ``draft_max`` 2 for every other one),
    arriving at random times with budgets of their own, greedy and seeded: tokens and per-round proposals
    equal each one's solo run."""
    draft = _draft_for(tiny_dir, tiny_llama, mode)
    cfg = PowerConfig(spec_mode=mode, max_tokens=40, n_ctx=256, n_threads=2, trace=True)
    out = _eight_at_random_arrivals(cfg, tiny_llama, draft, (5, 2, 5, 2), seed=32)
    assert max(st["draft_batch"] for res in out for st in _draft_stats(res)) >= 2


@pytest.mark.parametrize("mode", ["dflash", "draft-model"])
def test_a_cancelled_and_a_faulted_request_leave_the_shared_draft_passes_of_the_others_unchanged(tiny_dir, tiny_llama,
                                                                                                   mode):
    draft = _draft_for(tiny_dir, tiny_llama, mode)
    cfg = PowerConfig(spec_mode=mode, max_tokens=40, n_ctx=256, n_threads=2, trace=True)
    prompts = PROMPTS[:4]
    with Session.open(cfg, model=str(tiny_llama), draft=str(draft)) as s:
        solo = [s.start(p).run() for p in prompts]
    with Session.open_engine(4, cfg, model=str(tiny_llama), draft=str(draft)) as engine:
        gens = [engine.submit(p) for p in prompts]
        victim, faulty = gens[1], gens[2]
        faulty.session.proposer = Flaky(faulty.session.proposer, fail_at=4)
        results: list = [None] * len(gens)

        def go(i: int) -> None:
            try:
                for k, _ in enumerate(engine.rounds(gens[i])):
                    if gens[i] is victim and k == 3:
                        victim.cancel.cancel()
                results[i] = gens[i].result()
            except (Cancelled, AdapterFault) as exc:
                results[i] = exc

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(gens))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        # the two ended mid-draft; the sequences they leave draft their next requests' solo drafts again
        again = [engine.submit(p) for p in prompts[1:3]]
        redo: list = [None] * 2

        def rerun(j: int) -> None:
            redo[j] = engine.run(again[j])

        threads = [threading.Thread(target=rerun, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert isinstance(results[1], Cancelled) and victim.receipt.status == "cancelled"
    assert victim.tokens == solo[1].tokens[: len(victim.tokens)]
    assert isinstance(results[2], AdapterFault) and faulty.receipt.status == "failed"
    for i in (0, 3):
        assert results[i].tokens == solo[i].tokens, i
        assert _proposals(results[i]) == _proposals(solo[i]), i
        assert max(st["draft_batch"] for st in _draft_stats(results[i])) >= 2
    for j, i in enumerate((1, 2)):
        assert redo[j].tokens == solo[i].tokens
        assert _proposals(redo[j]) == _proposals(solo[i])


@pytest.mark.parametrize("mode", ["dflash2", "draft-model"])
def test_a_failed_shared_draft_pass_lets_each_request_draft_alone(tiny_dir, tiny_llama, mode, monkeypatch):
    """A shared draft pass that ran and then failed leaves every proposer as it was (the noise rows
    gone, draft-model's memory what it knows it holds): each request of it drafts alone that round,
    and every output and proposal equals its solo run."""
    from power_native.block import SharedBlockDraft
    from power_native.draft import SharedDraftModel

    draft = _draft_for(tiny_dir, tiny_llama, mode)
    cfg = PowerConfig(spec_mode=mode, max_tokens=40, n_ctx=256, n_threads=2, trace=True)
    kind = SharedDraftModel if mode == "draft-model" else SharedBlockDraft
    real = kind.propose_many
    calls = {"n": 0}

    def flaky(self, asks):
        calls["n"] += 1
        got = real(self, asks)  # the shared passes run, then the batch fails
        if calls["n"] in (2, 5):
            raise ValueError("boom")
        return got

    solo = _solo(cfg, tiny_llama, draft)
    monkeypatch.setattr(kind, "propose_many", flaky)
    shared = _shared(cfg, tiny_llama, draft)
    assert calls["n"] >= 5
    _check(shared, solo, mode)


# -- the memory of the contexts (TargetCapabilities.memory): draft contexts sized for the sequences ------
def _memory(cfg: PowerConfig, model: Path, n: int | None, draft: Path | None = None) -> dict:
    if n is None:
        with Session.open(cfg, model=str(model), draft=str(draft) if draft else None) as s:
            return dict(s.opened.target.capabilities.memory())
    with Session.open_engine(n, cfg, model=str(model), draft=str(draft) if draft else None) as engine:
        return dict(engine.sessions[0].opened.target.capabilities.memory())


def test_memory_reports_the_target_and_each_draft_context_sized_for_the_sequences(tiny_dir, tiny_llama,
                                                                                   tiny_qwen35_mtp):
    cfg = PowerConfig(spec_mode="mtp", n_ctx=256, n_threads=2)
    one, four = _memory(cfg, tiny_qwen35_mtp, None), _memory(cfg, tiny_qwen35_mtp, 4)
    for mem in (one, four):
        assert mem["target"]["weights"] > 0 and mem["target"]["context"] > 0 and mem["target"]["compute"] > 0
        assert set(mem["drafts"]) == {"mtp"}
        assert mem["drafts"]["mtp"]["weights"] == 0  # the head runs on the target's weights: counted once
        assert mem["drafts"]["mtp"]["context"] > 0 and mem["drafts"]["mtp"]["compute"] > 0
    assert four["target"]["weights"] == one["target"]["weights"]
    # one MTP context for the four sequences, a KV stream of n_ctx cells each
    assert four["drafts"]["mtp"]["context"] == 4 * one["drafts"]["mtp"]["context"]
    draft = _draft_for(tiny_dir, tiny_llama, "draft-model")
    mem = _memory(PowerConfig(spec_mode="draft-model", n_ctx=256, n_threads=2), tiny_llama, 2, draft)
    assert set(mem["drafts"]) == {"draft-model"} and mem["drafts"]["draft-model"]["weights"] > 0
    assert _memory(PowerConfig(spec_mode="off", n_ctx=256, n_threads=2), tiny_llama, 2)["drafts"] == {}
