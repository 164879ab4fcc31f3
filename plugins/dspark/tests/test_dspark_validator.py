"""Per-rule tests of the DSpark validator."""

import pytest
from power_dspark import validate_dspark

from power_core.artifacts import ArtifactView, synthetic
from power_core.errors import ArtifactError

E, V = synthetic.N_EMBD, synthetic.N_VOCAB


@pytest.fixture
def target(tmp_path):
    return ArtifactView.from_gguf(synthetic.target_spec(mtp=True).write(tmp_path / "t.gguf"))


def accept(target, spec, tmp_path):
    return validate_dspark(target, ArtifactView.from_gguf(spec.write(tmp_path / "d.gguf")), None)


def reject(target, spec, tmp_path):
    with pytest.raises(ArtifactError) as ei:
        accept(target, spec, tmp_path)
    return ei.value.code, ei.value.evidence


def test_accepts_dspark_with_and_without_confidence(target, tmp_path):
    v = accept(target, synthetic.dspark_spec(), tmp_path)
    assert v.mode == "dspark" and v.max_k == 8 and v.facts["confidence_head"] is False
    v = accept(target, synthetic.dspark_spec(confidence=True), tmp_path)
    assert v.facts["confidence_head"] is True and v.facts["markov_rank"] == 16


def test_anchor_off_reduces_k(target, tmp_path):
    s = synthetic.dspark_spec()
    s.kv["dflash.sample_from_anchor"] = ("bool", False)
    assert accept(target, s, tmp_path).max_k == 7


def test_v1_offered_as_dspark(target, tmp_path):
    assert reject(target, synthetic.dflash_spec(), tmp_path) == ("contract_is_dflash_v1", "markov_w1.weight")


def test_dflash2_offered_as_dspark(target, tmp_path):
    assert reject(target, synthetic.dflash2_spec(), tmp_path) == ("contract_is_dflash2", "markov_w1.weight")


def test_markov_plus_selector_is_two_mechanisms(target, tmp_path):
    s = synthetic.dspark_spec()
    s.tensors["selector_hidden.weight"] = ((E, 16), "F32")
    assert reject(target, s, tmp_path) == ("draft_mixed_mechanisms", "selector_hidden.weight")


def test_markov_w2_missing_or_wrong_rank(target, tmp_path):
    s = synthetic.dspark_spec()
    del s.tensors["markov_w2.weight"]
    assert reject(target, s, tmp_path) == ("dspark_tensor_missing", "markov_w2.weight")
    s.tensors["markov_w2.weight"] = ((8, V), "F32")
    assert reject(target, s, tmp_path) == ("dspark_tensor_shape", "markov_w2.weight")


def test_markov_w1_vocab(target, tmp_path):
    s = synthetic.dspark_spec()
    s.tensors["markov_w1.weight"] = ((16, V - 1), "F32")
    assert reject(target, s, tmp_path) == ("dspark_tensor_shape", "markov_w1.weight")


def test_confidence_flag_true_without_head(target, tmp_path):
    s = synthetic.dspark_spec()
    s.kv["dflash.has_confidence_head"] = ("bool", True)
    assert reject(target, s, tmp_path) == ("dspark_confidence_inconsistent", "conf_proj.weight")


def test_confidence_flag_false_with_head(target, tmp_path):
    s = synthetic.dspark_spec(confidence=True)
    s.kv["dflash.has_confidence_head"] = ("bool", False)
    assert reject(target, s, tmp_path) == ("dspark_confidence_inconsistent", "conf_proj.weight")


def test_confidence_bias_without_weight(target, tmp_path):
    s = synthetic.dspark_spec(confidence=True)
    del s.kv["dflash.has_confidence_head"]
    del s.tensors["conf_proj.weight"]
    assert reject(target, s, tmp_path) == ("dspark_confidence_inconsistent", "conf_proj.bias")


def test_confidence_shape(target, tmp_path):
    s = synthetic.dspark_spec(confidence=True)
    s.tensors["conf_proj.weight"] = ((E, 1), "F32")  # must be n_embd + rank
    assert reject(target, s, tmp_path) == ("dspark_tensor_shape", "conf_proj.weight")


def test_confidence_flag_wrong_type(target, tmp_path):
    s = synthetic.dspark_spec()
    s.kv["dflash.has_confidence_head"] = ("str", "false")
    assert reject(target, s, tmp_path) == ("dspark_key_invalid", "dflash.has_confidence_head")


def test_backbone_rule_with_dspark_prefix(target, tmp_path):
    s = synthetic.dspark_spec(target_layers=(0, 2))
    assert reject(target, s, tmp_path) == ("dflash_target_layer_out_of_range", "dflash.target_layers[1]")
    s = synthetic.dspark_spec()
    del s.kv["tokenizer.ggml.mask_token_id"]
    assert reject(target, s, tmp_path) == ("dspark_mask_token_missing", "tokenizer.ggml.mask_token_id")
