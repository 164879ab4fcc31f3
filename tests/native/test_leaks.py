"""200 load/generate/free cycles of a tiny model grow RSS by less than 16 MiB."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

from native_helpers import greedy_reference  # noqa: E402
from power_native.target import open_target  # noqa: E402

pytestmark = [pytest.mark.native, pytest.mark.slow]


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _cycle(path) -> None:
    t = open_target(path, n_ctx=256, max_block=5, snapshots=4, n_threads=2)
    greedy_reference(t, np.array([1, 2, 3], dtype=np.int32), 8)
    t.checkpoint()
    t.close()
    del t


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_no_leak_over_200_cycles(tiny_qwen35):
    for _ in range(10):  # warm-up: allocator arenas, lazy init
        _cycle(tiny_qwen35)
    gc.collect()
    before = _rss()
    for _ in range(200):
        _cycle(tiny_qwen35)
    gc.collect()
    grown = _rss() - before
    assert grown < 16 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 200 cycles"
