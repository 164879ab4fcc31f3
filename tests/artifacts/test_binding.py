"""Draft-to-target binding: sidecar via power bind, metadata key, other target, stale, conflict, required."""

import json

import pytest

from power_core.artifacts import (
    BINDING_KEY,
    ArtifactView,
    check_binding,
    file_digest,
    read_model_manifest,
    synthetic,
    write_binding,
)
from power_core.cli import main
from power_core.errors import ArtifactError, ArtifactMismatch


def sha(p):
    return file_digest(p).sha256


def test_power_bind_writes_sidecar_and_manifest(fx, capsys):
    rc = main(["bind", "--target", str(fx["target_plain"]), "--draft", str(fx["dspark"]), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] and out["mode"] == "dspark"
    side = json.loads((fx["dspark"].parent / "dspark.gguf.power.json").read_text())
    assert side["format"] == "power.binding/1" and side["target_sha256"] == sha(fx["target_plain"])
    assert side["draft_sha256"] == sha(fx["dspark"]) and side["mode"] == "dspark"
    entries = read_model_manifest(fx["target_plain"])
    assert [(e.mode, e.path.name, e.sha256) for e in entries] == [("dspark", "dspark.gguf", sha(fx["dspark"]))]
    # binding again is idempotent (one entry per draft)
    assert main(["bind", "--target", str(fx["target_plain"]), "--draft", str(fx["dspark"])]) == 0
    assert len(read_model_manifest(fx["target_plain"])) == 1


def test_bind_refuses_an_invalid_pair(fx, capsys):
    rc = main(["bind", "--target", str(fx["target_plain"]), "--draft", str(fx["dspark"]), "--mode", "dflash"])
    err = capsys.readouterr().err
    assert rc == 2 and "error[contract_is_dspark]" in err
    assert not (fx["dspark"].parent / "dspark.gguf.power.json").exists()


def test_bound_to_another_target_fails_with_both_digests(fx):
    assert main(["bind", "--target", str(fx["target_plain"]), "--draft", str(fx["dflash"]), "--no-register"]) == 0
    other = fx["target_mtp"]
    d = ArtifactView.from_gguf(fx["dflash"])
    with pytest.raises(ArtifactMismatch) as ei:
        check_binding(str(other), sha(other), d, sha(fx["dflash"]), required=False)
    e = ei.value
    assert e.code == "binding_other_target"
    assert sha(other) in str(e) and sha(fx["target_plain"]) in str(e) and sha(fx["dflash"]) in str(e)
    # via the CLI too, even without --require-binding
    assert main(["validate", "--target", str(other), "--draft", str(fx["dflash"])]) == 2


def test_unbound_where_required(fx, capsys):
    rc = main(["validate", "--target", str(fx["target_plain"]), "--draft", str(fx["dflash"]), "--require-binding"])
    err = capsys.readouterr().err
    assert rc == 2 and "error[binding_missing]" in err and "power bind" in err
    assert sha(fx["target_plain"]) in err and sha(fx["dflash"]) in err
    assert main(["bind", "--target", str(fx["target_plain"]), "--draft", str(fx["dflash"])]) == 0
    assert main(["validate", "--target", str(fx["target_plain"]), "--draft", str(fx["dflash"]),
                 "--require-binding"]) == 0


def test_stale_sidecar_after_the_draft_changes(fx):
    write_binding(fx["dflash"], draft_sha256="0" * 64, target_sha256=sha(fx["target_plain"]), mode="dflash")
    d = ArtifactView.from_gguf(fx["dflash"])
    with pytest.raises(ArtifactMismatch) as ei:
        check_binding(str(fx["target_plain"]), sha(fx["target_plain"]), d, sha(fx["dflash"]), required=True)
    assert ei.value.code == "binding_stale"


def test_metadata_key_carrier(tmp_path, fx):
    t_sha = sha(fx["target_plain"])
    s = synthetic.dflash_spec()
    s.kv[BINDING_KEY] = ("str", t_sha)
    p = s.write(tmp_path / "bound.gguf")
    d = ArtifactView.from_gguf(p)
    b = check_binding(str(fx["target_plain"]), t_sha, d, sha(p), required=True)
    assert b.source == "metadata" and b.target_sha256 == t_sha
    with pytest.raises(ArtifactMismatch) as ei:
        check_binding(str(fx["target_mtp"]), sha(fx["target_mtp"]), d, sha(p), required=False)
    assert ei.value.code == "binding_other_target" and ei.value.evidence == BINDING_KEY
    # a sidecar that disagrees with the key is a conflict
    write_binding(p, draft_sha256=sha(p), target_sha256=sha(fx["target_mtp"]), mode="dflash")
    with pytest.raises(ArtifactMismatch) as ei:
        check_binding(str(fx["target_plain"]), t_sha, d, sha(p), required=False)
    assert ei.value.code == "binding_conflict"


@pytest.mark.parametrize("content", ["{not json", "[]", '{"format": "x"}',
                                     '{"format": "power.binding/1", "draft_sha256": "zz", "target_sha256": "00"}'])
def test_malformed_sidecar(fx, content):
    (fx["dflash"].parent / "dflash.gguf.power.json").write_text(content)
    d = ArtifactView.from_gguf(fx["dflash"])
    with pytest.raises(ArtifactError) as ei:
        check_binding("t", "0" * 64, d, sha(fx["dflash"]), required=False)
    assert ei.value.code == "binding_invalid"


def test_bad_metadata_key_value(tmp_path):
    s = synthetic.dflash_spec()
    s.kv[BINDING_KEY] = ("str", "not-a-digest")
    p = s.write(tmp_path / "b.gguf")
    with pytest.raises(ArtifactError) as ei:
        check_binding("t", "0" * 64, ArtifactView.from_gguf(p), sha(p), required=False)
    assert ei.value.code == "binding_invalid" and ei.value.evidence == BINDING_KEY
