"""The ``power.adapters`` entry point of power-dflash2: registers the ``dflash2`` strategy.

The shared block-draft mechanics (draft context, feature injection, noise block, trimming) are
power-native's (:mod:`power_native.block`); this package owns the contract's validator and readout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from power_core.spec import ProposerRequest, Strategy, hookimpl, package_version
from power_dflash2.validate import validate_dflash2


def _proposer(req: ProposerRequest) -> Any:
    from power_native.block import open_block_draft

    from power_dflash2.readout import LatticeReadout

    return open_block_draft(req, lambda model, r: LatticeReadout(top_k=model.dflash_selector_top_k(),
                                                                 p_min=r.config.spec_draft_p_min))


def _target_features(verified: Any) -> frozenset[str]:
    from power_native.block import target_features

    return target_features(verified)


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="dflash2", version=package_version("power-dflash2"), package="power-dflash2", kind="model-backed", needs_draft=True,
        summary="DFlash2 block drafts through llama.cpp's dflash graph: the selector-lattice walk over one forward.",
        validate=validate_dflash2, proposer=_proposer, backends=frozenset({"llama"}), target_features=_target_features,
    ))
