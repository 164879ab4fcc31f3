"""Every solo request decodes on the process's compute thread (power_core.compute), whichever thread reads it.

llama.cpp leads an OpenMP team from each thread that decodes; a process with one per reading thread decodes
at a third of the speed (the module's docstring has the figures). These tests check the mechanism: where the
rounds run, that results, errors, interrupts and early exits are the reader's as before, and that requests
of several sessions share the thread.
"""

from __future__ import annotations

import contextvars
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import open_session

from power_core.compute import ComputeThread, compute_thread, wait_get
from power_core.errors import Cancelled, ConfigError
from power_core.plugins import hookimpl

MODEL = "reference:seed=2,vocab=288,dim=16,eos=256"
PROMPT = [104, 105, 106]


class _Where:
    """Records the thread every verify phase runs on."""

    __name__ = "test.where"

    def __init__(self) -> None:
        self.threads: list[int] = []
        self.names: list[str] = []

    @hookimpl(wrapper=True)
    def power_txn_phase(self, phase, round_index):
        if phase == "verify":
            self.threads.append(threading.get_ident())
            self.names.append(threading.current_thread().name)
        return (yield)


def test_every_round_runs_on_the_compute_thread_whichever_thread_reads_it():
    where = _Where()
    with open_session(MODEL, "ref-draft", None, where, max_tokens=12) as a, \
            open_session(MODEL, "ref-draft", None, where, max_tokens=12) as b, ThreadPoolExecutor(2) as pool:
        expected = a.generate(PROMPT).tokens  # the main thread reads
        got = [pool.submit(s.generate, PROMPT).result().tokens for s in (a, b, a)]  # two other threads
        streamed = pool.submit(lambda: [r.emitted for r in b.start(PROMPT).rounds()]).result()  # iterated
    assert got == [expected] * 3
    assert sum(streamed) == len(expected) and len(streamed) > 1
    # the compute thread (it may have ended while idle and started again: a thread of that name each time)
    assert where.names and set(where.names) == {"power-compute"}
    assert threading.get_ident() not in where.threads and compute_thread().idle > 0


def test_a_requests_error_and_cancel_reach_its_reader():
    with open_session(MODEL, "ref-draft", max_tokens=40) as s:
        gen = s.start(PROMPT)
        rounds = gen.rounds()
        next(rounds)
        gen.cancel.cancel()
        with pytest.raises(Cancelled):
            next(rounds)
        assert gen.receipt is not None and gen.receipt.status == "cancelled"
        kept = len(gen.tokens)
        assert kept >= 1 and s.generate(PROMPT).tokens  # the session serves the next request


def test_a_reader_that_leaves_early_ends_its_request_and_frees_the_session():
    with open_session(MODEL, "ref-draft", max_tokens=40) as s:
        expected = s.generate(PROMPT).tokens
        gen = s.start(PROMPT)
        rounds = gen.rounds()
        first = next(rounds).emitted
        threading.Thread(target=rounds.close).start()  # closed from another thread, as a server's would be
        for _ in range(200):
            if gen.receipt is not None:
                break
            time.sleep(0.01)
        assert gen.receipt is not None and gen.receipt.status == "cancelled"
        assert gen.tokens[:first] == expected[:first]
        assert s.generate(PROMPT).tokens == expected


def test_requests_of_two_sessions_read_at_once_both_finish_exactly():
    with open_session(MODEL, "ref-draft", max_tokens=30) as a, open_session(MODEL, "off", max_tokens=30) as b:
        want = (a.generate(PROMPT).tokens, b.generate(PROMPT).tokens)
        for _ in range(3):
            with ThreadPoolExecutor(2) as pool:
                fa, fb = pool.submit(a.generate, PROMPT), pool.submit(b.generate, PROMPT)
                assert (fa.result().tokens, fb.result().tokens) == want


def test_a_bad_request_is_refused_on_the_readers_thread():
    with open_session(MODEL, "ref-draft", max_tokens=4) as s:
        with pytest.raises(ConfigError):
            s.generate(PROMPT, sampling={"temperature": -1.0})
        assert s.generate(PROMPT).tokens


# -- the thread itself ---------------------------------------------------------------------------------------
def test_a_call_returns_raises_and_carries_the_callers_context():
    worker = ComputeThread(name="test-compute")
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    var.set("caller's")
    assert worker.call(lambda: (threading.get_ident(), var.get())) == (worker.ident, "caller's")
    with pytest.raises(KeyError, match="boom"):
        worker.call(lambda: {}["boom"])
    # a call from the thread itself runs at once (no deadlock)
    assert worker.call(lambda: worker.call(lambda: threading.get_ident())) == worker.ident


def test_an_idle_thread_ends_and_the_next_call_starts_another():
    """The thread ends after ``idle`` seconds without a call (and its OpenMP team with it: an engine's driver is
    then the process's only team); a call after that, or racing with its end, is served by a new one."""
    worker = ComputeThread(name="test-compute", idle=0.02)
    assert worker.call(threading.get_ident) == worker.ident
    for _ in range(200):
        if worker.ident is None:
            break
        time.sleep(0.01)
    assert worker.ident is None  # it ended
    second = worker.call(threading.get_ident)
    assert worker.call(lambda: "served") == "served" and second == worker.ident
    for delay in (0.0, 0.01, 0.015, 0.019, 0.02, 0.021, 0.025, 0.03) * 5:  # calls around the moment it ends
        time.sleep(delay)
        assert worker.call(lambda: 7) == 7


def test_an_interrupted_caller_runs_its_interrupt_and_waits_for_the_call():
    worker = ComputeThread(name="test-compute")
    stop = threading.Event()
    finished: list[bool] = []

    def work() -> str:
        stop.wait(10)
        finished.append(True)
        return "done"

    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))  # Ctrl-C while the main thread waits
    timer.start()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        worker.call(work, interrupt=stop.set)
    assert time.perf_counter() - t0 < 5  # the interrupt stopped the work (not its 10 s timeout)
    assert finished == [True]  # the work settled before the interrupt reached the caller
    assert worker.call(lambda: "still serving") == "still serving"


def test_wait_get_returns_the_item_and_lets_a_ctrl_c_through():
    q: queue.Queue[str] = queue.Queue()
    threading.Timer(0.12, q.put, ("item",)).start()
    assert wait_get(q) == "item"
    threading.Timer(0.05, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        wait_get(q)  # nothing ever arrives
    assert time.perf_counter() - t0 < 5
