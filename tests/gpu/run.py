"""The device check of issue #20: what Power does on an NVIDIA GPU, in one report.

``tests/gpu/run.sh`` builds the CUDA backend with every core and then runs this; ``--cpu`` runs the
same checks on the installed CPU build (a dry run of the script, what CI-less machines can do):

    bash tests/gpu/run.sh [OUT]                 # on a GPU machine with a CUDA toolkit
    python native/tools/build_llama.py --peers  # anywhere, no offload: the CPU build's llama.cpp tools, then
    python tests/gpu/run.py --cpu --out OUT --peer-bin "$(python native/tools/build_llama.py --print-dir)/bin"

Every step goes through the installed ``power`` CLI (a fresh process each) and is timed:

1. ``power selftest`` on SmolLM2 and Gemma-3 with every layer offloaded: are a GPU verify pass's rows
   its one-token rows (batch invariance; expect not on CUDA) — and the same with ``--require-identical``
   on a ``suffix`` run, whose receipt then says it fell back to target-only and why;
2. parity of every mode with ``--mode off``, greedy, all layers offloaded: ``suffix`` and
   ``draft-model`` (self-draft) on both real models; MTP on a tiny synthetic qwen35 with an MTP head
   (a recurrent target: its checkpoints stay in device buffers, the receipt's ``state_checkpoints``);
   DFlash v1, DFlash2 and DSpark on a synthetic llama target with its drafts (random weights, shaped
   by ``--shape``: ``tiny`` as the test suite's, ``full`` a 1024-wide, 8-layer, 32k-vocabulary
   target); a differing output is reported with its first differing token, never hidden;
3. paired timings (``--runs`` interleaved, medians): ``suffix`` on both real models with one captured
   graph shape (``--verify-capacity 8``) against free widths, and greedy ids sampled in the graph
   (``--sampling-in-graph on``) against rows on the host;
4. ``power bench`` against llama.cpp's own tools of the same build (``--peer-bin``: ``llama-completion``
   and ``llama-speculative-simple`` with each n-gram type, offloaded as Power is), ``off`` and
   ``suffix`` on both real models, once with llama.cpp's graph reuse (its default) and once without
   (``LLAMA_GRAPH_REUSE_DISABLE=1``, which Power's contexts and the peers read alike).

The report (``OUT/report.json``, ``OUT/report.md``) records the devices, the build flags and every
figure; each ``power bench`` also writes its own evidence under ``OUT/bench-*``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "native"))
sys.path.insert(0, str(REPO / "tests" / "bench"))
from paired_cli import PROMPT, paired, power  # noqa: E402

SHAPES = {"tiny": {}, "full": {"n_embd": 1024, "n_head": 8, "n_ff": 2816, "n_layer": 8, "n_vocab": 32000}}


def fixtures(out: Path, shape: str) -> dict[str, tuple[str, str | None]]:
    """mode -> (target, draft) of the synthetic checks."""
    from native_helpers import make_tiny, make_tiny_draft, make_tiny_mtp

    kw = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    target = make_tiny(out, "llama", name=f"llama-{shape}", **kw)
    # the synthetic qwen35's hybrid (SSM) dimensions are written for the tiny shape only: a 1024-wide one
    # trips a ggml shape assert in its graph, so MTP runs on the tiny shape at either --shape
    got: dict[str, tuple[str, str | None]] = {"mtp": (str(make_tiny_mtp(out, "qwen35", name="qwen35-mtp")), None)}
    for mode in ("dflash", "dflash2", "dspark"):
        got[mode] = (str(target), str(make_tiny_draft(out, target, mode, name=f"{mode}-{shape}")))
    return got


def parity(model: str, mode: str, draft: str | None, offload: list[str], prompt: list[str]) -> dict:
    base = ["run", "--model", model, *prompt, "--max-tokens", "64", *offload]
    off, _ = power(*base, "--mode", "off")
    drafted = ["--draft", draft] if draft else []
    if offload and mode != "mtp":  # the draft model on the GPU too (the MTP head follows the target)
        drafted += ["--draft-gpu-layers", "-1"]
    spec, wall = power(*base, "--mode", mode, *drafted)
    a, b = off["tokens"], spec["tokens"]
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    r = spec["receipt"]
    return {"model": Path(model).name, "mode": mode, "identical": first is None, "first_difference": first,
            "acceptance": r["summary"].get("acceptance"), "sampling": r["backend"].get("sampling"),
            "draft_sampling": r["backend"].get("draft_sampling"), "state_checkpoints": r["backend"].get("state_checkpoints"),
            "host_us_per_round": round(r["timings"].get("host_us_per_round", float("nan")), 1),
            "wall_s": round(wall, 2)}


def versus_llama_cpp(model: str, peer_bin: Path, runs: int, offload: list[str], out: Path, reuse: bool) -> dict:
    """``power bench`` (off, suffix) with llama.cpp's tools as peers, graph reuse on or off for both sides."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_GRAPH_REUSE_DISABLE"}
    if not reuse:
        env["LLAMA_GRAPH_REUSE_DISABLE"] = "1"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "power_core.cli", "bench", "--model", model, "--modes", "off,suffix",
                           "--prompts", str(PROMPT), "--runs", str(runs), "--tokens", "128", "--peer-bin", str(peer_bin),
                           "--out", str(out), "--no-progress", *offload], capture_output=True, text=True, env=env)
    if proc.returncode not in (0, 1):  # 1: a parity failure, reported in the evidence
        raise SystemExit(f"power bench on {model} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    (prompt,) = report["prompts"].values()

    def med(s: dict | None, digits: int = 1) -> float | None:
        return round(s["median"], digits) if s else None

    return {"model": model, "graph_reuse": report["graph_reuse"], "offload": report["offload"],
            "power_tok_s": {m: med(c["tok_s"]) for m, c in prompt["modes"].items()},
            "parity": {m: c["parity"] for m, c in prompt["modes"].items()},
            "peer_tok_s": {n: med(c["tok_s"]) for n, c in prompt["peers"].items()},
            "peer_same_text": {n: c["same_text"] for n, c in prompt["peers"].items()},
            "best_peer_ngram": prompt.get("best_peer_ngram"),
            "suffix_vs_best_peer_ngram": med((prompt.get("ratio_to_best_peer_ngram") or {}).get("suffix"), 3),
            "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-report"))
    ap.add_argument("--cpu", action="store_true", help="no offload: a dry run on a CPU build")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="full")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--build-seconds", type=float)
    ap.add_argument("--peer-bin", type=Path, required=True,
                    help="llama-completion and llama-speculative-simple of the same build "
                         "(native/tools/build_llama.py --peers, then its bin/)")
    args = ap.parse_args()
    import power_native
    from power_native import _llama

    offload = [] if args.cpu else ["--gpu-layers", "-1"]
    report: dict = {"offload": offload, "build": power_native.build_info(), "build_seconds": args.build_seconds,
                    "devices": [list(d) for d in _llama.backend_devices()], "steps": {}}
    t0 = time.perf_counter()
    models = ["smollm2", "gemma3-270m"]
    report["selftest"] = [power("selftest", "--model", m, *offload)[0] | {"model": m} for m in models]
    report["require_identical"] = []
    for m in models:
        got, _ = power("run", "--model", m, "--mode", "suffix", "--prompt-file", str(PROMPT), "--max-tokens", "32",
                       "--require-identical", *offload)
        report["require_identical"].append({"model": m, "strategy": got["receipt"]["strategy"]["name"],
                                            "selection": got["receipt"]["selection"]})
    report["steps"]["selftest_s"] = round(time.perf_counter() - t0, 1)

    t1 = time.perf_counter()
    rows = [parity(m, mode, None, offload, ["--prompt-file", str(PROMPT)])
            for m in models for mode in ("suffix", "draft-model")]
    for mode, (target, draft) in fixtures(args.out / "fixtures", args.shape).items():
        rows.append(parity(target, mode, draft, offload, ["--prompt", "hello world, this is a test prompt"]))
    report["parity"] = rows
    report["steps"]["parity_s"] = round(time.perf_counter() - t1, 1)

    t2 = time.perf_counter()
    report["paired"] = []
    for m in models:
        report["paired"].append(paired(m, {"free widths": ["--mode", "suffix"],
                                           "verify_capacity 8": ["--mode", "suffix", "--draft-max", "7",
                                                                 "--verify-capacity", "8"]}, args.runs, offload))
        report["paired"].append(paired(m, {"host ids": ["--mode", "suffix", "--sampling-in-graph", "off"],
                                           "in-graph ids": ["--mode", "suffix", "--sampling-in-graph", "on"]},
                                       args.runs, offload))
    target, draft = fixtures(args.out / "fixtures", args.shape)["dflash"]
    drafter = ["--mode", "dflash", "--draft", draft, *([] if args.cpu else ["--draft-gpu-layers", "-1"])]
    report["paired"].append(paired(target, {"draft ids on the host": [*drafter, "--sampling-in-graph", "off"],
                                            "draft ids in its graph": [*drafter, "--sampling-in-graph", "on"]},
                                   args.runs, offload))
    report["steps"]["paired_s"] = round(time.perf_counter() - t2, 1)

    t3 = time.perf_counter()
    report["versus_llama_cpp"] = [versus_llama_cpp(m, args.peer_bin, args.runs, offload,
                                                   args.out / f"bench-{m}-{'reuse' if reuse else 'no-reuse'}", reuse)
                                  for m in models for reuse in (True, False)]
    report["steps"]["versus_llama_cpp_s"] = round(time.perf_counter() - t3, 1)
    report["steps"]["total_s"] = round(time.perf_counter() - t0, 1)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# Power device check ({'CPU dry run' if args.cpu else 'GPU, all layers offloaded'})", "",
             f"devices: {report['devices']}; build flags: {' '.join(report['build'].get('flags') or [])}", "",
             "| selftest model | identical | max abs diff |", "|---|---|---|"]
    lines += [f"| {s['model']} | {s.get('identical')} | {s.get('max_abs_diff')} |" for s in report["selftest"]]
    lines += ["", "| parity: model | mode | identical to off | first difference | acceptance | sampling | draft sampling "
              "| state checkpoints | host µs/round |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['mode']} | {r['identical']} | {r['first_difference']} | {r['acceptance']} | "
              f"{r['sampling']} | {r['draft_sampling']} | {r['state_checkpoints']} | {r['host_us_per_round']} |"
              for r in rows]
    lines += ["", "| paired: model | arms | decode tok/s | ratio | host µs/round | same output |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {p['model']} | {' vs '.join(p['arms'])} | {p['decode_tok_s']} | {p['ratio']} | {p['host_us_per_round']} "
              f"| {p['same_output']} |" for p in report["paired"]]
    lines += ["", "| vs llama.cpp: model | graph reuse | Power off / suffix tok/s | parity | llama-completion tok/s "
              "| best n-gram peer (tok/s) | suffix / best peer | peers' text = off |", "|---|---|---|---|---|---|---|---|"]
    for v in report["versus_llama_cpp"]:
        best = v["best_peer_ngram"]
        lines.append(f"| {v['model']} | {'on' if v['graph_reuse'] else 'off'} | {v['power_tok_s'].get('off')} / "
                     f"{v['power_tok_s'].get('suffix')} | {v['parity']} | {v['peer_tok_s'].get('llama-completion')} | "
                     f"{best} ({v['peer_tok_s'].get(best) if best else None}) | {v['suffix_vs_best_peer_ngram']} | "
                     f"{v['peer_same_text']} |")
    lines += ["", f"steps (s): {report['steps']}; build: {args.build_seconds} s"]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    identical = all(r["identical"] for r in rows) and all(all(v["parity"].values()) for v in report["versus_llama_cpp"])
    return 0 if identical or not args.cpu else 1


if __name__ == "__main__":
    os.environ.setdefault("POWER_LOG", "warning")
    raise SystemExit(main())
