"""bench_native: Power on llama.cpp versus llama.cpp's own programs, paired and interleaved.

Three comparisons on the same model, prompt, token count and threads, each run ``--runs`` times with
the order alternating inside every pair (A,B then B,A) so drift on a shared machine hits both sides:

1. target-only decode tok/s: ``power run --mode off`` vs ``llama-completion`` (goal ratio ≥ 0.98); both
   rates include sampling (llama-completion's printed "eval" rate does not; it is reported as well);
2. the draft-model loop: ``power run --mode draft-model`` vs ``llama-speculative-simple
   --spec-type draft-simple`` with the same draft and K (goal ratio ≥ 1.0, identical tokens);
3. peak RSS of the whole process: Power target-only vs ``llama-completion`` (goal overhead ≤ 64 MiB).

Reports median/min/max of every figure and of the per-pair ratios; writes JSON evidence.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "native" / "tools"))
import build_llama  # noqa: E402

SAMPLING_RE = re.compile(r"sampling time =\s+([\d.]+) ms")
EVAL_RE = re.compile(r"eval time =\s+[\d.]+ ms /\s+(\d+) runs\s+\(\s*[\d.]+ ms per token,\s+([\d.]+) tokens per second\)")
SPEC_RE = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
ACCEPT_RE = re.compile(r"accept\s+=\s+([\d.]+)%")


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[str, str, int]:
    """Run a command; return stdout, stderr and its peak RSS in KiB (wait4 rusage)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        o, e = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {e[-2000:]}")
    return o, e, int(usage.ru_maxrss)


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def default_model() -> str:
    from power_native.models import smollm2_path  # the embedded default

    return str(smollm2_path())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-file", default=str(ROOT / "docs" / "examples" / "code-edit.txt"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "bench_native.json")
    args = ap.parse_args()
    model = args.model or default_model()
    prompt_file = Path(args.prompt_file)
    if not prompt_file.exists():
        prompt_file = Path(tempfile.mkstemp(suffix=".txt")[1])
        prompt_file.write_text("Rewrite this function so that it returns the sum instead of the product:\n"
                               "def f(xs):\n    r = 1\n    for x in xs:\n        r *= x\n    return r\n")
    bindir = build_llama.build_dir(False) / "bin"
    completion, speculative = bindir / "llama-completion", bindir / "llama-speculative-simple"
    if not completion.exists() or not speculative.exists():
        build_llama.build(peers=True)
    power = shutil.which("power") or sys.argv[0]
    common = ["-n", str(args.tokens), "-t", str(args.threads), "--temp", "0", "-c", "2048"]
    peer_completion = [str(completion), "-m", model, "-f", str(prompt_file), *common, "-no-cnv", "--top-k", "1"]
    peer_spec = [str(speculative), "-m", model, "-md", model, "--spec-type", "draft-simple", "--spec-draft-n-max",
                 str(args.k), "-f", str(prompt_file), *common, "--top-k", "1"]
    power_base = [power, "run", "--model", model, "--prompt-file", str(prompt_file), "--max-tokens", str(args.tokens),
                  "--threads", str(args.threads), "--n-ctx", "2048", "--json"]
    power_off = [*power_base, "--mode", "off"]
    power_draft = [*power_base, "--mode", "draft-model", "--draft", model, "--draft-max", str(args.k)]

    rows: dict[str, list[float]] = {k: [] for k in (
        "power_off_tok_s", "completion_tok_s", "ratio_off", "power_draft_tok_s", "spec_simple_tok_s", "ratio_draft",
        "power_off_rss_mib", "completion_rss_mib", "rss_overhead_mib", "power_draft_acceptance", "peer_acceptance",
        "completion_eval_only_tok_s")}
    identical = []
    for i in range(args.runs):
        order = [0, 1] if i % 2 == 0 else [1, 0]
        res: dict[int, Any] = {}
        for side in order:  # pair 1: target-only
            if side == 0:
                o, _, rss = run_measured(power_off)
                res[0] = (json.loads(o), rss)
            else:
                _, e, rss = run_measured(peer_completion)
                m, ms = EVAL_RE.search(e), SAMPLING_RE.search(e)
                assert m and ms, "llama-completion printed no eval/sampling timing"
                # like for like with Power's decode rate, which includes sampling: llama-completion's
                # "eval" rate excludes it (its sampling time covers runs + 1 samples)
                runs, eval_tok_s = int(m.group(1)), float(m.group(2))
                eval_s = runs / eval_tok_s
                sampling_s = float(ms.group(1)) / 1000 * runs / (runs + 1)
                res[1] = (runs / (eval_s + sampling_s), rss)
                rows["completion_eval_only_tok_s"].append(eval_tok_s)
        off, off_rss = res[0]
        tok_c, rss_c = res[1]
        t_off = off["receipt"]["timings"]["decode_tok_s"]
        rows["power_off_tok_s"].append(t_off)
        rows["completion_tok_s"].append(tok_c)
        rows["ratio_off"].append(t_off / tok_c)
        rows["power_off_rss_mib"].append(off_rss / 1024)
        rows["completion_rss_mib"].append(rss_c / 1024)
        rows["rss_overhead_mib"].append((off_rss - rss_c) / 1024)
        for side in order:  # pair 2: draft-model loop
            if side == 0:
                o, _, _ = run_measured(power_draft)
                res[2] = json.loads(o)
            else:
                _, e, _ = run_measured(peer_spec)
                m = SPEC_RE.search(e)
                assert m, "llama-speculative-simple printed no decode speed"
                a = ACCEPT_RE.search(e)
                res[3] = (float(m.group(3)), float(a.group(1)) / 100 if a else float("nan"))
        draft = res[2]
        t_draft = draft["receipt"]["timings"]["decode_tok_s"]
        rows["power_draft_tok_s"].append(t_draft)
        rows["spec_simple_tok_s"].append(res[3][0])
        rows["ratio_draft"].append(t_draft / res[3][0])
        rows["power_draft_acceptance"].append(draft["receipt"]["summary"]["acceptance"] or 0.0)
        rows["peer_acceptance"].append(res[3][1])
        identical.append(draft["tokens"] == off["tokens"])
        print(f"run {i + 1}/{args.runs}: off {t_off:.1f} vs completion {tok_c:.1f} tok/s "
              f"(x{t_off / tok_c:.3f}); draft-model {t_draft:.1f} vs spec-simple {res[3][0]:.1f} "
              f"(x{t_draft / res[3][0]:.3f}); RSS {off_rss / 1024:.0f} vs {rss_c / 1024:.0f} MiB", flush=True)
    summary = {k: stats(v) for k, v in rows.items()}
    evidence = {
        "bench": "native", "model": model, "prompt_file": str(prompt_file), "tokens": args.tokens,
        "threads": args.threads, "k": args.k, "runs": args.runs, "llama_cpp_commit": build_llama.LLAMA_CPP_COMMIT,
        "identical_tokens_draft_vs_off": identical, "summary": summary, "raw": rows,
        "goals": {"ratio_off_median>=0.98": summary["ratio_off"]["median"] >= 0.98,
                  "ratio_draft_median>=1.0": summary["ratio_draft"]["median"] >= 1.0,
                  "rss_overhead_median<=64MiB": summary["rss_overhead_mib"]["median"] <= 64},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(evidence, indent=2))
    for key in ("ratio_off", "ratio_draft", "rss_overhead_mib", "power_off_tok_s", "completion_tok_s",
                "completion_eval_only_tok_s", "power_draft_tok_s", "spec_simple_tok_s"):
        s = summary[key]
        print(f"{key:>20}: median {s['median']:.3f}  min {s['min']:.3f}  max {s['max']:.3f}")
    print(f"identical tokens (draft-model vs off): {all(identical)}; goals: {evidence['goals']}")
    print(f"evidence written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
