"""The standard checks every proposal adapter must pass.

Each check runs the adapter's strategy and the target-only strategy over the same target and
compares emitted token ids. The target is the reference backend by default (``model``), which has
an attention layer and a recurrent layer, so S < K exercises the checkpoint + replay path.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from power_core.config import ConfigKey, PowerConfig
from power_core.constraint import ConstraintSpec, Vocabulary
from power_core.errors import AdapterFault, Cancelled, ConfigError, PowerError
from power_core.generation import Result
from power_core.reference.proposers import NoisyProposer
from power_core.runtime import Proposer, ProposerCapabilities
from power_core.session import Session
from power_core.testing.faults import FailOnCall, FaultInjector, Recorder, SkipRounds
from power_core.testing.harness import NO_STOP, AdapterHarness, first_diff
from power_core.transaction import PHASES, CancelToken

__all__ = ["AdapterConformance"]

STEP_PHASES = PHASES[:-1]  # restore is the reaction, not a place to inject
#: rounds the fault and cancel checks interrupt: the first proposing round, the next, and a late one
FAULT_ROUNDS = ("1", "2", "late")


def _range_ends(key: ConfigKey) -> list[Any]:
    """The values a key's declaration admits at its edges: both ends of a range (an open end: the
    default), every choice, both booleans."""
    if key.type is bool:
        return [False, True]
    if key.choices:
        return list(key.choices)
    if key.type in (int, float):
        lo = key.default if key.lo is None or key.lo_open else key.lo
        hi = key.default if key.hi is None or key.hi_open else key.hi
        return list(dict.fromkeys(x for x in (lo, hi) if x is not None))
    return [key.default]


def _out_of_range(key: ConfigKey) -> list[Any]:
    """Values the declaration refuses: just past each bound, an unknown choice, a string for a number."""
    out: list[Any] = []
    if key.type in (int, float):
        out.append("1")
        step = 1 if key.type is int else 0.5
        if key.lo is not None:
            out.append(key.lo if key.lo_open else key.lo - step)
        if key.hi is not None:
            out.append(key.hi if key.hi_open else key.hi + step)
    elif key.choices:
        out.append("not-one-of-the-choices")
    elif key.type is bool:
        out.append("yes")
    return out


class AdapterConformance(AdapterHarness):
    """Base class of the standard checks. Configure with class attributes:

    * ``strategy_name`` — the strategy under test (must be registered, or supply ``strategy()``);
    * ``model`` — target model (default: a small reference model with a recurrent layer);
    * ``draft`` — draft artifact passed to the strategy, if it needs one;
    * ``k`` — proposal width used by the checks; ``seeds`` — how many seeds/prompts parity runs use;
    * ``max_tokens`` — tokens per request.

    Override :meth:`strategy` to register a strategy that is not installed through an entry point,
    :meth:`prompt` to shape the prompts of the parity checks and :meth:`proposing_prompt` to give the
    checks that compare proposals a prompt on which the adapter proposes (and gets tokens accepted).

    The checks that compare *proposals* hold an adapter to its contract, not just the target to its
    own: a proposer's proposals must depend only on the committed history, so a round proposes the
    same tokens whether it runs uninterrupted, after a restore, in a fresh request whose prompt is
    that history, or after other requests of the same session.
    """

    # -- the checks --------------------------------------------------------------------------------------
    @pytest.mark.power_conformance
    def test_greedy_parity(self) -> None:
        """Greedy speculative ids equal target-only ids over ``seeds`` prompts, for K = ``k``.

        Troubleshooting: a mismatch means the adapter changed target state (it must only propose),
        or its commit() kept a state row from a rejected suffix. An ``AdapterFault`` here names the
        method and the broken rule (more than ``ctx.k`` ids, an id outside ``[0, n_vocab)``, an
        exception)."""
        v = self.n_vocab()
        for seed in range(self.seeds):
            p = self.prompt(seed, v)
            got, want = self.speculative(p).tokens, self.reference(p).tokens
            assert got == want, (f"greedy, prompt(seed={seed}) = {p}: speculative emitted {list(got)} but "
                                 f"target-only emitted {list(want)}; {first_diff(got, want)}")

    @pytest.mark.power_conformance
    def test_seeded_stochastic_parity(self) -> None:
        """Seeded stochastic runs (temperature 0.9, top-p 0.95) emit the same ids as target-only.

        Troubleshooting: Power samples target rows with a position-indexed stream; an adapter that
        calls the target sampler itself, or proposes from the target's rows, breaks this."""
        v = self.n_vocab()
        for seed in range(max(3, self.seeds // 2)):
            p = self.prompt(seed, v)
            cfg: dict[str, Any] = dict(temperature=0.9, top_p=0.95, seed=seed)
            got, want = self.speculative(p, **cfg).tokens, self.reference(p, **cfg).tokens
            assert got == want, (f"temperature 0.9, top-p 0.95, seed {seed}: speculative emitted {list(got)} but "
                                 f"target-only emitted {list(want)}; {first_diff(got, want)}")

    @pytest.mark.power_conformance
    def test_proposes(self) -> None:
        """On :meth:`proposing_prompt` the adapter proposes tokens and the target accepts some.

        Troubleshooting: an adapter that never proposes passes every parity check while doing
        nothing. If it proposes nothing, check that ``propose`` reads ``ctx.history`` (read-only
        int32, ending with the anchor) and returns a ``Proposal`` of int32 ids; if nothing is accepted, that the ids
        continue ``ctx.anchor``. If your adapter needs another prompt (or model) to propose,
        override :meth:`proposing_prompt`; opt out only with ``xfail(reason=...)``."""
        v = self.n_vocab()
        seen = []
        for seed in range(2):
            p = self.proposing_prompt(seed, v)
            res, _ = self.uninterrupted(p)
            summary = res.receipt.summary()
            seen.append(f"proposing_prompt(seed={seed}) ({len(p)} tokens): {summary['rounds']} rounds, "
                        f"{summary['proposed']} proposed, {summary['accepted']} accepted")
            ref = self.reference(p, stop_ids=NO_STOP).tokens
            assert res.tokens == ref, f"proposing_prompt(seed={seed}): parity broken; {first_diff(res.tokens, ref)}"
            if summary["accepted"] > 0:
                return
        raise AssertionError("the adapter never got a proposal accepted: " + "; ".join(seen))

    @pytest.mark.power_conformance
    def test_declares_capabilities(self) -> None:
        """The proposer declares what it can do as a ``ProposerCapabilities`` value, and a compute
        clock it declares is monotonic seconds over a request.

        Troubleshooting: "declares no capabilities" means the class lacks ``capabilities``; add
        ``capabilities = ProposerCapabilities()`` (nothing beyond the protocol) or a property that
        declares its abilities, e.g. ``ProposerCapabilities(compute_seconds=self.compute_seconds,
        close=self.close)``. A clock that runs backwards is a wrong unit or a counter that resets."""
        v = self.n_vocab()
        session = self.open(self.name())
        try:
            assert session.proposer is not None, "the strategy made no proposer"
            caps = ProposerCapabilities.of(session.proposer)
            before = caps.compute_seconds() if caps.compute_seconds is not None else 0.0
            session.generate(self.proposing_prompt(0, v))
            after = caps.compute_seconds() if caps.compute_seconds is not None else 0.0
            assert isinstance(after, float) and after >= before >= 0.0, (
                f"compute_seconds went from {before!r} to {after!r} over a request: it must be monotonic seconds")
        finally:
            session.close()

    def constraints(self, vocabulary: Vocabulary) -> tuple[ConstraintSpec, ...]:
        """The constrained check's constraints, spelled in the target's own ``vocabulary``: text made
        of every other printable piece among the first ids (a regex over them), and the same after a
        lazy trigger (free text before it). Override to check your own grammars."""
        pieces = []
        for i, piece in enumerate(vocabulary.pieces[:256]):
            text = piece.decode("ascii", errors="ignore") if piece[:1] != b"\xff" else ""
            if text and text == piece.decode("latin-1") and text.isprintable() and i % 2 == 0:
                pieces.append(text)
        assert pieces, "the target's vocabulary has no printable pieces among its first 256 ids"
        alphabet = "(" + "|".join(re.escape(p) for p in sorted(set(pieces[:48]), key=len, reverse=True)) + ")"
        return (ConstraintSpec.regex(f"{alphabet}{{1,400}}"),
                ConstraintSpec.regex(f"{alphabet}{{1,400}}", trigger=pieces[len(pieces) // 2]))

    @pytest.mark.power_conformance
    def test_constrained_parity(self) -> None:
        """With a constraint (a regular expression, a lazy JSON grammar), greedy and seeded
        speculative ids equal constrained target-only ids, and the receipt counts the proposals the
        constraint cut before verification.

        Troubleshooting: the core cuts a proposal at the first token the grammar forbids and verifies
        only the rest, so ``commit(n_accepted, emitted)`` may follow a round whose block was shorter
        than what ``propose`` returned; a proposer that assumes its whole proposal was verified (or
        that keeps the cut tokens) fails here."""
        v = self.n_vocab()
        with self.open("off") as s:
            assert s.opened.grammars is not None, "the target's backend cannot read its vocabulary"
            specs = self.constraints(s.opened.grammars.vocabulary())
        for i, spec in enumerate(specs):
            for seed in range(max(2, self.seeds // 4)):
                p = self.prompt(seed, v)
                for cfg in ({}, dict(temperature=0.9, top_p=0.95, seed=seed)):
                    got = self._constrained(self.name(), p, spec, cfg)
                    key = ("constrained", i, tuple(p), tuple(sorted(cfg.items())))
                    want: Result = self._memo(key, functools.partial(self._constrained, "off", p, spec, cfg))
                    assert got.tokens == want.tokens, (
                        f"constraint {spec.kind} {spec.source!r}, {cfg or 'greedy'}, prompt(seed={seed}) = {p}: "
                        f"speculative emitted {list(got.tokens)} but constrained target-only emitted "
                        f"{list(want.tokens)}; {first_diff(got.tokens, want.tokens)}")
                    c = got.receipt.constraint
                    assert c is not None and c["digest"] == spec.digest, "the receipt does not record the constraint"
                    cut = [r for r in got.receipt.rounds if r.get("cut")]
                    assert c["cuts"] == len(cut), f"the receipt counts {c['cuts']} cuts but {len(cut)} rounds were cut"

    def _constrained(self, mode: str, prompt: list[int], spec: ConstraintSpec, cfg: dict[str, Any]) -> Result:
        with self.open(mode) as s:
            return s.start(prompt, sampling=cfg, constraint=spec).run()

    @pytest.mark.power_conformance
    def test_penalties_and_bias_parity(self) -> None:
        """With llama.cpp's repeat, frequency and presence penalties and a logit bias (rows depend
        on the history each row would have had), speculative ids equal target-only ids, greedy and
        seeded.

        Troubleshooting: like the plain parity checks; the core applies penalties per verified row,
        so a proposer never needs to know about them."""
        v = self.n_vocab()
        knobs: dict[str, Any] = dict(repeat_penalty=1.3, repeat_last_n=16, frequency_penalty=0.4,
                                     presence_penalty=0.3, logit_bias=((0, 2.0), (min(3, v - 1), -5.0)))
        for seed in range(max(2, self.seeds // 4)):
            p = self.prompt(seed, v)
            for cfg in (knobs, {**knobs, "temperature": 0.9, "seed": seed}):
                got = self.speculative(p, **cfg).tokens
                want = self.reference(p, **cfg).tokens
                assert got == want, (f"penalties {cfg}, prompt(seed={seed}) = {p}: speculative emitted {list(got)} "
                                     f"but target-only emitted {list(want)}; {first_diff(got, want)}")

    @pytest.mark.power_conformance
    def test_rejection_at_every_position(self) -> None:
        """Force the first rejection at every position 0..K (K = no forced rejection): parity holds.

        Troubleshooting: commit(n_accepted, emitted) must keep exactly ``n_accepted`` proposals and
        then take ``emitted[-1]`` (the correction or bonus token) as the next anchor."""
        v = self.n_vocab()
        p = self.prompt(3, v)
        ref = self.reference(p).tokens
        for j in range(self.k + 1):
            reject_at = j if j < self.k else None

            def wrap(inner: Proposer, reject_at: int | None = reject_at) -> Proposer:
                return NoisyProposer(inner, vocab=v, reject_at=reject_at)

            got = self.speculative(p, wrap=wrap).tokens
            assert got == ref, (f"with every proposal rejected at position {j}: speculative emitted {list(got)} but "
                                f"target-only emitted {list(ref)}; {first_diff(got, ref)}")

    @pytest.mark.power_conformance
    def test_zero_proposal_rounds(self) -> None:
        """Rounds with no proposals (every other round) still emit exactly one target token.

        Troubleshooting: after ``commit(0, [token])`` the proposer must continue from that token as
        the anchor; a proposer that assumes every round proposed fails here."""
        v = self.n_vocab()
        p = self.prompt(4, v)
        res = self.speculative(p, wrap=lambda inner: SkipRounds(inner))
        ref = self.reference(p).tokens
        assert res.tokens == ref, (f"with every other round proposing nothing: speculative emitted "
                                   f"{list(res.tokens)} but target-only emitted {list(ref)}")
        assert any(r["proposed"] == 0 and r["emitted"] == 1 for r in res.receipt.rounds)

    @pytest.mark.power_conformance
    def test_stop_token_inside_block(self) -> None:
        """A stop token inside a proposal block ends generation there; nothing past it is emitted.

        Troubleshooting: the core cuts the block; a failure means the adapter's ``commit`` or
        ``restore`` changed what the target saw (e.g. it decoded into the target's memory)."""
        v = self.n_vocab()
        p = self.prompt(5, v)
        ref = self.reference(p).tokens
        for idx in (1, len(ref) // 3, len(ref) // 2):
            stop = [ref[idx]]
            want = self.reference(p, stop_ids=stop)
            got = self.speculative(p, stop_ids=stop)
            assert got.tokens == want.tokens and got.receipt.finish_reason == "stop", (
                f"stop id {stop[0]}: speculative emitted {list(got.tokens)} ({got.receipt.finish_reason}) but "
                f"target-only emitted {list(want.tokens)}")
            assert got.tokens[-1] == ref[idx] and stop[0] not in got.tokens[:-1]

    @pytest.mark.power_conformance
    def test_max_tokens_inside_block(self) -> None:
        """``max_tokens`` that ends inside a block emits exactly that many tokens.

        Troubleshooting: the core clamps ``ctx.k`` so a round cannot pass ``max_tokens``; a proposer
        returning more than ``ctx.k`` ids fails here with ``AdapterFault``."""
        v = self.n_vocab()
        p = self.prompt(6, v)
        for n in (1, 2, self.k, self.k + 2, 2 * self.k + 1):
            got = self.speculative(p, max_tokens=n).tokens
            want = self.reference(p, max_tokens=n).tokens
            assert got == want and len(got) == n, (f"max_tokens={n}: speculative emitted {list(got)} but "
                                                   f"target-only emitted {list(want)}")

    @pytest.mark.power_conformance
    def test_replay_when_s_below_k(self) -> None:
        """S < K with rejections at position 0 forces checkpoint + replay; output is still exact and the
        guard clamps later rounds to S.

        Troubleshooting: a replayed round still calls ``commit(n_accepted, emitted)`` exactly once;
        a proposer that mirrors target memory must follow ``commit``, not count target decodes."""
        v = self.n_vocab()
        p = self.prompt(7, v)
        s_ = max(1, self.k - 2)
        res = self.speculative(p, spec_recurrent_snapshots=s_,
                               wrap=lambda inner: NoisyProposer(inner, vocab=v, reject_at=0, keep_tail=True))
        ref = self.reference(p).tokens
        assert res.tokens == ref, (f"S={s_} < K={self.k}, every proposal rejected at 0: speculative emitted "
                                   f"{list(res.tokens)} but target-only emitted {list(ref)}")
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
    @pytest.mark.parametrize("at", FAULT_ROUNDS)
    @pytest.mark.parametrize("when", ["before", "after"])
    @pytest.mark.parametrize("phase", STEP_PHASES)
    def test_fault_at_each_step_restores(self, phase: str, when: str, at: str) -> None:
        """An exception before or after any step, in round 1, 2 or a late round, restores the last
        committed round; resuming emits what target-only emits and, from the faulted round on,
        proposes exactly what an uninterrupted run proposes.

        Troubleshooting: "round r proposed [..] but an uninterrupted run proposed [..]" means
        ``restore(checkpoint)`` did not undo everything since ``checkpoint()``: whatever ``propose``,
        ``observe`` or ``commit`` changed (a history copy, a draft KV, an RNG, statistics) must be in
        the checkpoint. A fault after ``commit`` or at ``emit`` is restored after your ``commit`` ran."""
        v = self.n_vocab()
        p = self.proposing_prompt(8, v)
        ref = self.reference(p, stop_ids=NO_STOP).tokens
        want, _ = self.uninterrupted(p)
        r = self._fault_round(at, len(want.receipt.rounds))
        what = f"after a fault at round {r} ({when} phase {phase})"
        inj = FaultInjector(phase=phase, round_index=r, when=when)
        with self.open(self.name(), inj, trace=True, stop_ids=NO_STOP) as s:
            gen = s.start(p)
            with pytest.raises(PowerError):
                gen.run()
            assert inj.fired == 1, f"the fault planned for round {r} never fired"
            assert gen.receipt is not None and gen.receipt.status == "failed"
            self._assert_committed(s, gen, p, ref, what)
            self._assert_resumed(gen.run(), want, ref, what + " and resume", r)

    @pytest.mark.power_conformance
    @pytest.mark.parametrize("at", FAULT_ROUNDS)
    @pytest.mark.parametrize("phase", STEP_PHASES)
    def test_cancel_at_each_step_restores(self, phase: str, at: str) -> None:
        """Cancelling at any step (round 1, 2 or a late one) keeps every committed token; clearing the
        token resumes with target-only's ids and the uninterrupted run's proposals.

        Troubleshooting: as for faults — cancellation restores through ``restore(checkpoint)``; a
        cancel at ``emit`` takes effect before the next round, after your ``commit`` ran."""
        v = self.n_vocab()
        p = self.proposing_prompt(9, v)
        ref = self.reference(p, stop_ids=NO_STOP).tokens
        want, _ = self.uninterrupted(p)
        r = self._fault_round(at, len(want.receipt.rounds))
        what = f"after a cancel at round {r} (phase {phase})"
        cancel = CancelToken()
        inj = FaultInjector(phase=phase, round_index=r, action="cancel", cancel=cancel)
        with self.open(self.name(), inj, trace=True, stop_ids=NO_STOP) as s:
            gen = s.start(p, cancel=cancel)
            with pytest.raises(Cancelled):
                gen.run()
            assert gen.receipt is not None and gen.receipt.status == "cancelled"
            self._assert_committed(s, gen, p, ref, what)
            cancel.reset()
            self._assert_resumed(gen.run(), want, ref, what + " and resume", r)

    @pytest.mark.power_conformance
    @pytest.mark.parametrize("method", ["begin", "checkpoint", "propose", "observe", "commit"])
    def test_adapter_exception_restores(self, method: str) -> None:
        """An exception inside the adapter's own ``method`` becomes an ``AdapterFault`` naming it and
        restores the round (``begin``: the whole prefill); resuming emits target-only's ids and the
        uninterrupted run's proposals.

        Troubleshooting: restore(checkpoint) must undo everything propose/observe/commit changed,
        and ``begin`` must start the request from scratch (it runs again when a failed prefill is
        re-run)."""
        v = self.n_vocab()
        p = self.proposing_prompt(10, v)
        ref = self.reference(p, stop_ids=NO_STOP).tokens
        want, _ = self.uninterrupted(p)
        call = 1 if method == "begin" else 2
        with self.open(self.name(), wrap=lambda inner: FailOnCall(inner, method, call), trace=True,
                       stop_ids=NO_STOP) as s:
            gen = s.start(p)
            with pytest.raises(AdapterFault) as err:
                gen.run()
            assert err.value.method == method, f"the AdapterFault names {err.value.method!r}, not {method!r}"
            failed = len(gen.txn.rounds) if gen.txn is not None else 0
            what = f"after {method}() raised (call {call}, round {failed})"
            if gen.txn is None or gen.txn.anchor < 0:  # it failed inside the prefill (begin or a chunk's observe)
                assert gen.tokens == () and s.opened.target.n_past == 0, f"{what}, a failed prefill left tokens loaded"
            else:
                self._assert_committed(s, gen, p, ref, what)
            self._assert_resumed(gen.run(), want, ref, what + " and resume", failed)

    @pytest.mark.power_conformance
    def test_proposals_follow_the_history(self) -> None:
        """A round proposes what a fresh request proposes whose prompt is that round's committed
        history: the adapter's state follows ``commit``, round by round.

        Troubleshooting: "round r offered [..] but a fresh request on the same history offered [..]"
        means the proposer's own copy of the history (or draft memory) drifted from the committed
        tokens: ``commit(n_accepted, emitted)`` must append the ``n_accepted`` proposals *and* the
        correction or bonus token ``emitted[-1]``; round 0 commits ``(0, [first token])`` too. An
        adapter whose proposals legitimately depend on more than the history (a random draft that
        is not keyed by position) opts out with ``xfail(reason=...)``."""
        v = self.n_vocab()
        p = self.proposing_prompt(13, v)
        res, offered = self.uninterrupted(p)
        width = max((k for k, _ in offered.values()), default=0)
        full = [r for r in sorted(offered) if r >= 2 and offered[r][0] == width]
        picks = sorted({full[0], full[-1]}) if full else []
        starts = np.cumsum([0] + [r["emitted"] for r in res.receipt.rounds])
        for r in picks:
            before = list(res.tokens[: int(starts[r])])  # emitted before round r; its last id is the anchor
            fresh_prompt = p + before[:-1]  # round 0 of the fresh request emits the anchor again
            with self.open(self.name(), wrap=Recorder, max_tokens=width + 2, stop_ids=NO_STOP) as s:
                s.generate(fresh_prompt)
                got = getattr(s.proposer, "offered", {}).get(1)
            assert got is not None and got[1] == offered[r][1], (
                f"round {r} of proposing_prompt(seed=13) offered {offered[r][1]} (k={offered[r][0]}) but a fresh "
                f"request on the same history ({len(fresh_prompt)} prompt tokens, then the anchor) offered "
                f"{None if got is None else got[1]} (k={None if got is None else got[0]})")

    @pytest.mark.power_conformance
    def test_requests_are_independent(self) -> None:
        """In one session, requests A, B and A again offer exactly what each offers in a fresh
        session, at every point of the history both reach: nothing leaks from one request into the next.

        Troubleshooting: ``begin(prompt)`` must reset every per-request state (history copies,
        draft memory, positions); one proposer serves all requests of a session. Statistics that
        are meant to persist (an acceptance model) may change how much is verified, never what is
        offered for a given history and ``ctx.k``."""
        v = self.n_vocab()
        a, b = self.proposing_prompt(11, v), self.proposing_prompt(12, v)

        with self.open(self.name(), wrap=Recorder, stop_ids=NO_STOP) as s:
            recorder = s.proposer
            previous = "the session opened"
            for label, prompt in (("A", a), ("B", b), ("A", a)):
                if isinstance(recorder, Recorder):
                    recorder.at = {}
                res = s.generate(prompt)
                want_res, want_at = self.fresh_at(prompt)
                assert res.tokens == want_res.tokens, f"request {label} after {previous}: parity broken"
                got_at = dict(getattr(recorder, "at", {}))
                common = sorted(set(got_at) & set(want_at))
                assert common, f"request {label} after {previous} never proposed at a point a fresh session did"
                for n in common:
                    assert got_at[n] == want_at[n], (
                        f"request {label} after {previous}: with {n} tokens of history it offered {got_at[n]} "
                        f"(k, ids) but the same request in a fresh session offered {want_at[n]}: state leaked "
                        "from an earlier request")
                previous = f"request {label}"

    @pytest.mark.power_conformance
    def test_shared_passes_parity(self) -> None:
        """Requests that share target passes (:class:`~power_core.engine.Engine`, three sequences of one
        target) emit what each emits alone and offer what each offers alone: first three greedy
        requests on :meth:`proposing_prompt`, one per sequence, whose proposals must equal a fresh
        session's at every history length and width both reach; then six requests — greedy and seeded
        stochastic, prompts of different lengths — over the three sequences, so requests join and
        leave between rounds and passes mix prompt chunks and verify blocks.

        Troubleshooting: the engine opens one proposer per sequence (``make_proposer`` once per
        sequence) and runs their rounds interleaved; a proposer that shares state between instances
        (a module-level cache, a class attribute, one instance handed out twice) offers another
        request's continuation here. A :class:`ConfigError` naming ``parallel`` means the backend or
        the strategy cannot share passes: opt out with ``xfail(reason=...)`` saying why (its requests
        then run as independent slots)."""
        import threading
        import time

        v = self.n_vocab()
        base: dict[str, Any] = dict(spec_mode=self.name(), spec_draft_max=self.k, max_tokens=self.max_tokens,
                                    n_ctx=256)
        with Session.open_engine(3, PowerConfig(**base), model=self.model, draft=self.draft, plugins=self.plugins(),
                                 stop_ids=frozenset(NO_STOP)) as engine:
            for session in engine.sessions:
                if session.proposer is not None:
                    session.proposer = Recorder(session.proposer)

            def concurrently(jobs: list[Callable[[], Result]]) -> list[Result]:
                """Run every job in its own thread; they join the engine's passes together."""
                out: list[Result | BaseException | None] = [None] * len(jobs)

                def one(i: int) -> None:
                    try:
                        out[i] = jobs[i]()
                    except BaseException as exc:  # reported below, with the request it belongs to
                        out[i] = exc

                threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
                with engine.held():  # no pass before every request has joined (or ended early)
                    for t in threads:
                        t.start()
                    deadline = time.monotonic() + 60
                    while engine.running + sum(r is not None for r in out) < min(len(jobs), len(engine.sessions)):
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.001)
                for t in threads:
                    t.join()
                for i, res in enumerate(out):
                    if not isinstance(res, Result):
                        raise AssertionError(f"request {i} in shared passes failed: {res!r}")
                return [res for res in out if isinstance(res, Result)]

            # 1. proposals: one proposing request per sequence, all three decoding in the same passes
            prompts = [self.proposing_prompt(s, v) for s in (11, 12, 13)]
            sessions = [engine.acquire() for _ in prompts]
            for session in sessions:
                if isinstance(session.proposer, Recorder):
                    session.proposer.at = {}
            gens = [session.start(prompt) for session, prompt in zip(sessions, prompts, strict=True)]
            results = concurrently([functools.partial(engine.run, gen) for gen in gens])
            compared = 0
            for i, (session, prompt, res) in enumerate(zip(sessions, prompts, results, strict=True)):
                want_res, want_at = self.fresh_at(prompt)
                assert res.tokens == want_res.tokens, (
                    f"proposing_prompt(seed={11 + i}) in shared passes emitted {list(res.tokens)} but alone "
                    f"{list(want_res.tokens)}; {first_diff(res.tokens, want_res.tokens)}")
                got_at = dict(getattr(session.proposer, "at", {}))
                for n in sorted(set(got_at) & set(want_at)):
                    if got_at[n][0] != want_at[n][0]:
                        continue  # another width this round (the pass was shared): not the same question
                    compared += 1
                    assert got_at[n] == want_at[n], (
                        f"proposing_prompt(seed={11 + i}) in shared passes: with {n} tokens of history it offered "
                        f"{got_at[n]} (k, ids) but alone it offered {want_at[n]}: the proposer's state is "
                        "shared with another sequence's")
            assert compared, "no round of the shared passes proposed at a history length and width a fresh run did"

            # 2. parity: six requests, greedy and seeded stochastic, over three sequences
            requests: list[tuple[list[int], dict[str, Any]]] = [
                (self.prompt(seed, v), dict(temperature=0.9, top_p=0.95, seed=seed) if seed % 2 else {})
                for seed in range(6)]
            def submitted(prompt: list[int], sampling: dict[str, Any]) -> Result:
                return engine.run(engine.submit(prompt, sampling=sampling))

            results = concurrently([functools.partial(submitted, p, smp) for p, smp in requests])
        for i, ((prompt, sampling), res) in enumerate(zip(requests, results, strict=True)):
            want = self.reference(prompt, stop_ids=NO_STOP, **sampling).tokens
            assert res.tokens == want, (f"request {i} ({sampling or 'greedy'}), prompt {prompt}: in shared passes it "
                                        f"emitted {list(res.tokens)} but target-only alone emitted {list(want)}; "
                                        f"{first_diff(res.tokens, want)}")

    @pytest.mark.power_conformance
    def test_config_keys(self) -> None:
        """The strategy's own configuration keys (``Strategy.config_keys``) hold to their declaration: a
        value outside a key's range is a ``ConfigError`` naming the key, and a session at each end of the
        range (each choice, both booleans) opens, proposes through and keeps greedy parity. A strategy
        without keys of its own passes.

        Troubleshooting: declare a key with ``power_core.spec.ConfigKey`` (name, type, ``lo``/``hi`` or
        ``choices``, default, scope, flag, help) and read it as ``request.config.<name>`` in the proposer
        factory. Parity lost at one end means the proposer mishandles that value, or the declared range
        admits values it cannot take: narrow ``lo``/``hi``. A ``PluginError`` when the strategy registers
        names a key that clashes with the core's or another strategy's declaration."""
        strategy = self.plugins().strategy(self.name())
        v = self.n_vocab()
        prompts = [self.prompt(seed, v) for seed in range(min(2, self.seeds))]
        for key in strategy.config_keys:
            for bad in _out_of_range(key):
                with pytest.raises(ConfigError) as err:
                    PowerConfig(spec_mode=self.name(), **{key.name: bad})
                assert err.value.key == key.name, (f"{key.name}={bad!r} raised a ConfigError naming "
                                                   f"{err.value.key!r}")
            for value in _range_ends(key):
                for p in prompts:
                    got, want = self.speculative(p, **{key.name: value}).tokens, self.reference(p).tokens
                    assert got == want, (f"{key.name}={value!r}, prompt {p}: speculative emitted {list(got)} but "
                                         f"target-only emitted {list(want)}; {first_diff(got, want)}")

    def test_opt_outs_are_explicit(self) -> None:
        """Guard: a subclass may only replace a standard check with an ``xfail(reason=...)`` version.

        Troubleshooting: decorate the override with ``@pytest.mark.xfail(reason="why")``."""
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
