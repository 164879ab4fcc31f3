"""Transaction edge cases the property tests do not reach directly."""

from __future__ import annotations

import numpy as np
import pytest

from power_core.errors import AdapterFault, CapacityError, RuntimeFault
from power_core.runtime import Proposal, ProposalContext, ProposerCapabilities
from tests.helpers import open_session, run

MODEL = "reference:seed=8,vocab=48,dim=8,recurrent=1"


def test_failure_inside_prefill_resumes_from_a_fresh_prefill():
    ref = run(MODEL, [1, 2, 3, 4, 5], max_tokens=12).tokens
    with open_session(MODEL, "ref-draft", max_tokens=12) as s:
        s.opened.target.fail_on = 1  # the first decode call is the prefill's
        gen = s.start([1, 2, 3, 4, 5])
        with pytest.raises(RuntimeFault, match="injected"):
            gen.run()
        assert gen.tokens == () and gen.receipt.status == "failed"
        assert gen.run().tokens == ref


def test_round_zero_emits_from_the_prefill_row_without_a_decode():
    with open_session(MODEL, "ref-draft", max_tokens=1) as s:
        res = s.generate([1, 2, 3])
        assert s.opened.target.decode_calls == 1  # the prefill only
        r0 = res.receipt.rounds[0]
        assert (r0["reason"], r0["proposed"], r0["emitted"]) == ("prefill", 0, 1)


@pytest.mark.parametrize("prompt,n_ctx,msg", [([], 64, "empty"), ([1] * 64, 64, "context holds 64"),
                                              ([1, 99], 64, "outside the vocabulary")])
def test_bad_prompts_are_capacity_errors(prompt, n_ctx, msg):
    with open_session(MODEL, "off", n_ctx=n_ctx) as s, pytest.raises(CapacityError, match=msg):
        s.generate(prompt)


def test_context_limit_is_never_exceeded():
    with open_session(MODEL, "ref-draft", n_ctx=20, max_tokens=100, spec_draft_max=7) as s:
        res = s.generate([1, 2, 3, 4])
        assert res.receipt.finish_reason == "context"
        assert s.opened.target.n_past == 20
        assert len(res.tokens) == 20 - 4 + 1  # the last emitted token is the unconsumed anchor
    assert res.tokens == run(MODEL, [1, 2, 3, 4], n_ctx=20, max_tokens=100).tokens


class _Undeclared:
    """A proposer as written before ProposerCapabilities: every method, no ``capabilities``."""

    features = frozenset()

    def __init__(self, out):
        self.out = out

    def begin(self, prompt): pass
    def checkpoint(self): return None
    def observe(self, result): pass
    def commit(self, n, emitted): pass
    def restore(self, cp): pass

    def propose(self, ctx: ProposalContext):
        return self.out(ctx)


class _Bad(_Undeclared):
    capabilities = ProposerCapabilities()


def test_proposal_source_and_stats_reach_the_rounds_and_the_receipt():
    def out(ctx):
        return Proposal(np.arange(1, ctx.k + 1), stats={"k": ctx.k, "one": np.float32(1)},
                        source="even" if ctx.round_index % 2 == 0 else "odd")

    with open_session(MODEL, "ref-draft", max_tokens=9, spec_draft_max=3) as s:
        s.proposer = _Bad(out)
        res = s.generate([1, 2, 3])
    d = res.receipt.to_dict()
    offered = [r for r in d["rounds"] if r["proposed"]]
    assert offered and all(r["source"] == ("even" if r["index"] % 2 == 0 else "odd") for r in offered)
    assert all(r["stats"] == {"k": float(r["proposed"]), "one": 1.0} for r in offered)
    assert "source" not in d["rounds"][0] and "stats" not in d["rounds"][0]  # round 0 proposes nothing
    p = d["proposer"]
    assert p["stats"] == {"k": float(sum(r["proposed"] for r in offered)), "one": float(len(offered))}
    assert sum(v["accepted"] for v in p["sources"].values()) == p["accepted"]
    assert sum(v["drafted"] for v in p["sources"].values()) == p["drafted"]


@pytest.mark.parametrize("out,msg", [
    (lambda ctx: Proposal(np.arange(ctx.k + 1)), "at most"),
    (lambda ctx: Proposal(np.array([48])), "outside"),
    (lambda ctx: Proposal(np.array([-1])), "outside"),
    (lambda ctx: Proposal(np.zeros((1, 1), dtype=np.int32)), "1-D"),
    (lambda ctx: Proposal(np.array([0.5])), "integer"),
    # a bare array (the protocol before Proposal): the message says how to fix the adapter
    (lambda ctx: np.array([1], dtype=np.int32), r"returned a bare array \(int32\[1\]\), not a Proposal; "
                                                r"return power_core\.Proposal\(ids\)"),
    (lambda ctx: [1], "returned a list, not a Proposal"),
    (lambda ctx: None, "returned None, not a Proposal"),
    (lambda ctx: Proposal(np.array([1]), confidence=[[0.5]]), "confidence of a list; expected one float per id"),
    (lambda ctx: Proposal(np.array([1, 2]), confidence=[0.5]), "1 confidences for 2 ids"),
    (lambda ctx: Proposal(np.array([1]), confidence=[1.5]), r"confidence outside \[0, 1\]"),
    (lambda ctx: Proposal(np.array([1]), confidence=[float("nan")]), r"confidence outside \[0, 1\]"),
    (lambda ctx: Proposal(np.array([1]), stats=[("n", 1)]), "stats of type list; expected a mapping"),
    (lambda ctx: Proposal(np.array([1]), stats={"n": "1"}), r"expected names \(str\) to finite numbers"),
    (lambda ctx: Proposal(np.array([1]), stats={"n": float("inf")}), r"expected names \(str\) to finite numbers"),
    (lambda ctx: Proposal(np.array([1]), source=3), "source of type int; expected a name"),
])
def test_proposer_contract_violations_are_adapter_faults(out, msg):
    with open_session(MODEL, "ref-draft", max_tokens=5) as s:
        s.proposer = _Bad(out)
        gen = s.start([1, 2, 3])
        with pytest.raises(AdapterFault, match=msg):
            gen.run()
        assert s.opened.target.n_past == 3 and len(gen.tokens) == 1  # round 0 kept, round 1 restored


# -- every adapter call goes through one door: foreign exceptions become AdapterFault ---------------------
def _failing(method, call):
    from power_core.testing.faults import FailOnCall

    return lambda inner: FailOnCall(inner, method, call=call)


@pytest.mark.parametrize("method,call", [("checkpoint", 2), ("propose", 1), ("observe", 2), ("commit", 2),
                                         ("commit", 1)])
def test_adapter_exception_in_a_round_is_an_adapter_fault_and_restores(method, call):
    prompt = [1, 2, 3, 4, 5]
    ref = run(MODEL, prompt, max_tokens=12).tokens
    with open_session(MODEL, "ref-draft", max_tokens=12) as s:
        s.proposer = _failing(method, call)(s.proposer)
        gen = s.start(prompt)
        with pytest.raises(AdapterFault, match=rf"FailOnCall\.{method} raised ValueError: adapter bug") as err:
            gen.run()
        assert (err.value.proposer, err.value.method) == ("FailOnCall", method)
        assert isinstance(err.value.__cause__, ValueError)
        assert gen.receipt.status == "failed" and gen.receipt.error.startswith("adapter_fault")
        assert s.opened.target.n_past == len(prompt) - 1 + max(len(gen.tokens), 1)  # last commit, exactly
        assert gen.tokens == ref[: len(gen.tokens)]
        assert gen.run().tokens == ref


@pytest.mark.parametrize("method", ["begin", "observe"])
def test_adapter_exception_in_prefill_leaves_nothing_loaded_and_the_request_reruns(method):
    prompt = [1, 2, 3, 4, 5]
    ref = run(MODEL, prompt, max_tokens=12).tokens
    with open_session(MODEL, "ref-draft", max_tokens=12) as s:
        s.proposer = _failing(method, 1)(s.proposer)  # the first observe is the prefill chunk's
        gen = s.start(prompt)
        with pytest.raises(AdapterFault, match=rf"\.{method} raised ValueError") as err:
            gen.run()
        assert err.value.method == method
        assert gen.tokens == () and s.opened.target.n_past == 0  # nothing half-loaded
        begins = s.proposer.calls if method == "begin" else None
        assert gen.run().tokens == ref  # the request starts over: begin, then the prefill again
        if begins is not None:
            assert s.proposer.calls == begins + 1


def test_failing_proposer_restore_still_restores_the_target_and_finishes_target_only():
    from power_core.testing.faults import FaultInjector

    prompt = [1, 2, 3, 4, 5]
    ref = run(MODEL, prompt, max_tokens=12).tokens
    inj = FaultInjector(phase="commit", round_index=1, when="after")
    with open_session(MODEL, "ref-draft", None, inj, max_tokens=12) as s:
        s.proposer = _failing("restore", 1)(s.proposer)
        gen = s.start(prompt)
        with pytest.raises(AdapterFault, match="restore raised ValueError.*while restoring after InjectedFault"
                                               ".*target-only") as err:
            gen.run()
        assert err.value.method == "restore"
        assert len(gen.tokens) == 1 and s.opened.target.n_past == len(prompt)  # round 1 undone
        res = gen.run()
        assert res.tokens == ref
        assert all(r["proposed"] == 0 for r in res.receipt.rounds[1:])  # the proposer sat the request out
        assert s.generate(prompt).receipt.summary()["proposed"] > 0  # the next request begins it again


def test_power_errors_from_the_adapter_pass_through_typed():
    from power_core.errors import StateLost

    class Lost(_Bad):
        def propose(self, ctx):
            raise StateLost("draft memory lost")

    with open_session(MODEL, "ref-draft", max_tokens=5) as s:
        s.proposer = Lost(None)
        with pytest.raises(StateLost, match="draft memory lost"):
            s.generate([1, 2, 3])


def test_session_close_closes_the_target_even_when_the_proposer_close_fails():
    closed = []
    s = open_session(MODEL, "ref-draft", max_tokens=5)
    s.opened.close = lambda: closed.append(True)

    class Boom(_Bad):
        @property
        def capabilities(self):
            return ProposerCapabilities(close=self.close)

        def close(self):
            raise OSError("handle already freed")

    s.proposer = Boom(None)
    with pytest.raises(AdapterFault, match=r"Boom\.close raised OSError"):
        s.close()
    assert closed == [True]


# -- capabilities: declared once, as a value, read from there ----------------------------------------------
def test_a_proposer_that_declares_no_capabilities_is_an_adapter_fault():
    with open_session(MODEL, "ref-draft", max_tokens=5) as s:
        s.proposer = _Undeclared(lambda ctx: Proposal.none())
        with pytest.raises(AdapterFault, match=r"proposer _Undeclared declares no capabilities .*"
                                               r"capabilities = ProposerCapabilities\(\)") as err:
            s.generate([1, 2, 3])
        assert err.value.method == "capabilities"
        s.proposer = None  # the session closes cleanly without it


def test_proposer_capabilities_of_checks_the_type():
    class Wrong(_Bad):
        capabilities = {"close": None}

    with pytest.raises(AdapterFault, match=r"Wrong\.capabilities is a dict; expected a power_core\.ProposerCapabilities"):
        ProposerCapabilities.of(Wrong(None))
    assert ProposerCapabilities.of(_Bad(None)) == ProposerCapabilities()


def test_declared_abilities_are_callables_and_compare_by_flags():
    from power_core.runtime import TargetCapabilities

    def clock() -> float:
        return 1.0

    assert ProposerCapabilities(compute_seconds=clock) == ProposerCapabilities()  # abilities never compared
    assert ProposerCapabilities(reads_target_rows=True) != ProposerCapabilities()
    with pytest.raises(TypeError, match="close must be a callable"):
        ProposerCapabilities(close=True)  # type: ignore[arg-type]
    base = dict(name="t", n_vocab=8, n_ctx=8, max_block=2, rollback_window=None)
    with pytest.raises(TypeError, match="declares cancel without clear_abort"):
        TargetCapabilities(**base, cancel=clock)  # type: ignore[arg-type]


def test_the_reference_target_declares_its_abilities():
    with open_session(MODEL, "off", max_tokens=5) as s:
        caps = s.opened.target.capabilities
        assert caps.keep_prefix is not None and caps.counters is not None and caps.compute_seconds is not None
        assert caps.cancel is None and caps.sample_in_graph is None  # it can neither abort nor sample in a graph
        assert set(caps.counters()) >= {"decodes"} and caps.compute_seconds() >= 0.0


def test_an_observer_of_the_propose_phase_sees_the_checked_proposal():
    """The ``propose`` phase's result is the Proposal itself: ids (int32, as checked), the
    proposer's confidence and its statistics travel as one value, not as attributes read later."""
    from power_core.plugins import hookimpl

    seen = []

    class Watch:
        __name__ = "watch"

        @hookimpl(wrapper=True)
        def power_txn_phase(self, phase, round_index):
            result = yield
            if phase == "propose":
                seen.append(result)
            return result

    def out(ctx):
        return Proposal(np.arange(1, ctx.k + 1, dtype=np.int64), confidence=[0.5] * ctx.k, stats={"k": float(ctx.k)})

    with open_session(MODEL, "ref-draft", None, Watch(), max_tokens=6, spec_draft_max=3) as s:
        s.proposer = _Bad(out)
        s.generate([1, 2, 3])
    assert seen and all(isinstance(p, Proposal) and p.ids.dtype == np.int32 for p in seen)
    offered = [p for p in seen if p.ids.size]  # round 0 (and a width-0 round) propose nothing: Proposal.none()
    assert offered and all(p.stats == {"k": float(p.ids.shape[0])} and len(p.confidence) == p.ids.shape[0]
                           for p in offered)
