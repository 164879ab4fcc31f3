"""The prompt cache across requests (:class:`power_core.PromptCache`): saved target states restored
into any sequence, LRU by bytes, scoped per tenant; outputs equal cold runs of ``spec_mode=off``."""

from __future__ import annotations

import functools
import threading

import numpy as np
import pytest
from helpers import core_plugins, open_session
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from power_core import PromptCache
from power_core.config import PowerConfig
from power_core.errors import ConfigError
from power_core.memory import reusable_prefix
from power_core.reference.model import ReferenceTarget
from power_core.session import Session

ATTN = "reference:seed=5,vocab=97,dim=16,recurrent=0"
RECURRENT = "reference:seed=5,vocab=97,dim=16,recurrent=1"
CTX = 256


@functools.cache
def _cold(model: str, prompt: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    """What ``spec_mode=off`` emits for ``prompt`` in a fresh session (no reuse)."""
    with open_session(model, "off", n_ctx=CTX, max_tokens=max_tokens) as s:
        return s.generate(list(prompt)).tokens


def _session(model: str, mode: str = "off", *, prompt_cache: object = None, **cfg) -> Session:
    return Session.open(PowerConfig(spec_mode=mode, n_ctx=CTX, **cfg), model=model, plugins=core_plugins(),
                        prompt_cache=prompt_cache)  # type: ignore[arg-type]


def _engine(model: str, n: int, cache: PromptCache | None, mode: str = "off", **cfg):
    return Session.open_engine(n, PowerConfig(spec_mode=mode, n_ctx=CTX, **cfg), model=model,
                               plugins=core_plugins(), prompt_cache=cache)


def _ids(a) -> np.ndarray:
    return np.asarray(a, dtype=np.int32)


# -- the store ------------------------------------------------------------------------------------------
def test_reusable_prefix_keeps_the_prompt_s_last_token_out_and_recurrent_memory_all_or_nothing():
    held = _ids([1, 2, 3, 4])
    assert reusable_prefix(held, _ids([1, 2, 3, 4, 5]), trims=False) == 4
    assert reusable_prefix(held, _ids([1, 2, 3, 4]), trims=True) == 3  # its last token is decoded for its row
    assert reusable_prefix(held, _ids([1, 2, 3, 4]), trims=False) == 0
    assert reusable_prefix(held, _ids([1, 2, 9, 9, 9]), trims=True) == 2
    assert reusable_prefix(held, _ids([1, 2, 9, 9, 9]), trims=False) == 0
    assert reusable_prefix(held, _ids([7]), trims=True) == 0


def test_the_store_is_lru_by_bytes_per_tenant_and_format():
    cache = PromptCache(1000)
    data = bytes(200)
    assert cache.put(_ids([1, 2, 3]), data, state_format="f", tenant="a", trims=True)
    assert cache.put(_ids([5, 6, 7]), data, state_format="f", tenant="a", trims=True)
    assert cache.put(_ids([1, 2, 3, 4]), data, state_format="f", tenant="a", trims=True)  # supersedes [1, 2, 3]
    assert len(cache) == 2
    found = cache.lookup(_ids([1, 2, 3, 4, 8]), state_format="f", tenant="a", trims=True, n_ctx=CTX)
    assert found is not None and found[1] == 4
    assert cache.lookup(_ids([1, 2, 3, 4, 8]), state_format="f", tenant="b", trims=True, n_ctx=CTX) is None
    assert cache.lookup(_ids([1, 2, 3, 4, 8]), state_format="g", tenant="a", trims=True, n_ctx=CTX) is None
    assert cache.lookup(_ids([1, 2, 3, 4, 8]), state_format="f", tenant="a", trims=True, n_ctx=3) is None
    cache.restored(found[0], 4)  # now the most recently used: [5, 6, 7] is evicted first
    for i in range(3):
        assert cache.put(_ids([20 + i, 1]), data, state_format="f", tenant="b", trims=True)
        assert cache.bytes <= cache.budget_bytes
    assert cache.lookup(_ids([5, 6, 7, 8]), state_format="f", tenant="a", trims=True, n_ctx=CTX) is None
    assert cache.lookup(_ids([1, 2, 3, 4, 8]), state_format="f", tenant="a", trims=True, n_ctx=CTX) is not None
    st_ = cache.stats()
    assert st_.evictions == 1 and st_.entries == 4 and st_.bytes == cache.bytes <= 1000 and st_.restores == 1
    assert not cache.put(_ids([1]), bytes(2000), state_format="f", tenant="a", trims=True)  # alone over budget
    assert len(cache) == 4
    cache.resize(500)  # the least recently used go at once
    assert cache.bytes <= 500 and len(cache) == 2 and cache.stats().evictions == 3
    assert cache.lookup(_ids([1, 2, 3, 4, 8]), state_format="f", tenant="a", trims=True, n_ctx=CTX) is None
    with pytest.raises(ConfigError):
        cache.resize(-1)
    shared = PromptCache(1000, share_tenants=True)
    shared.put(_ids([1, 2, 3]), data, state_format="f", tenant="a", trims=True)
    assert shared.lookup(_ids([1, 2, 3, 4]), state_format="f", tenant="b", trims=True, n_ctx=CTX) is not None
    # recurrent memory cannot be cut back: a longer state neither covers nor supersedes a prefix
    rec = PromptCache(1000)
    rec.put(_ids([1, 2]), data, state_format="f", tenant="a", trims=False)
    rec.put(_ids([1, 2, 3]), data, state_format="f", tenant="a", trims=False)
    assert len(rec) == 2 and not rec.covers(_ids([1]), state_format="f", tenant="a", trims=False)
    assert rec.covers(_ids([1, 2]), state_format="f", tenant="a", trims=False)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_a_bad_budget_is_a_config_error(bad):
    with pytest.raises(ConfigError):
        PromptCache(bad)
    with pytest.raises(ConfigError):
        PromptCache.of_mib(bad)
    assert PromptCache.of_mib(0) is None


def test_a_prompt_cache_turns_cache_prompt_on_and_refuses_it_off():
    with _session(ATTN, prompt_cache=PromptCache(1 << 20)) as s:
        assert s.config.cache_prompt and s.reuses_prompts
    with pytest.raises(ConfigError) as info:
        Session.open(model=ATTN, plugins=core_plugins(), prompt_cache=PromptCache(1 << 20), cache_prompt=False)
    assert info.value.key == "cache_prompt"
    with pytest.raises(ConfigError):
        _session(ATTN, prompt_cache=object())


# -- restoring into any sequence ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["off", "ref-draft"])
@pytest.mark.parametrize("model", [ATTN, RECURRENT])
def test_a_state_saved_by_one_session_is_restored_by_another(model, mode):
    """Session 1 answers a prompt and closes (its state goes into the shared cache); session 2's
    next turn restores it: the conversation so far is not prefilled again, and the answer equals a
    cold run's."""
    rng = np.random.default_rng(0)
    cache = PromptCache(1 << 22)
    p = rng.integers(1, 96, 40).tolist()
    with _session(model, mode, max_tokens=12, prompt_cache=cache) as s:
        first = s.generate(p)
    assert first.tokens == _cold(model, tuple(p), 12) and first.receipt.prompt_reused == 0
    assert len(cache) == 1 and cache.stats().restores == 0
    q = p + list(first.tokens) + rng.integers(1, 96, 5).tolist()
    with _session(model, mode, max_tokens=12, prompt_cache=cache) as s:
        second = s.generate(q)
    assert second.tokens == _cold(model, tuple(q), 12)
    assert second.receipt.prompt_reused == len(p) + len(first.tokens) - 1
    assert cache.stats().restores == 1


@pytest.mark.parametrize("model", [ATTN, RECURRENT])
def test_the_engine_restores_into_another_sequence_and_admits_to_the_one_holding_the_prompt(model):
    rng = np.random.default_rng(1)
    cache = PromptCache(1 << 22)
    a, b, c = (rng.integers(1, 96, 30).tolist() for _ in range(3))
    with _engine(model, 2, cache, max_tokens=8) as engine:
        ra = engine.run(engine.submit(a))  # sequence 0
        rb = engine.run(engine.submit(b))  # the other one: sequence 0 holds a's state, sequence 1 nothing
        assert ra.receipt.backend["seq_id"] != rb.receipt.backend["seq_id"]
        # b's continuation goes to b's sequence, where it continues in place (nothing saved, nothing restored)
        b2 = b + list(rb.tokens) + [3, 4]
        rb2 = engine.run(engine.submit(b2))
        assert rb2.receipt.backend["seq_id"] == rb.receipt.backend["seq_id"]
        assert rb2.receipt.prompt_reused == len(b) + len(rb.tokens) - 1
        assert cache.stats().saves == 0
        rc = engine.run(engine.submit(c))  # lands on a's sequence (freed longest ago): a's state is saved
        assert rc.receipt.backend["seq_id"] == ra.receipt.backend["seq_id"] and cache.stats().saves == 1
        a2 = a + list(ra.tokens) + [5, 6]
        ra2 = engine.run(engine.submit(a2))  # no sequence holds a now: b2's (freed longest ago) restores it
        assert ra2.receipt.backend["seq_id"] == rb.receipt.backend["seq_id"]
        assert ra2.receipt.prompt_reused == len(a) + len(ra.tokens) - 1 and cache.stats().restores == 1
    for prompt, res in ((a, ra), (b, rb), (b2, rb2), (c, rc), (a2, ra2)):
        assert res.tokens == _cold(model, tuple(prompt), 8)


def test_four_concurrent_requests_share_the_warm_cache_and_equal_cold_runs():
    rng = np.random.default_rng(2)
    cache = PromptCache(1 << 22)
    system = rng.integers(1, 96, 40).tolist()
    prompts = [system + rng.integers(1, 96, 6).tolist() for _ in range(8)]
    with _engine(ATTN, 4, cache, mode="ref-draft", max_tokens=10) as engine:
        engine.run(engine.submit(system + [1]))  # warm: the system prompt's state
        results: dict[int, object] = {}

        def one(i: int) -> None:
            results[i] = engine.run(engine.submit(prompts[i]))

        for start in (0, 4):
            threads = [threading.Thread(target=one, args=(i,)) for i in range(start, start + 4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    for i, p in enumerate(prompts):
        assert results[i].tokens == _cold(ATTN, tuple(p), 10), i
        assert results[i].receipt.prompt_reused >= len(system) or i == 0, (i, results[i].receipt.prompt_reused)
    assert sum(r.receipt.prompt_reused >= len(system) for r in results.values()) >= 7


# -- tenants ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("share", [False, True])
def test_a_tenant_never_restores_another_tenant_s_state_unless_sharing_is_on(share):
    rng = np.random.default_rng(3)
    cache = PromptCache(1 << 22, share_tenants=share)
    p = rng.integers(1, 96, 30).tolist()
    q = p + [7, 8, 9]
    with _engine(ATTN, 2, cache, max_tokens=6) as engine:
        first = engine.run(engine.submit(p, tenant="alice"))
        other = engine.run(engine.submit(q, tenant="bob"))
        # bob's prompt extends alice's: he lands on a sequence and may not reuse her state
        assert (other.receipt.prompt_reused > 0) == share
        assert other.receipt.config["tenant"] == "bob"
        engine.run(engine.submit(rng.integers(1, 96, 30).tolist(), tenant="carol"))  # pushes states into the cache
        engine.run(engine.submit(rng.integers(1, 96, 30).tolist(), tenant="carol"))
        before = cache.stats().restores
        again = engine.run(engine.submit(q, tenant="dave"))
        assert (again.receipt.prompt_reused > 0) == share
        assert (cache.stats().restores > before) == share
        mine = engine.run(engine.submit(q, tenant="alice"))
        assert mine.receipt.prompt_reused >= len(p) - 1 if not share else mine.receipt.prompt_reused > 0
    for res, prompt in ((first, p), (other, q), (again, q), (mine, q)):
        assert res.tokens == _cold(ATTN, tuple(prompt), 6)


# -- faults -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["refuses", "raises"])
def test_a_failed_restore_leaves_the_sequence_empty_and_the_request_prefills_from_scratch(how, monkeypatch):
    rng = np.random.default_rng(4)
    cache = PromptCache(1 << 22)
    p = rng.integers(1, 96, 30).tolist()
    q = p + [5, 6, 7]
    with _session(ATTN, max_tokens=6, prompt_cache=cache) as s:
        s.generate(p)
    with _session(ATTN, max_tokens=6, prompt_cache=cache) as s:
        target = s.opened.target
        s.generate(rng.integers(1, 96, 20).tolist())  # the target holds something the restore must not leave behind
        real = ReferenceTarget.load_state

        def load(self: ReferenceTarget, data: bytes, n: int) -> bool:
            real(self, data, n)  # half-way: the memory holds the state, then the load "fails"
            self._n_past = n - 3
            if how == "raises":
                raise RuntimeError("injected")
            return False

        monkeypatch.setattr(ReferenceTarget, "load_state", load)
        res = s.generate(q)
        assert res.receipt.status == "completed" and res.receipt.prompt_reused == 0
        assert res.tokens == _cold(ATTN, tuple(q), 6)
        assert cache.stats().failed_restores == 1
        assert cache.lookup(_ids(q), state_format=target.state_format, tenant="", trims=True, n_ctx=CTX) is None


# -- exactness, as a property ---------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), model=st.sampled_from([ATTN, RECURRENT]), mode=st.sampled_from(["off", "ref-draft"]),
       budget=st.sampled_from([4_000, 20_000, 1 << 22]), n=st.sampled_from([1, 2]))
def test_every_output_equals_a_cold_off_run_whatever_the_cache_holds(data, model, mode, budget, n):
    """Requests drawn from a few conversations (prefixes shared, histories resent), on 1 or 2
    sequences, with a cache small enough to evict: each output equals the cold off run's, and the
    cache never holds more than its budget."""
    cache = PromptCache(budget)
    roots = [list(range(1 + 10 * i, 11 + 10 * i)) for i in range(3)]
    with _engine(model, n, cache, mode=mode, max_tokens=5) as engine:
        for _ in range(data.draw(st.integers(2, 6))):
            root = roots[data.draw(st.integers(0, 2))]
            tail = data.draw(st.lists(st.integers(1, 96), min_size=1, max_size=6))
            prompt = root + tail
            res = engine.run(engine.submit(prompt))
            assert res.tokens == _cold(model, tuple(prompt), 5)
            assert cache.bytes <= budget
            roots.append(prompt + list(res.tokens))  # the conversation goes on


# -- bounded memory -------------------------------------------------------------------------------------------
def test_a_thousand_requests_never_take_the_cache_over_its_budget():
    """1,000 small requests, each a new prompt or a continuation: the cache evicts and stays within
    its budget after every request (RSS flatness under load is a bench item)."""
    rng = np.random.default_rng(5)
    budget = 40_000  # a few dozen tiny states
    cache = PromptCache(budget)
    model = "reference:seed=5,vocab=97,dim=8,recurrent=0"
    history: list[list[int]] = []
    peak = 0
    with _engine(model, 2, cache, max_tokens=2) as engine:
        for i in range(1000):
            if history and rng.random() < 0.5:
                prompt = history[int(rng.integers(len(history)))] + rng.integers(1, 96, 2).tolist()
            else:
                prompt = rng.integers(1, 96, 8).tolist()
            res = engine.run(engine.submit(prompt))
            history = (history + [prompt + list(res.tokens)])[-50:]
            peak = max(peak, cache.bytes)
            assert cache.bytes <= budget, i
    st_ = cache.stats()
    assert st_.evictions > 0 and st_.restores > 0 and peak <= budget
