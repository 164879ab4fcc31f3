"""Native lifetimes: a closed context raises instead of dereferencing NULL, zero-copy views keep the
llama.cpp memory they point into alive, and objects built without a loaded model raise typed
errors. (Run once under AddressSanitizer for the note of issue #11: ``LD_PRELOAD=$(gcc
-print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 pytest tests/native/test_lifetimes.py``.)"""

from __future__ import annotations

import gc

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

from power_native import _llama  # noqa: E402
from power_native.target import open_target  # noqa: E402

from power_core.errors import RuntimeFault  # noqa: E402

pytestmark = pytest.mark.native


def _ctx(path, **kw):
    m = _llama.Model.load(str(path))
    return m, _llama.Context(m, n_ctx=128, n_batch=8, **kw)


def test_every_call_after_close_raises(tiny_llama):
    m, ctx = _ctx(tiny_llama)
    ctx.decode(np.arange(4, dtype=np.int32), 0)
    ctx.close()
    ctx.close()  # idempotent
    for call in (lambda: ctx.decode(np.arange(2, dtype=np.int32), 4), ctx.logits, lambda: ctx.seq_rm(0, 2),
                 ctx.state_get, lambda: ctx.state_set(b"x"), ctx.clear, lambda: ctx.set_causal_attn(False),
                 ctx.pos_max, lambda: ctx.set_embeddings_layer_inp(0), lambda: _llama.BatchExt(ctx),
                 lambda: _llama.Context(m, n_ctx=64, n_batch=8, ctx_other=ctx)):
        with pytest.raises(RuntimeFault, match="closed"):
            call()
    ctx.abort()  # cancelling a closed context is a no-op, not a write into freed memory
    ctx.clear_abort()


def test_logits_view_outlives_its_context(tiny_llama):
    m, ctx = _ctx(tiny_llama)
    ctx.decode(np.arange(4, dtype=np.int32), 0)
    view = ctx.logits()
    want = np.array(view)
    assert not view.flags.writeable and not view.flags.owndata
    ctx.close()
    del ctx
    gc.collect()
    junk = [np.full(1 << 16, 7.0, dtype=np.float32) for _ in range(64)]  # reuse freed memory, if any were freed
    assert view.tobytes() == want.tobytes()  # a memcpy: AddressSanitizer's interceptor checks it
    del junk


def test_target_rows_and_taps_outlive_the_target(tiny_qwen35):
    t = open_target(tiny_qwen35, n_ctx=128, max_block=4, snapshots=3, n_threads=2,
                    features=frozenset({"layer_inp:1"}), numerics="stock")
    res = t.decode(np.arange(4, dtype=np.int32))
    logits, feats = res.logits, res.features["layer_inp:1"]
    want = (np.array(logits), np.array(feats))
    t.close()
    del t, res
    gc.collect()
    assert logits.tobytes() == want[0].tobytes() and feats.tobytes() == want[1].tobytes()


def test_a_draft_context_keeps_the_target_context_it_borrows(tiny_dir, tiny_llama):
    """A DFlash draft without its own embeddings reads the target's through ``ctx_other``: closing
    (and dropping) the target context first must not free what the draft still reads."""
    from native_helpers import make_tiny_draft

    draft = make_tiny_draft(tiny_dir, tiny_llama, name="lifetime-borrow", borrow=True)
    m = _llama.Model.load(str(tiny_llama))
    base = _llama.Context(m, n_ctx=128, n_batch=8)
    d = _llama.Model.load(str(draft))
    top = _llama.Context(d, n_ctx=128, n_batch=8, ctx_other=base)
    assert top.has_ctx_other
    base.close()
    del base
    gc.collect()
    junk = [np.full(1 << 16, 7.0, dtype=np.float32) for _ in range(64)]
    assert top.has_ctx_other
    top.decode(np.arange(3, dtype=np.int32), 0)  # reads the borrowed embeddings: still allocated
    assert np.isfinite(top.logits()).all()
    del junk


def test_direct_construction_is_a_typed_error():
    with pytest.raises(RuntimeFault, match="Model.load"):
        _llama.Model()
    bare = _llama.Model.__new__(_llama.Model)
    for call in (lambda: bare.arch, lambda: bare.n_layer, lambda: bare.tokenize("hi"), lambda: bare.bos,
                 bare.eog_ids, lambda: bare.meta("general.architecture"), lambda: bare.is_eog(0),
                 lambda: bare.token_to_piece(0), lambda: bare.detokenize([]), lambda: bare.token_text(0)):
        with pytest.raises(RuntimeFault, match="no loaded model"):
            call()
    with pytest.raises(RuntimeFault, match="no loaded model"):
        _llama.Context(bare, n_ctx=64, n_batch=8)
    ctx = _llama.Context.__new__(_llama.Context)
    with pytest.raises(RuntimeFault, match="closed"):
        ctx.decode(np.arange(2, dtype=np.int32), 0)
    with pytest.raises(RuntimeFault, match="closed"):
        ctx.logits()


def test_a_context_initialises_once(tiny_llama):
    m, ctx = _ctx(tiny_llama)
    with pytest.raises(RuntimeFault, match="already"):
        ctx.__init__(m, n_ctx=64, n_batch=8)


def test_sessions_on_one_file_share_its_weights(tiny_llama, monkeypatch):
    from power_core.config import PowerConfig
    from power_core.session import Session

    cfg = PowerConfig(spec_mode="off", n_ctx=128, max_tokens=8, n_threads=2)
    with Session.open(cfg, model=str(tiny_llama)) as a, Session.open(cfg, model=str(tiny_llama)) as b:
        assert a.opened.target.model is b.opened.target.model  # one set of weights
        assert a.opened.target.ctx is not b.opened.target.ctx  # each session its own context
        assert a.generate([1, 2, 3]).tokens == b.generate([1, 2, 3]).tokens
    monkeypatch.setenv("POWER_NATIVE_SHARED_WEIGHTS", "0")
    with Session.open(cfg, model=str(tiny_llama)) as a, Session.open(cfg, model=str(tiny_llama)) as b:
        assert a.opened.target.model is not b.opened.target.model
