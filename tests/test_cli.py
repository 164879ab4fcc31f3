"""The ``power`` CLI: run on the reference backend, JSON output, exit codes, no tracebacks."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from power_core.cli import build_parser, main
from power_core.commands import _config_from_args
from power_core.plugins import hookimpl
from power_core.receipt import token_digest

REF = ["--backend", "reference", "--model", "reference:seed=2,vocab=288,dim=16,eos=256"]


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_run_json_has_tokens_text_receipt(capsys):
    rc, out, _ = run_cli(capsys, "run", *REF, "--mode", "ref-draft", "--prompt", "hello", "--max-tokens", "12",
                         "--json")
    assert rc == 0
    obj = json.loads(out)
    assert len(obj["tokens"]) == 12 and isinstance(obj["text"], str)
    r = obj["receipt"]
    assert r["schema"] == "power.receipt/1" and r["strategy"]["name"] == "ref-draft"
    assert r["summary"]["acceptance"] == 1.0 and len(r["output_sha256"]) == 64


def test_run_speculative_equals_off(capsys):
    outs = []
    for mode in ("off", "ref-draft"):
        rc, out, _ = run_cli(capsys, "run", *REF, "--mode", mode, "--prompt", "abc", "--max-tokens", "20",
                             "--temperature", "0.8", "--seed", "7", "--draft", "reference:accept=0.5", "--json")
        assert rc == 0
        outs.append(json.loads(out)["tokens"])
    assert outs[0] == outs[1]


def test_run_plain_streams_text_then_one_summary_line(capsys):
    rc, out, err = run_cli(capsys, "run", *REF, "--mode", "ref-draft", "--max-tokens", "8", "--prompt", "hello")
    rc2, js, _ = run_cli(capsys, "run", *REF, "--mode", "ref-draft", "--max-tokens", "8", "--prompt", "hello", "--json")
    assert rc == rc2 == 0
    assert out == json.loads(js)["text"] + "\n"  # the text only: no receipt JSON on stdout
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[completed] finish=max_tokens strategy=ref-draft"), err
    assert re.search(r" decode=[\d.]+ tok/s host=[\d.]+ us/round$", lines[0]), lines[0]  # receipt timings.host_us_per_round


def test_run_with_config_file(tmp_path, capsys):
    cfg = tmp_path / "p.toml"
    cfg.write_text('spec_mode = "ref-draft"\nspec_draft_max = 3\nmax_tokens = 6\n')
    rc, out, _ = run_cli(capsys, "run", *REF, "--config", str(cfg), "--json")
    assert rc == 0
    r = json.loads(out)["receipt"]
    assert r["config"]["spec_draft_max"] == 3 and r["output_tokens"] == 6


@pytest.mark.parametrize("argv,code,msg", [
    (["run", "--draft-max", "0", *REF], 2, "spec_draft_max"),
    (["run", "--snapshots", "9", "--draft-max", "7", *REF], 2, "spec_recurrent_snapshots"),
    (["run", "--mode", "mtp", *REF], 2, "pip install power-mtp"),
    (["run", "--mode", "Not A Mode", *REF], 2, "spec_mode"),
    (["run", "--config", "/nonexistent.toml", *REF], 2, "config"),
    (["run", "--prompt-file", "/nonexistent.txt", *REF], 2, "prompt_file"),
    (["run", "--model", "reference:bogus=1", "--backend", "reference"], 2, "unknown key"),
    (["run", "--gpu-layers", "-2", *REF], 2, "n_gpu_layers"),
    (["run", "--draft-gpu-layers", "-5", *REF], 2, "draft_gpu_layers"),
    (["run", "--gpu-layers", "1", *REF], 2, "'n_gpu_layers': got 1, allowed 0 on the reference backend"),
    (["run", "--devices", "CUDA0", *REF], 2, "'devices': got ['CUDA0'], allowed no device names on the reference"),
    (["run", "--draft-gpu-layers", "2", *REF], 2, "'draft_gpu_layers': got 2, allowed 0 on the reference"),
    (["selftest", "--gpu-layers", "-1", *REF], 2, "'n_gpu_layers': got -1, allowed 0 on the reference"),
    (["run", "--flash-attn", "maybe", *REF], 1, "invalid choice"),
    (["run", "--max-tokens", "abc"], 1, "invalid int"),
    (["run", "--prompt", "a", "--prompt-file", "b"], 1, "not allowed with"),
    (["frobnicate"], 1, "invalid choice"),
    ([], 1, "required"),
])
def test_errors_have_exit_codes_and_no_traceback(capsys, monkeypatch, argv, code, msg):
    monkeypatch.setenv("POWER_LOAD_PLUGINS", "")
    rc, out, err = run_cli(capsys, *argv)
    assert rc == code, err
    assert msg in err and "Traceback" not in err


def test_offload_flags_reach_the_config_and_the_receipt(capsys):
    args = build_parser().parse_args(["run", "--gpu-layers", "-1", "--devices", "CUDA0,CUDA1", "--flash-attn", "off",
                                      "--draft-gpu-layers", "3"])
    cfg = _config_from_args(args)
    assert (cfg.n_gpu_layers, cfg.devices, cfg.flash_attn, cfg.draft_gpu_layers) == (-1, ("CUDA0", "CUDA1"), "off", 3)
    serve = build_parser().parse_args(["serve", "--gpu-layers", "2", "--devices", "CUDA0", "--draft-gpu-layers", "1"])
    assert (serve.gpu_layers, serve.devices, serve.draft_gpu_layers) == (2, "CUDA0", 1)
    rc, out, _ = run_cli(capsys, "run", *REF, "--flash-attn", "on", "--max-tokens", "3", "--json")
    assert rc == 0
    r = json.loads(out)["receipt"]
    assert r["backend"]["devices"] == ["CPU"]
    assert {k: r["config"][k] for k in ("n_gpu_layers", "devices", "flash_attn", "draft_gpu_layers")} == {
        "n_gpu_layers": 0, "devices": [], "flash_attn": "on", "draft_gpu_layers": 0}


def test_bad_toml_is_rejected(tmp_path, capsys):
    f = tmp_path / "bad.toml"
    f.write_text("spec_draft_max = [\n")
    rc, _, err = run_cli(capsys, "run", *REF, "--config", str(f))
    assert rc == 2 and "a readable TOML file" in err
    f.write_text("spec_draft_mx = 3\n")
    rc, _, err = run_cli(capsys, "run", *REF, "--config", str(f))
    assert rc == 2 and "did you mean 'spec_draft_max'" in err


def test_plugins_json(capsys):
    rc, out, _ = run_cli(capsys, "plugins", "--json")
    assert rc == 0
    info = {p["name"]: p for p in json.loads(out)}
    assert "off" in info["power.core"]["strategies"]
    assert info["power.reference"]["backends"] == ["reference"]
    assert "power_register_strategies" in info["power.reference"]["hooks"]


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "power_core.cli", "plugins", "--json"], capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout)


def test_profile_reports_every_phase(capsys):
    rc, out, _ = run_cli(capsys, "run", *REF, "--mode", "ref-draft", "--max-tokens", "10", "--profile", "--json")
    assert rc == 0
    phases = json.loads(out)["phases"]
    assert set(phases) == {"checkpoint", "propose", "verify", "accept", "commit", "emit"}
    assert all(p["calls"] == phases["emit"]["calls"] for p in phases.values())


# -- streaming output, receipts, stop strings, Ctrl-C ------------------------------------------------
class _CtrlCAt:
    """Presses Ctrl-C (a real SIGINT to this process) or raises KeyboardInterrupt in a given round."""

    __name__ = "test.ctrl-c"

    def __init__(self, round_index: int, how: str) -> None:
        self.round_index, self.how = round_index, how

    @hookimpl(wrapper=True)
    def power_txn_phase(self, phase, round_index):
        if phase == "verify" and round_index == self.round_index:
            if self.how == "signal":
                # a terminal's Ctrl-C reaches the main thread, which runs the handler (a cancel) while it waits
                # for the compute thread, where this round runs (power_core.compute): give it that moment
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                time.sleep(0.2)
            else:
                raise KeyboardInterrupt
        return (yield)


def _with_plugin(monkeypatch, plugin):
    import power_core.plugins as plugins_mod

    real = plugins_mod.build_plugins
    monkeypatch.setattr(plugins_mod, "build_plugins", lambda extra=(): real(extra=(*extra, plugin)))


def test_receipt_file_and_stop_strings(tmp_path, capsys):
    rc, js, _ = run_cli(capsys, "run", *REF, "--mode", "ref-draft", "--max-tokens", "40", "--prompt", "hello", "--json")
    full = json.loads(js)["text"]
    stop = full[12:14]
    path = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, "run", *REF, "--mode", "ref-draft", "--max-tokens", "40", "--prompt", "hello",
                           "--stop", stop, "--stop", "\x01zz", "--receipt", str(path))
    assert rc == 0 and out == full[:full.index(stop)] + "\n"
    receipt = json.loads(path.read_text())
    assert receipt["status"] == "completed" and receipt["finish_reason"] == "stop"
    assert receipt["config"]["stop"] == [stop, "\x01zz"]
    assert err.strip().endswith(f"receipt={path}") and "finish=stop" in err


def test_receipt_dash_prints_it_after_the_text(capsys):
    rc, js, _ = run_cli(capsys, "run", *REF, "--mode", "ref-draft", "--max-tokens", "24", "--prompt", "hello", "--json")
    want = json.loads(js)
    rc, out, err = run_cli(capsys, "run", *REF, "--mode", "ref-draft", "--max-tokens", "24", "--prompt", "hello",
                           "--receipt", "-")
    text, _, rest = out.partition("\n")
    receipt = json.loads(rest)
    assert rc == 0 and text == want["text"] and receipt["output_sha256"] == want["receipt"]["output_sha256"]
    assert "receipt=" not in err and "tokens=24" in err


@pytest.mark.parametrize("how", ["signal", "raise"])
def test_ctrl_c_keeps_the_committed_text_and_a_cancelled_receipt(tmp_path, capsys, monkeypatch, how):
    args = ["run", *REF, "--mode", "off", "--max-tokens", "40", "--prompt", "hello"]
    rc, js, _ = run_cli(capsys, *args, "--json")
    full = json.loads(js)
    _with_plugin(monkeypatch, _CtrlCAt(6, how))
    path = tmp_path / "r.json"
    rc, out, err = run_cli(capsys, *args, "--receipt", str(path))
    assert rc == 130
    receipt = json.loads(path.read_text())
    assert receipt["status"] == "cancelled" and receipt["output_tokens"] == 6  # rounds 0-5 committed
    # a real Ctrl-C goes through the CLI's handler: a cancel, checked at the next step
    assert receipt["error"].startswith("generation cancelled" if how == "signal" else "KeyboardInterrupt")
    assert receipt["output_sha256"] == token_digest(full["tokens"][:6])
    printed = out.removesuffix("\n")
    assert full["text"].startswith(printed) and len(printed) > 0
    assert "[cancelled]" in err and "Traceback" not in err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the CLI put the handler back
    rc, js, _ = run_cli(capsys, *args, "--json")
    obj = json.loads(js)
    assert rc == 130 and obj["receipt"]["status"] == "cancelled" and obj["tokens"] == full["tokens"][:6]


def test_chat_needs_a_template_and_system_needs_chat(capsys):
    rc, _, err = run_cli(capsys, "run", *REF, "--chat", "--prompt", "hi")
    assert rc == 2 and "no chat template: pass a plain prompt" in err
    rc, _, err = run_cli(capsys, "run", *REF, "--system", "be brief", "--prompt", "hi")
    assert rc == 1 and "--system needs --chat" in err


def test_models_without_tokenizer_stream_ids(capsys):
    model = ["--backend", "reference", "--model", "reference:seed=2,vocab=200,dim=16"]
    rc, out, err = run_cli(capsys, "run", *model, "--max-tokens", "7", "--prompt", "1 2 3")
    rc2, js, _ = run_cli(capsys, "run", *model, "--max-tokens", "7", "--prompt", "1 2 3", "--json")
    assert rc == rc2 == 0 and out.split() == [str(t) for t in json.loads(js)["tokens"]]


def test_no_warmup_flag():
    assert _config_from_args(build_parser().parse_args(["run"])).warmup is True  # llama.cpp's default too
    assert _config_from_args(build_parser().parse_args(["run", "--no-warmup"])).warmup is False
