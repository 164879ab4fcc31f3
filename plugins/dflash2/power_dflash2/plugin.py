"""The ``power.adapters`` entry point of power-dflash2: registers the ``dflash2`` strategy.

The llama.cpp execution path comes in a later release, so ``proposer`` is None; the session
fails closed ("execution path not available yet") when this strategy is selected to run.
"""

from __future__ import annotations

from collections.abc import Callable

from power_core.plugins import Strategy, hookimpl, package_version
from power_dflash2.validate import validate_dflash2


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="dflash2", version=package_version("power-dflash2"), package="power-dflash2", kind="model-backed", needs_draft=True,
        summary="DFlash2 drafts (`dflash` arch + selector and per-layer convolution tensors): validator and strategy registration.",
        validate=validate_dflash2, proposer=None,
    ))
