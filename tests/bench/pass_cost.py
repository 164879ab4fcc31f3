"""The cost of one target pass of n tokens relative to one token, on one model and numerics
(docs/evidence/bench-engine.md): median of 7 timed passes after a warm-up, at a context position of
200, each pass rolled back before the next. One process per numerics (the switch is process-wide).

    python tests/bench/pass_cost.py exact|stock [MODEL]     # MODEL: default the embedded SmolLM2
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from power_core import PowerConfig, Session


def main() -> int:
    numerics, model = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    # a speculative mode, so the target's batch holds a 16-token block in one pass (target-only: 1)
    cfg = PowerConfig(spec_mode="suffix", numerics=numerics, n_threads=2, n_ctx=1024, spec_draft_max=15)
    with Session.open(cfg, model=model) as s:
        target = s.opened.target
        rng = np.random.default_rng(0)
        target.reset()
        target.prefill(rng.integers(0, 1000, 200).astype(np.int32))
        ms = {}
        for n in (1, 2, 4, 8):
            block = rng.integers(0, 1000, n).astype(np.int32)
            times = []
            for _ in range(8):
                cp = target.checkpoint()
                t0 = time.perf_counter()
                target.decode(block)
                times.append(time.perf_counter() - t0)
                target.restore(cp)
            ms[n] = statistics.median(times[1:]) * 1000
    print(numerics, model or "smollm2", {n: round(v, 2) for n, v in ms.items()},
          "relative", {n: round(v / ms[1], 2) for n, v in ms.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
