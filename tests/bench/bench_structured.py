"""bench_structured: constrained output under speculation, paired and interleaved, exact numerics.

On the structured workload (:mod:`structured_workload`: twelve JSON-extraction and tool-argument
tasks whose prompts invite copying):

a. ``--mode suffix`` vs ``--mode off``, both constrained by each task's schema, in one process
   (library sessions, alternating order per run): aggregate decode tok/s over the task set per run,
   the paired ratio per run, and whether every text is identical.
b. the constraint's host cost: the receipt's ``timings.constraint_us_per_round`` against the decode
   time per round of the off runs (a SmolLM2 decode), as a fraction.
c. the same requests on ``llama-server`` of the pinned build (exact numerics: batch-invariant kernels,
   ``GGML_CPU_BATCH_INVARIANT=1``) with the same schema in its ``json_schema`` field, one client, for every n-gram
   ``--spec-type``; its grammar may place whitespace differently, so the report says, per type,
   how many texts equal Power's, and its aggregate decode tok/s (``timings``) against Power's suffix
   through ``power serve`` (``json_schema`` field, the same requests).

Goals (issue #30): suffix >= 1.3x off on the set; the constraint <= 5 % of a decode.
Writes ``report.json`` and ``report.md`` under ``--out`` (default ``docs/evidence/bench_structured/``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))
from bench_serve import LLAMA_ANNOUNCE, Quiet, llama_server_cmd, peer_bin_dir, power_serve_cmd, stats  # noqa: E402
from structured_workload import TASKS, prompt  # noqa: E402

from power_core import PowerConfig, Session  # noqa: E402
from power_core.bench import NGRAM_TYPES, peer_env  # noqa: E402
from power_core.constraint import ConstraintSpec  # noqa: E402
from tests.serve_helpers import listening  # noqa: E402

SPEEDUP_GOAL, COST_GOAL = 1.3, 0.05


def library_run(session: Session, names: list[str]) -> dict[str, Any]:
    """Every task once on ``session``: aggregate decode tok/s, the texts, and the constraint's cost."""
    n = decode = constraint_s = rounds = 0.0
    texts, cuts = {}, 0
    for name in names:
        r = session.start(prompt(name), constraint=ConstraintSpec.json_schema(TASKS[name][0])).run()
        t = r.receipt.timings
        n += max(len(r.tokens) - 1, 0)
        decode += t["decode_s"]
        k = len(r.receipt.rounds)
        rounds += k
        constraint_s += t.get("constraint_us_per_round", 0.0) * k / 1e6
        texts[name] = r.text
        cuts += r.receipt.constraint["cuts"] if r.receipt.constraint else 0
    return {"decode_tok_s": n / decode if decode else 0.0, "decode_s": decode, "tokens": n, "rounds": rounds,
            "constraint_s": constraint_s, "texts": texts, "cuts": cuts}


def bench_library(model: str, names: list[str], runs: int, threads: int, quiet: Quiet) -> dict[str, Any]:
    sessions = {mode: Session.open(PowerConfig(spec_mode=mode, max_tokens=TOKENS, n_ctx=2048, n_threads=threads),
                                   model=model) for mode in ("off", "suffix")}
    try:
        for s in sessions.values():  # warm: the grammar engine's tokenizer, caches
            library_run(s, names[:1])
        raw: dict[str, list[dict[str, Any]]] = {"off": [], "suffix": []}
        for i in range(runs):
            for mode in (("off", "suffix") if i % 2 == 0 else ("suffix", "off")):
                raw[mode].append(quiet.measure(lambda mode=mode: library_run(sessions[mode], names)))
            print(f"  run {i + 1}/{runs}: off {raw['off'][-1]['decode_tok_s']:.1f}, suffix "
                  f"{raw['suffix'][-1]['decode_tok_s']:.1f} tok/s", flush=True)
    finally:
        for s in sessions.values():
            s.close()
    ratios = [s["decode_tok_s"] / o["decode_tok_s"] for o, s in zip(raw["off"], raw["suffix"], strict=True)]
    identical = all(o["texts"] == s["texts"] for o, s in zip(raw["off"], raw["suffix"], strict=True))
    # the constraint's share of a decode: its host seconds over the off runs' decode seconds
    cost = [o["constraint_s"] / o["decode_s"] for o in raw["off"]]
    per_round = [1e6 * o["constraint_s"] / o["rounds"] for o in raw["off"]]
    decode_per_round = [1e6 * o["decode_s"] / o["rounds"] for o in raw["off"]]
    return {"off_tok_s": stats([r["decode_tok_s"] for r in raw["off"]]),
            "suffix_tok_s": stats([r["decode_tok_s"] for r in raw["suffix"]]),
            "ratio": stats(ratios), "ratios": ratios, "identical": identical,
            "constraint_fraction_of_decode": stats(cost), "constraint_us_per_round": stats(per_round),
            "off_decode_us_per_round": stats(decode_per_round),
            "suffix_cuts_per_run": raw["suffix"][0]["cuts"], "texts": raw["off"][0]["texts"],
            "foreign_cpu": {m: [r["foreign_cpu"] for r in raw[m]] for m in raw}}


def _serve_run(base: str, names: list[str], llama: bool) -> dict[str, Any]:
    n = decode = 0.0
    texts = {}
    with httpx.Client(timeout=900) as c:
        served = c.get(base + "/v1/models").json()["data"][0]["id"]
        for name in names:
            body: dict[str, Any] = {"model": served, "prompt": prompt(name), "max_tokens": TOKENS,
                                    "json_schema": TASKS[name][0]}
            if llama:
                body.update(temperature=0, top_k=1, seed=0)
            r = c.post(base + "/v1/completions", json=body)
            r.raise_for_status()
            d = r.json()
            texts[name] = d["choices"][0]["text"]
            if llama:
                n += d["timings"]["predicted_n"] - 1
                decode += d["timings"]["predicted_ms"] / 1000
            else:
                k = d["usage"]["completion_tokens"]
                n += k - 1
                decode += (k - 1) / d["power"]["decode_tok_s"] if d["power"]["decode_tok_s"] else 0.0
    return {"decode_tok_s": n / decode if decode else 0.0, "texts": texts}


def bench_peers(model: str, names: list[str], runs: int, threads: int, types: list[str], quiet: Quiet,
                power_texts: dict[str, str]) -> dict[str, Any]:
    peer_bin, _ = peer_bin_dir()
    env = peer_env("exact")
    out: dict[str, Any] = {}
    power: list[float] = []
    with listening(power_serve_cmd(model, "suffix", threads, 2048, 1)) as p:
        for _ in range(runs):
            r = quiet.measure(lambda: _serve_run(p.url, names, llama=False))
            power.append(r["decode_tok_s"])
            served_identical = r["texts"] == power_texts
    out["power-serve suffix"] = {"decode_tok_s": stats(power), "texts_equal_library": served_identical}
    for spec_type in types:
        tok_s, agree = [], 0
        cmd = llama_server_cmd(peer_bin, model, spec_type, threads, 2048, 1)
        with listening(cmd, env=env, announce=LLAMA_ANNOUNCE) as s:
            for _ in range(runs):
                r = quiet.measure(lambda: _serve_run(s.url, names, llama=True))
                tok_s.append(r["decode_tok_s"])
                agree = sum(r["texts"][k] == power_texts[k] for k in names)
        out[f"llama-server {spec_type}"] = {"decode_tok_s": stats(tok_s), "texts_equal_power": agree,
                                            "example": r["texts"][names[0]]}
        print(f"  llama-server {spec_type}: {statistics.median(tok_s):.1f} tok/s, {agree}/{len(names)} texts "
              "equal Power's", flush=True)
    return out


def _markdown(report: dict[str, Any]) -> str:
    lines = ["# bench_structured: constrained JSON under speculation", "",
             f"{report['when']} · {report['machine']} · {report['runs']} paired runs · {report['tokens']} tokens "
             f"max per task · exact numerics both sides · the twelve tasks of `tests/bench/structured_workload.py`",
             ""]
    for model, m in report["models"].items():
        lib = m["library"]
        lines += [f"## {model}", "",
                  "| | off | suffix | suffix / off (paired) | identical texts |", "|---|---|---|---|---|",
                  f"| decode tok/s (median [min, max]) | {_f(lib['off_tok_s'])} | {_f(lib['suffix_tok_s'])} | "
                  f"{_f(lib['ratio'], 3)} | {'yes' if lib['identical'] else 'NO'} |", "",
                  f"- the constraint's host time: {_f(lib['constraint_us_per_round'])} µs per round against "
                  f"{_f(lib['off_decode_us_per_round'])} µs of decode per round: "
                  f"{100 * lib['constraint_fraction_of_decode']['median']:.2f} % of a decode (goal ≤ "
                  f"{100 * COST_GOAL:.0f} %).",
                  f"- suffix over off: x{lib['ratio']['median']:.3f} (goal ≥ {SPEEDUP_GOAL}).", ""]
        if m.get("peers"):
            lines += ["| server (one client, `json_schema` field) | decode tok/s | texts equal Power's |",
                      "|---|---|---|"]
            for name, p in m["peers"].items():
                eq = p.get("texts_equal_power")
                shown = "-" if eq is None else f"{eq}/{len(lib['texts'])}"
                lines.append(f"| {name} | {_f(p['decode_tok_s'])} | {shown} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def _f(s: dict[str, float], digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


TOKENS = 96


def main() -> int:
    global TOKENS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2", help="comma-separated model aliases or paths")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(NGRAM_TYPES), help="llama-server --spec-type values ('' for none)")
    ap.add_argument("--max-foreign", type=float, default=0.15)
    ap.add_argument("--quiet-wait", type=float, default=60.0)
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "evidence" / "bench_structured")
    args = ap.parse_args()
    TOKENS = args.tokens
    from power_native.models import resolve_model

    quiet = Quiet(args.max_foreign, args.quiet_wait, args.retries)
    names = sorted(TASKS)
    report: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
                              "runs": args.runs, "tokens": args.tokens,
                              "goals": {"suffix_over_off": SPEEDUP_GOAL, "constraint_fraction": COST_GOAL},
                              "models": {}}
    for alias in [m for m in args.models.split(",") if m]:
        model = str(resolve_model(alias))
        print(f"{alias}: library, off vs suffix", flush=True)
        lib = bench_library(model, names, args.runs, args.threads, quiet)
        entry: dict[str, Any] = {"library": lib}
        types = [t for t in args.types.split(",") if t]
        if types:
            print(f"{alias}: servers", flush=True)
            entry["peers"] = bench_peers(model, names, args.runs, args.threads, types, quiet, lib["texts"])
        report["models"][alias] = entry
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "report.md").write_text(_markdown(report))
    print(_markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
