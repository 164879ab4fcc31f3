"""``power bench`` on the reference backend: the evidence package, bad input, and a parity failure
flagged and excluded, never averaged in."""

from __future__ import annotations

import json

import numpy as np

from power_core.bench import BenchSpec, run_bench
from power_core.cli import main
from power_core.plugins import Strategy, hookimpl

REF = "reference:seed=11,vocab=300,dim=16,recurrent=1"  # > 256 ids: a byte tokenizer


def _prompts(tmp_path):
    a = tmp_path / "copy.txt"
    a.write_text("abcabcabcabcabcabcabc abcabcabc\n")
    b = tmp_path / "story.txt"
    b.write_text("Once upon a time")
    return [str(a), str(b)]


def test_evidence_package(tmp_path, capsys):
    out = tmp_path / "ev"
    rc = main(["bench", "--model", REF, "--modes", "off,suffix", "--prompts", *_prompts(tmp_path), "--runs", "2",
               "--tokens", "24", "--out", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["parity_failures"] == [] and set(report["prompts"]) == {"copy.txt", "story.txt"}
    cell = report["prompts"]["copy.txt"]["modes"]["suffix"]
    assert cell["parity"] and cell["tok_s"]["n"] == 2 and cell["ratio_to_off"]["n"] == 2
    assert cell["output_sha256"] == report["prompts"]["copy.txt"]["modes"]["off"]["output_sha256"]
    assert (out / "report.md").read_text().startswith("# power bench")
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"
    assert "power suffix" in capsys.readouterr().out


def test_bad_input_exits_non_zero(tmp_path):
    p = _prompts(tmp_path)
    assert main(["bench", "--model", REF, "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert main(["bench", "--model", REF, "--modes", "off,nosuch", "--prompts", *p]) == 2
    (tmp_path / "bin").mkdir()
    assert main(["bench", "--model", REF, "--prompts", *p, "--peer-bin", str(tmp_path / "bin")]) == 2


class _Corrupting:
    """A broken adapter that writes into the target behind the transaction's back."""

    features = frozenset()

    def __init__(self, target):
        self.target = target

    def begin(self, prompt):
        pass

    def checkpoint(self):
        return None

    def propose(self, ctx):
        if ctx.round_index == 3:
            self.target.decode(np.array([5], dtype=np.int32))
        return np.zeros(0, dtype=np.int32)

    def observe(self, result):
        pass

    def commit(self, n, emitted):
        pass

    def restore(self, cp):
        pass


class _Plugin:
    __name__ = "test.corrupting"

    @hookimpl
    def power_register_strategies(self, register):
        register(Strategy(name="corrupting", version="0", package="test", kind="model-free",
                          proposer=lambda req: _Corrupting(req.opened.target)))


def test_parity_failure_is_flagged_and_excluded(tmp_path):
    from power_core.plugins import build_plugins

    spec = BenchSpec(model=REF, modes=("off", "corrupting"), prompts=(tmp_path / "p.txt",), runs=2, tokens=16,
                     out=tmp_path / "ev")
    (tmp_path / "p.txt").write_text("hello hello hello")
    report = run_bench(spec, progress=False, plugins=build_plugins(extra=(_Plugin(),)))
    cell = report["prompts"]["p.txt"]["modes"]["corrupting"]
    assert cell["parity"] is False and cell["ratio_to_off"] is None and cell["first_divergence"] is not None
    # the reference target computes every row identically in any block: numerics cannot explain it
    assert cell["numerics"]["explained_by_batch_numerics"] is False and cell["numerics"]["max_abs_diff"] == 0.0
    assert report["parity_failures"][0]["mode"] == "corrupting"
    assert "Parity failures" in (tmp_path / "ev" / "report.md").read_text()
