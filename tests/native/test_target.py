"""LlamaTarget on tiny synthetic models: decode, rollback through n_rs_seq, checkpoint + replay
(S < K), restore, and exact greedy parity of speculative vs autoregressive decoding."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

from native_helpers import FailingDecode, greedy_reference, oracle, speculative  # noqa: E402
from power_native.target import JOURNAL_ROUNDS, LlamaTarget, open_target  # noqa: E402

from power_core.errors import Cancelled, CapacityError, StateLost  # noqa: E402
from power_core.runtime import TargetRuntime  # noqa: E402

pytestmark = pytest.mark.native

PROMPT = np.array([1, 17, 42, 99, 5, 63, 8], dtype=np.int32)
N = 48


def _open(path, k: int, s: int, n_ctx: int = 256, device_states: bool | None = None) -> LlamaTarget:
    return open_target(path, n_ctx=n_ctx, max_block=k + 1, snapshots=s, n_threads=2, device_states=device_states)


def test_protocol_and_capabilities(tiny_llama, tiny_qwen35):
    att = _open(tiny_llama, 4, 4)
    rec = _open(tiny_qwen35, 4, 4)
    assert isinstance(att, TargetRuntime)
    assert att.capabilities.rollback_window is None
    assert rec.capabilities.rollback_window == 4 == rec.ctx.n_rs_seq
    assert att.capabilities.n_vocab == 128 and att.capabilities.max_block == 5


def test_decode_rows_match_sequential(tiny_model):
    t = _open(tiny_model, 4, 4)
    t.reset()
    block = t.decode(PROMPT[:5])
    rows = np.array(block.logits)
    assert rows.shape == (5, 128) and t.n_past == 5
    assert not block.logits.flags.writeable
    t.reset()
    seq = [np.array(t.decode(PROMPT[i:i + 1]).logits[0]) for i in range(5)]
    np.testing.assert_allclose(rows, np.stack(seq), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device_states", [None, True])
@pytest.mark.parametrize("k,s", [(4, 4), (4, 1), (6, 2)])
def test_speculative_parity(tiny_model, k, s, device_states):
    """Greedy speculative decoding with every acceptance depth equals one-token decoding; on the
    recurrent target also with its checkpoints kept in the context's backend buffers (``device_states``,
    what an offloaded target does; here the CPU backend's), whose restores the S < K runs exercise."""
    ref_t = _open(tiny_model, 0, 1)
    ref = greedy_reference(ref_t, PROMPT, N)
    t = _open(tiny_model, k, s, device_states=device_states)
    assert t.state_checkpoints == (None if t.capabilities.rollback_window is None
                                   else "device" if device_states else "host")
    run = speculative(t, PROMPT, N, k, oracle(ref, len(PROMPT), 128))
    assert run["tokens"] == ref
    assert 0 < run["accepted"] < run["proposed"]
    if t.capabilities.rollback_window is None:  # attention KV: always in place
        assert t.stats["rollback_restored"] == 0 and run["replays"] == 0
    elif s >= k:  # every depth fits the snapshot window
        assert t.stats["rollback_restored"] == 0 and t.stats["rollback_in_place"] > 0
    else:  # S < K: deep rollbacks restore the checkpoint and replay
        assert t.stats["rollback_restored"] > 0 and run["replays"] == t.stats["rollback_restored"]
        assert t.stats["rollback_in_place"] > 0


def test_recurrent_rollback_single_use_and_depth(tiny_qwen35):
    t = _open(tiny_qwen35, 4, 4)
    t.reset()
    t.prefill(PROMPT[:3])
    cp = t.checkpoint()
    t.decode(PROMPT[3:7])  # 4 tokens: window = min(4, 4 - 1) = 3
    assert t.rollback(cp, 1) is True  # depth 3 in place
    assert t.n_past == 4
    assert t.rollback(cp, 0) is False  # second rollback since that decode: restored
    assert t.n_past == 3
    cp2 = t.checkpoint()
    t.decode(PROMPT[3:7])
    assert t.rollback(cp2, 0) is False  # depth 4 > tokens_in_last_decode - 1


def test_restore_is_exact_and_repeatable(tiny_model):
    t = _open(tiny_model, 4, 4)
    t.reset()
    t.prefill(PROMPT[:4])
    cp = t.checkpoint()
    first = np.array(t.decode(PROMPT[4:7]).logits)
    for _ in range(3):
        t.restore(cp)
        assert t.n_past == 4
        again = np.array(t.decode(PROMPT[4:7]).logits)
        np.testing.assert_array_equal(first, again)
    t.reset()
    with pytest.raises(StateLost):
        t.restore(cp)


def test_recurrent_checkpoints_reuse_two_state_buffers(tiny_qwen35):
    """Where a round's rollback may not fit the snapshots (S < K), a recurrent target copies its state at every
    checkpoint into one of two buffers taken in turn (no allocation per round); a checkpoint whose buffer a newer
    one took raises StateLost, never restores another checkpoint's state."""
    t = _open(tiny_qwen35, 4, 3)
    assert not t.journaled
    t.reset()
    t.prefill(PROMPT[:3])
    cp1 = t.checkpoint()
    first = np.array(t.decode(PROMPT[3:5]).logits)
    cp2 = t.checkpoint()
    t.decode(PROMPT[5:6])
    assert isinstance(cp1.state, bytearray) and cp1.state is not cp2.state and len(cp1.state) > 0
    t.restore(cp1)  # the previous round's checkpoint is still whole
    assert t.n_past == 3
    np.testing.assert_array_equal(first, np.array(t.decode(PROMPT[3:5]).logits))
    cp3 = t.checkpoint()
    assert cp3.state is cp1.state  # cp1's buffer, reused
    t.decode(PROMPT[5:6])
    with pytest.raises(StateLost, match="superseded"):
        t.restore(cp1)
    t.restore(cp3)
    assert t.n_past == 5
    t.restore(cp2)  # still the owner of its buffer
    assert t.n_past == 5
    assert t.stats["state_copies"] == 3
    with pytest.raises(TypeError, match="bytes or bytearray"):
        t.ctx.state_set(memoryview(bytes(cp2.state)))


def test_journaled_checkpoints_copy_once_in_journal_rounds(tiny_qwen35):
    """Where every rollback fits the snapshots (S >= K), checkpoints share one copy of the state for
    JOURNAL_ROUNDS rounds and journal the blocks kept since; restoring one decodes them again, to the same rows.
    A checkpoint after blocks that a restore to an older one discarded raises StateLost."""
    t = _open(tiny_qwen35, 4, 4)
    assert t.journaled
    t.reset()
    t.prefill(PROMPT[:2])
    blocks = [np.array([(7 * i + j) % 128 for j in range(3)], dtype=np.int32) for i in range(JOURNAL_ROUNDS)]
    cps, rows = [], []
    for block in blocks:
        cps.append(t.checkpoint())
        rows.append(np.array(t.decode(block).logits))
        assert t.rollback(cps[-1], 2)  # keep two of three: in place
    assert t.stats["state_copies"] == 1 and {cp.ident for cp in cps} == {1}
    assert [cp.journal for cp in cps] == list(range(JOURNAL_ROUNDS))
    t.restore(cps[5])  # the copy, then five kept blocks decoded again
    assert t.n_past == cps[5].n_past == 2 + 2 * 5
    np.testing.assert_array_equal(rows[5], np.array(t.decode(blocks[5]).logits))
    with pytest.raises(StateLost, match="superseded"):
        t.restore(cps[7])  # its blocks 5 and 6 are gone
    t.restore(cps[2])
    np.testing.assert_array_equal(rows[2], np.array(t.decode(blocks[2]).logits))
    with pytest.raises(StateLost, match="superseded"):
        t.restore(cps[5])  # block 2 was decoded again: another block
    assert t.stats["state_copies"] == 1
    t.restore(cps[2])
    for block in blocks[2:]:
        t.checkpoint()
        t.decode(block[:1])
    assert t.checkpoint().ident == 2 and t.stats["state_copies"] == 2  # a full journal: a new copy


def test_a_restore_runs_whole_under_a_cancel(tiny_qwen35):
    """A cancel asked before or while a journaled checkpoint restores (the cancel is often why it restores) stops
    none of the restore's own decodes; it stops the next decode after it."""
    t = _open(tiny_qwen35, 4, 4)
    t.reset()
    t.prefill(PROMPT[:2])
    for i in range(3):
        t.checkpoint()
        t.decode(PROMPT[2 + i:3 + i])
    cp = t.checkpoint()
    assert cp.journal == 3
    rows = np.array(t.decode(PROMPT[5:7]).logits)
    t.cancel()
    t.restore(cp)  # the copy, then three blocks decoded again
    assert t.n_past == 5
    with pytest.raises(Cancelled):
        t.decode(PROMPT[5:7])
    t.restore(cp)
    np.testing.assert_array_equal(rows, np.array(t.decode(PROMPT[5:7]).logits))


@pytest.mark.parametrize("device_states", [None, True])
@pytest.mark.parametrize("k,s", [(4, 4), (6, 7), (4, 2)])
def test_restores_mid_request_are_exact(tiny_qwen35, k, s, device_states):
    """Rounds that fail after their verify pass, or in it after its graph wrote the state, restore their
    checkpoint and run again; the tokens stay those of one-token decoding. Journaled (S >= K) the restores decode
    the journal again and the target copies its state about once in JOURNAL_ROUNDS rounds; S < K every round."""
    ref = greedy_reference(_open(tiny_qwen35, 0, 1), PROMPT, N)
    t = _open(tiny_qwen35, k, s, device_states=device_states)
    t.ctx = FailingDecode(t.ctx)
    faults = {1: "after", 3: "during", 4: "after", 8: "during", 9: "after", 12: "during", 13: "during"}
    run = speculative(t, PROMPT, N, k, oracle(ref, len(PROMPT), 128), faults=faults)
    assert run["tokens"] == ref and run["restores"] == len(faults)
    assert t.stats["restores"] == len(faults) + t.stats["rollback_restored"]
    checkpoints = run["rounds"] + len(faults)
    if s >= k:
        assert t.journaled and t.stats["rollback_restored"] == 0
        assert t.stats["state_copies"] <= checkpoints // JOURNAL_ROUNDS + 2
    else:
        assert not t.journaled and t.stats["state_copies"] == checkpoints


def test_device_checkpoints_keep_the_newest_state(tiny_qwen35):
    """Device checkpoints (llama.cpp's ON_DEVICE: the state stays in the context's backend buffers, one copy
    per sequence) leave only a header on the host and restore the newest checkpoint exactly; an older one,
    whose copy the newer replaced, raises StateLost (S < K: a copy every round)."""
    host = _open(tiny_qwen35, 4, 3)
    t = _open(tiny_qwen35, 4, 3, device_states=True)
    assert host.state_checkpoints == "host" and t.state_checkpoints == "device"
    for target in (host, t):
        target.reset()
        target.prefill(PROMPT[:3])
    host_cp = host.checkpoint()
    cp1 = t.checkpoint()
    assert 0 < len(cp1.state) < len(host_cp.state) // 10  # the header; the tensors stay in backend buffers
    first = np.array(t.decode(PROMPT[3:5]).logits)
    np.testing.assert_array_equal(first, np.array(host.decode(PROMPT[3:5]).logits))
    t.restore(cp1)
    assert t.n_past == 3
    np.testing.assert_array_equal(first, np.array(t.decode(PROMPT[3:5]).logits))
    cp2 = t.checkpoint()
    after = np.array(t.decode(PROMPT[5:7]).logits)
    with pytest.raises(StateLost, match="newest state copy, on the device"):
        t.restore(cp1)
    t.restore(cp2)
    t.restore(cp2)  # a restore leaves the copy in place
    assert t.n_past == 5
    np.testing.assert_array_equal(after, np.array(t.decode(PROMPT[5:7]).logits))


def test_capacity_and_cancel(tiny_llama):
    t = _open(tiny_llama, 4, 4, n_ctx=16)
    n_ctx = t.capabilities.n_ctx  # llama.cpp may round the context up; the target reports what it got
    t.reset()
    t.prefill(np.arange(n_ctx - 2, dtype=np.int32) % 128)
    with pytest.raises(CapacityError):
        t.decode(np.arange(3, dtype=np.int32))
    assert t.n_past == n_ctx - 2
    with pytest.raises(CapacityError):
        t.decode(np.array([128], dtype=np.int32))  # outside the vocabulary
    cp = t.checkpoint()
    t.cancel()
    with pytest.raises(Cancelled):
        t.decode(np.array([3], dtype=np.int32))
    t.restore(cp)
    assert t.n_past == n_ctx - 2
    t.decode(np.array([3], dtype=np.int32))
    assert t.n_past == n_ctx - 1


def test_receipt_counts_are_per_request(tiny_llama):
    """backend.rollback holds each request's own counts, not the target's session-wide running totals."""
    from power_core.config import PowerConfig
    from power_core.session import Session

    cfg = PowerConfig(spec_mode="off", n_ctx=256, n_threads=2)
    with Session.open(cfg, model=str(tiny_llama)) as s:
        receipts = [s.generate(PROMPT.tolist(), max_tokens=n).receipt for n in (5, 9)]
        assert s.opened.target.counters()["decodes"] >= sum(r.backend["rollback"]["decodes"] for r in receipts)
    for r in receipts:
        n_out = r.output_tokens
        assert n_out > 1 and r.backend["rollback"] == {  # one prefill chunk, then one decode per token after it
            "rollback_in_place": 0, "rollback_restored": 0, "restores": 0, "decodes": n_out, "state_copies": 0}
    assert receipts[0].backend["rollback"] != receipts[1].backend["rollback"]


def test_a_late_cancel_of_a_finished_request_never_aborts_the_next(tiny_llama):
    """The target's abort listens to a request's cancel token only while that request runs: a late
    ``cancel()`` of a finished request (``power serve``'s timeout firing just after it ended) must not
    abort the decode of the next request on the context (issue 44, item 4)."""
    from power_core.config import PowerConfig
    from power_core.session import Session
    from power_core.transaction import CancelToken

    cfg = PowerConfig(spec_mode="off", n_ctx=256, n_threads=2)
    with Session.open(cfg, model=str(tiny_llama)) as s:
        want = s.generate(PROMPT.tolist(), max_tokens=8).tokens
        done = CancelToken()
        assert s.generate([3, 4, 5], max_tokens=4, cancel=done).receipt.status == "completed"
        gen = s.start(PROMPT.tolist(), max_tokens=8)
        rounds = gen.rounds()
        next(rounds)
        done.cancel()  # the finished request's late cancel
        list(rounds)
        assert gen.receipt.status == "completed" and gen.tokens == want
