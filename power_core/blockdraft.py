"""The one :class:`~power_core.spec.Strategy` factory of the DFlash-family plugins (DFlash v1, DFlash2,
DSpark): each registers a model-backed strategy on the ``llama`` backend whose proposer is
power-native's block-draft driver (:func:`power_native.block.open_block_draft`) with the contract's
readout, and whose target features are the draft's target layers
(:func:`power_native.block.target_features`). The plugins differ only in the arguments.

The factory lives in the core, not in power-native, because a plugin registers its strategy when it is
imported, and that must work without power-native installed (``power plugins`` lists it; selection
then refuses it for want of the ``llama`` backend). power-native is imported when a proposer opens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from power_core.runtime import Proposer
from power_core.spec import ConfigKey, ProposerRequest, Strategy

__all__ = ["DRAFT_P_MIN", "block_strategy"]

#: the family's one key: a proposal stops where the draft's confidence falls below it (llama.cpp
#: ``--spec-draft-p-min``); each family strategy declares it, alike, and so do power-eagle3 and power-mtp
DRAFT_P_MIN = ConfigKey(
    name="spec_draft_p_min", type=float, default=0.0, lo=0.0, hi=1.0, hi_open=True,
    flag="--p-min", help="draft heads (DFlash family, EAGLE3, MTP) stop a proposal below this draft confidence (0: never)",
)


def block_strategy(*, name: str, version: str, package: str, summary: str, validate: Callable[..., Any],
                   make_readout: Callable[[Any, ProposerRequest], Any],
                   driver: Callable[[], Any]) -> Strategy:
    """The Strategy of one DFlash-family plugin. ``make_readout(draft_model, request)`` builds the
    contract's :class:`power_native.block.Readout` once the draft model is loaded; ``driver()``
    returns power-native's block module (the plugin imports it lazily: the core never imports
    power-native)."""

    def proposer(req: ProposerRequest) -> Proposer:
        proposer_: Proposer = driver().open_block_draft(req, make_readout)
        return proposer_

    def target_features(verified: Any) -> frozenset[str]:
        return frozenset(driver().target_features(verified))

    return Strategy(name=name, version=version, package=package, kind="model-backed", needs_draft=True,
                    summary=summary, validate=validate, proposer=proposer, backends=frozenset({"llama"}),
                    target_features=target_features, config_keys=(DRAFT_P_MIN,))
