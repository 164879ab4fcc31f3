"""power-suffix's memory across requests: the index over other text (find), tenants, the budget and
eviction, the corpus, the store (round trip, another vocabulary, truncated or corrupt), the
per-source statistics in receipts, and exactness against ``--mode off`` with the memory cold, warm,
shared by concurrent requests and after eviction (reference backend, property-based)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from power_suffix import SuffixMemory, SuffixProposer, share_memory
from power_suffix.index import SEPARATOR, SuffixIndex
from power_suffix.memory import SEGMENTS, SHARED_LENGTHS, STORE_FILE
from power_suffix.plugin import vocabulary_digest

from power_core import PowerConfig, Session
from power_core.errors import ArtifactError, ArtifactMismatch, ConfigError
from power_core.runtime import ProposalContext, RequestScope

REF = "reference:seed=11,vocab=97,dim=16,recurrent=1"


def ctx(history, k=32):
    h = np.asarray(history, dtype=np.int32)
    return ProposalContext(history=h, anchor=int(h[-1]), k=k, round_index=1)


# -- the index over other text ---------------------------------------------------------------------------
def brute_find(docs: list[list[int]], query: list[int]) -> tuple[int, set[int]]:
    """Longest suffix of ``query`` ending anywhere in one of ``docs``, and the tokens that follow it there."""
    best, follow = 0, set()
    for d in docs:
        for e in range(len(d)):
            n = 0
            while n <= e and n < len(query) and d[e - n] == query[-1 - n]:
                n += 1
            if n > best:
                best, follow = n, set()
            if n == best and n and e + 1 < len(d):
                follow.add(d[e + 1])
    return best, follow


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=3),
       st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_find_is_the_longest_occurrence_in_other_text(docs, query):
    ix = SuffixIndex(SHARED_LENGTHS, truncatable=False)
    for d in docs:
        ix.extend(d)
        ix.extend([SEPARATOR])
    m = ix.find(np.asarray(query), 8)
    best, follow = brute_find(docs, query)
    if best < SHARED_LENGTHS[0]:
        assert m is None
        return
    assert m is not None and m.length == best
    # a continuation never crosses a document's end, and starts as an occurrence of the match goes on
    assert (m.tokens >= 0).all()
    assert m.tokens.size == 0 or int(m.tokens[0]) in follow


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=3),
       st.lists(st.integers(0, 3), min_size=1, max_size=12), st.integers(0, 14), st.integers(0, 4))
def test_find_with_a_match_to_beat_answers_only_a_better_one(docs, query, length, occurrences):
    """``beat``: the caller's own match. A match that would lose to it is not voted on; one that wins is
    the one found without it."""
    ix = SuffixIndex(SHARED_LENGTHS, truncatable=False)
    for d in docs:
        ix.extend(d)
        ix.extend([SEPARATOR])
    plain = ix.find(np.asarray(query), 8)
    got = ix.find(np.asarray(query), 8, beat=(length, occurrences))
    if plain is None or (plain.length, plain.occurrences) <= (length, occurrences):
        assert got is None
    else:
        assert got is not None and (got.length, got.occurrences, got.tokens.tolist()) == \
            (plain.length, plain.occurrences, plain.tokens.tolist())


def test_a_separated_document_is_never_continued_past_its_end():
    ix = SuffixIndex(SHARED_LENGTHS, truncatable=False)
    for d in ([1, 2, 3, 4], [9, 9, 9, 9, 9]):
        ix.extend(d)
        ix.extend([SEPARATOR])
    m = ix.find(np.asarray([7, 1, 2]), 8)
    assert m is not None and m.length == 2 and m.tokens.tolist() == [3, 4]
    with pytest.raises(ValueError):
        ix.truncate(2)


# -- the memory: tenants, budget, eviction -----------------------------------------------------------------
def test_a_tenant_reads_only_its_own_documents_unless_sharing_is_on():
    text = list(range(10, 40))
    for share in (False, True):
        mem = SuffixMemory("v", budget_tokens=1000, share_tenants=share)
        mem.learn("b", text)
        assert mem.find("b", np.asarray(text[:8]), 8) is not None
        got = mem.find("a", np.asarray(text[:8]), 8)
        assert (got is not None) == share
        if got is not None:
            assert got.source == "shared" and got.match.tokens.tolist() == text[8:16]


def test_the_budget_holds_under_a_thousand_requests_and_the_oldest_go_first():
    rng = np.random.default_rng(0)
    budget = 4096
    mem = SuffixMemory("v", budget_tokens=budget)
    firsts = []
    for i in range(1000):
        doc = rng.integers(0, 500, int(rng.integers(2, 200))).tolist()
        firsts.append(doc)
        mem.learn(f"t{i % 7}", doc)
        st_ = mem.stats()
        assert st_.tokens <= budget and st_.segments <= SEGMENTS + 7
    st_ = mem.stats()
    assert st_.evicted_documents > 0 and st_.documents + st_.evicted_documents == 1000
    kept = [d.tolist() for t in range(7) for d in mem.documents(f"t{t}")]
    assert firsts[-1] in kept and firsts[0] not in kept  # the newest stay, the oldest went


def test_proposals_come_from_the_longer_and_more_frequent_match():
    mem = SuffixMemory("v", budget_tokens=10_000)
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    mem.learn("", shared)
    p = SuffixProposer(mem)
    prompt = [1, 2, 7, 8, 3, 4, 6, 7, 8]  # own text: (7, 8) then 3; the memory: (6, 7, 8) then 9
    p.request_scope(RequestScope(""))
    p.begin(np.asarray(prompt, dtype=np.int32))
    got = p.propose(ctx(prompt))
    assert got.source == "shared" and got.ids.tolist()[:3] == [9, 10, 11]
    assert got.stats is not None and got.stats["match_length"] == 3.0
    prompt = [6, 7, 8, 20, 1, 6, 7, 8]  # now the request itself has (6, 7, 8) too: a tie goes to it
    p.begin(np.asarray(prompt, dtype=np.int32))
    got = p.propose(ctx(prompt))
    assert got.source == "request" and got.ids.tolist()[0] == 20


def test_a_request_is_learned_under_the_tenant_it_ran_for():
    mem = SuffixMemory("v", budget_tokens=10_000)
    p = SuffixProposer(mem)
    for tenant, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        p.request_scope(RequestScope(tenant))
        p.begin(np.asarray(prompt, dtype=np.int32))
        p.commit(0, np.asarray([40, 41, 42], dtype=np.int32))  # round 0 and a later round
        p.commit(1, np.asarray([43, 44], dtype=np.int32))
    p.close()
    assert [d.tolist() for d in mem.documents("a")] == [[40, 41, 42, 43, 44]]
    assert [d.tolist() for d in mem.documents("b")] == [[40, 41, 42, 43, 44]]
    mem2 = SuffixMemory("v", budget_tokens=10_000, learn_prompts=True)
    p = SuffixProposer(mem2)
    p.begin(np.asarray([1, 2, 3], dtype=np.int32))
    p.commit(0, np.asarray([7], dtype=np.int32))
    p.close()
    assert [d.tolist() for d in mem2.documents("")] == [[1, 2, 3, 7]]


# -- tenants: bounded, the least recently used first ---------------------------------------------------------
def test_tenants_are_bounded_and_the_least_recently_used_goes_first():
    mem = SuffixMemory("v", budget_tokens=100_000, tenants_max=3)
    for t in "abc":
        mem.learn(t, [ord(t), 1, 2, 3])
    assert mem.tenants() == ["a", "b", "c"]
    assert mem.find("a", np.array([97, 1, 2]), 4) is not None  # a read makes "a" the most recent
    assert mem.tenants() == ["b", "c", "a"]
    mem.learn("d", [100, 1, 2, 3])
    assert mem.tenants() == ["c", "a", "d"] and mem.documents("b") == []
    st = mem.stats()
    assert (st.tenants, st.tenants_max, st.evicted_tenants, st.documents) == (3, 3, 1, 3)
    assert mem.find("b", np.array([98, 1, 2]), 4) is None  # nothing of b's is left to offer
    mem.learn("a", [97, 5, 6])  # a known tenant evicts no one
    assert mem.stats().evicted_tenants == 1
    # however many users write (the tenant is client-controlled text), the memory holds at most the cap
    for i in range(5000):
        mem.learn(f"user{i}", [i, i + 1, i + 2])
    st = mem.stats()
    assert st.tenants == 3 and st.segments == 3 and st.evicted_tenants == 1 + 5000
    assert mem.tenants() == ["user4997", "user4998", "user4999"]
    with pytest.raises(ConfigError, match="spec_suffix_tenants"):
        SuffixMemory("v", tenants_max=0)


def test_a_query_scans_only_its_tenants_segments_unless_tenants_share(monkeypatch):
    """The cost of a query does not grow with other tenants' documents (and sharing still reads them all)."""
    calls = []
    real = SuffixIndex.find

    def counting(self, *a, **k):
        calls.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(SuffixIndex, "find", counting)
    for share in (False, True):
        mem = SuffixMemory("v", budget_tokens=1_000_000, tenants_max=1000, share_tenants=share)
        for i in range(200):
            mem.learn(f"t{i}", [5, 6, 7, 8, i])
        calls.clear()
        got = mem.find("t7", np.array([5, 6, 7, 8]), 4)
        assert got is not None and got.match.tokens.tolist()[:1] == ([199] if share else [7])
        assert len(calls) == (200 if share else 1)


def test_a_tenant_the_lru_drops_is_dropped_from_the_store_too(tmp_path):
    """Chosen: the LRU's eviction is in the store's log (the EVICT record of the learn), so a restart does not bring the
    tenant back (the store stays what the memory held), and the next compaction drops its bytes."""
    mem = SuffixMemory("v", budget_tokens=100_000, tenants_max=2)
    mem.open_store(tmp_path)
    mem.learn("alice", [1, 2, 3, 4])
    mem.learn("bob-the-evicted", [5, 6, 7, 8])
    mem.find("alice", np.array([1, 2, 3]), 4)
    mem.learn("carol", [9, 10, 11])
    assert mem.tenants() == ["alice", "carol"]
    crash = tmp_path / "crash"  # what a kill now leaves
    crash.mkdir()
    (crash / STORE_FILE).write_bytes((tmp_path / STORE_FILE).read_bytes())
    back = SuffixMemory("v", budget_tokens=100_000, tenants_max=2)
    back.load(crash)
    assert back.documents("bob-the-evicted") == [] and back.stats().tenants == 2
    assert [d.tolist() for d in back.documents("alice")] == [[1, 2, 3, 4]]
    mem.close_store()  # a compaction: a snapshot of what the memory holds
    assert b"bob-the-evicted" not in (tmp_path / STORE_FILE).read_bytes()
    # a restart with a smaller cap keeps the most recently used
    small = SuffixMemory("v", budget_tokens=100_000, tenants_max=1)
    small.load(tmp_path)
    assert small.tenants() == ["carol"]


# -- the store -----------------------------------------------------------------------------------------------
def test_the_store_round_trips_and_refuses_another_vocabulary_and_damage(tmp_path):
    mem = SuffixMemory("vocab-1", budget_tokens=10_000)
    mem.learn("a", [1, 2, 3, 4, 5])
    mem.learn("b", list(range(50, 90)))
    path = mem.save(tmp_path)
    back = SuffixMemory("vocab-1", budget_tokens=10_000)
    assert back.load(tmp_path) == 2
    assert [d.tolist() for d in back.documents("a")] == [[1, 2, 3, 4, 5]]
    assert [d.tolist() for d in back.documents("b")] == [list(range(50, 90))]
    assert SuffixMemory("vocab-1").load(tmp_path / "nothing-here") == 0
    with pytest.raises(ArtifactMismatch, match="another vocabulary"):
        SuffixMemory("vocab-2", budget_tokens=10_000).load(tmp_path)
    blob = path.read_bytes()
    # a saved store is all snapshot (fsynced before it was renamed into place): any damage to it is
    # corruption, not a torn tail (load raises; opening it moves it aside: test_store.py)
    for damaged in (blob[:-7], blob[:20], blob[: len(blob) // 2], b"not a store at all"):
        path.write_bytes(damaged)
        fresh = SuffixMemory("vocab-1", budget_tokens=10_000)
        with pytest.raises(ArtifactError, match="truncated or corrupt") as err:
            fresh.load(tmp_path)
        assert err.value.code == "suffix_store_corrupt" and fresh.stats().documents == 0
    flipped = bytearray(blob)
    flipped[-3] ^= 0x40
    path.write_bytes(bytes(flipped))
    with pytest.raises(ArtifactError, match="snapshot holds 1 whole records of 2"):
        SuffixMemory("vocab-1", budget_tokens=10_000).load(tmp_path)


def test_a_session_saves_its_store_when_it_closes_and_the_next_one_loads_it(tmp_path):
    store = tmp_path / "store"
    cfg = dict(spec_mode="suffix", max_tokens=24, spec_suffix_memory_tokens=4096, spec_suffix_store=str(store))
    with Session.open(PowerConfig(**cfg), model=REF) as s:
        s.generate([3, 4, 5, 6, 7, 8] * 3)
        learned = s.proposer.memory.stats()
    assert (store / STORE_FILE).exists()
    with Session.open(PowerConfig(**cfg), model=REF) as s:
        assert s.proposer.memory.stats().documents == max(learned.documents, 1)
    # a store of another model's vocabulary: a typed error when the session opens (exit 2 in the CLI)
    other = "reference:seed=11,vocab=101,dim=16,recurrent=1"
    with pytest.raises(ArtifactMismatch):
        Session.open(PowerConfig(**cfg), model=other)
    with pytest.raises(ConfigError, match="spec_suffix_store"):
        Session.open(PowerConfig(spec_mode="suffix", spec_suffix_store=str(store)), model=REF)


def test_the_cli_takes_the_flags_and_refuses_a_store_of_another_model_with_exit_2(tmp_path, capsys):
    from power_core.cli import main

    model = "reference:seed=3,vocab=300,dim=16"  # a byte tokenizer: --prompt is text
    (tmp_path / "a.txt").write_text("hello there, hello again\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# a title\nsome text\n")
    store = tmp_path / "store"
    run = ["run", "--model", model, "--mode", "suffix", "--prompt", "hello", "--max-tokens", "8", "--json",
           "--suffix-memory", "1000", "--suffix-store", str(store), "--suffix-store-sync", "0.5",
           "--suffix-store-sync-requests", "4", "--suffix-tenants", "16",
           "--suffix-corpus", str(tmp_path / "a.txt"), str(tmp_path / "docs")]
    assert main(run) == 0
    config = json.loads(capsys.readouterr().out)["receipt"]["config"]
    assert config["spec_suffix_corpus"] == [str(tmp_path / "a.txt"), str(tmp_path / "docs")]
    assert (config["spec_suffix_store_sync_s"], config["spec_suffix_store_sync_requests"],
            config["spec_suffix_tenants"]) == (0.5, 4, 16)
    assert config["spec_suffix_memory_tokens"] == 1000 and (store / STORE_FILE).exists()
    SuffixMemory("not-this-model", budget_tokens=100).save(store)
    assert main(run) == 2
    assert "another vocabulary" in capsys.readouterr().err
    # damage is not a configuration error: the store is moved aside and the run starts empty
    (store / STORE_FILE).write_bytes(b"PWRSFX1\n" + b"\0" * 10)
    assert main(run) == 0
    capsys.readouterr()
    [aside] = store.glob(f"{STORE_FILE}.corrupt-*")
    assert aside.read_bytes() == b"PWRSFX1\n" + b"\0" * 10
    with Session.open(PowerConfig(spec_mode="suffix"), model=model) as s:
        vocab = vocabulary_digest(s.opened)
    assert SuffixMemory(vocab, budget_tokens=1000).load(store) >= 1  # a valid store again, with the run learned


# -- the corpus -----------------------------------------------------------------------------------------------
def test_the_corpus_is_drafted_from_for_every_tenant(tmp_path):
    model = "reference:seed=3,vocab=300,dim=16"  # > 256 ids: a byte tokenizer
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n")
    (tmp_path / "docs" / "b.py").write_text("def add(a, b):\n    return a + b\n")
    (tmp_path / "docs" / "image.png").write_bytes(b"\x89PNG")
    cfg = PowerConfig(spec_mode="suffix", spec_suffix_corpus=[str(tmp_path / "docs")], max_tokens=8)
    with Session.open(cfg, model=model) as s:
        mem = s.proposer.memory
        assert mem is not None and mem.stats().corpus_tokens == len("the quick brown fox jumps over the lazy dog\n") \
            + len("def add(a, b):\n    return a + b\n")
        found = mem.find("anyone", s.encode("def add(a, b):\n    ret"), 8)
        assert found is not None and found.source == "corpus"
        assert bytes(found.match.tokens.tolist()).startswith(b"urn a")
    with pytest.raises(ConfigError, match="spec_suffix_corpus"):
        Session.open(PowerConfig(spec_mode="suffix", spec_suffix_corpus=[str(tmp_path / "missing")]), model=model)


# -- exactness and per-source statistics, end to end -------------------------------------------------------
def _off(prompts, **cfg):
    with Session.open(PowerConfig(spec_mode="off", **cfg), model=REF) as s:
        return [s.generate(p).tokens for p in prompts]


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(st.integers(3, 90), min_size=2, max_size=6), min_size=2, max_size=5),
       st.integers(1, 6), st.sampled_from([24, 100_000]), st.booleans(), st.integers(0, 2**31))
def test_suffix_with_a_memory_equals_off_cold_warm_and_after_eviction(motifs, repeats, budget, seeded, seed):
    prompts = [(m * repeats)[:120] for m in motifs]
    prompts += prompts  # every prompt again: the memory is warm for it now
    cfg = dict(max_tokens=24, **(dict(temperature=0.8, top_k=20, seed=seed) if seeded else {}))
    want = _off(prompts, **cfg)
    with Session.open(PowerConfig(spec_mode="suffix", spec_suffix_memory_tokens=budget, **cfg), model=REF) as s:
        got = [s.generate(p) for p in prompts]
        stats = s.proposer.memory.stats()
    assert [g.tokens for g in got] == want
    assert stats.tokens <= budget
    if budget == 24:
        assert stats.evicted_documents > 0  # 24 tokens: every request evicts an earlier one
    for g in got:  # every proposal names its source; the receipt counts each source's tokens
        p = g.receipt.to_dict()["proposer"]
        assert set(p["sources"]) <= {"request", "shared", "corpus"}
        assert sum(v["accepted"] for v in p["sources"].values()) == p["accepted"]


def test_a_warm_memory_proposes_from_earlier_requests():
    prompt = [5, 9, 13, 17, 21, 25, 29, 33]  # nothing repeats inside it
    with Session.open(PowerConfig(spec_mode="suffix", max_tokens=32, spec_suffix_memory_tokens=4096,
                                  trace=True), model=REF) as s:
        cold = s.generate(prompt)
        warm = s.generate(prompt)
    assert warm.tokens == cold.tokens
    sources = warm.receipt.to_dict()["proposer"]["sources"]
    assert sources["shared"]["accepted"] > 0
    assert warm.receipt.accepted > cold.receipt.accepted


def test_four_concurrent_requests_share_one_memory_and_equal_off():
    prompts = [[7, 8, 9, 10, 11] * 4, [20, 30, 40] * 6, [7, 8, 9, 10, 11] * 4, [50, 51, 52, 53] * 5] * 2
    want = _off(prompts, max_tokens=20)
    cfg = PowerConfig(spec_mode="suffix", max_tokens=20, spec_suffix_memory_tokens=100_000)
    engines = [Session.open_engine(4, cfg, model=REF),
               Session.independent_engine([Session.open(cfg, model=REF) for _ in range(4)])]
    for engine in engines:
        try:
            memories = {id(s.proposer.memory) for s in engine.sessions}
            assert len(memories) == 1  # one process, one model, one configuration: one memory
            got: list[tuple[int, ...] | None] = [None] * len(prompts)

            def run(i: int, engine=engine, got=got) -> None:
                got[i] = engine.run(engine.submit(prompts[i]))

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert [g.tokens for g in got] == want
        finally:
            engine.close()


def test_share_memory_attaches_an_embedders_memory():
    with Session.open(PowerConfig(spec_mode="suffix", max_tokens=16), model=REF) as a, \
            Session.open(PowerConfig(spec_mode="suffix", max_tokens=16), model=REF) as b:
        assert a.proposer.memory is None
        mem = SuffixMemory(vocabulary_digest(a.opened), budget_tokens=10_000)
        share_memory(mem, a, b)
        assert a.proposer.memory is mem and b.proposer.memory is mem
        prompt = [5, 9, 13, 17, 21, 25, 29, 33]
        first = a.generate(prompt)
        assert mem.stats().documents == 1  # learned when it finished
        second = b.generate(prompt)  # another session, at once: it drafts from a's answer
        assert second.tokens == first.tokens
        assert second.receipt.to_dict()["proposer"]["sources"]["shared"]["accepted"] > 0
    assert mem.stats().documents == 2
    with Session.open(PowerConfig(spec_mode="off"), model=REF) as off:
        with pytest.raises(ConfigError, match="spec_mode"):
            share_memory(mem, off)
    with Session.open(PowerConfig(spec_mode="suffix"), model="reference:seed=11,vocab=101,dim=16") as other:
        with pytest.raises(ArtifactMismatch):
            share_memory(mem, other)


# -- tenants, end to end: what the trace shows ----------------------------------------------------------------
def test_tenant_b_text_never_reaches_tenant_a_unless_sharing_is_on():
    rng = np.random.default_rng(5)
    x = rng.integers(3, 90, 20).tolist()
    with Session.open(PowerConfig(spec_mode="off", max_tokens=1), model=REF) as s:
        t1 = s.generate(x).tokens[0]  # what the model emits after x
    y = rng.integers(3, 90, 30).tolist()  # B's secret: it follows x and t1 only in B's prompt
    b_prompt = x + [t1] + y

    def a_rounds(share: bool, b_tenant: str) -> list[dict]:
        cfg = PowerConfig(spec_mode="suffix", max_tokens=24, trace=True, spec_suffix_memory_tokens=100_000,
                          spec_suffix_learn_prompts=True, spec_suffix_share_tenants=share)
        with Session.open(cfg, model=REF) as s:
            s.start(b_prompt, tenant=b_tenant).run()
            res = s.start(x, tenant="a").run()
        return res.receipt.to_dict()["rounds"]

    def leaked(rounds: list[dict]) -> bool:
        secret = {tuple(y[i:i + 3]) for i in range(len(y) - 2)}
        return any(tuple(r.get("proposal", [])[i:i + 3]) in secret for r in rounds for i in range(len(r.get("proposal", []))))

    isolated = a_rounds(share=False, b_tenant="b")
    assert not leaked(isolated) and all(r.get("source") in (None, "request") for r in isolated)
    with Session.open(PowerConfig(spec_mode="suffix", max_tokens=24, trace=True), model=REF) as s:
        s.start(b_prompt, tenant="b").run()  # the same acceptance statistics, no memory at all
        cold = s.start(x, tenant="a").run().receipt.to_dict()["rounds"]
    assert [r.get("proposal") for r in isolated] == [r.get("proposal") for r in cold]  # as if B's text never was
    shared = a_rounds(share=True, b_tenant="b")
    same_tenant = a_rounds(share=False, b_tenant="a")
    for rounds in (shared, same_tenant):
        assert rounds[1].get("source") == "shared" and rounds[1]["proposal"] == y[: len(rounds[1]["proposal"])]
        assert leaked(rounds)


def test_a_thousand_requests_keep_the_memory_within_its_budget():
    rng = np.random.default_rng(9)
    budget = 512
    cfg = PowerConfig(spec_mode="suffix", max_tokens=6, spec_suffix_memory_tokens=budget,
                      spec_suffix_learn_prompts=True)
    with Session.open(cfg, model=REF) as s:
        memory = s.proposer.memory
        for i in range(1000):
            prompt = rng.integers(3, 90, int(rng.integers(2, 40))).tolist()
            s.start(prompt, tenant=f"t{i % 5}").run()
            if i % 50 == 49:
                assert memory.stats().tokens <= budget
        stats = memory.stats()
    assert stats.tokens <= budget and stats.evicted_documents > 900 and stats.tenants == 5


@settings(max_examples=8, deadline=None)
@given(st.lists(st.lists(st.integers(3, 90), min_size=2, max_size=5), min_size=4, max_size=8),
       st.integers(2, 5), st.sampled_from([40, 100_000]), st.booleans())
def test_concurrent_requests_sharing_a_memory_equal_off(motifs, repeats, budget, independent):
    prompts = [(m * repeats)[:60] for m in motifs]
    prompts += prompts[:4]  # some come back while others still run
    want = _off(prompts, max_tokens=16)
    cfg = PowerConfig(spec_mode="suffix", max_tokens=16, spec_suffix_memory_tokens=budget)
    engine = (Session.independent_engine([Session.open(cfg, model=REF) for _ in range(4)]) if independent
              else Session.open_engine(4, cfg, model=REF))
    try:
        got: list = [None] * len(prompts)

        def run(i: int) -> None:
            got[i] = engine.run(engine.submit(prompts[i], tenant=f"t{i % 2}"))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        memory = engine.sessions[0].proposer.memory
        assert [g.tokens for g in got] == want and memory.stats().tokens <= budget
    finally:
        engine.close()


def test_a_store_that_cannot_be_written_is_a_typed_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="spec_suffix_store"):
        Session.open(PowerConfig(spec_mode="suffix", spec_suffix_memory_tokens=100,
                                 spec_suffix_store=str(blocker)), model=REF)
    mem = SuffixMemory("v", budget_tokens=100)
    mem.learn("", [1, 2, 3])
    with pytest.raises(ArtifactError, match="cannot write") as err:
        mem.save(blocker / "store")
    assert err.value.code == "suffix_store_unwritable" and blocker.read_text() == "not a directory"
