"""Bounded inspection: valid fixtures, the malformed corpus, lying 2 GB sparse files."""

import struct
import tracemalloc

import numpy as np
import pytest
from artifact_helpers import Timer, rchar

from power_core.artifacts import ArtifactView, synthetic
from power_core.artifacts.reader import Limits
from power_core.errors import ArtifactError


def test_valid_fixtures_parse(fixtures_dir):
    v = ArtifactView.from_gguf(fixtures_dir["target_mtp"])
    assert v.architecture == "qwen35"
    assert v.metadata["qwen35.nextn_predict_layers"] == 1
    assert v.shape("blk.2.nextn.eh_proj.weight") == (2 * synthetic.N_EMBD, synthetic.N_EMBD)
    assert v.tensors["token_embd.weight"].ggml_type == "F32"
    assert v.vocab.n_tokens == synthetic.N_VOCAB and v.vocab.model == "test" and v.vocab.pre == "default"
    assert v.vocab.tokens[5] == "tok_5" and v.vocab.token_types[1] == 3
    assert v.vocab.special == {"bos": 1, "eos": 2}
    d = ArtifactView.from_gguf(fixtures_dir["dflash2"])
    assert d.metadata["dflash.target_layers"] == (0, 1)
    assert d.value_types["dflash.target_layers"] == "ARRAY[INT32]"
    assert d.shape("blk.0.attn_conv_base") == (synthetic.N_EMBD, 4, 2)
    assert d.vocab.special["mask"] == synthetic.MASK_ID


def test_view_is_frozen_and_long_arrays_summarised(fixtures_dir, tmp_path):
    import attrs

    v = ArtifactView.from_gguf(fixtures_dir["dflash"])
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        v.architecture = "x"
    spec = synthetic.target_spec(mtp=False, n_vocab=5000)
    big = ArtifactView.from_gguf(spec.write(tmp_path / "big.gguf"))
    s = big.metadata["tokenizer.ggml.tokens"]
    assert s.length == 5000 and s.element_type == "STRING"
    assert big.vocab.n_tokens == 5000  # the vocabulary keeps every token


def test_read_tensor_bounded(fixtures_dir):
    v = ArtifactView.from_gguf(fixtures_dir["dflash"])
    a = v.read_tensor("enc.output_norm.weight")
    assert a.shape == (synthetic.N_EMBD,) and a.dtype == np.float32
    with pytest.raises(ArtifactError) as ei:
        v.read_tensor("fc.weight", max_bytes=16)
    assert ei.value.code == "tensor_too_large"


@pytest.mark.parametrize("role", ["target_mtp", "dflash"])
def test_malformed_corpus_typed_reasons(fixtures_dir, tmp_path, role):
    corpus = synthetic.malformed_corpus(fixtures_dir[role], tmp_path / "bad")
    assert len(corpus) >= 30
    for name, (path, expected) in corpus.items():
        with pytest.raises(ArtifactError) as ei:
            ArtifactView.from_gguf(path)
        code = ei.value.code
        assert code.startswith("gguf_"), (name, code)
        if expected is not None:
            assert code in expected.split("|"), (name, code, str(ei.value))
        assert ei.value.evidence, name


def test_missing_and_non_regular_files(tmp_path):
    with pytest.raises(ArtifactError) as ei:
        ArtifactView.from_gguf(tmp_path / "nope.gguf")
    assert ei.value.code == "file_not_found"
    with pytest.raises(ArtifactError) as ei:
        ArtifactView.from_gguf(tmp_path)
    assert ei.value.code == "not_a_file"


def test_limits_are_enforced(fixtures_dir):
    with pytest.raises(ArtifactError) as ei:
        ArtifactView.from_gguf(fixtures_dir["dflash"], limits=Limits(max_header_bytes=1024))
    assert ei.value.code == "gguf_header_too_large"
    with pytest.raises(ArtifactError) as ei:
        ArtifactView.from_gguf(fixtures_dir["dflash"], limits=Limits(max_array_len=10))
    assert ei.value.code == "gguf_count_too_large"


@pytest.mark.parametrize("lie,code", [
    ("offset", "gguf_tensor_out_of_bounds"),
    ("shape", "gguf_tensor_out_of_bounds"),
    ("overlap", "gguf_tensor_overlap"),
    ("count", None),
])
def test_2gb_sparse_file_with_lying_tensor_table(fixtures_dir, tmp_path, lie, code):
    size = 2 << 30
    path = synthetic.make_sparse_lie(fixtures_dir["target_mtp"], tmp_path / f"sparse-{lie}.gguf", size=size, lie=lie)
    assert path.stat().st_size == size
    before = rchar()
    tracemalloc.start()
    try:
        with Timer() as t, pytest.raises(ArtifactError) as ei:
            ArtifactView.from_gguf(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    after = rchar()
    assert ei.value.code.startswith("gguf_")
    if code is not None:
        assert ei.value.code == code, str(ei.value)
    assert t.elapsed < 2.0
    assert peak < 32 << 20
    if before is not None and after is not None:
        assert after - before < 16 << 20  # read the header window, not the 2 GB


def test_gguf_big_value_lies_do_not_allocate(tmp_path):
    """A string or array length that exceeds the file is refused before any allocation."""
    raw = synthetic.encode_gguf([("general.architecture", 8, struct.pack("<Q", 1 << 40) + b"qwen")], [])
    p = tmp_path / "lie.gguf"
    p.write_bytes(raw)
    tracemalloc.start()
    try:
        with pytest.raises(ArtifactError) as ei:
            ArtifactView.from_gguf(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ei.value.code in ("gguf_bad_string", "gguf_truncated")
    assert peak < 4 << 20
