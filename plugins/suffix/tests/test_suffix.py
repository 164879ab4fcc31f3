"""power-suffix: the index (exact matches, exact truncation), per-round draft length, exactness on the
reference backend (greedy and seeded, property-based), the cost-aware width and the conformance kit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from power_suffix.index import LENGTHS, SuffixIndex, _vote
from power_suffix.memory import SHARED_LENGTHS
from power_suffix.proposer import ALPHA, SuffixProposer

from power_core import PowerConfig, Session
from power_core.runtime import ProposalContext
from power_core.testing import AdapterConformance

REF = "reference:seed=11,vocab=97,dim=16,recurrent=1"


def brute_longest(tokens: list[int]) -> int:
    """Longest suffix of ``tokens`` that also ends at an earlier position (brute force)."""
    n, best = len(tokens), 0
    for e in range(n - 1):
        L = 0
        while L <= e and tokens[e - L] == tokens[n - 1 - L]:
            L += 1
        best = max(best, L)
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=60))
def test_match_length_is_the_longest_earlier_occurrence(tokens):
    ix = SuffixIndex()
    ix.extend(tokens)
    m = ix.match(8)
    best = brute_longest(tokens)
    if best == 0:
        assert m is None
    else:
        assert m is not None and m.length == best
        # every proposed token continues at least one earlier occurrence of that match
        ends = [e for e in range(len(tokens) - 1)
                if all(tokens[e - j] == tokens[-1 - j] for j in range(best)) and e >= best - 1]
        first = {tokens[e + 1] for e in ends if e + 1 < len(tokens)}
        assert m.tokens.size == 0 or int(m.tokens[0]) in first


def reference_vote(tok: list[int], ends: list[int], k: int) -> tuple[list[int], list[float]]:
    """The vote, spelled out: position by position, the token most of the still-agreeing occurrences
    continue with (ties: the smaller id) while it has at least half of all the occurrences' votes."""
    out, share, alive = [], [], list(ends)
    for j in range(1, k + 1):
        alive = [e for e in alive if e + j < len(tok)]
        if not alive:
            break
        counts: dict[int, int] = {}
        for e in alive:
            counts[tok[e + j]] = counts.get(tok[e + j], 0) + 1
        votes = max(counts.values())
        if votes / len(ends) < 0.5:
            break
        top = min(t for t, c in counts.items() if c == votes)
        out.append(top)
        share.append(votes / len(ends))
        alive = [e for e in alive if tok[e + j] == top]
    return out, share


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=90), st.data())
def test_vote_is_the_positionwise_majority(tokens, data):
    ends = sorted(set(data.draw(st.lists(st.integers(0, len(tokens) - 1), min_size=1, max_size=32))))
    k = data.draw(st.integers(1, 40))
    out, share = _vote(np.asarray(tokens, dtype=np.int32), len(tokens), np.asarray(ends, dtype=np.int64), k)
    ref_out, ref_share = reference_vote(tokens, ends, k)
    assert out == ref_out and share == ref_share


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=80), st.data())
def test_truncate_is_exact(tokens, data):
    cut = data.draw(st.integers(0, len(tokens)))
    ix = SuffixIndex()
    ix.extend(tokens)
    ix.truncate(cut)
    fresh = SuffixIndex()
    fresh.extend(tokens[:cut])
    assert ix.n == fresh.n and ix._pre == fresh._pre
    assert ix._head == fresh._head and ix._keys == fresh._keys and ix._prev == fresh._prev
    a, b = ix.match(16), fresh.match(16)
    assert (a is None) == (b is None)
    if a is not None:
        assert a.length == b.length and a.tokens.tolist() == b.tokens.tolist()


def _same_index(a: SuffixIndex, b: SuffixIndex) -> None:
    assert a.n == b.n and list(a._pre) == list(b._pre) and a.tokens.tolist() == b.tokens.tolist()
    assert a._head == b._head
    assert {L: list(v) for L, v in a._keys.items()} == {L: list(v) for L, v in b._keys.items()}
    assert {L: list(v) for L, v in a._prev.items()} == {L: list(v) for L, v in b._prev.items()}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=300), st.data(), st.booleans())
def test_chunked_extends_index_as_token_by_token(tokens, data, truncatable):
    """Many tokens at once take the vectorized path; the hashes and chains are the token-by-token ones."""
    lengths = LENGTHS if truncatable else SHARED_LENGTHS
    one = SuffixIndex(lengths, truncatable=truncatable)
    for t in tokens:
        one.extend([t])
    chunked = SuffixIndex(lengths, truncatable=truncatable)
    at = 0
    while at < len(tokens):
        k = data.draw(st.integers(1, 90))
        chunked.extend(tokens[at:at + k])
        at += k
    _same_index(one, chunked)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=120), st.lists(st.integers(0, 4), max_size=60), st.data())
def test_a_new_request_reuses_the_shared_prefix_exactly(first, tail, data):
    """``begin`` cuts the index back to what the new prompt shares with the previous request and indexes
    the rest: the same index as a fresh one's."""
    p = SuffixProposer()
    p.begin(np.asarray(first, dtype=np.int32))
    keep = data.draw(st.integers(0, len(first)))
    second = np.asarray(first[:keep] + tail + [9], dtype=np.int32)
    p.begin(second)
    fresh = SuffixIndex()
    fresh.extend(second)
    _same_index(p.index, fresh)


def test_a_repeating_history_proposes_its_period_on():
    """A match that overlaps itself (the history repeats with a period shorter than the match) goes on
    repeating past the present, instead of stopping where the history ends."""
    p = SuffixProposer()
    text = [40, 41, 42, 43] + [7, 8, 9] * 5
    p.begin(np.asarray(text, dtype=np.int32))
    ids = p.propose(ctx(text, k=10)).ids.tolist()
    assert ids == ([7, 8, 9] * 4)[:10]


def ctx(history, k=32):
    h = np.asarray(history, dtype=np.int32)
    return ProposalContext(history=h, anchor=int(h[-1]), k=k, round_index=1)


def test_long_unambiguous_matches_draft_long_short_ones_little():
    p = SuffixProposer()
    text = list(range(40)) + [90, 91] + list(range(20))  # the last 20 tokens copy the first 20
    p.begin(np.asarray(text, dtype=np.int32))
    proposal = p.propose(ctx(text))
    long = proposal.ids
    assert long.tolist() == (list(range(20, 40)) + [90, 91] + list(range(20)))[:32]  # k caps it
    assert proposal.confidence is not None and len(proposal.confidence) == long.size
    assert proposal.stats is not None and proposal.stats["match_length"] > 0
    short_hist = [7, 1, 2, 3, 8, 9, 5, 3]  # '3' occurred once, followed by 8: a one-token match
    p.begin(np.asarray(short_hist, dtype=np.int32))
    short = p.propose(ctx(short_hist)).ids
    assert 0 < short.size <= ALPHA * 1
    ambiguous = [5, 1, 2, 5, 3, 4, 5, 6, 7, 5]  # '5' was followed by 1, 3 and 6: no majority
    p.begin(np.asarray(ambiguous, dtype=np.int32))
    assert p.propose(ctx(ambiguous)).ids.size == 0


def test_explicit_draft_max_caps_and_the_default_is_the_strategys():
    prompt = list(range(1, 60)) * 3
    with Session.open(PowerConfig(spec_mode="suffix", max_tokens=16), model=REF) as s:
        assert s.config.spec_draft_max == 32
    with Session.open(PowerConfig(spec_mode="suffix", max_tokens=16, spec_draft_max=5), model=REF) as s:
        res = s.generate(prompt)
    assert res.receipt.config["spec_draft_max"] == 5
    assert max(r["proposed"] for r in res.receipt.rounds) <= 5


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(3, 20), min_size=1, max_size=24), st.integers(1, 24), st.integers(0, 2**31))
def test_suffix_equals_off_greedy_and_seeded(motif, repeats, seed):
    prompt = (motif * repeats)[:200]
    for cfg in (dict(), dict(temperature=0.9, top_k=20, seed=seed)):
        with Session.open(PowerConfig(spec_mode="off", max_tokens=40, **cfg), model=REF) as s:
            ref = s.generate(prompt).tokens
        with Session.open(PowerConfig(spec_mode="suffix", max_tokens=40, **cfg), model=REF) as s:
            got = s.generate(prompt)
        assert got.tokens == ref


def test_cost_aware_width_is_in_the_receipt():
    prompt = list(range(1, 80)) * 3
    with Session.open(PowerConfig(spec_mode="suffix", max_tokens=48), model=REF) as s:
        res = s.generate(prompt)
    widths = [r["width"] for r in res.receipt.rounds if "width" in r]
    assert widths and all(w["chosen"] <= w["offered"] for w in widths)
    assert res.receipt.scheduler["cost_aware"] is True
    # the proposer's statistics, in the core's one shape: offered tokens count as drafted
    p = res.receipt.to_dict()["proposer"]
    assert set(p) == {"drafts", "drafted", "accepted", "accepted_per_position", "sources", "stats"}
    assert p["drafts"] == len([w for w in widths if w["offered"] > 0])
    assert p["drafted"] == sum(w["offered"] for w in widths) >= res.receipt.proposed
    assert p["accepted"] == res.receipt.accepted == sum(p["accepted_per_position"])


def test_requests_are_independent_without_a_memory():
    p = SuffixProposer()
    first = np.asarray([50, 51, 52, 53, 54, 55, 56, 57], dtype=np.int32)
    p.begin(first)
    second = np.asarray([9, 50, 51, 52], dtype=np.int32)
    p.begin(second)
    assert p.propose(ctx(second)).ids.size == 0


class TestSuffixConformance(AdapterConformance):
    strategy_name = "suffix"
    model = REF
    k = 6

    def prompt(self, seed: int, n_vocab: int) -> list[int]:
        rng = np.random.default_rng(seed + 2000)
        motif = rng.integers(3, n_vocab - 1, size=int(rng.integers(2, 6))).tolist()
        return (motif * 6)[: int(rng.integers(4, 30))]


class TestSuffixCorpusConformance(AdapterConformance):
    """With a corpus the suffix proposer still keeps every contract of the kit: the corpus is fixed
    when the session opens, so proposals depend only on the history (and on the corpus). The corpus
    holds the ASCII runs of the model's own answers to other prompts, so it is drafted from."""

    strategy_name = "suffix"
    model = "reference:seed=11,vocab=300,dim=16,recurrent=1"  # a byte tokenizer: the corpus is text
    k = 6

    @pytest.fixture(autouse=True)
    def _corpus(self, tmp_path_factory):
        cls = type(self)
        if "corpus" in cls.__dict__:
            return
        d = tmp_path_factory.mktemp("corpus")
        runs: list[str] = []
        with Session.open(PowerConfig(spec_mode="off", max_tokens=64), model=self.model) as s:
            for seed in range(40, 52):
                out = s.generate(self.prompt(seed, 300)).tokens
                run: list[int] = []
                for t in (*out, 999):  # 999: ends the last run
                    if 32 <= t < 127:
                        run.append(t)
                        continue
                    if len(run) >= 3:
                        runs.append(bytes(run).decode())
                    run = []
        (d / "answers.txt").write_text("\n".join(runs))
        cls.corpus = str(d)

    def open(self, mode, *extra, wrap=None, stop_ids=None, **cfg):
        if mode == "suffix":
            cfg = {**cfg, "spec_suffix_corpus": [type(self).corpus]}
        return super().open(mode, *extra, wrap=wrap, stop_ids=stop_ids, **cfg)

    def prompt(self, seed: int, n_vocab: int) -> list[int]:
        rng = np.random.default_rng(seed + 3000)
        return rng.integers(97, 110, int(rng.integers(4, 30))).tolist()

    @pytest.mark.xfail(reason="the kit opens this check's engine from its own configuration, without the corpus, "
                              "so it offers what a fresh session without one does (sequences of one engine sharing "
                              "a memory: test_memory.py)", strict=True)
    def test_shared_passes_parity(self) -> None:
        super().test_shared_passes_parity()

    def test_the_corpus_is_drafted_from(self) -> None:
        with self.open("suffix") as s:
            sources = [s.generate(self.prompt(seed, 300)).receipt.to_dict()["proposer"]["sources"]
                       for seed in range(12)]
        assert any("corpus" in x for x in sources), sources
