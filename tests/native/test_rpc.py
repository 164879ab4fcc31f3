"""llama.cpp's RPC backend: two ``rpc-server`` processes on 127.0.0.1 hold SmolLM2's layers, and the
greedy output equals the local run; a dead, refused or silent server is a typed error naming the
address within a bounded time, never a hang and never ggml-rpc's process abort."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("power_native._llama")

from power_native import build_info  # noqa: E402
from power_native.rpc import RpcUnreachable, probe  # noqa: E402
from test_models import _model_path  # noqa: E402

from power_core import cli  # noqa: E402
from power_core.config import PowerConfig  # noqa: E402
from power_core.errors import ConfigError  # noqa: E402
from power_core.session import Session  # noqa: E402
from tests.helpers import build_tools  # noqa: E402

pytestmark = [pytest.mark.native, pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n"]


def _rpc_server() -> Path:
    tools = build_tools()
    exe = tools.build_dir(False, rpc=True) / "bin" / tools.RPC_SERVER
    if "-DGGML_RPC=ON" not in (build_info().get("flags") or []) or not exe.exists():
        why = f"power-native was built without RPC (POWER_NATIVE_RPC=1) or {exe} is missing"
        (pytest.fail if os.environ.get("CI") else pytest.skip)(why)
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(exe: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    # exact numerics on the servers too: their CPU kernels start batch-invariant (patch 0002)
    env = dict(os.environ, GGML_CPU_BATCH_INVARIANT="1")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port), "-t", "1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            probe(endpoint, timeout=2)
            return proc, endpoint
        except RpcUnreachable:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def servers():
    exe = _rpc_server()
    started = [_start(exe) for _ in range(2)]
    yield [endpoint for _, endpoint in started]
    gc.collect()  # free every model held on the servers while they run (ggml-rpc aborts otherwise)
    for proc, _ in started:
        proc.terminate()
        proc.wait(timeout=10)


def _run(model: str, **cfg) -> list:
    config = PowerConfig(**{"spec_mode": "off", "max_tokens": 32, "n_threads": 2, "n_ctx": 512, **cfg})
    with Session.open(config, model=model) as s:
        return [s.generate(p) for p in PROMPTS]


def test_greedy_output_on_two_rpc_servers_equals_the_local_run(servers):
    model = _model_path("smollm2")
    local = _run(model)
    remote = _run(model, rpc_servers=tuple(servers))
    for a, b in zip(local, remote, strict=True):
        assert a.tokens == b.tokens
    assert remote[0].receipt.backend["rpc_servers"] == servers
    assert local[0].receipt.backend["rpc_servers"] == []


def test_speculative_over_rpc_is_exact(servers):
    model = _model_path("smollm2")
    want = _run(model)
    got = _run(model, rpc_servers=tuple(servers[:1]), spec_mode="suffix")
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_cli_rpc_flag(servers, capsys):
    model = _model_path("smollm2")
    args = ["run", "--model", model, "--mode", "off", "--max-tokens", "16", "--threads", "2", "--json",
            "--prompt", PROMPTS[0]]
    assert cli.main(args + ["--rpc", ",".join(servers)]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert cli.main(args) == 0
    local = json.loads(capsys.readouterr().out)
    assert remote["tokens"] == local["tokens"] and remote["receipt"]["backend"]["rpc_servers"] == servers


def test_refused_dead_and_silent_servers_are_typed_errors_in_bounded_time(monkeypatch):
    model = _model_path("smollm2")
    exe = _rpc_server()
    proc, dead = _start(exe)
    proc.kill()
    proc.wait(timeout=10)
    refused = f"127.0.0.1:{_free_port()}"
    silent = socket.socket()  # accepts connections (the kernel's backlog) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    monkeypatch.setenv("POWER_RPC_TIMEOUT", "1")
    try:
        for endpoint in (dead, refused, f"127.0.0.1:{silent.getsockname()[1]}"):
            t0 = time.monotonic()
            with pytest.raises(RpcUnreachable, match=endpoint.replace(".", r"\.")) as err:
                _run(model, rpc_servers=(endpoint,))
            assert time.monotonic() - t0 < 10 and err.value.code == "rpc_unreachable"
    finally:
        silent.close()
    assert cli.main(["run", "--model", model, "--rpc", refused, "--max-tokens", "4"]) == 2


def test_a_second_model_on_servers_already_in_use(servers, monkeypatch):
    """rpc-server serves one client at a time and ggml-rpc keeps this process's connection open while
    a model lives there: a second load must reuse it, not time out in a fresh probe."""
    model = _model_path("smollm2")
    monkeypatch.setenv("POWER_NATIVE_SHARED_WEIGHTS", "0")  # a second, separate load onto the same servers
    monkeypatch.setenv("POWER_RPC_TIMEOUT", "1")
    cfg = PowerConfig(spec_mode="off", max_tokens=8, n_threads=2, n_ctx=512, rpc_servers=tuple(servers))
    with Session.open(cfg, model=model) as a, Session.open(cfg, model=model) as b:
        assert a.opened.target.model is not b.opened.target.model
        assert a.generate(PROMPTS[0]).tokens == b.generate(PROMPTS[0]).tokens


@pytest.mark.parametrize("bad", ["localhost", "host:0", "h:99999", ":80", "a:1,a:1", "[::1]:50052", "::1:80"])
def test_malformed_endpoints_are_config_errors(bad):
    with pytest.raises(ConfigError, match="rpc_servers"):
        PowerConfig(rpc_servers=bad)
