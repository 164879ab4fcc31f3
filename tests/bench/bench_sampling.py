"""bench_sampling: greedy ids sampled in llama.cpp's graph (``--sampling-in-graph on``) against logits
rows read on the host (``off``), paired and interleaved, on SmolLM2-135M and Gemma-3-270M (49,152- and
262,144-token vocabularies) for ``off``, ``suffix`` and ``draft-model`` (self-draft: the draft's ids
follow the same switch). Each run is a fresh ``power run`` process on ``docs/examples/code-edit.txt``;
reports decode tok/s and host µs per round (medians), the median of the per-run ratios in-graph/host,
which path each receipt says ran, and whether all runs emitted the same tokens. JSON and Markdown
evidence; exits 1 when an arm's tokens differ."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from paired_cli import paired  # noqa: E402

ROOT = HERE.parents[1]
ARMS = {"host rows": ["--sampling-in-graph", "off"], "in-graph ids": ["--sampling-in-graph", "on"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--modes", default="off,suffix,draft-model")
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "bench_sampling")
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            arms = {arm: ["--mode", mode, "--threads", str(args.threads), *flags] for arm, flags in ARMS.items()}
            row = paired(model, arms, args.runs, [], tokens=args.tokens) | {"mode": mode}
            rows.append(row)
            print(f"{model:>12} {mode:>11}: host rows {row['decode_tok_s']['host rows']} tok/s "
                  f"({row['host_us_per_round']['host rows']} µs/round host) vs in-graph ids "
                  f"{row['decode_tok_s']['in-graph ids']} tok/s ({row['host_us_per_round']['in-graph ids']} µs/round); "
                  f"paired ratio {row['ratio']}; same output {row['same_output']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps({"runs": args.runs, "tokens": args.tokens,
                                                      "threads": args.threads, "cpus": os.cpu_count(),
                                                      "rows": rows}, indent=2) + "\n")
    lines = ["# In-graph greedy ids vs host rows", "",
             f"{args.runs} paired runs, {args.tokens} tokens, {args.threads} threads, `docs/examples/code-edit.txt`; "
             "decode tok/s and host µs per round are medians; the ratio is the median of the per-run ratios "
             "in-graph / host.", "",
             "| model | mode | host rows tok/s | in-graph tok/s | ratio | host µs/round (host / in-graph) | paths | same output |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, h = r["decode_tok_s"], r["host_us_per_round"]
        lines.append(f"| {r['model']} | {r['mode']} | {d['host rows']} | {d['in-graph ids']} | {r['ratio']} | "
                     f"{h['host rows']} / {h['in-graph ids']} | {r['sampling']['host rows']} → "
                     f"{r['sampling']['in-graph ids']} | {r['same_output']} |")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["same_output"] for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("POWER_LOG", "warning")
    raise SystemExit(main())
