"""bench_threads: does it matter which thread reads a request? (power_core.compute)

llama.cpp's CPU backend leads an OpenMP team from each thread that decodes, and libgomp stops spinning at a
pass's barriers once a process holds more team threads than CPUs. Power therefore decodes every solo request
on the process's compute thread. Each case below runs in a fresh interpreter on the tiny qwen35 fixture with
its MTP head (``--model`` for another GGUF), 192 tokens a request, and reports the median milliseconds a
request:

* ``one_thread``: one session, every request from the main thread;
* ``two_threads``: one session, requests from two threads in turn (a web framework's worker pool);
* ``two_sessions``: two sessions, each read from a thread of its own, in turn;
* ``serve_no_batch``: ``power serve --no-batch --parallel 2``, one client, requests in turn.

``--base DIR``: also run every case with the ``power_core`` of another checkout first on ``PYTHONPATH``
(e.g. a ``git worktree`` of the commit before), alternating with this one, for a paired before/after.
JSON and Markdown evidence.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "native"))

CHILD = r"""
import json, statistics, sys, time
from concurrent.futures import ThreadPoolExecutor
from power_core.config import PowerConfig
from power_core.session import Session

model, case, n, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
cfg = PowerConfig(spec_mode=mode, max_tokens=192, n_threads=2, n_ctx=512)
prompt = "hello world, this is a test prompt for the speculative decoding benchmark"
pools = [ThreadPoolExecutor(1) for _ in range(2)]
sessions = [Session.open(cfg, model=model) for _ in range(2 if case == "two_sessions" else 1)]

def one(s):
    t = time.perf_counter()
    s.generate(prompt)
    return time.perf_counter() - t

def request(i):
    if case == "one_thread":
        return one(sessions[0])
    if case == "two_threads":
        return pools[i % 2].submit(one, sessions[0]).result()
    return pools[i % 2].submit(one, sessions[i % 2]).result()

for i in range(4):
    request(i)
ms = [request(i) * 1e3 for i in range(n)]
for s in sessions:
    s.close()
print(json.dumps({"median_ms": statistics.median(ms), "ms": ms}))
"""


def _env(base: Path | None) -> dict[str, str]:
    """This environment, with ``base``'s ``power_core`` imported first when given."""
    env = dict(os.environ)
    if base is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(base), env.get("PYTHONPATH", "")])
    return env


def _in_process(model: Path, case: str, n: int, mode: str, base: Path | None) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), case, str(n), mode], env=_env(base), check=True,
                         capture_output=True, text=True, cwd=base or ROOT)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["median_ms"])


def _serve(model: Path, n: int, mode: str, base: Path | None) -> float:
    import httpx

    from tests.serve_helpers import listening, power_cmd

    cmd = power_cmd("serve", "--port", "0", "--model", str(model), "--mode", mode, "--threads", "2", "--n-ctx", "512",
                    "--parallel", "2", "--no-batch")
    prompts = ["hello world, this is a test prompt for the speculative decoding benchmark",
               "the quick brown fox jumps over the lazy dog and then the dog sleeps"]
    with listening(cmd, env=_env(base), cwd=base) as s, httpx.Client(timeout=600) as c:
        name = c.get(s.base_url + "/models").json()["data"][0]["id"]
        ms = []
        for i in range(n + 4):
            t = time.perf_counter()
            c.post(s.url + "/v1/completions", json={"model": name, "prompt": prompts[i % 2], "max_tokens": 192}
                   ).raise_for_status()
            if i >= 4:
                ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms)


CASES = ("one_thread", "two_threads", "two_sessions", "serve_no_batch")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: the tiny qwen35 MTP fixture)")
    ap.add_argument("--mode", default=None, help="spec_mode (default: mtp on the fixture, off on --model)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--runs", type=int, default=2, help="alternating runs of every case")
    ap.add_argument("--base", type=Path, default=None, help="another checkout's root, measured alternately")
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "bench_threads.json")
    args = ap.parse_args()
    model, mode = args.model, args.mode
    if model is None:
        from native_helpers import make_tiny_mtp

        tmp = args.out.parent / "bench_threads-fixtures"
        tmp.mkdir(parents=True, exist_ok=True)
        model = make_tiny_mtp(tmp, "qwen35", predictable=True, name="qwen35-mtp-predictable")
        mode = mode or "mtp"
    mode = mode or "off"
    sides: list[tuple[str, Path | None]] = [("this", None)] + ([("base", args.base)] if args.base else [])
    raw: dict[str, dict[str, list[float]]] = {side: {c: [] for c in CASES} for side, _ in sides}
    for run in range(args.runs):
        for case in CASES:
            for side, base in sides if run % 2 == 0 else sides[::-1]:
                ms = (_serve(model, args.requests, mode, base) if case == "serve_no_batch"
                      else _in_process(model, case, args.requests, mode, base))
                raw[side][case].append(ms)
                print(f"run {run + 1} {case:15s} {side}: {ms:.1f} ms a request", flush=True)
    summary = {side: {c: statistics.median(v) for c, v in cases.items()} for side, cases in raw.items()}
    report = {"bench": "threads", "model": str(model), "mode": mode, "requests": args.requests, "runs": args.runs,
              "base": str(args.base) if args.base else None, "median_ms": summary, "raw_ms": raw,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# bench_threads ({report['date']}, {model.name}, --mode {mode}, {args.requests} requests a case, "
             f"{args.runs} alternating runs; median ms a request)", "",
             "| case | " + " | ".join(side for side, _ in sides) + " |", "|---|" + "---|" * len(sides)]
    for case in CASES:
        lines.append(f"| {case} | " + " | ".join(f"{summary[side][case]:.1f}" for side, _ in sides) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
