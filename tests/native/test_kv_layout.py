"""The shared cache of a batch (one KV cache for every sequence, so a pass is one ubatch): with
batch-invariant kernels the patched llama.cpp keeps each sequence's cells in position order, so its
rows stay its solo rows through rollbacks among the others' cells; a pass that finds no slot
compacts the cache and runs, its rows unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("power_native._llama")

from native_helpers import rollback_rows_differ  # noqa: E402
from power_native import _llama  # noqa: E402
from power_native.target import open_target  # noqa: E402

from power_core import PowerConfig, Session  # noqa: E402
from power_core.runtime import BatchItem  # noqa: E402

pytestmark = pytest.mark.native


def _solo(runtime) -> _llama.Context:
    return _llama.Context(runtime.model, n_ctx=1024, n_threads=2, n_batch=512, n_ubatch=512, n_outputs_max=512)


@pytest.mark.parametrize("fixture", ["tiny_llama", "smollm2"])
def test_rows_stay_solo_rows_through_rollbacks_in_the_shared_cache(request, fixture):
    model = None if fixture == "smollm2" else str(request.getfixturevalue(fixture))
    cfg = PowerConfig(spec_mode="off", n_threads=2, n_ctx=1024)
    with Session.open_batch(3, cfg, model=model) as batch:
        assert batch.sessions[0].opened.backend_info["kv_unified"] is True
        solo = _solo(batch.runtime)
        try:
            for t in batch.runtime.sequences:
                t.reset()
            assert rollback_rows_differ(batch.runtime.ctx, solo) == [None, None, None]
        finally:
            solo.close()


def test_a_stock_cache_shared_the_same_way_reorders_cells_and_rows_differ(tiny_llama):
    """The check above can fail: without batch-invariant kernels the patch is off, freed cells are
    reused wherever llama.cpp finds them, and rows stop being solo rows."""
    cfg = PowerConfig(spec_mode="off", n_threads=2, n_ctx=1024, numerics="stock")
    with Session.open_batch(3, cfg, model=str(tiny_llama)) as batch:
        solo = _solo(batch.runtime)
        try:
            for t in batch.runtime.sequences:
                t.reset()
            differ = rollback_rows_differ(batch.runtime.ctx, solo)
        finally:
            solo.close()
    # sequences 0 and 2 get cells that sequence 1 freed, before their own last ones
    assert differ[0] is not None and differ[2] is not None


class _NoSlotOnce:
    """A context whose next ``decode_seqs`` (the shared pass) finds no memory slot (as a fragmented shared
    cache does)."""

    def __init__(self, ctx) -> None:
        self.ctx, self.armed = ctx, True

    def __getattr__(self, name):
        return getattr(self.ctx, name)

    def decode_seqs(self, *args):
        if self.armed:
            self.armed = False
            raise _llama.NoMemorySlot("llama_decode: no memory slot for the batch (rc=1)")
        return self.ctx.decode_seqs(*args)


@pytest.mark.parametrize(("fixture", "n_ctx", "lengths"), [
    ("tiny_llama", 256, (40, 17, 29)),
    # Gemma-3's sliding-window layers (n_swa = 512): saving a sequence's state leaves out the cells
    # outside its window, so the restored cache holds fewer cells there than before
    ("gemma3-270m", 1024, (600, 17, 530)),
])
def test_a_pass_without_a_slot_compacts_the_cache_and_its_rows_are_unchanged(request, fixture, n_ctx, lengths):
    model = str(request.getfixturevalue(fixture)) if fixture == "tiny_llama" else fixture
    cfg = PowerConfig(spec_mode="off", n_threads=2, n_ctx=n_ctx)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 100, n).astype(np.int32) for n in lengths]
    blocks = [rng.integers(0, 100, n).astype(np.int32) for n in (5, 1, 8)]

    def run(fail: bool) -> tuple[list[np.ndarray], int]:
        with Session.open_batch(3, cfg, model=model) as batch:
            rt = batch.runtime
            seqs = rt.sequences
            for lo in range(0, max(lengths), 128):  # prompt chunks within a pass's token budget
                rt.decode_batch([BatchItem(t, p[lo:lo + 128], "last") for t, p in zip(seqs, prompts, strict=True)
                                 if p.shape[0] > lo])
            # sequence 1 leaves cells behind among the others' (a rejected block)
            cp = seqs[1].checkpoint()
            rt.decode_batch([BatchItem(seqs[1], blocks[2], "all")])
            seqs[1].rollback(cp, 2)
            if fail:
                rt.ctx = _NoSlotOnce(rt.ctx)
            res = rt.decode_batch([BatchItem(t, b, "all") for t, b in zip(seqs, blocks, strict=True)])
            return [np.array(r.logits) for r in res], rt.compactions

    want, none = run(False)
    got, compactions = run(True)
    assert none == 0 and compactions == 1
    for a, b in zip(want, got, strict=True):
        assert np.array_equal(a, b)



@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_schedules_on_the_shared_cache_keep_every_row_a_solo_row(tiny_llama, seed):
    """Three sequences of a 64-token share each grow by blocks in shuffled batch order, keep a random
    prefix of each block (a rejection), and end and start again at random, for 40 passes: every row
    of every pass equals the row of that sequence's history decoded alone (and any pass that finds no
    slot compacts on the way). With stock numerics the same schedules give other rows in most passes
    (70-96 of them per schedule, checked by hand). The cache holds each request's context times the
    sequences, and none of these schedules has needed a compaction (nor 120 longer ones tried by
    hand): the injected tests above cover that path."""
    n_ctx = 64
    rng = np.random.default_rng(seed)
    with Session.open_batch(3, PowerConfig(spec_mode="off", n_threads=2, n_ctx=n_ctx), model=str(tiny_llama)) as batch:
        rt = batch.runtime
        history: dict[int, list[int]] = {t.seq_id: [] for t in rt.sequences}
        solo = _solo(rt)
        try:
            for _ in range(40):
                items = []
                for t in rt.sequences:
                    n = int(rng.integers(1, 9)) if t.n_past else int(rng.integers(1, 33))
                    if rng.random() < 0.1 or t.n_past + n > n_ctx:  # its request ends; the next one starts
                        t.reset()
                        history[t.seq_id] = []
                        continue
                    items.append(BatchItem(t, rng.integers(0, 100, n).astype(np.int32), "all"))
                rng.shuffle(items)
                if not items:
                    continue
                checkpoints = [(item.target.checkpoint(), item) for item in items]
                results = rt.decode_batch(items)
                for (cp, item), res in zip(checkpoints, results, strict=True):
                    t, block = item.target, item.tokens
                    past = history[t.seq_id]
                    solo.clear(False)
                    if past:
                        solo.decode(np.array(past, dtype=np.int32), 0, all_outputs=False)
                    solo.decode(block, len(past))
                    assert np.array_equal(np.array(res.logits), np.array(solo.logits())), \
                        f"sequence {t.seq_id} at {len(past)}: its rows in the shared pass differ from its solo rows"
                    keep = int(rng.integers(1, block.shape[0] + 1))
                    t.rollback(cp, keep)
                    past.extend(int(x) for x in block[:keep])
        finally:
            solo.close()


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_restores_in_shared_passes_of_a_hybrid_target_keep_every_row_a_solo_row(tiny_qwen35, seed):
    """Three sequences of a hybrid target (a recurrent state each, journaled checkpoints: S = K) verify blocks
    in shared passes and keep a random prefix in place; now and then one's round fails after the pass and
    restores its checkpoint: it loads its last state copy and decodes the blocks it kept since alone on the
    shared context. Every row of every pass still equals that sequence's row on a context of its own that
    decoded only the kept blocks (and rolled back in place, llama.cpp's own)."""
    k = 4
    rng = np.random.default_rng(seed)
    cfg = PowerConfig(spec_mode="suffix", spec_draft_max=k, n_threads=2, n_ctx=256)
    with Session.open_batch(3, cfg, model=str(tiny_qwen35)) as batch:
        rt = batch.runtime
        assert all(t.journaled for t in rt.sequences)
        solo = {t.seq_id: open_target(tiny_qwen35, n_ctx=256, max_block=k + 1, snapshots=k, n_threads=2)
                for t in rt.sequences}
        restored = 0
        try:
            for t in rt.sequences:
                prompt = np.array([1 + t.seq_id, 7], dtype=np.int32)
                for target in (t, solo[t.seq_id]):
                    target.reset()
                    target.prefill(prompt)
            for _ in range(24):
                items = [BatchItem(t, rng.integers(0, 128, int(rng.integers(1, k + 2))).astype(np.int32), "all")
                         for t in rt.sequences]
                rng.shuffle(items)
                checkpoints = [item.target.checkpoint() for item in items]
                results = rt.decode_batch(items)
                rows = [np.array(res.logits) for res in results]  # read before any restore decodes
                for cp, item, got in zip(checkpoints, items, rows, strict=True):
                    t, block = item.target, item.tokens
                    if rng.random() < 0.2:  # the round failed after its pass: its block is gone
                        t.restore(cp)
                        restored += bool(cp.journal)
                        continue
                    alone = solo[t.seq_id]
                    alone_cp = alone.checkpoint()
                    assert np.array_equal(got, np.array(alone.decode(block).logits)), \
                        f"sequence {t.seq_id} at {t.n_past}: its rows differ from its solo rows"
                    keep = int(rng.integers(1, block.shape[0] + 1))
                    assert t.rollback(cp, keep) and alone.rollback(alone_cp, keep)
        finally:
            for target in solo.values():
                target.close()
    assert restored > 0


@pytest.mark.parametrize(("tokens", "pos", "seq", "out", "error", "says"), [
    ([1, 2], [0, 1], [0, 3], [1, 1], "ConfigError", "seq_id"),
    ([1, 2], [0, 1], [-1, 0], [1, 1], "ConfigError", "seq_id"),
    ([1, 2], [0, 5000], [0, 1], [1, 1], "CapacityError", "positions up to 5000"),
    ([1, 2], [-1, 0], [0, 1], [0, 1], "CapacityError", "overflow the context"),
    ([1, 100000], [0, 0], [0, 1], [1, 1], "CapacityError", "outside the vocabulary"),
    ([-2, 1], [0, 0], [0, 1], [1, 1], "CapacityError", "outside the vocabulary"),
    ([1, 2], [0, 0], [0, 1, 2], [1, 1], "ConfigError", "of one length"),
])
def test_a_multi_sequence_decode_checks_its_arrays_before_it_decodes(tiny_llama, tokens, pos, seq, out, error, says):
    from power_core import errors

    cfg = PowerConfig(spec_mode="off", n_threads=2, n_ctx=64)
    with Session.open_batch(2, cfg, model=str(tiny_llama)) as batch:
        ctx = batch.runtime.ctx
        with pytest.raises(getattr(errors, error), match=says):
            ctx.decode_multi(*(np.array(a, dtype=d) for a, d in zip(
                (tokens, pos, seq, out), (np.int32, np.int32, np.int32, np.uint8), strict=True)))
        # nothing was decoded: both sequences start at position 0
        rows = ctx.decode_multi(np.array([1, 2], dtype=np.int32), np.array([0, 0], dtype=np.int32),
                                np.array([0, 1], dtype=np.int32), np.array([1, 1], dtype=np.uint8))
        assert rows.shape[0] == 2


@pytest.mark.parametrize(("seqs", "error", "says"), [
    ([([1, 2], 0, 3, 2)], "ConfigError", "seq_id"),
    ([([1, 2], 0, -1, 2)], "ConfigError", "seq_id"),
    ([([1, 2], 4999, 0, 2)], "CapacityError", "positions up to 5000"),
    ([([1, 2], -1, 0, 1)], "CapacityError", "overflow the context"),
    ([([1, 2], 2**31 - 1, 0, 1)], "CapacityError", "overflow the context"),
    ([([1], 0, 0, 1), ([100000], 0, 1, 1)], "CapacityError", "outside the vocabulary"),
    ([([-2, 1], 0, 0, 1)], "CapacityError", "outside the vocabulary"),
    ([([1, 2], 0, 0, 3)], "ConfigError", "n_rows"),
    ([([], 0, 0, 0)], "CapacityError", "without tokens"),
    ([(np.array([1, 2], dtype=np.int64), 0, 0, 2)], "ConfigError", "int32"),
])
def test_the_shared_pass_checks_its_blocks_before_it_decodes(tiny_llama, seqs, error, says):
    """``Context.decode_seqs`` (the pass of ``LlamaBatch.decode_batch``) refuses a bad block with a typed error
    before anything is decoded, as ``decode_multi`` does."""
    from power_core import errors

    cfg = PowerConfig(spec_mode="off", n_threads=2, n_ctx=64)
    with Session.open_batch(2, cfg, model=str(tiny_llama)) as batch:
        ctx = batch.runtime.ctx
        given = [(t if isinstance(t, np.ndarray) else np.array(t, dtype=np.int32), p, q, k) for t, p, q, k in seqs]
        with pytest.raises(getattr(errors, error), match=says):
            ctx.decode_seqs(given)
        rows = ctx.decode_seqs([(np.array([1], dtype=np.int32), 0, 0, 1), (np.array([2], dtype=np.int32), 0, 1, 1)])
        assert rows.shape[0] == 2  # nothing was decoded: both sequences start at position 0


def test_the_shared_pass_is_the_multi_sequence_decode(tiny_llama):
    """``decode_seqs`` decodes what ``decode_multi`` decodes from position, sequence and output arrays: the same
    rows, bit for bit (each block's last ``n_rows`` tokens), in batch order."""
    cfg = PowerConfig(spec_mode="off", n_threads=2, n_ctx=64)
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, 100, 7).astype(np.int32), rng.integers(0, 100, 4).astype(np.int32)]
    got = []
    for how in ("seqs", "multi"):
        with Session.open_batch(2, cfg, model=str(tiny_llama)) as batch:
            ctx = batch.runtime.ctx
            if how == "seqs":
                rows = ctx.decode_seqs([(blocks[0], 0, 0, 7), (blocks[1], 0, 1, 1)])
            else:
                rows = ctx.decode_multi(np.concatenate(blocks), np.array([*range(7), *range(4)], dtype=np.int32),
                                        np.array([0] * 7 + [1] * 4, dtype=np.int32),
                                        np.array([1] * 7 + [0, 0, 0, 1], dtype=np.uint8))
            got.append(np.array(rows))
    assert got[0].shape == (8, got[0].shape[1]) and np.array_equal(got[0], got[1])


def test_a_pass_over_streams_per_sequence_is_one_ubatch_whatever_the_items_order(tiny_qwen35):
    """A hybrid target keeps a KV stream per sequence, and llama.cpp cuts such a pass into ubatches at
    every sequence id that is not the previous one + 1: items given last sequence first would run as
    four ubatches, a graph built for each. The batch puts them in id order, so passes of one shape
    reuse one graph; every item still gets its own rows, in the order asked."""
    cfg = PowerConfig(spec_mode="off", n_threads=2, n_ctx=128)
    rng = np.random.default_rng(7)
    with Session.open_batch(4, cfg, model=str(tiny_qwen35)) as batch:
        rt = batch.runtime
        # llama.cpp's own reuse (the previous pass's graph only), which counts ubatches: the graph cache
        # (test_graph_cache.py) would serve four ubatches a pass from its four kept graphs too
        rt.ctx.set_graph_cache(False)
        assert batch.sessions[0].opened.backend_info["kv_unified"] is False
        seqs = list(rt.sequences)
        in_order = [seqs[0], seqs[1], seqs[2], seqs[3]]
        blocks = [rng.integers(0, 100, (6, 8)).astype(np.int32) for _ in seqs]
        rows, reuses = [], []
        for order in (in_order, in_order[::-1]):
            for t in seqs:
                t.reset()
            reused = rt.ctx.graphs_reused
            got = []
            for step in range(6):
                res = rt.decode_batch([BatchItem(t, blocks[seqs.index(t)][step], "all") for t in order])
                got.append({t.seq_id: np.array(r.logits) for t, r in zip(order, res, strict=True)})
            reuses.append(rt.ctx.graphs_reused - reused)
            rows.append(got)
        # in order: the first passes after a reset build graphs (fresh recurrent states), then one graph
        # serves every pass; out of order the passes run the same ubatches, so as many reuse it
        assert reuses[0] >= 4 and reuses[1] == reuses[0], reuses
        for step in range(6):
            for t in seqs:
                assert np.array_equal(rows[0][step][t.seq_id], rows[1][step][t.seq_id]), (step, t.seq_id)
