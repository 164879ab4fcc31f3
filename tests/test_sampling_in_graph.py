"""In-graph greedy sampling seen from the core: a runtime that hands over greedy ids instead of
logits rows (``TargetCapabilities.sample_in_graph``) emits exactly the host path's
tokens; the host path runs whenever the rows are needed (stochastic sampling, logprobs, a proposer
that reads target rows), with ``sampling_in_graph = "off"``, and with ``"auto"`` where the runtime
says graph sampling does not pay; the receipt says which path ran."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest

from power_core.config import PowerConfig
from power_core.errors import ConfigError
from power_core.reference.proposers import ProposerWrapper
from power_core.runtime import DecodeResult, ProposerCapabilities, TargetCapabilities, TargetRuntime, TokenArray
from power_core.session import Session
from tests.helpers import open_session

MODEL = "reference:seed=3,vocab=60,dim=8"
PROMPT = [5, 6, 7, 8]


class GraphGreedy:
    """A target whose "graph" samples greedy ids (numpy's argmax of its own rows) and then hides
    the rows, as power-native's llama target does with llama.cpp's backend sampling."""

    def __init__(self, inner: TargetRuntime, pays: bool) -> None:
        self.inner = inner
        self.graph_sampling_pays = pays
        self.on = False
        self.asked: list[bool] = []

    @property
    def capabilities(self) -> TargetCapabilities:
        # the inner target's, plus the ability it adds: declared, not discovered
        return attrs.evolve(self.inner.capabilities, sample_in_graph=self.sample_in_graph,
                            graph_sampling_pays=self.graph_sampling_pays)

    @property
    def n_past(self) -> int:
        return self.inner.n_past

    def sample_in_graph(self, on: bool) -> bool:
        self.asked.append(on)
        self.on = on
        return on

    def decode(self, tokens: TokenArray) -> DecodeResult:
        res = self.inner.decode(tokens)
        if not self.on:
            return res
        return attrs.evolve(res, logits=res.logits[:0], greedy_ids=np.argmax(res.logits, axis=1).astype(np.int32))

    def prefill(self, tokens: TokenArray, observe: Callable[[DecodeResult], None] | None = None) -> Any:
        row = self.inner.prefill(tokens, observe)
        if not self.on or isinstance(row, DecodeResult):
            return row
        return DecodeResult(tokens=tokens[-1:], logits=np.zeros((0, row.shape[0]), dtype=np.float32), kind="prompt",
                            greedy_ids=np.array([np.argmax(row)], dtype=np.int32))

    def checkpoint(self) -> Any:
        return self.inner.checkpoint()

    def rollback(self, checkpoint: Any, keep: int) -> bool:
        return self.inner.rollback(checkpoint, keep)

    def restore(self, checkpoint: Any) -> None:
        self.inner.restore(checkpoint)

    def reset(self) -> None:
        self.inner.reset()


def _graph_session(mode: str = "off", draft: str | None = None, pays: bool = True,
                   **cfg: Any) -> tuple[Session, GraphGreedy]:
    s = open_session(MODEL, mode, draft, **cfg)
    target = GraphGreedy(s.opened.target, pays)
    s.opened.target = target
    return s, target


def test_the_wrapper_declares_in_graph_sampling():
    s, target = _graph_session()
    with s:
        assert target.capabilities.sample_in_graph is not None and target.inner.capabilities.sample_in_graph is None
        assert target.capabilities.graph_sampling_pays and not target.inner.capabilities.graph_sampling_pays


@pytest.mark.parametrize("mode,draft", [("off", None), ("ref-draft", "reference:accept=0.6")])
def test_in_graph_ids_emit_the_host_tokens(mode, draft):
    with open_session(MODEL, mode, draft, max_tokens=40, spec_draft_max=4) as s:
        host = s.generate(PROMPT)
    s, target = _graph_session(mode, draft, max_tokens=40, spec_draft_max=4)
    with s:
        got = s.generate(PROMPT)
    assert got.tokens == host.tokens and got.receipt.output_sha256 == host.receipt.output_sha256
    assert got.receipt.backend["sampling"] == "in-graph" and host.receipt.backend["sampling"] == "host"
    assert target.asked == [True]


@pytest.mark.parametrize("request_kw,cfg", [
    (dict(sampling={"temperature": 0.7}), {}),  # stochastic: the position-indexed sampler needs rows
    (dict(logprobs=2), {}),  # logprobs read the rows
    ({}, dict(sampling_in_graph="off")),
])
def test_rows_stay_on_the_host_when_needed(request_kw, cfg):
    s, target = _graph_session(max_tokens=20, **cfg)
    with s:
        got = s.start(PROMPT, **request_kw).run()
        again = s.generate(PROMPT)  # the next greedy request turns it on (unless off)
    assert got.receipt.backend["sampling"] == "host" and target.asked[0] is False
    off = cfg.get("sampling_in_graph") == "off"
    assert again.receipt.backend["sampling"] == ("host" if off else "in-graph")


@pytest.mark.parametrize("setting,want", [("auto", "host"), ("on", "in-graph"), ("off", "host")])
def test_auto_samples_in_the_graph_only_where_it_pays(setting, want):
    s, target = _graph_session(pays=False, max_tokens=20, sampling_in_graph=setting)
    with s:
        got = s.generate(PROMPT)
    assert got.receipt.backend["sampling"] == want and target.asked == [want == "in-graph"]


def test_a_proposer_that_reads_target_rows_keeps_them():
    s, target = _graph_session("ref-draft", "reference:accept=0.6", max_tokens=20)
    with s:
        class RowReader(ProposerWrapper):
            capabilities = ProposerCapabilities(reads_target_rows=True)  # declared, as an adapter would

        s.proposer = RowReader(s.proposer)
        got = s.generate(PROMPT)
    assert got.receipt.backend["sampling"] == "host" and target.asked == [False]


def test_sampling_in_graph_is_validated():
    assert PowerConfig().sampling_in_graph == "auto"
    with pytest.raises(ConfigError) as err:
        PowerConfig(sampling_in_graph="always")
    assert err.value.key == "sampling_in_graph"
