"""power-suffix's durable store (power_suffix.store, SuffixMemory.open_store): a torn tail is cut at the
last whole record, a damaged store is moved aside (logged, counted) and the memory starts empty,
another model's store still stops the start, the log is fsynced within its interval or request
count, every replace is fsynced (file, then directory), a compaction killed midway leaves the old
store, failed writes leave the memory in RAM until a compaction recovers the store, one writer per
directory, formats 1 and 2 still load, a torn learn that evicted a tenant keeps it; and a child process learning into a store killed with SIGKILL at
random points, again and again: every restart loads, and nothing acknowledged is lost."""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from power_suffix import store as store_mod
from power_suffix.memory import STORE_FILE, SuffixMemory
from power_suffix.store import MAGIC, parse_store

from power_core import PowerConfig, Session
from power_core.errors import ArtifactError, ArtifactMismatch, ConfigError

REF = "reference:seed=11,vocab=97,dim=16,recurrent=1"
VOCAB = "vocab-1"


def wait_for(cond, timeout: float = 10.0, every: float = 0.005) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(every)
    return cond()


def held(mem: SuffixMemory) -> dict[str, list[list[int]]]:
    return {t: [d.tolist() for d in mem.documents(t)] for t in mem.tenants()}


def crash_copy(mem: SuffixMemory, src: Path, dst: Path) -> Path:
    """What a kill of the process would leave: the store's bytes as they are now (the memory stays open)."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / STORE_FILE).write_bytes((src / STORE_FILE).read_bytes())
    return dst


@pytest.fixture
def logged(tmp_path):
    """A store with a snapshot of two documents and a log of three records after it (A, B, C)."""
    src = tmp_path / "src"
    mem = SuffixMemory(VOCAB, budget_tokens=10_000)
    mem.learn("a", [1, 2, 3, 4])
    mem.learn("b", [5, 6, 7])
    mem.save(src)
    mem2 = SuffixMemory(VOCAB, budget_tokens=10_000)
    assert mem2.open_store(src) == 2
    sizes = [(src / STORE_FILE).stat().st_size]
    for doc in ([10, 11, 12], [20, 21, 22, 23], [30, 31]):
        mem2.learn("a", doc)
        sizes.append((src / STORE_FILE).stat().st_size)  # appended before learn returns
    blob = (src / STORE_FILE).read_bytes()
    yield mem2, blob, sizes
    mem2.close_store()


# -- a torn tail ------------------------------------------------------------------------------------------
def test_a_torn_tail_is_cut_at_the_last_whole_record(tmp_path, logged, caplog):
    mem, blob, sizes = logged
    want = held(mem)
    assert sizes[1] < sizes[2] < sizes[3] == len(blob)
    last_start = sizes[2]
    cases = {f"cut{k}": blob[:last_start + k] for k in (1, 5, 9, 12, sizes[3] - last_start - 1)}
    cases["garbage"] = blob + b"\x07" * 37
    cases["zeros"] = blob + b"\0" * 4096  # a filesystem that extended the file before writing it
    flipped = bytearray(blob)
    flipped[-2] ^= 0x10
    cases["flipped"] = bytes(flipped)
    for name, damaged in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / STORE_FILE).write_bytes(damaged)
        whole = len(blob) if name in ("garbage", "zeros") else last_start
        expect = want if whole == len(blob) else {"a": want["a"][:-1], "b": want["b"]}
        assert held_of_load(d) == expect, name  # load() reads up to the tail without raising
        fresh = SuffixMemory(VOCAB, budget_tokens=10_000)
        with caplog.at_level(logging.WARNING, logger="power_suffix"):
            fresh.open_store(d)
        assert held(fresh) == expect, name
        assert (d / STORE_FILE).stat().st_size == whole, name  # cut, durably, before anything is appended
        assert fresh.store_stats().torn_bytes_cut == len(damaged) - whole
        assert fresh.store_stats().corrupt_moved_aside == 0 and not list(d.glob("*.corrupt-*"))
        fresh.learn("c", [40, 41, 42])
        fresh.close_store()
        again = SuffixMemory(VOCAB, budget_tokens=10_000)
        again.open_store(d)
        assert held(again) == {**expect, "c": [[40, 41, 42]]}, name
        again.close_store()
    assert "suffix.store_tail_cut" in caplog.text


def test_a_torn_learn_that_evicted_a_tenant_loses_the_learn_and_keeps_the_victim(tmp_path):
    """A learn that makes the tenant LRU drop a tenant writes one record: a kill that cuts it anywhere
    leaves the store as it was before that learn, the victim's documents with it (format /2 wrote a
    FORGET and a DOC, and a cut inside the DOC replayed the FORGET alone)."""
    src = tmp_path / "src"
    mem = SuffixMemory(VOCAB, budget_tokens=10_000, tenants_max=2)
    mem.open_store(src)
    mem.learn("t1", [1, 2, 3])
    mem.learn("t2", [4, 5, 6])
    start = (src / STORE_FILE).stat().st_size
    before = list(held(mem).items())
    mem.learn("t3", [7, 8, 9, 10])
    after = list(held(mem).items())
    assert before == [("t1", [[1, 2, 3]]), ("t2", [[4, 5, 6]])] and after == [("t2", [[4, 5, 6]]),
                                                                              ("t3", [[7, 8, 9, 10]])]
    blob = crash_copy(mem, src, tmp_path / "copy").joinpath(STORE_FILE).read_bytes()
    mem.close_store()
    for cut in range(start, len(blob) + 1):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / STORE_FILE).write_bytes(blob[:cut])
        m = SuffixMemory(VOCAB, budget_tokens=10_000, tenants_max=2)
        m.open_store(d)
        assert list(held(m).items()) == (after if cut == len(blob) else before), cut
        assert m.store_stats().torn_bytes_cut == (0 if cut == len(blob) else cut - start)
        m.close_store()


def test_a_malformed_eviction_record_is_damage_not_a_crash(tmp_path):
    """An EVICT record whose checksum holds but whose contents do not parse (written by no power-suffix) is
    damage (``suffix_store_corrupt``), found without allocating what its counts claim."""
    mem = SuffixMemory(VOCAB, budget_tokens=10_000)
    mem.learn("a", [1, 2, 3])
    head = mem.save(tmp_path).read_bytes()
    doc = struct.pack("<I", 1) + b"b" + np.asarray([4, 5], dtype="<i4").tobytes()
    bad = {"no victim": struct.pack("<I", 0) + doc, "2**31 victims": struct.pack("<I", 2**31) + doc,
           "a victim past the end": struct.pack("<II", 1, 999) + doc, "no document": struct.pack("<II", 1, 1) + b"a"}
    for name, payload in bad.items():
        blob = head + store_mod._record(store_mod.EVICT, payload)
        with pytest.raises(ArtifactError, match="truncated or corrupt") as err:
            parse_store(tmp_path / STORE_FILE, blob, VOCAB)
        assert err.value.code == "suffix_store_corrupt", name
    good = head + store_mod._record(store_mod.EVICT, struct.pack("<II", 1, 1) + b"a" + doc)
    assert [(k, t) for k, t, _ in parse_store(tmp_path / STORE_FILE, good, VOCAB).ops] == [
        (store_mod.DOC, "a"), (store_mod.FORGET, "a"), (store_mod.DOC, "b")]


def held_of_load(d: Path) -> dict[str, list[list[int]]]:
    m = SuffixMemory(VOCAB, budget_tokens=10_000)
    m.load(d)
    return held(m)


# -- damage: moved aside ----------------------------------------------------------------------------------
def _v1(vocab: str, docs: list[tuple[str, list[int]]]) -> bytes:
    """A store of format power-suffix.store/1 (what the previous release wrote at close)."""
    import hashlib

    header = json.dumps({"format": "power-suffix.store/1", "vocab_sha256": vocab, "documents": len(docs)},
                        sort_keys=True).encode()
    parts = [struct.pack("<I", len(header)), header]
    for tenant, doc in docs:
        t = tenant.encode()
        parts += [struct.pack("<IQ", len(t), len(doc)), t, np.asarray(doc, dtype="<i4").tobytes()]
    body = b"".join(parts)
    return b"PWRSFX1\n" + hashlib.sha256(body).digest() + body


def test_a_damaged_store_is_moved_aside_logged_counted_and_the_memory_starts_empty(tmp_path, logged, caplog):
    _, blob, sizes = logged
    header_end = len(MAGIC) + 9 + struct.unpack_from("<I", blob, len(MAGIC) + 4)[0]
    snap = bytearray(blob)
    snap[header_end + 12] ^= 0x01  # inside the snapshot's first document
    head = bytearray(blob)
    head[len(MAGIC) + 12] ^= 0x01  # inside the header
    v1 = bytearray(_v1(VOCAB, [("a", [1, 2, 3])]))
    v1[-1] ^= 0x01
    cases = {"snapshot": bytes(snap), "header": bytes(head), "magic": b"XXXXXXX\n" + blob[8:],
             "short": blob[:header_end + 3], "empty": b"", "v1": bytes(v1), "text": b"not a store at all"}
    for name, damaged in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / STORE_FILE).write_bytes(damaged)
        mem = SuffixMemory(VOCAB, budget_tokens=10_000)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="power_suffix"):
            assert mem.open_store(d) == 0, name
        assert mem.stats().documents == 0
        [aside] = d.glob(f"{STORE_FILE}.corrupt-*")
        assert aside.read_bytes() == damaged, name
        assert aside.name[len(STORE_FILE) + len(".corrupt-"):].endswith("Z")  # its UTC time
        stats = mem.store_stats()
        assert stats.corrupt_moved_aside == 1 and stats.moved_aside == str(aside) and stats.healthy
        assert "suffix.store_corrupt" in caplog.text and str(aside) in caplog.text
        mem.learn("a", [9, 8, 7])  # the new store works
        mem.close_store()
        assert held_of_load(d) == {"a": [[9, 8, 7]]}
    # the same through a session (memory_for): the session opens, with an empty memory
    store = tmp_path / "session"
    store.mkdir()
    (store / STORE_FILE).write_bytes(b"PWRSFX2\n" + b"\xff" * 64)
    with Session.open(PowerConfig(spec_mode="suffix", spec_suffix_memory_tokens=4096, spec_suffix_store=str(store)),
                      model=REF) as s:
        assert s.proposer.memory.stats().documents == 0
        assert s.proposer.memory.store_stats().corrupt_moved_aside == 1
    assert len(list(store.glob(f"{STORE_FILE}.corrupt-*"))) == 1


def test_another_models_store_still_stops_the_start_and_is_left_alone(tmp_path):
    mem = SuffixMemory(VOCAB, budget_tokens=10_000)
    mem.learn("a", [1, 2, 3])
    path = mem.save(tmp_path)
    blob = path.read_bytes()
    with pytest.raises(ArtifactMismatch, match="another vocabulary") as err:
        SuffixMemory("vocab-2", budget_tokens=10_000).open_store(tmp_path)
    assert err.value.code == "suffix_store_mismatch"
    # a torn tail or a damaged log does not turn another model's store into "damage" either
    path.write_bytes(blob + b"\x01" * 20)
    with pytest.raises(ArtifactMismatch):
        SuffixMemory("vocab-2", budget_tokens=10_000).open_store(tmp_path)
    assert path.read_bytes() == blob + b"\x01" * 20 and not list(tmp_path.glob("*.corrupt-*"))
    # format 1 of another model too
    path.write_bytes(_v1("vocab-2", [("a", [1, 2, 3])]))
    with pytest.raises(ArtifactMismatch):
        SuffixMemory(VOCAB, budget_tokens=10_000).open_store(tmp_path)
    # a store a newer power-suffix wrote: refused, not destroyed
    path.write_bytes(b"PWRSFX4\n" + b"\0" * 100)
    with pytest.raises(ArtifactMismatch) as err:
        SuffixMemory(VOCAB, budget_tokens=10_000).open_store(tmp_path)
    assert err.value.code == "suffix_store_format" and path.read_bytes() == b"PWRSFX4\n" + b"\0" * 100
    # the refusals released the directory: the right model opens it
    path.write_bytes(blob)
    ok = SuffixMemory(VOCAB, budget_tokens=10_000)
    assert ok.open_store(tmp_path) == 1
    ok.close_store()


def _v2(vocab: str, ops: list[tuple[int, str, list[int] | None]], *, torn: bytes = b"") -> bytes:
    """A store of format power-suffix.store/2 (what the previous release appended to): every op a
    snapshot-free log record (an LRU eviction a FORGET before its DOC), then ``torn``."""
    header = json.dumps({"format": "power-suffix.store/2", "vocab_sha256": vocab, "snapshot": 0, "created": 0},
                        sort_keys=True).encode()
    parts = [b"PWRSFX2\n", store_mod._record(store_mod.HEADER, header)]
    for kind, tenant, doc in ops:
        parts.append(store_mod.doc_record(tenant, np.asarray(doc, dtype=np.int32)) if kind == store_mod.DOC
                     else store_mod.forget_record(tenant))
    return b"".join(parts) + torn


def test_formats_1_and_2_still_load_and_are_rewritten_as_format_3(tmp_path):
    (tmp_path / STORE_FILE).write_bytes(_v1(VOCAB, [("a", [1, 2, 3]), ("b", [4, 5, 6, 7])]))
    mem = SuffixMemory(VOCAB, budget_tokens=10_000)
    assert mem.open_store(tmp_path) == 2
    assert held(mem) == {"a": [[1, 2, 3]], "b": [[4, 5, 6, 7]]}
    assert (tmp_path / STORE_FILE).read_bytes().startswith(MAGIC)
    mem.close_store()
    d = tmp_path / "v2"
    d.mkdir()
    D, F = store_mod.DOC, store_mod.FORGET
    (d / STORE_FILE).write_bytes(_v2(VOCAB, [(D, "t1", [1, 2, 3]), (D, "t2", [4, 5]), (F, "t1", None),
                                             (D, "t3", [6, 7, 8])], torn=b"\x01\x02\x03"))
    mem = SuffixMemory(VOCAB, budget_tokens=10_000, tenants_max=2)
    assert mem.open_store(d) == 2
    assert list(held(mem).items()) == [("t2", [[4, 5]]), ("t3", [[6, 7, 8]])]
    assert mem.store_stats().torn_bytes_cut == 3
    assert parse_store(d / STORE_FILE, (d / STORE_FILE).read_bytes(), VOCAB).version == 3
    mem.learn("t4", [9, 10])  # appended to the rewritten store: an EVICT of t2
    mem.close_store()
    again = SuffixMemory(VOCAB, budget_tokens=10_000, tenants_max=2)
    again.open_store(d)
    assert list(held(again).items()) == [("t3", [[6, 7, 8]]), ("t4", [[9, 10]])]
    again.close_store()


# -- syncing, replacing, compacting -----------------------------------------------------------------------
def test_the_log_is_fsynced_within_its_interval_or_request_count(tmp_path):
    mem = SuffixMemory(VOCAB, budget_tokens=100_000)
    mem.open_store(tmp_path / "t", sync_s=0.2, sync_requests=1_000_000)
    mem.learn("a", [1, 2, 3])
    t0 = time.monotonic()
    assert wait_for(lambda: mem.store_stats().synced == 1, timeout=10)
    by_time = time.monotonic() - t0
    mem.close_store()
    assert by_time < 0.2 + 2.0  # the interval, and slack for a loaded machine

    mem = SuffixMemory(VOCAB, budget_tokens=100_000)
    mem.open_store(tmp_path / "n", sync_s=60.0, sync_requests=3)
    mem.learn("a", [1, 2, 3])
    mem.learn("a", [4, 5, 6])
    time.sleep(0.3)
    assert mem.store_stats().synced == 0  # neither 60 s nor 3 records yet
    mem.learn("a", [7, 8, 9])
    t0 = time.monotonic()
    assert wait_for(lambda: mem.store_stats().synced == 3, timeout=10)
    assert time.monotonic() - t0 < 2.0  # at once (slack for a loaded machine), not after 60 s
    mem.close_store()
    with pytest.raises(ConfigError, match="spec_suffix_store_sync_s"):
        SuffixMemory(VOCAB).open_store(tmp_path / "x", sync_s=0)
    with pytest.raises(ConfigError, match="spec_suffix_store_sync_requests"):
        SuffixMemory(VOCAB).open_store(tmp_path / "x", sync_requests=0)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names descriptors through /proc")
def test_every_replace_is_fsynced_file_first_then_directory(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", str(Path(src).resolve())))
        real_replace(src, dst)

    monkeypatch.setattr(store_mod.os, "fsync", fsync)
    monkeypatch.setattr(store_mod.os, "replace", replace)
    mem = SuffixMemory(VOCAB, budget_tokens=100_000)
    mem.learn("a", [1, 2, 3])
    mem.save(tmp_path / "saved")  # save to a directory
    mem.open_store(tmp_path / "open", compact_bytes=1)  # a new store
    for i in range(50):
        mem.learn(f"t{i % 3}", list(range(i, i + 30)))
    mem.save(tmp_path / "open")  # its own open store: a compaction
    mem.close_store()  # a final compaction
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / STORE_FILE).write_bytes(b"garbage")
    SuffixMemory(VOCAB).open_store(tmp_path / "torn")  # moved aside (a rename too), then a new store
    replaces = [i for i, (kind, _) in enumerate(events) if kind == "replace"]
    assert len(replaces) >= 5
    for i in replaces:
        src = events[i][1]
        before = [p for kind, p in events[:i] if kind == "fsync"]
        after = [p for kind, p in events[i + 1:] if kind == "fsync"]
        if Path(src).name.startswith(".suffix-memory."):  # a new store: its data fsynced before the rename
            assert before and before[-1] == src
        assert after and after[0] == str(Path(src).parent), "the directory is fsynced right after the rename"


def test_compaction_keeps_the_store_bounded_and_loads_what_the_memory_held(tmp_path):
    mem = SuffixMemory(VOCAB, budget_tokens=2000, tenants_max=3)
    mem.open_store(tmp_path, sync_s=0.01, compact_bytes=1)
    rng = np.random.default_rng(0)
    written = 0
    for i in range(3000):
        doc = rng.integers(0, 90, int(rng.integers(2, 40)))
        mem.learn(f"t{rng.integers(0, 5)}", doc)
        written += 4 * doc.size
        if i % 300 == 0:
            time.sleep(0.03)  # let the store's thread run
    assert wait_for(lambda: mem.store_stats().compactions >= 3, timeout=10)
    # once the store's thread has run, the file is at most twice a snapshot of what the memory holds
    snapshot = mem._bytes + 200  # the documents' records, the magic and the header
    assert wait_for(lambda: (tmp_path / STORE_FILE).stat().st_size <= 2 * snapshot, timeout=10)
    assert written > 20 * snapshot  # what was learned, far more than what is kept
    live = held(mem)
    crash = crash_copy(mem, tmp_path, tmp_path / "crash")
    back = SuffixMemory(VOCAB, budget_tokens=2000, tenants_max=3)
    back.open_store(crash)
    assert held(back) == live and back.stats().segments == mem.stats().segments
    back.close_store()
    mem.close_store()
    final = parse_store(tmp_path / STORE_FILE, (tmp_path / STORE_FILE).read_bytes(), VOCAB)
    assert final.records == final.snapshot == mem.stats().documents  # closed: all snapshot


def test_a_compaction_that_fails_or_dies_midway_leaves_the_old_store(tmp_path, monkeypatch):
    mem = SuffixMemory(VOCAB, budget_tokens=100_000)
    mem.open_store(tmp_path)
    mem.learn("a", [1, 2, 3])

    def broken(src, dst):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(store_mod.os, "replace", broken)
    with pytest.raises(ArtifactError, match="cannot write") as err:
        mem.save(tmp_path)
    assert err.value.code == "suffix_store_unwritable"
    monkeypatch.undo()
    assert not list(tmp_path.glob(".suffix-memory.*.tmp"))
    mem.learn("a", [4, 5, 6])  # still appending to the old file
    assert held(mem) == held_of_load(crash_copy(mem, tmp_path, tmp_path / "c1"))
    mem.close_store()
    # a compaction killed before its rename leaves a temporary file: the next open removes it
    (tmp_path / ".suffix-memory.abc.tmp").write_bytes(b"half a snapshot")
    back = SuffixMemory(VOCAB, budget_tokens=100_000)
    back.open_store(tmp_path)
    assert held(back) == {"a": [[1, 2, 3], [4, 5, 6]]} and back.store_stats().stale_tmp_removed == 1
    assert not list(tmp_path.glob(".suffix-memory.*.tmp"))
    back.close_store()


def test_a_store_that_fails_to_write_leaves_the_memory_in_ram_until_a_compaction_recovers_it(tmp_path, monkeypatch,
                                                                                           caplog):
    import power_suffix.memory as memory_mod

    monkeypatch.setattr(memory_mod, "RETRY_S", 0.05)
    mem = SuffixMemory(VOCAB, budget_tokens=100_000)
    mem.open_store(tmp_path, sync_s=0.02)
    mem.learn("a", [1, 2, 3])
    real = store_mod._write_all
    failing = threading.Event()
    failing.set()

    def write_all(fd, data):
        if failing.is_set():
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real(fd, data)

    monkeypatch.setattr(store_mod, "_write_all", write_all)
    with caplog.at_level(logging.WARNING, logger="power_suffix"):
        mem.learn("a", [4, 5, 6])  # no exception reaches the request path
        mem.learn("b", [7, 8, 9])
        stats = mem.store_stats()
        assert not stats.healthy and stats.write_errors >= 1
        assert held(mem) == {"a": [[1, 2, 3], [4, 5, 6]], "b": [[7, 8, 9]]}  # learning goes on in RAM
        failing.clear()  # the disk has room again: the store's thread retries with a compaction
        assert wait_for(lambda: mem.store_stats().healthy and "suffix.store_recovered" in caplog.text, timeout=10)
    assert "suffix.store_write_failed" in caplog.text
    mem.learn("b", [10, 11])
    assert held_of_load(crash_copy(mem, tmp_path, tmp_path / "c")) == held(mem)
    mem.close_store()


def test_one_writer_per_store_directory(tmp_path):
    a = SuffixMemory(VOCAB, budget_tokens=1000)
    a.open_store(tmp_path)
    with pytest.raises(ConfigError, match="spec_suffix_store"):
        SuffixMemory(VOCAB, budget_tokens=1000).open_store(tmp_path)
    with pytest.raises(ArtifactError) as err:
        SuffixMemory(VOCAB, budget_tokens=1000).save(tmp_path)
    assert err.value.code == "suffix_store_busy"
    a.learn("t", [1, 2, 3])
    a.close_store()
    b = SuffixMemory(VOCAB, budget_tokens=1000)
    assert b.open_store(tmp_path) == 1
    b.close_store()


def test_the_last_release_closes_the_store_and_the_next_acquire_reopens_it(tmp_path):
    mem = SuffixMemory(VOCAB, budget_tokens=1000)
    mem.open_store(tmp_path)
    mem.acquire()
    mem.learn("a", [1, 2, 3])
    mem.release()  # the last user: compacted, closed, unlocked
    assert not mem.store_stats().open
    other = SuffixMemory(VOCAB, budget_tokens=1000)
    other.open_store(tmp_path)
    assert held(other) == {"a": [[1, 2, 3]]}
    other.learn("b", [4, 5, 6])
    other.close_store()
    mem.acquire()  # the store changed since this memory closed it: what the file holds wins
    assert mem.store_stats().open and held(mem) == {"a": [[1, 2, 3]], "b": [[4, 5, 6]]}
    mem.learn("c", [7, 8, 9])
    mem.release()
    mem.acquire()  # unchanged since: appended to as it is
    mem.learn("c", [10, 11])
    mem.release()
    assert held_of_load(tmp_path) == held(mem) == {"a": [[1, 2, 3]], "b": [[4, 5, 6]], "c": [[7, 8, 9], [10, 11]]}


def test_a_session_keeps_its_store_open_and_appends_every_request(tmp_path):
    store = tmp_path / "store"
    cfg = PowerConfig(spec_mode="suffix", max_tokens=12, spec_suffix_memory_tokens=4096, spec_suffix_store=str(store),
                      spec_suffix_store_sync_s=0.05, spec_suffix_store_sync_requests=4, spec_suffix_tenants=8)
    with Session.open(cfg, model=REF) as s:
        memory = s.proposer.memory
        assert memory.tenants_max == 8
        s.generate([3, 4, 5, 6, 7, 8] * 3)
        s.generate([9, 10, 11, 12] * 3)  # the first request is learned when the second begins
        assert memory.store_stats().appended >= 1 and memory.store_stats().sync_s == 0.05
        # what a kill now would leave: the first request is in the store
        docs = held_of_load_vocab(crash_copy(memory, store, tmp_path / "crash"), memory.vocab_digest)
        assert sum(len(v) for v in docs.values()) >= 1
    assert memory.store_stats().open is False


def held_of_load_vocab(d: Path, vocab: str) -> dict[str, list[list[int]]]:
    m = SuffixMemory(vocab, budget_tokens=100_000)
    m.load(d)
    return held(m)


# -- kill -9 in a loop ------------------------------------------------------------------------------------
DOC_SRC = '''
import numpy as np

def doc(i):
    """The i-th document the child learns: its tenant, and tokens starting with 1000 + i (its id)."""
    rng = np.random.default_rng(i)
    n = int(rng.integers(2, 60))
    tenant = f"t{int(rng.integers(0, 6))}"
    return tenant, np.concatenate([[1000 + i], rng.integers(0, 50, n)]).astype(np.int32)
'''

CHILD_SRC = DOC_SRC + '''
import json, sys
from power_suffix.memory import SuffixMemory

store, budget, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mem = SuffixMemory("kill-test", budget_tokens=budget, tenants_max=cap)
mem.open_store(store, sync_s=0.005, sync_requests=8, compact_bytes=1)
held = {t: [int(d[0]) - 1000 for d in mem.documents(t)] for t in mem.tenants()}
ok = all(doc(int(d[0]) - 1000)[0] == t and np.array_equal(doc(int(d[0]) - 1000)[1], d)
         for t in mem.tenants() for d in mem.documents(t))
st, ss = mem.stats(), mem.store_stats()
nxt = max((max(v) for v in held.values() if v), default=-1) + 1
print("READY " + json.dumps({"next": nxt, "held": held, "ok": ok, "tokens": st.tokens, "segments": st.segments,
                             "documents": st.documents, "torn": ss.torn_bytes_cut, "moved": ss.corrupt_moved_aside,
                             "stale_tmp": ss.stale_tmp_removed}), flush=True)
i = nxt
while True:
    t, d = doc(i)
    mem.learn(t, d)
    s = mem.store_stats()
    age = s.last_sync_age_s if s.appended > s.synced and s.last_sync_age_s is not None else 0.0
    print(f"L {i} {s.appended - s.synced} {s.compactions} {age:.4f}", flush=True)
    i += 1
'''


@pytest.mark.slow
def test_kill_9_while_learning_loses_nothing_acknowledged(tmp_path):
    """A child learns into a store (6 tenants over a cap of 4, a 3000-token budget, so the LRU and
    the budget evict; fsync every 5 ms; a compaction on nearly every sync) and is killed with SIGKILL
    at a random moment: mostly while learning, sometimes while it starts (loading, cutting, compacting).
    Every restart must load (never a store moved aside), hold exactly what a memory that learned the
    same documents without a crash holds, and have every document the child acknowledged (a learn
    that returned: in the kernel, so a killed process keeps it; a power cut would keep the synced
    ones, which the child reports too)."""
    budget, cap, kills_wanted, deadline = 3000, 4, 60, time.monotonic() + 300
    script = tmp_path / "child.py"
    script.write_text(CHILD_SRC)
    store = tmp_path / "store"
    ns: dict = {}
    exec(DOC_SRC, ns)
    doc = ns["doc"]
    ref = SuffixMemory("kill-test", budget_tokens=budget, tenants_max=cap)
    ref_n = 0
    rng = np.random.default_rng(44)
    acked = -1  # the last document a child acknowledged
    figures = {"kills": 0, "early_kills": 0, "restarts_checked": 0, "extra_in_flight": 0, "torn_cut": 0,
               "stale_tmp": 0, "unsynced_at_kill": [], "learned_per_life": [], "compactions": 0}
    ages: list[float] = []  # seconds since the last fsync, at every acknowledged learn with some unsynced
    t_start = time.monotonic()

    def check_ready(data: dict) -> None:
        nonlocal ref_n, acked
        n = data["next"]
        assert data["moved"] == 0, "a kill left a store that looked damaged"
        assert data["ok"], "a loaded document differs from what was learned"
        assert n >= acked + 1, f"lost acknowledged learning: loaded up to {n - 1}, acknowledged {acked}"
        assert n <= acked + 2, f"loaded {n - 1}, beyond the one learn in flight after {acked}"
        figures["extra_in_flight"] += n - (acked + 1)
        figures["torn_cut"] += bool(data["torn"])
        figures["stale_tmp"] += data["stale_tmp"]
        acked = n - 1  # loaded: what the next child learns follows it
        while ref_n < n:
            ref.learn(*doc(ref_n))
            ref_n += 1
        want = {t: [int(d[0]) - 1000 for d in ref.documents(t)] for t in ref.tenants()}
        assert data["held"] == want  # the same documents, tenants and LRU order as without a crash
        st = ref.stats()
        assert (data["tokens"], data["segments"], data["documents"]) == (st.tokens, st.segments, st.documents)
        figures["restarts_checked"] += 1

    while figures["kills"] < kills_wanted and time.monotonic() < deadline:
        err = open(tmp_path / "child.err", "wb")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, str(script), str(store), str(budget), str(cap)],
                             stdout=subprocess.PIPE, stderr=err, text=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def read(pipe=p.stdout, out=lines) -> None:
            for line in pipe:
                out.put(line)
            out.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        early = rng.random() < 0.15
        got: list[str] = []
        if early:  # anywhere in its start: imports, load, cut, compaction, first learns
            time.sleep(rng.uniform(0.0, 0.8))
        else:
            line = lines.get(timeout=60)
            assert line is not None and line.startswith("READY"), (tmp_path / "child.err").read_text()
            got.append(line)
            time.sleep(rng.uniform(0.0, 0.05))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        reader.join(timeout=30)
        err.close()
        assert p.returncode == -signal.SIGKILL, (tmp_path / "child.err").read_text()
        figures["kills"] += 1
        figures["early_kills"] += early
        while (line := lines.get(timeout=30)) is not None:
            got.append(line)
        learned = 0
        for line in got:
            if line.startswith("READY"):
                check_ready(json.loads(line[len("READY "):]))
            elif line.startswith("L ") and line.endswith("\n"):  # a whole line: the learn returned
                fields = line.split()
                i, unsynced, compactions, age = int(fields[1]), int(fields[2]), int(fields[3]), float(fields[4])
                assert i == acked + 1
                acked = i
                learned += 1
                last = (unsynced, compactions, age)
                ages.append(age)
        if learned:
            figures["unsynced_at_kill"].append(last[0])
            figures["compactions"] += last[1]
        figures["learned_per_life"].append(learned)
    elapsed = time.monotonic() - t_start
    # the last kill's restart
    last_check = SuffixMemory("kill-test", budget_tokens=budget, tenants_max=cap)
    last_check.open_store(store)
    assert last_check.store_stats().corrupt_moved_aside == 0
    ids = [int(d[0]) - 1000 for t in last_check.tenants() for d in last_check.documents(t)]
    assert max(ids) >= acked
    last_check.close_store()
    unsynced = figures.pop("unsynced_at_kill")
    per_life = figures.pop("learned_per_life")
    summary = {**figures, "seconds": round(elapsed, 1), "documents_acknowledged": acked + 1,
               "learned_per_life_median": float(np.median(per_life)),
               "unsynced_records_at_kill_max": max(unsynced, default=0),
               "unsynced_records_at_kill_mean": round(float(np.mean(unsynced)), 2) if unsynced else 0.0,
               "unsynced_age_s_max": round(max(ages, default=0.0), 4),
               "unsynced_age_s_p99": round(float(np.quantile(ages, 0.99)), 4) if ages else 0.0}
    print("kill-9 loop:", json.dumps(summary))
    assert figures["kills"] >= 50, f"only {figures['kills']} kills in the time allowed: {summary}"
    assert figures["restarts_checked"] >= 40
    # the power-cut exposure: what was not fsynced was never older than the interval (5 ms) by much
    assert max(ages, default=0.0) < 2.0
