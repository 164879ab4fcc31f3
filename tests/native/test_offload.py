"""GPU offload configuration on this CPU-only build: a GPU asked of it is a typed error before any model
loads, and every receipt records the devices and offload settings it ran with."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("power_native._llama")

import power_native.target as native_target  # noqa: E402
from power_native import _llama  # noqa: E402

from power_core.cli import main  # noqa: E402
from power_core.config import PowerConfig  # noqa: E402
from power_core.errors import ConfigError  # noqa: E402
from power_core.session import Session  # noqa: E402

pytestmark = pytest.mark.native

BASE = dict(max_tokens=4, n_ctx=256, n_threads=2)


def test_this_build_has_only_the_cpu():
    assert _llama.backend_devices() == [("CPU", "cpu")]


@pytest.mark.parametrize("kw,key", [
    (dict(n_gpu_layers=1), "n_gpu_layers"),
    (dict(n_gpu_layers=-1), "n_gpu_layers"),
    (dict(devices=["CUDA0"]), "devices"),
    (dict(spec_mode="draft-model", draft_gpu_layers=1), "draft_gpu_layers"),
])
def test_a_gpu_asked_of_a_cpu_build_fails_typed_before_loading(tiny_llama, monkeypatch, kw, key):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(native_target, "load_model", no_load)
    with pytest.raises(ConfigError) as err:
        Session.open(PowerConfig(**{"spec_mode": "off", **BASE, **kw}), model=str(tiny_llama))
    assert err.value.key == key
    assert "POWER_NATIVE_CUDA=1 pip install ./native" in str(err.value) and "its devices: CPU" in str(err.value)


def test_a_gpu_asked_of_a_cpu_build_fails_typed_for_batches(tiny_llama):
    with pytest.raises(ConfigError, match="n_gpu_layers.*POWER_NATIVE_CUDA=1"):
        Session.open_batch(2, PowerConfig(spec_mode="off", n_gpu_layers=2, **BASE), model=str(tiny_llama))


def test_cli_gpu_flags_on_a_cpu_build_exit_2(tiny_llama, capsys):
    rc = main(["run", "--model", str(tiny_llama), "--mode", "off", "--max-tokens", "2", "--gpu-layers", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "'n_gpu_layers': got 1" in err and "POWER_NATIVE_CUDA=1" in err and "Traceback" not in err
    rc = main(["run", "--model", str(tiny_llama), "--mode", "off", "--max-tokens", "2", "--devices", "CUDA0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 2 and out["code"] == "config_invalid" and "CUDA0" in out["message"] and "CPU" in out["message"]


def test_model_load_and_context_reject_unknown_names(tiny_llama):
    with pytest.raises(ConfigError, match=r"devices.*this build's devices \(CPU\)"):
        _llama.Model.load(str(tiny_llama), n_gpu_layers=1, devices=("CUDA7",))
    m = _llama.Model.load(str(tiny_llama))
    with pytest.raises(ConfigError, match="flash_attn"):
        _llama.Context(m, n_ctx=64, n_batch=8, flash_attn="yes")


@pytest.mark.parametrize("mode,flash", [("off", "auto"), ("draft-model", "on"), ("draft-model", "off")])
def test_receipts_record_devices_and_offload(tiny_llama, mode, flash):
    cfg = PowerConfig(spec_mode=mode, flash_attn=flash, **BASE)
    with Session.open(cfg, model=str(tiny_llama)) as s:
        receipt = s.generate([1, 2, 3]).receipt
    assert receipt.backend["devices"] == ["CPU"]
    assert {k: receipt.backend[k] for k in ("n_gpu_layers", "draft_gpu_layers", "flash_attn")} == {
        "n_gpu_layers": 0, "draft_gpu_layers": 0, "flash_attn": flash}
    assert receipt.config["flash_attn"] == flash and receipt.config["devices"] == []


def test_batch_receipts_record_devices(tiny_llama):
    with Session.open_batch(2, PowerConfig(spec_mode="off", flash_attn="off", **BASE), model=str(tiny_llama)) as ss:
        receipt = ss.sessions[0].generate([1, 2, 3]).receipt
    assert receipt.backend["devices"] == ["CPU"] and receipt.backend["flash_attn"] == "off"
