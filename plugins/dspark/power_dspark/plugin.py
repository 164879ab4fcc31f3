"""The ``power.adapters`` entry point of power-dspark: registers the ``dspark`` strategy.

The llama.cpp execution path comes in a later release, so ``proposer`` is None; the session
fails closed ("execution path not available yet") when this strategy is selected to run.
"""

from __future__ import annotations

from collections.abc import Callable

from power_core.plugins import Strategy, hookimpl, package_version
from power_dspark.validate import validate_dspark


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="dspark", version=package_version("power-dspark"), package="power-dspark", kind="model-backed", needs_draft=True,
        summary="DSpark drafts (`dflash` backbone + Markov head, optional confidence head): validator and strategy registration.",
        validate=validate_dspark, proposer=None,
    ))
