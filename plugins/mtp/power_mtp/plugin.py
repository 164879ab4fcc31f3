"""The ``power.adapters`` entry point of power-mtp: registers the ``mtp`` strategy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from power_core.artifacts.contracts import mtp_evidence
from power_core.blockdraft import DRAFT_P_MIN
from power_core.spec import ConfigKey, ProposerRequest, Strategy, hookimpl, package_version
from power_mtp.validate import validate_mtp

#: the FR compact vocabulary: the head's output matmul covers ids < N only (the validator checks N < n_vocab)
FR_VOCAB_SIZE = ConfigKey(
    name="spec_mtp_fr_vocab_size", type=int, default=None, optional=True, lo=1, flag="--fr-vocab",
    help="MTP drafts only from the first N token ids (unset: the whole vocabulary)",
)


def _detect(target: Any) -> str | None:
    """``auto`` without a draft runs MTP when the target carries MTP layers."""
    evidence = mtp_evidence(target)
    return f"MTP layers ({evidence})" if evidence is not None else None


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
        config_keys=(FR_VOCAB_SIZE, DRAFT_P_MIN), auto_detect=_detect,
    ))
