"""Every opener closes what it opened when a later step fails: the llama contexts it created are
closed and the numerics mode it took is released, while the caller still holds the exception (whose
traceback keeps the opener's locals alive, so collection would not free them)."""

from __future__ import annotations

import contextlib
import importlib

import pytest

pytest.importorskip("power_native._llama")

from power_native import _llama, backend, draft, loading, target  # noqa: E402

from power_core.config import PowerConfig  # noqa: E402
from power_core.errors import RuntimeFault  # noqa: E402
from power_core.spec import OpenRequest  # noqa: E402

pytestmark = pytest.mark.native


class Boom(RuntimeError):
    """The injected failure."""


def _boom(*args, **kwargs):
    raise Boom("injected")


@pytest.fixture
def contexts(monkeypatch):
    """Every llama context created during the test (a spy subclass of ``_llama.Context``)."""
    made: list[_llama.Context] = []
    # extensions that cimport the Context look its vtable up on _llama.Context when they load: load
    # them before the spy takes its place
    with contextlib.suppress(ImportError):
        importlib.import_module("power_mtp._mtp")

    class Spy(_llama.Context):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(_llama, "Context", Spy)
    return made


@pytest.fixture
def numerics():
    """The open-target count per numerics mode before the test; the test compares after."""
    return dict(loading.numerics_guard._open)


def _closed(ctx: _llama.Context) -> bool:
    try:
        ctx.pos_max(0)
    except RuntimeFault:
        return True
    return False


def _request(path, *, verify_cost: bool = False, **cfg) -> OpenRequest:
    config = PowerConfig(spec_mode="off", n_ctx=256, n_threads=2, **cfg)
    return OpenRequest(model=str(path), config=config, max_block=4, snapshots=0, verify_cost=verify_cost)


def test_open_llama_batch_closes_its_batch_when_the_cost_curve_fails(tiny_llama, contexts, numerics, monkeypatch):
    monkeypatch.setattr(backend, "verify_cost_curve", _boom)
    with pytest.raises(Boom) as failed:
        backend.open_llama_batch(_request(tiny_llama, verify_cost=True), 2)
    assert failed.value is not None  # the traceback (and the opener's frame) is still alive here
    assert contexts and all(_closed(c) for c in contexts)
    assert loading.numerics_guard._open == numerics


def test_open_llama_batch_closes_its_context_when_warm_up_fails(tiny_llama, contexts, numerics, monkeypatch):
    monkeypatch.setattr(backend, "warm_up", _boom)
    with pytest.raises(Boom):
        backend.open_llama_batch(_request(tiny_llama, warmup=True), 2)
    assert contexts and all(_closed(c) for c in contexts)
    assert loading.numerics_guard._open == numerics


def test_open_target_closes_its_context_when_warm_up_fails(tiny_llama, contexts, numerics, monkeypatch):
    monkeypatch.setattr(target, "warm_up", _boom)
    with pytest.raises(Boom):
        target.open_target(tiny_llama, n_ctx=256, max_block=4, snapshots=0, n_threads=2, warmup=True)
    assert contexts and all(_closed(c) for c in contexts)
    assert loading.numerics_guard._open == numerics


def test_open_llama_closes_its_target_when_the_cost_curve_fails(tiny_llama, contexts, numerics, monkeypatch):
    monkeypatch.setattr(backend, "verify_cost_curve", _boom)
    with pytest.raises(Boom):
        backend.open_llama(_request(tiny_llama, verify_cost=True))
    assert contexts and all(_closed(c) for c in contexts)
    assert loading.numerics_guard._open == numerics


def test_open_llama_closes_its_target_when_a_late_step_fails(tiny_llama, contexts, numerics, monkeypatch):
    monkeypatch.setattr(backend, "LlamaTokenizer", _boom)
    with pytest.raises(Boom):
        backend.open_llama(_request(tiny_llama))
    assert contexts and all(_closed(c) for c in contexts)
    assert loading.numerics_guard._open == numerics


def test_open_llama_batch_closes_its_batch_when_a_late_step_fails(tiny_llama, contexts, numerics, monkeypatch):
    monkeypatch.setattr(backend, "LlamaTokenizer", _boom)
    with pytest.raises(Boom):
        backend.open_llama_batch(_request(tiny_llama), 2)
    assert contexts and all(_closed(c) for c in contexts)
    assert loading.numerics_guard._open == numerics


def test_the_draft_model_context_closes_when_warm_up_fails(tiny_llama, contexts, monkeypatch):
    model = loading.load_model(tiny_llama, role="draft")
    monkeypatch.setattr(draft, "warm_up", _boom)
    with pytest.raises(Boom):
        draft.SharedDraftModel(model, n_ctx=256, k_max=4, n_threads=2, warmup=True)
    assert contexts and all(_closed(c) for c in contexts)


# -- the strategy openers, through Session.open (which closes the target when its proposer fails) ---
def _session_open_fails(cfg: PowerConfig, model, draft=None) -> None:
    from power_core.session import Session

    with pytest.raises(Boom):
        Session.open(cfg, model=str(model), draft=str(draft) if draft else None)


def test_a_draft_model_session_closes_both_contexts_when_the_draft_fails(tiny_llama, contexts, numerics,
                                                                          monkeypatch):
    monkeypatch.setattr(draft, "warm_up", _boom)
    _session_open_fails(PowerConfig(spec_mode="draft-model", n_ctx=256, n_threads=2), tiny_llama, tiny_llama)
    assert len(contexts) == 2 and all(_closed(c) for c in contexts)
    assert loading.numerics_guard._open == numerics


def test_a_block_draft_session_closes_both_contexts_when_the_driver_fails(tiny_dir, tiny_llama, contexts,
                                                                           numerics, monkeypatch):
    from native_helpers import make_tiny_draft

    dflash = make_tiny_draft(tiny_dir, tiny_llama, "dflash", name="openers-dflash", d2t=96)
    monkeypatch.setattr(_llama, "BlockDraft", _boom)
    _session_open_fails(PowerConfig(spec_mode="dflash", n_ctx=256, n_threads=2), tiny_llama, dflash)
    assert len(contexts) == 2 and all(_closed(c) for c in contexts)
    assert loading.numerics_guard._open == numerics


def test_an_mtp_session_closes_both_contexts_when_the_head_fails(tiny_qwen35_mtp, contexts, numerics, monkeypatch):
    mtp = pytest.importorskip("power_mtp._mtp")
    monkeypatch.setattr(mtp, "MtpHead", _boom)
    _session_open_fails(PowerConfig(spec_mode="mtp", n_ctx=256, n_threads=2), tiny_qwen35_mtp)
    assert len(contexts) == 2 and all(_closed(c) for c in contexts)
    assert loading.numerics_guard._open == numerics
