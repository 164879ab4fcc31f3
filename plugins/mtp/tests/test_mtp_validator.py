"""Per-rule tests of the MTP validator (reason code + evidence for each rule)."""

import pytest
from power_mtp import validate_mtp

from power_core.artifacts import ArtifactView, synthetic
from power_core.config import PowerConfig
from power_core.errors import ArtifactError


def view(spec, tmp_path, name="t.gguf"):
    return ArtifactView.from_gguf(spec.write(tmp_path / name))


def reject(tmp_path, spec, config=None, draft=None):
    with pytest.raises(ArtifactError) as ei:
        validate_mtp(view(spec, tmp_path), draft, config)
    return ei.value.code, ei.value.evidence


def test_accepts_valid_target(tmp_path):
    v = validate_mtp(view(synthetic.target_spec(mtp=True), tmp_path), None, PowerConfig(spec_mode="mtp"))
    assert v.mode == "mtp" and v.facts["n_nextn"] == 1 and v.facts["n_trunk"] == 2 and v.max_k is None


def test_accepts_two_blocks_and_fr_prefix(tmp_path):
    v = validate_mtp(view(synthetic.target_spec(n_nextn=2), tmp_path), None,
                     PowerConfig(spec_mode="mtp", spec_mtp_fr_vocab_size=64))
    assert v.facts["n_nextn"] == 2 and v.facts["fr_vocab_size"] == 64


def test_no_nextn(tmp_path):
    assert reject(tmp_path, synthetic.target_spec(mtp=False)) == ("mtp_no_nextn", "qwen35.nextn_predict_layers")
    s = synthetic.target_spec()
    s.kv["qwen35.nextn_predict_layers"] = ("u32", 0)
    assert reject(tmp_path, s)[0] == "mtp_no_nextn"


def test_arch_without_mtp_graph(tmp_path):
    s = synthetic.target_spec(arch="llama")
    assert reject(tmp_path, s) == ("mtp_arch_unsupported", "general.architecture")


def test_nextn_not_below_block_count(tmp_path):
    s = synthetic.target_spec()
    s.kv["qwen35.nextn_predict_layers"] = ("u32", 3)
    assert reject(tmp_path, s) == ("mtp_key_invalid", "qwen35.nextn_predict_layers")


def test_block_count_missing(tmp_path):
    s = synthetic.target_spec()
    del s.kv["qwen35.block_count"]
    assert reject(tmp_path, s) == ("mtp_key_missing", "qwen35.block_count")


def test_single_block_arch(tmp_path):
    s = synthetic.target_spec(arch="nemotron_h_moe", n_nextn=2)
    assert reject(tmp_path, s)[0] == "mtp_too_many_blocks"


@pytest.mark.parametrize("tensor", ["blk.2.nextn.eh_proj.weight", "blk.2.nextn.enorm.weight",
                                    "blk.2.nextn.hnorm.weight", "blk.2.attn_norm.weight"])
def test_missing_nextn_tensor(tmp_path, tensor):
    s = synthetic.target_spec()
    del s.tensors[tensor]
    assert reject(tmp_path, s) == ("mtp_tensor_missing", tensor)


def test_eh_proj_shape(tmp_path):
    s = synthetic.target_spec()
    s.tensors["blk.2.nextn.eh_proj.weight"] = ((synthetic.N_EMBD, synthetic.N_EMBD), "F32")
    assert reject(tmp_path, s) == ("mtp_tensor_shape", "blk.2.nextn.eh_proj.weight")


def test_inconsistent_blocks(tmp_path):
    s = synthetic.target_spec(n_nextn=2)
    del s.tensors["blk.3.nextn.shared_head_norm.weight"]
    assert reject(tmp_path, s) == ("mtp_tensor_inconsistent", "blk.3.nextn.shared_head_norm.weight")


def test_nextn_tensor_in_trunk_block(tmp_path):
    s = synthetic.target_spec()
    s.tensors["blk.0.nextn.enorm.weight"] = ((synthetic.N_EMBD,), "F32")
    assert reject(tmp_path, s) == ("mtp_tensor_unexpected", "blk.0.nextn.enorm.weight")


def test_per_layer_array_length_and_recurrent_mtp_block(tmp_path):
    s = synthetic.target_spec()
    s.kv["qwen35.attention.recurrent_layers"] = ("arr:u8", [1, 0])  # the saver bug: trunk layers only
    assert reject(tmp_path, s) == ("mtp_layer_array_length", "qwen35.attention.recurrent_layers")
    s.kv["qwen35.attention.recurrent_layers"] = ("arr:u8", [1, 0, 1])
    assert reject(tmp_path, s) == ("mtp_block_recurrent", "qwen35.attention.recurrent_layers[2]")


def test_fr_prefix_larger_than_vocab(tmp_path):
    cfg = PowerConfig(spec_mode="mtp", spec_mtp_fr_vocab_size=synthetic.N_VOCAB + 1)
    assert reject(tmp_path, synthetic.target_spec(), cfg) == ("mtp_fr_vocab_too_large", "spec_mtp_fr_vocab_size")


def test_draft_with_mtp_is_two_mechanisms(tmp_path):
    d = view(synthetic.dflash_spec(), tmp_path, "d.gguf")
    assert reject(tmp_path, synthetic.target_spec(), draft=d)[0] == "mtp_unexpected_draft"


def test_registered_strategy():
    from power_core.plugins import build_plugins

    s = build_plugins().strategy("mtp")
    assert s.package == "power-mtp" and not s.needs_draft and s.validate is validate_mtp
    assert s.proposer is not None and s.backends == frozenset({"llama"})
    assert s.target_features == frozenset({"mtp_head", "h_nextn"})
