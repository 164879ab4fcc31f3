"""Four clients on `power serve --parallel 4` and on `llama-server -np 4` (draft-mtp), both alive under the compute
clock (tests/bench/compute_clock.c), measured in turn (Power, llama-server, Power, llama-server), then each side's
llama.cpp calls inside its windows by context and by pass size: how many, and the median µs a call.

    PATH=.nox/tests/bin:$PATH python passes.py {mtp,mtp-predictable} REQUESTS_PER_CLIENT
"""

import collections
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "native"), str(ROOT / "tests" / "bench")]
from bench_drafts import PROMPTS, _fixtures  # noqa: E402
from bench_serve import LLAMA_ANNOUNCE, peer_bin_dir  # noqa: E402
from host_clock import compute_clock, traced_env  # noqa: E402
from serve_helpers import listening, power_cmd  # noqa: E402

from power_core.bench import peer_env  # noqa: E402

suite, per_client, clients = sys.argv[1], int(sys.argv[2]), 4
tmp = Path(tempfile.mkdtemp(prefix="passes-"))
target, _ = _fixtures(suite, tmp)
shim = compute_clock(tmp)
peer_bin, _ = peer_bin_dir()
traces = {side: tmp / f"trace-{side}.txt" for side in ("power", "llama")}
power = power_cmd("serve", "--port", "0", "--model", str(target), "--mode", "mtp", "--threads", "2", "--n-ctx", "512",
                  "--parallel", "4", "--draft-max", "7", "--numerics", "exact")
llama = [str(peer_bin / "llama-server"), "-m", str(target), "--host", "127.0.0.1", "--port", "0", "-t", "2", "-tb", "2",
         "-c", "2048", "-np", "4", "--spec-type", "draft-mtp", "--spec-draft-n-max", "7", "--spec-draft-p-min", "0",
         "--no-webui"]


def load(url: str, body: dict, tag: str) -> tuple[int, int]:
    def client(k: int) -> None:
        with httpx.Client(timeout=600) as c:
            for i in range(per_client):
                prompt = PROMPTS[(i + k) % len(PROMPTS)] + f" ({tag} {i} {k})"
                c.post(url + "/v1/completions", json={**body, "prompt": prompt}).raise_for_status()

    t0 = time.perf_counter_ns()  # CLOCK_MONOTONIC, the shim's clock
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return t0, time.perf_counter_ns()


windows: dict[str, list[tuple[int, int]]] = {"power": [], "llama": []}
with listening(power, startup_s=300, env=traced_env(dict(os.environ), shim, traces["power"])) as p, \
        listening(llama, announce=LLAMA_ANNOUNCE, startup_s=300,
                  env=traced_env(peer_env("exact"), shim, traces["llama"])) as q:
    name = httpx.get(p.url + "/v1/models").json()["data"][0]["id"]
    bodies = {"power": (p.url, {"model": name, "max_tokens": 192}),
              "llama": (q.url, {"model": "peer", "max_tokens": 192, "temperature": 0, "top_k": 1, "seed": 0})}
    for url, body in bodies.values():
        load(url, body, "warm-up")
    for turn in range(2):
        for side, (url, body) in bodies.items():
            windows[side].append(load(url, body, f"turn {turn}"))
time.sleep(1)  # the traces are written at exit
for side in ("power", "llama"):
    calls = [line.split() for line in traces[side].read_text().splitlines() if line.strip()]
    inside = [(ctx, int(d), int(n)) for ctx, s, d, n in calls if any(a <= int(s) <= b for a, b in windows[side])]
    wall = sum(b - a for a, b in windows[side])
    compute = sum(d for _, d, _ in inside)
    tokens = 2 * clients * per_client * 192
    print(f"== {side}: {tokens / (wall * 1e-9):.0f} tok/s; window {wall / 1e6:.0f} ms, compute {compute / 1e6:.0f} ms, "
          f"host {(wall - compute) / 1e6:.0f} ms")
    by_ctx: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for ctx, d, n in inside:
        by_ctx[ctx].append((d, n))
    for role, (_, xs) in zip(("target", "draft"), sorted(by_ctx.items(), key=lambda kv: len(kv[1])), strict=False):
        sizes: dict[int, list[int]] = collections.defaultdict(list)
        for d, n in xs:
            sizes[n].append(d)
        top = sorted(sizes.items(), key=lambda kv: -len(kv[1]))[:5]
        print(f"   {role}: {len(xs)} calls, {sum(d for d, _ in xs) / 1e6:.0f} ms; by tokens a call: "
              + ", ".join(f"{n}: {len(v)} x {statistics.median(v) / 1e3:.0f} us" for n, v in top))
