"""bench_breakdown: where a served request's wall time goes, in µs per request, at 1 and at 4 clients.

A real ``power serve`` (streamed chat completions through the official ``openai`` client, a chat
template, the prompt cache on) runs under two clocks at once:

- ``compute_clock.c`` (``LD_PRELOAD``, :mod:`host_clock`): the time inside llama.cpp's decode calls,
  target and drafts: **llama.cpp compute**;
- ``py-spy record --gil --threads``: samples of the Python thread holding the GIL (host work; a thread
  waiting on a lock, a socket or a llama.cpp call that released the GIL is not sampled). Each sample is
  charged to the innermost Power function on its stack, and that function to one cost by the
  :data:`COSTS` table (library frames below it, json or jinja2 or prometheus_client, count for the Power
  function that called them; stacks with no Power frame are the HTTP server's own).

Per cost: µs per request = samples / rate / requests. The report names the top five. Host work the
GIL does not see (C code that releases it, kernel time in socket calls) is the rest: wall time minus
compute minus the sampled Python time.

    python tests/bench/bench_breakdown.py --out docs/evidence/bench_breakdown [--requests 200] [--mode mtp]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT / "tests" / "native"))
from host_clock import compute_clock, split, traced_env  # noqa: E402

from tests.serve_helpers import listening, power_cmd  # noqa: E402

#: (cost, pattern on "function (file)" of the innermost Power frame): the first match names the cost
COSTS: tuple[tuple[str, str], ...] = (
    ("llama.cpp calls holding the GIL", r"\((power_native|power_mtp|power_eagle3|power_dflash2?|power_dspark)/"),
    ("receipt building and copying", r"\(power_core/receipt\.py\)|Generation\.report|_receipt|to_json"),
    ("metrics", r"_round_metrics|_metrics|\(power_core/observers\.py\)"),
    ("text assembly (commits to text deltas)", r"\(power_core/(text|streaming)\.py\)|TextAssembler"),
    ("chat template", r"\(power_core/chat\.py\)|chat_prompt"),
    ("tokenizing", r"tokeniz|encode \("),
    ("prompt cache (match, save, restore)", r"\(power_core/memory\.py\)|resident|prompt_cache|save_state|load_state"
                                            r"|prepare_memory"),
    ("constraints", r"\(power_core/(constraint|tools)\.py\)"),
    ("the transaction's host work per round", r"\(power_core/(transaction|sampling|scheduler|spec|runtime)\.py\)"),
    ("engine hand-offs and scheduling", r"\(power_core/engine\.py\)"),
    ("session: request assembly", r"\(power_core/(session|config)\.py\)"),
    ("HTTP, JSON and the OpenAI protocol", r"\(power_core/serve/"),
)
POWER_FRAME = re.compile(r"\((power_core|power_native|power_mtp|power_eagle3|power_dflash2?|power_dspark|power_suffix)/")
MESSAGES = [{"role": "system", "content": "You are a helpful assistant that answers briefly."},
            {"role": "user", "content": "Tell me a short story about a robot who learns to paint."}]


def charge(stack: str) -> str:
    """The cost a sampled stack belongs to (:data:`COSTS`)."""
    frames = [re.sub(r":\d+\)", ")", f) for f in stack.split(";")[1:]]
    inner = next((f for f in reversed(frames) if POWER_FRAME.search(f)), None)
    if inner is None:
        return "HTTP, JSON and the OpenAI protocol"
    return next((cost for cost, pattern in COSTS if re.search(pattern, inner)), "other Power code")


def _requests(base_url: str, model: str, n: int, clients: int, tokens: int) -> tuple[int, int, int]:
    """``n`` streamed chat completions over ``clients`` threads; (start_ns, end_ns, completion tokens)."""
    from openai import OpenAI

    done = [0]
    lock = threading.Lock()
    per = [n // clients + (1 if k < n % clients else 0) for k in range(clients)]
    gate = threading.Barrier(clients)

    def client(k: int) -> None:
        oa = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        gate.wait()
        for i in range(per[k]):
            msgs = [MESSAGES[0], {"role": "user", "content": f"{MESSAGES[1]['content']} ({k}-{i})"}]
            stream = oa.chat.completions.create(model=model, messages=msgs, max_tokens=tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.usage is not None:
                    with lock:
                        done[0] += chunk.usage.completion_tokens

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter_ns()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return t0, time.perf_counter_ns(), done[0]


def measure(args: argparse.Namespace, target: Path, clients: int, tmp: Path, shim: Path) -> dict[str, Any]:
    trace, samples = tmp / f"trace-c{clients}.txt", tmp / f"spy-c{clients}.txt"
    cmd = power_cmd("serve", "--port", "0", "--model", str(target), "--mode", args.mode, "--threads",
                    str(args.threads), "--n-ctx", "1024", "--parallel", "4", "--numerics", "exact",
                    "--chat-template", str(ROOT / "docs" / "examples" / "hermes-tools.jinja"), *args.power_args.split())
    with listening(cmd, env=traced_env(dict(os.environ), shim, trace)) as s:
        from openai import OpenAI

        model = OpenAI(base_url=s.base_url, api_key="unused").models.list().data[0].id
        _requests(s.base_url, model, 8, clients, args.tokens)  # warm-up: graphs, caches
        spy = subprocess.Popen([args.py_spy, "record", "--pid", str(s.proc.pid), "--format", "raw", "-o", str(samples),
                                "--gil", "--threads", "--rate", str(args.rate), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # py-spy attaches
        start, end, tokens = _requests(s.base_url, model, args.requests, clients, args.tokens)
        spy.send_signal(2)
        _, err = spy.communicate(timeout=120)
    if not samples.exists():
        raise SystemExit(f"py-spy wrote no samples: {err.strip()}")
    host = split(trace, start, end)
    costs: collections.Counter[str] = collections.Counter()
    window_s = (end - start) * 1e-9
    for line in samples.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        costs[charge(stack)] += int(n)
    sampled = sum(costs.values())
    us = {cost: n / args.rate / args.requests * 1e6 for cost, n in costs.most_common()}
    wall_us = window_s / args.requests * 1e6
    compute_us = host.compute_s / args.requests * 1e6
    python_us = sampled / args.rate / args.requests * 1e6
    return {"clients": clients, "requests": args.requests, "completion_tokens": tokens, "window_s": window_s,
            "rounds": host.rounds, "wall_us_per_request": wall_us, "compute_us_per_request": compute_us,
            "python_us_per_request": python_us, "unsampled_host_us_per_request": wall_us - compute_us - python_us,
            "costs_us_per_request": us, "tok_s": tokens / window_s}


def _markdown(report: dict[str, Any]) -> str:
    lines = ["# bench_breakdown: a served request's time, cost by cost", "",
             f"`{report['command']}`, {report['date']}, model `{report['model']}`, mode `{report['mode']}`, "
             f"{report['tokens']} tokens per request, {report['threads']} threads, py-spy at {report['rate']} Hz "
             "(`--gil`).", "",
             "Per request: server time = the measured window / requests; "
             "compute = llama.cpp decode calls (`compute_clock.c`); Python = py-spy samples of the GIL holder, "
             "charged to the innermost Power function (`COSTS` in `tests/bench/bench_breakdown.py`).", ""]
    for cell in report["cells"]:
        c = cell["clients"]
        lines += [f"## {c} client{'s' if c > 1 else ''}", "",
                  f"{cell['requests']} requests, {cell['completion_tokens']} tokens, {cell['tok_s']:.0f} tok/s, "
                  f"{cell['rounds']} target passes.", "",
                  "| | µs per request |", "|---|---|",
                  f"| server time (window / requests) | {cell['wall_us_per_request']:.0f} |",
                  f"| llama.cpp compute (target and draft) | {cell['compute_us_per_request']:.0f} |",
                  f"| Python host work (sampled) | {cell['python_us_per_request']:.0f} |",
                  f"| rest (waits, kernel, unsampled C) | {cell['unsampled_host_us_per_request']:.0f} |", "",
                  "| Python cost | µs per request |", "|---|---|"]
        lines += [f"| {'**' if i < 5 else ''}{cost}{'**' if i < 5 else ''} | {us:.0f} |"
                  for i, (cost, us) in enumerate(cell["costs_us_per_request"].items())]
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="mtp")
    ap.add_argument("--model", default="qwen35-mtp", help="qwen35-mtp (a tiny hybrid target with an MTP head that "
                    "reproduces it, written by the tests' helpers), smollm2, or a GGUF path")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--power-args", default="")
    ap.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "evidence" / "bench_breakdown")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-breakdown-"))
    if args.model == "qwen35-mtp":
        from native_helpers import make_tiny_mtp

        target = make_tiny_mtp(tmp, "qwen35", predictable=True, name="qwen35-mtp-predictable")
    elif args.model == "smollm2":
        from power_native.models import smollm2_path

        target = Path(smollm2_path())
    else:
        target = Path(args.model)
    shim = compute_clock(tmp)
    cells = [measure(args, target, int(c), tmp, shim) for c in args.clients.split(",")]
    report = {"bench": "breakdown", "command": " ".join(["python", *sys.argv]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model, "mode": args.mode,
              "tokens": args.tokens, "threads": args.threads, "rate": args.rate, "cells": cells}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
