"""The one scheduler every model-backed adapter shares: proposal width K versus rollback width S.

* **Balanced (K ≤ S, default K7/S7).** Every round proposes K; a rejected suffix always fits the
  resident rollback window, so replay never happens.
* **Guarded (K > S, e.g. K7/S6).** Rounds propose K while the request stays on the high-acceptance
  path. A rejected suffix deeper than S forces one exact replay (checkpoint restore + re-decode of
  the accepted prefix); after that first replay every later round of the request is clamped to S.
* **Adaptive (``spec_adaptive``, opt-in).** The request-local controller never uses replay as
  its first signal: it starts at ``min(K, S)``, opens the wider K only after a fully accepted first
  probe, and closes that path after a partial first round. Healthy partial rounds keep their graph
  shape (no per-round resizing). ``spec_adaptive_low_yield_rounds`` consecutive rounds whose
  acceptance falls below ``spec_adaptive_low_yield`` open a one-way target-only circuit.

S here is the rollback window the target actually granted (``TargetCapabilities.rollback_window``);
``None`` means attention-only memory, where any suffix rolls back in place and replay cannot occur.
A window of 0 means the runtime has no in-place rollback at all: every rejection goes through
checkpoint + replay, and clamping cannot help, so the guard records replays without clamping.

**Cost-aware width.** When the target reports its verify-cost curve (``verify_cost[b-1]``: the cost
of a pass of ``b`` tokens relative to one) and the proposer attaches a confidence to its proposals
(``Proposal.confidence``: the probability that each is accepted given the previous one was),
:meth:`Scheduler.choose_width` verifies the prefix ``w`` that maximizes the expected tokens per
unit of cost, ``E[emitted | w] / cost(w + 1)``, where ``E = 1 + sum_{i<=w} prod_{j<=i} p_j``. A
round where no prefix beats a one-token decode verifies nothing (cost 1, one token, exactly
target-only), and the next rounds back off from proposing (1, 3, 7, 15 rounds) until one pays
again, so a request where speculation does not pay converges to target-only.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["PassLoad", "RoundPlan", "RoundOutcome", "Scheduler"]


@attrs.frozen
class RoundPlan:
    """How many proposals to ask for this round, and why."""

    k: int
    reason: str


@attrs.frozen
class PassLoad:
    """What a shared target pass already holds when a request chooses its width: other requests'
    tokens and how many requests (each yields at least one token)."""

    tokens: int
    requests: int


@attrs.frozen
class RoundOutcome:
    """What the round did: proposals verified, how many were accepted, whether it replayed."""

    proposed: int
    accepted: int
    replayed: bool
    offered: int = 0  # proposals before the cost-aware width cut them


def _tail_line(costs: tuple[float, ...]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through the widest half of a cost curve:
    what a pass wider than the measured ones costs. One measured step would not do: the curve is
    noisy and not smooth in the width (on CPUs a pass of a multiple of 8 tokens can cost less than
    one of 7), so the last step's slope misjudges every wider pass."""
    if len(costs) < 2:
        return 0.0, costs[0]  # one point: a token costs what the one-token pass costs
    xs = range(min(len(costs) // 2, len(costs) - 2), len(costs))
    ys = [costs[x] for x in xs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 0.0)
    return my - slope * mx, slope


@attrs.define(eq=False)
class Scheduler:
    """Request-local scheduling state. Create one per request with :meth:`for_request`."""

    k_max: int
    window: int | None
    adaptive: bool = False
    low_yield: float = 0.25
    low_yield_rounds: int = 3
    enabled: bool = True
    #: the K the session's strategy opened with, which sized its target and draft (``k_max``: this request's,
    #: narrower when the request asked for it; None: the same)
    k_session: int | None = None
    #: relative cost of a verify pass of 1..B tokens (None: width is not cost-aware)
    costs: tuple[float, ...] | None = None
    # state
    round_index: int = 0
    replays: int = 0
    clamp: int | None = None
    wide_open: bool | None = None  # adaptive: None until the probe decides
    circuit_open: bool = False
    low_streak: int = 0
    nopay_streak: int = 0  # consecutive rounds whose best width was 0
    backoff: int = 0  # rounds left without proposing
    events: list[dict[str, Any]] = attrs.field(factory=list)

    @classmethod
    def for_request(cls, config: Any, window: int | None, enabled: bool = True,
                    costs: tuple[float, ...] | None = None, k_session: int | None = None) -> Scheduler:
        """``window`` is the granted rollback window; configured S caps it. ``costs``: the target's
        verify-cost curve, for cost-aware strategies. ``k_session``: the session's K where the request's
        (``config``) is narrower."""
        # attention-only targets (window None) roll back any depth: K vs S never binds
        return cls(
            costs=tuple(costs) if costs else None,
            k_max=config.draft_max,
            k_session=k_session if k_session != config.draft_max else None,
            window=None if window is None else min(window, config.snapshots),
            adaptive=config.spec_adaptive,
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
        if self.backoff > 0:
            return RoundPlan(0, "backoff")
        if self.clamp is not None:
            return RoundPlan(self.clamp, "clamped-after-replay")
        if self.adaptive:
            if self.wide_open is None:
                return RoundPlan(self.narrow, "probe")
            return RoundPlan(self.k_max if self.wide_open else self.narrow,
                             "wide" if self.wide_open else "narrow")
        return RoundPlan(self.k_max, "guarded" if self.guarded else "balanced")

    def choose_width(self, confidence: Any, offered: int, load: PassLoad | None = None) -> tuple[int, dict[str, Any]]:
        """The verified prefix of ``offered`` proposals that maximizes expected tokens per cost.

        Alone, a round's pass of ``1 + w`` tokens costs ``costs[w]`` one-token passes and yields the
        expected ``1 + p1 + p1 p2 + ...`` tokens. In a pass shared with other requests (``load``: the
        tokens and requests already in it), the pass happens anyway, so the width is chosen for the
        whole pass's yield: the others' tokens plus this request's, over the cost of the pass with
        this request's block in it — a wide block that a solo pass would take can cost the shared
        pass more than it adds, and is then narrowed (down to target-only)."""
        costs = self.costs
        p = [float(x) for x in confidence][:offered]
        base_tokens = load.tokens if load is not None else 0
        base_yield = float(load.requests) if load is not None else 0.0
        w_max = min(len(p), len(costs) - 1) if costs else 0

        tail = _tail_line(costs) if costs and base_tokens + w_max >= len(costs) else None

        def cost(w: int) -> float:  # a pass of base + 1 + w tokens, in one-token passes
            assert costs is not None
            b = base_tokens + w
            if b < len(costs):
                return costs[b]
            assert tail is not None  # wider than measured: the line through the widest half of the curve
            return tail[0] + tail[1] * b

        best_w, best_e = 0, 1.0
        best_gain = (base_yield + 1.0) / cost(0) if costs else 1.0
        expected, run = 1.0, 1.0
        for w in range(1, w_max + 1):
            run *= min(max(p[w - 1], 0.0), 1.0)
            expected += run
            gain = (base_yield + expected) / cost(w)
            if gain > best_gain:
                best_w, best_e, best_gain = w, expected, gain
        info: dict[str, Any] = {"offered": offered, "chosen": best_w, "expected_tokens": round(best_e, 4),
                "relative_cost": round(cost(best_w), 4) if costs else 1.0, "gain": round(best_gain, 4)}
        if load is not None:
            info["shared_pass"] = {"tokens": load.tokens, "requests": load.requests}
        return best_w, info

    def record(self, plan: RoundPlan, outcome: RoundOutcome) -> None:
        """Update request-local state after a committed round."""
        if plan.reason == "backoff":
            self.backoff -= 1
        elif outcome.offered > 0 and outcome.proposed == 0:  # the cost-aware width chose target-only
            self.nopay_streak += 1
            self.backoff = min((1 << self.nopay_streak) - 1, 15)
        elif outcome.proposed > 0:
            self.nopay_streak = 0
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
            "k_session": self.k_max if self.k_session is None else self.k_session,
            "window": self.window,
            "mode": "off" if not self.enabled else "adaptive" if self.adaptive
            else "guarded" if self.guarded else "balanced",
            "replays": self.replays,
            "clamp": self.clamp,
            "wide_open": self.wide_open,
            "circuit_open": self.circuit_open,
            "cost_aware": self.costs is not None,
            "events": list(self.events),
        }
