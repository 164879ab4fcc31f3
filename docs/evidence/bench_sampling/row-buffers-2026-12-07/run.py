"""End to end: seeded stochastic ``power run`` requests on Gemma-3-270M (262,144 tokens, from PyPI) with the
sampler (and logprobs) of 7b1cbb5 and today's, alternated request by request in one process on one session; per
side the median request wall and host µs a round (the receipt's), the texts required equal. Run from the
repository root of a git clone:

    python docs/evidence/bench_sampling/row-buffers-2026-12-07/run.py [MODE] [REQUESTS]
"""
import statistics
import subprocess
import sys
import time
import types

sys.path.insert(0, ".")
from power_native.models import gemma3_path  # noqa: E402

import power_core.rounds as rounds  # noqa: E402
import power_core.sampling as sampling  # noqa: E402
from power_core.session import Session  # noqa: E402

old = types.ModuleType("old_sampling")
exec(subprocess.run(["git", "show", "7b1cbb5:power_core/sampling.py"], capture_output=True, text=True, check=True).stdout,
     old.__dict__)
old_rounds = types.ModuleType("old_rounds")
exec(subprocess.run(["git", "show", "7b1cbb5:power_core/rounds.py"], capture_output=True, text=True, check=True).stdout,
     old_rounds.__dict__)
NEW = (sampling.TargetSampler.sample, sampling.TargetSampler._draw_from_all, rounds.TokenLogprob.from_row)
OLD = (old.TargetSampler.sample, old.TargetSampler._draw_from_all,
       classmethod(old_rounds.TokenLogprob.from_row.__func__))


def use(fns):
    sampling.TargetSampler.sample, sampling.TargetSampler._draw_from_all = fns[0], fns[1]
    rounds.TokenLogprob.from_row = fns[2]


mode = sys.argv[1] if len(sys.argv) > 1 else "suffix"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2
res = {"before": [], "after": []}
with Session.open(model=str(gemma3_path()), spec_mode=mode, n_threads=2, n_ctx=1024) as s:
    s.generate(prompt, max_tokens=16, sampling={"temperature": 0.8, "seed": 1})
    for i in range(n):
        texts = {}
        for side in (("before", "after") if i % 2 == 0 else ("after", "before")):
            use(OLD if side == "before" else NEW)
            t = time.perf_counter()
            r = s.start(prompt, max_tokens=96, sampling={"temperature": 0.8, "top_p": 0.95, "seed": 100 + i},
                        logprobs=5).run()
            w = time.perf_counter() - t
            texts[side] = r.text
            tm = r.receipt.to_dict()["timings"]
            res[side].append((w, tm["host_us_per_round"]))
        assert texts["before"] == texts["after"], i
for side, v in res.items():
    print(f"{mode} {side:6s}: wall median {statistics.median(x[0] for x in v) * 1e3:7.1f} ms, host µs a round median "
          f"{statistics.median(x[1] for x in v):7.1f}")
ratios = [a[0] / b[0] for a, b in zip(res["before"], res["after"], strict=True)]
print(f"paired wall before/after median {statistics.median(ratios):.3f} ({sum(r > 1 for r in ratios)}/{len(ratios)} "
      "pairs after faster); same texts in every pair")
