"""Ready-made observers: plugins that wrap transaction phases without changing them."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Generator
from typing import Any

from power_core.logs import get_logger
from power_core.spec import hookimpl

__all__ = ["PhaseTimer"]

log = get_logger("power_core.txn")


class PhaseTimer:
    """Accumulates wall time per transaction phase and logs one ``txn.phase`` debug event per phase.

    Register it with ``build_plugins(extra=(timer,))`` (``power run --profile`` does).
    """

    __name__ = "power.observers.phase-timer"

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @hookimpl(wrapper=True)
    def power_txn_phase(self, phase: str, round_index: int) -> Generator[None, Any, Any]:
        t0 = time.perf_counter()
        try:
            return (yield)
        finally:
            dt = time.perf_counter() - t0
            self.seconds[phase] += dt
            self.calls[phase] += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("txn.phase", phase=phase, round=round_index, seconds=dt)

    def summary(self) -> dict[str, dict[str, float]]:
        return {p: {"seconds": self.seconds[p], "calls": self.calls[p]} for p in self.seconds}
