"""The ``power.adapters`` entry point of power-dspark: registers the ``dspark`` strategy.

The shared block-draft mechanics (draft context, feature injection, noise block, trimming) are
power-native's (:mod:`power_native.block`); this package owns the contract's validator and readout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from power_core.artifacts.contracts import Verified
from power_core.blockdraft import block_strategy
from power_core.spec import ProposerRequest, Strategy, hookimpl, package_version
from power_dspark.validate import validate_dspark


def _readout(model: Any, req: ProposerRequest) -> Any:
    from power_dspark.readout import DSparkReadout

    backbone = req.validated(Verified).backbone
    assert backbone is not None  # the DSpark validator always proves the dflash backbone
    return DSparkReadout(anchor_first=backbone.sample_from_anchor, p_min=req.config.spec_draft_p_min)


def _driver() -> Any:
    import power_native.block  # on first use: registering the strategy must not need power-native

    return power_native.block


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(block_strategy(
        name="dspark", version=package_version("power-dspark"), package="power-dspark", validate=validate_dspark,
        driver=_driver, make_readout=_readout,
        summary="DSpark block drafts through llama.cpp's dflash graph: anchor-first block, in-graph Markov head, confidence cut.",
    ))
