"""Complete vocabulary comparison: first differing id, types, special ids, model/pre, d2t."""

import numpy as np
import pytest

from power_core.artifacts import ArtifactView, compare_vocab, synthetic
from power_core.errors import ArtifactMismatch


def _views(tmp_path, draft_spec, target_spec=None):
    t = (target_spec or synthetic.target_spec(mtp=False)).write(tmp_path / "t.gguf")
    d = draft_spec.write(tmp_path / "d.gguf")
    return ArtifactView.from_gguf(t), ArtifactView.from_gguf(d)


def _mismatch(tmp_path, draft_spec, target_spec=None):
    t, d = _views(tmp_path, draft_spec, target_spec)
    with pytest.raises(ArtifactMismatch) as ei:
        compare_vocab(t, d)
    return ei.value


def test_identical_vocab_matches(tmp_path):
    t, d = _views(tmp_path, synthetic.dflash_spec())
    m = compare_vocab(t, d)
    assert m.mapping == "identity" and m.n_target == m.n_draft == synthetic.N_VOCAB


def test_token_text_reports_first_differing_id(tmp_path):
    s = synthetic.dflash_spec()
    toks = list(s.kv["tokenizer.ggml.tokens"][1])
    toks[40], toks[90] = "other", "again"
    s.kv["tokenizer.ggml.tokens"] = ("arr:str", toks)
    e = _mismatch(tmp_path, s)
    assert e.code == "vocab_token_mismatch" and e.evidence == "tokenizer.ggml.tokens[40]"
    assert "first differing id 40" in str(e)


def test_token_type_differs(tmp_path):
    s = synthetic.dflash_spec()
    types = list(s.kv["tokenizer.ggml.token_type"][1])
    types[77] = 4
    s.kv["tokenizer.ggml.token_type"] = ("arr:i32", types)
    e = _mismatch(tmp_path, s)
    assert e.code == "vocab_type_mismatch" and e.evidence == "tokenizer.ggml.token_type[77]"


@pytest.mark.parametrize("key,value", [("tokenizer.ggml.eos_token_id", 3), ("tokenizer.ggml.bos_token_id", 0),
                                       ("tokenizer.ggml.padding_token_id", 5), ("tokenizer.ggml.eot_token_id", 6)])
def test_special_ids_differ(tmp_path, key, value):
    s = synthetic.dflash_spec()
    s.kv[key] = ("u32", value)
    e = _mismatch(tmp_path, s)
    assert e.code == "vocab_special_mismatch" and e.evidence == key


def test_mask_only_in_draft_is_fine_but_differing_masks_are_not(tmp_path):
    t = synthetic.target_spec(mtp=False)
    t.kv["tokenizer.ggml.mask_token_id"] = ("u32", 100)
    e = _mismatch(tmp_path, synthetic.dflash_spec(), t)
    assert e.code == "vocab_special_mismatch" and e.evidence == "tokenizer.ggml.mask_token_id"


@pytest.mark.parametrize("key,value,code", [("tokenizer.ggml.model", "gpt2", "vocab_model_mismatch"),
                                            ("tokenizer.ggml.pre", "qwen2", "vocab_pre_mismatch")])
def test_tokenizer_model_and_pre(tmp_path, key, value, code):
    s = synthetic.dflash_spec()
    s.kv[key] = ("str", value)
    e = _mismatch(tmp_path, s)
    assert e.code == code and e.evidence == key


def test_size_mismatch_without_d2t(tmp_path):
    e = _mismatch(tmp_path, synthetic.dflash_spec(n_vocab=100))
    assert e.code == "vocab_size_mismatch" and "d2t" in str(e)


def _reduced(n_draft=64, mapping=None):
    s = synthetic.dflash_spec(n_vocab=n_draft)
    ids = np.arange(n_draft, dtype=np.int64) * 2 if mapping is None else np.asarray(mapping, dtype=np.int64)
    s.kv["tokenizer.ggml.tokens"] = ("arr:str", [f"tok_{int(i)}" for i in ids])
    types = [3 if int(i) in (0, 1, 2) else 1 for i in ids]
    s.kv["tokenizer.ggml.token_type"] = ("arr:i32", types)
    s.kv["tokenizer.ggml.bos_token_id"] = ("u32", 0)
    s.kv["tokenizer.ggml.eos_token_id"] = ("u32", 1)
    s.kv["tokenizer.ggml.mask_token_id"] = ("u32", n_draft - 1)
    s.tensors["d2t"] = ((n_draft,), "I64")
    s.data["d2t"] = ids
    return s


def test_reduced_vocab_through_checked_d2t(tmp_path):
    # draft id i is target id 2i; draft bos 0 -> 0 is not target bos 1, so remap specials to match
    mapping = [1, 2] + [2 * i for i in range(2, 64)]
    s = _reduced(mapping=mapping)
    t, d = _views(tmp_path, s)
    m = compare_vocab(t, d)
    assert m.mapping == "d2t" and m.n_draft == 64 and m.n_target == synthetic.N_VOCAB


@pytest.mark.parametrize("mutate,evidence", [
    (lambda ids: ids.__setitem__(5, 500), "d2t[5]"),   # outside the target vocabulary
    (lambda ids: ids.__setitem__(6, ids[7]), "d2t"),     # not injective
])
def test_bad_d2t(tmp_path, mutate, evidence):
    mapping = np.array([1, 2] + [2 * i for i in range(2, 64)])
    s = _reduced(mapping=mapping)
    bad = s.data["d2t"].copy()
    mutate(bad)
    s.data["d2t"] = bad
    e = _mismatch(tmp_path, s)
    assert e.code == "d2t_invalid" and e.evidence == evidence


def test_d2t_text_mismatch_reports_draft_id(tmp_path):
    mapping = np.array([1, 2] + [2 * i for i in range(2, 64)])
    s = _reduced(mapping=mapping)
    ids = s.data["d2t"].copy()
    ids[10] = 21  # points at tok_21, the draft text says tok_20
    s.data["d2t"] = ids
    e = _mismatch(tmp_path, s)
    assert e.code == "vocab_token_mismatch" and e.evidence == "d2t[10]"


def test_d2t_wrong_length(tmp_path):
    s = _reduced(mapping=[1, 2] + [2 * i for i in range(2, 64)])
    s.tensors["d2t"] = ((32,), "I64")
    s.data["d2t"] = s.data["d2t"][:32]
    e = _mismatch(tmp_path, s)
    assert e.code == "d2t_invalid"
