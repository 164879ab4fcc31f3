"""The ``power.adapters`` entry point of power-dflash: registers the ``dflash`` strategy.

The shared block-draft mechanics (draft context, feature injection, noise block, trimming) are
power-native's (:mod:`power_native.block`); this package owns the contract's validator and readout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from power_core.spec import ProposerRequest, Strategy, hookimpl, package_version
from power_dflash.validate import validate_dflash


def _proposer(req: ProposerRequest) -> Any:
    from power_native.block import open_block_draft

    from power_dflash.readout import V1Readout

    return open_block_draft(req, lambda model, r: V1Readout(p_min=r.config.spec_draft_p_min))


def _target_features(verified: Any) -> frozenset[str]:
    from power_native.block import target_features

    return target_features(verified)


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="dflash", version=package_version("power-dflash"), package="power-dflash", kind="model-backed", needs_draft=True,
        summary="DFlash v1 block drafts through llama.cpp's dflash graph: proposals from one forward of the noise block.",
        validate=validate_dflash, proposer=_proposer, backends=frozenset({"llama"}), target_features=_target_features,
    ))
