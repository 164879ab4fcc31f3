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
    proc = subprocess.Popen(power_cmd("serve", "--port", "0", *args), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
    log: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def drain() -> None:  # keep reading, so the server never blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            m = _ANNOUNCE.search(line)
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
            raise AssertionError(f"power serve did not start in {startup_s} s: {''.join(log)}")
    if not url:
        proc.wait(10)
        raise AssertionError(f"power serve exited with {proc.returncode} before listening: {''.join(log)}")
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
