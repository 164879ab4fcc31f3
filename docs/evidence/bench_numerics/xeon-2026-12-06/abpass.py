"""usage: abpass.py MODEL WIDTH ROUNDS 'ENV1' 'ENV2' ... : passes alternating env variants in one process"""
import sys, os, time, statistics
import numpy as np
from power_native import _llama
from power_native.target import open_target
model, w, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
variants = sys.argv[4:]
_llama.set_log_level("error")
t = open_target(model, n_ctx=2048, max_block=16, snapshots=1, n_threads=2, numerics="exact")
ctx = _llama.Context(t.model, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, n_outputs_max=16)
toks = np.random.default_rng(0).integers(1, min(t.model.n_vocab, 30000), size=400).astype(np.int32)
ctx.decode(toks[:300], 0, all_outputs=False)
def setv(v):
    for k in ("EXP_PF", "EXP_MS", "EXP_A", "EXP_B"): os.environ.pop(k, None)
    for kv in v.split():
        k, _, x = kv.partition("="); os.environ[k] = x
res = {v: [] for v in variants}
for r in range(rounds):
    for v in (variants if r % 2 == 0 else variants[::-1]):
        setv(v)
        for _ in range(3):
            t0 = time.perf_counter(); ctx.decode(toks[300:300+w], 300, all_outputs=True); dt = time.perf_counter()-t0; ctx.seq_rm(0, 300)
            if r: res[v].append(dt)
base = variants[0]
for v in variants:
    ratio = statistics.median(a / b for a, b in zip(res[base], res[v]))
    print(f"[{v}] median {1000*statistics.median(res[v]):.2f} ms  paired base/this {ratio:.3f}")
