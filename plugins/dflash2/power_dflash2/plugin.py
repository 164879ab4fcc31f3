"""The ``power.adapters`` entry point of power-dflash2: registers the ``dflash2`` strategy.

The shared block-draft mechanics (draft context, feature injection, noise block, trimming) are
power-native's (:mod:`power_native.block`); this package owns the contract's validator and readout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from power_core.blockdraft import block_strategy
from power_core.spec import Strategy, hookimpl, package_version
from power_dflash2.validate import validate_dflash2


def _readout(model: Any, req: Any) -> Any:
    from power_dflash2.readout import LatticeReadout

    return LatticeReadout(top_k=model.dflash_selector_top_k(), p_min=req.config.spec_draft_p_min)


def _driver() -> Any:
    import power_native.block  # on first use: registering the strategy must not need power-native

    return power_native.block


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(block_strategy(
        name="dflash2", version=package_version("power-dflash2"), package="power-dflash2", validate=validate_dflash2,
        driver=_driver, make_readout=_readout,
        summary="DFlash2 block drafts through llama.cpp's dflash graph: the selector-lattice walk over one forward.",
    ))
