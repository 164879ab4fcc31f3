"""fa_share.py MODEL HIST ROUNDS: flash attention's cost against the GEMM's in one 512-token prompt chunk, exact
and stock, from `perf record` of abpre.py (same process, same chunk; the GEMM does the same work in both modes,
so fa/gemm compares the two attention kernels without the machine's between-process noise).
LD_PRELOAD passes through (a dev build of the same source)."""
import os, re, subprocess, sys
from pathlib import Path

model, hist, rounds = sys.argv[1], sys.argv[2], sys.argv[3]
here = Path(__file__).resolve().parent
for numerics in ("exact", "stock"):
    data = f"/tmp/fa_share_{numerics}.data"
    env = dict(os.environ, NUM=numerics, HIST=hist)
    run = subprocess.run(["perf", "record", "-q", "-o", data, sys.executable, str(here / "abpre.py"), model, "512",
                          rounds, ""], env=env, capture_output=True, text=True, check=True)
    rep = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "symbol"], capture_output=True,
                         text=True, check=True).stdout
    gemm = fa = 0.0
    for line in rep.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+\[\.\]\s+(\S+)", line)
        if not m:
            continue
        share, sym = float(m.group(1)), m.group(2)
        if sym.startswith("tiled_run_micro"):
            gemm += share
        if "flash_attn" in sym or sym.startswith("fa_bi") or "fp16_to_fp32" in sym or "simd_gemm" in sym:
            fa += share
    chunk = [l for l in run.stdout.splitlines() if "median" in l]
    print(f"HIST={hist} {numerics}: gemm {gemm:.1f}% attention {fa:.1f}% attention/gemm {fa / gemm:.3f}  "
          f"({chunk[-1].split('paired')[0].strip() if chunk else ''})")
