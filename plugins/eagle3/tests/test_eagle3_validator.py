"""Per-rule tests of the EAGLE3 validator on synthetic files (``synthetic.eagle3_spec``): every invalid
file is rejected with a typed error naming its key or tensor; what llama.cpp's converters write passes."""

import pytest
from power_eagle3 import validate_eagle3

from power_core.artifacts import ArtifactView, synthetic
from power_core.artifacts.contracts import classify_draft
from power_core.artifacts.vocab import compare_vocab
from power_core.errors import ArtifactError, ArtifactMismatch


@pytest.fixture
def target(tmp_path):
    """qwen35, 2 trunk layers + 1 MTP block (n_layer 3): taps 0, 1, and 3 (its final hidden state)."""
    return ArtifactView.from_gguf(synthetic.target_spec(mtp=True).write(tmp_path / "t.gguf"))


def view(spec, tmp_path, name="d.gguf"):
    return ArtifactView.from_gguf(spec.write(tmp_path / name))


def reject(target, spec, tmp_path):
    with pytest.raises(ArtifactError) as ei:
        validate_eagle3(target, view(spec, tmp_path), None)
    return ei.value.code, ei.value.evidence


def test_accepts_own_embeddings(target, tmp_path):
    v = validate_eagle3(target, view(synthetic.eagle3_spec(), tmp_path), None)
    assert v.mode == "eagle3" and v.head is not None
    assert v.head.target_layers == (0, 1, 1) and v.head.own_embeddings and v.head.draft_vocab == synthetic.N_VOCAB
    assert v.facts["target_layers"] == (0, 1, 1) and not v.head.final_tap


def test_accepts_inherited_embeddings_of_equal_width(target, tmp_path):
    v = validate_eagle3(target, view(synthetic.eagle3_spec(own_embeddings=False), tmp_path), None)
    assert not v.head.own_embeddings and not v.head.own_output


def test_accepts_d2t_draft_vocabulary(target, tmp_path):
    d = view(synthetic.eagle3_spec(d2t=96), tmp_path)
    v = validate_eagle3(target, d, None)
    assert v.head.d2t and v.head.draft_vocab == 96
    assert compare_vocab(target, d).mapping == "d2t"


@pytest.mark.parametrize(("residual", "before_fc"), [(True, None), (None, True), (True, True), (False, False)])
def test_accepts_both_norm_flags(target, tmp_path, residual, before_fc):
    v = validate_eagle3(target, view(synthetic.eagle3_spec(norm_before_residual=residual, norm_before_fc=before_fc),
                                     tmp_path), None)
    assert v.head.norm_before_residual is bool(residual) and v.head.norm_before_fc is bool(before_fc)


def test_final_hidden_state_tap(target, tmp_path):
    """An id equal to the target's layer count (3 with the MTP block) is its final hidden state (qwen35 sets it)."""
    v = validate_eagle3(target, view(synthetic.eagle3_spec(target_layers=(0, 1, 3)), tmp_path), None)
    assert v.head.final_tap and v.head.target_n_layer == 3


def test_classified_for_auto_only_as_a_given_draft(tmp_path):
    assert classify_draft(view(synthetic.eagle3_spec(), tmp_path)) == ("eagle3", "general.architecture")


def test_no_draft(target):
    with pytest.raises(ArtifactMismatch) as ei:
        validate_eagle3(target, None, None)
    assert ei.value.code == "draft_missing"


def test_wrong_arch(target, tmp_path):
    assert reject(target, synthetic.dflash_spec(), tmp_path) == ("contract_wrong_arch", "general.architecture")


@pytest.mark.parametrize("layers", [(0, 1), (0, 1, 1, 0), ()])
def test_exactly_three_target_layers(target, tmp_path, layers):
    s = synthetic.eagle3_spec()
    s.kv["eagle3.target_layers"] = ("arr:i32", list(layers)) if layers else ("arr:i32", [])
    if not layers:
        del s.kv["eagle3.target_layers"]
        assert reject(target, s, tmp_path) == ("eagle3_key_missing", "eagle3.target_layers")
    else:
        assert reject(target, s, tmp_path) == ("eagle3_key_invalid", "eagle3.target_layers")


def test_target_layers_wrong_type(target, tmp_path):
    s = synthetic.eagle3_spec()
    s.kv["eagle3.target_layers"] = ("arr:f32", [0.0, 1.0, 1.0])
    assert reject(target, s, tmp_path) == ("eagle3_key_invalid", "eagle3.target_layers")


@pytest.mark.parametrize(("layers", "code", "evidence"), [
    ((0, 1, 4), "eagle3_target_layer_out_of_range", "eagle3.target_layers[2]"),
    ((2, 1, 1), "eagle3_target_layer_out_of_range", "eagle3.target_layers[0]"),  # the MTP block: not recorded
    ((0, -1, 1), "eagle3_target_layer_out_of_range", "eagle3.target_layers[1]"),
])
def test_target_layer_out_of_range(target, tmp_path, layers, code, evidence):
    assert reject(target, synthetic.eagle3_spec(target_layers=layers), tmp_path) == (code, evidence)


def test_final_tap_needs_a_target_that_publishes_it(tmp_path):
    """llama sets no t_h_nextn: an id equal to its layer count would abort llama.cpp."""
    t = ArtifactView.from_gguf(synthetic.target_spec(mtp=False, arch="llama").write(tmp_path / "t.gguf"))
    s = synthetic.eagle3_spec(target_layers=(0, 1, 2))
    assert reject(t, s, tmp_path) == ("eagle3_target_untappable", "eagle3.target_layers[2]")


def test_untappable_target_arch(tmp_path):
    t = ArtifactView.from_gguf(synthetic.target_spec(mtp=False, arch="gpt2").write(tmp_path / "t.gguf"))
    assert reject(t, synthetic.eagle3_spec(), tmp_path) == ("eagle3_target_untappable", "general.architecture")


def test_target_hidden_size_must_be_the_targets_width(target, tmp_path):
    s = synthetic.eagle3_spec()
    s.kv["eagle3.target_hidden_size"] = ("u32", 2 * synthetic.N_EMBD)
    assert reject(target, s, tmp_path) == ("eagle3_target_hidden_mismatch", "eagle3.target_hidden_size")


@pytest.mark.parametrize("key", ["eagle3.target_hidden_size", "eagle3.block_count", "eagle3.embedding_length",
                                 "eagle3.context_length", "eagle3.attention.head_count",
                                 "eagle3.attention.head_count_kv", "eagle3.feed_forward_length",
                                 "eagle3.attention.layer_norm_rms_epsilon"])
def test_required_key_missing(target, tmp_path, key):
    s = synthetic.eagle3_spec()
    del s.kv[key]
    assert reject(target, s, tmp_path) == ("eagle3_key_missing", key)


def test_one_decoder_layer(target, tmp_path):
    s = synthetic.eagle3_spec()
    s.kv["eagle3.block_count"] = ("u32", 2)
    assert reject(target, s, tmp_path) == ("eagle3_key_invalid", "eagle3.block_count")


def test_stray_layer_tensor(target, tmp_path):
    s = synthetic.eagle3_spec()
    s.tensors["blk.1.attn_norm.weight"] = ((synthetic.N_EMBD,), "F32")
    assert reject(target, s, tmp_path) == ("eagle3_tensor_unexpected", "blk.1.attn_norm.weight")


@pytest.mark.parametrize("key", ["eagle3.norm_before_residual", "eagle3.norm_before_fc"])
def test_norm_flags_are_bools(target, tmp_path, key):
    s = synthetic.eagle3_spec()
    s.kv[key] = ("u32", 1)
    assert reject(target, s, tmp_path) == ("eagle3_key_invalid", key)


def test_norm_before_fc_needs_enc_output_norm(target, tmp_path):
    s = synthetic.eagle3_spec(norm_before_fc=True)
    del s.tensors["enc.output_norm.weight"]
    assert reject(target, s, tmp_path) == ("eagle3_tensor_missing", "enc.output_norm.weight")
    s = synthetic.eagle3_spec(norm_before_fc=True)
    s.tensors["enc.output_norm.weight"] = ((synthetic.N_EMBD,), "F32")
    assert reject(target, s, tmp_path) == ("eagle3_tensor_shape", "enc.output_norm.weight")


def test_enc_output_norm_without_norm_before_fc(target, tmp_path):
    s = synthetic.eagle3_spec(norm_before_fc=False)
    s.tensors["enc.output_norm.weight"] = ((3 * synthetic.N_EMBD,), "F32")
    assert reject(target, s, tmp_path) == ("eagle3_tensor_unexpected", "enc.output_norm.weight")


@pytest.mark.parametrize("tensor", ["fc.weight", "output_norm.weight", "blk.0.attn_norm.weight",
                                    "blk.0.attn_norm_2.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"])
def test_tensor_missing(target, tmp_path, tensor):
    s = synthetic.eagle3_spec()
    del s.tensors[tensor]
    assert reject(target, s, tmp_path) == ("eagle3_tensor_missing", tensor)


def test_fc_fuses_three_target_rows(target, tmp_path):
    s = synthetic.eagle3_spec()
    s.tensors["fc.weight"] = ((2 * synthetic.N_EMBD, synthetic.N_EMBD), "F32")
    assert reject(target, s, tmp_path) == ("eagle3_tensor_shape", "fc.weight")


def test_attention_takes_embed_and_g(target, tmp_path):
    s = synthetic.eagle3_spec()
    s.tensors["blk.0.attn_q.weight"] = ((synthetic.N_EMBD, synthetic.N_EMBD), "F32")
    assert reject(target, s, tmp_path) == ("eagle3_tensor_shape", "blk.0.attn_q.weight")


@pytest.mark.parametrize("drop", ["token_embd.weight", "output.weight"])
def test_narrower_draft_cannot_inherit(target, tmp_path, drop):
    """llama.cpp aborts on a draft narrower than the target that inherits its embeddings or output."""
    s = synthetic.eagle3_spec(n_embd=32)
    del s.tensors[drop]
    assert reject(target, s, tmp_path) == ("eagle3_embd_mismatch", "eagle3.embedding_length")


def test_narrower_draft_with_own_embeddings_passes(target, tmp_path):
    v = validate_eagle3(target, view(synthetic.eagle3_spec(n_embd=32), tmp_path), None)
    assert v.head.n_embd == 32


def test_own_token_embd_covers_the_target_vocabulary(target, tmp_path):
    s = synthetic.eagle3_spec()
    s.tensors["token_embd.weight"] = ((synthetic.N_EMBD, 64), "F32")
    assert reject(target, s, tmp_path) == ("eagle3_tensor_shape", "token_embd.weight")


def test_reduced_output_without_d2t(target, tmp_path):
    s = synthetic.eagle3_spec()
    s.tensors["output.weight"] = ((synthetic.N_EMBD, 96), "F32")
    assert reject(target, s, tmp_path) == ("eagle3_tensor_shape", "output.weight")


def test_d2t_length_is_the_output_rows(target, tmp_path):
    s = synthetic.eagle3_spec(d2t=96)
    s.tensors["output.weight"] = ((synthetic.N_EMBD, 80), "F32")
    assert reject(target, s, tmp_path) == ("d2t_invalid", "d2t")
    s = synthetic.eagle3_spec(d2t=96, own_embeddings=False)  # inherited output: one id per target row
    assert reject(target, s, tmp_path) == ("d2t_invalid", "d2t")


@pytest.mark.parametrize(("ids", "evidence"), [([5, 5, *range(2, 96)], "d2t"), ([0, 200, *range(2, 96)], "d2t[1]")])
def test_d2t_ids_unique_and_in_range(target, tmp_path, ids, evidence):
    s = synthetic.eagle3_spec(d2t=96)
    import numpy as np

    s.data["d2t"] = np.asarray(ids, dtype=np.int64)
    d = view(s, tmp_path)
    validate_eagle3(target, d, None)  # the contract's shape rules hold; the ids are the vocabulary check's
    with pytest.raises(ArtifactError) as ei:
        compare_vocab(target, d)
    assert (ei.value.code, ei.value.evidence) == ("d2t_invalid", evidence)


def test_tokenizer_must_match_the_targets(target, tmp_path):
    s = synthetic.eagle3_spec()
    s.kv["tokenizer.ggml.tokens"] = ("arr:str", [f"other_{i}" for i in range(synthetic.N_VOCAB)])
    d = view(s, tmp_path)
    with pytest.raises(ArtifactError) as ei:
        compare_vocab(target, d)
    assert ei.value.code == "vocab_token_mismatch" and ei.value.evidence == "tokenizer.ggml.tokens[0]"


def test_mtp_layers_in_the_draft(target, tmp_path):
    s = synthetic.eagle3_spec()
    s.kv["eagle3.nextn_predict_layers"] = ("u32", 1)
    assert reject(target, s, tmp_path) == ("draft_mixed_mechanisms", "eagle3.nextn_predict_layers")


def test_accepts_what_the_converter_writes(target, tmp_path):
    """convert_hf_to_gguf.py (EAGLE3 and speculators checkpoints alike): vocab_size, rope keys, an explicit
    head size other than n_embd / n_head (key_length = value_length), llama3 rope_freqs, a d2t table."""
    s = synthetic.eagle3_spec(d2t=96, norm_before_residual=False, norm_before_fc=False)
    n = synthetic.N_EMBD
    s.kv["eagle3.rope.dimension_count"] = ("u32", 48)
    s.kv["eagle3.rope.freq_base"] = ("f32", 500000.0)
    s.kv["eagle3.attention.key_length"] = ("u32", 48)
    s.kv["eagle3.attention.value_length"] = ("u32", 48)
    s.tensors["rope_freqs.weight"] = ((24,), "F32")
    s.tensors["blk.0.attn_q.weight"] = ((2 * n, 2 * 48), "F32")
    s.tensors["blk.0.attn_k.weight"] = ((2 * n, 48), "F32")
    s.tensors["blk.0.attn_v.weight"] = ((2 * n, 48), "F32")
    s.tensors["blk.0.attn_output.weight"] = ((2 * 48, n), "F32")
    v = validate_eagle3(target, view(s, tmp_path), None)
    assert v.head.d2t and not v.head.norm_before_fc
    s.kv["eagle3.attention.value_length"] = ("u32", 32)
    assert reject(target, s, tmp_path) == ("eagle3_key_invalid", "eagle3.attention.key_length")
