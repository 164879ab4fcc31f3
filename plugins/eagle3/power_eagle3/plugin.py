"""The ``power.adapters`` entry point of power-eagle3: registers the ``eagle3`` strategy.

The strategy is model-backed on the ``llama`` backend and needs a draft file: ``auto`` picks it only
for a given ``eagle3``-arch draft (``contracts.classify_draft``), never from a target alone. The
proposer (:mod:`power_eagle3.proposer`) imports power-native when it opens, not when the plugin
registers, so ``power plugins`` lists the strategy without power-native installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from power_core.blockdraft import DRAFT_P_MIN
from power_core.runtime import Proposer
from power_core.spec import ProposerRequest, Strategy, hookimpl, package_version
from power_eagle3.validate import validate_eagle3


def _proposer(req: ProposerRequest) -> Proposer:
    from power_eagle3.proposer import open_eagle3

    return open_eagle3(req)


def _target_features(verified: Any) -> frozenset[str]:
    from power_eagle3.proposer import target_features

    return target_features(verified)


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="eagle3", version=package_version("power-eagle3"), package="power-eagle3", kind="model-backed",
        needs_draft=True, validate=validate_eagle3, proposer=_proposer, backends=frozenset({"llama"}),
        target_features=_target_features, config_keys=(DRAFT_P_MIN,),
        summary="EAGLE3 draft heads through llama.cpp's eagle3 graph: three target layers fused into g, "
                "K autoregressive decoder steps per round.",
    ))
