"""The standard checks every proposal adapter must pass.

Each check runs the adapter's strategy and the target-only strategy over the same target and
compares emitted token ids. The target is the reference backend by default (``model``), which has
an attention layer and a recurrent layer, so S < K exercises the checkpoint + replay path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import numpy as np
import pytest

from power_core.config import PowerConfig
from power_core.errors import Cancelled, PowerError, RuntimeFault
from power_core.plugins import PowerPlugins, Strategy, build_plugins, hookimpl
from power_core.reference.proposers import NoisyProposer, ProposerWrapper
from power_core.runtime import ProposalContext, Proposer, TokenArray
from power_core.session import Result, Session
from power_core.transaction import PHASES, CancelToken

__all__ = ["AdapterConformance", "FaultInjector", "SkipRounds", "FailOnCall"]

STEP_PHASES = PHASES[:-1]  # restore is the reaction, not a place to inject


class InjectedFault(RuntimeFault):
    code = "injected_fault"


@attrs.define(eq=False)
class FaultInjector:
    """An observer plugin that cancels or raises at one phase of one round (before or after it runs)."""

    phase: str | None = None
    round_index: int = 1
    when: str = "before"  # before | after
    action: str = "raise"  # raise | cancel
    cancel: CancelToken | None = None
    fired: int = 0
    __name__: str = "power.testing.injector"

    @hookimpl(wrapper=True)
    def power_txn_phase(self, phase: str, round_index: int):
        hit = phase == self.phase and round_index == self.round_index and self.fired == 0
        if hit and self.when == "before":
            self._fire(phase)
        result = yield
        if hit and self.when == "after":
            self._fire(phase)
        return result

    def _fire(self, phase: str) -> None:
        self.fired += 1
        if self.action == "cancel":
            assert self.cancel is not None
            self.cancel.cancel()
            if phase == "emit":  # nothing left to check in this round: cancel takes effect next round
                return
            raise Cancelled(f"injected cancel at {phase}")
        raise InjectedFault(f"injected fault at {self.when} {phase}")


class SkipRounds(ProposerWrapper):
    """Every ``every``-th round proposes nothing."""

    def __init__(self, inner: Proposer, every: int = 2) -> None:
        super().__init__(inner)
        self.every = every

    def propose(self, ctx: ProposalContext) -> TokenArray:
        props = self.inner.propose(ctx)
        return props[:0] if ctx.round_index % self.every == 0 else props


class FailOnCall(ProposerWrapper):
    """Raise ``ValueError`` from ``method`` on its ``call``-th invocation (an adapter bug)."""

    def __init__(self, inner: Proposer, method: str, call: int = 2) -> None:
        super().__init__(inner)
        self.method, self.call, self.calls = method, call, 0
        original = getattr(self, method)

        def failing(*args: Any) -> Any:
            self.calls += 1
            if self.calls == self.call:
                raise ValueError(f"adapter bug in {method}")
            return original(*args)

        setattr(self, method, failing)


class AdapterConformance:
    """Base class of the standard checks. Configure with class attributes:

    * ``strategy_name`` — the strategy under test (must be registered, or supply ``strategy()``);
    * ``model`` — target model (default: a small reference model with a recurrent layer);
    * ``draft`` — draft artifact passed to the strategy, if it needs one;
    * ``k`` — proposal width used by the checks; ``seeds`` — how many seeds/prompts parity runs use;
    * ``max_tokens`` — tokens per request.

    Override :meth:`strategy` to register a strategy that is not installed through an entry point.
    """

    strategy_name: ClassVar[str] = ""
    model: ClassVar[str | None] = "reference:seed=11,vocab=97,dim=16,recurrent=1"
    draft: ClassVar[str | None] = None
    k: ClassVar[int] = 5
    seeds: ClassVar[int] = 12
    max_tokens: ClassVar[int] = 48

    # -- hooks for subclasses -------------------------------------------------------------------------
    def strategy(self) -> Strategy | None:
        """Return a :class:`Strategy` to register for the checks (``None``: use an installed one)."""
        return None

    def plugins(self, *extra: object) -> PowerPlugins:
        strategy = self.strategy()
        objs: list[object] = list(extra)
        if strategy is not None:
            chosen: Strategy = strategy

            class _Register:
                __name__ = "power.testing.adapter"

                @hookimpl
                def power_register_strategies(self, register: Callable[[Strategy], None]) -> None:
                    register(chosen)

            objs.append(_Register())
        return build_plugins(extra=tuple(objs))

    def name(self) -> str:
        s = self.strategy()
        return s.name if s is not None else self.strategy_name

    def prompt(self, seed: int, n_vocab: int) -> list[int]:
        rng = np.random.default_rng(seed + 1000)
        return rng.integers(0, n_vocab - 1, size=int(rng.integers(1, 12))).tolist()

    # -- machinery ---------------------------------------------------------------------------------------
    def open(self, mode: str, *extra: object, wrap: Callable[[Proposer], Proposer] | None = None,
             stop_ids: Sequence[int] | None = None, **cfg: Any) -> Session:
        base: dict[str, Any] = dict(spec_mode=mode, spec_draft_max=self.k, max_tokens=self.max_tokens, n_ctx=256)
        base.update(cfg)
        session = Session.open(PowerConfig(**base), model=self.model, draft=self.draft if mode != "off" else None,
                               plugins=self.plugins(*extra),
                               stop_ids=frozenset(stop_ids) if stop_ids is not None else None)
        if wrap is not None and session.proposer is not None:
            session.proposer = wrap(session.proposer)
        return session

    def reference(self, prompt: list[int], stop_ids: Sequence[int] | None = None, **cfg: Any) -> Result:
        cfg = {k: v for k, v in cfg.items() if k not in ("spec_mtp_recurrent_snapshots", "spec_mtp_adaptive")}
        with self.open("off", stop_ids=stop_ids, **cfg) as s:
            return s.generate(prompt)

    def speculative(self, prompt: list[int], *extra: object, **kw: Any) -> Result:
        with self.open(self.name(), *extra, **kw) as s:
            return s.generate(prompt)

    def n_vocab(self) -> int:
        with self.open("off") as s:
            return s.opened.target.capabilities.n_vocab

    # -- the checks --------------------------------------------------------------------------------------
    @pytest.mark.power_conformance
    def test_greedy_parity(self) -> None:
        """Greedy speculative ids equal target-only ids over ``seeds`` prompts, for K = ``k``.

        Troubleshooting: a mismatch means the adapter changed target state (it must only propose),
        or its commit() kept a state row from a rejected suffix."""
        v = self.n_vocab()
        for seed in range(self.seeds):
            p = self.prompt(seed, v)
            assert self.speculative(p).tokens == self.reference(p).tokens, f"prompt seed {seed}"

    @pytest.mark.power_conformance
    def test_seeded_stochastic_parity(self) -> None:
        """Seeded stochastic runs (temperature 0.9, top-p 0.95) emit the same ids as target-only.

        Troubleshooting: Power samples target rows with a position-indexed stream; an adapter that
        calls the target sampler itself, or proposes from the target's rows, breaks this."""
        v = self.n_vocab()
        for seed in range(max(3, self.seeds // 2)):
            p = self.prompt(seed, v)
            cfg: dict[str, Any] = dict(temperature=0.9, top_p=0.95, seed=seed)
            assert self.speculative(p, **cfg).tokens == self.reference(p, **cfg).tokens, f"seed {seed}"

    @pytest.mark.power_conformance
    def test_rejection_at_every_position(self) -> None:
        """Force the first rejection at every position 0..K (K = no forced rejection): parity holds.

        Troubleshooting: commit(n_accepted, emitted) must keep exactly ``n_accepted`` proposals."""
        v = self.n_vocab()
        p = self.prompt(3, v)
        ref = self.reference(p).tokens
        for j in range(self.k + 1):
            reject_at = j if j < self.k else None

            def wrap(inner: Proposer, reject_at: int | None = reject_at) -> Proposer:
                return NoisyProposer(inner, vocab=v, reject_at=reject_at)

            assert self.speculative(p, wrap=wrap).tokens == ref, f"reject at {j}"

    @pytest.mark.power_conformance
    def test_zero_proposal_rounds(self) -> None:
        """Rounds with no proposals (every other round) still emit exactly one target token."""
        v = self.n_vocab()
        p = self.prompt(4, v)
        res = self.speculative(p, wrap=lambda inner: SkipRounds(inner))
        assert res.tokens == self.reference(p).tokens
        assert any(r["proposed"] == 0 and r["emitted"] == 1 for r in res.receipt.rounds)

    @pytest.mark.power_conformance
    def test_stop_token_inside_block(self) -> None:
        """A stop token inside a proposal block ends generation there; nothing past it is emitted."""
        v = self.n_vocab()
        p = self.prompt(5, v)
        ref = self.reference(p).tokens
        for idx in (1, len(ref) // 3, len(ref) // 2):
            stop = [ref[idx]]
            want = self.reference(p, stop_ids=stop)
            got = self.speculative(p, stop_ids=stop)
            assert got.tokens == want.tokens and got.receipt.finish_reason == "stop"
            assert got.tokens[-1] == ref[idx] and stop[0] not in got.tokens[:-1]

    @pytest.mark.power_conformance
    def test_max_tokens_inside_block(self) -> None:
        """``max_tokens`` that ends inside a block emits exactly that many tokens."""
        v = self.n_vocab()
        p = self.prompt(6, v)
        for n in (1, 2, self.k, self.k + 2, 2 * self.k + 1):
            got = self.speculative(p, max_tokens=n)
            assert got.tokens == self.reference(p, max_tokens=n).tokens and len(got.tokens) == n

    @pytest.mark.power_conformance
    def test_replay_when_s_below_k(self) -> None:
        """S < K with rejections at position 0 forces checkpoint + replay; output is still exact and the
        guard clamps later rounds to S."""
        v = self.n_vocab()
        p = self.prompt(7, v)
        s_ = max(1, self.k - 2)
        res = self.speculative(p, spec_mtp_recurrent_snapshots=s_,
                               wrap=lambda inner: NoisyProposer(inner, vocab=v, reject_at=0, keep_tail=True))
        assert res.tokens == self.reference(p).tokens
        window = res.receipt.scheduler.get("window")
        if window is None:  # attention-only target: every rollback is in place
            assert res.receipt.replays == 0
            return
        rounds = res.receipt.rounds
        for r in rounds:  # a replay happens exactly when the rejected suffix exceeds the window
            assert r["replayed"] == (r["shape"] - r["emitted"] > window), r
        if window == 0:  # recurrent memory without resident snapshots: every rejection replays, no clamp helps
            assert res.receipt.scheduler["clamp"] is None
            return
        assert res.receipt.replays <= 1, "the guard allows one replay per request"
        if res.receipt.replays:
            first = next(i for i, r in enumerate(rounds) if r["replayed"])
            assert res.receipt.scheduler["clamp"] == window
            assert all(r["planned"] <= window for r in rounds[first + 1:])

    @pytest.mark.power_conformance
    @pytest.mark.parametrize("when", ["before", "after"])
    @pytest.mark.parametrize("phase", STEP_PHASES)
    def test_fault_at_each_step_restores(self, phase: str, when: str) -> None:
        """An exception at any step restores the last committed round; resuming finishes exactly."""
        v = self.n_vocab()
        p = self.prompt(8, v)
        ref = self.reference(p).tokens
        inj = FaultInjector(phase=phase, round_index=1, when=when)
        with self.open(self.name(), inj) as s:
            gen = s.start(p)
            with pytest.raises(PowerError):
                gen.run()
            committed = gen.tokens
            assert committed == ref[: len(committed)]
            assert s.opened.target.n_past == len(p) - 1 + max(len(committed), 1), "target memory not restored"
            assert gen.receipt is not None and gen.receipt.status == "failed"
            assert gen.run().tokens == ref

    @pytest.mark.power_conformance
    @pytest.mark.parametrize("phase", STEP_PHASES)
    def test_cancel_at_each_step_restores(self, phase: str) -> None:
        """Cancelling at any step keeps every committed token; clearing the token resumes exactly."""
        v = self.n_vocab()
        p = self.prompt(9, v)
        ref = self.reference(p).tokens
        cancel = CancelToken()
        inj = FaultInjector(phase=phase, round_index=1, action="cancel", cancel=cancel)
        with self.open(self.name(), inj) as s:
            gen = s.start(p, cancel=cancel)
            with pytest.raises(Cancelled):
                gen.run()
            assert gen.receipt is not None and gen.receipt.status == "cancelled"
            assert gen.tokens == ref[: len(gen.tokens)]
            assert s.opened.target.n_past == len(p) - 1 + max(len(gen.tokens), 1)
            cancel.reset()
            assert gen.run().tokens == ref

    @pytest.mark.power_conformance
    @pytest.mark.parametrize("method", ["propose", "observe", "commit"])
    def test_adapter_exception_restores(self, method: str) -> None:
        """An exception inside the adapter restores the round; resuming finishes exactly.

        Troubleshooting: restore(checkpoint) must undo everything propose/observe/commit changed."""
        v = self.n_vocab()
        p = self.prompt(10, v)
        ref = self.reference(p).tokens
        with self.open(self.name(), wrap=lambda inner: FailOnCall(inner, method)) as s:
            gen = s.start(p)
            with pytest.raises(PowerError) as err:
                gen.run()
            assert err.value.code == "adapter_fault"
            assert s.opened.target.n_past == len(p) - 1 + max(len(gen.tokens), 1)
            assert gen.run().tokens == ref

    def test_opt_outs_are_explicit(self) -> None:
        """Guard: a subclass may only replace a standard check with an ``xfail(reason=...)`` version."""
        for name, member in inspect.getmembers(type(self)):
            if not name.startswith("test_") or name == "test_opt_outs_are_explicit":
                continue
            base = getattr(AdapterConformance, name, None)
            if base is None or member is base:
                continue
            marks = [m for m in getattr(member, "pytestmark", []) if m.name == "xfail"]
            assert marks and marks[0].kwargs.get("reason"), (
                f"{type(self).__name__}.{name} overrides a standard check without "
                "@pytest.mark.xfail(reason=...); say why the adapter opts out")
