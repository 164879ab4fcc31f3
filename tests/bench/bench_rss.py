"""bench_rss: resident memory of N sessions on one model in one process, sharing the loaded weights
(the default) vs loading them once per session (``POWER_NATIVE_SHARED_WEIGHTS=0``). Each case runs
in a fresh interpreter; every session serves one short request; VmRSS and VmHWM from
/proc/self/status. JSON evidence."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
from power_core.config import PowerConfig
from power_core.session import Session
from power_native.models import resolve_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024.0  # MiB

alias, n, numerics = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = str(resolve_model(alias))
base = status("VmRSS")
cfg = PowerConfig(spec_mode="off", max_tokens=8, n_ctx=2048, n_threads=2, numerics=numerics)
sessions = [Session.open(cfg, model=model) for _ in range(n)]
for s in sessions:
    s.generate("The capital of France is")
print(json.dumps({"rss_mib": status("VmRSS") - base, "hwm_mib": status("VmHWM") - base,
                  "distinct_models": len({id(s.opened.target.model) for s in sessions})}))
"""


def case(alias: str, n: int, shared: bool, numerics: str) -> dict:
    env = dict(os.environ, POWER_NATIVE_SHARED_WEIGHTS="1" if shared else "0")
    out = subprocess.run([sys.executable, "-c", CHILD, alias, str(n), numerics], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "bench_rss.json")
    args = ap.parse_args()
    res: dict[str, dict] = {}
    for alias in args.models.split(","):
        for numerics in ("exact", "stock"):
            shared = case(alias, args.sessions, True, numerics)
            private = case(alias, args.sessions, False, numerics)
            res[f"{alias}/{numerics}"] = {"shared": shared, "private": private,
                                          "ratio_rss": shared["rss_mib"] / private["rss_mib"]}
            print(f"{alias:>12} {numerics:>5}: {args.sessions} sessions share one model {shared['rss_mib']:.0f} MiB "
                  f"RSS vs {private['rss_mib']:.0f} MiB with {private['distinct_models']} loads "
                  f"({res[f'{alias}/{numerics}']['ratio_rss']:.2f}x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
