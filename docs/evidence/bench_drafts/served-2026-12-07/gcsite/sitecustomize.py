"""Imported by every Python process started with this directory on PYTHONPATH and GC_LOG set: at exit it appends
its argv and its full collections, (ms, objects frozen then, time % 1000), to GC_LOG."""
import atexit
import gc
import os
import sys
import time

if os.environ.get("GC_LOG"):
    _t = [0.0]
    _log: list[tuple[float, int, float]] = []

    def _cb(phase: str, info: dict) -> None:
        if phase == "start":
            _t[0] = time.perf_counter()
        elif info["generation"] == 2:
            _log.append((round((time.perf_counter() - _t[0]) * 1e3, 2), gc.get_freeze_count(), round(time.time() % 1000, 3)))

    gc.callbacks.append(_cb)

    def _dump() -> None:
        with open(os.environ["GC_LOG"], "a") as f:
            f.write(f"{' '.join(sys.argv[:3])[-60:]} gen2 {_log}\n")

    atexit.register(_dump)
