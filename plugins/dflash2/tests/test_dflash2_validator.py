"""Per-rule tests of the DFlash2 validator."""

import pytest
from power_dflash2 import validate_dflash2

from power_core.artifacts import ArtifactView, synthetic
from power_core.errors import ArtifactError


@pytest.fixture
def target(tmp_path):
    return ArtifactView.from_gguf(synthetic.target_spec(mtp=False).write(tmp_path / "t.gguf"))


def reject(target, spec, tmp_path):
    with pytest.raises(ArtifactError) as ei:
        validate_dflash2(target, ArtifactView.from_gguf(spec.write(tmp_path / "d.gguf")), None)
    return ei.value.code, ei.value.evidence


def test_accepts_dflash2(target, tmp_path):
    v = validate_dflash2(target, ArtifactView.from_gguf(synthetic.dflash2_spec().write(tmp_path / "d.gguf")), None)
    assert v.mode == "dflash2" and v.max_k == 7 and v.facts["selector_top_k"] == 4


def test_v1_offered_as_dflash2(target, tmp_path):
    assert reject(target, synthetic.dflash_spec(), tmp_path) == ("contract_is_dflash_v1", "selector_hidden.weight")


def test_dspark_offered_as_dflash2(target, tmp_path):
    assert reject(target, synthetic.dspark_spec(), tmp_path) == ("contract_is_dspark", "markov_w1.weight")


def test_dspark_and_dflash2_in_one_file(target, tmp_path):
    s = synthetic.dflash2_spec()
    s.tensors["markov_w1.weight"] = ((16, synthetic.N_VOCAB), "F32")
    assert reject(target, s, tmp_path) == ("contract_is_dspark", "markov_w1.weight")


def test_parts_without_marker(target, tmp_path):
    s = synthetic.dflash2_spec()
    del s.tensors["selector_hidden.weight"]
    assert reject(target, s, tmp_path) == ("dflash2_tensor_missing", "selector_hidden.weight")


@pytest.mark.parametrize("key", ["dflash.selector_rank", "dflash.selector_top_k", "dflash.conv_kernel_size",
                                 "dflash.conv_group_size", "dflash.block_size"])
def test_required_keys(target, tmp_path, key):
    s = synthetic.dflash2_spec()
    del s.kv[key]
    assert reject(target, s, tmp_path) == ("dflash2_key_missing", key)
    s.kv[key] = ("u32", 0)
    assert reject(target, s, tmp_path) == ("dflash2_key_invalid", key)


def test_group_divisibility(target, tmp_path):
    s = synthetic.dflash2_spec(group=24)
    assert reject(target, s, tmp_path) == ("dflash2_conv_group_indivisible", "dflash.conv_group_size")


def test_lattice_size(target, tmp_path):
    s = synthetic.dflash2_spec(top_k=8)  # 8*9 = 72 > n_embd 64
    assert reject(target, s, tmp_path) == ("dflash2_lattice_too_small", "dflash.selector_top_k")


@pytest.mark.parametrize("tensor", ["selector_predecessor.weight", "selector_successor.weight",
                                    "blk.0.attn_conv_base", "blk.0.ffn_conv_base", "blk.0.attn_conv_proj.weight",
                                    "blk.0.ffn_conv_proj.weight"])
def test_tensor_missing(target, tmp_path, tensor):
    s = synthetic.dflash2_spec()
    del s.tensors[tensor]
    assert reject(target, s, tmp_path) == ("dflash2_tensor_missing", tensor)


def test_conv_base_with_weight_suffix_is_missing(target, tmp_path):
    s = synthetic.dflash2_spec()
    s.tensors["blk.0.attn_conv_base.weight"] = s.tensors.pop("blk.0.attn_conv_base")
    assert reject(target, s, tmp_path) == ("dflash2_tensor_missing", "blk.0.attn_conv_base")


@pytest.mark.parametrize("tensor,shape", [
    ("selector_hidden.weight", (synthetic.N_EMBD, 8)),
    ("selector_predecessor.weight", (16, 100)),
    ("blk.0.attn_conv_base", (synthetic.N_EMBD, 3, 2)),
    ("blk.0.ffn_conv_proj.weight", (synthetic.N_EMBD, 32)),
])
def test_tensor_shapes(target, tmp_path, tensor, shape):
    s = synthetic.dflash2_spec()
    s.tensors[tensor] = (shape, "F32")
    assert reject(target, s, tmp_path) == ("dflash2_tensor_shape", tensor)


def test_backbone_codes_use_the_dflash2_prefix(target, tmp_path):
    s = synthetic.dflash2_spec()
    del s.tensors["fc.weight"]
    assert reject(target, s, tmp_path) == ("dflash2_tensor_missing", "fc.weight")
