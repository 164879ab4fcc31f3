"""In-graph greedy sampling on llama.cpp (``Context.set_greedy``, config ``sampling_in_graph``):
the backend sampler picks each row's first maximum, as ``numpy.argmax`` does (ggml's own argmax
keeps the last one: a synthetic tie shows both), and real models emit exactly the host path's
tokens in every mode (SmolLM2 and Gemma-3: off, suffix, draft-model self-draft). On a CPU-only
target ``auto`` keeps the host path (graph sampling does not pay there); ``on`` forces it."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("power_native._llama")

from power_native import _llama  # noqa: E402

from power_core.config import PowerConfig  # noqa: E402
from power_core.session import Session  # noqa: E402

pytestmark = pytest.mark.native

N_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What are the three primary colors?\nA:",
]


@pytest.fixture(scope="module")
def tied_llama(tiny_llama, tmp_path_factory):
    """The tiny llama with an output head of ties: even rows are one vector ``v``, odd rows ``-v``, so
    every logits row holds ``n_vocab / 2`` equal maxima (``v . h`` or ``-v . h``, whichever is larger)."""
    path = tmp_path_factory.mktemp("tied") / "tiny-llama-tied.gguf"
    shutil.copyfile(tiny_llama, path)
    reader = gguf.GGUFReader(str(path), "r+")
    names = {t.name: t for t in reader.tensors}
    head = names.get("output.weight", names["token_embd.weight"])
    assert head.tensor_type == gguf.GGMLQuantizationType.F32, head.tensor_type
    w = head.data  # (n_vocab, n_embd), a writable memory map
    v = np.array(w[0])
    w[0::2] = v
    w[1::2] = -v
    reader.data.flush()
    return path


def test_ties_resolve_to_the_first_maximum_like_numpy(tied_llama):
    from power_native import _llama

    model = _llama.Model.load(str(tied_llama), repack=False)
    ctx = _llama.Context(model, n_ctx=64, n_batch=8, n_outputs_max=8, n_threads=2)
    toks = np.array([1, 5, 9, 13, 17], dtype=np.int32)
    ctx.decode(toks, 0)
    rows = np.array(ctx.logits())
    first = np.argmax(rows, axis=1)
    last = rows.shape[1] - 1 - np.argmax(rows[:, ::-1], axis=1)
    assert (last > first).all(), "every row must hold a tie for the check to mean anything"
    assert ctx.set_greedy(True) and ctx.greedy
    ctx.seq_rm(0, 0, -1)
    ctx.decode(toks, 0)
    assert ctx.sampled_ids().tolist() == first.tolist()  # numpy's tie rule, not ggml argmax's (last)
    with pytest.raises(Exception, match="in the graph"):
        ctx.logits()
    assert not ctx.set_greedy(False) and not ctx.greedy
    with pytest.raises(Exception, match="no decode with outputs"):
        ctx.logits()  # the last decode's outputs were ids
    ctx.seq_rm(0, 0, -1)
    ctx.decode(toks, 0)
    np.testing.assert_array_equal(np.array(ctx.logits()), rows)  # the rows come back
    ctx.close()


def test_a_context_of_several_sequences_keeps_its_rows(tiny_llama):
    from power_native import _llama

    model = _llama.Model.load(str(tiny_llama))
    ctx = _llama.Context(model, n_ctx=64, n_batch=8, n_seq_max=2, n_threads=2)
    assert not ctx.set_greedy(True) and not ctx.greedy
    ctx.close()


def _model(alias: str) -> str:
    from test_models import _model_path

    return _model_path(alias)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
@pytest.mark.parametrize("mode", ["off", "suffix", "draft-model"])
def test_in_graph_tokens_equal_host_tokens(alias, mode):
    model = _model(alias)
    draft = model if mode == "draft-model" else None
    kw = dict(spec_mode=mode, max_tokens=N_TOKENS, n_ctx=1024, n_threads=2,
              **({"spec_draft_max": 4} if mode == "draft-model" else {}))
    out = {}
    for path in ("off", "on"):
        with Session.open(PowerConfig(sampling_in_graph=path, **kw), model=model, draft=draft) as s:
            out[path] = [s.generate(p) for p in PROMPTS]
    assert [g.tokens for g in out["on"]] == [g.tokens for g in out["off"]]
    assert {g.receipt.backend["sampling"] for g in out["off"]} == {"host"}
    assert {g.receipt.backend["sampling"] for g in out["on"]} == {"in-graph"}
    if mode != "off":
        assert sum(g.receipt.summary()["accepted"] for g in out["on"]) > 0


@pytest.mark.model
def test_stochastic_and_logprobs_requests_keep_the_rows_on_smollm2():
    with Session.open(PowerConfig(max_tokens=16, n_threads=2), model=_model("smollm2")) as s:
        auto = s.generate(PROMPTS[0])
    assert auto.receipt.backend["sampling"] == "host"  # a CPU target: the rows are in memory already
    with Session.open(PowerConfig(max_tokens=16, n_threads=2, sampling_in_graph="on"), model=_model("smollm2")) as s:
        greedy = s.generate(PROMPTS[0])
        hot = s.start(PROMPTS[0], sampling={"temperature": 0.8, "seed": 7}).run()
        with_lp = s.start(PROMPTS[0], logprobs=2)
        lp = with_lp.run()
        again = s.generate(PROMPTS[0])
    assert greedy.receipt.backend["sampling"] == again.receipt.backend["sampling"] == "in-graph"
    assert hot.receipt.backend["sampling"] == lp.receipt.backend["sampling"] == "host"
    assert lp.tokens == greedy.tokens == again.tokens == auto.tokens and len(with_lp.logprobs) == len(lp.tokens)


# -- drafters: draft-model, MTP, DFlash v1 and DSpark take their argmax ids from their own graph -------------
def _recorded(cfg: PowerConfig, model, draft, prompts) -> tuple[list, list, set]:
    """Tokens, every round's proposals and the receipts' draft_sampling of ``prompts`` on one session."""
    with Session.open(cfg, model=str(model), draft=str(draft) if draft else None) as s:
        proposals: list[list[int]] = []
        propose = s.proposer.propose

        def record(ctx):
            out = propose(ctx)
            proposals.append(np.asarray(out.ids).tolist())
            return out

        s.proposer.propose = record
        gens = [s.generate(p) for p in prompts]
    return [g.tokens for g in gens], proposals, {g.receipt.backend.get("draft_sampling") for g in gens}


@pytest.fixture(scope="module")
def drafter_cases(tiny_dir, tiny_qwen35, tiny_qwen35_mtp, tiny_llama, tied_llama) -> dict:
    """mode -> (target, draft, expected draft_sampling with ``on``)."""
    from native_helpers import make_tiny_draft

    out = {"mtp": (tiny_qwen35_mtp, None, "in-graph"),
           "draft-model": (tiny_llama, tied_llama, "in-graph"),  # a draft whose every row is a tie
           "dflash2": (tiny_qwen35, make_tiny_draft(tiny_dir, tiny_qwen35, name="ig-dflash2", kind="dflash2",
                                                    borrow=True), "host")}  # a lattice, not an argmax
    out["dflash"] = (tiny_qwen35, make_tiny_draft(tiny_dir, tiny_qwen35, name="ig-dflash", kind="dflash", d2t=96),
                     "in-graph")
    out["dspark"] = (tiny_qwen35, make_tiny_draft(tiny_dir, tiny_qwen35, name="ig-dspark", kind="dspark",
                                                  block_size=16), "in-graph")
    return out


@pytest.mark.parametrize("mode", ["draft-model", "mtp", "dflash", "dflash2", "dspark"])
def test_drafter_ids_from_the_graph_equal_the_host_argmax(drafter_cases, mode):
    """Same proposals in every round and the same tokens with the drafter's ids sampled in its graph
    (``on``) as on the host (``off``); on a CPU-only draft ``auto`` stays on the host."""
    target, draft, expected = drafter_cases[mode]
    prompts = [[1, 17, 42, 99, 5], [7, 7, 3]]
    kw = dict(spec_mode=mode, spec_draft_max=4, max_tokens=32, n_ctx=256, n_threads=2)
    runs = {path: _recorded(PowerConfig(sampling_in_graph=path, **kw), target, draft, prompts)
            for path in ("off", "on", "auto")}
    assert runs["on"][0] == runs["off"][0] == runs["auto"][0]
    assert runs["on"][1] == runs["off"][1] and sum(len(p) for p in runs["on"][1]) > 0
    assert runs["off"][2] == runs["auto"][2] == {"host"}
    assert runs["on"][2] == {expected}


def test_a_dflash_p_min_cut_keeps_the_rows(drafter_cases):
    """DFlash v1's p_min cut reads the rows' top-10 logits: its ids stay on the host."""
    target, draft, _ = drafter_cases["dflash"]
    cfg = PowerConfig(spec_mode="dflash", spec_draft_max=4, spec_draft_p_min=0.5, max_tokens=8, n_ctx=256,
                      n_threads=2, sampling_in_graph="on")
    assert _recorded(cfg, target, draft, [[1, 2, 3]])[2] == {"host"}


def test_an_mtp_p_min_cut_keeps_the_rows(drafter_cases):
    """MTP's p_min cut reads the head's top-10 logits: with ``on`` its ids stay on the host, and it cuts
    the drafts where the host path does."""
    target, _, _ = drafter_cases["mtp"]
    kw = dict(spec_mode="mtp", spec_draft_max=7, spec_draft_p_min=0.105, max_tokens=32, n_ctx=256, n_threads=2)
    on = _recorded(PowerConfig(sampling_in_graph="on", **kw), target, None, [[1, 17, 42, 99, 5]])
    off = _recorded(PowerConfig(sampling_in_graph="off", **kw), target, None, [[1, 17, 42, 99, 5]])
    assert on[2] == {"host"}
    assert on[:2] == off[:2]
    assert any(0 < len(p) < 7 for p in on[1]), "p_min cut no draft short: the test proves nothing"



_SPECIAL = st.sampled_from([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 3.0e38, -3.0e38, 1e-45])


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 300).flatmap(lambda n: st.lists(st.one_of(_SPECIAL, st.floats(-4, 4, width=32)),
                                                      min_size=n, max_size=n)),
       st.integers(0, 2000))
def test_the_drafters_host_first_maximum_is_numpys_argmax(values, pad):
    """``draft_pick``'s host rule (``_llama.first_max``, SIMD over a vocabulary-sized row): numpy's ``argmax``
    of the row wherever no NaN is in it (ties at the first maximum, -0.0 equal to 0.0), and the scalar loop's
    answer with NaNs (never the largest, unless the first element: then 0). Rows of every length around the
    vector widths, a maximum anywhere, repeated maxima; the tail padded with -inf to reach past the blocks."""
    row = np.array(values + [-np.inf] * pad, dtype=np.float32)
    got = _llama.first_max(row)
    v, best = row[0], 0
    for i in range(1, row.shape[0]):  # the scalar loop draft_pick ran before, element by element
        if row[i] > v:
            v, best = row[i], i
    assert got == best
    if not np.isnan(row).any():
        assert got == int(np.argmax(row))


def _top10_p(row: np.ndarray) -> np.float32:
    """The confidence ``draft_top_p`` computed before it skipped by SIMD: every element through the top-10
    insertion, then the float32 sum of ``exp(l_i - l_max)`` over the ten, in descending order."""
    top: list[np.float32] = []
    for v in row:
        if len(top) < 10:
            j = len(top)
            top.append(v)
        elif v > top[9]:
            j = 9
        else:
            continue
        while j > 0 and top[j - 1] < v:
            top[j] = top[j - 1]
            j -= 1
        top[j] = v
    s = np.float32(0)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, as the C loop computes it
        for t in top:
            s = np.float32(s + np.exp(np.float32(t - top[0]), dtype=np.float32))
        return np.float32(1) / s


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300).flatmap(lambda n: st.lists(st.one_of(_SPECIAL, st.floats(-4, 4, width=32)),
                                                      min_size=n, max_size=n)),
       st.integers(0, 400))
def test_the_drafters_top10_confidence_is_the_scalar_scans(values, pad):
    """``draft_top_p`` (``_llama.top10_p``), which skips 16 values a compare that cannot enter its top ten, keeps
    the same ten as the element-by-element insertion it replaced, so the same confidence (to float32 rounding of
    ``expf`` against numpy's ``exp``)."""
    row = np.array(values + [-np.inf] * pad, dtype=np.float32)
    got, want = _llama.top10_p(row), _top10_p(row)
    if np.isnan(want):
        assert np.isnan(got)
    else:
        assert got == pytest.approx(float(want), rel=1e-6, abs=0)


def test_first_max_and_top10_p_refuse_an_empty_row():
    with pytest.raises(ValueError, match="empty"):
        _llama.first_max(np.zeros(0, dtype=np.float32))
    with pytest.raises(ValueError, match="empty"):
        _llama.top10_p(np.zeros(0, dtype=np.float32))
