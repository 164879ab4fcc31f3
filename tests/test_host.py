"""Embedding Power in a host: streaming, stop strings, chat templates, one request per session, quiet logs.

All on the reference backend (byte tokenizer: every multibyte character straddles tokens, and its
random outputs are full of incomplete and invalid UTF-8)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import core_plugins, open_session

from power_core.chat import ChatTemplate
from power_core.errors import Cancelled, ConfigError, SessionBusy, StateLost
from power_core.plugins import hookimpl
from power_core.text import TextAssembler
from power_core.transaction import CancelToken

ROOT = Path(__file__).resolve().parents[1]
MODEL = "reference:seed=2,vocab=288,dim=16,eos=256"


def _bytes_decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", "replace")


# -- text assembly ---------------------------------------------------------------------------------
def test_utf8_characters_split_across_tokens_are_held_back_until_complete():
    text = "a é € 😀 ok"
    asm = TextAssembler(_bytes_decode)
    ids = list(text.encode())
    deltas = []
    for n in range(1, len(ids) + 1):
        asm.sync(ids[:n])
        deltas.append(asm.take(final=n == len(ids)))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # the 4-byte emoji appears in one piece, on its last byte
    assert deltas[ids.index(0xF0) + 3] == "😀" and deltas[ids.index(0xF0)] == ""


def test_stop_string_across_tokens_keeps_exactly_the_completing_token():
    asm = TextAssembler(_bytes_decode, stops=("END",))
    committed = list(b"abcE")
    assert asm.find_stop(committed, list(b"N")) is None
    assert asm.find_stop(committed, list(b"NDxyz")) == 2  # "N", "D": D completes the stop
    asm.sync(committed + list(b"ND"))
    assert asm.text() == "abc"
    # a stream holds back every prefix of a stop string until it is resolved
    s = TextAssembler(_bytes_decode, stops=("END",))
    s.sync(list(b"abcE"))
    assert s.take(False) == "abc"
    s.sync(list(b"abcEN"))
    assert s.take(False) == ""
    s.sync(list(b"abcENx"))
    assert s.take(False) == "ENx"


# -- streaming -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,seed", [("off", 2), ("ref-draft", 2), ("off", 5), ("ref-draft", 7)])
def test_stream_deltas_concatenate_to_the_generated_text_and_the_receipt_is_identical(mode, seed):
    model = f"reference:seed={seed},vocab=288,dim=16,eos=256"
    with open_session(model, mode, max_tokens=60) as s:
        for prompt in ("hello", "crème brûlée → 東京 😀", "abc abc abc"):
            ref = s.generate(prompt)
            stream = s.stream(prompt)
            deltas = list(stream)
            assert "".join(deltas) == ref.text == s.opened.tokenizer.decode(np.asarray(ref.tokens))
            assert stream.result is not None and stream.result.tokens == ref.tokens
            assert stream.receipt.digest() == ref.receipt.digest()  # everything but timings
            assert len(deltas) > 3  # it streamed: one delta per committed round, not one at the end
            # no delta ever splits a character the final text has whole
            assert all(not d.endswith("\ufffd") or "\ufffd" in ref.text for d in deltas)


def test_stream_yields_only_committed_text():
    seen: list[tuple[int, str]] = []
    with open_session(MODEL, "ref-draft", max_tokens=40) as s:
        gen = s.start("hello")
        stream = gen.stream()
        for delta in stream:
            committed = s.opened.tokenizer.decode(np.asarray(gen.tokens))
            seen.append((len(gen.tokens), delta))
            assert committed.startswith(stream.text)
    assert sum(len(d) for _, d in seen) == len(stream.result.text)


# -- stop strings ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["off", "ref-draft"])
@pytest.mark.parametrize("at", [5, 17, 30])
def test_stop_string_ends_output_exactly_before_it(mode, at):
    with open_session(MODEL, mode, max_tokens=60, spec_draft_max=6) as s:
        full = s.generate("hello")
        stop = full.text[at:at + 3]
        cut = full.text.index(stop)
        tok = s.opened.tokenizer
        # the shortest token prefix whose text contains the stop string
        need = next(n for n in range(1, len(full.tokens) + 1) if stop in tok.decode(np.asarray(full.tokens[:n])))
        res = s.generate("hello", stop=[stop, "\x00never"])
        assert res.text == full.text[:cut]
        assert res.tokens == full.tokens[:need]  # nothing after the completing token is committed
        assert res.receipt.finish_reason == "stop" and res.receipt.config["stop"] == [stop, "\x00never"]
        assert s.opened.target.n_past == len("hello") - 1 + len(res.tokens)  # nor left in the target's memory
        stream = s.stream("hello", stop=[stop])
        deltas = list(stream)
        assert "".join(deltas) == res.text and stream.receipt.digest() != full.receipt.digest()
        assert stream.result.tokens == res.tokens


def test_stop_strings_need_a_tokenizer():
    with open_session("reference:seed=1,vocab=200,dim=8", "off") as s, pytest.raises(ConfigError, match="stop"):
        s.start([1, 2, 3], stop=["x"])


# -- one request per session -----------------------------------------------------------------------
class _Slow:
    """Widens the window in which a second thread can collide with a running request."""

    __name__ = "test.slow"

    @hookimpl(wrapper=True)
    def power_txn_phase(self, phase, round_index):
        threading.Event().wait(0.0002)
        return (yield)


def test_one_session_from_many_threads_never_gives_wrong_tokens():
    prompt = [104, 105, 106]
    with open_session(MODEL, "ref-draft", None, _Slow(), max_tokens=6) as s:
        expected = s.generate(prompt).tokens
        outcomes: list[object] = []
        lock = threading.Lock()
        start = threading.Barrier(8)

        def worker():
            start.wait()
            for _ in range(25):
                try:
                    got: object = s.generate(prompt).tokens
                except SessionBusy:
                    got = "busy"
                except BaseException as exc:  # a crash or any other error fails the test
                    got = exc
                with lock:
                    outcomes.append(got)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(outcomes) == 200
    wrong = [o for o in outcomes if o != "busy" and o != expected]
    assert not wrong, wrong[:3]
    assert outcomes.count("busy") > 0 and outcomes.count(expected) > 0


def test_separate_sessions_on_threads_equal_single_threaded_output():
    prompts = ["hello", "crème", "abc abc", "ok"]
    models = [f"reference:seed={i},vocab=288,dim=16,eos=256" for i in range(4)]
    single = []
    for m, p in zip(models, prompts, strict=True):
        with open_session(m, "ref-draft", max_tokens=50) as s:
            single.append(s.generate(p).tokens)
    results: list[object] = [None] * 4

    def worker(i):
        with open_session(models[i], "ref-draft", max_tokens=50) as s:
            results[i] = [s.generate(prompts[i]).tokens for _ in range(3)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[t] * 3 for t in single]


def test_an_unfinished_stream_keeps_the_session_busy_and_closing_it_cancels():
    with open_session(MODEL, "off", max_tokens=40) as s:
        ref = s.generate("hello")
        stream = s.stream("hello")
        first = next(stream)
        with pytest.raises(SessionBusy, match="one request at a time"):
            s.generate("hello")
        stream.close()
        assert stream.receipt.status == "cancelled" and stream.result is None
        assert ref.text.startswith(first)
        assert s.generate("hello").tokens == ref.tokens  # the session is free again


def test_a_stream_read_from_two_threads_raises_session_busy():
    with open_session(MODEL, "off", None, _Slow(), max_tokens=200) as s:
        stream = s.stream("hello")
        errors: list[BaseException] = []

        def reader():
            try:
                for _ in stream:
                    pass
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors and all(isinstance(e, SessionBusy) for e in errors)


def test_resuming_after_another_request_used_the_session_is_refused():
    cancel = CancelToken()
    with open_session(MODEL, "off", max_tokens=40) as s:
        gen = s.start("hello", cancel=cancel)
        rounds = gen.rounds()
        next(rounds)
        next(rounds)
        cancel.cancel()
        with pytest.raises(Cancelled):
            next(rounds)
        assert gen.receipt.status == "cancelled"
        s.generate("other")
        cancel.reset()
        with pytest.raises(StateLost, match="served another request"):
            gen.run()


def test_cancelled_stream_resumes_exactly():
    cancel = CancelToken()
    with open_session(MODEL, "ref-draft", max_tokens=60) as s:
        ref = s.generate("hello")
        gen = s.start("hello", cancel=cancel)
        stream = gen.stream()
        parts = [next(stream), next(stream)]
        cancel.cancel()
        with pytest.raises(Cancelled):
            parts.extend(stream)
        assert stream.receipt.status == "cancelled"
        cancel.reset()
        parts.extend(gen.stream())
        assert "".join(parts) == ref.text


# -- chat ------------------------------------------------------------------------------------------
CHATML = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_renders_the_template_with_generation_prompt():
    tpl = ChatTemplate(source=CHATML, bos_token="<s>", eos_token="</s>")
    text = tpl.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 😀"}])
    assert text == "<s><|system|>be brief\n<|user|>hi 😀\n<|assistant|>"
    assert ChatTemplate(source="{{ messages | tojson }}").render([{"role": "user", "content": "é"}]) == \
        '[{"role": "user", "content": "é"}]'


def test_chat_bos_is_not_added_twice():
    tpl = ChatTemplate(source=CHATML, bos_token="<s>", add_bos=True, bos_id=1)
    assert tpl.prompt_text(tpl.render([{"role": "user", "content": "x"}])).startswith("<|user|>")
    assert ChatTemplate(source=CHATML, bos_token="<s>").prompt_text("<s>x") == "<s>x"  # tokenizer adds none
    assert list(tpl.dedupe_bos([1, 1, 5])) == [1, 5] and list(tpl.dedupe_bos([1, 5])) == [1, 5]


def test_chat_template_errors_are_config_errors():
    bad = ChatTemplate(source="{{ raise_exception('roles must alternate') }}", model="M")
    with pytest.raises(ConfigError, match="roles must alternate"):
        bad.render([{"role": "user", "content": "x"}])
    with pytest.raises(ConfigError, match="messages"):
        bad.render("just text")  # type: ignore[arg-type]
    # the sandbox refuses to reach Python internals from a downloaded template
    evil = ChatTemplate(source="{{ messages.append(1) }}{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ConfigError):
        evil.render([{"role": "user", "content": "x"}])


def test_session_chat_uses_the_template_and_streams():
    with open_session(MODEL, "off", max_tokens=30) as s:
        msgs = [{"role": "user", "content": "hello"}]
        res = s.chat(msgs, chat_template=CHATML)
        assert s.chat_prompt(msgs, chat_template=CHATML).tolist() == list(b"<|user|>hello\n<|assistant|>")
        assert res.tokens == s.generate("<|user|>hello\n<|assistant|>").tokens
        assert "".join(s.chat_stream(msgs, chat_template=CHATML)) == res.text
        with pytest.raises(ConfigError, match="no chat template: pass a plain prompt"):
            s.chat(msgs)  # a reference model carries no template


# -- quiet by default ------------------------------------------------------------------------------
EMBED = r"""
import sys
sys.path.insert(0, {tests!r})
from helpers import open_session
from power_core.transaction import CancelToken
with open_session({model!r}, "ref-draft", max_tokens=40) as s:
    r = s.generate("hello")
    t = "".join(s.stream("hello", stop=[r.text[5:8]]))
    s.chat([{{"role": "user", "content": "x"}}], chat_template="{{{{ messages[0]['content'] }}}}")
    c = CancelToken(); g = s.start("hello", cancel=c); it = g.rounds(); next(it); c.cancel()
    try:
        next(it)
    except Exception:
        pass
    try:
        s.chat([{{"role": "user", "content": "x"}}])
    except Exception:
        pass
import structlog
assert not structlog.is_configured()  # the library left the host's structlog alone
"""


def test_embedded_request_prints_nothing_without_logging_configured(tmp_path):
    code = EMBED.format(tests=str(ROOT / "tests"), model=MODEL)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_events_go_to_the_hosts_logging(tmp_path):
    code = ("import logging, sys\nlogging.basicConfig(level=logging.DEBUG, stream=sys.stdout, "
            "format='%(name)s %(message)s')\n" + EMBED.format(tests=str(ROOT / "tests"), model=MODEL))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("power_core.transaction txn.commit round=") for line in lines)
    assert sum(line.startswith("power_core.generation request.end status='completed'") for line in lines) >= 3
    assert any("request.end status='cancelled'" in line for line in lines)


def test_disabled_debug_events_build_nothing(monkeypatch):
    import power_core.transaction as txn_mod

    calls: list[object] = []
    monkeypatch.setattr(txn_mod.log, "debug", lambda *a, **k: calls.append(a))
    logging.getLogger("power_core.transaction").setLevel(logging.INFO)
    try:
        with open_session(MODEL, "off", max_tokens=5) as s:
            s.generate("x")
        assert calls == []
        logging.getLogger("power_core.transaction").setLevel(logging.DEBUG)
        with open_session(MODEL, "off", max_tokens=5) as s:
            s.generate("x")
        assert len(calls) == 5
    finally:
        logging.getLogger("power_core.transaction").setLevel(logging.NOTSET)


def test_power_loggers_carry_a_null_handler():
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("power_core").handlers)
    json.dumps(core_plugins().describe())  # (plugins import fine with logging untouched)
