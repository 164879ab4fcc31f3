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
    """llama.cpp's reduced-vocab export: the target's full tokenizer, n_draft output rows, d2t per row."""
    s = synthetic.dflash_spec()
    ids = np.arange(n_draft, dtype=np.int64) * 2 if mapping is None else np.asarray(mapping, dtype=np.int64)
    s.tensors["output.weight"] = ((synthetic.N_EMBD, n_draft), "F32")
    s.tensors["d2t"] = ((n_draft,), "I64")
    s.data["d2t"] = ids
    return s


def test_reduced_vocab_through_checked_d2t(tmp_path):
    s = _reduced(mapping=[1, 2] + [2 * i for i in range(2, 64)])
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


def test_d2t_does_not_excuse_a_different_tokenizer(tmp_path):
    s = _reduced()
    tokens = list(s.kv["tokenizer.ggml.tokens"][1])
    tokens[10] = "other"
    s.kv["tokenizer.ggml.tokens"] = ("arr:str", tokens)
    e = _mismatch(tmp_path, s)
    assert e.code == "vocab_token_mismatch" and e.evidence == "tokenizer.ggml.tokens[10]"


@pytest.mark.parametrize("rows,ttype", [(32, "I64"), (64, "I32")])
def test_d2t_must_match_the_output_rows_as_i64(tmp_path, rows, ttype):
    s = _reduced()
    s.tensors["d2t"] = ((rows,), ttype)
    s.data["d2t"] = np.arange(rows)
    e = _mismatch(tmp_path, s)
    assert e.code == "d2t_invalid" and "64 rows" in str(e)


def test_d2t_with_a_borrowed_output_covers_the_target_vocabulary(tmp_path):
    s = _reduced()
    del s.tensors["output.weight"]
    e = _mismatch(tmp_path, s)
    assert e.code == "d2t_invalid" and "borrowed" in str(e)
