"""bench_numerics: what the batch-invariant default costs. Target-only (``--mode off``) decode tok/s
and prefill seconds with ``numerics = "exact"`` vs ``"stock"``, paired and interleaved (the order
alternates every run; a fresh session per run), on SmolLM2-135M and Gemma-3-270M. Reports medians
and the median of the per-pair ratios exact/stock; JSON evidence."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from power_native.models import resolve_model

from power_core.config import PowerConfig
from power_core.session import Session

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def one(model: str, numerics: str, tokens: int, threads: int, prompt: str) -> dict[str, float]:
    cfg = PowerConfig(spec_mode="off", max_tokens=tokens, n_threads=threads, numerics=numerics)
    with Session.open(cfg, model=model) as s:
        t = s.generate(prompt).receipt.timings
    return {"decode_tok_s": t["decode_tok_s"], "prefill_s": t["prefill_s"]}


def measure(alias: str, runs: int, tokens: int, threads: int, prompt: str) -> dict:
    model = str(resolve_model(alias))
    one(model, "exact", 8, threads, prompt)  # warm the page cache and the graph allocator
    rows: dict[str, list[dict[str, float]]] = {"exact": [], "stock": []}
    for i in range(runs):
        for numerics in (("exact", "stock") if i % 2 == 0 else ("stock", "exact")):
            rows[numerics].append(one(model, numerics, tokens, threads, prompt))
    ratios = [e["decode_tok_s"] / s["decode_tok_s"] for e, s in zip(rows["exact"], rows["stock"], strict=True)]
    pre = [e["prefill_s"] / s["prefill_s"] for e, s in zip(rows["exact"], rows["stock"], strict=True)]
    return {
        "runs": runs, "tokens": tokens, "threads": threads,
        "exact_tok_s": statistics.median(r["decode_tok_s"] for r in rows["exact"]),
        "stock_tok_s": statistics.median(r["decode_tok_s"] for r in rows["stock"]),
        "paired_ratio_exact_over_stock": statistics.median(ratios),
        "paired_ratios": ratios,
        "prefill_ratio_exact_over_stock": statistics.median(pre),
        "raw": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "bench_numerics.json")
    args = ap.parse_args()
    res = {alias: measure(alias, args.runs, args.tokens, args.threads, PROMPT) for alias in args.models.split(",")}
    for alias, r in res.items():
        print(f"{alias:>12}: --mode off exact {r['exact_tok_s']:.1f} tok/s vs stock {r['stock_tok_s']:.1f} tok/s, "
              f"paired median ratio {r['paired_ratio_exact_over_stock']:.3f} "
              f"(prefill {r['prefill_ratio_exact_over_stock']:.3f}) over {r['runs']} pairs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
