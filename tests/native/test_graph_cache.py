"""The graph cache (``Context.set_graph_cache``, patch 0015): a pass reuses any of the context's kept
compute graphs that fits it, not only the previous pass's, so passes of alternating shapes stop building
a graph each time. The same graph computes the same rows: everything here is compared bit for bit with the
same context running as llama.cpp does (the cache off)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("power_native._llama")

from power_native import _llama  # noqa: E402


def _run(ctx: _llama.Context, passes: list[tuple[int, bool]], on: bool) -> tuple[list[np.ndarray], int]:
    """Decode ``passes`` (width, every row an output or only the last) from an empty sequence with the
    cache ``on`` or off: each pass's rows, and how many passes reused a graph."""
    ctx.set_graph_cache(on)
    ctx.seq_rm(0, 0, -1)
    reused = ctx.graphs_reused
    rows, pos = [], 0
    for i, (width, every) in enumerate(passes):
        tokens = (np.arange(width, dtype=np.int32) * 7 + i) % 97 + 3
        ctx.decode(tokens, pos, 0, every)
        rows.append(np.array(ctx.logits()))
        pos += width
    return rows, ctx.graphs_reused - reused


QUANTS = ("Q4_0", "Q4_K_M", "Q6_K", "Q8_0", "IQ4_NL")


@pytest.fixture(scope="module")
def contexts(request, tiny_llama, tiny_qwen35, tmp_path_factory):
    """A context by name, made once: ``llama`` (attention only) and ``qwen35`` (hybrid, recurrent layers)
    in F32, or ``qwen35`` quantized to one of :data:`QUANTS` by the pinned ``llama-quantize``."""
    made: dict[str, _llama.Context] = {}

    def get(name: str) -> _llama.Context:
        if name not in made:
            path = {"llama": tiny_llama, "qwen35": tiny_qwen35}.get(name)
            if path is None:
                path = tmp_path_factory.mktemp("graph-cache") / f"qwen35-{name}.gguf"
                peer_bin = request.getfixturevalue("peer_bin")
                subprocess.run([str(peer_bin / "llama-quantize"), str(tiny_qwen35), str(path), name], check=True,
                               capture_output=True)
            made[name] = _llama.Context(_llama.Model.load(str(path)), n_ctx=1024, n_batch=16, n_threads=2)
        return made[name]

    yield get
    for ctx in made.values():
        ctx.close()


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_alternating_shapes_reuse_their_graphs_and_compute_the_same_rows(contexts, arch):
    """A draft's rhythm (a one-token pass, then a two-token one, over and over) builds a graph for every
    pass as llama.cpp does; with the cache every pass after the first few (one graph per shape, and the
    hybrid model's first pass on a fresh recurrent state) reuses one."""
    ctx = contexts(arch)
    passes = [(1 + i % 2, True) for i in range(24)]
    off, reused_off = _run(ctx, passes, on=False)
    on, reused_on = _run(ctx, passes, on=True)
    assert reused_off == 0 and reused_on >= len(passes) - 3, (reused_off, reused_on)
    assert all(np.array_equal(a, b) for a, b in zip(off, on, strict=True))


@pytest.mark.parametrize("arch", ["llama", "qwen35", *QUANTS])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(passes=st.lists(st.tuples(st.integers(1, 9), st.booleans()), min_size=1, max_size=14))
def test_any_mix_of_shapes_computes_the_rows_of_a_new_graph(contexts, arch, passes):
    """More shapes than the cache keeps (four) evict the least recently used; whatever graph a pass
    runs on, kept or new, its rows are the ones a graph built for it gives; on the quantized kernels too
    (a graph is kept per shape, and widths pick different kernels)."""
    ctx = contexts(arch)
    off, _ = _run(ctx, passes, on=False)
    on, _ = _run(ctx, passes, on=True)
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        assert np.array_equal(a, b), (i, passes)


def test_a_setting_that_changes_the_graph_is_never_served_a_kept_one(contexts):
    """Sampling in the graph (``set_greedy``) adds nodes to every graph; once it is switched off again
    no kept graph that samples may serve a pass (and none built before it while it is on)."""
    ctx = contexts("llama")
    passes = [(1 + i % 2, True) for i in range(6)]
    off, _ = _run(ctx, passes, on=False)
    ctx.set_graph_cache(True)
    ctx.seq_rm(0, 0, -1)
    pos, ids = 0, []
    for i, (width, _every) in enumerate(passes):
        tokens = (np.arange(width, dtype=np.int32) * 7 + i) % 97 + 3
        if i == 2:
            assert ctx.set_greedy(True)
        if i == 4:
            assert not ctx.set_greedy(False)
        ctx.decode(tokens, pos, 0, True)
        if 2 <= i < 4:
            ids.append(np.array(ctx.sampled_ids()))
        else:
            assert np.array_equal(np.array(ctx.logits()), off[i]), i
        pos += width
    assert [list(x) for x in ids] == [list(np.argmax(off[i], axis=1)) for i in (2, 3)]
