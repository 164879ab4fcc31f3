"""The ``power.adapters`` entry point of power-mtp: registers the ``mtp`` strategy.

The llama.cpp execution path comes in a later release, so ``proposer`` is None; the session
fails closed ("execution path not available yet") when this strategy is selected to run.
"""

from __future__ import annotations

from collections.abc import Callable

from power_core.plugins import Strategy, hookimpl, package_version
from power_mtp.validate import validate_mtp


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="mtp", version=package_version("power-mtp"), package="power-mtp", kind="model-backed", needs_draft=False,
        summary="Native MTP (nextn) heads carried by the target GGUF: validator and strategy registration.",
        validate=validate_mtp, proposer=None,
    ))
