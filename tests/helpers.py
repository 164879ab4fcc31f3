"""Shared helpers for the core's tests: sessions over the reference backend only."""

from __future__ import annotations

import os
from typing import Any

import attrs
import pytest

from power_core.config import PowerConfig
from power_core.plugins import PowerPlugins, build_plugins
from power_core.session import Result, Session

_CORE: PowerPlugins | None = None


def core_plugins(*extra: object) -> PowerPlugins:
    """Built-ins only (no entry points), so core tests do not depend on what else is installed."""
    global _CORE
    if _CORE is not None and not extra:
        return _CORE
    old = os.environ.get("POWER_LOAD_PLUGINS")
    os.environ["POWER_LOAD_PLUGINS"] = ""
    try:
        plugins = build_plugins(extra=extra)
    finally:
        if old is None:
            del os.environ["POWER_LOAD_PLUGINS"]
        else:
            os.environ["POWER_LOAD_PLUGINS"] = old
    if not extra:
        _CORE = plugins
    return plugins


def open_session(model: str, mode: str = "off", draft: str | None = None, *extra: object,
                 stop_ids: frozenset[int] | None = None, **cfg: Any) -> Session:
    cfg.setdefault("n_ctx", 256)
    return Session.open(PowerConfig(spec_mode=mode, **cfg), model=model, draft=draft,
                        plugins=core_plugins(*extra), stop_ids=stop_ids)


def run(model: str, prompt: list[int], mode: str = "off", draft: str | None = None, **cfg: Any) -> Result:
    stop_ids = cfg.pop("stop_ids", None)
    with open_session(model, mode, draft, stop_ids=stop_ids, **cfg) as s:
        return s.generate(prompt)


def build_tools():
    """``native/tools/build_llama.py`` as a module (a script, not a package), loaded once."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "power_build_llama"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parent.parent / "native" / "tools" / "build_llama.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolves a class's module by name
        spec.loader.exec_module(module)
    return sys.modules[name]


def joined(engine: Any, n: int, timeout: float = 30.0) -> None:
    """Wait until ``engine``'s shared driver holds ``n`` requests (joining or in its passes): with the engine
    held (:meth:`Engine.held`), they then all join the same next pass."""
    import time

    deadline = time.monotonic() + timeout
    while engine.running < n:
        assert time.monotonic() < deadline, f"{engine.running} of {n} requests joined the driver"
        time.sleep(0.001)


def slow_passes(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every target pass of the reference backend takes at least ``seconds`` (a bigger model): a shared pass
    (``ReferenceBatch.decode_batch``) and a request's pass alone on its sequence (``ReferenceTarget.decode``,
    which the shared driver runs for a request that decodes alone)."""
    import time

    from power_core.reference.model import ReferenceTarget
    from power_core.reference.plugin import ReferenceBatch

    for cls, name in ((ReferenceBatch, "decode_batch"), (ReferenceTarget, "decode")):
        real = getattr(cls, name)

        def slow(self: Any, *args: Any, _real: Any = real) -> Any:
            time.sleep(seconds)
            return _real(self, *args)

        monkeypatch.setattr(cls, name, slow)


def check_host_split(receipt: Any, *, draft_timed: bool) -> dict[str, float]:
    """The receipt's compute/host split of its decode time: target + draft compute + host = decode."""
    t = receipt.timings
    assert {"target_compute_s", "draft_compute_s", "host_s", "decode_rounds", "host_us_per_round"} <= set(t), t
    assert t["decode_rounds"] == len(receipt.rounds)
    assert t["target_compute_s"] > 0 and t["host_s"] > 0
    assert (t["draft_compute_s"] > 0) is draft_timed
    assert t["target_compute_s"] + t["draft_compute_s"] + t["host_s"] == pytest.approx(t["decode_s"], rel=1e-9, abs=1e-9)
    assert t["host_us_per_round"] == pytest.approx(1e6 * t["host_s"] / t["decode_rounds"])
    return t


class Flaky:
    """A proposer whose n-th propose raises (a foreign exception: the core makes it an AdapterFault)."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def capabilities(self) -> Any:
        """The inner proposer's, but it drafts alone: a draft batch knows its own proposers, not a wrapper."""
        return attrs.evolve(self.inner.capabilities, batch=None)

    def propose(self, ctx: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("boom")
        return self.inner.propose(ctx)
