"""The verify-cost curve the scheduler sizes drafts by: measured so that another process's load cannot
poison it. A curve taken width by width on a busy machine once said a 2-token pass cost 5.8 one-token
passes; cached, it made a server never draft. Here a stand-in target's passes cost what a clock says, with
bursts of load injected."""

from __future__ import annotations

import types

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

from power_native import backend  # noqa: E402

pytestmark = pytest.mark.native


class Clocked:
    """A target whose b-token pass costs ``cost(b)`` seconds on a fake clock, plus ``burst`` seconds on each
    pass whose number (counted from 0) is in ``slow``."""

    def __init__(self, max_block: int, cost, slow=frozenset(), burst: float = 0.05) -> None:
        self.capabilities = types.SimpleNamespace(max_block=max_block, digest="f" * 64, n_ctx=4096, n_vocab=1000,
                                                  verify_capacity=0)
        self.numerics = "exact"
        self.now = 0.0
        self.passes = 0
        self.cost, self.slow, self.burst = cost, slow, burst

    def clock(self) -> float:
        return self.now

    def decode(self, block: np.ndarray) -> None:
        self.now += self.cost(block.size) + (self.burst if self.passes in self.slow else 0.0)
        self.passes += 1

    def reset(self) -> None: ...

    def prefill(self, tokens: np.ndarray) -> None: ...

    def checkpoint(self) -> None: ...

    def restore(self, cp: None) -> None: ...


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("POWER_NATIVE_CACHE", str(tmp_path))
    monkeypatch.delenv("POWER_VERIFY_COST_REFRESH", raising=False)

    def make(*args, **kwargs) -> Clocked:
        target = Clocked(*args, **kwargs)
        monkeypatch.setattr(backend.time, "perf_counter", target.clock)
        return target

    return make


def test_a_burst_of_load_during_the_measurement_does_not_reach_the_curve(fake):
    # 1 ms a token: a b-token pass costs b/4 ms more than a one-token pass; the load hits one pass of each
    # width in the first timed round (passes 8..15 of 4 rounds x 8 widths), as a burst would
    cost = lambda b: 0.001 + 0.00025 * (b - 1)  # noqa: E731
    target = fake(8, cost, slow=frozenset(range(8, 16)))
    curve = backend.verify_cost_curve(target, n_threads=2, reps=3)
    assert curve == pytest.approx([cost(b) / cost(1) for b in range(1, 9)])
    assert target.passes == 4 * 8  # a warm-up round and 3 timed rounds, every width in each


def test_widths_take_their_turns_so_a_long_burst_meets_them_alike(fake):
    # the load lasts two whole rounds: each width still has a quiet round
    cost = lambda b: 0.001 * b ** 0.5  # noqa: E731
    target = fake(4, cost, slow=frozenset(range(4, 12)))
    assert backend.verify_cost_curve(target, n_threads=2, reps=3) == pytest.approx([cost(b) / cost(1)
                                                                                  for b in range(1, 5)])


def test_a_width_is_held_to_what_a_pass_of_that_many_tokens_can_cost(fake):
    # a width dearer than that many one-token passes is held to that many
    cost = {1: 0.001, 2: 0.0012, 3: 0.009}.__getitem__
    assert backend.verify_cost_curve(fake(3, cost), n_threads=2, reps=3) == pytest.approx([1.0, 1.2, 3.0])
    # the one-token pass slow in every timed round (passes 3, 6, 9): no width reads cheaper than one token
    target = fake(3, cost, slow=frozenset({3, 6, 9}), burst=0.004)
    assert backend.verify_cost_curve(target, n_threads=3, reps=3) == pytest.approx([1.0, 1.0, 1.8])


def test_the_curve_is_cached_and_refreshed_on_request(fake, monkeypatch):
    cost = lambda b: 0.001 * b  # noqa: E731
    first = fake(4, cost)
    backend.verify_cost_curve(first, n_threads=2)
    again = fake(4, lambda b: 0.002)
    assert backend.verify_cost_curve(again, n_threads=2) == pytest.approx([1, 2, 3, 4])
    assert again.passes == 0
    monkeypatch.setenv("POWER_VERIFY_COST_REFRESH", "1")
    assert backend.verify_cost_curve(again, n_threads=2) == pytest.approx([1, 1, 1, 1])
