"""Four requests of 64 tokens in shared passes (``Session.open_engine(4)``, MTP, K=7) on a tiny hybrid qwen35 MTP
target with a large vocabulary (random weights, written once into OUT): per pass of two or more sequences, the
median over REPS of ms a pass (``SharedPasses._pass``), the target's compute a pass, and ``LlamaBatch.decode_batch``'s
own host time (its wall less the llama.cpp compute inside it), and a digest of the four outputs. The code under
test is whatever comes first on PYTHONPATH (power_core and power_native), so two checkouts run in turn pair:

    python bigvocab.py ARM REPS N_VOCAB OUT
"""
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[4]  # the repository root
sys.path[:0] = [str(HERE / "tests" / "native")]
import power_native.batch as nb
from native_helpers import make_tiny_mtp

import power_core
import power_core.passes as passes
from power_core.session import Session

arm, reps, nvocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = Path(sys.argv[4])
out.mkdir(parents=True, exist_ok=True)
name = f"qwen35-mtp-v{nvocab}"
target = out / f"tiny-{name}.gguf"
if not target.exists():
    target = make_tiny_mtp(out, "qwen35", n_vocab=nvocab, name=name)
print(arm, power_core.__file__, nb.__file__, file=sys.stderr)
acc = [0.0, 0]
f = passes.SharedPasses._pass
def timed(self, active):
    t = time.perf_counter()
    try: return f(self, active)
    finally:
        if len(active) > 1: acc[0] += time.perf_counter() - t; acc[1] += 1
passes.SharedPasses._pass = timed
db = [0.0, 0]
g = nb.LlamaBatch.decode_batch
def dtimed(self, items):
    t, c = time.perf_counter(), self.ctx.compute_ns
    try: return g(self, items)
    finally:
        if len(items) > 1: db[0] += time.perf_counter() - t - (self.ctx.compute_ns - c) * 1e-9; db[1] += 1
nb.LlamaBatch.decode_batch = dtimed
import hashlib

PROMPTS = [[1, 5, 9, 3, 7, 2, 8, 4], [17, 3, 99], [100, 3, 3, 3, 3, 64, 2, 90], [5] * 12]
with Session.open_engine(4, model=str(target), spec_mode="mtp", n_threads=2, n_ctx=512, spec_draft_max=7) as eng:
    eng.sessions[0].generate(PROMPTS[0], max_tokens=8)
    tctx = eng.sessions[0].opened.target.ctx
    walls = []
    for rep in range(reps):
        acc[:] = [0.0, 0]; db[:] = [0.0, 0]; c0 = tctx.compute_ns
        res = [None] * 4
        def go(j):
            res[j] = eng.sessions[j].generate(PROMPTS[j] + [rep + 1], max_tokens=64)
        ths = [threading.Thread(target=go, args=(j,)) for j in range(4)]
        for t in ths: t.start()
        for t in ths: t.join()
        n = acc[1] or 1
        walls.append((acc[0] / n * 1e3, (tctx.compute_ns - c0) * 1e-6 / n, db[0] / max(db[1], 1) * 1e3))
    toks = [r.tokens for r in res]
print(f"{arm}: ms/pass median {statistics.median(w for w, _, _ in walls):.3f} (target compute/pass {statistics.median(c for _, c, _ in walls):.3f}) decode_batch host ms/pass {statistics.median(d for _, _, d in walls):.3f} passes/rep {acc[1]} out {hashlib.sha256(str(toks).encode()).hexdigest()[:12]}")
