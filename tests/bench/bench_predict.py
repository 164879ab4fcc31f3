"""bench_predict: OpenAI's ``prediction`` (Predicted Outputs) on a code-edit set, against ``power serve``.

Each task is a small source file and an instruction for one small edit; the request asks for the whole
file, edited, and the prediction is the original file (as editors send it). One ``power serve --mode
off,suffix`` process (one slot, the cross-request suffix memory off, so every request stands alone)
answers three cells per task, paired and interleaved (A, B, C then C, B, A); ``--cache-ram 0``: every
request prefills its whole prompt, so wall times compare too:

* ``off``: ``power.strategy`` ``off``, no prediction (target-only: the reference output);
* ``suffix``: ``power.strategy`` ``suffix``, no prediction;
* ``prediction``: ``power.strategy`` ``suffix`` with the prediction (its drafts first, suffix's where the
  answer left it: docs/serving.md#predicted-outputs).

Reported: decode tok/s (the receipt's, ``power.decode_tok_s``) and wall tok/s (completion tokens / request
wall time) per cell, median (min-max), and the paired ratios prediction/off, prediction/suffix and
suffix/off (medians of per-(task, run) ratios); acceptance, tokens per target pass, and the prediction
counts (``usage.completion_tokens_details``). Exactness is asserted: every cell's text and
``output_sha256`` equal the ``off`` cell's of the same task (greedy), and once per task a seeded
stochastic request (temperature 0.8) with the prediction equals its ``off`` twin; a mismatch is listed
in the report and the bench exits 1. Each measurement records the CPU share other processes took
(``foreign_cpu``), as bench_serve does.

Writes ``report.json`` and ``report.md`` under ``--out`` (default ``docs/evidence/bench_predict/``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))

from bench_serve import _TICK, _cpu, stats  # noqa: E402

from tests.serve_helpers import listening, power_cmd  # noqa: E402

CELLS = ("off", "suffix", "prediction")
SYSTEM = "You are a code editor. Reply with the complete edited file and nothing else."
SEEDED = {"temperature": 0.8, "seed": 7}

#: (name, instruction, file): small files, one small edit each
TASKS: tuple[tuple[str, str, str], ...] = (
    ("stats.py", "Rename the function `mean` to `average`, and its call.", '''\
"""Small statistics helpers."""

import math


def mean(values):
    """The arithmetic mean of a non-empty list."""
    return sum(values) / len(values)


def variance(values):
    """The population variance."""
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def stdev(values):
    """The population standard deviation."""
    return math.sqrt(variance(values))


def median(values):
    """The middle value (the mean of the two middle values for an even count)."""
    s = sorted(values)
    n = len(s)
    mid = n // 2
    if n % 2:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2
'''),
    ("server.py", "Change the default port from 8080 to 9090.", '''\
import argparse
import http.server
import socketserver


class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        print("request:", format % args)


def main():
    parser = argparse.ArgumentParser(description="Serve the current directory.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    with socketserver.TCPServer((args.host, args.port), Handler) as httpd:
        print("Serving on", args.host, args.port)
        httpd.serve_forever()


if __name__ == "__main__":
    main()
'''),
    ("cart.js", "Change the tax rate from 0.2 to 0.25.", '''\
const TAX_RATE = 0.2;

function lineTotal(item) {
  return item.price * item.quantity;
}

function subtotal(cart) {
  return cart.items.reduce((sum, item) => sum + lineTotal(item), 0);
}

function tax(cart) {
  return subtotal(cart) * TAX_RATE;
}

function total(cart) {
  return subtotal(cart) + tax(cart);
}

function addItem(cart, name, price, quantity) {
  cart.items.push({ name, price, quantity });
  return cart;
}

module.exports = { lineTotal, subtotal, tax, total, addItem };
'''),
    ("config.py", "Change the default timeout from 30 to 60 seconds.", '''\
from dataclasses import dataclass, field


@dataclass
class RetryPolicy:
    attempts: int = 3
    backoff: float = 0.5


@dataclass
class ClientConfig:
    base_url: str = "https://api.example.com"
    timeout: int = 30
    verify_tls: bool = True
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    headers: dict = field(default_factory=dict)

    def with_header(self, name, value):
        headers = dict(self.headers)
        headers[name] = value
        return ClientConfig(self.base_url, self.timeout, self.verify_tls, self.retry, headers)
'''),
    ("queue.py", "Add a method `__len__` that returns the number of items.", '''\
class Queue:
    """A first-in, first-out queue."""

    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty queue")
        return self._items.pop(0)

    def peek(self):
        if not self._items:
            raise IndexError("peek at an empty queue")
        return self._items[0]

    def empty(self):
        return not self._items
'''),
)


def _process_cpu(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used: the server, a child not yet waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _foreign(start: tuple[float, float, float], server_start: float, pid: int) -> float:
    """The share of the machine's CPU that processes other than this bench and its server used since
    ``start`` (0: none, 1: every core)."""
    end = _cpu()
    wall = end[0] - start[0]
    ours = (end[2] - start[2]) + (_process_cpu(pid) - server_start)
    return max(0.0, ((end[1] - start[1]) - ours) / (wall * (os.cpu_count() or 1))) if wall > 0 else 0.0


def _messages(instruction: str, source: str, name: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{instruction}\n\nThe file {name}:\n\n{source}"}]


def _ask(client: httpx.Client, url: str, pid: int, model: str, task: tuple[str, str, str], cell: str,
         max_tokens: int, sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    name, instruction, source = task
    body: dict[str, Any] = {"model": model, "messages": _messages(instruction, source, name), "max_tokens": max_tokens,
                            "power": {"strategy": "off" if cell == "off" else "suffix"}, **(sampling or {})}
    if cell == "prediction":
        body["prediction"] = {"type": "content", "content": source}
    start, server_start = _cpu(), _process_cpu(pid)
    t0 = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json=body)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    d = r.json()
    p, usage = d["power"], d["usage"]
    n = usage["completion_tokens"]
    details = usage.get("completion_tokens_details") or {}
    return {"text": d["choices"][0]["message"]["content"], "sha256": p["output_sha256"], "n": n,
            "decode_tok_s": p["decode_tok_s"], "wall_tok_s": n / wall, "latency_s": wall,
            "acceptance": p["acceptance"], "tokens_per_pass": p["tokens_per_target_pass"],
            "accepted_prediction_tokens": details.get("accepted_prediction_tokens"),
            "rejected_prediction_tokens": details.get("rejected_prediction_tokens"),
            "foreign_cpu": _foreign(start, server_start, pid)}


def _ratios(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> list[float]:
    return [x[key] / y[key] for x, y in zip(a, b, strict=True) if x[key] and y[key]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a resolve_model name or a GGUF path")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=320, help="max_tokens of every request")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "evidence" / "bench_predict")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    from power_native.models import resolve_model

    model = str(resolve_model(args.model)) if not Path(args.model).is_file() else args.model
    cmd = power_cmd("serve", "--port", "0", "--model", model, "--mode", "off,suffix", "--threads", str(args.threads),
                    "--n-ctx", str(args.n_ctx), "--parallel", "1", "--suffix-memory", "0", "--cache-ram", "0")
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {t[0]: {c: [] for c in CELLS} for t in TASKS}
    seeded: dict[str, dict[str, Any]] = {}
    mismatches: list[str] = []
    with listening(cmd) as server, httpx.Client(timeout=1800) as client:
        name = client.get(server.base_url + "/models").json()["data"][0]["id"]
        for i in range(args.runs):
            for task in TASKS:
                order = CELLS if i % 2 == 0 else CELLS[::-1]
                for cell in order:
                    raw[task[0]][cell].append(_ask(client, server.url, server.proc.pid, name, task, cell,
                                                            args.tokens))
                got = {c: raw[task[0]][c][-1] for c in CELLS}
                for cell in ("suffix", "prediction"):
                    if (got[cell]["sha256"], got[cell]["text"]) != (got["off"]["sha256"], got["off"]["text"]):
                        mismatches.append(f"{task[0]} run {i + 1}: {cell} differs from off")
                print(f"  run {i + 1}/{args.runs} {task[0]}: " + " ".join(
                    f"{c}={got[c]['decode_tok_s']:.1f}" for c in CELLS) + f" tok/s ({got['off']['n']} tokens, "
                    f"{got['prediction']['accepted_prediction_tokens']} prediction tokens accepted)", flush=True)
        for task in TASKS:  # seeded stochastic: the prediction changes nothing either
            off = _ask(client, server.url, server.proc.pid, name, task, "off", args.tokens, SEEDED)
            pred = _ask(client, server.url, server.proc.pid, name, task, "prediction", args.tokens, SEEDED)
            same = (off["sha256"], off["text"]) == (pred["sha256"], pred["text"])
            seeded[task[0]] = {"same_as_off": same, "tokens": off["n"], "off_decode_tok_s": off["decode_tok_s"],
                               "prediction_decode_tok_s": pred["decode_tok_s"]}
            if not same:
                mismatches.append(f"{task[0]} seeded: prediction differs from off")
    report = _report(args, model, raw, seeded, mismatches)
    _write(args.out, report)
    print((args.out / "report.md").read_text())
    return 1 if mismatches else 0


def _report(args: argparse.Namespace, model: str, raw: dict[str, dict[str, list[dict[str, Any]]]],
            seeded: dict[str, dict[str, Any]], mismatches: list[str]) -> dict[str, Any]:
    tasks: dict[str, Any] = {}
    pairs: dict[str, list[float]] = {"prediction/off": [], "prediction/suffix": [], "suffix/off": []}
    wall_pairs: dict[str, list[float]] = {k: [] for k in pairs}
    for name, cells in raw.items():
        entry: dict[str, Any] = {"tokens": cells["off"][0]["n"],
                                 "prediction_accepted": cells["prediction"][0]["accepted_prediction_tokens"],
                                 "prediction_rejected": cells["prediction"][0]["rejected_prediction_tokens"]}
        for cell, runs in cells.items():
            entry[cell] = {"decode_tok_s": stats([r["decode_tok_s"] for r in runs]),
                           "wall_tok_s": stats([r["wall_tok_s"] for r in runs]),
                           "acceptance": stats([r["acceptance"] for r in runs]),
                           "tokens_per_pass": stats([r["tokens_per_pass"] for r in runs]),
                           "foreign_cpu": stats([r["foreign_cpu"] for r in runs])}
        for key in pairs:
            a, b = key.split("/")
            pairs[key] += _ratios(cells[a], cells[b], "decode_tok_s")
            wall_pairs[key] += _ratios(cells[a], cells[b], "wall_tok_s")
            entry[f"{a}_over_{b}"] = stats(_ratios(cells[a], cells[b], "decode_tok_s"))
        tasks[name] = entry
    every = [r for cells in raw.values() for runs in cells.values() for r in runs]
    return {"schema": "power.bench_predict/1", "model": model, "runs": args.runs, "max_tokens": args.tokens,
            "threads": args.threads, "n_ctx": args.n_ctx, "server": "power serve --mode off,suffix --parallel 1 "
            "--suffix-memory 0 --cache-ram 0", "tasks": tasks,
            "paired_decode": {k: stats(v) for k, v in pairs.items()},
            "paired_wall": {k: stats(v) for k, v in wall_pairs.items()},
            "exact": not mismatches, "mismatches": mismatches, "seeded": seeded,
            "foreign_cpu": stats([r["foreign_cpu"] for r in every]),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_end": os.getloadavg()}}


def _fmt(s: dict[str, float] | None, digits: int = 1) -> str:
    return "—" if not s else f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def _markdown(r: dict[str, Any]) -> str:
    lines = ["# bench_predict: `prediction` (Predicted Outputs) on a code-edit set", "",
             f"`{r['server']}`, {Path(r['model']).name}, {r['threads']} thread(s), {r['runs']} paired, interleaved "
             f"runs of {len(r['tasks'])} tasks, max_tokens {r['max_tokens']}, greedy. Cells: `off` (target-only), "
             "`suffix`, `prediction` (suffix lane + the original file as the prediction). Figures: median (min–max); "
             "ratios are medians of per-(task, run) pairs. Decode tok/s is the receipt's; wall tok/s is completion "
             "tokens / request wall time. The prompt holds the file as well (as an editor's request does), so "
             "`suffix` drafts from the same text through its own-request index; the prediction adds its "
             "alignment (the answer's place in the file) and drafts where suffix's match is too short.", "",
             "| task | tokens | off tok/s | suffix tok/s | prediction tok/s | prediction tokens/pass | "
             "prediction / off | prediction / suffix | accepted / rejected prediction tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, t in r["tasks"].items():
        lines.append(f"| {name} | {t['tokens']} | {_fmt(t['off']['decode_tok_s'])} | {_fmt(t['suffix']['decode_tok_s'])} "
                     f"| {_fmt(t['prediction']['decode_tok_s'])} | {_fmt(t['prediction']['tokens_per_pass'], 2)} "
                     f"| x{_fmt(t['prediction_over_off'], 2)} | x{_fmt(t['prediction_over_suffix'], 2)} "
                     f"| {t['prediction_accepted']} / {t['prediction_rejected']} |")
    pd, pw = r["paired_decode"], r["paired_wall"]
    lines += ["", "Paired ratios over every (task, run):", ""]
    for key in pd:
        lines.append(f"- {key}: decode x{_fmt(pd[key], 3)}, wall x{_fmt(pw[key], 3)}")
    lines += ["", f"Exact: {'yes' if r['exact'] else 'NO'} — every suffix and prediction answer equals the off answer of "
              "its task (text and output_sha256), greedy; seeded (temperature 0.8, seed 7) prediction = off: "
              + ", ".join(f"{k} {'yes' if v['same_as_off'] else 'NO'}" for k, v in r["seeded"].items()) + "."]
    if r["mismatches"]:
        lines += ["", "Mismatches:", *[f"- {m}" for m in r["mismatches"]]]
    lines += ["", f"Other processes' CPU share during the requests: {_fmt(r['foreign_cpu'], 2)} (a shared machine: "
              "quote ratios, not absolute rates). Machine: " + json.dumps(r["machine"]) + "."]
    return "\n".join(lines) + "\n"


def _write(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report["written"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(_markdown(report))


if __name__ == "__main__":
    raise SystemExit(main())
