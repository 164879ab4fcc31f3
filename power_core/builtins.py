"""Power's built-in plugin: the target-only strategy and the core's ``power_txn_phase`` runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from power_core.spec import Strategy, hookimpl, package_version


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="off", version=package_version("power-core"), package="power-core", kind="target-only",
        summary="Target-only autoregressive decoding (speculation off).",
    ))


@hookimpl(trylast=True)
def power_txn_phase(step: Callable[[], Any]) -> Any:
    """The innermost call of every phase: run the transaction's step. No other plugin may answer
    this hook (:func:`power_core.plugins.check_observers_only`); observers wrap it."""
    return step()
