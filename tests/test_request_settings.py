"""A request's settings beside its session's configuration: :class:`RequestSettings` holds the request-scoped
keys' values, checked on their own by the keys' declarations, and :meth:`PowerConfig.with_request` puts them
in place without checking the session's keys again, to the configuration (and receipt digest) that a whole
rebuild, ``PowerConfig.from_mapping(config.to_dict(), **changes)``, made before."""

from __future__ import annotations

from typing import Any

import pytest

from power_core.config import CORE_KEYS, REQUEST_KEYS, PowerConfig, RequestSettings
from power_core.errors import ConfigError
from tests.helpers import open_session

# a byte tokenizer (stop strings work), eos among the ids
MODEL = "reference:seed=2,vocab=288,dim=16,eos=256"

SESSIONS = [
    PowerConfig(spec_mode="off"),
    PowerConfig(spec_mode="ref-draft", spec_draft_max=4, verify_capacity=8, max_tokens=9, temperature=0.5,
                stop=("###",), seed=5, tenant="a", logit_bias={"3": 1.5}),
]
CHANGES: list[dict[str, Any]] = [
    {"max_tokens": 200},
    {"spec_draft_max": 2},  # a request's own (narrower) K
    {"max_tokens": 9, "temperature": 0.7, "seed": 3},  # max_tokens as the session's: only the others change
    {"temperature": 1},  # an int for a float key stays as the caller gave it (the digest's JSON says 1)
    {"stop": ["\n\n", "###"], "tenant": "b", "top_k": 40, "top_p": 0.9, "min_p": 0.05},
    {"stop": "###", "logit_bias": {"15": -100, "3": 2.0}, "repeat_penalty": 1.1, "repeat_last_n": -1,
     "frequency_penalty": 0.5, "presence_penalty": -0.5},
]


def test_the_request_keys_are_the_tables():
    assert REQUEST_KEYS == tuple(k.name for k in CORE_KEYS if k.scope == "request")
    assert {"max_tokens", "stop", "tenant", "temperature", "logit_bias"} <= set(REQUEST_KEYS)
    every = {"temperature": 0.5, "top_k": 3, "top_p": 0.9, "min_p": 0.1, "seed": 7, "repeat_penalty": 1.1,
             "repeat_last_n": 32, "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"5": -1.0},
             "tenant": "t", "max_tokens": 5, "stop": ["x"], "spec_draft_max": 3}
    assert set(every) == set(REQUEST_KEYS)  # a key added to the table with scope "request" is a setting
    assert [k for k, _ in RequestSettings(every).values] == list(REQUEST_KEYS)  # the table's order


def test_settings_hold_checked_values_and_leave_none_to_the_session():
    s = RequestSettings({"stop": "###", "logit_bias": {"15": -100}, "max_tokens": None, "tenant": None})
    assert s.values == (("logit_bias", ((15, -100.0),)), ("stop", ("###",)))
    assert RequestSettings().values == () and RequestSettings({}) == RequestSettings()
    assert RequestSettings([("seed", 3)]) == RequestSettings({"seed": 3})


@pytest.mark.parametrize("changes", [
    {"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"min_p": 1.0}, {"top_k": 1.5},
    {"seed": -1}, {"max_tokens": 0}, {"max_tokens": True}, {"stop": [""]}, {"stop": ["x"] * 65},
    {"logit_bias": {"x": 1.0}}, {"logit_bias": {"5": float("inf")}}, {"tenant": 3}, {"repeat_last_n": -2},
])
def test_a_bad_value_is_the_error_a_configuration_with_it_raises(changes):
    with pytest.raises(ConfigError) as whole:
        PowerConfig.from_mapping(PowerConfig().to_dict(), **changes)
    with pytest.raises(ConfigError) as alone:
        RequestSettings(changes)
    assert (alone.value.key, str(alone.value)) == (whole.value.key, str(whole.value))


@pytest.mark.parametrize("key,value", [("n_ctx", 64), ("spec_adaptive", True), ("numerics", "stock")])
def test_a_key_that_is_not_a_requests_is_refused(key, value):
    with pytest.raises(ConfigError) as err:
        RequestSettings({key: value})
    assert err.value.key == key and "fixed when the" in str(err.value)
    with pytest.raises(ConfigError, match="did you mean 'temperature'"):
        RequestSettings({"temprature": 0.5})


@pytest.mark.parametrize("session", SESSIONS, ids=["default", "set"])
@pytest.mark.parametrize("changes", CHANGES, ids=range(len(CHANGES)))
def test_with_request_is_the_whole_rebuild(session, changes):
    """Key for key, type for type: the receipt's ``config`` and ``config_sha256`` cannot tell them apart."""
    whole = PowerConfig.from_mapping(session.to_dict(), **changes)
    got = session.with_request(RequestSettings(changes))
    assert got == whole
    assert got.to_dict() == whole.to_dict() and got.digest() == whole.digest()
    assert [type(v) for v in got.to_dict().values()] == [type(v) for v in whole.to_dict().values()]
    assert got.options == whole.options and got.draft_max == whole.draft_max


def test_with_request_keeps_the_session_config_when_nothing_differs():
    session = SESSIONS[1]
    assert session.with_request(RequestSettings()) is session
    assert session.with_request(RequestSettings({"max_tokens": 9, "stop": ["###"], "temperature": 0.5})) is session


def test_a_narrower_k_narrows_a_set_s_with_it():
    """Snapshots beyond K are never used: a request's narrower K takes a session's wider S down to it (its
    receipt says so), where a configuration with S > K is refused."""
    session = PowerConfig(spec_mode="ref-draft", spec_draft_max=6, spec_recurrent_snapshots=4)
    got = session.with_request(RequestSettings({"spec_draft_max": 2}))
    assert got == PowerConfig.from_mapping(session.to_dict(), spec_draft_max=2, spec_recurrent_snapshots=2)
    assert session.with_request(RequestSettings({"spec_draft_max": 5})).spec_recurrent_snapshots == 4
    with pytest.raises(ConfigError) as err:
        PowerConfig.from_mapping(session.to_dict(), spec_draft_max=2)
    assert err.value.key == "spec_recurrent_snapshots"


def test_with_request_runs_the_checks_across_keys(monkeypatch):
    """Each value was checked on its own (the session's by its construction, the settings' by theirs); what
    relates keys (``__attrs_post_init__``) runs on the result, so a check across keys that someday reads a
    request key holds for a request too."""
    seen: list[PowerConfig] = []
    monkeypatch.setattr(PowerConfig, "__attrs_post_init__", lambda self: seen.append(self))
    got = SESSIONS[0].with_request(RequestSettings({"max_tokens": 5}))
    assert seen == [got] and seen[0] is got


def test_a_requests_receipt_records_what_the_whole_rebuild_made():
    with open_session(MODEL, "ref-draft", max_tokens=6, spec_draft_max=3) as s:
        sampling = {"temperature": 0.7, "seed": 3, "top_k": 20, "logit_bias": {"7": -2}}
        receipt = s.start("hello", max_tokens=5, stop=["\x00never"], tenant="t", sampling=sampling).run().receipt
        whole = PowerConfig.from_mapping(s.config.to_dict(), max_tokens=5, stop=["\x00never"], tenant="t",
                                         **sampling)
        assert receipt.config == whole.to_dict() and receipt.config_sha256 == whole.digest()
        assert (receipt.config["max_tokens"], receipt.config["tenant"], receipt.config["logit_bias"]) == \
            (5, "t", ((7, -2.0),))
        plain = s.start("hello").run().receipt  # no settings: the session's configuration as it is
        assert plain.config == s.config.to_dict() and plain.config_sha256 == s.config.digest()


def test_session_start_errors_name_the_field():
    with open_session(MODEL, "off", max_tokens=6) as s:
        with pytest.raises(ConfigError) as err:
            s.start([1, 2, 3], sampling={"n_ctx": 64})
        assert err.value.key == "sampling.n_ctx" and "other keys are the session's" in str(err.value)
        for kw, key in ((dict(max_tokens=0), "max_tokens"), (dict(stop=[""]), "stop"), (dict(tenant=3), "tenant"),
                        (dict(sampling={"temperature": -1.0}), "temperature")):
            with pytest.raises(ConfigError) as err:
                s.start([1, 2, 3], **kw)
            assert err.value.key == key


def test_a_bad_value_equal_to_the_sessions_is_refused_too():
    """Every value a request gives is checked, not only one that differs from the session's: ``False``
    equals the session's seed 0 and ``True`` its top_k 1, but neither is an integer key's value."""
    with open_session(MODEL, "off", max_tokens=6, top_k=1) as s:
        for sampling in ({"seed": False}, {"top_k": True}):
            with pytest.raises(ConfigError) as err:
                s.start([1, 2, 3], sampling=sampling)
            assert err.value.key == next(iter(sampling))
