"""Per-rule tests of the DFlash v1 validator, including the backbone rules shared with DFlash2/DSpark."""

import pytest
from power_dflash import validate_dflash

from power_core.artifacts import ArtifactView, synthetic
from power_core.errors import ArtifactError


@pytest.fixture
def target(tmp_path):
    return ArtifactView.from_gguf(synthetic.target_spec(mtp=True).write(tmp_path / "t.gguf"))


def draft(spec, tmp_path):
    return ArtifactView.from_gguf(spec.write(tmp_path / "d.gguf"))


def reject(target, spec, tmp_path):
    with pytest.raises(ArtifactError) as ei:
        validate_dflash(target, draft(spec, tmp_path), None)
    return ei.value.code, ei.value.evidence


def test_accepts_v1(target, tmp_path):
    v = validate_dflash(target, draft(synthetic.dflash_spec(), tmp_path), None)
    assert v.mode == "dflash" and v.max_k == 7 and v.facts["target_layers"] == (0, 1)
    assert v.facts["mask_token_id"] == synthetic.MASK_ID


def test_accepts_borrowed_embeddings_with_equal_n_embd(target, tmp_path):
    v = validate_dflash(target, draft(synthetic.dflash_spec(own_embeddings=False), tmp_path), None)
    assert v.facts["own_embeddings"] is False


def test_dspark_offered_as_dflash(target, tmp_path):
    assert reject(target, synthetic.dspark_spec(), tmp_path) == ("contract_is_dspark", "markov_w1.weight")


def test_dflash2_offered_as_dflash(target, tmp_path):
    assert reject(target, synthetic.dflash2_spec(), tmp_path) == ("contract_is_dflash2", "selector_hidden.weight")


@pytest.mark.parametrize("extra", ["blk.0.attn_conv_base", "blk.0.ffn_conv_proj.weight"])
def test_conv_tensor_alone_is_dflash2_evidence(target, tmp_path, extra):
    s = synthetic.dflash_spec()
    s.tensors[extra] = ((synthetic.N_EMBD, 4, 2) if extra.endswith("base") else (synthetic.N_EMBD, 16), "F32")
    assert reject(target, s, tmp_path) == ("contract_is_dflash2", extra)


def test_selector_key_alone_is_dflash2_evidence(target, tmp_path):
    s = synthetic.dflash_spec()
    s.kv["dflash.selector_top_k"] = ("u32", 4)
    assert reject(target, s, tmp_path) == ("contract_is_dflash2", "dflash.selector_top_k")


def test_mtp_in_draft_is_two_mechanisms(target, tmp_path):
    s = synthetic.dflash_spec()
    s.kv["dflash.nextn_predict_layers"] = ("u32", 1)
    assert reject(target, s, tmp_path) == ("draft_mixed_mechanisms", "dflash.nextn_predict_layers")


def test_wrong_arch(target, tmp_path):
    s = synthetic.dflash_spec()
    s.arch = "eagle3"
    assert reject(target, s, tmp_path) == ("contract_wrong_arch", "general.architecture")


@pytest.mark.parametrize("key", ["dflash.target_layers", "dflash.block_count", "dflash.embedding_length",
                                 "dflash.context_length", "dflash.attention.head_count",
                                 "dflash.attention.head_count_kv", "dflash.feed_forward_length",
                                 "dflash.attention.layer_norm_rms_epsilon"])
def test_required_key_missing(target, tmp_path, key):
    s = synthetic.dflash_spec()
    del s.kv[key]
    assert reject(target, s, tmp_path) == ("dflash_key_missing", key)


@pytest.mark.parametrize("layers,evidence", [((0, 2), "dflash.target_layers[1]"), ((5,), "dflash.target_layers[0]")])
def test_target_layer_outside_tappable_layers(target, tmp_path, layers, evidence):
    # qwen35 records no t_layer_inp[n_layer]: with 2 trunk layers only 0 and 1 are tappable (notes §1.4, §7.2)
    s = synthetic.dflash_spec(target_layers=layers)
    assert reject(target, s, tmp_path) == ("dflash_target_layer_out_of_range", evidence)


def test_target_layers_wrong_type_or_repeated(target, tmp_path):
    s = synthetic.dflash_spec()
    s.kv["dflash.target_layers"] = ("arr:f32", [0.0, 1.0])
    assert reject(target, s, tmp_path) == ("dflash_key_invalid", "dflash.target_layers")
    s = synthetic.dflash_spec(target_layers=(1, 1))
    assert reject(target, s, tmp_path) == ("dflash_key_invalid", "dflash.target_layers")


def test_untappable_target_arch(tmp_path):
    t = ArtifactView.from_gguf(synthetic.target_spec(mtp=False, arch="gpt2").write(tmp_path / "t.gguf"))
    assert reject(t, synthetic.dflash_spec(), tmp_path) == ("dflash_target_untappable", "general.architecture")


def test_mask_token(target, tmp_path):
    s = synthetic.dflash_spec()
    del s.kv["tokenizer.ggml.mask_token_id"]
    assert reject(target, s, tmp_path) == ("dflash_mask_token_missing", "tokenizer.ggml.mask_token_id")
    s.kv["tokenizer.ggml.mask_token_id"] = ("u32", synthetic.N_VOCAB)
    assert reject(target, s, tmp_path) == ("dflash_mask_token_out_of_range", "tokenizer.ggml.mask_token_id")


@pytest.mark.parametrize("tensor", ["fc.weight", "enc.output_norm.weight", "output_norm.weight",
                                    "blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.attn_k_norm.weight"])
def test_tensor_missing(target, tmp_path, tensor):
    s = synthetic.dflash_spec()
    del s.tensors[tensor]
    assert reject(target, s, tmp_path) == ("dflash_tensor_missing", tensor)


def test_fc_width_must_match_target_layers(target, tmp_path):
    s = synthetic.dflash_spec()
    s.tensors["fc.weight"] = ((3 * synthetic.N_EMBD, synthetic.N_EMBD), "F32")
    assert reject(target, s, tmp_path) == ("dflash_tensor_shape", "fc.weight")


def test_extra_layer_tensor(target, tmp_path):
    s = synthetic.dflash_spec()
    s.tensors["blk.1.attn_norm.weight"] = ((synthetic.N_EMBD,), "F32")
    assert reject(target, s, tmp_path) == ("dflash_tensor_unexpected", "blk.1.attn_norm.weight")


def test_borrowed_embeddings_need_equal_n_embd(tmp_path):
    t = ArtifactView.from_gguf(synthetic.target_spec(mtp=False, n_embd=32).write(tmp_path / "t.gguf"))
    s = synthetic.dflash_spec(own_embeddings=False, target_n_embd=32)
    assert reject(t, s, tmp_path) == ("dflash_embd_mismatch", "dflash.embedding_length")
    own = synthetic.dflash_spec(own_embeddings=True, target_n_embd=32)  # own embeddings do not help either
    assert reject(t, own, tmp_path) == ("dflash_embd_mismatch", "dflash.embedding_length")


def test_block_size(target, tmp_path):
    s = synthetic.dflash_spec(block_size=1)
    assert reject(target, s, tmp_path) == ("dflash_key_invalid", "dflash.block_size")
    s = synthetic.dflash_spec()
    del s.kv["dflash.block_size"]
    assert validate_dflash(target, draft(s, tmp_path), None).max_k == 15  # runtime default 16


def test_bool_key_type(target, tmp_path):
    s = synthetic.dflash_spec()
    s.kv["dflash.attention.causal"] = ("u32", 1)
    assert reject(target, s, tmp_path) == ("dflash_key_invalid", "dflash.attention.causal")


def test_needs_a_draft(target):
    with pytest.raises(ArtifactError) as ei:
        validate_dflash(target, None, None)
    assert ei.value.code == "draft_missing"
