"""The prompt cache on llama.cpp (tiny synthetic attention and hybrid/recurrent GGUFs): a sequence's
whole state (``llama_state_seq_get_data_ext``) restored into another sequence gives the rows a
recomputed prefill gives, bit for bit, and every output equals ``spec_mode=off`` cold, warm, across
sequences, shared by 4 concurrent requests and after eviction."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

from power_native.target import open_target  # noqa: E402

from power_core import PowerConfig, PromptCache, Session  # noqa: E402

pytestmark = pytest.mark.native

RNG = np.random.default_rng(7)
SYSTEM = RNG.integers(1, 127, 48).astype(np.int32)


def _cfg(mode: str = "off", n: int = 12) -> PowerConfig:
    return PowerConfig(spec_mode=mode, max_tokens=n, n_ctx=256, n_threads=2)


def test_restored_rows_equal_recomputed_rows(tiny_model):
    """Sequence 0 prefills the prompt and saves its state; sequence 1 loads it and decodes the same
    block as a sequence that prefilled the prompt itself: identical rows (exact numerics), and a
    target of its own (another context) loads it too."""
    with Session.open_engine(2, _cfg(), model=str(tiny_model)) as engine:
        a, b = (s.opened.target for s in engine.sessions)
        caps = a.capabilities
        assert caps.saves_states and caps.state_format == b.capabilities.state_format
        assert caps.trims_prefix == (caps.rollback_window is None)
        block = RNG.integers(1, 127, 5).astype(np.int32)
        a.reset()
        a.prefill(SYSTEM)
        saved = caps.save_state()
        fresh = np.array(a.decode(block).logits)
        b.reset()
        b.prefill(SYSTEM[:7])  # something the load replaces
        assert b.capabilities.load_state(saved, len(SYSTEM)) and b.n_past == len(SYSTEM)
        restored = np.array(b.decode(block).logits)
        np.testing.assert_array_equal(restored, fresh)
        solo = open_target(tiny_model, n_ctx=256, max_block=8, snapshots=4, n_threads=2)
        try:
            if solo.capabilities.state_format == caps.state_format:
                assert solo.load_state(saved, len(SYSTEM))
                np.testing.assert_array_equal(np.array(solo.decode(block).logits), fresh)
            assert not solo.load_state(saved[: len(saved) // 2], len(SYSTEM))  # refused: empty, never half-loaded
            assert solo.n_past == 0 and solo.ctx.pos_max(0) == -1
        finally:
            solo.close()


@pytest.mark.parametrize("mode", ["off", "draft-model"])
def test_outputs_equal_off_cold_warm_across_sequences_and_after_eviction(tiny_model, mode):
    prompts = [np.concatenate([SYSTEM, RNG.integers(1, 127, 4).astype(np.int32)]) for _ in range(6)]
    with Session.open(_cfg("off"), model=str(tiny_model)) as off:
        want = [off.generate(p).tokens for p in prompts]
    draft = str(tiny_model) if mode == "draft-model" else None
    cache = PromptCache(1 << 26)
    with Session.open_engine(2, _cfg(mode), model=str(tiny_model), draft=draft, prompt_cache=cache) as engine:
        cold = engine.run(engine.submit(prompts[0]))
        assert cold.tokens == want[0] and cold.receipt.prompt_reused == 0
        # a continuation: on the same sequence, in place
        follow = np.concatenate([prompts[0], cold.tokens, [3, 4]]).astype(np.int32)
        res = engine.run(engine.submit(follow))
        with Session.open(_cfg("off"), model=str(tiny_model)) as off:
            assert res.tokens == off.generate(follow).tokens
        assert res.receipt.prompt_reused == len(prompts[0]) + len(cold.tokens) - 1
        # 4 concurrent requests sharing the system prompt, restored into whichever sequence
        out: list = [None] * 4

        def go(i: int) -> None:
            out[i] = engine.run(engine.submit(prompts[1 + i]))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for i, r in enumerate(out):
            assert r.tokens == want[1 + i], i
        trims = engine.sessions[0].opened.target.capabilities.trims_prefix
        if trims:  # attention KV trims back to the system prompt; recurrent state only extends
            assert sum(r.receipt.prompt_reused >= len(SYSTEM) for r in out) >= 3
            assert cache.stats().restores >= 1
        cache.resize(cache.bytes)  # nothing more fits without evicting
        for p, w in zip(prompts[4:], want[4:], strict=True):
            assert engine.run(engine.submit(p)).tokens == w
        assert cache.bytes <= cache.budget_bytes


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("model", [None, "gemma3-270m"])
def test_three_chats_on_two_slots_equal_cold_off_runs(model):
    """SmolLM2 and Gemma-3 (sliding-window layers): three conversations, each turn resending the
    whole history, interleaved on two sequences, so turns land where another chat left its state and
    restore their own from the cache: every answer equals a cold off run and later turns reuse at
    least 90 % of the history; then, with the cache cut to half of what it holds (evictions), still."""
    cfg = PowerConfig(spec_mode="suffix", max_tokens=24, n_threads=2, n_ctx=1024)
    off_cfg = PowerConfig(spec_mode="off", max_tokens=24, n_threads=2, n_ctx=1024)
    chats = [["The capital of France is", " It is known for", " Its river is", " And its museum"],
             ["def add(a, b):\n    return", "\n\ndef sub(a, b):\n    return", "\n\nprint(add(1, 2),", "\n# done"],
             ["Once upon a time", " The dragon said", " Then the knight", " The end:"]]
    cache = PromptCache(1 << 30)
    with Session.open_engine(2, cfg, model=model, prompt_cache=cache) as engine, \
            Session.open(off_cfg, model=model) as off:
        tok = off.opened.tokenizer
        history = [np.zeros(0, dtype=np.int32) for _ in chats]
        for turn in range(4):
            if turn == 3:
                cache.resize(cache.bytes // 2)  # the oldest states go
            for c, chat in enumerate(chats):
                text = (off.encode(chat[turn]) if turn == 0 else  # no BOS inside the conversation
                        np.asarray(tok.model.tokenize(chat[turn], add_special=False, parse_special=False)))
                prompt = np.concatenate([history[c], text]).astype(np.int32)
                res = engine.run(engine.submit(prompt, tenant=f"chat{c}"))
                assert res.tokens == off.generate(prompt).tokens, (model, turn, c)
                if 0 < turn < 3:
                    assert res.receipt.prompt_reused >= 0.9 * len(history[c]), (turn, c, res.receipt.prompt_reused)
                history[c] = np.concatenate([prompt, res.tokens]).astype(np.int32)
        assert cache.stats().restores >= 2 and cache.bytes <= cache.budget_bytes
