"""The round driver on the reference backend: every request's output equals its solo run whatever
the schedule (arrivals, concurrency, lengths, seeds, a prompt longer than a pass); a request's
cancel or fault leaves the others unchanged; a failed shared pass restores every round of it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from power_core.config import PowerConfig
from power_core.engine import Engine
from power_core.errors import AdapterFault, Cancelled, RuntimeFault
from power_core.session import Session
from tests.helpers import Flaky, check_host_split, core_plugins, joined, slow_passes

MODEL = "reference:seed=0,vocab=288,dim=24,recurrent=1,eos=256"


def _config(mode: str, **kw) -> PowerConfig:
    return PowerConfig(spec_mode=mode, n_ctx=512, **kw)


def _solo(mode: str, prompt: list[int], **kw) -> tuple[int, ...]:
    sampling = {k: kw.pop(k) for k in ("temperature", "seed") if k in kw}
    with Session.open(_config(mode), model=MODEL, plugins=core_plugins()) as s:
        return s.start(prompt, sampling=sampling, **kw).run().tokens


def _engine(mode: str, n: int, **kw) -> Engine:
    return Session.open_engine(n, _config(mode), model=MODEL, plugins=core_plugins(), **kw)


def _run_all(engine: Engine, jobs: list[dict], delays: list[float]) -> list:
    out: list = [None] * len(jobs)

    def go(i: int) -> None:
        time.sleep(delays[i])
        job = dict(jobs[i])
        prompt = job.pop("prompt")
        sampling = {k: job.pop(k) for k in ("temperature", "seed") if k in job}
        gen = engine.submit(prompt, sampling=sampling, **job)
        try:
            out[i] = engine.run(gen)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


job_strategy = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(0, 255), min_size=1, max_size=90),
    "max_tokens": st.integers(1, 40),
    "temperature": st.sampled_from([0.0, 0.0, 0.8]),
    "seed": st.integers(0, 5),
})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["off", "ref-draft"]),
       jobs=st.lists(job_strategy, min_size=1, max_size=8),
       delays=st.lists(st.sampled_from([0.0, 0.0, 0.001, 0.005, 0.02]), min_size=8, max_size=8),
       slots=st.integers(1, 4), budget=st.sampled_from([None, 70, 100]))
def test_every_request_equals_its_solo_run_on_any_schedule(mode, jobs, delays, slots, budget):
    kw = {} if budget is None else {"token_budget": budget}
    with _engine(mode, slots, **kw) as engine:
        results = _run_all(engine, jobs, delays)
    for job, res in zip(jobs, results, strict=True):
        assert not isinstance(res, BaseException), res
        expect = _solo(mode, job["prompt"], max_tokens=job["max_tokens"], temperature=job["temperature"],
                       seed=job["seed"])
        assert res.tokens == expect
        assert res.receipt.status == "completed"
        assert res.receipt.backend["batch"]["n_seq"] == slots


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=st.lists(st.tuples(st.sampled_from(["off", "ref-draft"]), st.sampled_from([None, 1, 2, 5]), job_strategy),
                     min_size=2, max_size=8),
       delays=st.lists(st.sampled_from([0.0, 0.0, 0.001, 0.005, 0.02]), min_size=8, max_size=8),
       slots=st.integers(2, 4))
def test_mixed_strategies_and_widths_in_shared_passes_each_equal_their_solo_run(jobs, delays, slots):
    """Sequences of one target that each run off and ref-draft (``strategies=``), requests asking for
    either and some for a narrower K of their own (``draft_max``): blocks of every width share passes,
    and each request emits its solo output at its strategy and width."""
    with Session.open_engine(slots, _config("off", spec_draft_max=5), model=MODEL, plugins=core_plugins(),
                             strategies=["off", "ref-draft"]) as engine:
        out: list = [None] * len(jobs)

        def go(i: int) -> None:
            time.sleep(delays[i])
            mode, width, job = jobs[i]
            gen = engine.submit(job["prompt"], max_tokens=job["max_tokens"], strategy=mode, draft_max=width,
                                sampling={"temperature": job["temperature"], "seed": job["seed"]})
            out[i] = engine.run(gen)

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for (mode, width, job), res in zip(jobs, out, strict=True):
        assert res is not None and res.receipt.strategy["name"] == mode
        assert res.receipt.config["spec_draft_max"] == (width or 5)
        assert all(r["proposed"] <= (width or 5) for r in res.receipt.rounds)
        with Session.open(_config(mode, spec_draft_max=width or 5), model=MODEL, plugins=core_plugins()) as s:
            alone = s.start(job["prompt"], max_tokens=job["max_tokens"],
                            sampling={"temperature": job["temperature"], "seed": job["seed"]}).run()
        assert res.tokens == alone.tokens


def test_a_request_may_narrow_its_strategys_k_but_not_widen_it():
    """``draft_max`` at most the lane's K (which sized the target's passes): a wider one, or one that is
    no integer, is a ConfigError naming ``spec_draft_max`` before anything runs; a narrower one narrows a
    set S with it (snapshots beyond K are never used), and its receipt records both."""
    from power_core.errors import ConfigError

    with Session.open_engine(2, _config("off", spec_draft_max=4, spec_recurrent_snapshots=3), model=MODEL,
                             plugins=core_plugins(), strategies=["ref-draft", "off"]) as engine:
        for bad in (5, 0, True, 2.0):
            with pytest.raises(ConfigError) as err:
                engine.submit([1, 2], draft_max=bad)
            assert err.value.key == "spec_draft_max" and "[1, 4]" in str(err.value)
        assert engine.waiting == 0 and engine.busy == 0  # the refused requests gave their sequences back
        res = engine.run(engine.submit([1, 2, 3], max_tokens=12, draft_max=2))
        assert (res.receipt.config["spec_draft_max"], res.receipt.config["spec_recurrent_snapshots"]) == (2, 2)
        assert max(r["proposed"] for r in res.receipt.rounds) == 2
        assert (res.receipt.scheduler["k_max"], res.receipt.scheduler["k_session"]) == (2, 4)  # what sized the passes
        res = engine.run(engine.submit([1, 2, 3], max_tokens=12))
        assert (res.receipt.config["spec_draft_max"], res.receipt.config["spec_recurrent_snapshots"]) == (4, 3)
        assert res.receipt.scheduler["k_max"] == res.receipt.scheduler["k_session"] == 4
        with pytest.raises(ConfigError, match="one of this engine's strategies"):
            engine.submit([1, 2], strategy="suffix")


def test_a_request_picks_any_strategy_of_an_engine_whose_sequences_run_several():
    """``Engine.submit(strategy=)`` on sequences that each carry several strategies (lanes): any free
    sequence takes it, and the request runs (and its receipt names) the strategy it asked for."""
    with Session.open_engine(2, _config("off"), model=MODEL, plugins=core_plugins(),
                             strategies=["ref-draft", "off"]) as engine:
        for name in ("off", "ref-draft", "auto"):
            res = engine.run(engine.submit([1, 2, 3], max_tokens=8, strategy=name))
            assert res.receipt.strategy["requested"] == name
            assert res.receipt.strategy["name"] == name if name != "auto" else res.receipt.strategy["name"] in ("off",
                                                                                                             "ref-draft")


def test_a_long_prompt_is_chunked_and_does_not_stall_the_others(monkeypatch):
    long_prompt = list(np.random.default_rng(1).integers(0, 256, 400))
    with _engine("off", 2, token_budget=66) as engine:
        slow_passes(monkeypatch, 0.01)  # passes of 10 ms: both requests join in time
        long_gen = engine.submit(long_prompt, max_tokens=5)
        short = engine.submit([5, 6, 7], max_tokens=3)
        order: list[str] = []

        def run(gen, name: str) -> None:
            engine.run(gen)
            order.append(name)

        threads = [threading.Thread(target=run, args=(long_gen, "long")),
                   threading.Thread(target=run, args=(short, "short"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert order == ["short", "long"]  # the short request decoded while the long prompt was prefilled
    assert long_gen.tokens == _solo("off", long_prompt, max_tokens=5)
    assert short.tokens == _solo("off", [5, 6, 7], max_tokens=3)
    batch = long_gen.receipt.backend["batch"]
    assert batch["shared_passes"] >= 400 // 66  # the prompt took several passes
    assert batch["peak_concurrent"] == 2


def test_cancel_of_one_request_leaves_the_others_unchanged(monkeypatch):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with _engine("ref-draft", 3) as engine:
        slow_passes(monkeypatch, 0.01)
        gens = [engine.submit(p, max_tokens=60) for p in prompts]
        victim = gens[1]
        results: list = [None, None, None]

        def go(i: int) -> None:
            try:
                for k, _ in enumerate(engine.rounds(gens[i])):
                    if i == 1 and k == 3:
                        victim.cancel.cancel()
                results[i] = gens[i].result()
            except Cancelled as exc:
                results[i] = exc

        threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert isinstance(results[1], Cancelled)
    assert victim.receipt.status == "cancelled" and 0 < len(victim.tokens) < 60
    solo_victim = _solo("ref-draft", prompts[1], max_tokens=60)
    assert victim.tokens == solo_victim[: len(victim.tokens)]  # what it committed is its solo prefix
    for i in (0, 2):
        assert results[i].tokens == _solo("ref-draft", prompts[i], max_tokens=60)


def test_a_proposer_fault_fails_only_its_request():
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with _engine("ref-draft", 3) as engine:
        gens = [engine.submit(p, max_tokens=40) for p in prompts]
        session = gens[2].session
        session.proposer = Flaky(session.proposer, fail_at=4)
        results: list = [None] * 3

        def go(i: int) -> None:
            try:
                results[i] = engine.run(gens[i])
            except AdapterFault as exc:
                results[i] = exc

        threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert isinstance(results[2], AdapterFault) and gens[2].receipt.status == "failed"
    for i in (0, 1):
        assert results[i].tokens == _solo("ref-draft", prompts[i], max_tokens=40)


def test_a_failed_shared_pass_restores_its_rounds_and_the_engine_keeps_serving():
    with _engine("off", 2) as engine:
        engine.runtime.fail_on = engine.runtime.passes + 5  # type: ignore[attr-defined]
        a, b = engine.submit([1, 2], max_tokens=20), engine.submit([3, 4], max_tokens=20)
        errors: list = []

        def go(g) -> None:
            try:
                engine.run(g)
            except RuntimeFault as exc:
                errors.append(exc)

        threads = [threading.Thread(target=go, args=(g,)) for g in (a, b)]
        with engine.held():  # both join the same passes: the failing one is shared
            for t in threads:
                t.start()
            joined(engine, 2)
        for t in threads:
            t.join(60)
        assert errors and all(g.receipt.status in ("failed", "completed") for g in (a, b))
        for g in (a, b):  # what each committed before the failure is its solo prefix
            assert g.tokens == _solo("off", list(g.prompt), max_tokens=20)[: len(g.tokens)]
        after = engine.run(engine.submit([9, 9, 9], max_tokens=10))
    assert after.tokens == _solo("off", [9, 9, 9], max_tokens=10)


def test_reading_stops_early_cancels_and_frees_the_slot(monkeypatch):
    with _engine("off", 1) as engine:
        slow_passes(monkeypatch, 0.01)
        gen = engine.submit([1, 2, 3], max_tokens=200)
        rounds = engine.rounds(gen)
        next(rounds)
        rounds.close()
        assert gen.receipt is not None and gen.receipt.status == "cancelled"
        again = engine.run(engine.submit([1, 2, 3], max_tokens=5))  # the only slot is free again
    assert again.tokens == _solo("off", [1, 2, 3], max_tokens=5)


def test_open_batch_refuses_a_backend_without_shared_passes():
    from power_core.errors import ConfigError

    with pytest.raises(ConfigError, match="parallel"):
        Session.open_batch(0, _config("off"), model=MODEL, plugins=core_plugins())


def test_a_requests_decode_time_holds_the_whole_of_its_passes(monkeypatch):
    """The driver's own work in a shared pass, outside every request's stretches (here a slow
    ``_ask_together``: 20 ms a pass), is decode time of the requests whose rounds the pass closed, and
    host time: a receipt's ``decode_s`` is the wall time its rounds took, not only its own stretches'."""
    from power_core import passes

    ask = passes.SharedPasses._ask_together

    def slow(self, opened):
        time.sleep(0.02)
        return ask(self, opened)

    monkeypatch.setattr(passes.SharedPasses, "_ask_together", slow)
    with _engine("ref-draft", 2) as engine:
        results = _run_all(engine, [{"prompt": [1, 2, 3], "max_tokens": 8}, {"prompt": [4, 5], "max_tokens": 8}],
                           [0.0, 0.0])
    for res in results:
        t = check_host_split(res.receipt, draft_timed=False)
        passes_closed = t["decode_rounds"] - 1  # round 0's verify row came from the prefill: no pass of its own
        assert t["decode_s"] >= 0.02 * passes_closed, t
        assert t["host_s"] >= 0.02 * passes_closed, t


def test_a_solo_rounds_decode_time_holds_its_commit_and_its_clock_reads(monkeypatch):
    """On a solo sequence (``power run``), a round's stretch holds what the request's own round makes around the
    step: the reads of its compute clocks at both ends and the commit its reader gets (here 5 ms each, slowed);
    they are decode time and host time, as in shared passes."""
    import power_core.engine as engine_module
    from power_core.generation import Generation

    clock, commit = Generation.clock, engine_module.commit_of

    def slow_clock(self):
        time.sleep(0.005)
        return clock(self)

    def slow_commit(gen, record):
        time.sleep(0.005)
        return commit(gen, record)

    monkeypatch.setattr(Generation, "clock", slow_clock)
    monkeypatch.setattr(engine_module, "commit_of", slow_commit)
    with Session.open(PowerConfig(spec_mode="ref-draft", n_ctx=256), model="reference") as s:
        res = s.generate([1, 2, 3], max_tokens=12)
    t = check_host_split(res.receipt, draft_timed=False)
    committed = t["decode_rounds"]  # every round: two clock reads and a commit, 15 ms
    assert t["decode_s"] >= 0.015 * committed and t["host_s"] >= 0.015 * committed, t


def test_engine_receipts_split_decode_time_into_compute_and_host():
    """A request's share of the shared passes counts as its target compute; its own rounds' work (the
    proposer, sampling, commit) as host time."""
    with _engine("ref-draft", 2) as engine:
        results = _run_all(engine, [{"prompt": [1, 2, 3], "max_tokens": 20}, {"prompt": [4, 5], "max_tokens": 12}],
                           [0.0, 0.0])
    for res in results:
        check_host_split(res.receipt, draft_timed=False)
