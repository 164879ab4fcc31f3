"""A request's end in the server's metrics (``power_core.serve.jobs._round_metrics``) for synthetic rounds, the
median of 300 calls: ``python metrics_end.py REPO`` (REPO's power_core is the one measured)."""

import random
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])
from power_core.rounds import RoundRecord  # noqa: E402
from power_core.serve.jobs import Metrics, _round_metrics  # noqa: E402


class Txn:
    rounds: list[RoundRecord] = []


class Gen:  # what _round_metrics reads of a generation
    first_commit_at = None
    txn = Txn


class Job:
    arrived = 0.0


metrics = Metrics()
for n, acc in ((192, 0), (24, 7), (48, 3)):
    Txn.rounds = [RoundRecord(index=i, planned=7, reason="static", proposed=7, accepted=acc, emitted=acc + 1,
                              replayed=False, shape=8, stop=None, seconds=random.uniform(0.001, 0.004),
                              stats={"draft_passes": 7.0}) for i in range(n)]
    spans = []
    for _ in range(300):
        t = time.perf_counter_ns()
        _round_metrics(metrics, Job, Gen)  # type: ignore[arg-type]
        spans.append(time.perf_counter_ns() - t)
    print(f"{n} rounds, {acc} accepted a round: {statistics.median(spans) / 1e3:.1f} us")
