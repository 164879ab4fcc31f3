"""The ``power.adapters`` entry point of power-dflash: registers the ``dflash`` strategy.

The shared block-draft mechanics (draft context, feature injection, noise block, trimming) are
power-native's (:mod:`power_native.block`); this package owns the contract's validator and readout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from power_core.blockdraft import block_strategy
from power_core.spec import Strategy, hookimpl, package_version
from power_dflash.validate import validate_dflash


def _readout(model: Any, req: Any) -> Any:
    from power_dflash.readout import V1Readout

    return V1Readout(p_min=req.config.spec_draft_p_min)


def _driver() -> Any:
    import power_native.block  # on first use: registering the strategy must not need power-native

    return power_native.block


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(block_strategy(
        name="dflash", version=package_version("power-dflash"), package="power-dflash", validate=validate_dflash,
        driver=_driver, make_readout=_readout,
        summary="DFlash v1 block drafts through llama.cpp's dflash graph: proposals from one forward of the noise block.",
    ))
