"""The ``power.adapters`` entry point of power-mtp: registers the ``mtp`` strategy.

The llama.cpp execution path comes in a later release, so ``proposer`` is None; the session
fails closed ("execution path not available yet") when this strategy is selected to run.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

from power_core.plugins import Strategy, hookimpl
from power_mtp.validate import validate_mtp


def _version() -> str:
    try:
        return metadata.version("power-mtp")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@hookimpl
def power_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(Strategy(
        name="mtp", version=_version(), package="power-mtp", kind="model-backed", needs_draft=False,
        summary="Native MTP (nextn) heads carried by the target GGUF: validator and strategy registration.",
        validate=validate_mtp, proposer=None,
    ))
