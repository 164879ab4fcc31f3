"""Embedding on a real model (SmolLM2-135M-Instruct): streaming parity with multibyte text, the chat
template, stop strings that straddle tokens, threads, and a silent embedded request."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

from test_models import _model_path  # noqa: E402

from power_core.chat import ChatTemplate  # noqa: E402
from power_core.config import PowerConfig  # noqa: E402
from power_core.errors import ConfigError, SessionBusy  # noqa: E402
from power_core.session import Session  # noqa: E402

pytestmark = [pytest.mark.native, pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# outputs with characters split across tokens (hiragana, emoji), and plain ASCII
CHATS = ["Write 'thank you' in Japanese hiragana:", "Three emoji for the ocean:"]


def _same_receipt(a, b) -> bool:
    """Equal but for timings and the backend's running rollback counters (they span the session)."""
    da, db = a._body(False), b._body(False)
    for d in (da, db):
        d["backend"].pop("rollback", None)
    return da == db


@pytest.fixture(scope="module")
def smollm2() -> str:
    return _model_path("smollm2")


@pytest.fixture(scope="module")
def session(smollm2):
    with Session.open(PowerConfig(spec_mode="off", max_tokens=10, n_threads=2, n_ctx=512), model=smollm2) as s:
        yield s


def test_stream_equals_generate_with_multibyte_text(session):
    tok = session.opened.tokenizer
    split_chars = 0
    for content in CHATS:
        prompt = session.chat_prompt([{"role": "user", "content": content}])
        ref = session.generate(prompt)
        stream = session.stream(prompt)
        deltas = list(stream)
        assert "".join(deltas) == ref.text == tok.decode(np.asarray(ref.tokens, dtype=np.int32))
        assert _same_receipt(stream.receipt, ref.receipt)
        # a character split across tokens is never streamed in halves (only the final flush of a
        # request cut off by max_tokens may end inside one, exactly as the generated text does)
        assert all("\ufffd" not in d for d in deltas[:-1])
        split_chars += sum("\ufffd" in tok.decode(np.asarray([t], dtype=np.int32)) for t in ref.tokens)
    assert split_chars > 0, "no output split a character across tokens: the multibyte path went untested"


def test_chat_answers_the_poem_prompt(session):
    msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
    prompt = session.chat_prompt(msgs)
    assert prompt[0] == 1 and list(prompt).count(1) == 3  # <|im_start|> parsed as the special token, once per turn
    res = session.chat(msgs, max_tokens=16)
    assert len(res.tokens) == 16 and res.receipt.finish_reason == "max_tokens", res.text  # no early end of turn
    bare = session.generate("Write a short poem about the sea.", max_tokens=16)
    assert len(bare.tokens) < 16  # without the template the Instruct model ends its turn at once


@pytest.mark.parametrize("mode", ["off", "suffix"])
def test_stop_string_straddling_tokens_ends_output_exactly(smollm2, mode):
    cfg = PowerConfig(spec_mode=mode, max_tokens=20, n_threads=2, n_ctx=512)
    with Session.open(cfg, model=smollm2) as s:
        tok = s.opened.tokenizer
        prompt = "Once upon a time, in a small village by the sea, there lived"
        full = s.generate(prompt)
        texts = [tok.decode(np.asarray(full.tokens[:n], dtype=np.int32)) for n in range(len(full.tokens) + 1)]
        for j in range(4, len(full.tokens) - 1):  # a stop string across the boundary after token j
            b = len(texts[j])
            stop = full.text[b - 2:b + 1]
            cut = full.text.index(stop)
            need = next(n for n in range(len(texts)) if stop in texts[n])
            if len(stop) == 3 and stop.strip() and len(texts[need - 1]) > cut:  # it straddles two tokens
                break
        else:
            pytest.fail(f"no stop string straddles a token boundary in {full.text!r}")
        res = s.generate(prompt, stop=[stop])
        assert res.text == full.text[:cut] and res.receipt.finish_reason == "stop"
        assert res.tokens == full.tokens[:need]
        assert "".join(s.stream(prompt, stop=[stop])) == res.text


def test_one_session_two_threads_200_attempts(session):
    prompt = session.encode("Hello")
    expected = session.generate(prompt, max_tokens=1).tokens
    outcomes: list[object] = []
    lock = threading.Lock()
    barrier = threading.Barrier(2)

    def worker():
        barrier.wait()
        for _ in range(100):
            try:
                got: object = session.generate(prompt, max_tokens=1).tokens
            except SessionBusy:
                got = "busy"
            except BaseException as exc:  # noqa: BLE001 - any other error fails the test
                got = exc
            with lock:
                outcomes.append(got)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 200
    assert all(o in ("busy", expected) for o in outcomes), [o for o in outcomes if o not in ("busy", expected)][:3]
    assert outcomes.count(expected) > 0 and outcomes.count("busy") > 0


def test_sessions_on_separate_threads_equal_single_threaded(smollm2):
    cfg = PowerConfig(spec_mode="off", max_tokens=8, n_threads=1, n_ctx=256)
    prompts = ["The capital of France is", "Once upon a time"]
    with Session.open(cfg, model=smollm2) as s:
        single = [s.generate(p).tokens for p in prompts]
    results: list[object] = [None, None]

    def worker(i):
        with Session.open(cfg, model=smollm2) as s:
            results[i] = s.generate(prompts[i]).tokens

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == single


def test_a_model_without_a_chat_template_names_itself():
    with pytest.raises(ConfigError, match=r"Gemma.*no chat template: pass a plain prompt"):
        ChatTemplate.from_gguf(_model_path("gemma3-270m"))


def test_a_custom_chat_template_renders_the_models_bos_and_eos(session, smollm2):
    own = ChatTemplate.from_gguf(smollm2)
    assert own.bos_token and own.eos_token  # SmolLM2's vocabulary names both
    source = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}"
    ids = session.chat_prompt([{"role": "user", "content": "hi"}], chat_template=source)
    tok = session.opened.tokenizer
    expected = own.dedupe_bos(list(tok.encode(own.prompt_text(f"{own.bos_token}hi{own.eos_token}"))))
    assert ids.tolist() == [int(t) for t in expected]
    eos = tok.model.tokenize(own.eos_token, add_special=False, parse_special=True)
    assert len(eos) == 1 and ids[-1] == eos[0]  # the template's {{ eos_token }} is the model's EOS token


EMBED = r"""
from power_core import PowerConfig, Session
with Session.open(PowerConfig(spec_mode="off", max_tokens=4, n_threads=2, n_ctx=256), model={model!r}) as s:
    s.generate("Hello")
    "".join(s.chat_stream([{{"role": "user", "content": "Hi"}}]))
"""


def test_embedded_request_on_smollm2_prints_nothing(smollm2, tmp_path):
    import power_native.target as target

    if "power_core.logs" not in Path(target.__file__).read_text():
        pytest.skip("the installed power-native predates stdlib logging (reinstall ./native)")
    proc = subprocess.run([sys.executable, "-c", EMBED.format(model=smollm2)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


@pytest.mark.parametrize("mode", ["off", "suffix"])
def test_three_turn_chat_reuses_the_conversation(smollm2, mode):
    """cache_prompt: each later turn's prompt (system prompt, previous turns and answers, a new
    message) prefills only what the target does not already hold (>= 90% reused), and every answer
    equals a fresh session's."""
    questions = ["Name a planet.", "Why is it called that?", "Say it again in one word."]
    cfg = dict(spec_mode=mode, max_tokens=48, n_threads=2, n_ctx=2048)
    system = ("You are a patient astronomy tutor for a class of curious ten-year-olds. Answer in plain words, "
              "in one or two short sentences, and never use jargon without explaining it. The class has just "
              "visited a planetarium, seen the eight planets of the solar system projected on the dome, and "
              "learned that some planets are rocky while others are giants made mostly of gas. They like "
              "names, stories and simple comparisons with things they know from everyday life. When a child "
              "asks why something is so, give the real reason first and then one picture they can imagine, such "
              "as a ball, a kitchen or a playground. If a question is unclear, answer the most likely meaning "
              "instead of asking back, and keep every answer short enough to read aloud in one breath.")
    messages: list[dict] = [{"role": "system", "content": system}]
    held = 0  # tokens the target holds after the previous turn
    with Session.open(PowerConfig(cache_prompt=True, **cfg), model=smollm2) as s:
        for turn, q in enumerate(questions):
            messages.append({"role": "user", "content": q})
            prompt = s.chat_prompt(messages)
            res = s.generate(prompt)
            with Session.open(PowerConfig(**cfg), model=smollm2) as fresh:
                want = fresh.generate(prompt)
            assert res.tokens == want.tokens, f"turn {turn}"
            if turn:  # everything the target held is reused: the conversation so far but the last answer's end
                assert res.receipt.prompt_reused == held, (turn, res.receipt.prompt_reused, held)
                assert res.receipt.prompt_reused >= 0.9 * res.receipt.prompt_tokens, (turn, res.receipt.prompt_reused,
                                                                                      res.receipt.prompt_tokens)
            held = res.receipt.prompt_tokens + len(res.tokens) - 1
            messages.append({"role": "assistant", "content": res.text})


def test_a_cancel_left_pending_does_not_cancel_the_next_reusing_request(smollm2):
    """A cancel that lands between decodes stops its request before llama.cpp consumed the abort
    flag; the next request, reusing the prompt (no reset), must not inherit it."""
    from power_core.errors import Cancelled
    from power_core.transaction import CancelToken

    cfg = PowerConfig(spec_mode="off", max_tokens=16, n_threads=2, n_ctx=512, cache_prompt=True)
    with Session.open(cfg, model=smollm2) as s:
        token = CancelToken()
        gen = s.start("The capital of France is", cancel=token)
        rounds = gen.rounds()
        next(rounds)
        token.cancel()  # between decodes: the transaction stops at its next check
        with pytest.raises(Cancelled):
            next(rounds)
        res = s.generate("The capital of France is Paris.")
        assert res.receipt.status == "completed" and res.receipt.prompt_reused > 0


def test_what_power_asks_for_is_not_a_warning(caplog):
    """Gemma-3 has sliding-window layers: Power asks llama.cpp for a full-size SWA cache (so a verify
    pass can roll back), and llama.cpp's warning about it is logged as information, not a warning."""
    import logging

    from power_native import _llama

    _llama.set_log_level("info")  # forward llama.cpp's info lines too, so the message is seen at its new level
    try:
        with caplog.at_level(logging.INFO, logger="power_native"):
            with Session.open(PowerConfig(spec_mode="off", max_tokens=2), model=_model_path("gemma3-270m")) as s:
                s.generate("Hi")
    finally:
        _llama.set_log_level("warning")
    swa = [r for r in caplog.records if "full-size SWA cache" in r.getMessage()]
    assert swa and all(r.levelno == logging.INFO for r in swa), [(r.levelname, r.getMessage()) for r in swa]
