"""power inspect / validate / bind: exit codes, JSON, no traceback for any input file."""

import json
import subprocess
import sys

import pytest

from power_core.artifacts import synthetic
from power_core.cli import main


def test_inspect_json(fx, capsys):
    assert main(["inspect", str(fx["dspark"]), "--json", "--sha256"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["architecture"] == "dflash" and out["mechanism"]["draft_contract"] == "dspark"
    assert out["mechanism"]["evidence"] == "markov_w1.weight" and len(out["sha256"]) == 64
    assert {"name": "markov_w1.weight", "shape": [16, 128], "type": "F32", "nbytes": 16 * 128 * 4} in out["tensors"]


def test_inspect_human_and_mtp(fx, capsys):
    assert main(["inspect", str(fx["target_mtp"]), "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "qwen35" in out and "mtp:           yes" in out and "blk.2.nextn.eh_proj.weight" in out


@pytest.mark.parametrize("target,draft,mode,rc,code", [
    ("target_mtp", None, "auto", 0, None),
    ("target_mtp", None, "mtp", 0, None),
    ("target_plain", None, "mtp", 2, "mtp_no_nextn"),
    ("target_plain", "dflash", "dflash", 0, None),
    ("target_plain", "dspark", "dflash", 2, "contract_is_dspark"),
    ("target_plain", "dflash", "dflash2", 2, "contract_is_dflash_v1"),
    ("target_plain", "dflash2", "dflash", 2, "contract_is_dflash2"),
    ("target_plain", "dflash2", "dspark", 2, "contract_is_dflash2"),
    ("target_plain", "dspark_conf", "dspark", 0, None),
    ("target_mtp", "dflash", "mtp", 2, "draft_unexpected"),
])
def test_validate_exit_codes(fx, capsys, target, draft, mode, rc, code):
    argv = ["validate", "--target", str(fx[target]), "--mode", mode, "--json"]
    if draft:
        argv += ["--draft", str(fx[draft])]
    assert main(argv) == rc
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is (rc == 0)
    if code:
        assert out["code"] == code and out["evidence"] and out["message"]
    else:
        # auto picks the target's own MTP head once it verifies (power-mtp runs it)
        assert out["mode"] == (mode if mode != "auto" else "mtp") and out["reason"]
        if mode == "auto":
            assert "MTP layers" in out["reason"] and "verified" in out["reason"]


def test_validate_human_rejection_line(fx, capsys):
    assert main(["validate", "--target", str(fx["target_plain"]), "--draft", str(fx["dspark"]),
                 "--mode", "dflash"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error[contract_is_dspark]: ") and "evidence: markov_w1.weight" in err


def test_usage_errors_exit_1(fx, capsys):
    assert main(["validate"]) == 1
    assert main(["validate", "--target", str(fx["target_plain"]), "--mode", "NOT A MODE"]) == 1
    assert main(["bind", "--target", str(fx["target_plain"])]) == 1


def test_malformed_corpus_through_cli_no_traceback(fixtures_dir, tmp_path, capsys):
    corpus = synthetic.malformed_corpus(fixtures_dir["dflash"], tmp_path / "bad")
    for name, (path, _) in corpus.items():
        for argv in (["inspect", str(path)], ["validate", "--target", str(fixtures_dir["target_plain"]),
                                               "--draft", str(path)],
                     ["validate", "--target", str(path), "--json"]):
            rc = main(argv)
            cap = capsys.readouterr()
            assert rc == 2, (name, argv, cap)
            assert "Traceback" not in cap.err + cap.out
            assert "error[gguf_" in cap.err or '"code": "gguf_' in cap.out, (name, cap)


def test_subprocess_has_no_traceback(fixtures_dir, tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    r = subprocess.run([sys.executable, "-m", "power_core.cli", "validate", "--target", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.startswith("error[gguf_")
