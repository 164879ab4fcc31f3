"""``power bench`` on the reference backend: the evidence package, bad input, and a parity failure
flagged and excluded, never averaged in."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from power_core.bench import NGRAM_TYPES, BenchSpec, run_bench
from power_core.cli import main
from power_core.config import PowerConfig
from power_core.plugins import Strategy, hookimpl
from power_core.runtime import Proposal, ProposerCapabilities

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
    capabilities = ProposerCapabilities()

    def __init__(self, target):
        self.target = target

    def begin(self, prompt):
        pass

    def checkpoint(self):
        return None

    def propose(self, ctx):
        if ctx.round_index == 3:
            self.target.decode(np.array([5], dtype=np.int32))
        return Proposal.none()

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


def _fake_peers(tmp_path, text: str, n: int):
    """llama-completion / llama-speculative-simple stand-ins: echo the prompt, print ``text`` as their
    generation and llama.cpp's timing lines; each call appends its argv and batch-invariance env to calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    gen = tmp_path / "gen.txt"
    gen.write_text(text)
    for exe, timing in (("llama-completion", "prompt eval time =       4.00 ms /     4 tokens\n"
                                              f"       eval time = 100.00 ms / {n - 1} runs ( 4.00 ms per token, 250.00 tokens per second)\n"
                                              "      total time =     110.00 ms /   259 tokens"),
                        ("llama-speculative-simple", f"decoded {n} tokens in 0.100 seconds, speed: 240.00 t/s\naccept    = 50.000%")):
        script = bin_dir / exe
        script.write_text(
            "#!/usr/bin/env python3\n"
            "import os, sys\n"
            f"open({str(log)!r}, 'a').write(repr([sys.argv[0].rsplit('/', 1)[-1], os.environ.get('GGML_CPU_BATCH_INVARIANT'), sys.argv[1:]]) + '\\n')\n"
            "prompt = sys.argv[sys.argv.index('-p') + 1]\n"
            f"sys.stdout.write(prompt + open({str(gen)!r}).read() + '\\n\\n')\n"
            f"sys.stderr.write({timing!r} + '\\n')\n")
        script.chmod(0o755)
    return bin_dir, log


def _off_text(prompt: str, tokens: int) -> tuple[str, int]:
    from power_core.session import Session

    with Session.open(PowerConfig(spec_mode="off", max_tokens=tokens), model=REF) as s:
        res = s.generate(prompt)
    return res.text, len(res.tokens)


def test_peers_run_with_powers_numerics_and_their_text_is_checked(tmp_path):
    import ast

    prompt = tmp_path / "p.txt"
    prompt.write_text("abcabcabcabc abc")
    text, n = _off_text("abcabcabcabc abc", 12)
    bin_dir, log = _fake_peers(tmp_path, text, n)
    spec = BenchSpec(model=REF, modes=("off", "suffix"), prompts=(prompt,), runs=1, tokens=12, peer_bin=bin_dir,
                     out=tmp_path / "ev")
    report = run_bench(spec, progress=False)
    assert report["numerics"] == report["peer_numerics"] == "exact"
    calls = [ast.literal_eval(line) for line in log.read_text().splitlines()]
    assert calls and all(env == "1" and "--no-repack" not in argv for _, env, argv in calls)
    # offload is explicit: the tools' own default (-ngl auto) would offload every layer on a GPU build
    assert all("-ngl 0 -fa auto" in " ".join(argv) for _, _, argv in calls)
    assert report["offload"] == {"n_gpu_layers": 0, "devices": [], "flash_attn": "auto", "draft_gpu_layers": 0}
    peers = report["prompts"]["p.txt"]["peers"]
    assert set(peers) == {"llama-completion", *NGRAM_TYPES}
    assert all(p["same_text"] is True for p in peers.values())
    assert report["prompts"]["p.txt"]["best_peer_ngram"] in NGRAM_TYPES
    assert "| yes |" in (tmp_path / "ev" / "report.md").read_text()


def test_stock_peers_and_a_peer_that_writes_other_text(tmp_path):
    import ast

    prompt = tmp_path / "p.txt"
    prompt.write_text("abcabcabcabc abc")
    text, n = _off_text("abcabcabcabc abc", 12)
    bin_dir, log = _fake_peers(tmp_path, "something else entirely", n)
    rc = main(["bench", "--model", REF, "--modes", "off,suffix", "--prompts", str(prompt), "--runs", "1", "--tokens", "12",
               "--peer-bin", str(bin_dir), "--peer-numerics", "stock", "--out", str(tmp_path / "ev"), "--no-progress"])
    assert rc == 0  # a peer writing other text is reported, not a Power parity failure
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert report["numerics"] == "exact" and report["peer_numerics"] == "stock"
    calls = [ast.literal_eval(line) for line in log.read_text().splitlines()]
    assert calls and all(env is None and "--no-repack" not in argv for _, env, argv in calls)
    prompt_report = report["prompts"]["p.txt"]
    assert all(p["same_text"] is False for p in prompt_report["peers"].values())
    # a peer that decoded other text is never the reference of a ratio
    assert "best_peer_ngram" not in prompt_report and prompt_report["peers_other_text"] == sorted(["llama-completion", *NGRAM_TYPES])
    md = (tmp_path / "ev" / "report.md").read_text()
    assert "| NO |" in md and "Not the same workload" in md


def test_same_text():
    from power_core.bench import _generated, same_text

    assert same_text("Paris.\n\nThe", "Paris.\n\n") is True  # a peer may decode a little more
    assert same_text("Paris.\n\n\n\n", "Paris.") is True  # the tools' own trailing newlines
    assert same_text("Paris!", "Paris.") is False
    assert same_text("Paris.[end of text]\n\n", "Paris.") is True
    assert same_text(None, "Paris.") is None and same_text("", "Paris.") is False
    assert _generated("\n\nThe capital is Paris.", "The capital is") == " Paris."
    assert _generated("garbled", "The capital is") is None


def test_a_missing_optional_dependency_stops_before_any_run(tmp_path, monkeypatch, capsys):
    """Without the ``bench`` extra (matplotlib) ``power bench`` exits 1 naming the install, before any
    session opens, not with a traceback at the plot step after the whole run."""
    from power_core import bench
    from power_core.errors import MissingDependency, PowerError

    opened = []

    def cell(*args, **kwargs):
        opened.append(args)
        raise AssertionError("a bench cell opened a session")

    monkeypatch.setattr(bench, "_PowerCell", cell)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an import of an absent package does
    out = tmp_path / "ev"
    rc = main(["bench", "--model", REF, "--modes", "off,suffix", "--prompts", *_prompts(tmp_path), "--runs", "1",
               "--tokens", "8", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and opened == [] and not out.exists()
    assert "error[dependency_missing]" in err and "pip install 'power-core[bench]'" in err and "matplotlib" in err
    assert "Traceback" not in err
    spec = BenchSpec(model=REF, modes=("off",), prompts=(tmp_path / "copy.txt",), runs=1, tokens=8, out=out)
    with pytest.raises(MissingDependency) as info:
        run_bench(spec, progress=False)
    assert isinstance(info.value, PowerError) and isinstance(info.value, ImportError)
    assert info.value.module == "matplotlib" and info.value.extra == "bench" and opened == []


def test_peer_offload_mirrors_powers_keys():
    from power_core.bench import peer_offload

    assert peer_offload(0) == ["-ngl", "0", "-fa", "auto"]
    assert peer_offload(-1, ("CUDA0", "CUDA1"), "on") == ["-ngl", "all", "-fa", "on", "-dev", "CUDA0,CUDA1"]
    assert peer_offload(12, (), "off") == ["-ngl", "12", "-fa", "off"]


def test_graph_reuse_reads_llama_cpps_switch():
    from power_core.bench import graph_reuse

    assert graph_reuse({}) and graph_reuse({"LLAMA_GRAPH_REUSE_DISABLE": "0"}) and graph_reuse({"LLAMA_GRAPH_REUSE_DISABLE": ""})
    assert not graph_reuse({"LLAMA_GRAPH_REUSE_DISABLE": "1"}) and not graph_reuse({"LLAMA_GRAPH_REUSE_DISABLE": " 2x"})
    assert graph_reuse({"LLAMA_GRAPH_REUSE_DISABLE": "yes"})  # atoi("yes") == 0, as llama.cpp reads it


@pytest.mark.parametrize("flags, key", [(["--gpu-layers", "-1"], "n_gpu_layers"), (["--draft-gpu-layers", "2"], "draft_gpu_layers"),
                                        (["--devices", "CUDA0,CUDA0"], "devices"), (["--gpu-layers", "-3"], "n_gpu_layers")])
def test_offload_the_backend_cannot_do_stops_before_any_run(tmp_path, capsys, flags, key):
    out = tmp_path / "ev"
    rc = main(["bench", "--model", REF, "--modes", "off,suffix", "--prompts", *_prompts(tmp_path)[:1], "--runs", "1",
               "--tokens", "4", "--out", str(out), "--no-progress", *flags])
    assert rc == 2 and f"config key '{key}'" in capsys.readouterr().err
    assert not out.exists()


def test_completion_rate_counts_wall_time_after_the_prompt_pass():
    """llama-completion's rate as Power's receipt counts decode_tok_s: tokens after the first over the wall time
    after the prompt pass (total less prompt eval), not over the time inside llama_decode alone (its "eval time"),
    which leaves out the host work that Power's rate includes. The lines are a real run's (the pinned build)."""
    from power_core.bench import completion_rate

    stderr = ("common_perf_print:    sampling time =       1.59 ms\n"
              "common_perf_print:        load time =     123.18 ms\n"
              "common_perf_print: prompt eval time =      10.74 ms /     4 tokens (    2.68 ms per token,   372.51 tokens per second)\n"
              "common_perf_print:        eval time =    1127.15 ms /   255 runs   (    4.42 ms per token,   226.23 tokens per second)\n"
              "common_perf_print:       total time =    1157.49 ms /   259 tokens\n")
    n, rate = completion_rate(stderr)
    assert n == 256
    assert rate == pytest.approx(255 / 1.14675)  # not the 226.23 of the eval time alone
    assert completion_rate(stderr.replace("total time", "tot")) is None
