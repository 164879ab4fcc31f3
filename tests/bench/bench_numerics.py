"""bench_numerics: what ``numerics = "exact"`` costs against llama.cpp's stock kernels, quant type by quant type.

Two paired, interleaved measurements per model (the order of the two numerics alternates every run; each run is
a fresh process, since the batch-invariant switch is process-wide and picks the repacked layouts at load):

1. **Passes** (``--worker``): the target opened as Power opens it (``open_target`` with the numerics), then the
   median time of a one-token pass, an 8-token and a 16-token pass (all rows out, after a 300-token history)
   and of a 512-token prompt chunk; and the bytes llama.cpp repacked (``CPU_REPACK``).
2. **Decode** (``--decode``): ``power run --mode off`` (exact) against ``llama-completion`` of the same build
   with stock kernels (the peer llama.cpp users run), tokens per second over the same prompt and count; and
   ``llama-completion`` with exact's kernels, so the gap splits into kernels and Power's host time.

Models: a synthetic wide llama per quant type (``--types``; written as F16 and quantized by the pinned build's
``llama-quantize``, tests/native/native_helpers.py ``make_wide``, cached in ``--model-dir``) and the two real
models (``--real``). Reports medians, the median of the per-pair ratios ``stock time / exact time`` (1.0: exact
costs nothing; the goal is >= 0.97), JSON and a Markdown table.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "native"))
NUMERICS = ("exact", "stock")
WIDTHS = (1, 8, 16)
HISTORY = 300
PREFILL = 512
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def worker(model: str, numerics: str, threads: int, reps: int) -> dict:
    """One process, one numerics: pass times on the target Power opens."""
    from power_native import _llama
    from power_native.target import open_target

    _llama.set_log_level("error")
    target = open_target(model, n_ctx=2048, max_block=max(WIDTHS), snapshots=1, n_threads=threads, numerics=numerics)
    try:
        ctx = _llama.Context(target.model, n_ctx=2048, n_batch=PREFILL, n_ubatch=PREFILL, n_threads=threads,
                             n_outputs_max=max(WIDTHS))
        toks = np.random.default_rng(0).integers(1, min(target.model.n_vocab, 30000), size=HISTORY + PREFILL)
        toks = toks.astype(np.int32)
        out: dict = {}
        times = []
        for _ in range(max(2, reps // 2)):
            t0 = time.perf_counter()
            ctx.decode(toks[:PREFILL], 0, all_outputs=False)
            times.append(time.perf_counter() - t0)
            ctx.seq_rm(0, 0)
        out["prefill512_ms"] = 1000 * statistics.median(times)
        ctx.decode(toks[:HISTORY], 0, all_outputs=False)
        for w in WIDTHS:
            ctx.decode(toks[HISTORY:HISTORY + w], HISTORY, all_outputs=True)  # warm this shape's graph
            ctx.seq_rm(0, HISTORY)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                ctx.decode(toks[HISTORY:HISTORY + w], HISTORY, all_outputs=True)
                times.append(time.perf_counter() - t0)
                ctx.seq_rm(0, HISTORY)
            out[f"n{w}_ms"] = 1000 * statistics.median(times)
        out["repacked_bytes"] = ctx.memory().get("CPU_REPACK", {}).get("model", 0)
        ctx.close()
    finally:
        target.close()
    return out


def decode_pair(model: str, peer_bin: Path, tokens: int, threads: int) -> dict:
    """``power run --mode off`` (exact) vs stock ``llama-completion``, decode tokens per second; and
    ``llama-completion`` with exact's kernels (``GGML_CPU_BATCH_INVARIANT=1``), which splits the gap into
    kernels (completion exact / stock) and host (Power / completion exact)."""
    from power_core.config import PowerConfig
    from power_core.session import Session

    cfg = PowerConfig(spec_mode="off", max_tokens=tokens, n_threads=threads, numerics="exact")
    with Session.open(cfg, model=model) as s:
        power = s.generate(PROMPT).receipt.timings["decode_tok_s"]
    peer = {n: _completion(model, peer_bin, tokens, threads, n) for n in NUMERICS}
    return {"power_off_tok_s": power, "llama_completion_tok_s": peer["stock"],
            "llama_completion_exact_tok_s": peer["exact"]}


def _completion(model: str, peer_bin: Path, tokens: int, threads: int, numerics: str) -> float:
    """``llama-completion``'s decode tokens per second with ``numerics``' kernels, counted as Power's receipt
    counts them (wall time after the prompt pass: :func:`power_core.bench.completion_rate`)."""
    from power_core.bench import completion_rate, peer_env

    proc = subprocess.run([str(peer_bin / "llama-completion"), "-m", model, "-p", PROMPT, "-n", str(tokens),
                           "-t", str(threads), "--temp", "0", "--top-k", "1", "-c", "2048", "-ngl", "0",
                           "-no-cnv"], capture_output=True, text=True, timeout=900, env=peer_env(numerics))
    rate = completion_rate(proc.stderr)
    if proc.returncode != 0 or rate is None:
        raise RuntimeError(f"llama-completion failed ({proc.returncode}): {proc.stderr[-800:]}")
    return rate[1]


def _spawn(model: str, numerics: str, threads: int, reps: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", model, numerics, str(threads), str(reps)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {numerics} on {model} failed: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median_ratio(pairs: list[tuple[float, float]]) -> float:
    return statistics.median(s / e for e, s in pairs)


def measure(model: str, runs: int, threads: int, reps: int, peer_bin: Path | None, tokens: int) -> dict:
    rows: dict[str, list[dict]] = {n: [] for n in NUMERICS}
    for i in range(runs):
        for numerics in (NUMERICS if i % 2 == 0 else NUMERICS[::-1]):
            rows[numerics].append(_spawn(model, numerics, threads, reps))
    keys = [f"n{w}_ms" for w in WIDTHS] + ["prefill512_ms"]
    res: dict = {"runs": runs, "raw": rows,
                 "repacked_bytes": {n: rows[n][0]["repacked_bytes"] for n in NUMERICS}}
    for k in keys:
        res[k] = {n: statistics.median(r[k] for r in rows[n]) for n in NUMERICS}
        res[k]["speed_ratio"] = _median_ratio([(e[k], s[k]) for e, s in zip(rows["exact"], rows["stock"], strict=True)])
    if peer_bin is not None:
        dec = [decode_pair(model, peer_bin, tokens, threads) for _ in range(runs)]
        res["decode"] = {
            "power_off_tok_s": statistics.median(d["power_off_tok_s"] for d in dec),
            "llama_completion_tok_s": statistics.median(d["llama_completion_tok_s"] for d in dec),
            "ratio": statistics.median(d["power_off_tok_s"] / d["llama_completion_tok_s"] for d in dec),
            "kernels_ratio": statistics.median(d["llama_completion_exact_tok_s"] / d["llama_completion_tok_s"]
                                               for d in dec),
            "raw": dec,
        }
    return res


def table(results: dict) -> str:
    lines = ["| model | 1-token pass ms (exact / stock, ratio) | 8-token | 16-token | 512-token prefill | "
             "`--mode off` vs `llama-completion` tok/s | `llama-completion` exact / stock kernels |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        cells = []
        for k in [f"n{w}_ms" for w in WIDTHS] + ["prefill512_ms"]:
            cells.append(f"{r[k]['exact']:.1f} / {r[k]['stock']:.1f} (**{r[k]['speed_ratio']:.2f}**)")
        d = r.get("decode")
        cells.append(f"{d['power_off_tok_s']:.1f} / {d['llama_completion_tok_s']:.1f} (**{d['ratio']:.2f}**)"
                     if d else "-")
        cells.append(f"**{d['kernels_ratio']:.2f}**" if d and "kernels_ratio" in d else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        model, numerics, threads, reps = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(worker(model, numerics, threads, reps)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_K_M,Q5_K_M,Q6_K,Q8_0,IQ4_NL,IQ4_XS,Q4_1,Q5_0,Q5_1,F16,BF16")
    ap.add_argument("--real", default="smollm2,gemma3-270m", help="real models (aliases), '' for none")
    ap.add_argument("--embd", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="pairs per model (processes alternate exact/stock)")
    ap.add_argument("--reps", type=int, default=9, help="timed passes per width in a process (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256, help="tokens for the --mode off vs llama-completion pair")
    ap.add_argument("--model-dir", type=Path, default=Path(os.environ.get("POWER_NATIVE_CACHE", Path.home() / ".cache" /
                                                                         "power-native")) / "bench-models")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "evidence" / "bench_numerics")
    args = ap.parse_args()

    from native_helpers import make_wide
    from power_native.models import resolve_model

    from tests.helpers import build_tools

    tools = build_tools()
    peer_bin = tools.build_dir(False, rpc=os.environ.get("POWER_NATIVE_RPC") == "1") / "bin"
    if not (peer_bin / "llama-quantize").exists() or not (peer_bin / "llama-completion").exists():
        subprocess.run([sys.executable, str(ROOT / "native" / "tools" / "build_llama.py"), "--peers"], check=True)
    args.model_dir.mkdir(parents=True, exist_ok=True)
    models = {f"wide {t}": str(make_wide(args.model_dir, t, peer_bin / "llama-quantize", n_embd=args.embd,
                                         n_ff=args.ff, n_layer=args.layers, n_ctx=2048))
              for t in filter(None, args.types.split(","))}
    models.update({alias: str(resolve_model(alias)) for alias in filter(None, args.real.split(","))})
    results = {}
    for name, path in models.items():
        results[name] = measure(path, args.runs, args.threads, args.reps, peer_bin, args.tokens)
        r = results[name]
        print(f"{name:>22}: " + ", ".join(f"{k} {r[k]['speed_ratio']:.2f}" for k in
                                          [f"n{w}_ms" for w in WIDTHS] + ["prefill512_ms"])
              + (f", --mode off/llama-completion {r['decode']['ratio']:.2f}" if "decode" in r else ""), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "runs": args.runs, "reps": args.reps, "wide": {"embd": args.embd, "ff": args.ff,
                                                                                   "layers": args.layers}}
    (args.out / "report.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (args.out / "report.md").write_text(table(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
