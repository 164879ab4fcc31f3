"""Helpers shared by the artifact tests (measuring reads and time)."""

import time
from pathlib import Path


def rchar() -> int | None:
    """Bytes this process has read through read syscalls (Linux), or None."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.perf_counter() - self.t0
