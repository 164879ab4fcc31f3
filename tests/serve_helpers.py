"""Start a real ``power serve`` process on 127.0.0.1 (a free port, announced on stderr) for tests."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
_ANNOUNCE = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


@attrs.define
class Served:
    url: str
    proc: subprocess.Popen[str]
    log: list[str]

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stderr(self) -> str:
        return "".join(self.log)


def power_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "power_core.cli", *args]


@contextlib.contextmanager
def served(*args: str, startup_s: float = 180.0, env: dict[str, str] | None = None) -> Iterator[Served]:
    """``power serve --port 0 ARGS``; yields once it listens, and stops it (SIGTERM) afterwards."""
    with listening(power_cmd("serve", "--port", "0", *args), startup_s=startup_s,
                   env={**os.environ, **(env or {})}) as server:
        yield server


@contextlib.contextmanager
def listening(cmd: list[str], *, startup_s: float = 180.0, env: dict[str, str] | None = None,
              announce: re.Pattern[str] = _ANNOUNCE, cwd: Path | None = None) -> Iterator[Served]:
    """Any server process that announces ``listening on http://127.0.0.1:PORT`` on stderr once it serves
    (``power serve``, llama.cpp's ``llama-server --port 0``); stopped with SIGTERM afterwards. It runs in ``cwd``
    (default: the repository root, whose ``power_core`` a ``python -m`` command imports first)."""
    what = Path(cmd[0]).name if cmd[0] != sys.executable else "power serve"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd or ROOT, env=env)
    log: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def drain() -> None:  # keep reading, so the server never blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            m = announce.search(line)
            if m and not url:
                url.append(m.group(1))
                found.set()
        found.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    deadline = time.monotonic() + startup_s
    while not found.wait(0.2):
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what} did not start in {startup_s} s: {''.join(log)}")
    if not url:
        proc.wait(10)
        raise AssertionError(f"{what} exited with {proc.returncode} before listening: {''.join(log)}")
    server = Served(url[0], proc, log)
    try:
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(5)


def asgi(app, *calls: tuple[str, str, dict | None], timeout: float = 30.0) -> list:
    """Send ``calls`` (``(method, path, json)``) to the ASGI ``app`` in process, one after another, each
    within ``timeout`` seconds; their ``httpx`` responses."""
    import asyncio

    import httpx

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await asyncio.wait_for(client.request(method, path, json=body), timeout)
                    for method, path, body in calls]

    return asyncio.run(go())
