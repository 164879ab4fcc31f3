"""Shared target passes (``Engine``) vs independent sessions, paired and interleaved.

For each model and mode: N concurrent requests (different prompts, the same token count) decoded
(a) by N independent sessions in N threads — how concurrent requests ran before the engine — and
(b) by one ``Engine`` over N sequences; aggregate decode tok/s (emitted tokens / wall time of the
whole batch, prefill included), the paired ratio b/a per run, the median over runs, TTFT p50/p99,
and that every output equals its solo run. ``--rss`` measures peak RSS of each arrangement in a
fresh subprocess. One request: ``Session.generate`` vs the engine with one request.

    python tests/bench/bench_engine.py --out evidence/bench_engine.json [--runs 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from power_core import PowerConfig, Session
from power_core.engine import Engine
from power_core.errors import ConfigError
from power_core.session import in_own_thread

QUESTIONS = ["Name three primary colors and say why.", "What is 12 times 12? Explain.",
             "Write a haiku about the sea.", "List the days of the week.", "Give two synonyms for 'fast'.",
             "Translate 'good morning' into French and Spanish.", "What is the capital of Italy?",
             "Explain what a compiler does."]


def _prompts(session: Session, n: int) -> list:
    """The questions in the model's chat template; plain text for a GGUF without one (Gemma-3-270M's)."""
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    try:
        return [session.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    except ConfigError as exc:
        if exc.key != "chat":
            raise
        return [session.encode(q) for q in questions]


def _concurrent(prompts: list, start, rounds) -> tuple[float, list, list[float]]:
    """Run every prompt in its own thread: ``start(i, prompt)`` makes the request, ``rounds(gen)``
    runs it; returns wall seconds, results and each request's time to its first round."""
    out: list = [None] * len(prompts)
    ttft: list[float] = [0.0] * len(prompts)
    t0 = time.perf_counter()

    def go(i: int) -> None:
        gen = start(i, prompts[i])
        for k, _ in enumerate(rounds(gen)):
            if k == 0:
                ttft[i] = time.perf_counter() - t0
        out[i] = gen.result()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out, ttft


def _sessions_run(sessions: list[Session], prompts: list) -> tuple[float, list, list[float]]:
    return _concurrent(prompts, lambda i, p: sessions[i].start(p), lambda gen: gen.rounds())


def _engine_run(engine: Engine, prompts: list) -> tuple[float, list, list[float]]:
    return _concurrent(prompts, lambda i, p: engine.submit(p), engine.rounds)


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bench(model: str | None, mode: str, n: int, runs: int, tokens: int, threads: int) -> dict:
    cfg = PowerConfig(spec_mode=mode, n_threads=threads, max_tokens=tokens, n_ctx=1024)
    sessions = [Session.open(cfg, model=model) for _ in range(n)]
    engine = Session.open_engine(n, cfg, model=model)
    try:
        prompts = _prompts(sessions[0], n)
        # on a thread that ends: a thread that decoded keeps its OpenMP team (power_core.opening.in_own_thread)
        solo = in_own_thread(lambda: [sessions[0].generate(p).tokens for p in prompts])
        rows = []
        for r in range(runs):
            order = ("sessions", "engine") if r % 2 == 0 else ("engine", "sessions")
            got = {}
            for arm in order:
                wall, out, ttft = (_sessions_run(sessions, prompts) if arm == "sessions"
                                   else _engine_run(engine, prompts))
                assert [o.tokens for o in out] == solo, f"{arm}: an output differs from its solo run"
                emitted = sum(len(o.tokens) for o in out)
                got[arm] = {"tok_s": emitted / wall, "ttft": ttft}
            rows.append(got)
        med = {arm: statistics.median(row[arm]["tok_s"] for row in rows) for arm in ("sessions", "engine")}
        ratios = [row["engine"]["tok_s"] / row["sessions"]["tok_s"] for row in rows]
        ttfts = {arm: [t for row in rows for t in row[arm]["ttft"]] for arm in ("sessions", "engine")}
        return {"model": model or "smollm2", "mode": mode, "concurrent": n, "runs": runs, "tokens": tokens,
                "sessions_tok_s": round(med["sessions"], 1), "engine_tok_s": round(med["engine"], 1),
                "ratio_median": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios],
                "ttft_p50_s": {a: round(_q(v, 0.5), 3) for a, v in ttfts.items()},
                "ttft_p99_s": {a: round(_q(v, 0.99), 3) for a, v in ttfts.items()},
                "identical_to_solo": True, "probe_identical": engine.probe.identical if engine.probe else None}
    finally:
        engine.close()
        for s in sessions:
            s.close()


def bench_one(model: str | None, mode: str, runs: int, tokens: int, threads: int) -> dict:
    """One request: ``Session.generate`` vs the engine with one request, each run in a fresh process
    (a process holding both would hold two OpenMP teams, the engine driver's and the session's, and
    libgomp then slows both: power_core.opening.in_own_thread)."""
    ratios, rates = [], {"session": [], "engine": []}
    for r in range(runs):
        got = {}
        for arm in (("session", "engine") if r % 2 == 0 else ("engine", "session")):
            out = subprocess.run([sys.executable, __file__, "--one-child", model or "smollm2", mode, arm,
                                  "--tokens", str(tokens), "--threads", str(threads)],
                                 capture_output=True, text=True, check=True)
            got[arm] = json.loads(out.stdout.strip().splitlines()[-1])["tok_s"]
            rates[arm].append(got[arm])
        ratios.append(got["engine"] / got["session"])
    return {"model": model or "smollm2", "mode": mode, "concurrent": 1, "runs": runs,
            "session_tok_s": round(statistics.median(rates["session"]), 1),
            "engine_tok_s": round(statistics.median(rates["engine"]), 1),
            "ratio_median": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios]}


def one_child(model: str | None, mode: str, arm: str, tokens: int, threads: int) -> None:
    cfg = PowerConfig(spec_mode=mode, n_threads=threads, max_tokens=tokens, n_ctx=1024)
    if arm == "session":
        with Session.open(cfg, model=model) as session:
            prompt = _prompts(session, 1)[0]
            t0 = time.perf_counter()
            res = session.generate(prompt)
    else:
        with Session.open_engine(2, cfg, model=model) as engine:
            prompt = _prompts(engine.sessions[0], 1)[0]
            t0 = time.perf_counter()
            res = engine.run(engine.submit(prompt))
    print(json.dumps({"tok_s": len(res.tokens) / (time.perf_counter() - t0)}))


def rss_child(model: str | None, mode: str, n: int, arm: str, tokens: int, threads: int) -> None:
    cfg = PowerConfig(spec_mode=mode, n_threads=threads, max_tokens=tokens, n_ctx=1024)
    if arm == "sessions":
        sessions = [Session.open(cfg, model=model) for _ in range(n)]
        _sessions_run(sessions, _prompts(sessions[0], n))
    else:
        engine = Session.open_engine(n, cfg, model=model)
        _engine_run(engine, _prompts(engine.sessions[0], n))
    # VmHWM, not getrusage's ru_maxrss: Linux carries the parent's high-water mark into a forked child
    # across execve, so every child would report the (growing) parent's peak
    hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
    print(json.dumps({"max_rss_mib": int(hwm.split()[1]) // 1024}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="evidence/bench_engine.json")
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--modes", default="off,suffix")
    ap.add_argument("--concurrency", default="4,8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--rss-child", nargs=4, metavar=("MODEL", "MODE", "N", "ARM"))
    ap.add_argument("--one-child", nargs=3, metavar=("MODEL", "MODE", "ARM"))
    args = ap.parse_args()
    if args.one_child:
        model, mode, arm = args.one_child
        one_child(None if model == "smollm2" else model, mode, arm, args.tokens, args.threads)
        return 0
    if args.rss_child:
        model, mode, n, arm = args.rss_child
        rss_child(None if model == "smollm2" else model, mode, int(n), arm, args.tokens, args.threads)
        return 0
    report: dict = {"rows": [], "one_request": [], "rss": []}
    for model in args.models.split(","):
        m = None if model == "smollm2" else model
        for mode in args.modes.split(","):
            report["one_request"].append(bench_one(m, mode, args.runs, args.tokens, args.threads))
            print(json.dumps(report["one_request"][-1]), flush=True)
            for n in (int(x) for x in args.concurrency.split(",") if x):
                report["rows"].append(bench(m, mode, n, args.runs, args.tokens, args.threads))
                print(json.dumps(report["rows"][-1]), flush=True)
                if args.rss:
                    for arm in ("sessions", "engine"):
                        out = subprocess.run([sys.executable, __file__, "--rss-child", model, mode, str(n), arm,
                                              "--tokens", str(args.tokens), "--threads", str(args.threads)],
                                             capture_output=True, text=True, check=True)
                        row = {"model": model, "mode": mode, "concurrent": n, "arm": arm,
                               **json.loads(out.stdout.strip().splitlines()[-1])}
                        report["rss"].append(row)
                        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
