"""Run from the repository root: python docs/evidence/bench_breakdown/gil-2026-12-06/gilsim.py REQUESTS BURN_US [mtp|dflash] [gil|nogil].

In process: MTP requests fed to the shared passes; each commit wakes a 'loop' thread that burns BURN µs of Python
holding the GIL (as the event loop does a chunk). The driver's host µs a round from the receipts."""
import hashlib, statistics, sys, threading, time, queue
from pathlib import Path
sys.path[:0] = [".", "tests/native", "tests/bench"]
from bench_drafts import _fixtures
from power_core.passes import Commit, Ended
from power_core.session import Session
n, burn_us = int(sys.argv[1]), float(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "mtp"
gil = (sys.argv[4] if len(sys.argv) > 4 else "gil") == "gil"  # "nogil": the same CPU, the GIL released (sha256)
BLOB = bytes(1 << 22)
t0 = time.perf_counter()
for _ in range(20):
    hashlib.sha256(memoryview(BLOB)[: 1 << 20])
VIEW = memoryview(BLOB)[: min(len(BLOB), int((1 << 20) * burn_us * 1e-6 / ((time.perf_counter() - t0) / 20)))]
target, draft = _fixtures(mode, Path("/tmp/pd"))
q: queue.SimpleQueue = queue.SimpleQueue()
def loop():
    while True:
        item = q.get()
        if item is None: return
        if isinstance(item, Commit) and burn_us:
            if not gil:
                hashlib.sha256(VIEW)  # one C call of ~BURN µs with the GIL released
                continue
            t = time.perf_counter() + burn_us * 1e-6
            while time.perf_counter() < t:
                pass
        elif isinstance(item, Ended):
            item_done.set()
th = threading.Thread(target=loop, daemon=True); th.start()
item_done = threading.Event()
with Session.open_engine(4, model=str(target), spec_mode=mode, n_threads=2, n_ctx=512, spec_draft_max=7,
                         **({"draft": str(draft)} if draft is not None else {})) as eng:
    host = []
    for i in range(n + 2):
        t = eng.reserve(); s = t.session
        g = s.start([1, 2, 3, 4 + i % 50], max_tokens=192)
        item_done.clear()
        eng.feed(g, q.put)
        item_done.wait()
        r = g.report()
        if i >= 2: host.append(r.to_dict()["timings"]["host_us_per_round"])
    q.put(None)
print(f"burn {burn_us} µs a commit ({'holding' if gil else 'releasing'} the GIL): driver host µs a round median {statistics.median(host):.1f} least {min(host):.1f}")
