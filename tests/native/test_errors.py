"""Bad input never aborts the process: each case is a typed error with a clear message."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

from native_helpers import write_metadata  # noqa: E402
from power_native import _llama  # noqa: E402
from power_native.loading import load_model
from power_native.target import open_target  # noqa: E402

from power_core.errors import ArtifactError, CapacityError, ConfigError, RuntimeFault  # noqa: E402

pytestmark = pytest.mark.native


def _reason(exc_info) -> str:
    return exc_info.value.reason


def test_missing_file(tmp_path):
    with pytest.raises(ArtifactError, match="no such file") as ei:
        load_model(tmp_path / "nope.gguf")
    assert _reason(ei) == "file_not_found"


def test_directory(tmp_path):
    with pytest.raises(ArtifactError, match="not a regular file") as ei:
        load_model(tmp_path)
    assert _reason(ei) == "not_a_file"


@pytest.mark.parametrize("data", [b"", b"GG", b"PK\x03\x04 this is a zip, not a model" * 4, b"\x00" * 64])
def test_not_gguf(tmp_path, data):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(ArtifactError) as ei:
        load_model(p)
    assert _reason(ei) in ("gguf_bad_magic", "gguf_truncated")


@pytest.mark.parametrize("cut", [10, 30, 2000, 0.5, 0.99])
def test_truncated(tmp_path, tiny_llama, cut):
    data = tiny_llama.read_bytes()
    n = int(len(data) * cut) if isinstance(cut, float) else cut
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(ArtifactError) as ei:
        load_model(p)
    assert _reason(ei).startswith("gguf_")  # truncated, count larger than the file, tensor out of bounds


def test_bad_version(tmp_path, tiny_llama):
    data = bytearray(tiny_llama.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    p = tmp_path / "v99.gguf"
    p.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="version 99"):
        load_model(p)


def test_unknown_architecture(tmp_path):
    p = write_metadata(tmp_path / "alien.gguf", "alienformer")
    with pytest.raises(ArtifactError, match="alienformer") as ei:
        load_model(p)
    assert _reason(ei) == "arch_unknown"


@pytest.mark.parametrize("arch,reason", [("gptj", "arch_unknown"), ("", "arch_missing")])
def test_architecture_checked_before_llama_cpp(tmp_path, arch, reason):
    p = write_metadata(tmp_path / "a.gguf", arch or "llama")  # gptj: named by llama.cpp, but no model class
    if not arch:  # rename the key in place (same length): a well-formed file without general.architecture
        p.write_bytes(p.read_bytes().replace(b"general.architecture", b"general.architecturX", 1))
    with pytest.raises(ArtifactError, match="general.architecture" if not arch else "gptj") as ei:
        load_model(p, role="draft")
    assert _reason(ei) == reason and ei.value.evidence == "general.architecture"


def test_missing_tensors_is_a_load_failure(tmp_path):
    p = write_metadata(tmp_path / "empty-llama.gguf", "llama")  # valid header, no tensors
    with pytest.raises(ArtifactError) as ei:
        load_model(p)
    assert _reason(ei) == "gguf_load_failed"


def test_ubatch_not_above_snapshots(tiny_qwen35):
    m = _llama.Model.load(str(tiny_qwen35))
    with pytest.raises(ConfigError, match="n_rs_seq"):
        _llama.Context(m, n_ctx=256, n_batch=8, n_ubatch=5, n_rs_seq=4)
    ctx = _llama.Context(m, n_ctx=256, n_batch=8, n_ubatch=6, n_rs_seq=4)
    assert ctx.n_rs_seq == 4


def test_snapshots_clamped_for_attention_models(tiny_llama):
    t = open_target(tiny_llama, n_ctx=256, max_block=8, snapshots=7)
    assert t.ctx.n_rs_seq == 0 and t.capabilities.rollback_window is None


def test_batch_and_output_limits(tiny_llama):
    m = _llama.Model.load(str(tiny_llama))
    ctx = _llama.Context(m, n_ctx=256, n_batch=8, n_outputs_max=2)
    with pytest.raises(CapacityError, match="n_batch"):
        ctx.decode(np.zeros(9, dtype=np.int32), 0)
    with pytest.raises(CapacityError, match="n_outputs_max"):
        ctx.decode(np.zeros(3, dtype=np.int32), 0)
    assert ctx.decode(np.zeros(3, dtype=np.int32), 0, all_outputs=False) == 1
    with pytest.raises(CapacityError, match="vocabulary"):
        ctx.decode(np.array([-1], dtype=np.int32), 3)
    with pytest.raises(CapacityError, match="overflow"):
        ctx.decode(np.zeros(2, dtype=np.int32), ctx.n_ctx - 1, all_outputs=False)
    with pytest.raises(ConfigError, match="n_outputs_max"):
        _llama.Context(m, n_ctx=256, n_batch=8, n_outputs_max=9)


def test_layer_taps_prechecked(tiny_llama, tiny_qwen35):
    m = _llama.Model.load(str(tiny_qwen35))
    ctx = _llama.Context(m, n_ctx=256, n_batch=8, n_ubatch=8)
    with pytest.raises(ConfigError, match="layer"):
        ctx.set_embeddings_layer_inp(m.n_layer)  # qwen35 does not record the last layer's output
    with pytest.raises(RuntimeFault, match="not tapped"):
        ctx.embeddings_layer_inp(0)
    ctx.set_embeddings_layer_inp(1)
    ctx.decode(np.arange(4, dtype=np.int32), 0)
    rows = ctx.embeddings_layer_inp(1)
    assert rows.shape == (4, m.n_embd) and np.isfinite(rows).all()


def test_tap_table_is_the_validators_and_spells_arch_names(tiny_dir):
    """One tap table (power_core.artifacts.archs, generated from the pinned source) for the validator
    and this call: a ``hunyuan_vl`` target, which the DFlash/DSpark validator accepts, is tapped here
    (the native copy once spelt it ``hunyuan-vl`` and refused it)."""
    from power_core.artifacts import archs, contracts

    assert _llama.LAYER_INP_ARCHS is archs.LAYER_INPUT_ARCHS is contracts.LAYER_INPUT_ARCHS
    assert _llama.LAYER_INP_FINAL_ARCHS is archs.FINAL_TAP_ARCHS is contracts.FINAL_TAP_ARCHS
    meta = write_metadata(tiny_dir / "hunyuan_vl-meta.gguf", "hunyuan_vl")
    m = _llama.Model.from_metadata(str(meta), seed=1, stdev=0.1)
    assert m.arch == "hunyuan_vl" and m.arch in contracts.LAYER_INPUT_ARCHS
    ctx = _llama.Context(m, n_ctx=256, n_batch=8, n_ubatch=8)
    with pytest.raises(ConfigError, match="record the output of the last layer"):
        ctx.set_embeddings_layer_inp(m.n_layer)
    ctx.set_embeddings_layer_inp(m.n_layer - 1)
    ctx.decode(np.arange(4, dtype=np.int32), 0)
    rows = ctx.embeddings_layer_inp(m.n_layer - 1)
    assert rows.shape == (4, m.n_embd) and np.isfinite(rows).all()


def test_mtp_context_needs_nextn(tiny_llama):
    m = _llama.Model.load(str(tiny_llama))
    with pytest.raises(ArtifactError, match="nextn"):
        _llama.Context(m, n_ctx=256, n_batch=8, ctx_type=1)


def test_closed_context(tiny_llama):
    m = _llama.Model.load(str(tiny_llama))
    ctx = _llama.Context(m, n_ctx=256, n_batch=8)
    ctx.close()
    with pytest.raises(RuntimeFault, match="closed"):
        ctx.decode(np.zeros(1, dtype=np.int32), 0)
