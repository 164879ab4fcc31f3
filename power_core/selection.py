"""Strategy selection (``spec_mode``): explicit modes run or fail closed; ``auto`` decides."""

from __future__ import annotations

from typing import Any

import attrs

from power_core.plugins import PowerPlugins, Strategy

__all__ = ["Selection", "select"]


@attrs.frozen
class Selection:
    strategy: Strategy
    reason: str
    verified: Any = None
    draft: str | None = None
    artifacts: dict[str, str] = attrs.field(factory=dict)


def select(plugins: PowerPlugins, config: Any, *, model: str | None, draft: str | None) -> Selection:
    mode = config.spec_mode
    if mode == "auto":
        return Selection(plugins.strategy("off"), "auto: no verified draft artifact; target-only")
    return Selection(plugins.strategy(mode), f"explicit spec_mode={mode!r}", draft=draft)
