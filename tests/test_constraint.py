"""Constraints, penalties and logit biases inside the transaction: speculative output equals
constrained target-only output, greedy and seeded, alone and in shared passes.

The reference backend's models with ``vocab > 256`` have a byte tokenizer (ids 0..255 are bytes,
256 ends text), so a grammar over text constrains them like a real model.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from power_core.config import PowerConfig
from power_core.constraint import ConstraintSpec, Grammars
from power_core.errors import ConfigError, ConstraintError, PowerError
from power_core.plugins import Strategy, hookimpl
from power_core.reference.plugin import ByteTokenizer
from power_core.runtime import Proposal, ProposalContext, ProposerCapabilities
from power_core.sampling import TargetSampler
from power_core.session import Session
from power_core.testing.faults import FaultInjector
from tests.helpers import core_plugins, open_session

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
     "required": ["a"]},
    {"type": "array", "items": {"enum": ["x", "y", "zz"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"k": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["k"]},
    {"type": "string", "pattern": "^[a-c]{2,5}$"},
]
SPECS = [ConstraintSpec.json_schema(s) for s in SCHEMAS] + [
    ConstraintSpec.regex(r"(ab|cd)+[0-9]{1,3}"),
    ConstraintSpec.grammar('root ::= "yes" | "no" | "maybe " [a-z]+ "!"'),
    ConstraintSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                               trigger="<c>"),
    # keys from a short pattern: the reference model repeats them, which the key guard forbids
    ConstraintSpec.json_schema({"type": "object", "patternProperties": {"^[ab]{1,3}$": {"enum": [1, 2]}},
                                "additionalProperties": False}),
]
MODELS = ["reference:seed={seed},vocab=288,dim=12,recurrent={rec},sharp=3.0,eos=256"]


def _model(seed: int, rec: int) -> str:
    return MODELS[0].format(seed=seed, rec=rec)


def _run(model: str, prompt: Sequence[int], mode: str, spec: ConstraintSpec | None, draft: str | None = None,
         **cfg) -> object:
    sampling = {k: cfg.pop(k) for k in list(cfg) if k in ("temperature", "top_k", "top_p", "seed", "repeat_penalty",
                                                         "repeat_last_n", "frequency_penalty", "presence_penalty",
                                                         "logit_bias")}
    with open_session(model, mode, draft, stop_ids=frozenset({256}), **cfg) as s:
        return s.start(list(prompt), sampling=sampling, constraint=spec).run()


def _matches(spec: ConstraintSpec, text: bytes) -> bool:
    """Whether ``text`` is a complete match (a fresh engine consumes it and may stop)."""
    grammars = Grammars(ByteTokenizer(288).vocabulary)
    c = grammars.compile(spec)
    toks = list(text)
    if c.allows(toks) != len(toks):
        return False
    c.advance(toks)
    return bool(c.allows([256]))  # the end of text is allowed: the match is complete


@st.composite
def scenarios(draw, stochastic: bool = False):
    model = _model(draw(st.integers(0, 5000)), draw(st.integers(0, 1)))
    profile = draw(st.sampled_from(["own", "noisy", "other"]))
    draft = {"own": None, "noisy": f"reference:accept={draw(st.sampled_from([0.3, 0.9]))}",
             "other": f"reference:seed={draw(st.integers(0, 99))},vocab=288,dim=8,recurrent=0"}[profile]
    prompt = draw(st.lists(st.integers(32, 126), min_size=1, max_size=10))
    cfg: dict = dict(spec_draft_max=draw(st.integers(1, 8)), max_tokens=draw(st.integers(4, 40)))
    if stochastic:
        cfg.update(temperature=draw(st.floats(0.3, 1.5)), top_k=draw(st.sampled_from([0, 8])),
                   seed=draw(st.integers(0, 2**32)))
    return model, draft, prompt, cfg, draw(st.sampled_from(SPECS))


@SETTINGS
@given(scenarios())
def test_constrained_greedy_speculation_equals_constrained_off(scenario):
    model, draft, prompt, cfg, spec = scenario
    spec_run = _run(model, prompt, "ref-draft", spec, draft, **cfg)
    off = _run(model, prompt, "off", spec, **cfg)
    assert spec_run.tokens == off.tokens
    c = spec_run.receipt.constraint
    assert c is not None and c["digest"] == spec.digest and c["kind"] == spec.kind
    # the receipt counts every cut, and a cut proposal was never verified past its first forbidden token
    cut_rounds = [r for r in spec_run.receipt.rounds if r.get("cut")]
    assert c["cuts"] == len(cut_rounds) and c["cut_tokens"] == sum(r["cut"] for r in cut_rounds)
    if off.receipt.finish_reason == "stop":
        assert _matches(spec, bytes(t for t in off.tokens if t < 256))


@SETTINGS
@given(scenarios(stochastic=True))
def test_constrained_seeded_speculation_equals_constrained_off(scenario):
    model, draft, prompt, cfg, spec = scenario
    assert _run(model, prompt, "ref-draft", spec, draft, **cfg).tokens == _run(model, prompt, "off", spec, **cfg).tokens


@SETTINGS
@given(scenarios(stochastic=False), st.sampled_from([
    dict(repeat_penalty=1.3, repeat_last_n=8), dict(frequency_penalty=0.7, repeat_last_n=-1),
    dict(presence_penalty=1.1), dict(logit_bias=((32, -50.0), (101, 4.0))),
    dict(repeat_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.5, logit_bias=((256, -3.0),)),
]), st.booleans())
def test_penalties_and_biases_under_speculation_equal_off(scenario, knobs, stochastic):
    model, draft, prompt, cfg, _ = scenario
    cfg = {**cfg, **knobs}
    if stochastic:
        cfg.update(temperature=0.8, seed=7)
    spec_run = _run(model, prompt, "ref-draft", None, draft, **cfg)
    off = _run(model, prompt, "off", None, **cfg)
    assert spec_run.tokens == off.tokens
    for key, value in knobs.items():  # the receipt records what the request ran with
        assert spec_run.receipt.config[key] == (tuple(value) if key == "logit_bias" else value)


def test_penalties_change_output():
    """The penalties are live (the identity above is not vacuous): a repeating greedy output changes."""
    model, prompt = _model(5, 0), list(b"aaaa")
    plain = _run(model, prompt, "off", None, max_tokens=40)
    assert _run(model, prompt, "off", None, max_tokens=40, repeat_penalty=1.5, repeat_last_n=-1).tokens != plain.tokens
    assert _run(model, prompt, "off", None, max_tokens=40, frequency_penalty=1.5).tokens != plain.tokens
    banned = plain.tokens[0]
    assert banned not in _run(model, prompt, "off", None, max_tokens=40, logit_bias=((banned, -1e9),)).tokens


def test_adjust_is_llama_cpp_penalties_in_float32():
    """llama.cpp's logit-bias then penalties samplers: bias added; then for each token in the last
    ``repeat_last_n`` of the history with count c: logit <= 0 ? logit * r : logit / r, then minus
    c * freq + present."""
    s = TargetSampler(repeat_penalty=2.0, repeat_last_n=3, frequency_penalty=0.5, presence_penalty=0.25,
                      logit_bias=((0, 1.0),))
    row = np.array([1.0, -1.0, 4.0, 3.0], dtype=np.float32)
    history = np.array([2, 1, 2, 1, 1], dtype=np.int32)  # window [2, 1, 1]: token 2 once, token 1 twice
    out = s.adjust(row, history)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.array([2.0, -1.0 * 2 - (2 * 0.5 + 0.25), 4.0 / 2 - (0.5 + 0.25), 3.0],
                                                dtype=np.float32))
    np.testing.assert_array_equal(row, np.array([1.0, -1.0, 4.0, 3.0], dtype=np.float32))  # not changed
    assert not TargetSampler(repeat_last_n=0, repeat_penalty=2.0).penalizes
    assert not TargetSampler().adjusts


def test_logit_bias_outside_the_vocabulary_is_a_config_error():
    with pytest.raises(ConfigError, match="logit_bias"):
        _run(_model(1, 0), [65], "off", None, logit_bias=((5000, 1.0),))


class _Replay:
    """Proposes the next tokens of a known output (what target-only decoding emits), so every
    proposal is accepted: blocks run through the lazy trigger."""

    features: frozenset[str] = frozenset()

    def __init__(self, output: Sequence[int], n_prompt: int) -> None:
        self.output, self.n_prompt = list(output), n_prompt

    @property
    def capabilities(self) -> ProposerCapabilities:
        return ProposerCapabilities()

    def begin(self, prompt) -> None:
        pass

    def checkpoint(self) -> None:
        return None

    def propose(self, ctx: ProposalContext) -> Proposal:
        done = ctx.history.shape[0] - self.n_prompt  # emitted so far (the anchor included)
        return Proposal(np.asarray(self.output[done: done + ctx.k], dtype=np.int32))

    def observe(self, result) -> None:
        pass

    def commit(self, n_accepted, emitted) -> None:
        pass

    def restore(self, checkpoint) -> None:
        pass


def _replay_plugin(output: Sequence[int], n_prompt: int) -> object:
    class P:
        __name__ = "replay-test"

        @hookimpl
        def power_register_strategies(self, register):
            register(Strategy(name="replay", version="1", package="replay-test", kind="model-free",
                              proposer=lambda req: _Replay(output, n_prompt)))

    return P()


def test_a_lazy_trigger_inside_an_accepted_block_constrains_the_rest_as_off_does():
    """The trigger completes inside a speculated block whose proposals are accepted: the rows after
    it are masked by the grammar exactly as an autoregressive run masks them (vLLM ignored the
    grammar there). The proposer replays the free (unconstrained) run, so the blocks before and
    through the trigger are accepted, and the grammar must cut or correct what follows it."""
    checked = 0
    for seed in range(2000):
        model, prompt = _model(seed, seed % 2), list(b"go")
        free = _run(model, prompt, "off", None, max_tokens=24).tokens
        # before its trigger a lazy grammar leaves text free (UTF-8 text, no control token): a free run
        # whose first three tokens are printable ASCII emits the same through the trigger
        if len(free) < 12 or not all(32 <= t < 127 for t in free[:3]) or bytes(free[:3]).find(bytes(free[1:3])) != 1:
            continue
        trigger = bytes(free[1:3])
        lazy = ConstraintSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                           "required": ["n"]}, trigger=trigger.decode())
        off = _run(model, prompt, "off", lazy, max_tokens=24)
        assert off.tokens[:3] == free[:3]  # free text through the trigger, then the grammar
        with Session.open(PowerConfig(spec_mode="replay", spec_draft_max=8, max_tokens=24, n_ctx=256), model=model,
                          plugins=core_plugins(_replay_plugin(free, len(prompt))),
                          stop_ids=frozenset({256})) as s:
            spec_run = s.start(prompt, constraint=lazy).run()
        assert spec_run.tokens == off.tokens
        rounds = spec_run.receipt.rounds
        covering = _round_covering(rounds, 3)
        assert covering is not None
        before = sum(r["emitted"] for r in rounds[: rounds.index(covering)])
        if covering["accepted"] >= 3 - before and covering.get("cut"):
            checked += 1  # the trigger ended inside the accepted block, and the grammar cut the rest of it
        if checked >= 3:
            break
    assert checked >= 3


def _round_covering(rounds: list[dict], position: int) -> dict | None:
    """The round whose emitted tokens include output position ``position`` (0-based, exclusive end)."""
    done = 0
    for r in rounds:
        if done < position <= done + r["emitted"]:
            return r
        done += r["emitted"]
    return None


def test_constraints_in_shared_passes_equal_solo_off():
    """Four concurrent constrained requests in shared target passes, each with its own grammar and
    sampling (greedy, seeded, penalised): each equals its solo constrained off run, and proposes per
    round what its solo speculative run proposes (the cuts too)."""
    model = _model(3, 1)
    jobs = [(list(b"ab"), SPECS[0], {}), (list(b"x"), SPECS[4], {"temperature": 0.7, "seed": 5}),
            (list(b"hello"), SPECS[6], {}), (list(b"q"), SPECS[1], {"frequency_penalty": 0.5})]
    solo = [_run(model, p, "off", spec, max_tokens=30, **samp).tokens for p, spec, samp in jobs]
    solo_spec = [_run(model, p, "ref-draft", spec, max_tokens=30, trace=True, **samp) for p, spec, samp in jobs]
    engine = Session.open_engine(4, PowerConfig(spec_mode="ref-draft", max_tokens=30, n_ctx=256, trace=True),
                                 model=model, plugins=core_plugins(), stop_ids=frozenset({256}))
    out: list = [None] * len(jobs)

    def go(i: int) -> None:
        prompt, spec, samp = jobs[i]
        out[i] = engine.run(engine.submit(prompt, sampling=samp, constraint=spec))

    with engine:
        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert [r.tokens for r in out] == solo
    for shared, alone in zip(out, solo_spec, strict=True):
        assert [(r["proposal"], r.get("cut", 0)) for r in shared.receipt.rounds] == \
            [(r["proposal"], r.get("cut", 0)) for r in alone.receipt.rounds]
        assert shared.receipt.backend.get("batch") is not None


def test_a_schema_the_engine_refuses_is_a_constraint_error_naming_it():
    with open_session(_model(1, 0)) as s:
        with pytest.raises(ConstraintError, match="uniqueItems"):
            s.start([65], constraint=ConstraintSpec.json_schema({"type": "array", "uniqueItems": True},
                                                                field="response_format"))
        with pytest.raises(ConstraintError, match="regex"):
            s.start([65], constraint=ConstraintSpec.regex("(["))
        with pytest.raises(ConstraintError, match="not JSON"):
            ConstraintSpec.json_schema("{nope")
        # the session still serves
        assert s.start([65], constraint=SPECS[4]).run().receipt.status == "completed"


def test_a_model_without_a_vocabulary_refuses_constraints():
    with open_session("reference:vocab=64") as s:
        assert s.start([1], constraint=ConstraintSpec.regex("[0-9]+")).run().receipt.constraint is not None
        s.opened.grammars = None  # a backend that cannot read its vocabulary
        with pytest.raises(ConstraintError, match="vocabulary"):
            s.start([1], constraint=SPECS[4])


@pytest.mark.parametrize("phase", ["propose", "verify", "accept", "commit", "emit"])
@pytest.mark.parametrize("round_index", [1, 3])
def test_a_restored_round_rolls_the_constraint_back(phase, round_index):
    """A failure inside a round restores the constraint with the target: the resumed request's
    output equals an uninterrupted one."""
    model, prompt = _model(7, 1), list(b"go")
    off = _run(model, prompt, "off", SPECS[0], max_tokens=30)
    inj = FaultInjector(phase=phase, round_index=round_index, when="after")
    with open_session(model, "ref-draft", "reference:accept=0.7", inj, stop_ids=frozenset({256}), max_tokens=30) as s:
        gen = s.start(prompt, constraint=SPECS[0])
        try:
            gen.run()
        except PowerError:
            assert inj.fired == 1
            assert gen.tokens == off.tokens[: len(gen.tokens)]
        assert gen.run().tokens == off.tokens


def test_receipt_digest_and_json_of_a_constraint():
    spec = ConstraintSpec.json_schema('{"type": "integer"}')
    assert spec.source == json.dumps({"type": "integer"}, separators=(",", ":"))
    # the key order is kept: it is the order the output writes properties in
    ordered = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert list(json.loads(ConstraintSpec.json_schema(ordered).source)["properties"]) == ["b", "a"]
    assert spec.digest == ConstraintSpec.json_schema({"type": "integer"}).digest
    assert spec.to_dict() == {"kind": "json_schema", "digest": spec.digest, "lazy": False}


# -- open objects (issue 45, point 4): closed by default, as llama-server's converter; never a key twice --
def _duplicates(text: bytes) -> list[str]:
    """Keys that some object of the JSON ``text`` holds twice."""
    seen: list[str] = []

    def hook(pairs: list[tuple[str, object]]) -> dict:
        keys = [k for k, _ in pairs]
        seen.extend(k for i, k in enumerate(keys) if k in keys[:i])
        return dict(pairs)

    json.loads(text, object_pairs_hook=hook)
    return seen


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


@pytest.mark.parametrize("schema, text, ok", [
    # an object that declares its properties takes no others unless it says so (llama-server's converter)
    (PERSON, b'{"name": "Ada", "age": 36}', True),
    (PERSON, b'{"name": "Ada", "city": "London"}', False),
    ({**PERSON, "additionalProperties": True}, b'{"name": "Ada", "city": "London"}', True),
    ({**PERSON, "additionalProperties": {"type": "integer"}}, b'{"name": "Ada", "born": 1815}', True),
    ({**PERSON, "additionalProperties": {"type": "integer"}}, b'{"name": "Ada", "born": "1815"}', False),
    ({"type": "object", "properties": {"p": PERSON}}, b'{"p": {"name": "Ada", "x": 1}}', False),  # nested
    ({"type": "array", "items": PERSON}, b'[{"name": "Ada"}, {"age": 1, "extra": 2}]', False),
    ({"anyOf": [PERSON, {"type": "null"}]}, b'{"name": "Ada", "x": 1}', False),
    ({"$defs": {"P": PERSON}, "$ref": "#/$defs/P"}, b'{"name": "Ada", "x": 1}', False),
    ({"$defs": {"P": PERSON}, "$ref": "#/$defs/P"}, b'{"name": "Ada", "age": 1}', True),
    # several allOf members are one object: each is left as written (closing each would refuse the others' keys)
    ({"allOf": [PERSON, {"properties": {"city": {"type": "string"}}}]}, b'{"name": "Ada", "city": "X"}', True),
    # an object that declares no properties is any object (json_object, {"type": "object"})
    ({"type": "object"}, b'{"a": 1, "b": [1, {"c": null}]}', True),
    ({"type": "object", "properties": {}}, b'{}', True),
    ({"type": "object", "properties": {}}, b'{"a": 1}', False),
])
def test_objects_are_closed_unless_they_say_otherwise(schema, text, ok):
    assert _matches(ConstraintSpec.json_schema(schema), text) is ok


@pytest.mark.parametrize("schema", [
    {"type": "object"},
    {**PERSON, "additionalProperties": True},
    {"type": "object", "patternProperties": {"^x": {}}},
])
@pytest.mark.parametrize("text, ok", [
    (b'{"xa": 1, "xb": 2}', True),
    (b'{"xa": 1, "xa": 2}', False),
    (b'{"xa": 1, "\\u0078a": 2}', False),  # the same key, escaped
    (b'{"xa": {"xa": 1, "xb": 2}, "xb": {"xa": 3}}', True),  # one key in several objects
    (b'{"xa": {"xc": 1, "xd": 2}, "xa": 2}', False),
    (b'{"xa": {"xb": 1, "xb": 2}}', False),
    (b'{"xa": "\\"xa\\": 1, ", "xb": 1}', True),  # a key's text inside a value is no key
])
def test_no_object_ever_holds_a_key_twice(schema, text, ok):
    assert _matches(ConstraintSpec.json_schema(schema), text) is ok, text
    assert bool(_duplicates(text)) is not ok


def test_no_key_twice_after_a_lazy_trigger_and_in_tool_calls():
    lazy = ConstraintSpec.json_schema({"type": "object"}, trigger="<j>")
    assert _matches(lazy, b'say "a": 1, "a": 2 <j>{"a": 1, "b": 2}')
    assert not _matches(lazy, b'text <j>{"a": 1, "a": 2}')
    from power_core import tools

    free = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for choice in ("auto", "required"):
        spec = tools.ToolPlan.make([free], choice).constraint()
        call = b'<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": {"a": 2}}}\n</tool_call>'
        twice = b'<tool_call>\n{"name": "f", "arguments": {"a": 1, "a": 2}}\n</tool_call>'
        assert _matches(spec, call) and _matches(spec, call + b"\n" + call), choice
        assert not _matches(spec, twice) and not _matches(spec, call + b"\n" + twice), choice
    closed = {"type": "function", "function": {"name": "g", "parameters": PERSON}}
    spec = tools.ToolPlan.make([closed], "required").constraint()
    assert not _matches(spec, b'<tool_call>\n{"name": "g", "arguments": {"name": "A", "x": 1}}\n</tool_call>')


def test_the_key_guard_masks_rows_and_cuts_proposals_over_multi_byte_tokens():
    """Tokens that close a key, or span a value, a comma and a whole key: the row's mask forbids the
    one that would write a key twice, a proposal is cut before it, and a rollback forgets the keys."""
    from power_core.constraint import Vocabulary

    extra = [b'a"', b', "a": ', b'1, "a"', b'1, "b"', b'}, "a"', b'"a": ']
    pieces = tuple(bytes([i]) for i in range(256)) + (b"\xff<|endoftext|>",) + tuple(extra)
    tok = {p: 257 + i for i, p in enumerate(extra)}
    grammars = Grammars(lambda: Vocabulary(pieces, (256,), lambda text: list(text)))
    row = np.zeros(len(pieces), dtype=np.float32)

    c = grammars.compile(ConstraintSpec.json_schema({"type": "object"}))
    c.advance(list(b'{"a": 1, "'))
    allowed = np.isfinite(c.mask(row))
    assert not allowed[tok[b'a"']] and allowed[ord("a")] and allowed[ord("b")]
    assert c.allows([ord("a"), ord('"')]) == 1 and c.allows([tok[b'a"']]) == 0 and c.allows([ord("b")]) == 1
    c.rollback(4)  # back to '{"a": ' (the key is still held)
    assert c.allows([ord("1"), tok[b', "a": ']]) == 1 and c.allows([tok[b'1, "b"']]) == 1
    allowed = np.isfinite(c.mask(row))
    assert not allowed[tok[b'1, "a"']] and allowed[tok[b'1, "b"']]
    c.rollback(6)  # back to the start: no key is held
    assert c.allows([ord("{"), tok[b'"a": '], ord("1")]) == 3
    c.advance([ord("{"), tok[b'"a": '], ord("{")])  # a nested object holds its own keys
    assert c.allows([tok[b'"a": '], ord("2")]) == 2
    c.advance([tok[b'"a": '], ord("2")])
    allowed = np.isfinite(c.mask(row))
    assert allowed[ord("}")] and not allowed[tok[b'}, "a"']]  # closes it, then "a" again in the outer one
    assert c.allows([tok[b'}, "a"']]) == 0


def test_open_objects_under_speculation_equal_off_and_never_repeat_a_key():
    """A small model (the reference one) repeats keys of an object whose keys are a pattern (issue 45:
    instructor's tools, 4 of 40 BFCL tools ran away): never here, and speculation equals off."""
    spec = ConstraintSpec.json_schema({"type": "object", "patternProperties": {"^[ab]{1,3}$": {"enum": [1, 2]}},
                                       "additionalProperties": False})
    several = 0
    for seed in range(24):
        model = _model(seed, seed % 2)
        off = _run(model, list(b"{"), "off", spec, max_tokens=60)
        got = _run(model, list(b"{"), "ref-draft", spec, "reference:accept=0.6", spec_draft_max=6, max_tokens=60)
        assert got.tokens == off.tokens
        text = bytes(t for t in off.tokens if t < 256)
        keys = re.findall(rb'"([ab]+)":', text)
        assert len(keys) == len(set(keys)), text
        several += len(keys) >= 3
        if off.receipt.finish_reason == "stop":
            assert _matches(spec, text)
    assert several >= 3


def _greedy_vocabulary(extra: Sequence[bytes]):
    """Bytes, an end of text (256) and ``extra`` pieces, tokenized longest match first (as a BPE
    vocabulary's merges would): the grammar engine then writes forced text in those pieces only."""
    from power_core.constraint import Vocabulary

    pieces = tuple(bytes([i]) for i in range(256)) + (b"\xff<|endoftext|>",) + tuple(extra)
    ids = {p: i for i, p in enumerate(pieces) if i != 256}
    longest = max(map(len, extra))

    def encode(text: bytes) -> list[int]:
        out, i = [], 0
        while i < len(text):
            n = next(n for n in range(min(longest, len(text) - i), 0, -1) if text[i:i + n] in ids)
            out.append(ids[text[i:i + n]])
            i += n
        return out

    return Vocabulary(pieces, (256,), encode), encode


def test_a_forced_tool_call_in_multi_byte_pieces_runs_through_the_key_guard():
    """With BPE-like pieces the engine allows only the forced text's own pieces (after '",' only ' "',
    never ' '): the look-ahead must follow whole tokens, not bytes (it once refused every token
    there, on SmolLM2)."""
    from power_core import tools

    vocab, encode = _greedy_vocabulary([b'",', b' "', b'{"', b'name', b'":', b'arguments', b'get_weather',
                                        b'<tool_call>', b'</tool_call>', b'city', b'"}}'])
    grammars = Grammars(lambda: vocab)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}
    free = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    plan = tools.ToolPlan.make([weather, free], "required")
    row = np.zeros(len(vocab.pieces), dtype=np.float32)
    for call in (b'<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                 b'<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris", "name": "x"}}\n</tool_call>'):
        c = grammars.compile(plan.constraint())
        for tok in encode(call):
            allowed = np.isfinite(c.mask(row))
            assert allowed[tok], (call, vocab.pieces[tok])
            c.advance([tok])
        assert c.allows([256]) == 1
    after = grammars.compile(plan.constraint())
    after.advance(encode(b'<tool_call>\n{"name": "get_weather",'))
    assert np.flatnonzero(np.isfinite(after.mask(row))).tolist() == encode(b' "')  # the forced piece only
