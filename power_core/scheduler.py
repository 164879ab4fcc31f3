"""The one scheduler every model-backed adapter shares: proposal width K versus rollback width S.

* **Balanced (K ≤ S, default K7/S7).** Every round proposes K; a rejected suffix always fits the
  resident rollback window, so replay never happens.
* **Guarded (K > S, e.g. K7/S6).** Rounds propose K while the request stays on the high-acceptance
  path. A rejected suffix deeper than S forces one exact replay (checkpoint restore + re-decode of
  the accepted prefix); after that first replay every later round of the request is clamped to S.
* **Adaptive (``spec_mtp_adaptive``, opt-in).** The request-local controller never uses replay as
  its first signal: it starts at ``min(K, S)``, opens the wider K only after a fully accepted first
  probe, and closes that path after a partial first round. Healthy partial rounds keep their graph
  shape (no per-round resizing). ``spec_adaptive_low_yield_rounds`` consecutive rounds whose
  acceptance falls below ``spec_adaptive_low_yield`` open a one-way target-only circuit.

S here is the rollback window the target actually granted (``TargetCapabilities.rollback_window``);
``None`` means attention-only memory, where any suffix rolls back in place and replay cannot occur.
A window of 0 means the runtime has no in-place rollback at all: every rejection goes through
checkpoint + replay, and clamping cannot help, so the guard records replays without clamping.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["RoundPlan", "RoundOutcome", "Scheduler"]


@attrs.frozen
class RoundPlan:
    """How many proposals to ask for this round, and why."""

    k: int
    reason: str


@attrs.frozen
class RoundOutcome:
    """What the round did: proposals verified, how many were accepted, whether it replayed."""

    proposed: int
    accepted: int
    replayed: bool


@attrs.define(eq=False)
class Scheduler:
    """Request-local scheduling state. Create one per request with :meth:`for_request`."""

    k_max: int
    window: int | None
    adaptive: bool = False
    low_yield: float = 0.25
    low_yield_rounds: int = 3
    enabled: bool = True
    # state
    round_index: int = 0
    replays: int = 0
    clamp: int | None = None
    wide_open: bool | None = None  # adaptive: None until the probe decides
    circuit_open: bool = False
    low_streak: int = 0
    events: list[dict[str, Any]] = attrs.field(factory=list)

    @classmethod
    def for_request(cls, config: Any, window: int | None, enabled: bool = True) -> Scheduler:
        """``window`` is the granted rollback window; configured S caps it."""
        # attention-only targets (window None) roll back any depth: K vs S never binds
        return cls(
            k_max=config.spec_draft_max,
            window=None if window is None else min(window, config.snapshots),
            adaptive=config.spec_mtp_adaptive,
            low_yield=config.spec_adaptive_low_yield,
            low_yield_rounds=config.spec_adaptive_low_yield_rounds,
            enabled=enabled,
        )

    @property
    def guarded(self) -> bool:
        """K exceeds the resident rollback window: a rejected suffix may need replay."""
        return self.window is not None and self.k_max > self.window

    @property
    def narrow(self) -> int:
        """min(K, S): the shape that can never replay."""
        return self.k_max if self.window is None else min(self.k_max, max(self.window, 0))

    def _event(self, event: str, reason: str, **data: Any) -> None:
        self.events.append({"round": self.round_index, "event": event, "reason": reason, **data})

    def plan(self) -> RoundPlan:
        """The proposal width of the next round."""
        if not self.enabled:
            return RoundPlan(0, "target-only")
        if self.circuit_open:
            return RoundPlan(0, "circuit-open")
        if self.clamp is not None:
            return RoundPlan(self.clamp, "clamped-after-replay")
        if self.adaptive:
            if self.wide_open is None:
                return RoundPlan(self.narrow, "probe")
            return RoundPlan(self.k_max if self.wide_open else self.narrow,
                             "wide" if self.wide_open else "narrow")
        return RoundPlan(self.k_max, "guarded" if self.guarded else "balanced")

    def record(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        """Update request-local state after a committed round."""
        if outcome.replayed:
            self.replays += 1
            if self.clamp is None and self.window and self.window > 0 and self.k_max > self.window:
                self.clamp = self.window
                self._event("clamp", f"replay after rejecting a suffix deeper than S={self.window}; "
                            f"later rounds propose at most {self.window}", k=self.window)
        if self.adaptive and self.enabled:
            if self.wide_open is None and plan.reason == "probe":
                full = plan.k > 0 and outcome.accepted == plan.k
                self.wide_open = full and self.k_max > plan.k
                if self.wide_open:
                    self._event("open-wide", f"first probe fully accepted ({outcome.accepted}/{plan.k})",
                                k=self.k_max)
                else:
                    self._event("close-wide", f"first probe accepted {outcome.accepted}/{plan.k}"
                                if not full else "no wider shape than min(K, S)", k=self.narrow)
            if outcome.proposed > 0 and not self.circuit_open:
                if outcome.accepted / outcome.proposed < self.low_yield:
                    self.low_streak += 1
                else:
                    self.low_streak = 0
                if self.low_streak >= self.low_yield_rounds:
                    self.circuit_open = True
                    self._event("circuit-open", f"{self.low_streak} consecutive rounds below "
                                f"{self.low_yield:.0%} acceptance; target-only for the rest of the request")
        self.round_index += 1

    def summary(self) -> dict[str, Any]:
        return {
            "k_max": self.k_max,
            "window": self.window,
            "mode": "off" if not self.enabled else "adaptive" if self.adaptive
            else "guarded" if self.guarded else "balanced",
            "replays": self.replays,
            "clamp": self.clamp,
            "wide_open": self.wide_open,
            "circuit_open": self.circuit_open,
            "events": list(self.events),
        }
