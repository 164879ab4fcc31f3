"""One-token pass time by the thread that decodes (docs/embedding.md, "Threads"): llama.cpp's CPU
passes run as OpenMP teams led by the calling thread, and a second thread that has led a team makes
libgomp stop spinning at barriers. Median ms of 30 passes each, SmolLM2, 2 threads, exact numerics.

    python tests/bench/thread_teams.py
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from power_core import PowerConfig, Session
from power_core.session import in_own_thread


def passes(target) -> float:
    times = []
    for _ in range(30):
        cp = target.checkpoint()
        t0 = time.perf_counter()
        target.decode(np.array([5], dtype=np.int32))
        times.append(time.perf_counter() - t0)
        target.rollback(cp, 0)
    return round(statistics.median(times) * 1e3, 2)


def main() -> int:
    cfg = PowerConfig(spec_mode="off", numerics="exact", n_threads=2, n_ctx=2048)
    session = Session.open(cfg)  # opened on a thread of its own: no team is left behind
    target = session.opened.target

    def prefill() -> None:
        target.reset()
        target.prefill(np.arange(300, dtype=np.int32) % 1000)

    in_own_thread(prefill)
    with ThreadPoolExecutor(1) as pool:
        print("a worker thread, the only one that decodes:", pool.submit(passes, target).result(), "ms")
    print("the main thread, the only one that decodes now (the worker has ended):", passes(target), "ms")
    with ThreadPoolExecutor(1) as pool:
        print("a worker thread after the main thread decoded (two teams):", pool.submit(passes, target).result(), "ms")
    done = threading.Thread(target=lambda: print("a plain thread, two teams:", passes(target), "ms"))
    done.start()
    done.join()
    session.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
