"""One session, several strategies (:meth:`Session.open`'s ``strategies``; ``power serve --mode a,b,c``):
one :class:`~power_core.opening.Lane` per strategy on one target, the first the default; a request
picks its lane and equals a session of that strategy alone; every sequence of an engine runs any
strategy; prompt reuse follows each request's lane."""

from __future__ import annotations

import threading

import pytest
from helpers import core_plugins

from power_core import PromptCache
from power_core.config import PowerConfig
from power_core.errors import ConfigError, StrategyNotFound
from power_core.reference.proposers import ProposerWrapper
from power_core.session import Session

MODEL = "reference:seed=3,vocab=97,dim=16,recurrent=0"
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [2, 4, 6]]


def _config(mode: str = "auto", **kw) -> PowerConfig:
    return PowerConfig(spec_mode=mode, n_ctx=256, max_tokens=24, trace=True, **kw)


def _open(strategies=("ref-draft", "off"), **kw) -> Session:
    return Session.open(_config(), model=MODEL, plugins=core_plugins(), strategies=list(strategies), **kw)


def _alone(mode: str, prompt: list[int], **sampling):
    with Session.open(_config(mode), model=MODEL, plugins=core_plugins()) as s:
        return s.start(prompt, sampling=sampling).run()


def _rounds(result) -> list:
    return [(r["proposal"] if "proposal" in r else None, r["accepted"]) for r in result.receipt.to_dict()["rounds"]]


def test_lanes_the_default_and_the_names_a_request_may_ask_for():
    with _open() as s:
        assert [(lane.mode, lane.name) for lane in s.lanes] == [("ref-draft", "ref-draft"), ("off", "off")]
        # the session's own attributes are the default lane's, as with one strategy
        assert s.strategy_name == "ref-draft" and s.config.spec_mode == "ref-draft" and s.proposer is not None
        assert s.selection is s.lanes[0].selection
        assert s.max_block == s.config.draft_max + 1 == s.lanes[0].max_block and s.lanes[1].max_block == 1
        assert s.strategy_names == ("ref-draft", "off", "auto")
        assert s.lane() is s.lanes[0] and s.lane("off") is s.lanes[1]
        assert s.lane("auto") is s.lanes[1] and s.auto_reason.startswith("auto:")  # no GGUF: target-only
        with pytest.raises(ConfigError) as info:
            s.start([1, 2], strategy="suffix")
        assert info.value.key == "strategy" and "ref-draft, off, auto" in str(info.value)
    with _open(("auto", "ref-draft", "off")) as s:  # auto picks off here: off runs in auto's lane
        assert [(lane.mode, lane.name) for lane in s.lanes] == [("auto", "off"), ("ref-draft", "ref-draft")]
        assert s.lane("off") is s.lane("auto") is s.lane() is s.lanes[0] and s.auto == 0
        assert s.strategy_names == ("auto", "off", "ref-draft")
    with Session.open(_config("ref-draft"), model=MODEL, plugins=core_plugins()) as one:
        assert len(one.lanes) == 1 and one.strategy_names == ("ref-draft", "auto")
        assert one.lane("auto") is one.lane("ref-draft") is one.lanes[0]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5}], ids=["greedy", "seeded"])
def test_a_request_in_a_lane_equals_a_session_of_that_strategy_alone(sampling):
    with _open(("off", "ref-draft")) as s:
        for prompt in PROMPTS[:2]:
            for mode in ("ref-draft", "off", None, "auto"):
                got = s.start(prompt, sampling=sampling, strategy=mode).run()
                ran = {"ref-draft": "ref-draft", "off": "off", None: "off", "auto": "off"}[mode]
                alone = _alone(ran, prompt, **sampling)
                assert got.tokens == alone.tokens and _rounds(got) == _rounds(alone), mode
                assert got.receipt.strategy["name"] == ran and got.receipt.config["spec_mode"] == ran
                assert got.receipt.strategy.get("requested") == mode
                assert got.receipt.config_sha256 == alone.receipt.config_sha256


def test_each_lane_gets_its_own_keys_and_the_draft_goes_where_it_is_read():
    with Session.open(_config(spec_adaptive=True), model=MODEL, plugins=core_plugins(),
                      strategies=["ref-draft", "off"]) as s:
        assert s.lanes[0].config.spec_adaptive and not s.lanes[1].config.spec_adaptive
    with pytest.raises(ConfigError) as info:
        _open(("ref-draft", "off"), draft="/some/draft.gguf")  # neither reads a draft file
    assert info.value.key == "draft"


@pytest.mark.parametrize("strategies, key", [
    ([], "strategies"),
    ("ref-draft", "strategies"),
    (["off", "off"], "strategies"),
])
def test_malformed_strategies_are_config_errors(strategies, key):
    with pytest.raises(ConfigError) as info:
        Session.open(_config(), model=MODEL, plugins=core_plugins(), strategies=strategies)
    assert info.value.key == key


def test_an_unknown_strategy_fails_closed():
    with pytest.raises(StrategyNotFound):
        _open(("ref-draft", "no-such-mode"))


def test_replacing_the_session_s_proposer_replaces_the_default_lane_s():
    with _open() as s:
        s.proposer = ProposerWrapper(s.proposer)
        assert isinstance(s.lanes[0].proposer, ProposerWrapper)
        gen = s.start(PROMPTS[0])
        gen.run()
        assert gen.txn is not None and gen.txn.proposer is s.lanes[0].proposer


def test_every_sequence_runs_any_strategy_in_the_shared_passes():
    """Two sequences: two requests of the lane that is not the default run at once (one on each), then
    a mixed pair; each equals its strategy alone."""
    with Session.open_engine(2, _config(), model=MODEL, plugins=core_plugins(),
                             strategies=["ref-draft", "off"]) as engine:
        assert engine.runtime is not None and engine.probe is not None and engine.probe.identical
        for modes in (("off", "off"), ("ref-draft", "ref-draft"), ("off", "ref-draft")):
            gens = []
            for mode, prompt in zip(modes, PROMPTS, strict=False):
                session = engine.acquire(prompt=None)
                gens.append(session.start(prompt, strategy=mode))
            assert {g.session for g in gens} == set(engine.sessions)
            out: list = [None, None]

            def go(i: int, gens=gens, out=out) -> None:
                out[i] = engine.run(gens[i])

            with engine.held():  # both join the same first pass
                threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
                for t in threads:
                    t.start()
            for t in threads:
                t.join(60)
            for mode, prompt, res in zip(modes, PROMPTS, out, strict=False):
                alone = _alone(mode, prompt)
                assert res.tokens == alone.tokens and _rounds(res) == _rounds(alone), mode
                assert res.receipt.strategy["name"] == mode
                assert res.receipt.backend["batch"]["peak_concurrent"] == 2


def test_prompt_reuse_follows_the_request_s_lane():
    """A request keeps what the previous one left, whichever lane either ran in; a lane whose
    proposer reads the target's hidden states prefills whole, after the state is saved for the others."""
    cache = PromptCache(1 << 24)
    prompt, longer = PROMPTS[2], PROMPTS[2] + [20, 21]
    with _open(("ref-draft", "off"), prompt_cache=cache) as s:
        first = s.start(prompt, strategy="ref-draft").run()
        reused = s.start(longer, strategy="off").run()
        assert reused.receipt.prompt_reused > 0 and reused.tokens == _alone("off", longer).tokens
        lane = s.lane("ref-draft")
        lane.proposer = wrapped = ProposerWrapper(lane.proposer)
        wrapped.features = frozenset({"hidden"})  # as an MTP head's: it must observe the whole prefill
        assert not lane.reuses_prompts and s.lane("off").reuses_prompts and s.reuses_prompts
        whole = s.start(longer, strategy="ref-draft").run()
        assert whole.receipt.prompt_reused == 0 and whole.tokens == _alone("ref-draft", longer).tokens
        assert cache.stats().entries >= 1  # what the off request left was saved before the whole prefill
        again = s.start(longer, strategy="off").run()
        assert again.receipt.prompt_reused > 0 and again.tokens == reused.tokens
    assert first.tokens == _alone("ref-draft", prompt).tokens
