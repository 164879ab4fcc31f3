"""The ``power.adapters`` entry point of power-mtp: registers the ``mtp`` strategy."""

from __future__ import annotations

from collections.abc import Callable

from power_core.spec import ProposerRequest, Strategy, hookimpl, package_version
from power_mtp.validate import validate_mtp


def _proposer(req: ProposerRequest):
    from power_mtp.proposer import make_mtp_proposer

    return make_mtp_proposer(req)


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    from power_mtp.proposer import TARGET_FEATURES

    register(Strategy(
        name="mtp", version=package_version("power-mtp"), package="power-mtp", kind="model-backed", needs_draft=False,
        summary="Native MTP: the target's own nextn head drafts greedily through llama.cpp's MTP graph.",
        validate=validate_mtp, proposer=_proposer, backends=frozenset({"llama"}), target_features=TARGET_FEATURES,
    ))
