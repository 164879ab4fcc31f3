"""Custom chat templates (``--chat-template``, ``chat_template=``): they get the GGUF's BOS/EOS texts like
the model's own template, and each is compiled once — per server, per session — not per request."""

from __future__ import annotations

import asyncio

import httpx
import jinja2
import pytest
from helpers import core_plugins, open_session

from power_core.artifacts.synthetic import BOS_ID, EOS_ID, target_spec
from power_core.chat import ChatTemplate, template_for
from power_core.config import PowerConfig

MODEL = "reference:seed=2,vocab=288,dim=16,eos=256"
SOURCE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}{{ eos_token }}")
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """A tiny GGUF with a vocabulary (``tok_<id>``), BOS and EOS, and no chat template of its own."""
    return target_spec(mtp=False).write(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def compilations(monkeypatch):
    """How many times a Jinja template was compiled (``Environment.from_string``), from a cold cache."""
    from power_core import chat

    chat._with_source.cache_clear()  # templates an earlier test built (and compiled) are not reused
    count = [0]
    real = jinja2.Environment.from_string

    def spy(self, *args, **kwargs):
        count[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jinja2.Environment, "from_string", spy)
    return count


# -- BOS/EOS of a custom template -----------------------------------------------------------------
def test_a_custom_template_gets_the_ggufs_bos_and_eos(gguf):
    tpl = template_for(str(gguf), SOURCE)
    assert (tpl.bos_token, tpl.eos_token, tpl.bos_id) == (f"tok_{BOS_ID}", f"tok_{EOS_ID}", BOS_ID)
    assert tpl.render(MSGS) == f"tok_{BOS_ID}<|user|>hi\n<|assistant|>tok_{EOS_ID}"


def test_session_chat_prompt_with_a_custom_template_renders_bos_and_eos(gguf):
    with open_session(MODEL, "off") as s:
        s.opened.model_path = str(gguf)  # the byte tokenizer spells the rendered text out
        ids = s.chat_prompt(MSGS, chat_template=SOURCE).tolist()
    assert bytes(ids).decode() == f"tok_{BOS_ID}<|user|>hi\n<|assistant|>tok_{EOS_ID}"


def test_a_custom_template_without_a_gguf_still_renders():
    assert template_for("reference:x", SOURCE).render(MSGS) == "<|user|>hi\n<|assistant|>"


# -- compiled once --------------------------------------------------------------------------------
def test_a_template_object_compiles_once_over_many_renders(compilations):
    tpl = ChatTemplate(source=SOURCE)
    for _ in range(3):
        tpl.render(MSGS)
    assert compilations[0] == 1


def test_session_chat_prompt_with_a_source_override_compiles_once(compilations):
    with open_session(MODEL, "off") as s:
        first = s.chat_prompt(MSGS, chat_template=SOURCE).tolist()
        for _ in range(3):
            assert s.chat_prompt(MSGS, chat_template=SOURCE).tolist() == first
    assert compilations[0] == 1


async def _chat_requests(app, n: int) -> list[dict]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        out = []
        for _ in range(n):
            r = await client.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, "max_tokens": 4})
            assert r.status_code == 200, r.text
            out.append(r.json())
        return out


def test_the_server_compiles_a_custom_template_once_across_chat_requests(compilations):
    pytest.importorskip("starlette")
    from power_core.serve import ServeOptions, create_app, open_sessions

    slots = open_sessions(PowerConfig(spec_mode="off", n_ctx=256), 1, model=MODEL, plugins=core_plugins())
    try:
        app = create_app(slots.engine, ServeOptions(model_name="m", chat_template=SOURCE))
        got = asyncio.run(_chat_requests(app, 4))
        app.state.power.executor.shutdown(wait=True)
    finally:
        slots.close()
    assert len({r["choices"][0]["message"]["content"] for r in got}) == 1
    assert compilations[0] == 1


def test_power_serve_builds_the_template_once_and_the_server_reuses_it(tmp_path, monkeypatch, compilations):
    pytest.importorskip("starlette")
    import power_core.serve as serve_mod
    from power_core.cli import main
    from power_core.serve import create_app

    path = tmp_path / "chat.jinja"
    path.write_text(SOURCE)
    got: dict = {}

    def fake_serve(slots, options, host, port, **kw):  # no port: run the requests in-process
        app = create_app(slots.engine, options)
        got["responses"] = asyncio.run(_chat_requests(app, 3))
        app.state.power.executor.shutdown(wait=True)
        got["template"] = options.chat_template

    monkeypatch.setattr(serve_mod, "serve", fake_serve)
    monkeypatch.setenv("POWER_LOAD_PLUGINS", "")
    assert main(["serve", "--backend", "reference", "--model", MODEL, "--mode", "off", "--n-ctx", "256",
                 "--served-model-name", "m", "--chat-template", str(path)]) == 0
    assert isinstance(got["template"], ChatTemplate) and got["template"].source == SOURCE
    assert len(got["responses"]) == 3
    assert compilations[0] == 1  # the startup check compiled it; the requests reused it


# -- what real templates use ------------------------------------------------------------------------------
def test_a_generation_block_renders_its_body():
    """``{% generation %}`` (transformers' marker of the assistant's tokens, in LFM2.5's and Poolside's
    templates) renders its body; it was a compile error."""
    source = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}[{{ m['content'] }}]"
              "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    got = ChatTemplate(source=source).render([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "yo"}], add_generation_prompt=False)
    assert got == "hi[yo]"


def test_a_template_failing_on_a_value_is_a_typed_error_not_a_crash():
    """A ``TypeError`` inside a template (llama.cpp's ``llama-cpp-deepseek-r1.jinja`` applies ``tojson`` to
    a generator) is a :class:`ConfigError` naming the messages, as a ``raise_exception`` is."""
    from power_core.errors import ConfigError

    with pytest.raises(ConfigError, match="not JSON serializable"):
        ChatTemplate(source="{{ (messages | map(attribute='role')) | tojson }}").render(MSGS)
