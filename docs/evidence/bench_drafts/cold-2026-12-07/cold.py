"""Why a round's host work costs several times what the same calls cost in a loop: the caches are cold
after every llama.cpp pass. Three calls a round makes, timed (a) inside the shared passes' driver, as the
round makes them (a wrapper around each call, bench_drafts' MTP fixture, one request at a time), (b) in a loop
with nothing between the calls (warm), (c) in a loop, each call after a sweep of a 16 MiB buffer (as a
target pass sweeps the caches with its weights and KV). Medians, µs. Run from the repository root:

    python docs/evidence/bench_drafts/cold-2026-12-07/cold.py [REQUESTS]
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [".", "tests/native", "tests/bench"]
import power_native.target as target_module  # noqa: E402
from bench_drafts import _fixtures  # noqa: E402

import power_core.transaction as txn_module  # noqa: E402
from power_core.session import Session  # noqa: E402

n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
inside: dict[str, list[float]] = {"target checkpoint": [], "argmax of the verify rows": [], "sampler.greedy": []}
checkpoint, accept = target_module.LlamaTarget.checkpoint, txn_module.Transaction._accept
rows: list[np.ndarray] = []
samplers: list[object] = []


def timed_checkpoint(self):
    t0 = time.perf_counter_ns()
    try:
        return checkpoint(self)
    finally:
        inside["target checkpoint"].append((time.perf_counter_ns() - t0) / 1e3)


def timed_accept(self, props, res):  # the two reads _accept makes first, timed as it makes them
    k = props.shape[0] + 1
    t0 = time.perf_counter_ns()
    res.logits[:k].argmax(axis=1)
    t1 = time.perf_counter_ns()
    self.sampler.greedy  # noqa: B018
    t2 = time.perf_counter_ns()
    inside["argmax of the verify rows"].append((t1 - t0) / 1e3)
    inside["sampler.greedy"].append((t2 - t1) / 1e3)
    if not rows:
        rows.append(np.array(res.logits[:k]))
        samplers.append(self.sampler)
    return accept(self, props, res)


target_module.LlamaTarget.checkpoint = timed_checkpoint
txn_module.Transaction._accept = timed_accept
target, _ = _fixtures("mtp", Path("/tmp/pd"))
with Session.open_engine(1, model=str(target), spec_mode="mtp", n_threads=2, n_ctx=512, spec_draft_max=7) as eng:
    sess = eng.sessions[0]
    sess.generate([1, 2, 3, 4], max_tokens=192)
    for v in inside.values():
        v.clear()
    for i in range(n):
        sess.generate([1, 2, 3, 5 + i], max_tokens=192)
    tgt = sess.opened.target
    target_module.LlamaTarget.checkpoint = checkpoint
    junk = np.zeros(16 << 20, dtype=np.uint8)
    calls = {"target checkpoint": tgt.checkpoint, "argmax of the verify rows": lambda: rows[0].argmax(axis=1),
             "sampler.greedy": lambda: samplers[0].greedy}

    def loop(fn, sweep: bool) -> float:
        xs = []
        for _ in range(400):
            if sweep:
                np.add(junk, 1, out=junk)
            t0 = time.perf_counter_ns()
            fn()
            xs.append((time.perf_counter_ns() - t0) / 1e3)
        return statistics.median(xs)

    print("| call | in the driver's round | in a loop, warm | in a loop, after a 16 MiB sweep |\n|---|---|---|---|")
    for name, fn in calls.items():
        print(f"| {name} | {statistics.median(inside[name]):.1f} | {loop(fn, False):.1f} | {loop(fn, True):.1f} |")
