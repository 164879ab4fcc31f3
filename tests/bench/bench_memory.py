"""bench_memory: a server with memory on multi-request traffic, paired and interleaved, exact numerics.

The workload is public and reproducible (built here, no data files): conversations whose every turn
resends the whole history, as chat clients and agents do.

- ``chat``: multi-turn chats; each turn asks to revise or extend the previous answer (so answers
  copy the history);
- ``agent``: an agent loop; each step shows the same tool schema, the file being edited and the
  last tool result, and the model answers with a JSON tool call (repeated call shapes, templated
  code edits).

Each workload has ``--conversations`` conversations of ``--turns`` turns (default 4 x 8 = 32
requests each). The next turn's prompt includes the answer the server gave, so both sides see the
same prompts only while their texts agree; the report says whether every text was identical.

Sides (one ``/v1/completions`` client per conversation; concurrency 1 runs the conversations one
after another, concurrency 4 at once on 4 slots):

- ``power serve --mode suffix`` with its memories: the prompt cache (``--cache-ram``, on by default)
  and the cross-request suffix index (``--suffix-memory``);
- the same without them (``--cache-ram 0 --suffix-memory 0``);
- the same with the prompt cache but no suffix memory (``--suffix-memory 0``: what the serve default buys);
- ``power serve --mode off`` with the prompt cache (the per-request 2 % check);
- ``llama-server`` of the pinned build with its defaults (its own prompt cache in RAM) and each n-gram
  ``--spec-type``: every type is tried once, the best is then paired with Power's sides.

Aggregate tok/s = completion tokens / wall time of the whole workload. Goals (issue #31): >= 1.3x the
best llama-server type with identical texts; >= 1.2x Power without its memories; no request slower
than ``--mode off``'s by more than 2 % (per request, median over runs).
Writes ``report.json`` and ``report.md`` under ``--out`` (default ``docs/evidence/bench_memory/``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))
from bench_serve import LLAMA_ANNOUNCE, Quiet, peer_bin_dir, stats  # noqa: E402

from power_core.bench import NGRAM_TYPES, peer_env  # noqa: E402
from tests.serve_helpers import listening, power_cmd  # noqa: E402

GOAL_PEER, GOAL_SELF, GOAL_OFF = 1.3, 1.2, 0.02

TOPICS = ["a bakery's opening hours", "a bike repair checklist", "a weekly study plan", "a packing list for a hike",
          "a small garden's watering schedule", "a team's meeting agenda"]
ASKS = ["Write {topic} as a short list.", "Repeat the list and add one more item at the end.",
        "Repeat the whole list again, numbering each item.", "Repeat the numbered list and mark the first item "
        "as done.", "Repeat the list once more, unchanged.", "Give the list again, adding a title line.",
        "Repeat the titled list and add a closing note.", "Repeat everything you wrote in your last answer."]
TOOL = ('{"name": "edit_file", "parameters": {"path": "string", "line": "integer", "text": "string"}}')
CODE = ["def total(items):", "    s = 0", "    for x in items:", "        s += x.price", "    return s", "",
        "def average(items):", "    return total(items) / len(items)"]


def _chat_turn(history: list[tuple[str, str]], ask: str) -> str:
    out = "A conversation between a user and a helpful assistant.\n\n"
    for user, answer in history:
        out += f"User: {user}\nAssistant: {answer}\n\n"
    return out + f"User: {ask}\nAssistant:"


def _agent_turn(history: list[tuple[str, str]], step: int) -> str:
    code = "\n".join(f"{i + 1}: {line}" for i, line in enumerate(CODE))
    out = (f"You are a coding agent. Call the tool with JSON.\nTool: {TOOL}\nFile src/shop.py:\n{code}\n\n"
           "Task: rename every 'items' to 'basket', one line per call.\n\n")
    for i, (_, answer) in enumerate(history):
        out += f"Step {i + 1} call: {answer}\nResult: ok, line edited.\n\n"
    return out + f"Step {step + 1} call:"


def conversation(kind: str, index: int, turns: int) -> list[str]:
    """The conversation's user turns (an agent's are its step numbers)."""
    if kind == "chat":
        return [ask.format(topic=TOPICS[index % len(TOPICS)]) for ask in ASKS[:turns]]
    return [str(step) for step in range(turns)]


def render(kind: str, history: list[tuple[str, str]], turn: str) -> str:
    """The prompt of ``turn``: the whole history (user turn, answer) resent, then the turn."""
    return _chat_turn(history, turn) if kind == "chat" else _agent_turn(history, int(turn))


def drive(url: str, model: str, kind: str, index: int, turns: int, tokens: int, llama: bool) -> list[dict[str, Any]]:
    """One client: the conversation's turns in order, each resending the history."""
    history: list[tuple[str, str]] = []
    out = []
    with httpx.Client(timeout=900) as c:
        for turn in conversation(kind, index, turns):
            body: dict[str, Any] = {"model": model, "prompt": render(kind, history, turn), "max_tokens": tokens,
                                    "stop": ["\nUser:", "\nStep"]}
            if llama:
                body.update(temperature=0, top_k=1, seed=0, cache_prompt=True)
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json=body)
            wall = time.perf_counter() - t0
            r.raise_for_status()
            d = r.json()
            answer = d["choices"][0]["text"]
            out.append({"n": d["usage"]["completion_tokens"], "latency_s": wall, "text": answer,
                        "reused": (d.get("power") or {}).get("prompt_reused",
                                                             (d.get("timings") or {}).get("cache_n"))})
            history.append((turn, answer.strip()))
    return out


def run_workload(url: str, kind: str, conversations: int, turns: int, tokens: int, clients: int,
                 llama: bool) -> dict[str, Any]:
    with httpx.Client(timeout=60) as c:
        model = c.get(url + "/v1/models").json()["data"][0]["id"]
    results: dict[int, list[dict[str, Any]]] = {}

    def client(k: int) -> None:
        for i in range(k, conversations, clients):
            results[i] = drive(url, model, kind, i, turns, tokens, llama)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    reqs = [r for i in sorted(results) for r in results[i]]
    n = sum(r["n"] for r in reqs)
    return {"aggregate_tok_s": n / wall, "wall_s": wall, "tokens": n, "requests": len(reqs),
            "texts": [r["text"] for r in reqs], "latencies": [r["latency_s"] for r in reqs],
            "reused": [r["reused"] for r in reqs]}


def power_side(model: str, mode: str, memory: bool, parallel: int, threads: int, n_ctx: int,
               suffix_memory: bool = True) -> list[str]:
    args = ["serve", "--port", "0", "--model", model, "--mode", mode, "--threads", str(threads),
            "--n-ctx", str(n_ctx), "--parallel", str(parallel)]
    if mode == "suffix" and not (memory and suffix_memory):
        args += ["--suffix-memory", "0"]  # (on by default under power serve)
    if not memory:
        args += ["--cache-ram", "0"]
    return power_cmd(*args)


def llama_side(peer_bin: Path, model: str, spec_type: str, parallel: int, threads: int, n_ctx: int) -> list[str]:
    return [str(peer_bin / "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", "0", "-t", str(threads),
            "-tb", str(threads), "-c", str(n_ctx * parallel), "-np", str(parallel), "--spec-type", spec_type,
            "--no-webui"]


def measure_side(cmd: list[str], env: dict[str, str] | None, llama: bool, args: argparse.Namespace, clients: int,
                 quiet: Quiet) -> dict[str, Any]:
    """A fresh server (cold memories) per measurement: both workloads, one after the other."""
    def once() -> dict[str, Any]:
        kw: dict[str, Any] = {"announce": LLAMA_ANNOUNCE} if llama else {}
        with listening(cmd, env=env, **kw) as s:
            out = {kind: run_workload(s.url, kind, args.conversations, args.turns, args.tokens, clients, llama)
                   for kind in ("chat", "agent")}
        n = sum(w["tokens"] for w in out.values())
        wall = sum(w["wall_s"] for w in out.values())
        return {"aggregate_tok_s": n / wall, "workloads": out}

    return quiet.measure(once)


def bench_model(alias: str, model: str, args: argparse.Namespace, quiet: Quiet,
                save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every concurrency of one model; ``save`` gets the report so far after every paired run (a run
    cut short still leaves what it measured)."""
    peer_bin, _ = peer_bin_dir()
    env = peer_env("exact")
    report: dict[str, Any] = {}
    screened: dict[str, float] = {}
    for clients in args.clients:
        parallel = max(clients, 1)
        sides = {"power-memory": (power_side(model, "suffix", True, parallel, args.threads, args.n_ctx), None, False)}
        if "power-no-memory" not in args.skip:
            sides["power-no-memory"] = (power_side(model, "suffix", False, parallel, args.threads, args.n_ctx), None,
                                        False)
        if "power-no-suffix-memory" not in args.skip:
            sides["power-no-suffix-memory"] = (power_side(model, "suffix", True, parallel, args.threads, args.n_ctx,
                                                          suffix_memory=False), None, False)
        if clients == 1:
            sides["power-off"] = (power_side(model, "off", True, parallel, args.threads, args.n_ctx), None, False)
        # every llama-server type once (at the first concurrency); the best one is paired with Power's sides
        screen = dict(screened or args.screened or {})
        for t in ([] if screen else args.types):
            r = measure_side(llama_side(peer_bin, model, t, parallel, args.threads, args.n_ctx), env, True,
                             args, clients, quiet)
            screen[t] = r["aggregate_tok_s"]
            print(f"  {alias} c={clients} llama-server {t}: {r['aggregate_tok_s']:.1f} tok/s", flush=True)
        best = max(screen, key=lambda t: screen[t])
        screened = screen
        sides["llama-server"] = (llama_side(peer_bin, model, best, parallel, args.threads, args.n_ctx), env,
                                 True)
        raw: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
        for i in range(args.runs):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in order:
                cmd, side_env, llama = sides[name]
                raw[name].append(measure_side(cmd, side_env, llama, args, clients, quiet))
            print(f"  {alias} c={clients} run {i + 1}/{args.runs}: " + ", ".join(
                f"{k} {v[-1]['aggregate_tok_s']:.1f}" for k, v in raw.items()), flush=True)
            report[f"clients={clients}"] = _summary(raw, screen, best)
            save(report)
    return report


def _texts(run: dict[str, Any]) -> list[str]:
    return [t for kind in ("chat", "agent") for t in run["workloads"][kind]["texts"]]


def _divergences(mine: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where two sides' texts part, per run: the first request whose text differs (index as in
    ``ratios``: chat then agent, each conversation's turns in order; later turns resend it, so they differ
    too) and both texts from the first character they disagree at."""
    out = []
    for run, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        ta, tb = _texts(a), _texts(b)
        diff = [i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y]
        if diff:
            i = diff[0]
            at = next((k for k, (x, y) in enumerate(zip(ta[i], tb[i], strict=False)) if x != y), min(len(ta[i]), len(tb[i])))
            out.append({"run": run, "request": i, "requests_differing": len(diff), "at_char": at,
                        "power": ta[i][max(0, at - 40):at + 80], "other": tb[i][max(0, at - 40):at + 80]})
    return out


def _summary(raw: dict[str, list[dict[str, Any]]], screen: dict[str, float], best: str) -> dict[str, Any]:
    agg = {k: [r["aggregate_tok_s"] for r in v] for k, v in raw.items()}
    out: dict[str, Any] = {"llama_server_types": screen, "llama_server_best": best,
                           "aggregate_tok_s": {k: stats(v) for k, v in agg.items()},
                           # per run: each side's tok/s, and the share of the CPU other processes took meanwhile
                           "runs": {k: [round(x, 2) for x in v] for k, v in agg.items()},
                           "foreign_cpu": {k: [round(r.get("foreign_cpu", 0.0), 3) for r in v] for k, v in raw.items()}}
    mem = raw["power-memory"]
    for other, key in (("llama-server", "over_llama_server"), ("power-no-memory", "over_no_memory"),
                       ("power-no-suffix-memory", "over_no_suffix_memory")):
        if other not in raw:
            continue
        ratios = [a / b for a, b in zip(agg["power-memory"], agg[other], strict=True)]
        out[key] = stats(ratios)
        out[f"identical_texts_vs_{other}"] = all(_texts(a) == _texts(b) for a, b in zip(mem, raw[other], strict=True))
        if not out[f"identical_texts_vs_{other}"]:
            out[f"divergences_vs_{other}"] = _divergences(mem, raw[other])
    if "power-off" in raw:  # per request: memory latency / off latency, median over runs
        lat = {k: [[x for kind in ("chat", "agent") for x in r["workloads"][kind]["latencies"]] for r in raw[k]]
               for k in ("power-memory", "power-off")}
        per = [statistics.median(m[i] / o[i] for m, o in zip(lat["power-memory"], lat["power-off"], strict=True))
               for i in range(len(lat["power-memory"][0]))]
        out["per_request_over_off"] = {"worst": max(per), "median": statistics.median(per),
                                       "slower_than_off_by_2pct": sum(p > 1 + GOAL_OFF for p in per),
                                       "requests": len(per),
                                       # request i: chat then agent, each conversation's turns in order
                                       "ratios": per}
        out["identical_texts_vs_power-off"] = all(_texts(a) == _texts(b) for a, b in zip(mem, raw["power-off"],
                                                                                          strict=True))
    # every side's per-request latencies (the first run), to find the slow requests
    out["latencies_first_run"] = {k: [x for kind in ("chat", "agent") for x in v[0]["workloads"][kind]["latencies"]]
                                  for k, v in raw.items()}
    out["prompt_reused_median"] = statistics.median(
        [x or 0 for kind in ("chat", "agent") for x in mem[0]["workloads"][kind]["reused"]])
    return out


def _markdown(report: dict[str, Any]) -> str:
    lines = ["# bench_memory: a server with memory on multi-request traffic", "",
             f"{report['when']} · {report['machine']} · {report['runs']} paired runs · "
             f"{report['conversations']} conversations x {report['turns']} turns per workload (chat, agent), "
             f"{report['tokens']} tokens max per request · exact numerics both sides"
             + ("" if report.get("complete", True) else " · **cut short: the runs that finished**"), ""]
    for alias, m in report["models"].items():
        for conc, c in m.items():
            lines += [f"## {alias}, {conc}", "", "| side | aggregate tok/s (median [min, max]) |", "|---|---|"]
            for side, s in c["aggregate_tok_s"].items():
                name = f"llama-server {c['llama_server_best']}" if side == "llama-server" else side
                lines.append(f"| {name} | {s['median']:.1f} [{s['min']:.1f}, {s['max']:.1f}] |")
            lines += ["", "- llama-server types (one run each): " + ", ".join(
                f"{t} {v:.1f}" for t, v in c["llama_server_types"].items()),
                f"- Power with memories / llama-server {c['llama_server_best']}: x{c['over_llama_server']['median']:.3f} "
                f"(goal ≥ {GOAL_PEER}); identical texts: {c['identical_texts_vs_llama-server']}",
                f"- median prompt tokens reused per request (first run): {c['prompt_reused_median']}",
                "- CPU taken by other processes during each run (share, per side): " + "; ".join(
                    f"{k} {v}" for k, v in c["foreign_cpu"].items())]
            if "over_no_memory" in c:
                lines.append(f"- with / without memories: x{c['over_no_memory']['median']:.3f} (goal ≥ {GOAL_SELF}); "
                             f"identical texts: {c['identical_texts_vs_power-no-memory']}")
            if "over_no_suffix_memory" in c:
                lines.append(f"- with / without the suffix memory (prompt cache on both): "
                             f"x{c['over_no_suffix_memory']['median']:.3f}; identical texts: "
                             f"{c['identical_texts_vs_power-no-suffix-memory']}")
            if "per_request_over_off" in c:
                p = c["per_request_over_off"]
                lines.append(f"- per request, latency with memories / `--mode off` (median over runs): worst "
                             f"x{p['worst']:.3f}, median x{p['median']:.3f}; {p['slower_than_off_by_2pct']} of "
                             f"{p['requests']} slower by more than {100 * GOAL_OFF:.0f} %; identical texts: "
                             f"{c['identical_texts_vs_power-off']}")
            lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--types", default=",".join(NGRAM_TYPES))
    ap.add_argument("--screened", default="", help="llama-server types already screened, as type=tok/s,... (they "
                                                   "are not measured again; the best is paired)")
    ap.add_argument("--skip", default="", help="sides left out, comma-separated (power-no-memory: the slowest side, "
                                               "for a shorter run)")
    ap.add_argument("--max-foreign", type=float, default=0.15)
    ap.add_argument("--quiet-wait", type=float, default=60.0)
    ap.add_argument("--retries", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "evidence" / "bench_memory")
    args = ap.parse_args()
    args.clients = [int(c) for c in args.clients.split(",") if c]
    args.types = [t for t in args.types.split(",") if t]
    args.skip = {t for t in args.skip.split(",") if t}
    from power_native.models import resolve_model

    quiet = Quiet(args.max_foreign, args.quiet_wait, args.retries)
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
                              "runs": args.runs, "conversations": args.conversations, "turns": args.turns,
                              "tokens": args.tokens, "skipped": sorted(args.skip), "models": {}}
    if args.screened:  # llama-server types measured before (name=tok/s): not screened again
        args.screened = {t: float(v) for t, v in (x.split("=") for x in args.screened.split(",") if x)}

    def save(partial: dict[str, Any] | None = None, alias: str = "") -> None:
        if partial is not None:
            report["models"][alias] = partial
        report["complete"] = partial is None
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "report.md").write_text(_markdown(report))

    for alias in [m for m in args.models.split(",") if m]:
        report["models"][alias] = bench_model(alias, str(resolve_model(alias)), args, quiet,
                                              lambda r, a=alias: save(r, a))
    save()
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
