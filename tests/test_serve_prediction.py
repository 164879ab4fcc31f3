"""OpenAI's ``prediction`` (Predicted Outputs) as a proposal source (issue 45, item 3).

A request's prediction is drafted from first (:class:`power_core.prediction.PredictedProposer`), its
strategy's proposer where the output is not aligned with it, and the target verifies every token: the
output equals target-only (greedy and seeded), whatever the prediction (exact, diverging, empty, longer
than the output, holding the prompt, unrelated). The receipt and ``usage.completion_tokens_details``
count the prediction's tokens the output repeated (accepted) and the rest (rejected). Bad input is an
OpenAI-shaped 400 naming the field. Unit tests first, then the reference backend (in process), then the
real SmolLM2 behind ``power serve`` (``--mode suffix,off``: the prediction ≡ the off lane, byte for byte).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from power_core.config import PowerConfig
from power_core.errors import ConfigError
from power_core.prediction import MATCH_MIN, SOURCE, Alignment, PredictedProposer, Prediction
from power_core.runtime import DecodeResult, Proposal, ProposalContext, ProposerCapabilities
from power_core.session import Session
from tests.helpers import core_plugins
from tests.serve_helpers import asgi


# -- the alignment and the counts -----------------------------------------------------------------------------
def _usage(pred: list[int], out: list[int]) -> tuple[int, int, int]:
    u = Prediction(pred).usage(out)
    assert u.accepted + u.rejected == u.tokens == len(pred)
    return u.tokens, u.accepted, u.rejected


def test_usage_counts_the_prediction_tokens_the_output_repeated():
    text = list(range(10, 40))
    assert _usage(text, text) == (30, 30, 0)  # repeated whole
    assert _usage([], text) == (0, 0, 0)  # empty
    assert _usage(text, []) == (30, 0, 30)  # nothing written
    assert _usage(text + list(range(50, 70)), text) == (50, 30, 20)  # longer than the output
    assert _usage(text, [1, 2, 3, 4]) == (30, 0, 30)  # unrelated
    # an edit: a line inserted (the prediction's tokens all appear), a stretch replaced (those do not)
    assert _usage(text, text[:12] + [90, 91, 92] + text[12:]) == (30, 30, 0)
    assert _usage(text, text[:12] + [90, 91, 92] + text[17:]) == (30, 25, 5)
    # text the output repeats twice counts once: a prediction position is accepted at most once
    assert _usage(text, text + text) == (30, 30, 0)


def test_after_a_divergence_the_alignment_reanchors_on_the_longest_tail_forward():
    pred = [1, 2, 3, 7, 8, 1, 2, 3, 4, 5, 6]
    a = Alignment(Prediction(pred))
    assert a.pos == 0  # an answer is expected to start with its prediction
    for t in (1, 2, 3, 4):  # repeats 1, 2, 3, then 4 where the prediction has 7: not aligned
        a.feed(t)
    assert a.pos is not None and pred[a.pos:] == [5, 6]  # ... until the tail [2, 3, 4] is found at 6..8
    b = Alignment(Prediction(pred))
    b.feed(9)  # one token locates nothing (MATCH_MIN)
    assert b.pos is None and MATCH_MIN == 2
    b.feed(1)
    assert b.pos is None
    b.feed(2)  # [1, 2] occurs twice: the first place at or after the last alignment (0)
    assert b.pos == 2


def test_a_prediction_is_tokenized_as_output_text_and_bounded_by_the_context():
    class Tok:  # a tokenizer that puts BOS (0) before any text, as llama.cpp's does for many models
        def encode(self, text: str) -> np.ndarray:
            return np.asarray([0, *(ord(c) for c in text)], dtype=np.int32)

        def decode(self, tokens: Any) -> str:
            return "".join(chr(t) for t in tokens)

    assert Prediction.from_text("abc", Tok(), 16).tokens.tolist() == [97, 98, 99]
    assert len(Prediction.from_text("", Tok(), 16)) == 0
    with pytest.raises(ConfigError, match="prediction") as exc:
        Prediction.from_text("x" * 17, Tok(), 16)
    assert exc.value.key == "prediction"
    with pytest.raises(ConfigError, match="prediction"):
        Prediction.from_text("abc", None, 16)


class _Recorder:
    """A fallback proposer that proposes [77] and records every call."""

    features: frozenset[str] = frozenset()
    capabilities = ProposerCapabilities()

    def __init__(self) -> None:
        self.calls: list[str] = []

    def begin(self, prompt: Any) -> None:
        self.calls.append("begin")

    def checkpoint(self) -> Any:
        self.calls.append("checkpoint")
        return len(self.calls)

    def propose(self, ctx: ProposalContext) -> Proposal:
        self.calls.append("propose")
        return Proposal(np.asarray([77], dtype=np.int32), source="own")

    def observe(self, result: DecodeResult) -> None:
        self.calls.append("observe")

    def commit(self, n_accepted: int, emitted: Any) -> None:
        self.calls.append(f"commit{n_accepted}")

    def restore(self, checkpoint: Any) -> None:
        self.calls.append("restore")


def test_the_proposer_drafts_the_aligned_continuation_else_the_strategy_which_sees_every_round():
    inner = _Recorder()
    p = PredictedProposer(Prediction([5, 6, 7, 8, 9]), inner)
    prompt = np.asarray([1, 2], dtype=np.int32)
    p.begin(prompt)

    def ctx(out: list[int], k: int) -> ProposalContext:
        return ProposalContext(history=np.asarray([1, 2, *out], dtype=np.int32), anchor=(out or [2])[-1], k=k,
                               round_index=len(out))

    def verify(n: int) -> DecodeResult:
        return DecodeResult(tokens=np.zeros(n + 1, dtype=np.int32), logits=np.zeros((n + 1, 1), np.float32))

    p.commit(0, np.asarray([5], dtype=np.int32))  # round 0 wrote the prediction's first token
    got = p.propose(ctx([5], 3))
    assert got.ids.tolist() == [6, 7, 8] and got.source == SOURCE and got.confidence is not None
    cp = p.checkpoint()
    p.observe(verify(3))
    p.commit(1, np.asarray([6, 0], dtype=np.int32))  # diverged after one: not aligned, the strategy drafts
    assert p.propose(ctx([5, 6, 0], 3)).source == "own"
    p.restore(cp)  # back before the divergence: aligned again
    assert p.propose(ctx([5], 2)).ids.tolist() == [6, 7]
    assert inner.calls == ["begin", "commit0", "checkpoint", "observe", "commit1", "propose", "restore"]
    assert p.capabilities.close is None and p.capabilities.batch is None  # the session closes its own proposer


# -- the reference backend: every kind of prediction, output ≡ target-only -----------------------------------
PROMPT = "hello world"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def ref() -> Iterator[Session]:
    with Session.open(PowerConfig(n_ctx=256), model="reference", plugins=core_plugins(),
                      strategies=["ref-draft", "off"]) as s:
        yield s


def _kinds(out: list[int], prompt: list[int]) -> dict[str, list[int]]:
    return {"exact": out, "empty": [], "inserted": out[:10] + [5, 6, 7] + out[10:], "deleted": out[:20] + out[25:],
            "diverging": out[:15] + [1, 2, 3, 4, 5, 6, 7, 8] + out[15:30], "longer": out + out[::-1] + [9] * 40,
            "with_prompt": prompt + out + [9, 9, 9], "unrelated": [3, 1, 4, 1, 5, 9, 2, 6] * 8, "repeated": out * 2}


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 11}], ids=["greedy", "seeded"])
def test_reference_every_prediction_gives_the_target_only_output(ref, sampling):
    off = ref.start(PROMPT, max_tokens=60, strategy="off", sampling=sampling).run()
    out, prompt = list(off.tokens), ref.encode(PROMPT).tolist()
    for kind, pred in _kinds(out, prompt).items():
        got = ref.start(PROMPT, max_tokens=60, strategy="ref-draft", sampling=sampling,
                        prediction=Prediction(pred)).run()
        assert got.tokens == off.tokens, kind
        assert got.receipt.output_sha256 == off.receipt.output_sha256
        assert got.receipt.prediction == Prediction(pred).usage(out).to_dict(), kind
        sources = got.receipt.proposer["sources"]
        if kind in ("exact", "longer", "repeated", "inserted", "deleted"):
            # drafted from the prediction, and what it drafted the target kept
            assert sources[SOURCE]["accepted"] > 0.8 * len(out) - sources[SOURCE]["drafts"], (kind, sources)
        if kind in ("empty", "unrelated"):
            assert SOURCE not in sources
    exact = got = ref.start(PROMPT, max_tokens=60, strategy="ref-draft", sampling=sampling,
                            prediction=Prediction(out)).run()
    assert exact.receipt.prediction == {"tokens": 60, "accepted": 60, "rejected": 0}
    # the target-only lane (and the audit's target-only decode) only counts
    got = ref.start(PROMPT, max_tokens=60, strategy="off", sampling=sampling, prediction=Prediction(out)).run()
    assert got.tokens == off.tokens and got.receipt.prediction == exact.receipt.prediction
    assert got.receipt.proposer["drafted"] == 0


def test_reference_with_a_prediction_the_strategy_drafts_where_the_output_left_it(ref):
    off = ref.start(PROMPT, max_tokens=60, strategy="off").run()
    out = list(off.tokens)
    got = ref.start(PROMPT, max_tokens=60, strategy="ref-draft", prediction=Prediction(out[:20])).run()
    assert got.tokens == off.tokens
    sources = got.receipt.proposer["sources"]
    assert sources[SOURCE]["accepted"] > 0  # the first 20 from the prediction
    # the rest from ref-draft (which names no source): drafted tokens beyond the prediction's
    assert got.receipt.proposer["drafted"] > sources[SOURCE]["drafted"]


def test_reference_suffix_lane_with_a_prediction_equals_off():
    pytest.importorskip("power_suffix")
    from power_core.plugins import get_plugins

    with Session.open(PowerConfig(n_ctx=256), model="reference", plugins=get_plugins(),
                      strategies=["suffix", "off"]) as s:
        off = s.start(PROMPT, max_tokens=80, strategy="off").run()
        out = list(off.tokens)
        for pred in (out, out[:30] + [7, 7, 7] + out[35:], []):
            got = s.start(PROMPT, max_tokens=80, strategy="suffix", prediction=Prediction(pred)).run()
            assert got.tokens == off.tokens
        assert got.receipt.strategy["name"] == "suffix"


# -- power serve in process (reference): usage, and bad input is a 400 naming the field --------------------
@contextlib.contextmanager
def _app(n_ctx: int = 256) -> Iterator[Any]:
    from power_core.serve import ServeOptions, create_app

    with Session.open(PowerConfig(n_ctx=n_ctx), model="reference", plugins=core_plugins(),
                      strategies=["ref-draft", "off"]) as s:
        app = create_app(s.driver(), ServeOptions(model_name="m", chat_template=TEMPLATE))
        try:
            yield app
        finally:
            app.state.power.executor.shutdown(wait=True)


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": PROMPT, "max_tokens": 40, **extra}


def test_serve_usage_counts_accepted_and_rejected_prediction_tokens():
    pytest.importorskip("starlette")
    with _app() as app:
        (off,) = asgi(app, ("POST", "/v1/completions", _body(power={"strategy": "off"})))
        text = off.json()["choices"][0]["text"]
        pred = {"type": "content", "content": text + " and more"}
        parts = {"type": "content", "content": [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]}
        got, split, stream, chat = asgi(
            app, ("POST", "/v1/completions", _body(prediction=pred)),
            ("POST", "/v1/completions", _body(prediction=parts)),
            ("POST", "/v1/completions", _body(prediction=pred, stream=True, stream_options={"include_usage": True})),
            ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 8, "prediction": pred}))
        body = got.json()
        (stored,) = asgi(app, ("GET", f"/v1/receipts/{body['id']}", None))
    receipt = stored.json()["receipt"]
    assert "completion_tokens_details" not in off.json()["usage"]  # no prediction, no counts
    for r in (got, split, chat):
        assert r.status_code == 200, r.text
    assert body["choices"][0]["text"] == text and body["power"]["output_sha256"] == off.json()["power"]["output_sha256"]
    details = body["usage"]["completion_tokens_details"]
    assert details == {"accepted_prediction_tokens": receipt["prediction"]["accepted"],
                       "rejected_prediction_tokens": receipt["prediction"]["rejected"]}
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] > 0  # " and more"
    assert receipt["proposer"]["sources"][SOURCE]["accepted"] > 0
    assert split.json()["choices"][0]["text"] == text
    assert '"completion_tokens_details":{"accepted_prediction_tokens"' in stream.text.replace(" ", "")
    assert "completion_tokens_details" in chat.json()["usage"]


@pytest.mark.parametrize("prediction, param", [
    ("the file", "prediction"),  # not an object
    ({"type": "content"}, "prediction.content"),
    ({"type": "text", "content": "x"}, "prediction.type"),
    ({"type": "content", "content": 7}, "prediction.content"),
    # (a string or text parts: the error names the field, as for a message's content)
    ({"type": "content", "content": ["x"]}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "text": "x"}]}, "prediction.content"),
    ({"type": "content", "content": [{"type": "text", "text": 3}]}, "prediction.content"),
    ({"type": "content", "content": []}, "prediction.content"),
    ({"type": "content", "content": "x" * ((1 << 18) + 1)}, "prediction.content"),  # PREDICTION_MAX_CHARS
    ({"type": "content", "content": "y" * 300}, "prediction"),  # more tokens than the context (256) holds
    ({"type": "content", "content": "x", "extra": 1}, "prediction.extra"),
])
def test_serve_bad_predictions_are_a_400_naming_the_field(prediction, param):
    pytest.importorskip("starlette")
    with _app() as app:
        r, ok = asgi(app, ("POST", "/v1/completions", _body(prediction=prediction)),
                     ("POST", "/v1/completions", _body(prediction={"type": "content", "content": "hi"})))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", r.text
    assert set(err) == {"message", "type", "param", "code"}
    assert ok.status_code == 200  # and it serves on


def test_serve_prediction_bound_is_declared_once():
    from power_core.serve import protocol

    assert protocol.PREDICTION_MAX_CHARS == 1 << 18
    rule = next(f for f in protocol.FIELDS if f.name == "prediction")
    assert rule.rule == "honoured" and "prediction" in protocol.ChatRequest.model_fields


# -- SmolLM2 behind power serve: the prediction ≡ the off lane, byte for byte ------------------------------------
QUEUE = '''class Queue:
    """A first-in, first-out queue."""

    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty queue")
        return self._items.pop(0)
'''
ASK = "Add a method `__len__` that returns the number of items. Reply with the complete edited file.\n\n"


@pytest.fixture(scope="module")
def smollm2_server() -> Iterator[Any]:
    pytest.importorskip("power_native")
    pytest.importorskip("power_suffix")
    from tests.native.test_models import _model_path
    from tests.serve_helpers import served

    with served("--model", _model_path("smollm2"), "--mode", "off,suffix", "--threads", "1", "--parallel", "2",
                "--n-ctx", "1024") as s:
        yield s


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"])
def test_smollm2_served_predictions_equal_the_off_lane_byte_for_byte(smollm2_server, sampling):
    import concurrent.futures

    import httpx

    url = smollm2_server.url
    messages = [{"role": "user", "content": ASK + QUEUE}]
    body = {"model": httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"], "messages": messages,
            "max_tokens": 48, **sampling}
    kinds = {"exact": QUEUE, "diverging": QUEUE.replace("pop(0)", "popleft()").replace("push", "put"), "empty": "",
             "longer": QUEUE + "\n    def clear(self):\n        self._items.clear()\n" * 3,
             "with_prompt": ASK + QUEUE + QUEUE, "unrelated": "SELECT name FROM users WHERE id = 7;\n" * 4}
    parts = {"type": "content", "content": [{"type": "text", "text": QUEUE[:40]}, {"type": "text", "text": QUEUE[40:]}]}

    def post(extra: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()

    off = post({"power": {"strategy": "off"}})
    asks = [{"power": {"strategy": "suffix"}, "prediction": {"type": "content", "content": text}}
            for text in kinds.values()] + [{"power": {"strategy": "suffix"}, "prediction": parts}]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two at a time: their rounds share target passes
        answers = list(pool.map(post, asks))
    drafted = 0
    for kind, got in zip([*kinds, "parts"], answers, strict=True):
        assert got["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"], kind
        assert got["power"]["output_sha256"] == off["power"]["output_sha256"], kind
        details = got["usage"]["completion_tokens_details"]
        receipt = httpx.get(f"{url}/v1/receipts/{got['id']}", timeout=30).json()["receipt"]
        assert details == {"accepted_prediction_tokens": receipt["prediction"]["accepted"],
                           "rejected_prediction_tokens": receipt["prediction"]["rejected"]}, kind
        drafted += receipt["proposer"]["sources"].get(SOURCE, {}).get("accepted", 0)
        if kind == "empty":
            assert details == {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
    assert drafted > 0  # the predictions were drafted from, and the target kept some of it
