"""usage: pass8.py MODEL WIDTH REPS [numerics] -> median ms of a WIDTH-token pass after 300 history"""
import sys, time, statistics
import numpy as np
from power_native import _llama
from power_native.target import open_target
model, w, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
num = sys.argv[4] if len(sys.argv) > 4 else "exact"
_llama.set_log_level("error")
t = open_target(model, n_ctx=2048, max_block=16, snapshots=1, n_threads=2, numerics=num)
ctx = _llama.Context(t.model, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, n_outputs_max=16)
toks = np.random.default_rng(0).integers(1, min(t.model.n_vocab, 30000), size=400).astype(np.int32)
ctx.decode(toks[:300], 0, all_outputs=False)
res = {}
for width in ([w] if w else [1, 8, 16]):
    ctx.decode(toks[300:300+width], 300, all_outputs=True); ctx.seq_rm(0, 300)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); ctx.decode(toks[300:300+width], 300, all_outputs=True); ts.append(time.perf_counter()-t0); ctx.seq_rm(0, 300)
    res[width] = 1000*statistics.median(ts)
print(num, " ".join(f"n{k}={v:.2f}" for k, v in res.items()))
ctx.close(); t.close()
