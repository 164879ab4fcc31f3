"""The process's compute thread: the one thread every solo request's rounds run on.

llama.cpp's CPU backend runs a graph as an OpenMP team led by the thread that calls it, and libgomp keeps a
team for every thread that has led one. Once the process holds more of those threads than CPUs, libgomp
stops spinning at the barriers between a graph's ops, and every pass pays a sleep and a wake-up per barrier
(:func:`power_core.opening.in_own_thread` says the same of opening). So a request must not decode on
whichever thread happens to read it: with a team per reading thread, on this 2-core machine (tiny qwen35 with
its MTP head, 192 tokens; ``nox -s bench_threads``, docs/evidence/bench_threads) a session read from two
threads in turn took 176 ms a request against 44 from one, two sessions each read from a thread of its own
155 ms, and ``power serve --no-batch --parallel 2`` 145 ms; on this thread, 45, 45 and 37 ms.

:func:`compute_thread` is one daemon thread per process (``power-compute``), started when first needed. The
solo driver (:meth:`~power_core.engine.Engine.rounds`) hands it a request's rounds; whoever reads them
waits. Requests of several sessions interleave there round by round (:meth:`ComputeThread.busy` lets a
request that runs to its end give way between rounds). The shared passes' driver (one thread per engine)
and the thread that opens a model (which ends) lead the only other teams. The compute thread ends once it
has been idle for :data:`IDLE_S` (libgomp releases its team with it) and starts again at the next call, so a
process that ran solo requests and then an engine does not keep a second team beside the driver's (DFlash on
the bench fixtures, one process: an engine after a solo session took 547-720 ms a request with the thread kept,
161-234 with it ended; docs/evidence/bench_threads/idle-2026-12-07). Solo requests while an engine runs still
put two teams in the process.
"""

from __future__ import annotations

import contextvars
import os
import queue
import signal
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["ComputeThread", "compute_thread", "wait_get"]

_T = TypeVar("_T")
#: how often a thread waiting for a call runs its signal handlers (the longest a Ctrl-C waits for them)
_WAIT_SLICE_S = 0.05
#: how long the compute thread waits for a call before it ends (a call starts it again)
IDLE_S = 1.0
#: a call: the context's ``run``, the box its outcome goes to, the callable, the lock released when it is there
_Job = tuple[Callable[..., Any], list[tuple[bool, Any]], Callable[[], Any], threading.Lock]


class ComputeThread:
    """A thread that runs the callables handed to it, one at a time, in the order they came
    (:meth:`call`)."""

    def __init__(self, name: str = "power-compute", idle: float = IDLE_S) -> None:
        self.name, self.idle = name, idle
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._state = threading.Lock()  # a call's put and the thread's decision to end exclude each other
        self._thread: threading.Thread | None = None
        with self._state:
            self._start()

    def _start(self) -> None:  # under self._state
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        """The identifier of the thread serving calls now (``None`` while none is: the next call starts one)."""
        thread = self._thread
        return thread.ident if thread is not None else None

    def busy(self) -> bool:
        """Whether a call is waiting for this thread (read by the call it runs, to give way)."""
        return not self._jobs.empty()

    def call(self, fn: Callable[[], _T], *, interrupt: Callable[[], None] | None = None) -> _T:
        """``fn()`` on this thread, in the caller's context (``contextvars``: its log fields); its result,
        or its exception, raised here. A call from this thread itself runs at once. Interrupted while it
        waits (Ctrl-C), the caller runs ``interrupt`` (a request's cancel), still waits for ``fn`` to
        return (what it changed is settled), and re-raises."""
        if threading.get_ident() == self.ident:
            return fn()
        box: list[tuple[bool, Any]] = []
        done = threading.Lock()
        done.acquire()
        with self._state:
            self._jobs.put((contextvars.copy_context().run, box, fn, done))
            if self._thread is None:  # it ended while idle: a new one serves the call
                self._start()
        interrupted: BaseException | None = None
        # in slices: a signal that lands just before the lock's wait begins (a Ctrl-C) does not wake it, and
        # its handler runs only when this thread next runs Python. Interrupted, the call still settles first.
        while not box:
            try:
                done.acquire(timeout=_WAIT_SLICE_S)
            except BaseException as exc:  # noqa: BLE001 - raised once the call has settled
                if interrupted is None:
                    interrupted = exc
                    if interrupt is not None:
                        interrupt()
        if interrupted is not None:
            raise interrupted
        ok, value = box[0]
        if ok:
            return value  # type: ignore[no-any-return]
        raise value

    def _serve(self) -> None:
        if hasattr(signal, "pthread_sigmask"):  # a Ctrl-C interrupts the thread that waits for a call, never
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # this one (nor its OpenMP team)
        while True:
            try:
                run, box, fn, done = self._jobs.get(timeout=self.idle)
            except queue.Empty:
                with self._state:
                    if self._jobs.empty():  # idle: end (and with it this thread's OpenMP team)
                        self._thread = None
                        return
                continue
            try:
                box.append((True, run(fn)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
                box.append((False, exc))
            finally:
                done.release()


def wait_get(q: queue.Queue[_T]) -> _T:
    """``q.get()`` in slices, so that a signal landing just before the wait begins has its handler (a Ctrl-C's)
    run within a slice, not when the next item arrives (for a reader waiting for a request's end: its end)."""
    while True:
        try:
            return q.get(timeout=_WAIT_SLICE_S)
        except queue.Empty:
            continue


_lock = threading.Lock()
_compute: ComputeThread | None = None


def compute_thread() -> ComputeThread:
    """The process's compute thread (started on first use)."""
    global _compute
    with _lock:
        if _compute is None:
            _compute = ComputeThread()
        return _compute


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: it starts its own compute thread when it needs one."""
    global _compute, _lock
    _compute, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
