"""bench_serve: ``power serve`` against ``power run`` and llama.cpp's ``llama-server``, paired and interleaved.

The speed evidence of the server (issue 17), on each model (SmolLM2-135M, the embedded default, and
Gemma-3-270M) and each copy-heavy prompt (``docs/examples/code-edit.txt``, ``quote-from-context.txt``):

a. one client: ``power serve --mode suffix`` vs the same request through ``power run --mode suffix``
   (goal: server decode tok/s >= 0.95x ``power run``'s, median of the per-run ratios). Decode tok/s is
   the receipt's ``decode_tok_s`` on both sides (the response's ``power.decode_tok_s``); the client-side
   figure is tokens / wall seconds of the HTTP request (prompt pass, HTTP and JSON included) against
   tokens / (prefill + decode seconds) of ``power run`` (its process start and model load excluded);
b. one client: the same ``power serve`` request vs ``llama-server`` of the pinned build (``--peers`` of
   ``native/tools/build_llama.py``) with each n-gram ``--spec-type`` (:data:`power_core.bench.NGRAM_TYPES`),
   the same prompt through its ``/v1/completions`` with temperature 0, top-k 1, the same ``max_tokens``
   (goal: Power >= 1.10x the best type, median of the per-run ratios). Its decode tok/s is
   ``timings.predicted_per_second`` (tokens after the first per generation second: Power's definition);
c. four clients: ``power serve --parallel 4`` vs ``llama-server -np 4`` (the best type of b), each client
   sending the same requests (every prompt once) at the same moment: aggregate tok/s (all completion
   tokens / the makespan) and request latency (p50, p99 pooled over the runs). No goal.

Both sides run Power's numerics: Power its default (``exact``), llama.cpp with the same batch-invariant
kernels (``GGML_CPU_BATCH_INVARIANT=1``, :func:`power_core.bench.peer_env`), so
both write the same text, which is checked: the server's text against ``power run``'s, and every text
against ``power run --mode off`` at the same token count (``same_text``; a llama.cpp type whose text
differs is listed, never the reference). Every measurement starts a fresh process (as ``power run``
does): a server that learns across requests (llama.cpp's ``ngram-mod`` pool, ``ngram-cache``, Power's
per-session acceptance model) would otherwise copy the previous run's identical answer. Within a run
the order of the cells alternates (A, B, ... then ..., B, A), so drift on a shared machine hits all.

On a shared machine every measurement also records the CPU share other processes took while it ran
(``foreign_cpu``: busy CPU time from ``/proc/stat`` minus this bench's and its children's, over wall
time x cores). Before each measurement the bench waits (up to ``--quiet-wait`` s) for a quiet machine,
and a measurement that other processes disturbed by more than ``--max-foreign`` is taken again (up
to ``--retries`` times; the last attempt is kept, and flagged in the report).

Host time (issue 46): every server runs under ``compute_clock.c`` (``tests/bench/host_clock.py``), which times each
llama.cpp decode call; a request's wall time less the decode calls inside it is its host time (HTTP, JSON, template,
tokenizing, the transaction, hand-offs, receipt), reported per request and per round (the target's calls), for
Power and llama-server alike. The four-client cell spreads its window's host time over its requests.

Writes ``report.json`` and ``report.md`` under ``--out`` (default ``evidence/bench_serve/``), the compute traces
under ``--out``/traces.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import httpx

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "native" / "tools"))
import build_llama  # noqa: E402
from host_clock import compute_clock, split, traced_env  # noqa: E402

from power_core.bench import NGRAM_TYPES, peer_env, read_prompt  # noqa: E402
from tests.serve_helpers import listening, power_cmd  # noqa: E402

LLAMA_ANNOUNCE = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")
DEFAULT_PROMPTS = ("code-edit.txt", "quote-from-context.txt")
SERVE_GOAL, PEER_GOAL = 0.95, 1.10


def stats(xs: list[float]) -> dict[str, float] | None:
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank percentile (``q`` in 0..100): with few samples p99 is the slowest request."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


# -- contention on a shared machine ---------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu() -> tuple[float, float, float]:
    """(wall, machine busy CPU s, this process's and its waited-for children's CPU s)."""
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    busy = (sum(f[:8]) - f[3] - f[4]) / _TICK  # all but idle and iowait
    own = sum(getattr(resource.getrusage(who), k) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for k in ("ru_utime", "ru_stime"))
    return time.perf_counter(), busy, own


def foreign_share(start: tuple[float, float, float]) -> float:
    """The share of the machine's CPU that other processes used since ``start`` (0: none, 1: all cores)."""
    end = _cpu()
    wall = end[0] - start[0]
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / (wall * (os.cpu_count() or 1))) if wall > 0 else 0.0


class Quiet:
    """Waits for a quiet machine before a measurement and takes it again when others disturbed it."""

    def __init__(self, max_foreign: float, wait_s: float, retries: int) -> None:
        self.max_foreign, self.wait_s, self.retries = max_foreign, wait_s, retries
        self.waited_s = 0.0
        self.retaken = 0

    def wait(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            start = _cpu()
            time.sleep(2.0)
            self.waited_s += 2.0
            if foreign_share(start) <= self.max_foreign:
                return

    def measure(self, fn: Any) -> dict[str, Any]:
        for attempt in range(self.retries + 1):
            self.wait()
            start = _cpu()
            r = fn()
            share = foreign_share(start)
            if share <= self.max_foreign or attempt == self.retries:
                r["foreign_cpu"], r["attempts"] = share, attempt + 1
                return r
            self.retaken += 1
        raise AssertionError("unreachable")


def peer_bin_dir() -> tuple[Path, dict[str, Any]]:
    """``bin/`` of the pinned build the installed power-native runs on (built with ``--peers`` if it lacks
    ``llama-server``), and that build's ``power-build.json``."""
    import power_native

    info = json.loads((Path(power_native.__file__).parent / "build-info.json").read_text())
    bdir = Path(info["build"])
    if not (bdir / "bin" / "llama-server").is_file():
        bdir = build_llama.build(cuda="-DGGML_CUDA=ON" in info.get("flags", []), peers=True, rpc=bool(info.get("rpc")))
    return bdir / "bin", info


# -- host time: the same split on both sides ---------------------------------------------------------
@attrs.frozen
class HostClock:
    """Servers run under ``compute_clock.c`` (tests/bench/host_clock.py): a request's wall time splits into
    the time inside llama.cpp's decode calls and everything else, Power's and llama-server's alike."""

    shim: Path
    dir: Path

    def env(self, env: dict[str, str], name: str) -> tuple[dict[str, str], Path]:
        trace = self.dir / f"trace-{name}.txt"
        trace.unlink(missing_ok=True)
        return traced_env(env, self.shim, trace), trace


def _host(trace: Path, windows: list[tuple[int, int]]) -> dict[str, Any]:
    """Host time over the requests' windows (``perf_counter_ns``, the compute clock's): per request and per
    round (the calls of the context with the fewest calls: the target's). Read after the server exited (the
    shim writes its trace at exit)."""
    parts = [split(trace, a, b) for a, b in windows]
    host_s = sum(p.host_s for p in parts)
    rounds = sum(p.rounds for p in parts)
    return {"host_us_per_request": host_s / len(parts) * 1e6, "host_us_per_round": host_s / rounds * 1e6 if rounds else None,
            "compute_s": sum(p.compute_s for p in parts), "rounds": rounds}


# -- one measurement each -----------------------------------------------------------------------------
def power_run(model: str, mode: str, text: str, tokens: int, threads: int, n_ctx: int) -> dict[str, Any]:
    cmd = power_cmd("run", "--model", model, "--mode", mode, "--threads", str(threads), "--n-ctx", str(n_ctx),
                    "--json", "--prompt", text, "--max-tokens", str(tokens))
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"power run exited {out.returncode}: {out.stderr[-1500:]}")
    d = json.loads(out.stdout)
    r = d["receipt"]
    t = r["timings"]
    n = len(d["tokens"])
    return {"decode_tok_s": t["decode_tok_s"], "wall_tok_s": n / (t["prefill_s"] + t["decode_s"]),
            "process_wall_s": wall, "n": n, "text": d["text"], "sha256": r["output_sha256"],
            "acceptance": r["summary"]["acceptance"]}


def _power_body(name: str, text: str, tokens: int) -> dict[str, Any]:
    # no sampling keys: the server's defaults, which are power run's (greedy)
    return {"model": name, "prompt": text, "max_tokens": tokens}


def _llama_body(text: str, tokens: int) -> dict[str, Any]:
    return {"model": "peer", "prompt": text, "max_tokens": tokens, "temperature": 0, "top_k": 1, "seed": 0}


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float, tuple[int, int]]:
    """The response, its wall seconds and its window on the compute clock (``perf_counter_ns``)."""
    t0 = time.perf_counter_ns()
    r = client.post(url + "/v1/completions", json=body)
    t1 = time.perf_counter_ns()
    r.raise_for_status()
    return r.json(), (t1 - t0) * 1e-9, (t0, t1)


def _power_result(d: dict[str, Any], wall: float) -> dict[str, Any]:
    n = d["usage"]["completion_tokens"]
    p = d["power"]
    return {"decode_tok_s": p["decode_tok_s"], "wall_tok_s": n / wall, "latency_s": wall, "n": n,
            "text": d["choices"][0]["text"], "sha256": p["output_sha256"], "acceptance": p["acceptance"]}


def _llama_result(d: dict[str, Any], wall: float) -> dict[str, Any]:
    t = d["timings"]
    n = d["usage"]["completion_tokens"]
    drafted = t.get("draft_n") or 0
    return {"decode_tok_s": t["predicted_per_second"], "wall_tok_s": n / wall, "latency_s": wall, "n": n,
            "predicted_n": t["predicted_n"], "text": d["choices"][0]["text"],
            "acceptance": t.get("draft_n_accepted", 0) / drafted if drafted else None}


def power_serve_cmd(model: str, mode: str, threads: int, n_ctx: int, parallel: int) -> list[str]:
    return power_cmd("serve", "--port", "0", "--model", model, "--mode", mode, "--threads", str(threads),
                     "--n-ctx", str(n_ctx), "--parallel", str(parallel))


def llama_server_cmd(peer_bin: Path, model: str, spec_type: str, threads: int, n_ctx: int,
                     parallel: int) -> list[str]:
    # -c is the whole KV cache: each of the -np slots gets n_ctx (Power's per-session context)
    return [str(peer_bin / "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", "0",
            "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx * parallel), "-np", str(parallel),
            "--spec-type", spec_type, "--no-webui"]


def power_serve_once(model: str, mode: str, text: str, tokens: int, threads: int, n_ctx: int,
                     clock: HostClock) -> dict[str, Any]:
    env, trace = clock.env(dict(os.environ), "power-serve")
    with listening(power_serve_cmd(model, mode, threads, n_ctx, 1), env=env) as s, httpx.Client(timeout=900) as c:
        name = c.get(s.base_url + "/models").json()["data"][0]["id"]
        d, wall, window = _post(c, s.url, _power_body(name, text, tokens))
    return {**_power_result(d, wall), **_host(trace, [window])}


def llama_server_once(peer_bin: Path, model: str, spec_type: str, text: str, tokens: int, threads: int,
                      n_ctx: int, numerics: str, clock: HostClock) -> dict[str, Any]:
    env, trace = clock.env(peer_env(numerics), f"llama-server-{spec_type}")
    cmd = llama_server_cmd(peer_bin, model, spec_type, threads, n_ctx, 1)
    with listening(cmd, env=env, announce=LLAMA_ANNOUNCE) as s, httpx.Client(timeout=900) as c:
        d, wall, window = _post(c, s.url, _llama_body(text, tokens))
    return {**_llama_result(d, wall), **_host(trace, [window])}


# -- a: server vs power run, b: vs llama-server n-gram types (one client) --------------------------------
def bench_prompt(args: argparse.Namespace, peer_bin: Path, model: str, path: Path, quiet: Quiet) -> dict[str, Any]:
    text = read_prompt(path)
    off = power_run(model, "off", text, args.tokens, args.threads, args.n_ctx)  # the reference text and count
    n_ref = off["n"]
    cells = ["power-serve", "power-run", *args.types]
    raw: dict[str, list[dict[str, Any]]] = {c: [] for c in cells}

    def one(cell: str) -> dict[str, Any]:
        if cell == "power-serve":
            return power_serve_once(model, args.mode, text, args.tokens, args.threads, args.n_ctx, args.clock)
        if cell == "power-run":
            return power_run(model, args.mode, text, args.tokens, args.threads, args.n_ctx)
        return llama_server_once(peer_bin, model, cell, text, args.tokens, args.threads, args.n_ctx, args.peer_numerics,
                                 args.clock)

    for i in range(args.runs):
        order = cells if i % 2 == 0 else cells[::-1]
        for cell in order:
            raw[cell].append(quiet.measure(lambda cell=cell: one(cell)))
        serve, run = raw["power-serve"][-1], raw["power-run"][-1]
        line = " ".join(f"{c}={raw[c][-1]['decode_tok_s']:.1f}" for c in cells)
        print(f"  {path.name} run {i + 1}/{args.runs}: {line} tok/s; serve/run x{serve['decode_tok_s'] / run['decode_tok_s']:.3f}",
              flush=True)
    every = [r for runs in raw.values() for r in runs]
    out: dict[str, Any] = {"tokens": n_ref, "off_sha256": off["sha256"],
                           "foreign_cpu": stats([r["foreign_cpu"] for r in every]),
                           "disturbed": sum(r["foreign_cpu"] > args.max_foreign for r in every)}
    serve, run = raw["power-serve"], raw["power-run"]
    out["power_serve"] = {
        "decode_tok_s": stats([r["decode_tok_s"] for r in serve]), "wall_tok_s": stats([r["wall_tok_s"] for r in serve]),
        "latency_s": stats([r["latency_s"] for r in serve]), "acceptance": stats([r["acceptance"] for r in serve]),
        "host_us_per_request": stats([r["host_us_per_request"] for r in serve]),
        "host_us_per_round": stats([r["host_us_per_round"] for r in serve]), "tokens": serve[0]["n"],
        "same_as_power_run": all(a["sha256"] == b["sha256"] and a["text"] == b["text"] for a, b in zip(serve, run, strict=True)),
        "same_as_off": all(r["sha256"] == off["sha256"] for r in serve)}
    out["power_run"] = {
        "decode_tok_s": stats([r["decode_tok_s"] for r in run]), "wall_tok_s": stats([r["wall_tok_s"] for r in run]),
        "process_wall_s": stats([r["process_wall_s"] for r in run]), "acceptance": stats([r["acceptance"] for r in run]),
        "tokens": run[0]["n"], "same_as_off": all(r["sha256"] == off["sha256"] for r in run)}
    dec = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(serve, run, strict=True)]
    wal = [a["wall_tok_s"] / b["wall_tok_s"] for a, b in zip(serve, run, strict=True)]
    out["serve_over_run"] = {"decode": stats(dec), "wall": stats(wal), "goal": SERVE_GOAL,
                             "met": statistics.median(dec) >= SERVE_GOAL}
    peers: dict[str, Any] = {}
    for t in args.types:
        runs = raw[t]
        peers[t] = {"decode_tok_s": stats([r["decode_tok_s"] for r in runs]),
                    "wall_tok_s": stats([r["wall_tok_s"] for r in runs]),
                    "latency_s": stats([r["latency_s"] for r in runs]),
                    "acceptance": stats([r["acceptance"] for r in runs]),
                    "host_us_per_request": stats([r["host_us_per_request"] for r in runs]),
                    "host_us_per_round": stats([r["host_us_per_round"] for r in runs]),
                    "tokens": runs[0]["n"], "same_count": all(r["n"] == n_ref for r in runs),
                    "same_text": all(r["text"] == off["text"] for r in runs),
                    "power_over_peer": stats([a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(serve, runs, strict=True)]),
                    "host_per_request_power_over_peer": stats([a["host_us_per_request"] / b["host_us_per_request"]
                                                               for a, b in zip(serve, runs, strict=True)])}
    out["llama_server"] = peers
    same = {t: p for t, p in peers.items() if p["same_text"] and p["same_count"]}
    out["peers_other_workload"] = sorted(set(peers) - set(same))
    if same:
        best = max(same, key=lambda t: same[t]["decode_tok_s"]["median"])
        ratio = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(serve, raw[best], strict=True)]
        wall = [a["wall_tok_s"] / b["wall_tok_s"] for a, b in zip(serve, raw[best], strict=True)]
        out["best_type"] = best
        out["serve_over_best_type"] = {"decode": stats(ratio), "wall": stats(wall), "goal": PEER_GOAL,
                                       "met": statistics.median(ratio) >= PEER_GOAL}
    return out


# -- c: four clients ----------------------------------------------------------------------------------
def _clients(url: str, bodies: list[dict[str, Any]], clients: int, parse: Any) -> dict[str, Any]:
    """``clients`` threads, released together, each posting every body in order; makespan, results and the
    window (``perf_counter_ns``) from the first request's start to the last one's end."""
    gate = threading.Barrier(clients)
    results: list[list[dict[str, Any]]] = [[] for _ in range(clients)]
    errors: list[BaseException] = []
    spans: list[tuple[float, float]] = []

    def client(k: int) -> None:
        try:
            with httpx.Client(timeout=1800) as c:
                gate.wait()
                t0 = time.perf_counter_ns()
                for body in bodies:
                    d, wall, _ = _post(c, url, body)
                    results[k].append(parse(d, wall))
                spans.append((t0, time.perf_counter_ns()))
        except BaseException as exc:  # reported below, after every thread has ended
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    window = (min(s for s, _ in spans), max(e for _, e in spans))
    makespan = (window[1] - window[0]) * 1e-9
    flat = [r for rs in results for r in rs]
    return {"makespan_s": makespan, "tokens": sum(r["n"] for r in flat),
            "aggregate_tok_s": sum(r["n"] for r in flat) / makespan, "results": flat, "window": window}


def bench_concurrency(args: argparse.Namespace, peer_bin: Path, model: str, texts: dict[str, str],
                      refs: dict[str, dict[str, Any]], best: str, quiet: Quiet) -> dict[str, Any]:
    names = list(texts)
    raw: dict[str, list[dict[str, Any]]] = {"power-serve": [], "llama-server": []}

    def one(side: str) -> dict[str, Any]:
        if side == "power-serve":
            env, trace = args.clock.env(dict(os.environ), "power-serve-c")
            with listening(power_serve_cmd(model, args.mode, args.threads, args.n_ctx, args.clients), env=env) as s:
                name = httpx.get(s.base_url + "/models", timeout=60).json()["data"][0]["id"]
                res = _clients(s.url, [_power_body(name, texts[n], args.tokens) for n in names], args.clients,
                               _power_result)
        else:
            env, trace = args.clock.env(peer_env(args.peer_numerics), "llama-server-c")
            cmd = llama_server_cmd(peer_bin, model, best, args.threads, args.n_ctx, args.clients)
            with listening(cmd, env=env, announce=LLAMA_ANNOUNCE) as s:
                res = _clients(s.url, [_llama_body(texts[n], args.tokens) for n in names], args.clients, _llama_result)
        host = _host(trace, [res.pop("window")])  # the window's host time, spread over its requests
        host["host_us_per_request"] /= len(res["results"])
        return {**res, **host}

    for i in range(args.c4_runs):
        order = ["power-serve", "llama-server"] if i % 2 == 0 else ["llama-server", "power-serve"]
        for side in order:
            res = quiet.measure(lambda side=side: one(side))
            # each client's results are in prompt order
            for j, r in enumerate(res["results"]):
                ref = refs[names[j % len(names)]]
                r["same_text"] = r["n"] == ref["tokens"] and r["text"] == ref["text"]
            raw[side].append(res)
        print(f"  c{args.clients} run {i + 1}/{args.c4_runs}: power-serve {raw['power-serve'][-1]['aggregate_tok_s']:.1f} "
              f"vs llama-server {best} {raw['llama-server'][-1]['aggregate_tok_s']:.1f} aggregate tok/s", flush=True)
    out: dict[str, Any] = {"clients": args.clients, "requests_per_client": names, "llama_server_type": best}
    for side, runs in raw.items():
        lat = [r["latency_s"] for run in runs for r in run["results"]]
        out[side] = {"aggregate_tok_s": stats([r["aggregate_tok_s"] for r in runs]),
                     "makespan_s": stats([r["makespan_s"] for r in runs]),
                     "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
                     "latency_max_s": max(lat), "requests": len(lat),
                     "per_request_decode_tok_s": stats([r["decode_tok_s"] for run in runs for r in run["results"]]),
                     "same_text": all(r["same_text"] for run in runs for r in run["results"]),
                     "host_us_per_request": stats([r["host_us_per_request"] for r in runs]),
                     "host_us_per_round": stats([r["host_us_per_round"] for r in runs]),
                     "foreign_cpu": stats([r["foreign_cpu"] for r in runs])}
    out["power_over_llama_aggregate"] = stats([a["aggregate_tok_s"] / b["aggregate_tok_s"]
                                               for a, b in zip(raw["power-serve"], raw["llama-server"], strict=True)])
    return out


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3-270m", help="comma-separated resolve_model names")
    ap.add_argument("--prompts", nargs="+", type=Path, default=[ROOT / "docs" / "examples" / p for p in DEFAULT_PROMPTS])
    ap.add_argument("--mode", default="suffix")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--c4-runs", type=int, default=None, help="runs of the concurrency bench (default --runs; 0 skips it)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--types", default=",".join(NGRAM_TYPES), help="llama-server --spec-type values to compare")
    ap.add_argument("--peer-numerics", choices=("exact", "stock"), default="exact")
    ap.add_argument("--peer-bin", type=Path, default=None, help="default: the build the installed power-native runs on")
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "bench_serve")
    ap.add_argument("--max-foreign", type=float, default=0.15,
                    help="CPU share (0..1) other processes may take during a measurement before it is taken again")
    ap.add_argument("--quiet-wait", type=float, default=120.0, help="seconds to wait for a quiet machine per measurement")
    ap.add_argument("--retries", type=int, default=2, help="times a disturbed measurement is taken again")
    args = ap.parse_args()
    args.types = [t for t in args.types.split(",") if t]
    args.c4_runs = args.runs if args.c4_runs is None else args.c4_runs
    if args.runs < 1 or not args.types:
        ap.error("--runs must be >= 1 and --types non-empty")
    from power_native.models import resolve_model

    peer_bin, build = peer_bin_dir() if args.peer_bin is None else (args.peer_bin, {})
    report: dict[str, Any] = {
        "schema": "power.bench_serve/1", "mode": args.mode, "runs": args.runs, "c4_runs": args.c4_runs,
        "tokens": args.tokens, "threads": args.threads, "n_ctx": args.n_ctx, "numerics": "exact",
        "peer_numerics": args.peer_numerics, "types": args.types, "peer_bin": str(peer_bin),
        "power_load_plugins": os.environ.get("POWER_LOAD_PLUGINS"),
        "build": {k: build.get(k) for k in ("llama_cpp_commit", "sdist_sha256", "flags", "patches", "build")},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "loadavg_start": os.getloadavg()},
        "goals": {"serve_over_run": SERVE_GOAL, "serve_over_best_ngram": PEER_GOAL}, "models": {}}
    quiet = Quiet(args.max_foreign, args.quiet_wait, args.retries)
    args.out.mkdir(parents=True, exist_ok=True)
    traces = args.out / "traces"
    traces.mkdir(exist_ok=True)
    args.clock = HostClock(compute_clock(traces), traces)
    report["contention"] = {"max_foreign": args.max_foreign, "quiet_wait_s": args.quiet_wait, "retries": args.retries}
    for alias in args.models.split(","):
        model = str(resolve_model(None if alias in ("", "default") else alias))
        print(f"{alias}: {model}", flush=True)
        entry: dict[str, Any] = {"model_path": model, "prompts": {}}
        report["models"][alias] = entry
        for path in args.prompts:
            entry["prompts"][path.name] = bench_prompt(args, peer_bin, model, path, quiet)
        if args.c4_runs:
            texts = {p.name: read_prompt(p) for p in args.prompts}
            refs = {}
            for p in args.prompts:
                off = power_run(model, "off", texts[p.name], args.tokens, args.threads, args.n_ctx)
                refs[p.name] = {"tokens": off["n"], "text": off["text"]}
            ok = [t for t in args.types if all(t not in pr["peers_other_workload"] for pr in entry["prompts"].values())]
            best = max(ok or args.types, key=lambda t: _geomean(
                [pr["llama_server"][t]["decode_tok_s"]["median"] for pr in entry["prompts"].values()]))
            entry["concurrency"] = bench_concurrency(args, peer_bin, model, texts, refs, best, quiet)
        report["contention"].update(waited_s=quiet.waited_s, retaken=quiet.retaken)
        _write(args.out, report)  # after each model, so a long run leaves evidence behind
    report["machine"]["loadavg_end"] = os.getloadavg()
    _write(args.out, report)
    print((args.out / "report.md").read_text())
    return 0


# -- report -------------------------------------------------------------------------------------------
def _fmt(s: dict[str, float] | None, digits: int = 1) -> str:
    if not s:
        return "—"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def _yes(b: bool | None) -> str:
    return {True: "yes", False: "NO", None: "—"}[b]


def _markdown(report: dict[str, Any]) -> str:
    lines = ["# bench_serve: `power serve` vs `power run` and `llama-server`", "",
             f"{report['runs']} paired, interleaved runs (a fresh process per measurement), {report['tokens']} tokens max, "
             f"{report['threads']} threads on both sides, `--mode {report['mode']}`; numerics: Power "
             f"{report['numerics']}, llama.cpp {report['peer_numerics']} (`GGML_CPU_BATCH_INVARIANT=1`). "
             "Figures: median (min–max); ratios are medians of per-run pairs. Decode tok/s: tokens after the first "
             "per decode second (Power's receipt, llama-server's `timings.predicted_per_second`); wall tok/s: "
             "tokens / request wall time (HTTP, prompt pass included; `power run`: prefill + decode seconds). "
             f"Goals: server >= {report['goals']['serve_over_run']}x `power run`, >= "
             f"{report['goals']['serve_over_best_ngram']}x the best llama-server n-gram type (decode tok/s).", ""]
    for alias, m in report["models"].items():
        lines += [f"## {alias} (`{Path(m['model_path']).name}`)", ""]
        for name, p in m["prompts"].items():
            s, r = p["power_serve"], p["power_run"]
            lines += [f"### {name} ({p['tokens']} tokens)", "",
                      "| cell | decode tok/s | wall tok/s | host µs / request | host µs / round | acceptance | tokens "
                      "| text = off |", "|---|---|---|---|---|---|---|---|",
                      f"| power serve | {_fmt(s['decode_tok_s'])} | {_fmt(s['wall_tok_s'])} | {_fmt(s.get('host_us_per_request'), 0)} "
                      f"| {_fmt(s.get('host_us_per_round'), 0)} | {_fmt(s['acceptance'], 2)} | {s['tokens']} | {_yes(s['same_as_off'])} |",
                      f"| power run | {_fmt(r['decode_tok_s'])} | {_fmt(r['wall_tok_s'])} | | | {_fmt(r['acceptance'], 2)} "
                      f"| {r['tokens']} | {_yes(r['same_as_off'])} |"]
            for t, c in p["llama_server"].items():
                lines.append(f"| llama-server {t} | {_fmt(c['decode_tok_s'])} | {_fmt(c['wall_tok_s'])} "
                             f"| {_fmt(c.get('host_us_per_request'), 0)} | {_fmt(c.get('host_us_per_round'), 0)} "
                             f"| {_fmt(c['acceptance'], 2)} | {c['tokens']} | {_yes(c['same_text'] and c['same_count'])} |")
            so = p["serve_over_run"]
            lines += ["", f"- a. server / power run: decode x{_fmt(so['decode'], 3)}, wall x{_fmt(so['wall'], 3)} "
                          f"(goal >= {so['goal']}: {'met' if so['met'] else 'NOT met'}); server text = power run text: "
                          f"{_yes(s['same_as_power_run'])}"]
            if "best_type" in p:
                sb = p["serve_over_best_type"]
                lines.append(f"- b. server / best llama-server n-gram type ({p['best_type']}): decode x{_fmt(sb['decode'], 3)}, "
                             f"wall x{_fmt(sb['wall'], 3)} (goal >= {sb['goal']}: {'met' if sb['met'] else 'NOT met'})")
            lines.append(f"- other processes' CPU share during the measurements: {_fmt(p['foreign_cpu'], 2)}; "
                         f"measurements kept above --max-foreign: {p['disturbed']}")
            if p["peers_other_workload"]:
                lines.append(f"- not the same workload (text or count differs from `--mode off`): "
                             f"{', '.join(p['peers_other_workload'])}")
            lines.append("")
        c = m.get("concurrency")
        if c:
            lines += [f"### {c['clients']} concurrent clients (each sends {', '.join(c['requests_per_client'])})", "",
                      "| server | aggregate tok/s | makespan s | p50 latency s | p99 latency s | per-request decode tok/s "
                      "| host µs / request | host µs / round | text = off |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for side, label in (("power-serve", f"power serve --parallel {c['clients']}"),
                                ("llama-server", f"llama-server -np {c['clients']} {c['llama_server_type']}")):
                x = c[side]
                lines.append(f"| {label} | {_fmt(x['aggregate_tok_s'])} | {_fmt(x['makespan_s'], 2)} | "
                             f"{x['latency_p50_s']:.2f} | {x['latency_p99_s']:.2f} | {_fmt(x['per_request_decode_tok_s'])} "
                             f"| {_fmt(x.get('host_us_per_request'), 0)} | {_fmt(x.get('host_us_per_round'), 0)} "
                             f"| {_yes(x['same_text'])} |")
            lines += ["", f"- power / llama-server aggregate: x{_fmt(c['power_over_llama_aggregate'], 3)} "
                          f"({c['power-serve']['requests']} requests per side, latency percentiles pooled over the runs; "
                          f"other processes' CPU share: power {_fmt(c['power-serve']['foreign_cpu'], 2)}, "
                          f"llama-server {_fmt(c['llama-server']['foreign_cpu'], 2)})", ""]
    q = report.get("contention") or {}
    if q:
        lines.append(f"Shared machine: each measurement waited for a quiet machine (up to {q['quiet_wait_s']:.0f} s) and was "
                     f"taken again (up to {q['retries']}x) when other processes took > {q['max_foreign']:.0%} of the CPU; "
                     f"waited {q.get('waited_s', 0):.0f} s, {q.get('retaken', 0)} measurements taken again.\n")
    b = report.get("build") or {}
    lines.append(f"Build: llama.cpp {b.get('llama_cpp_commit')} ({b.get('build')}), patches {b.get('patches')}; "
                 f"machine {report['machine']}.")
    return "\n".join(lines) + "\n"


def _write(out: Path, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    report["written"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(_markdown(report))


if __name__ == "__main__":
    raise SystemExit(main())
