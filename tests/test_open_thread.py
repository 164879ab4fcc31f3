"""Opening computes (warm-up, the verify-cost curve, probes) on a thread that ends with the open, so the
thread that decodes afterwards leads the process's only OpenMP team on llama.cpp's CPU backend
(power_core.opening.in_own_thread); what the open returns or raises is unchanged."""

from __future__ import annotations

import contextvars
import threading

import pytest

from power_core import numerics
from power_core.config import PowerConfig
from power_core.errors import ConfigError
from power_core.session import Session, in_own_thread
from tests.helpers import core_plugins

MODEL = "reference:seed=0,vocab=288,dim=24,eos=256"
VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


def test_in_own_thread_returns_raises_and_sees_the_callers_context():
    caller = threading.get_ident()
    VAR.set("caller's")
    seen: list = []

    def work() -> int:
        seen.append((threading.get_ident(), VAR.get()))
        return 42

    assert in_own_thread(work) == 42
    assert seen[0][0] != caller and seen[0][1] == "caller's"
    boom = ConfigError("k", 1, "2")
    with pytest.raises(ConfigError) as info:
        in_own_thread(lambda: (_ for _ in ()).throw(boom))
    assert info.value is boom


def test_session_and_engine_open_compute_on_a_thread_that_has_ended(monkeypatch):
    threads: list[threading.Thread] = []
    plugins = core_plugins()

    def record(fn):
        def wrapped(*args, **kw):
            threads.append(threading.current_thread())
            return fn(*args, **kw)
        return wrapped

    # the session over a loaded target (self-test, proposer): called inside the open
    monkeypatch.setattr(Session, "_on", classmethod(record(Session._on.__func__)))
    monkeypatch.setattr("power_core.session.batch_probe", record(numerics.batch_probe))
    cfg = PowerConfig(spec_mode="off", n_ctx=256)
    with Session.open(cfg, model=MODEL, plugins=plugins) as s:
        assert s.generate([1, 2, 3], max_tokens=4).tokens
    with Session.open_engine(2, cfg, model=MODEL, plugins=plugins) as e:
        assert e.probe is not None
    assert len(threads) == 4  # Session.open, open_batch's two sessions, the engine's batch probe
    assert all(t is not threading.current_thread() and not t.is_alive() for t in threads)
