"""Faults stay contained (issue 29): an observer that raises, a close under a running decode, a
reader in another thread, a restore that fails. Each test failed on the code before the one
request path (the note of that change says how each was confirmed)."""

from __future__ import annotations

import threading
import time

import attrs
import numpy as np
import pytest

from power_core.config import PowerConfig
from power_core.errors import Cancelled, RuntimeFault, SessionBusy, StateLost
from power_core.session import Session
from power_core.spec import hookimpl
from power_core.testing.faults import FaultInjector
from tests.helpers import Flaky, core_plugins, joined, slow_passes

MODEL = "reference:seed=0,vocab=288,dim=24,recurrent=1,eos=256"


def _config(mode: str, **kw) -> PowerConfig:
    return PowerConfig(spec_mode=mode, n_ctx=512, **kw)


def _solo(mode: str, prompt: list[int], max_tokens: int) -> tuple[int, ...]:
    with Session.open(_config(mode), model=MODEL, plugins=core_plugins()) as s:
        return s.start(prompt, max_tokens=max_tokens).run().tokens


def _run_concurrently(engine, gens) -> list:
    """Run every request in a thread of its own (they share the engine's passes); results or errors."""
    out: list = [None] * len(gens)

    def go(i: int) -> None:
        try:
            out[i] = engine.run(gens[i])
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(gens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


class RaisingObserver:
    """A third-party observer with a bug in ``power_request_end`` (and one in ``power_request_start``)."""

    __name__ = "raising-observer"

    def __init__(self, *, start: bool = False) -> None:
        self.start = start

    @hookimpl
    def power_request_start(self, request):
        if self.start:
            raise KeyError("observer bug at start")

    @hookimpl
    def power_request_end(self, receipt):
        raise RuntimeError("observer bug")


def test_an_observer_that_raises_is_counted_and_stops_no_request(caplog):
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    plugins = core_plugins(RaisingObserver())
    with Session.open_engine(2, _config("ref-draft"), model=MODEL, plugins=plugins) as engine:
        gens = [engine.submit(p, max_tokens=30) for p in prompts]
        out = _run_concurrently(engine, gens)
        for prompt, res in zip(prompts, out, strict=True):
            assert not isinstance(res, BaseException), res
            assert res.tokens == _solo("ref-draft", prompt, 30)
            assert res.receipt.status == "completed" and res.receipt.observer_faults == 1
            assert res.receipt.to_dict()["observer_faults"] == 1
        # no round of the shared passes was restored and redone because of the observer
        assert all(r["replayed"] is False for res in out for r in res.receipt.rounds)
        assert "engine.pass_failed" not in caplog.text
    # a solo request: its answer stands, the fault is counted (start and end both raised)
    with Session.open(_config("ref-draft"), model=MODEL, plugins=core_plugins(RaisingObserver(start=True))) as s:
        res = s.generate([1, 2, 3], max_tokens=12)
    assert res.tokens == _solo("ref-draft", [1, 2, 3], 12)
    assert res.receipt.status == "completed" and res.receipt.observer_faults == 2


class _Gate:
    """A batch runtime whose next pass blocks until the test opens the gate."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.in_flight = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode_batch(self, items):
        self.in_flight = True
        self.entered.set()
        try:
            self.gate.wait(30)
            return self.inner.decode_batch(items)
        finally:
            self.in_flight = False


def test_close_never_frees_the_target_under_a_running_decode(monkeypatch):
    engine = Session.open_engine(2, _config("off"), model=MODEL, plugins=core_plugins())
    gated = _Gate(engine.runtime)
    engine.runtime = gated
    closed_in_flight: list[bool] = []
    real_close = Session.close

    def spy(self):
        closed_in_flight.append(gated.in_flight)
        real_close(self)

    monkeypatch.setattr(Session, "close", spy)
    gen = engine.submit([1, 2, 3], max_tokens=50)
    reader = threading.Thread(target=lambda: pytest.raises(Cancelled, engine.run, gen), daemon=True)
    reader.start()
    assert gated.entered.wait(10)
    t0 = time.monotonic()
    engine.close(timeout=0.2)  # the decode cannot be interrupted: close gives up waiting, frees nothing
    assert time.monotonic() - t0 < 5
    assert closed_in_flight == []
    gated.gate.set()  # the decode returns: the driver ends and frees the sequences itself
    deadline = time.monotonic() + 10
    while len(closed_in_flight) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed_in_flight == [False, False]
    reader.join(10)
    assert gen.receipt is not None and gen.receipt.status == "cancelled"


def test_a_reader_sees_each_round_as_it_committed():
    """The driver runs ahead of a slow reader; every commit the reader gets is the request as it
    stood when that round committed, not as it stands when the reader looks."""
    with Session.open_engine(2, _config("ref-draft"), model=MODEL, plugins=core_plugins()) as engine:
        gen = engine.submit([1, 2, 3], max_tokens=40, logprobs=1)
        seen: list[int] = []
        total = 0
        commits = []
        for commit in engine.rounds(gen):
            time.sleep(0.01)  # the driver commits more rounds meanwhile
            total += commit.record.emitted
            assert commit.n_tokens == total and len(commit.tokens) == commit.record.emitted
            assert len(commit.logprobs) == commit.record.emitted
            seen.extend(commit.tokens)
            commits.append(commit)
        assert tuple(seen) == gen.tokens == _solo("ref-draft", [1, 2, 3], 40)
        assert [c.finished for c in commits] == [False] * (len(commits) - 1) + [True]
        assert [lp.token for c in commits for lp in c.logprobs] == list(gen.tokens)


def _lose_state_on_restore(monkeypatch, target) -> None:
    """``target``'s restore fails (a device reset, say): its state is unknown afterwards."""
    real = type(target).restore

    def restore(self, checkpoint):
        if self is target:
            raise RuntimeFault("device lost during restore")
        return real(self, checkpoint)

    monkeypatch.setattr(type(target), "restore", restore)


def test_a_session_whose_restore_failed_refuses_further_requests(monkeypatch):
    with Session.open(_config("ref-draft"), model=MODEL, plugins=core_plugins()) as s:
        s.proposer = Flaky(s.proposer, fail_at=3)  # round 3 fails, so the transaction restores
        _lose_state_on_restore(monkeypatch, s.opened.target)  # and the restore fails
        gen = s.start([1, 2, 3], max_tokens=30)
        with pytest.raises(RuntimeFault, match="device lost"):
            gen.run()
        assert gen.receipt is not None and gen.receipt.status == "failed"
        assert s.lost is not None and "device lost" in s.lost
        with pytest.raises(StateLost, match="target state was lost"):
            s.generate([4, 5], max_tokens=4)
        with pytest.raises(StateLost):  # nor can the failed request resume on it
            gen.run()


def test_in_shared_passes_only_the_sequence_whose_restore_failed_is_lost(monkeypatch):
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    with Session.open_engine(2, _config("ref-draft"), model=MODEL, plugins=core_plugins()) as engine:
        gens = [engine.submit(p, max_tokens=30) for p in prompts]
        victim = gens[1].session
        victim.proposer = Flaky(victim.proposer, fail_at=3)
        _lose_state_on_restore(monkeypatch, victim.opened.target)
        out = _run_concurrently(engine, gens)
        assert isinstance(out[1], RuntimeFault) and victim.lost is not None
        assert out[0].tokens == _solo("ref-draft", prompts[0], 30)
        with pytest.raises(StateLost):
            engine.run(victim.start([9, 9], max_tokens=3))
        again = engine.run(engine.submit([9, 9], max_tokens=3))  # the healthy sequence keeps serving
        assert again.tokens == _solo("ref-draft", [9, 9], 3)


# -- admission stays consistent (found in review) ------------------------------------------------------


def test_a_finished_or_resumed_request_never_takes_a_sequence_admitted_for_another():
    # the cancel fires on the driver's thread at round 2 (a reader cancelling after its first commit
    # may find the driver done already: a fast request finishes before the reader gets to cancel)
    inj = FaultInjector(phase=None, round_index=2, action="cancel")
    with Session.open_engine(2, _config("off"), model=MODEL, plugins=core_plugins(inj)) as engine:
        done = engine.submit([1, 2, 3], max_tokens=4)
        assert engine.run(done).receipt.status == "completed"
        gen = engine.submit([4, 5], max_tokens=50)
        inj.phase, inj.cancel = "propose", gen.cancel
        commits = engine.rounds(gen)
        next(commits)
        with pytest.raises(Cancelled):
            list(commits)
        a, b = engine.reserve(), engine.reserve()  # both sequences admitted for new requests
        assert a.ready and b.ready and engine.busy == 2
        assert list(engine.rounds(done)) == [] and engine.busy == 2  # a finished request runs nothing
        gen.cancel.reset()
        with pytest.raises(SessionBusy):  # an interrupted request may not resume on an admitted sequence
            list(engine.rounds(gen))
        assert engine.busy == 2
        engine.release(a.session)
        engine.release(b.session)
        assert engine.busy == 0


def test_tickets_waiting_for_lost_sequences_fail_instead_of_waiting_forever(monkeypatch):
    with Session.open_engine(1, _config("ref-draft"), model=MODEL, plugins=core_plugins()) as engine:
        gen = engine.submit([1, 2, 3], max_tokens=30)
        session = gen.session
        session.proposer = Flaky(session.proposer, fail_at=3)
        _lose_state_on_restore(monkeypatch, session.opened.target)
        waiting = engine.reserve()
        assert not waiting.ready
        with pytest.raises(RuntimeFault):
            engine.run(gen)
        with pytest.raises(StateLost):
            waiting.wait(5)


def test_closing_independent_sequences_waits_for_their_requests():
    sessions = [Session.open(_config("off"), model=MODEL, plugins=core_plugins()) for _ in range(2)]
    engine = Session.independent_engine(sessions)
    gen = engine.submit([1, 2, 3], max_tokens=400)
    started = threading.Event()
    out: list = []

    def read() -> None:
        try:
            for _ in engine.rounds(gen):
                started.set()
                time.sleep(0.001)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            out.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(10)
    engine.close(timeout=10)  # cancels the request, waits for it, then closes both sessions
    reader.join(10)
    assert isinstance(out[0], Cancelled) and all(s.closed for s in sessions)


def test_closing_the_engine_ends_every_waiting_ticket():
    with Session.open_engine(1, _config("off"), model=MODEL, plugins=core_plugins()) as engine:
        held = engine.reserve()
        waiting = engine.reserve()
        woken: list[bool] = []
        waiting.on_ready(lambda: woken.append(True))
        engine.release(held.session)  # (handed to the waiting ticket, then given back below)
        engine.release(waiting.session)
        late = engine.reserve()
        later = engine.reserve()
        later.on_ready(lambda: woken.append(True))
        engine.close()
        assert woken == [True, True] and later.session is None
        with pytest.raises(SessionBusy, match="closed"):
            later.wait(1)
        assert late.ready


def test_a_stream_on_shared_passes_equals_its_generate():
    with Session.open_engine(2, _config("ref-draft", stop=("e",)), model=MODEL, plugins=core_plugins()) as engine:
        session = engine.sessions[0]
        expect = session.generate("hello there", max_tokens=60)
        parts = []
        for delta in session.stream("hello there", max_tokens=60):
            time.sleep(0.005)  # the driver runs ahead of the reader
            parts.append(delta)
        assert "".join(parts) == expect.text


# -- a server that cannot hang, leak a sequence or stall (issue 44) --------------------------------------


def _bounded(fn, timeout: float = 20.0):
    """``fn()`` on a thread of its own: its result or its exception, which must come within ``timeout``
    seconds (a request that waits forever fails the test instead of hanging it)."""
    box: list = []

    def go() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            box.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still waiting after {timeout} s: the call hangs"
    return box[0]


def test_a_request_whose_begin_fails_gives_its_sequence_back_once(monkeypatch):
    """``Generation.begin`` raises on a sequence a ticket waits for: the engine gives the sequence to
    that ticket, and the server's worker must not give it back a second time (issue 44, item 1)."""
    from power_core.serve.jobs import Job, Metrics, run_job
    from power_core.session import Generation

    real = Generation.begin

    def begin(self):
        if self.prompt.tolist() == [6, 6, 6]:
            raise RuntimeError("begin failed")
        return real(self)

    monkeypatch.setattr(Generation, "begin", begin)
    with Session.open_engine(1, _config("off"), model=MODEL, plugins=core_plugins()) as engine:
        first = engine.reserve()
        queued = engine.reserve()
        assert first.ready and not queued.ready
        for stream in (False, True):
            job = Job(prompt=np.asarray([6, 6, 6], dtype=np.int32), max_tokens=4, stop=(), sampling={},
                      top_logprobs=None, stream=stream)
            with pytest.raises(RuntimeError, match="begin failed"):
                run_job(engine, first.session.start(job.prompt, max_tokens=4), job, Metrics(),
                        (lambda commit: None) if stream else None)
            assert queued.ready and queued.session is first.session  # handed on once, to the waiting ticket
            assert engine.busy == 1
            late = engine.reserve()
            assert not late.ready, "a new request got the sequence the waiting ticket holds"
            first, queued = queued, late
        res = engine.run(first.session.start([1, 2, 3], max_tokens=4))
        assert res.tokens == _solo("off", [1, 2, 3], 4)
        assert queued.ready and engine.busy == 1
        engine.release(queued.session)
        assert engine.busy == 0


class _ShortPass:
    """A batch runtime whose ``at``-th pass returns one result too few (a backend defect)."""

    def __init__(self, inner, at: int) -> None:
        self.inner, self.at, self.passes = inner, at, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode_batch(self, items):
        self.passes += 1
        out = self.inner.decode_batch(items)
        return out[:-1] if self.passes == self.at else out


def test_a_short_pass_and_an_end_that_raises_never_stop_the_driver(monkeypatch):
    """A shared pass returns one result too few and a request in it fails to end (its ``end`` raises): the
    pass's rounds restore, that request ends with the error (the other one with the pass's), and the next
    request is served (issue 44, item 2: the driver thread used to die and every later request waited
    forever)."""
    from power_core.session import Generation

    real = Generation.end
    victims: list = []

    def end(self, failure, batch=None):
        if self in victims:
            raise RuntimeError("end failed")
        return real(self, failure, batch)

    monkeypatch.setattr(Generation, "end", end)
    with Session.open_engine(3, _config("off"), model=MODEL, plugins=core_plugins()) as engine:  # (the third: next)
        engine.runtime = _ShortPass(engine.runtime, at=3)  # the prefill, round 1, then round 2's pass
        victim, other = engine.submit([1, 2, 3], max_tokens=30), engine.submit([7, 8], max_tokens=30)
        victims.append(victim)
        out: dict = {}

        def go(name, gen) -> None:
            out[name] = _bounded(lambda: engine.run(gen))

        threads = [threading.Thread(target=go, args=item) for item in (("victim", victim), ("other", other))]
        with engine.held():  # both in every pass: the short one is shared
            for t in threads:
                t.start()
            joined(engine, 2)
        for t in threads:
            t.join(60)
        nxt = _bounded(lambda: engine.run(engine.submit([4, 5], max_tokens=6)))
        assert not isinstance(nxt, BaseException), nxt
        assert nxt.tokens == _solo("off", [4, 5], 6) and nxt.receipt.status == "completed"
        assert isinstance(out["victim"], RuntimeError) and "end failed" in str(out["victim"])  # what stopped its receipt
        assert isinstance(out["other"], RuntimeFault) and "results" in str(out["other"])  # the short pass
        assert engine.busy == 0  # their sequences went back all the same
        # the requests the short pass cut off can resume: their rounds restored
        victims.clear()
        for gen, prompt in ((victim, [1, 2, 3]), (other, [7, 8])):
            again = _bounded(lambda gen=gen: engine.run(gen))
            assert not isinstance(again, BaseException), again
            assert again.tokens == _solo("off", prompt, 30)


def test_a_driver_that_dies_fails_every_waiting_and_later_request():
    """A defect the driver cannot contain ends its thread: the engine is marked failed, the request it
    was running and the ticket waiting for a sequence end with a typed error, and so does every later
    request, at once (issue 44, item 2)."""
    with Session.open_engine(1, _config("off"), model=MODEL, plugins=core_plugins()) as engine:
        def defect(*args):
            raise RuntimeError("driver defect")

        engine._driver._pass = defect  # the pass fails, and so does ending its requests: the driver thread ends
        engine._driver._leave = defect
        gen = engine.submit([1, 2, 3], max_tokens=8)
        waiting = engine.reserve()
        assert not waiting.ready
        got = _bounded(lambda: engine.run(gen))
        assert isinstance(got, RuntimeFault) and "driver defect" in str(got), got
        assert gen.receipt is not None and gen.receipt.status == "failed"
        assert engine.failure is not None and "driver defect" in engine.failure
        with pytest.raises(RuntimeFault, match="driver"):
            waiting.wait(5)
        with pytest.raises(RuntimeFault, match="driver"):
            engine.reserve()
        assert engine.busy == 0


class _Abortable:
    """llama.cpp's abort flag on one reference target: its ``cancel`` ability sets the flag, the next
    decode consumes it (and raises :class:`Cancelled`), ``clear_abort`` withdraws it."""

    def __init__(self, monkeypatch, target) -> None:
        import attrs

        from power_core.reference.model import ReferenceTarget

        self.flag = False
        caps, decode = ReferenceTarget.capabilities.fget, ReferenceTarget.decode

        def with_cancel(t):
            return attrs.evolve(caps(t), cancel=self.abort, clear_abort=self.clear) if t is target else caps(t)

        def aborting(t, tokens):
            if t is target and self.flag:
                self.flag = False
                raise Cancelled("the decode was aborted through the cancel callback")
            return decode(t, tokens)

        monkeypatch.setattr(ReferenceTarget, "capabilities", property(with_cancel))
        monkeypatch.setattr(ReferenceTarget, "decode", aborting)

    def abort(self) -> None:
        self.flag = True

    def clear(self) -> None:
        self.flag = False


def test_a_late_cancel_of_a_finished_request_never_stops_the_next(monkeypatch):
    """The target's cancel listens to a request's token only while that request runs: a ``stop_now``
    that lands after it ended (a timeout firing late) must not abort the next request on the
    context (issue 44, item 4)."""
    from power_core.transaction import CancelToken

    with Session.open(_config("off"), model=MODEL, plugins=core_plugins()) as s:
        _Abortable(monkeypatch, s.opened.target)
        done = CancelToken()
        assert s.generate([1, 2, 3], max_tokens=5, cancel=done).receipt.status == "completed"
        gen = s.start([4, 5, 6], max_tokens=12)
        rounds = gen.rounds()
        next(rounds)
        done.cancel()  # the finished request's late cancel
        rest = _bounded(lambda: list(rounds))
        assert not isinstance(rest, BaseException), rest
        assert gen.receipt.status == "completed" and gen.tokens == _solo("off", [4, 5, 6], 12)
        # a request's own cancel still stops its decode, and clearing its token resumes it
        token = CancelToken()
        gen = s.start([7, 8], max_tokens=12, cancel=token)
        rounds = gen.rounds()
        next(rounds)
        token.cancel()
        with pytest.raises(Cancelled):
            list(rounds)
        token.reset()
        assert gen.run().tokens == _solo("off", [7, 8], 12)


class SleepyObserver:
    """A third-party observer whose ``power_request_end`` takes a second for short requests."""

    __name__ = "sleepy-observer"

    def __init__(self) -> None:
        self.slept: list[tuple[float, str]] = []

    @hookimpl
    def power_request_end(self, receipt):
        if receipt.output_tokens <= 3:
            self.slept.append((time.monotonic(), threading.current_thread().name))
            time.sleep(1.0)


def test_a_slow_end_observer_never_stalls_another_request(monkeypatch):
    """An observer that sleeps 1 s when a short request ends must not add 1 s to the inter-token gap
    of a request sharing its passes: observers run off the driver's thread (issue 44, item 5)."""
    obs = SleepyObserver()
    with Session.open_engine(2, _config("off"), model=MODEL, plugins=core_plugins(obs)) as engine:
        slow_passes(monkeypatch, 0.005)  # every pass at least 5 ms (a bigger model)
        long = engine.submit([1, 2, 3], max_tokens=300)
        stamps: list[float] = []
        short: list = []

        def read() -> None:
            for _ in engine.rounds(long):
                stamps.append(time.monotonic())
                if len(stamps) == 1:  # it decodes: a short request joins its passes and ends
                    gen = engine.submit([4, 5], max_tokens=3)
                    threading.Thread(target=lambda g=gen: short.append(engine.run(g)), daemon=True).start()

        assert _bounded(read, 60) is None
        assert len(obs.slept) == 1
        slept_at = obs.slept[0][0]
        assert stamps[-1] > slept_at + 0.5, "the long request ended before the observer woke: nothing measured"
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        assert max(gaps) < 0.5, f"a {max(gaps):.2f} s gap between the long request's tokens"
        assert obs.slept[0][1] != "power-engine"  # the short request's reader ran it
        assert long.tokens == _solo("off", [1, 2, 3], 300)
    deadline = time.monotonic() + 10
    while not short and time.monotonic() < deadline:
        time.sleep(0.01)
    assert short and short[0].tokens == _solo("off", [4, 5], 3)


def test_closing_a_batch_closes_every_session_when_one_close_fails():
    """A proposer whose ``close`` raises: every other session of the batch still closes and the shared
    runtime too, then the first failure is raised (issue 44, item 7)."""
    import attrs

    from power_core.errors import AdapterFault

    class FailsToClose:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        @property
        def capabilities(self):
            return attrs.evolve(self.inner.capabilities, batch=None, close=self.close)

        def close(self):
            raise OSError("disk full")

    batch = Session.open_batch(3, _config("ref-draft"), model=MODEL, plugins=core_plugins())
    closed: list[bool] = []
    real_close = batch.close_runtime
    batch.close_runtime = lambda: (closed.append(True), real_close())
    batch.sessions[0].proposer = FailsToClose(batch.sessions[0].proposer)
    with pytest.raises(AdapterFault, match="disk full"):
        batch.close()
    assert [s.closed for s in batch.sessions] == [True, True, True] and closed == [True]


class _Clobbered:
    """A batch runtime that hands out its pass's rows and taps as views of one buffer, which any sequence's
    own decode (a replay) overwrites with garbage: what ``BatchRuntime``'s contract allows a runtime to do
    (``LlamaBatch`` hands out views of llama.cpp's buffers)."""

    def __init__(self, inner, monkeypatch) -> None:
        self.inner = inner
        self.buffers: list[np.ndarray] = []
        self.clobbers = 0
        cls = type(inner.sequences[0])
        decode = cls.decode

        def replay(target, tokens):
            for buf in self.buffers:
                buf.fill(7.0e4)  # every row's argmax becomes token 0
            self.clobbers += 1
            return decode(target, tokens)

        monkeypatch.setattr(cls, "decode", replay)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _view(self, a: np.ndarray) -> np.ndarray:
        buf = np.array(a)
        self.buffers.append(buf)
        return buf

    def decode_batch(self, items):
        self.buffers = []
        return [attrs.evolve(r, logits=self._view(r.logits),
                             features={k: self._view(v) for k, v in r.features.items()})
                for r in self.inner.decode_batch(items)]


def test_a_replay_never_overwrites_rows_a_round_of_its_pass_still_reads(monkeypatch):
    """Every round of a shared pass reads its rows (``Transaction.read_round``) before any round commits, so a
    sequence that restores and replays alone in its commit (S = 1 < K: rejections deeper than the snapshots)
    overwrites no row another round still reads: each output is its solo run."""
    prompts = [[1, 2, 3], [5, 6], [9, 9, 9, 4], [7]]
    cfg = _config("ref-draft", spec_draft_max=4, spec_recurrent_snapshots=1, trace=True)
    with Session.open(cfg, model=MODEL, plugins=core_plugins()) as s:
        solo = [s.start(p, max_tokens=24).run().tokens for p in prompts]
    with Session.open_engine(4, cfg, model=MODEL, plugins=core_plugins()) as engine:
        runtime = _Clobbered(engine.runtime, monkeypatch)
        engine.runtime = runtime
        gens = [engine.submit(p, max_tokens=24) for p in prompts]
        out: list = [None] * len(gens)

        def go(i: int) -> None:
            out[i] = engine.run(gens[i])

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(gens))]
        with engine.held():  # all four join the same first pass, so every pass is shared until one ends
            for t in threads:
                t.start()
            joined(engine, len(gens))
        for t in threads:
            t.join(60)
    assert [r.tokens for r in out] == solo
    assert runtime.clobbers > 0  # replays ran while the pass's other rounds were open
    assert min(r.receipt.backend["batch"]["peak_concurrent"] for r in out) == 4


def test_a_restore_never_overwrites_rows_a_round_of_its_pass_still_reads(monkeypatch):
    """A round whose read fails (here: its request cancelled while the pass ran) restores only once every round
    of its pass has read its rows, since a restore may decode its sequence alone on the pass's context (a
    journaled recurrent llama target decodes its journal again): the other requests' outputs are their solo
    runs, and the cancelled one's is a prefix of its own."""
    from power_core.reference.model import ReferenceTarget
    from power_core.transaction import CancelToken

    prompts = [[1, 2, 3], [5, 6], [9, 9, 9, 4], [7]]
    cfg = _config("ref-draft", spec_draft_max=4, trace=True)
    with Session.open(cfg, model=MODEL, plugins=core_plugins()) as s:
        solo = [s.start(p, max_tokens=24).run().tokens for p in prompts]
    with Session.open_engine(4, cfg, model=MODEL, plugins=core_plugins()) as engine:
        runtime = _Clobbered(engine.runtime, monkeypatch)
        restore = ReferenceTarget.restore

        def replaying(target, checkpoint):
            for buf in runtime.buffers:
                buf.fill(7.0e4)
            runtime.clobbers += 1
            return restore(target, checkpoint)

        monkeypatch.setattr(ReferenceTarget, "restore", replaying)
        gens = [engine.submit(p, max_tokens=24, cancel=CancelToken()) for p in prompts]
        passes = 0
        decode_batch = runtime.decode_batch

        def cancelling(items):
            nonlocal passes
            out = decode_batch(items)
            passes += 1
            if passes == 3:
                gens[1].cancel.cancel()  # its round reads after this pass: Cancelled, and it restores
            return out

        runtime.decode_batch = cancelling
        engine.runtime = runtime
        out: list = [None] * len(gens)
        errors: list = [None] * len(gens)

        def go(i: int) -> None:
            try:
                out[i] = engine.run(gens[i])
            except Cancelled as exc:
                errors[i] = exc

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(gens))]
        with engine.held():
            for t in threads:
                t.start()
            joined(engine, len(gens))
        for t in threads:
            t.join(60)
    assert runtime.clobbers > 0 and passes >= 3
    assert [r.tokens for i, r in enumerate(out) if i != 1] == [t for i, t in enumerate(solo) if i != 1]
    cancelled = out[1].tokens if out[1] is not None else gens[1].txn.emitted
    assert errors[1] is not None or out[1].receipt.status == "cancelled"
    assert list(cancelled) == list(solo[1][: len(cancelled)]) and len(cancelled) < len(solo[1])
