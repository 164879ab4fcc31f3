"""usage: abpre.py MODEL N ROUNDS 'ENV1' 'ENV2' : N-token prompt chunks alternating env variants in one process"""
import sys, os, time, statistics
import numpy as np
from power_native import _llama
from power_native.target import open_target
model, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
H = int(os.environ.get('HIST', '0'))
variants = sys.argv[4:]
_llama.set_log_level("error")
t = open_target(model, n_ctx=2048, max_block=16, snapshots=1, n_threads=2, numerics=os.environ.get("NUM", "exact"))
ctx = _llama.Context(t.model, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, n_outputs_max=16)
toks = np.random.default_rng(0).integers(1, min(t.model.n_vocab, 30000), size=n + H).astype(np.int32)
def setv(v):
    for k in ("EXP_A", "EXP_B", "EXP_C"): os.environ.pop(k, None)
    for kv in v.split():
        k, _, x = kv.partition("="); os.environ[k] = x
res = {v: [] for v in variants}
for i in range(0, H, 512): ctx.decode(toks[i:min(H, i + 512)], i, all_outputs=False)
for r in range(rounds):
    for v in (variants if r % 2 == 0 else variants[::-1]):
        setv(v)
        t0 = time.perf_counter(); ctx.decode(toks[H:], H, all_outputs=False); dt = time.perf_counter()-t0; ctx.seq_rm(0, H)
        if r: res[v].append(dt)
base = variants[0]
for v in variants:
    ratio = statistics.median(a / b for a, b in zip(res[base], res[v]))
    print(f"[{v}] median {1000*statistics.median(res[v]):.1f} ms  paired base/this {ratio:.3f}")
