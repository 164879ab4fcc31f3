"""The ``power.adapters`` entry point of power-dspark: registers the ``dspark`` strategy.

The shared block-draft mechanics (draft context, feature injection, noise block, trimming) are
power-native's (:mod:`power_native.block`); this package owns the contract's validator and readout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from power_core.spec import ProposerRequest, Strategy, hookimpl, package_version
from power_dspark.validate import validate_dspark


def _proposer(req: ProposerRequest) -> Any:
    from power_native.block import open_block_draft

    from power_dspark.readout import DSparkReadout

    return open_block_draft(
        req, lambda model, r: DSparkReadout(anchor_first=bool(r.verified.result.facts["sample_from_anchor"]),
                                            p_min=r.config.spec_draft_p_min))


def _target_features(verified: Any) -> frozenset[str]:
    from power_native.block import target_features

    return target_features(verified)


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="dspark", version=package_version("power-dspark"), package="power-dspark", kind="model-backed", needs_draft=True,
        summary="DSpark block drafts through llama.cpp's dflash graph: anchor-first block, in-graph Markov head, confidence cut.",
        validate=validate_dspark, proposer=_proposer, backends=frozenset({"llama"}), target_features=_target_features,
    ))
