"""Prompt reuse (config ``cache_prompt``): a request whose prompt extends or shares a prefix with what
the session's previous request left in the target's memory prefills only the rest, and its output
equals a fresh session's."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import open_session

ATTN = "reference:seed=5,vocab=97,dim=16,recurrent=0"
RECURRENT = "reference:seed=5,vocab=97,dim=16,recurrent=1"


def _fresh(model: str, mode: str, prompt: list[int], **cfg) -> tuple[int, ...]:
    with open_session(model, mode, n_ctx=512, **cfg) as s:
        return s.generate(prompt).tokens


@pytest.mark.parametrize("mode", ["off", "ref-draft"])
@pytest.mark.parametrize("model", [ATTN, RECURRENT])
def test_three_turns_reuse_the_conversation_and_equal_fresh_sessions(model, mode):
    """Each turn's prompt is the previous prompt + its answer + a new message (a chat)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 96, 40).tolist()
    previous = 0
    with open_session(model, mode, n_ctx=512, max_tokens=24, cache_prompt=True) as s:
        for turn in range(3):
            res = s.generate(prompt)
            assert res.tokens == _fresh(model, mode, prompt, max_tokens=24), f"turn {turn}"
            if turn == 0:
                assert res.receipt.prompt_reused == 0
            else:
                # everything the target held: the previous prompt and answer, but its last token (the anchor)
                assert res.receipt.prompt_reused == previous - 1
                assert res.receipt.prompt_reused / len(prompt) >= 0.9
            previous = len(prompt) + len(res.tokens)
            prompt = prompt + list(res.tokens) + rng.integers(1, 96, 4).tolist()


def test_a_shared_prefix_trims_attention_memory_and_recurrent_memory_starts_over():
    rng = np.random.default_rng(1)
    system = rng.integers(1, 96, 30).tolist()
    a, b = system + [5, 6, 7], system + [9, 9]
    with open_session(ATTN, "off", n_ctx=512, max_tokens=8, cache_prompt=True) as s:
        s.generate(a)
        res = s.generate(b)
    assert res.receipt.prompt_reused == len(system) and res.tokens == _fresh(ATTN, "off", b, max_tokens=8)
    with open_session(RECURRENT, "off", n_ctx=512, max_tokens=8, cache_prompt=True) as s:
        s.generate(a)
        res = s.generate(b)  # a recurrent state cannot be trimmed back to the shared prefix
    assert res.receipt.prompt_reused == 0 and res.tokens == _fresh(RECURRENT, "off", b, max_tokens=8)


def test_off_by_default_and_an_identical_prompt_keeps_all_but_its_last_token():
    rng = np.random.default_rng(2)
    p = rng.integers(1, 96, 30).tolist()
    with open_session(ATTN, "off", n_ctx=512, max_tokens=8) as s:
        first = s.generate(p)
        again = s.generate(p + list(first.tokens))
    assert again.receipt.prompt_reused == 0
    with open_session(ATTN, "off", n_ctx=512, max_tokens=8, cache_prompt=True) as s:
        first = s.generate(p)
        # the previous request left p + first.tokens[:-1]; an identical prompt keeps all but its last token
        res = s.generate(p)
    assert res.receipt.prompt_reused == len(p) - 1 and res.tokens == first.tokens


def test_a_failed_prefill_resumes_from_empty_memory():
    from power_core.errors import RuntimeFault

    rng = np.random.default_rng(3)
    p = rng.integers(1, 96, 30).tolist()
    q = p + rng.integers(1, 96, 20).tolist()
    with open_session(ATTN, "off", n_ctx=512, max_tokens=8, cache_prompt=True) as s:
        s.generate(p)
        target = s.opened.target
        target.fail_on = target.decode_calls + 1  # the reused prefill's decode fails
        gen = s.start(q)
        with pytest.raises(RuntimeFault):
            gen.run()
        res = gen.run()  # the memory is half-filled: the retry must not trust the old contents
    assert res.receipt.prompt_reused == 0 and res.tokens == _fresh(ATTN, "off", q, max_tokens=8)
