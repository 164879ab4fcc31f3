"""The ``power.adapters`` entry point of power-dflash: registers the ``dflash`` strategy.

The llama.cpp execution path comes in a later release, so ``proposer`` is None; the session
fails closed ("execution path not available yet") when this strategy is selected to run.
"""

from __future__ import annotations

from collections.abc import Callable

from power_core.plugins import Strategy, hookimpl, package_version
from power_dflash.validate import validate_dflash


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="dflash", version=package_version("power-dflash"), package="power-dflash", kind="model-backed", needs_draft=True,
        summary="DFlash v1 drafts (llama.cpp `dflash` arch, no selector/conv/Markov parts): validator and strategy registration.",
        validate=validate_dflash, proposer=None,
    ))
