"""The transaction's own host time a round: ``Transaction.step`` over a target and a proposer that do nothing (a
block of 8 accepted whole), medians of 30 requests of 400 rounds: ``python txn_alone.py``."""

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from power_core.config import PowerConfig
from power_core.runtime import DecodeResult, Proposal, ProposerCapabilities, TargetCapabilities
from power_core.sampling import TargetSampler
from power_core.scheduler import Scheduler
from power_core.transaction import Transaction

V, K, TOK = 128, 7, 5


class Target:
    def __init__(self):
        self._caps = TargetCapabilities(
            name="fake",
            n_vocab=V,
            n_ctx=1 << 20,
            max_block=64,
            rollback_window=None,
            eog_ids=frozenset(),
            features=frozenset(),
            compute_seconds=lambda: 0.0,
        )
        self._n = 0
        rows = np.zeros((K + 1, V), dtype=np.float32)
        rows[:, TOK] = 1.0
        self.rows = rows

    @property
    def capabilities(self):
        return self._caps

    @property
    def n_past(self):
        return self._n

    def reset(self):
        self._n = 0

    def prefill(self, tokens, observe=None):
        self._n += len(tokens)
        return self.rows[0]

    def decode(self, block):
        self._n += block.shape[0]
        return DecodeResult(tokens=block, logits=self.rows[: block.shape[0]], kind="verify")

    def checkpoint(self):
        return self._n

    def rollback(self, cp, keep):
        self._n = cp + keep
        return True

    def restore(self, cp):
        self._n = cp


class Proposer:
    capabilities = ProposerCapabilities()
    ids = np.full(K, TOK, dtype=np.int32)

    def begin(self, prompt):
        pass

    def checkpoint(self):
        return None

    def propose(self, ctx):
        return Proposal(self.ids[: ctx.k], stats={"draft_passes": float(K), "draft_batch": 1.0})

    def observe(self, res):
        pass

    def commit(self, n, emitted):
        pass

    def restore(self, cp):
        pass


cfg = PowerConfig()
per = []
for _ in range(30):
    t = Target()
    txn = Transaction(
        target=t,
        proposer=Proposer(),
        sampler=TargetSampler.from_config(cfg),
        scheduler=Scheduler.for_request(cfg, None, enabled=True, costs=None, k_session=K),
        max_tokens=8 * 400,
    )
    txn.prefill([1, 2, 3, TOK])
    txn.step()
    t0 = time.perf_counter_ns()
    n = 0
    while txn.finished is None:
        txn.step()
        n += 1
    per.append((time.perf_counter_ns() - t0) / n / 1e3)
print(
    f"transaction step over a fake target and proposer: {statistics.median(per):.2f} us a round (median of 30 requests of {n} rounds)"
)
