"""Config ``verify_capacity`` on the pinned llama.cpp: every target pass is padded to exactly B tokens
(``decode_multi`` with no logits rows for the padding, whose KV cells are removed before ``decode``
returns); with the exact (batch-invariant) kernels the rows, the memory and the output are the
unpadded ones, bit for bit, for target-only decoding, suffix, draft-model and the DFlash family.
Recurrent and hybrid targets (MTP's included) are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

from native_helpers import make_tiny, make_tiny_draft  # noqa: E402
from power_native.target import open_target  # noqa: E402

from power_core.config import PowerConfig  # noqa: E402
from power_core.errors import CapacityError, ConfigError  # noqa: E402
from power_core.session import Session  # noqa: E402

pytestmark = pytest.mark.native

PROMPT = [1, 17, 42, 99, 5, 63, 8, 17, 42, 99, 5]


def generate(model: Path | str | None, mode: str, prompt: list[int] | str, draft: Path | None = None, **cfg):
    base = dict(spec_mode=mode, max_tokens=32, n_ctx=256, n_threads=2)
    base.update(cfg)
    with Session.open(PowerConfig(**base), model=str(model) if model else None,
                      draft=str(draft) if draft else None) as s:
        tokens = s.opened.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return s.generate(tokens)


def assert_padded_equals_unpadded(model, mode, prompt, draft=None, b=8, **cfg):
    plain = generate(model, mode, prompt, draft, **cfg)
    padded = generate(model, mode, prompt, draft, verify_capacity=b, **cfg)
    assert padded.tokens == plain.tokens, (mode, cfg)
    passes = padded.receipt.timings["target_passes"]
    assert padded.receipt.backend["verify_widths"] == {str(b): passes}
    assert padded.receipt.backend["verify_capacity"] == b and padded.receipt.backend["n_ctx"] == \
        plain.receipt.backend["n_ctx"]
    return plain, padded


def test_rows_and_memory_are_the_unpadded_ones(tiny_llama):
    plain = open_target(tiny_llama, n_ctx=64, max_block=8, snapshots=0, n_threads=2)
    padded = open_target(tiny_llama, n_ctx=64, max_block=8, snapshots=0, n_threads=2, verify_capacity=8)
    try:
        assert padded.capabilities.verify_capacity == 8 and padded.capabilities.n_ctx == plain.capabilities.n_ctx
        rng = np.random.default_rng(1)
        n_vocab = plain.capabilities.n_vocab
        for t in (plain, padded):
            t.prefill(np.arange(1, 12, dtype=np.int32))
        for n in (1, 4, 8, 3, 6):
            block = rng.integers(1, n_vocab, n).astype(np.int32)
            cps = [t.checkpoint() for t in (plain, padded)]
            a = np.array(plain.decode(block).logits)
            b = np.array(padded.decode(block).logits)
            assert b.shape == (n, n_vocab) and a.tobytes() == b.tobytes(), n
            assert plain.n_past == padded.n_past
            keep = max(1, n - 2)  # reject the last rows, as a round does
            assert plain.rollback(cps[0], keep) and padded.rollback(cps[1], keep)
        # the padding left nothing behind: the next rows still agree after rollbacks
        a = np.array(plain.decode(np.array([7], dtype=np.int32)).logits)
        assert a.tobytes() == np.array(padded.decode(np.array([7], dtype=np.int32)).logits).tobytes()
        with pytest.raises(CapacityError):
            padded.decode(np.ones(9, dtype=np.int32))
    finally:
        plain.close()
        padded.close()


def test_off_and_suffix_on_tiny_llama(tiny_llama):
    assert_padded_equals_unpadded(tiny_llama, "off", PROMPT, b=4)
    assert_padded_equals_unpadded(tiny_llama, "suffix", PROMPT, spec_draft_max=7)


def test_draft_model(tiny_llama, tiny_dir):
    other = make_tiny(tiny_dir, "llama", seed=7, name="llama-seed7-pad")
    plain, _ = assert_padded_equals_unpadded(tiny_llama, "draft-model", PROMPT, other, spec_draft_max=4)
    assert plain.receipt.summary()["accepted"] < plain.receipt.summary()["proposed"]  # rejections were padded
    assert_padded_equals_unpadded(tiny_llama, "draft-model", PROMPT, tiny_llama, b=6, spec_draft_max=5)


@pytest.mark.parametrize(("mode", "kw"), [("dflash", dict(kind="dflash", d2t=96)),
                                          ("dflash2", dict(kind="dflash2", borrow=True)),
                                          ("dspark", dict(kind="dspark", block_size=16))])
def test_block_drafters(tiny_llama, tiny_dir, mode, kw):
    draft = make_tiny_draft(tiny_dir, tiny_llama, name=f"llama-{mode}-pad", **kw)
    assert_padded_equals_unpadded(tiny_llama, mode, PROMPT, draft, b=8, spec_draft_max=7)


@pytest.mark.parametrize("model", [None, "gemma3-270m"])  # SmolLM2; Gemma-3: sliding window, K-quants
def test_real_models_off_and_suffix(model):
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    assert_padded_equals_unpadded(model, "off", prompt, b=8, max_tokens=16)
    assert_padded_equals_unpadded(model, "suffix", prompt, b=8, max_tokens=24)


def test_recurrent_and_mtp_targets_are_refused(tiny_qwen35, tiny_qwen35_mtp):
    for model, mode in ((tiny_qwen35, "off"), (tiny_qwen35_mtp, "mtp")):
        with pytest.raises(ConfigError, match="recurrent or hybrid") as err:
            generate(model, mode, PROMPT, verify_capacity=8, **({"spec_draft_max": 3} if mode == "mtp" else {}))
        assert err.value.key == "verify_capacity"


def test_batched_engine_is_refused(tiny_llama):
    with pytest.raises(ConfigError, match="verify_capacity") as err:
        Session.open_batch(2, PowerConfig(spec_mode="off", verify_capacity=4, n_ctx=256, n_threads=2),
                           model=str(tiny_llama))
    assert err.value.key == "parallel"


def test_session_selftest_probes_the_padded_target(tiny_llama):
    with Session.open(PowerConfig(spec_mode="off", verify_capacity=8, selftest=True, n_ctx=512, n_threads=2),
                      model=str(tiny_llama)) as s:
        report = s.numerics
        assert report is not None and report.identical
        assert {p["width"] for p in report.probes} == {2, 4, 8}


def test_padded_cost_curve_is_cached_apart():
    from power_native.backend import _cost_cache

    assert _cost_cache("d", 2, 8, "exact", 8) != _cost_cache("d", 2, 8, "exact", 0)
