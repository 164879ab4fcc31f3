"""dump.py MODEL OUT.npy: exact logits of a 700-token prompt (two chunks, all rows) + 8 one-token steps + an 8-token pass"""
import sys, hashlib
import numpy as np
from power_native import _llama
from power_native.target import open_target
_llama.set_log_level("error")
t = open_target(sys.argv[1], n_ctx=2048, max_block=16, snapshots=1, n_threads=2, numerics="exact")
ctx = _llama.Context(t.model, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2, n_outputs_max=512)
toks = np.random.default_rng(1).integers(1, min(t.model.n_vocab, 30000), size=720).astype(np.int32)
outs = []
ctx.decode(toks[:512], 0, all_outputs=True); outs.append(np.array(ctx.logits()))
ctx.decode(toks[512:700], 512, all_outputs=True); outs.append(np.array(ctx.logits()))
for i in range(700, 708):
    ctx.decode(toks[i:i+1], i, all_outputs=True); outs.append(np.array(ctx.logits()))
ctx.seq_rm(0, 700)
ctx.decode(toks[700:708], 700, all_outputs=True); outs.append(np.array(ctx.logits()))
a = np.concatenate([o.reshape(-1) for o in outs])
np.save(sys.argv[2], a)
# batch invariance inside this build: the 8-token pass rows == the one-token rows
one = np.stack([o.reshape(-1) for o in outs[2:10]]); eight = outs[10].reshape(8, -1)
print(sys.argv[1].split('/')[-1], hashlib.sha256(a.tobytes()).hexdigest()[:16], "8 == 1x8:", np.array_equal(one, eight))
