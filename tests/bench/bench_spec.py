"""bench_spec: Power's model-backed drafters against llama.cpp's own, paired and interleaved.

``--suite mtp``: ``power run --mode mtp`` vs ``llama-speculative-simple --spec-type draft-mtp`` on a
tiny qwen35 + MTP fixture (random head) and on the "predictable" fixture whose MTP head reproduces the
target's next-token map (acceptance ~100 %), plus Power ``--mode mtp`` vs Power ``--mode off`` there,
and the FR compact vocabulary: the MTP draft pass with ``spec_mtp_fr_vocab_size = N`` vs the full
head on a fixture with a large vocabulary.

``--suite dflash``: ``power run --mode dflash|dflash2|dspark`` vs ``llama-speculative-simple -md DRAFT
--spec-type draft-dflash|draft-dspark`` with the same draft, K and threads.

``--suite eagle3``: ``power run --mode eagle3`` vs ``llama-speculative-simple -md DRAFT --spec-type
draft-eagle3`` on the tiny qwen35 target with an EAGLE3 draft of its own embeddings (random weights) and
one that inherits the target's and taps its final hidden state.

Fixtures are written by the tests' helpers (random weights). Each pair runs ``--runs`` times with the
order alternating (A,B then B,A); figures are decode tok/s (llama.cpp's "decoded N tokens in T s"
vs the receipt's ``decode_tok_s``, both excluding the prompt), reported as median/min/max with the
per-pair ratios, and the tokens of every Power run are checked against Power ``--mode off``. Both
sides run the same kernels: the peer starts as ``power bench`` starts it for Power's numerics
(``power_core.bench.peer_env``: exact = ``GGML_CPU_BATCH_INVARIANT=1``).

Host time per round, both sides: Power's from its receipt (``timings.host_us_per_round``: decode time
minus the target's and the draft's time inside llama.cpp's decode calls); llama.cpp's from the same
span measured by ``compute_clock.c``, an ``LD_PRELOAD`` shim that times every ``llama_decode`` /
``llama_process`` call of ``llama-speculative-simple``: its decode window ("decoded N tokens in T s",
ending with its last call) minus the calls inside it, over its rounds (``n_predict - n_accept``: each
round emits its accepted drafts and one more).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT / "tests" / "native"))
sys.path.insert(0, str(ROOT / "native" / "tools"))
import build_llama  # noqa: E402
from bench_native import ACCEPT_RE, SPEC_RE, run_measured, stats  # noqa: E402
from host_clock import compute_clock  # noqa: E402

PROMPT = "hello world, this is a test prompt for the speculative decoding benchmark"


PEER_FAILURES: list[str] = []
COUNT_RE = re.compile(r"(n_predict|n_accept)\s+=\s+(\d+)")


def peer_host_us(trace: Path, n_tokens: int, tok_s: float, rounds: int) -> float:
    """llama.cpp's host µs per round: its decode window minus the decode calls inside it."""
    calls = [tuple(int(x) for x in line.split()[1:3]) for line in trace.read_text().splitlines()]
    end = max(start + dur for start, dur in calls)
    window = n_tokens / tok_s * 1e9  # "decoded N tokens in T s, speed: N/T t/s" (the rate has more digits)
    compute = sum(dur for start, dur in calls if start >= end - window)
    return (window - compute) / 1e3 / rounds


def peer_rate(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """The peer's decode rate, acceptance and host µs per round; a run that ends without its summary (seen
    rarely here: exit 0, log cut short) is recorded in the evidence and run again, once."""
    for _ in range(2):
        with tempfile.NamedTemporaryFile(suffix=".trace") as trace:
            _, err, _ = run_measured(cmd, env={**env, "POWER_COMPUTE_TRACE": trace.name})
            m = SPEC_RE.search(err)
            counts = {k: int(v) for k, v in COUNT_RE.findall(err)}
            if m and {"n_predict", "n_accept"} <= set(counts):
                a = ACCEPT_RE.search(err)
                rounds = counts["n_predict"] - counts["n_accept"]
                host = peer_host_us(Path(trace.name), int(m.group(1)), float(m.group(3)), rounds)
                return float(m.group(3)), (float(a.group(1)) / 100 if a else float("nan")), host
        PEER_FAILURES.append(err[-2000:])
    raise RuntimeError(f"llama-speculative-simple printed no decode speed twice: {err[-800:]}")


def power_json(cmd: list[str]) -> dict:
    out, _, _ = run_measured(cmd)
    return json.loads(out)


def paired(label: str, power_cmd: list[str], peer_cmd: list[str] | None, off_tokens: list[int], runs: int,
           other_cmd: list[str] | None = None, peer_env: dict[str, str] | None = None) -> dict:
    """``runs`` interleaved pairs of Power vs the peer (or vs ``other_cmd``, another Power run)."""
    rows: dict[str, list[float]] = {"power_tok_s": [], "peer_tok_s": [], "ratio": [], "power_acceptance": [],
                                    "peer_acceptance": [], "power_host_us_per_round": [], "peer_host_us_per_round": []}
    identical = []
    for i in range(runs):
        res = {}
        for side in ([0, 1] if i % 2 == 0 else [1, 0]):
            if side == 0:
                res[0] = power_json(power_cmd)
            elif peer_cmd is not None:
                res[1] = peer_rate(peer_cmd, peer_env or dict(os.environ))
            else:
                o = power_json(other_cmd)
                res[1] = (o["receipt"]["timings"]["decode_tok_s"], float("nan"),
                          o["receipt"]["timings"].get("host_us_per_round", float("nan")))
        p = res[0]
        t = p["receipt"]["timings"]["decode_tok_s"]
        host = p["receipt"]["timings"].get("host_us_per_round", float("nan"))
        rows["power_tok_s"].append(t)
        rows["peer_tok_s"].append(res[1][0])
        rows["ratio"].append(t / res[1][0])
        rows["power_acceptance"].append(p["receipt"]["summary"]["acceptance"] or 0.0)
        rows["peer_acceptance"].append(res[1][1])
        rows["power_host_us_per_round"].append(host)
        rows["peer_host_us_per_round"].append(res[1][2])
        identical.append(p["tokens"] == off_tokens)
        print(f"{label} run {i + 1}/{runs}: power {t:.1f} vs {'peer' if peer_cmd else 'off'} {res[1][0]:.1f} tok/s "
              f"(x{t / res[1][0]:.3f}); host us/round {host:.1f} vs {res[1][2]:.1f}", flush=True)
    summary = {k: stats([x for x in v if x == x]) if any(x == x for x in v) else None for k, v in rows.items()}
    # each side's fastest run: this machine's noise (other tenants) only ever slows a run down, so the best
    # runs are the least disturbed ones; reported beside the median of the paired ratios
    summary["best_ratio"] = max(rows["power_tok_s"]) / max(rows["peer_tok_s"])
    return {"summary": summary, "raw": rows, "identical_tokens_vs_off": identical}


def fr_pass_ratio(model: Path, n_fr: int, passes: int, threads: int) -> dict:
    """Per-pass time of the MTP draft with the full head vs the first ``n_fr`` rows (same process)."""
    from power_core import PowerConfig, Session

    out = {}
    for label, fr in (("full", None), ("fr", n_fr)):
        cfg = PowerConfig(spec_mode="mtp", spec_mtp_fr_vocab_size=fr, spec_draft_max=7, max_tokens=8, n_ctx=512,
                          n_threads=threads)
        with Session.open(cfg, model=str(model)) as s:
            s.generate([1, 2, 3, 4])  # warm: fills the MTP KV
            head = s.proposer.head
            times = []
            for _ in range(passes):
                t0 = time.perf_counter()
                head.draft(5, 7)
                times.append((time.perf_counter() - t0) / 7)
        out[label] = stats(times)
    out["ratio_fr_over_full"] = out["fr"]["median"] / out["full"]["median"]
    out["n_vocab"], out["n_fr"] = None, n_fr
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=("mtp", "dflash", "eagle3"), required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--numerics", choices=("exact", "stock"), default="exact",
                    help="Power's numerics; the peer runs the same kernels")
    ap.add_argument("--only", nargs="*", default=None, help="dflash suite: only these modes")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out_path = args.out or ROOT / "evidence" / f"bench_{args.suite}.json"
    bindir = build_llama.build_dir(False) / "bin"
    spec_exe = bindir / "llama-speculative-simple"
    if not spec_exe.exists():
        build_llama.build(peers=True)
    power = shutil.which("power") or "power"
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{args.suite}-"))
    from eagle3_helpers import make_tiny_eagle3
    from native_helpers import make_tiny, make_tiny_draft, make_tiny_mtp

    from power_core.bench import peer_env as numerics_env

    peer_env = numerics_env(args.numerics)
    peer_env["LD_PRELOAD"] = str(compute_clock(tmp))
    common_peer = ["-p", PROMPT, "-n", str(args.tokens), "--temp", "0", "--top-k", "1", "-c", "512",
                   "-t", str(args.threads), "--spec-draft-n-max", str(args.k)]

    def power_cmd(model: Path, mode: str, *extra: str) -> list[str]:
        return [power, "run", "--model", str(model), "--prompt", PROMPT, "--max-tokens", str(args.tokens),
                "--threads", str(args.threads), "--n-ctx", "512", "--json", "--numerics", args.numerics, "--mode", mode,
                *extra]

    def off_tokens(model: Path) -> list[int]:
        return power_json(power_cmd(model, "off"))["tokens"]

    results: dict = {}
    if args.suite == "mtp":
        random_head = make_tiny_mtp(tmp, "qwen35")
        predictable = make_tiny_mtp(tmp, "qwen35", predictable=True, name="qwen35-mtp-predictable")
        for name, model in (("random_head", random_head), ("predictable", predictable)):
            off = off_tokens(model)
            k = str(args.k)
            results[f"{name}_vs_llama"] = paired(
                f"mtp/{name}", power_cmd(model, "mtp", "--draft-max", k),
                [str(spec_exe), "-m", str(model), "--spec-type", "draft-mtp", *common_peer], off, args.runs,
                peer_env=peer_env)
        off = off_tokens(predictable)
        results["predictable_vs_off"] = paired("mtp-vs-off", power_cmd(predictable, "mtp", "--draft-max", str(args.k)),
                                               None, off, args.runs, other_cmd=power_cmd(predictable, "off"))
        big = make_tiny_mtp(tmp, "qwen35", name="qwen35-mtp-bigvocab", n_vocab=32768)
        fr = fr_pass_ratio(big, 1024, 200, args.threads)
        fr["n_vocab"] = 32768
        results["fr_vocab_pass_time"] = fr
        print(f"FR: MTP draft pass {fr['fr']['median'] * 1e3:.3f} ms (N=1024) vs {fr['full']['median'] * 1e3:.3f} ms "
              f"(full 32768): x{fr['ratio_fr_over_full']:.3f}")
    elif args.suite == "eagle3":
        target = make_tiny(tmp, "qwen35")
        off = off_tokens(target)
        for name, kw in (("own", dict(layers=(0, 1, 1))), ("final_tap", dict(layers=(0, 1, 2), borrow=True))):
            if args.only and name not in args.only:
                continue
            draft = make_tiny_eagle3(tmp, target, name=f"bench-eagle3-{name}", **kw)
            results[f"eagle3_{name}_vs_llama"] = paired(
                f"eagle3/{name}", power_cmd(target, "eagle3", "--draft", str(draft), "--draft-max", str(args.k)),
                [str(spec_exe), "-m", str(target), "-md", str(draft), "--spec-type", "draft-eagle3", *common_peer],
                off, args.runs, peer_env=peer_env)
    else:
        target = make_tiny(tmp, "qwen35")
        off = off_tokens(target)
        for mode, kw, spec_type in (("dflash", dict(kind="dflash"), "draft-dflash"),
                                    ("dflash2", dict(kind="dflash2"), "draft-dflash"),
                                    ("dspark", dict(kind="dspark", block_size=16), "draft-dspark")):
            if args.only and mode not in args.only:
                continue
            draft = make_tiny_draft(tmp, target, name=f"bench-{mode}", **kw)
            results[f"{mode}_vs_llama"] = paired(
                mode, power_cmd(target, mode, "--draft", str(draft), "--draft-max", str(args.k)),
                [str(spec_exe), "-m", str(target), "-md", str(draft), "--spec-type", spec_type, *common_peer],
                off, args.runs, peer_env=peer_env)
    evidence = {"bench": f"spec-{args.suite}", "tokens": args.tokens, "threads": args.threads, "k": args.k,
                "numerics": args.numerics,
                "runs": args.runs, "llama_cpp_commit": build_llama.LLAMA_CPP_COMMIT,
                "patches": [f"{n} sha256:{h}" for n, h in build_llama.patches()], "results": results,
                "peer_runs_without_summary": PEER_FAILURES,
                "goal": "ratio median >= 1.0 vs llama-speculative-simple, identical tokens; host us per round of both"}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(evidence, indent=2, default=float))
    for name, r in results.items():
        if "summary" in r:
            s = r["summary"]["ratio"]
            hp, hq = r["summary"]["power_host_us_per_round"], r["summary"]["peer_host_us_per_round"]
            print(f"{name:>28}: ratio median {s['median']:.3f} (min {s['min']:.3f}, max {s['max']:.3f}), "
                  f"best runs {r['summary']['best_ratio']:.3f}; "
                  f"power {r['summary']['power_tok_s']['median']:.1f} tok/s, identical {all(r['identical_tokens_vs_off'])}; "
                  f"host us/round {hp['median'] if hp else float('nan'):.1f} vs {hq['median'] if hq else float('nan'):.1f}")
    print(f"evidence written to {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
