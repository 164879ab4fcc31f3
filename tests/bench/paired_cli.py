"""Paired, interleaved runs of the ``power`` CLI, a fresh process each: shared by the device check
(``tests/gpu/run.py``) and ``bench_sampling``. The order of the arms alternates from run to run, so
drift on a shared machine hits every arm alike; figures are medians and the median of the per-run
ratios."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPT = REPO / "docs" / "examples" / "code-edit.txt"


def power(*args: str, check: bool = True) -> tuple[dict, float]:
    """``power ARGS --json`` in a fresh process: its JSON and wall seconds."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "power_core.cli", *args, "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if check and proc.returncode not in (0, 3):  # selftest: 3 = rows differ, a finding, not a failure
        raise SystemExit(f"power {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return (json.loads(proc.stdout) if proc.stdout.strip() else {"error": proc.stderr[-2000:]}), wall


def paired(model: str, arms: dict[str, list[str]], runs: int, offload: list[str], *, tokens: int = 128,
           prompt: Path = PROMPT) -> dict:
    """``power run`` of each arm ``runs`` times, interleaved: decode tok/s and host µs per round (medians),
    the second arm over the first (median of the per-run ratios, and of the medians), and whether every
    run of every arm emitted the same tokens. Each arm's receipt also says which sampling path ran."""
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    hosts: dict[str, list[float]] = {arm: [] for arm in arms}
    digests: dict[str, set[str]] = {arm: set() for arm in arms}
    paths: dict[str, set[str]] = {arm: set() for arm in arms}
    names = list(arms)
    for r in range(runs):
        for arm in names if r % 2 == 0 else names[::-1]:
            got, _ = power("run", "--model", model, "--prompt-file", str(prompt), "--max-tokens", str(tokens), *offload,
                           *arms[arm])
            receipt = got["receipt"]
            rates[arm].append(receipt["timings"]["decode_tok_s"])
            hosts[arm].append(receipt["timings"].get("host_us_per_round", float("nan")))
            digests[arm].add(receipt["output_sha256"])
            paths[arm].add(f"{receipt['backend'].get('sampling')}/{receipt['backend'].get('draft_sampling')}")
    med = {arm: round(statistics.median(v), 1) for arm, v in rates.items()}
    a, b = names[0], names[1]
    return {"model": Path(model).name, "arms": arms, "runs": runs, "decode_tok_s": med,
            "ratio": round(statistics.median(y / x for x, y in zip(rates[a], rates[b], strict=True)), 3),
            "ratio_of_medians": round(med[b] / med[a], 3),
            "host_us_per_round": {arm: round(statistics.median(v), 1) for arm, v in hosts.items()},
            "sampling": {arm: sorted(v) for arm, v in paths.items()},
            "same_output": len(set().union(*digests.values())) == 1, "raw_tok_s": rates}
