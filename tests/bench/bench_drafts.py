"""bench_drafts: batched draft passes under concurrency, ``power serve --parallel 4`` against
``llama-server -np 4`` with the same drafter, paired and interleaved.

For each drafter (``mtp``: ``--spec-type draft-mtp`` on a tiny qwen35 + MTP fixture; ``dflash`` /
``dspark``: ``--spec-type draft-dflash`` / ``draft-dspark`` with a tiny draft of a qwen35 target;
random weights written by the tests' helpers), both servers run with four sequences
(slots), K = ``--k`` and the same threads, one server at a time and a fresh one per measurement; then, ``--runs`` times with the order alternating:
1 client sending the four prompts one after the other, and 4 clients each sending one prompt at the
same time (so every slot drafts). Reported per side: aggregate tok/s (completion tokens / makespan),
p50 and p99 request latency, and the per-request draft acceptance at 1 and at 4 clients; the paired
ratio Power / llama-server per run and its median. Every text is checked against ``power run --mode
off`` (``same_text``). Both sides run the same kernels (``power_core.bench.peer_env``: exact =
``GGML_CPU_BATCH_INVARIANT=1``).

Served against run, paired: in each run, a fresh ``power serve`` and the same prompts decoded as ``power run``
decodes them (its flags, its configuration and a solo ``Session``, one warm-up request first, in a process of
its own), both alive and under the same compute clock, the served and the run request for each prompt back to
back (the order flipping each prompt), so each pair meets the same minute of this machine: per request,
``power serve``'s latency (HTTP included) against the run's ``generate`` wall, and their ratio (run / serve: the
served request's speed as a share of the run's); and the same ratio at equal compute (each side's wall less its
own llama.cpp compute is its host time; both decode the same passes, so the run's compute stands for both, and
the ratio loses the speed this machine gives each process, which moves the raw one by more than any host time
does; ``docs/evidence/bench_drafts/served-paired-2026-12-07/``).

    python tests/bench/bench_drafts.py --out docs/evidence/bench_drafts [--runs 5] [--tokens 192] [--suites mtp,dflash]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT / "tests" / "native"))
from bench_serve import LLAMA_ANNOUNCE, Quiet, _llama_result, _power_result, peer_bin_dir, percentile, power_run, stats  # noqa: E402
from host_clock import compute_clock, split, traced_env  # noqa: E402

from power_core.bench import peer_env  # noqa: E402
from tests.serve_helpers import listening, power_cmd  # noqa: E402

PROMPTS = ("hello world, this is a test prompt for the speculative decoding benchmark",
           "the quick brown fox jumps over the lazy dog and then the dog sleeps",
           "once upon a time there was a small model that proposed tokens to a large one",
           "def add(a, b): return a + b  # a tiny function that adds two numbers together")
WARMUP = "a warm-up request that is not measured"
#: suite -> (Power's mode, llama-server's --spec-type). ``mtp``: the random MTP head (accepts nothing: what
#: drafting costs); ``mtp-predictable``: an MTP head that reproduces the target (accepts ~all: what it wins)
SUITES = {"mtp": ("mtp", "draft-mtp"), "mtp-predictable": ("mtp", "draft-mtp"), "dflash": ("dflash", "draft-dflash"),
          "dspark": ("dspark", "draft-dspark")}


def _fixtures(suite: str, tmp: Path) -> tuple[Path, Path | None]:
    from native_helpers import make_tiny, make_tiny_draft, make_tiny_mtp

    if suite == "mtp":
        return make_tiny_mtp(tmp, "qwen35"), None
    if suite == "mtp-predictable":
        return make_tiny_mtp(tmp, "qwen35", predictable=True, name="qwen35-mtp-predictable"), None
    target = make_tiny(tmp, "qwen35")
    kw = {"dflash": dict(kind="dflash"), "dspark": dict(kind="dspark", block_size=16)}[suite]
    return target, make_tiny_draft(tmp, target, name=f"bench-{suite}", **kw)


def _clients(url: str, bodies: list[dict[str, Any]], clients: int, parse: Any,
             prompts: tuple[str, ...] = PROMPTS) -> dict[str, Any]:
    """1 client: every body in turn; N clients: bodies k, k + N, ... on client k, released together
    (``prompts``: the measured ones, each result's ``prompt`` its index there)."""
    per_client = [bodies] if clients == 1 else [bodies[k::clients] for k in range(clients)]
    gate = threading.Barrier(len(per_client))
    results: list[list[dict[str, Any]]] = [[] for _ in per_client]
    spans: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def client(k: int) -> None:
        try:
            with httpx.Client(timeout=1800) as c:
                gate.wait()
                t0 = time.perf_counter_ns()  # CLOCK_MONOTONIC: the compute clock's (host_clock)
                for body in per_client[k]:
                    t1 = time.perf_counter_ns()
                    r = c.post(url + "/v1/completions", json=body)
                    r.raise_for_status()
                    t2 = time.perf_counter_ns()
                    out = parse(r.json(), (t2 - t1) * 1e-9)
                    out["window_ns"] = (t1, t2)
                    out["prompt"] = prompts.index(body["prompt"]) if body["prompt"] in prompts else -1
                    results[k].append(out)
                spans.append((t0, time.perf_counter_ns()))
        except BaseException as exc:  # reported after every thread ended
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(per_client))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    flat = [r for rs in results for r in rs]
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    makespan = (end - start) * 1e-9
    return {"makespan_s": makespan, "aggregate_tok_s": sum(r["n"] for r in flat) / makespan, "results": flat,
            "window_ns": (start, end)}


def _run_side(argv: list[str], prompts: list[str], tokens: int) -> None:
    """Decode prompts as ``power run ARGV`` decodes them: its flags parsed by the CLI's own parser into its
    configuration, one solo session, a warm-up request first (then ``ready`` on stdout); then, for each prompt
    index read from stdin, that prompt, answering the window of its ``generate`` (``perf_counter_ns``, the compute
    clock's). Runs in a process of its own under the compute clock (``--run-side``), as the server does, until
    stdin closes."""
    from power_core.cli import build_parser
    from power_core.commands import _config_from_args
    from power_core.plugins import build_plugins
    from power_core.session import Session

    ns = build_parser().parse_args(argv)
    with Session.open(_config_from_args(ns), model=ns.model, draft=ns.draft, backend=ns.backend,
                      plugins=build_plugins()) as session:
        session.generate(WARMUP, max_tokens=tokens)
        print("ready", flush=True)
        for line in sys.stdin:
            t0 = time.perf_counter_ns()
            session.generate(prompts[int(line)], max_tokens=tokens)
            print(t0, time.perf_counter_ns(), flush=True)


def bench_suite(args: argparse.Namespace, suite: str, peer_bin: Path, tmp: Path, quiet: Quiet) -> dict[str, Any]:
    mode, spec_type = SUITES[suite]
    target, draft = _fixtures(suite, tmp)
    # --prompts N: PROMPTS, then variants of them (distinct prompts: no prompt cache serves a repeat)
    prompts = tuple(PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" (variant {i // len(PROMPTS)})")
                    for i in range(args.prompts))
    refs = [power_run(str(target), "off", p, args.tokens, args.threads, args.n_ctx) for p in prompts]
    extra = ["--draft", str(draft)] if draft else []
    power = power_cmd("serve", "--port", "0", "--model", str(target), "--mode", mode, *extra, "--threads",
                      str(args.threads), "--n-ctx", str(args.n_ctx), "--parallel", "4", "--draft-max", str(args.k),
                      "--numerics", args.numerics, "--p-min", str(args.p_min), *args.power_args.split())
    env = peer_env(args.numerics)
    peer = [str(peer_bin / "llama-server"), "-m", str(target), *(["-md", str(draft)] if draft else []),
            "--host", "127.0.0.1", "--port", "0", "-t", str(args.threads), "-tb", str(args.threads),
            "-c", str(args.n_ctx * 4), "-np", "4", "--spec-type", spec_type, "--spec-draft-n-max", str(args.k),
            "--spec-draft-p-min", str(args.p_min), "--no-webui"]
    raw: dict[str, dict[int, list[dict[str, Any]]]] = {"power": {1: [], 4: []}, "llama": {1: [], 4: []}}

    shim = compute_clock(tmp)

    run_argv = ["run", "--model", str(target), "--mode", mode, *(["--draft", str(draft)] if draft else []),
                "--threads", str(args.threads), "--n-ctx", str(args.n_ctx), "--draft-max", str(args.k), "--numerics",
                args.numerics, "--p-min", str(args.p_min), "--max-tokens", str(args.tokens), *args.power_args.split(),
                "--prompt", WARMUP]

    def measure_paired() -> dict[str, Any]:
        # a fresh server and power run's decode in a process of its own, both alive and under the compute clock,
        # each prompt served and run back to back (the order flipping each prompt); one decodes while the other
        # waits for its next request (llama.cpp's threads sleep once a pass's spin ends)
        job = json.dumps({"argv": run_argv, "prompts": list(prompts), "tokens": args.tokens})
        traces = {side: tmp / f"trace-paired-{side}.txt" for side in ("served", "run")}
        for trace in traces.values():
            trace.unlink(missing_ok=True)
        run_side = subprocess.Popen([sys.executable, str(HERE), "--run-side", job], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                    env=traced_env(dict(os.environ), shim, traces["run"]))
        assert run_side.stdin is not None and run_side.stdout is not None
        try:
            if run_side.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the run side exited {run_side.wait()} before it was ready")

            def run(j: int) -> tuple[int, int]:
                assert run_side.stdin is not None and run_side.stdout is not None
                run_side.stdin.write(f"{j}\n")
                run_side.stdin.flush()
                window = run_side.stdout.readline().split()
                if len(window) != 2:
                    raise RuntimeError(f"the run side exited {run_side.wait()} while decoding prompt {j}")
                return int(window[0]), int(window[1])

            with listening(power, env=traced_env(dict(os.environ), shim, traces["served"])) as s, \
                    httpx.Client(timeout=1800) as client:  # one connection, as _clients' one client keeps
                name = client.get(s.base_url + "/models").json()["data"][0]["id"]

                def serve(prompt: str) -> tuple[int, int]:
                    t1 = time.perf_counter_ns()
                    client.post(s.url + "/v1/completions", json={"model": name, "prompt": prompt,
                                                                 "max_tokens": args.tokens}).raise_for_status()
                    return t1, time.perf_counter_ns()

                serve(WARMUP)
                served, ran = [], []
                for j, prompt in enumerate(prompts):
                    if j % 2:
                        ran.append(run(j))
                    served.append(serve(prompt))
                    if not j % 2:
                        ran.append(run(j))
        finally:
            run_side.stdin.close()
            if run_side.wait(60) != 0:
                raise RuntimeError(f"the run side exited {run_side.returncode}")
        return {"served": [(b - a) * 1e-9 for a, b in served],
                "served_compute": [split(traces["served"], a, b).compute_s for a, b in served],
                "walls": [(b - a) * 1e-9 for a, b in ran], "compute": [split(traces["run"], a, b).compute_s for a, b in ran]}

    def measure(side: str, clients: int) -> dict[str, Any]:
        # one server at a time (an idle one's spinning threads would take the other's cores), fresh for each
        # measurement (a server that learns across requests would copy an earlier answer), one warm-up request;
        # both under the compute clock, so the window splits into llama.cpp compute and host time alike
        trace = tmp / f"trace-{side}-{clients}.txt"
        trace.unlink(missing_ok=True)
        if side == "power":
            with listening(power, env=traced_env(dict(os.environ), shim, trace)) as s:
                name = httpx.get(s.base_url + "/models", timeout=60).json()["data"][0]["id"]
                bodies = [{"model": name, "prompt": p, "max_tokens": args.tokens} for p in prompts]
                _clients(s.url, [{**bodies[0], "prompt": WARMUP}], 1, _power_result)
                res = _clients(s.url, bodies, clients, _power_result, prompts)
        else:
            with listening(peer, env=traced_env(env, shim, trace), announce=LLAMA_ANNOUNCE) as s:
                bodies = [{"model": "peer", "prompt": p, "max_tokens": args.tokens, "temperature": 0, "top_k": 1,
                           "seed": 0} for p in prompts]
                _clients(s.url, [{**bodies[0], "prompt": WARMUP}], 1, _llama_result)
                res = _clients(s.url, bodies, clients, _llama_result, prompts)
        host = split(trace, *res.pop("window_ns"))
        for r in res["results"]:  # each request's own llama.cpp compute (its window on the client's clock)
            r["compute_s"] = split(trace, *r.pop("window_ns")).compute_s
        res.update(compute_s=host.compute_s, host_s=host.host_s, rounds=host.rounds,
                   host_us_per_request=host.host_us_per(len(res["results"])), host_us_per_round=host.host_us_per(host.rounds))
        return res

    served_over_run: list[float] = []  # per run: the median over prompts of run wall / served latency
    # per run, the median over prompts of the same at equal compute: (C + run's host) / (C + served host), C the run's
    # llama.cpp compute for the prompt. Both sides decode the same passes (the served request alone: its round is the
    # solo step), so their compute differs only by this machine's speed in each process, which the raw ratio carries
    # whole (one process's decode can be 1.8x another's here); each side's host time is its wall less its own
    # compute, and the pairs (measure_paired) meet the same minute
    served_over_run_equal: list[float] = []
    host_ms: dict[str, list[float]] = {"served": [], "run": []}  # per run: median ms a request outside llama.cpp
    served_ms: list[float] = []  # per run: the median served latency (1 client), and the run's wall
    run_ms: list[float] = []
    for i in range(args.runs):
        for clients in (1, 4):
            order = ["power", "llama"] if i % 2 == 0 else ["llama", "power"]
            for side in order:
                res = quiet.measure(lambda side=side, clients=clients: measure(side, clients))
                for r in res["results"]:
                    ref = refs[r["prompt"]]
                    r["same_text"] = r["n"] == ref["n"] and r["text"] == ref["text"]
                raw[side][clients].append(res)
            if clients == 1:
                paired = quiet.measure(measure_paired)
                served, run_walls, run_compute = paired["served"], paired["walls"], paired["compute"]
                served_over_run.append(statistics.median(w / s for w, s in zip(run_walls, served, strict=True)))
                served_host = [s - c for s, c in zip(served, paired["served_compute"], strict=True)]
                run_host = [w - c for w, c in zip(run_walls, run_compute, strict=True)]
                served_over_run_equal.append(statistics.median(
                    w / (c + h) for w, c, h in zip(run_walls, run_compute, served_host, strict=True)))
                host_ms["served"].append(1e3 * statistics.median(served_host))
                host_ms["run"].append(1e3 * statistics.median(run_host))
                served_ms.append(1e3 * statistics.median(served))
                run_ms.append(1e3 * statistics.median(run_walls))
            print(f"  {suite} run {i + 1}/{args.runs} c={clients}: power {raw['power'][clients][-1]['aggregate_tok_s']:.1f}"
                  f" vs llama-server {raw['llama'][clients][-1]['aggregate_tok_s']:.1f} tok/s", flush=True)
    out: dict[str, Any] = {"mode": mode, "llama_server_spec_type": spec_type,
                           "served_over_run": stats(served_over_run),
                           "served_over_run_per_run": [round(x, 3) for x in served_over_run],
                           "served_ms": stats(served_ms), "run_ms": stats(run_ms),
                           "served_over_run_equal_compute": stats(served_over_run_equal),
                           "served_over_run_equal_compute_per_run": [round(x, 3) for x in served_over_run_equal],
                           "host_ms_per_request": {k: stats(v) for k, v in host_ms.items()}}
    for clients in (1, 4):
        cell: dict[str, Any] = {}
        for side in ("power", "llama"):
            runs = raw[side][clients]
            flat = [r for run in runs for r in run["results"]]
            lat = [r["latency_s"] for r in flat]
            acc = [r["acceptance"] for r in flat if r["acceptance"] is not None]
            cell[side] = {"aggregate_tok_s": stats([r["aggregate_tok_s"] for r in runs]),
                          "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
                          "acceptance_median": statistics.median(acc) if acc else None,
                          "acceptance_by_prompt": {prompts.index(p): statistics.median(
                              [r["acceptance"] for r in flat if prompts[r["prompt"]] == p and r["acceptance"] is not None]
                              or [float("nan")]) for p in prompts},
                          "same_text": all(r["same_text"] for r in flat), "requests": len(flat),
                          "foreign_cpu": stats([r["foreign_cpu"] for r in runs]),
                          "host_us_per_request": stats([r["host_us_per_request"] for r in runs]),
                          "host_us_per_round": stats([r["host_us_per_round"] for r in runs]),
                          "compute_share": stats([r["compute_s"] / r["makespan_s"] for r in runs])}
        cell["power_over_llama"] = stats([a["aggregate_tok_s"] / b["aggregate_tok_s"] for a, b in
                                          zip(raw["power"][clients], raw["llama"][clients], strict=True)])
        cell["per_run_ratios"] = [round(a["aggregate_tok_s"] / b["aggregate_tok_s"], 3) for a, b in
                                  zip(raw["power"][clients], raw["llama"][clients], strict=True)]
        out[f"c{clients}"] = cell
    for side in ("power", "llama"):
        a1, a4 = out["c1"][side]["acceptance_median"], out["c4"][side]["acceptance_median"]
        out[f"{side}_acceptance_points_c4_minus_c1"] = None if a1 is None or a4 is None else 100 * (a4 - a1)
    return out


def _markdown(report: dict[str, Any]) -> str:
    lines = [f"# bench_drafts: `power serve --parallel 4` vs `llama-server -np 4`, same drafter, K={report['k']}"
             + (f", p_min {report['p_min']} on both sides" if report.get("p_min") else ""),
             "", f"`{report['command']}`, {report['date']}, {report['threads']} threads, {report['tokens']} tokens per "
             f"request, numerics {report['numerics']}, {report['runs']} paired runs (order alternating).", "",
             "| drafter | clients | Power tok/s | llama-server tok/s | Power / llama (median of paired) | per-run | "
             "p50 / p99 s Power | llama | acceptance Power | llama | texts = off |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for suite, r in report["suites"].items():
        for c in (1, 4):
            cell = r[f"c{c}"]
            p, q = cell["power"], cell["llama"]
            lines.append(
                f"| {suite} ({r['llama_server_spec_type']}) | {c} | {p['aggregate_tok_s']['median']:.1f} | "
                f"{q['aggregate_tok_s']['median']:.1f} | **{cell['power_over_llama']['median']:.3f}** | "
                f"{' '.join(str(x) for x in cell['per_run_ratios'])} | {p['latency_p50_s']:.2f} / {p['latency_p99_s']:.2f} | "
                f"{q['latency_p50_s']:.2f} / {q['latency_p99_s']:.2f} | {p['acceptance_median']:.3f} | "
                f"{q['acceptance_median'] if q['acceptance_median'] is None else round(q['acceptance_median'], 3)} | "
                f"{'yes' if p['same_text'] and q['same_text'] else 'NO'} |")
    lines += ["", "Host time (wall minus the time inside llama.cpp's decode calls, both sides under "
              "`tests/bench/compute_clock.c`; a round = one target pass; medians over the runs):", "",
              "| drafter | clients | host µs / request Power | llama-server | host µs / round Power | llama-server | "
              "compute share Power | llama-server |", "|---|---|---|---|---|---|---|---|"]

    def num(x: dict[str, float] | None, fmt: str) -> str:
        return "—" if x is None else format(x["median"], fmt)

    for suite, r in report["suites"].items():
        for c in (1, 4):
            p, q = r[f"c{c}"]["power"], r[f"c{c}"]["llama"]
            lines.append(f"| {suite} | {c} | {num(p['host_us_per_request'], '.0f')} | {num(q['host_us_per_request'], '.0f')} | "
                         f"{num(p['host_us_per_round'], '.0f')} | {num(q['host_us_per_round'], '.0f')} | "
                         f"{num(p['compute_share'], '.2f')} | {num(q['compute_share'], '.2f')} |")
    lines += ["", "Served against run, 1 client, paired: `power serve`'s latency per request (HTTP included) against the "
              "same request decoded as `power run` decodes it (its configuration, a solo session, warm, in a process of "
              "its own beside the server, both under the same compute clock, each prompt served and run back to back); "
              "the ratio run / serve per request, the median over the prompts of a "
              "run, then over the runs; and the same at equal compute, (C + run's host) / (C + served host) with C the "
              "run's llama.cpp compute for the prompt and each side's host its wall less its own compute (both decode "
              "the same passes: only this machine's speed in each process tells their compute apart):", "",
              "| drafter | ms a request served | run | serve / run per request | per run | host ms a request served "
              "| run | serve / run at equal compute | per run |", "|---|---|---|---|---|---|---|---|---|"]
    for suite, r in report["suites"].items():
        h = r["host_ms_per_request"]
        lines.append(f"| {suite} | {r['served_ms']['median']:.1f} | {r['run_ms']['median']:.1f} | "
                     f"**{r['served_over_run']['median']:.3f}** | {' '.join(str(x) for x in r['served_over_run_per_run'])} "
                     f"| {num(h['served'], '.1f')} | {num(h['run'], '.1f')} | "
                     f"**{num(r['served_over_run_equal_compute'], '.3f')}** | "
                     f"{' '.join(str(x) for x in r['served_over_run_equal_compute_per_run'])} |")
    lines.append("")
    for suite, r in report["suites"].items():
        lines.append(f"- {suite}: acceptance at 4 clients minus 1 client: Power "
                     f"{r['power_acceptance_points_c4_minus_c1']} points, llama-server "
                     f"{r['llama_acceptance_points_c4_minus_c1']} points.")
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--run-side":  # (measure_paired's run side)
        job = json.loads(sys.argv[2])
        _run_side(job["argv"], job["prompts"], job["tokens"])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suites", default="mtp,mtp-predictable,dflash,dspark")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4, help="distinct prompts per measurement (4: the four base "
                    "prompts, one request each at 4 clients; more: variants of them, a longer window that evens "
                    "out this machine's noise)")
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--numerics", choices=("exact", "stock"), default="exact")
    ap.add_argument("--p-min", type=float, default=0.0, help="both sides' draft confidence cut (Power --p-min, "
                    "llama-server --spec-draft-p-min; 0: every draft runs K tokens)")
    ap.add_argument("--power-args", default="", help="more `power serve` flags, e.g. --adaptive (llama-server has "
                    "no counterpart: its drafters propose K every round)")
    ap.add_argument("--max-foreign", type=float, default=0.25)
    ap.add_argument("--quiet-wait", type=float, default=20.0)
    ap.add_argument("--retries", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "bench_drafts")
    args = ap.parse_args()
    peer_bin, _ = peer_bin_dir()
    quiet = Quiet(args.max_foreign, args.quiet_wait, args.retries)
    tmp = Path(tempfile.mkdtemp(prefix="bench-drafts-"))
    report: dict[str, Any] = {"bench": "drafts", "command": " ".join(["python", *sys.argv]),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": args.runs,
                              "tokens": args.tokens, "k": args.k, "p_min": args.p_min, "threads": args.threads,
                              "numerics": args.numerics,
                              "suites": {}}
    for suite in args.suites.split(","):
        report["suites"][suite] = bench_suite(args, suite, peer_bin, tmp, quiet)
    report["retaken"] = quiet.retaken
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=float))
    (args.out / "report.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
