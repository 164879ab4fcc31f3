"""Config validation, the position-indexed sampler, and the receipt format."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from power_core.config import PowerConfig
from power_core.errors import ConfigError
from power_core.receipt import token_digest
from power_core.rounds import RoundRecord, TokenLogprob
from power_core.runtime import ProposerCapabilities, TargetCapabilities, runtime_counters
from power_core.sampling import TargetSampler
from tests.helpers import check_host_split, open_session, run


@pytest.mark.parametrize("kw,key", [
    (dict(spec_draft_max=0), "spec_draft_max"),
    (dict(spec_draft_max=65), "spec_draft_max"),
    (dict(spec_draft_max=True), "spec_draft_max"),
    (dict(spec_draft_max=3, spec_recurrent_snapshots=4), "spec_recurrent_snapshots"),
    (dict(spec_recurrent_snapshots=0), "spec_recurrent_snapshots"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(min_p=1.0), "min_p"),
    (dict(spec_mode="off", spec_adaptive=True), "spec_adaptive"),
    (dict(spec_mode="dflash", spec_mtp_fr_vocab_size=8192), "spec_mtp_fr_vocab_size"),
    (dict(spec_adaptive="yes"), "spec_adaptive"),
    (dict(spec_mode="UPPER"), "spec_mode"),
    (dict(n_gpu_layers=-2), "n_gpu_layers"),
    (dict(n_gpu_layers=1.0), "n_gpu_layers"),
    (dict(n_gpu_layers=True), "n_gpu_layers"),
    (dict(draft_gpu_layers=-2), "draft_gpu_layers"),
    (dict(draft_gpu_layers="all"), "draft_gpu_layers"),
    (dict(devices=3), "devices"),
    (dict(devices=["CUDA0", ""]), "devices"),
    (dict(devices="CUDA0,CUDA0"), "devices"),
    (dict(flash_attn="yes"), "flash_attn"),
    (dict(flash_attn=True), "flash_attn"),
])
def test_config_errors_name_key_value_and_range(kw, key):
    with pytest.raises(ConfigError) as err:
        PowerConfig(**kw)
    assert err.value.key == key and key in str(err.value) and "allowed" in str(err.value)


def test_config_unknown_key_and_toml(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'temperature'"):
        PowerConfig.from_mapping({"temprature": 0.5})
    f = tmp_path / "c.toml"
    f.write_text('[power]\nspec_mode = "mtp"\nspec_draft_max = 7\nspec_mtp_recurrent_snapshots = 6\n'
                 "spec_mtp_fr_vocab_size = 8192\n")
    cfg = PowerConfig.from_toml(f, seed=3)
    assert (cfg.spec_mode, cfg.snapshots, cfg.spec_mtp_fr_vocab_size, cfg.seed) == ("mtp", 6, 8192, 3)
    assert cfg.digest() == PowerConfig.from_toml(f, seed=3).digest() != PowerConfig.from_toml(f).digest()


def test_gpu_keys_defaults_forms_and_toml(tmp_path):
    cfg = PowerConfig()
    assert (cfg.n_gpu_layers, cfg.devices, cfg.flash_attn, cfg.draft_gpu_layers) == (0, (), "auto", 0)
    assert PowerConfig(devices=" CUDA0, CUDA1 ").devices == PowerConfig(devices=["CUDA0", "CUDA1"]).devices == (
        "CUDA0", "CUDA1")
    f = tmp_path / "gpu.toml"
    f.write_text('n_gpu_layers = -1\ndevices = ["CUDA1"]\nflash_attn = "on"\ndraft_gpu_layers = 4\n')
    cfg = PowerConfig.from_toml(f)
    assert (cfg.n_gpu_layers, cfg.devices, cfg.flash_attn, cfg.draft_gpu_layers) == (-1, ("CUDA1",), "on", 4)
    assert cfg.digest() != PowerConfig().digest()
    assert {"n_gpu_layers", "devices", "flash_attn", "draft_gpu_layers"} <= set(cfg.to_dict())


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.integers(0, 10_000), st.floats(0.05, 3.0), st.integers(0, 30),
       st.floats(0.05, 1.0), st.floats(0.0, 0.5))
def test_sampler_is_a_pure_function_of_row_position_and_seed(seed, pos, temp, top_k, top_p, min_p):
    row = np.random.default_rng(seed % 1000).normal(0, 3, 64).astype(np.float32)
    s = TargetSampler(temp, top_k, top_p, min_p, seed)
    tok = s.sample(row, pos)
    assert tok == s.sample(row.copy(), pos)
    assert 0 <= tok < 64
    if top_k:
        assert tok in np.argsort(-row, kind="stable")[:top_k]


def test_sampler_distribution_matches_softmax():
    row = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float64)).astype(np.float32)
    s = TargetSampler(temperature=1.0, seed=1)
    counts = np.bincount([s.sample(row, p) for p in range(6000)], minlength=3) / 6000
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


def _sample_by_full_sort(s: TargetSampler, row: np.ndarray, position: int) -> int:
    """The sampler as it was: the whole vocabulary sorted (descending logit, ascending id), cut to its first top-k,
    normalized in that order, cut by top-p and min-p, then the inverse CDF of the kept ones."""
    x = np.asarray(row, dtype=np.float64)
    cand = np.arange(x.shape[0])
    cand = cand[np.lexsort((cand, -x[cand]))]
    if 0 < s.top_k < x.shape[0]:
        cand = cand[: s.top_k]
    z = x[cand] / s.temperature
    z -= z[0]
    p = np.exp(z)
    p /= p.sum()
    keep = p.shape[0]
    if s.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(p), s.top_p)) + 1)
    if s.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(p >= s.min_p * p[0]))))
    cdf = np.cumsum(p[:keep])
    return int(cand[min(int(np.searchsorted(cdf, s.uniform(position) * cdf[-1], side="right")), keep - 1)])


def test_sampling_the_whole_vocabulary_sorts_only_its_head():
    """Without top-k, the sampler sorts only the head of the order that the draw and the cuts reach (from the 64
    largest logits up, the whole row when that is cheaper): the tokens of the full sort. Peaked rows (decided
    in the head), flat ones (the head grows, then the whole row), ties around the head's last value, masked
    (-inf) ids, small and large vocabularies; deterministic cases, so no draw can flake."""
    rng = np.random.default_rng(0)
    for case in range(700):
        n = int(rng.choice([5, 65, 600, 2000, 20_000]))
        row = (rng.standard_normal(n) * float(rng.choice([0.3, 2.0, 6.0]))).astype(np.float32)
        if case % 2:  # peaked: a few tokens far above the rest, as a language model's logits
            row[rng.integers(0, n, 5)] += rng.uniform(5, 20, 5).astype(np.float32)
        if case % 3 == 0:  # ties, also at the head's last value
            row = np.round(row).astype(np.float32)
        if case % 5 == 0:
            row[rng.integers(0, n, n // 3)] = -np.inf
        s = TargetSampler(float(rng.choice([0.3, 0.8, 1.0, 2.0, 6.0])), 0, float(rng.choice([1.0, 0.9, 0.5, 0.999])),
                          float(rng.choice([0.0, 0.0, 0.05, 1e-4])), int(rng.integers(0, 2**31)))
        for pos in range(4):
            assert s.sample(row, pos) == _sample_by_full_sort(s, row, pos), (case, n, s, pos)


def test_sampling_a_152k_vocabulary_takes_its_head_above_a_sampled_bound():
    """At a real vocabulary (151,936) the head is every logit at or above a bound from a strided sample of the row:
    the tokens of the full sort, for peaked rows, rows whose sampled entries are all low (the bound then holds too
    many: the 64 largest instead), rows of ties and masked rows."""
    rng = np.random.default_rng(1)
    n = 151_936
    for case in range(8):
        row = (rng.standard_normal(n) * 2.0).astype(np.float32)
        row[rng.integers(0, n, 20)] += rng.uniform(4, 14, 20).astype(np.float32)
        if case % 4 == 1:
            row[::37] = -30.0  # every strided entry far below the rest
        if case % 4 == 2:
            row = np.round(row).astype(np.float32)
        if case % 4 == 3:
            row[rng.integers(0, n, n // 2)] = -np.inf
        s = TargetSampler(float(rng.choice([0.7, 1.0, 1.5])), 0, float(rng.choice([1.0, 0.95])),
                          float(rng.choice([0.0, 0.05])), int(rng.integers(0, 2**31)))
        for pos in range(3):
            assert s.sample(row, pos) == _sample_by_full_sort(s, row, pos), (case, s, pos)


def test_top_k_candidates_are_the_stable_orders_first_ties_and_all():
    """With top-k the candidates are the first top-k of the stable order (the lowest ids among values tied across the
    k-th place), drawn as the full sort draws them: small and 152k vocabularies, rounded rows (ties), masked ids."""
    rng = np.random.default_rng(3)
    for case in range(60):
        n = int(rng.choice([9, 500, 151_936]))
        row = (rng.standard_normal(n) * 2.0).astype(np.float32)
        row[rng.integers(0, n, 5)] += rng.uniform(3, 9, 5).astype(np.float32)
        if case % 2:
            row = np.round(row).astype(np.float32)  # ties across the k-th place
        if case % 5 == 0:
            row[rng.integers(0, n, n // 3)] = -np.inf
        s = TargetSampler(float(rng.choice([0.5, 1.0, 3.0])), int(rng.choice([2, 5, 40])), float(rng.choice([1.0, 0.9])),
                          float(rng.choice([0.0, 0.05])), int(rng.integers(0, 2**31)))
        for pos in range(3):
            assert s.sample(row, pos) == _sample_by_full_sort(s, row, pos), (case, n, s, pos)


def test_logprobs_top_ids_are_the_stable_orders_first_without_a_partition_of_the_row():
    """A logprobs row's top ids (``TokenLogprob.from_row``) are the first of the stable order (descending logit,
    ascending id): at a 152k vocabulary, where the head comes from a sampled bound, with ties across the cut (the
    lowest ids among them), masked ids, and at small vocabularies; the logprobs are the row's log-softmax."""
    rng = np.random.default_rng(2)
    for case in range(40):
        n = int(rng.choice([7, 300, 151_936]))
        row = (rng.standard_normal(n) * 2.0).astype(np.float32)
        row[rng.integers(0, n, 5)] += rng.uniform(4, 14, 5).astype(np.float32)
        if case % 3 == 1:  # ties everywhere, also across the n-th place
            row = np.round(row).astype(np.float32)
        if case % 3 == 2:  # a flat row: the head above the sampled bound holds too many (argpartition's ties)
            row = np.zeros(n, dtype=np.float32)
            row[rng.integers(0, n, 3)] = 1.0
        if case % 4 == 3:
            row[rng.integers(0, n, n // 2)] = -np.inf
        x = row.astype(np.float64)
        order = np.lexsort((np.arange(n), -x))
        lse = float(np.log(np.exp(x - x.max()).sum()) + x.max())
        for n_top in (1, 5, 20):
            got = TokenLogprob.from_row(row, int(order[3 % n]), n_top)
            want = order[: min(n_top, n)]
            assert [i for i, _ in got.top] == want.tolist(), (case, n, n_top)
            assert np.allclose([v for _, v in got.top], x[want] - lse)
            assert got.logprob == pytest.approx(float(x[order[3 % n]] - lse))


def test_greedy_is_argmax_first_max():
    row = np.array([0.0, 2.0, 2.0, 1.0], dtype=np.float32)
    assert TargetSampler().sample(row, 0) == 1


def test_token_digest_is_int32_little_endian_sha256():
    import hashlib

    assert token_digest([1, 256]) == hashlib.sha256(b"\x01\x00\x00\x00\x00\x01\x00\x00").hexdigest()


def test_receipt_fields_and_hash_stability():
    model = "reference:seed=4,vocab=60,dim=8,recurrent=1"
    a = run(model, [1, 2, 3], "ref-draft", "reference:accept=0.5", max_tokens=25, spec_draft_max=6,
            spec_recurrent_snapshots=4)
    b = run(model, [1, 2, 3], "ref-draft", "reference:accept=0.5", max_tokens=25, spec_draft_max=6,
            spec_recurrent_snapshots=4)
    d = a.receipt.to_dict()
    for key in ("schema", "config_sha256", "artifacts", "strategy", "backend", "rounds", "scheduler",
                "output_sha256", "timings", "summary", "receipt_sha256", "selection", "status"):
        assert key in d, key
    assert d["strategy"]["version"] and d["artifacts"]["target"]
    s = d["summary"]
    assert s["proposed"] == sum(r["proposed"] for r in d["rounds"]) and 0 <= s["acceptance"] <= 1
    assert s["verified_tokens_per_pass"] == pytest.approx(25 / len(d["rounds"]))
    assert a.receipt.digest() == b.receipt.digest()  # timings excluded
    assert json.loads(a.receipt.to_json())["receipt_sha256"] == a.receipt.digest()
    # the digest is sha256 of the canonical JSON: the receipt's dict without timings and round seconds, keys
    # sorted, no whitespace (orjson's; for this receipt the standard library's JSON spells the same bytes)
    canonical = {k: v for k, v in d.items() if k not in ("timings", "receipt_sha256")}
    canonical["rounds"] = [{k: v for k, v in r.items() if k != "seconds"} for r in d["rounds"]]
    blob = orjson.dumps(canonical, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    assert blob == json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    assert a.receipt.digest() == hashlib.sha256(blob).hexdigest()
    assert a.receipt.canonical_bytes == len(blob)
    d["rounds"][0]["proposed"] = -1  # to_dict is a copy: changing it leaves the receipt as it was
    d["backend"]["name"] = "changed"
    assert a.receipt.rounds[0]["proposed"] != -1 and a.receipt.backend["name"] != "changed"
    assert a.receipt.to_dict()["receipt_sha256"] == b.receipt.digest()


@given(proposal=st.none() | st.lists(st.integers(0, 9), max_size=3).map(tuple),
       width=st.none() | st.just({"offered": 3, "chosen": 2}), cut=st.integers(0, 2),
       source=st.none() | st.just("request"), stats=st.none() | st.just({"draft_passes": 2.0}))
def test_a_round_record_in_the_receipt_is_its_fields(proposal, width, cut, source, stats):
    """``RoundRecord.to_dict`` (a literal, for speed) holds every field in declaration order, the optional ones
    only when set, its dicts and the proposal copied: a field added to the record and not to it fails here."""
    import attrs

    rec = RoundRecord(index=3, planned=4, reason="balanced", proposed=2, accepted=1, emitted=2, replayed=False,
                      shape=3, stop=None, seconds=0.5, proposal=proposal, width=width, cut=cut, source=source,
                      stats=stats)
    full = attrs.asdict(rec, recurse=False)
    optional = {"proposal": proposal is not None, "width": width is not None, "cut": bool(cut),
                "source": source is not None, "stats": stats is not None}
    want = {k: (list(v) if k == "proposal" else v) for k, v in full.items() if optional.get(k, True)}
    got = rec.to_dict()
    assert got == want and list(got) == list(want)
    for key in ("width", "stats"):
        if key in got:
            assert got[key] is not getattr(rec, key)


def test_receipt_rollback_counts_are_the_requests_own():
    # backend.rollback once held the target's live session-wide counters: every receipt of a session
    # showed the running totals. Each request now reports its own share, as a fresh session would.
    model, draft = "reference:seed=4,vocab=60,dim=8,recurrent=1", "reference:accept=0.5"
    cfg = dict(spec_draft_max=4, spec_recurrent_snapshots=1)  # K > S: some rollbacks restore and replay
    requests = [([7, 8, 9, 10], 40), ([5, 6], 30)]
    with open_session(model, "ref-draft", draft, **cfg) as s:
        shared = [s.generate(p, max_tokens=n).receipt for p, n in requests]
    alone = [run(model, p, "ref-draft", draft, max_tokens=n, **cfg).receipt for p, n in requests]
    counts = [r.backend["rollback"] for r in shared]
    assert counts == [r.backend["rollback"] for r in alone]
    for r, c in zip(shared, counts, strict=True):
        assert set(c) == {"rollback_in_place", "rollback_restored", "restores", "decodes"}
        # a rollback the window could not hold is restored and replayed, and each pass is one decode
        assert c["rollback_restored"] == r.scheduler["replays"] > 0 and c["rollback_in_place"] > 0
        assert c["decodes"] == r.timings["target_passes"] + 1  # + the one-chunk prefill
    assert counts[0] != counts[1]
    assert shared[1].backend["rollback"]["decodes"] < sum(c["decodes"] for c in counts)  # not the totals
    assert shared[0].digest() == alone[0].digest() and shared[1].digest() == alone[1].digest()


def test_runtime_counters_are_optional():
    class Target:
        def __init__(self, **abilities: Any) -> None:
            self.capabilities = TargetCapabilities(name="t", n_vocab=8, n_ctx=8, max_block=2, rollback_window=None,
                                                   **abilities)

    assert runtime_counters(Target()) == {}  # type: ignore[arg-type]
    counting = Target(counters=lambda: {"decodes": np.int64(3)})
    assert runtime_counters(counting) == {"decodes": 3} and type(runtime_counters(counting)["decodes"]) is int  # type: ignore[arg-type]


def check_proposer_stats(receipt: Any) -> dict[str, Any]:
    """The receipt's ``proposer`` section: one shape for every proposer, consistent with its rounds."""
    d = receipt.to_dict()
    p = d["proposer"]
    assert set(p) == {"drafts", "drafted", "accepted", "accepted_per_position", "sources", "stats"}, p
    rounds = d["rounds"]
    assert p["drafts"] == sum(1 for r in rounds if (r.get("width") or {}).get("offered", r["proposed"]) > 0)
    assert p["accepted"] == d["summary"]["accepted"] and p["drafted"] >= d["summary"]["proposed"]
    per = p["accepted_per_position"]
    assert sum(per) == p["accepted"] and all(a >= b for a, b in zip(per, per[1:], strict=False))
    assert not per or per[0] <= p["drafts"]
    assert p == receipt.proposer
    return p


@pytest.mark.parametrize("mode,draft", [("off", None), ("ref-draft", "reference:accept=0.5"),
                                        ("ref-draft", "reference:accept=1.0")])
def test_proposer_statistics_in_every_receipt(mode, draft):
    model = "reference:seed=4,vocab=60,dim=8"
    res = run(model, [1, 2, 3], mode, draft, max_tokens=25, spec_draft_max=4)
    p = check_proposer_stats(res.receipt)
    if mode == "off":
        assert p == {"drafts": 0, "drafted": 0, "accepted": 0, "accepted_per_position": [], "sources": {}, "stats": {}}
        return
    assert p["drafts"] > 0 and p["drafted"] == res.receipt.proposed
    assert len(p["accepted_per_position"]) <= 4
    if draft.endswith("1.0"):  # every proposal accepted: each position counts every draft that offered it
        assert p["accepted"] == p["drafted"] and p["accepted_per_position"][0] == p["drafts"]


def test_proposer_statistics_from_rounds():
    from power_core.receipt import proposer_stats

    rounds = [{"proposed": 0, "accepted": 0}, {"proposed": 3, "accepted": 1},
              {"proposed": 2, "accepted": 2, "width": {"offered": 4, "chosen": 2}},
              {"proposed": 0, "accepted": 0, "width": {"offered": 2, "chosen": 0}}]
    assert proposer_stats(rounds) == {"drafts": 3, "drafted": 9, "accepted": 3, "accepted_per_position": [2, 1, 0, 0],
                                      "sources": {}, "stats": {}}
    # a proposal's source and statistics (Proposal.source, .stats) are counted and summed per request
    rounds = [{"proposed": 0, "accepted": 0, "stats": {"n": 1.0}},
              {"proposed": 3, "accepted": 1, "source": "a", "stats": {"n": 2.0, "m": 0.5}},
              {"proposed": 2, "accepted": 2, "source": "b", "width": {"offered": 4, "chosen": 2}},
              {"proposed": 1, "accepted": 1, "source": "a"}]
    got = proposer_stats(rounds)
    assert got["sources"] == {"a": {"drafts": 2, "drafted": 4, "accepted": 2}, "b": {"drafts": 1, "drafted": 4, "accepted": 2}}
    assert got["stats"] == {"m": 0.5, "n": 3.0}


@pytest.mark.parametrize("mode,draft", [("off", None), ("ref-draft", "reference:accept=0.5")])
def test_receipt_splits_decode_time_into_compute_and_host(mode, draft):
    """The reference target times its passes (``TargetCapabilities.compute_seconds``); its draft proposer has no compute clock
    (it computes on the host), so its work is host time."""
    res = run("reference:seed=4,vocab=60,dim=8", [1, 2, 3], mode, draft, max_tokens=25, spec_draft_max=4)
    t = check_host_split(res.receipt, draft_timed=False)
    assert t["target_compute_s"] < t["decode_s"]


def test_a_timed_proposer_counts_as_draft_compute():
    from power_core.generation import DecodeClock

    class Timed:
        def __init__(self, timed: bool = True) -> None:
            self.s = 0.0
            clock = self.compute_seconds if timed else None
            self.capabilities = TargetCapabilities(name="t", n_vocab=8, n_ctx=8, max_block=2, rollback_window=None,
                                                   compute_seconds=clock)

        def compute_seconds(self) -> float:
            return self.s

    class Proposer(Timed):
        def __init__(self) -> None:
            super().__init__()
            self.capabilities = ProposerCapabilities(compute_seconds=self.compute_seconds)  # type: ignore[assignment]

    target, proposer = Timed(), Proposer()
    clock = DecodeClock()
    clock.bind(target, proposer)  # type: ignore[arg-type]
    c0 = clock.read()
    target.s, proposer.s = 0.5, 0.25
    clock.lap(c0, clock.read())
    assert clock.timings(1.0) == {"target_compute_s": 0.5, "draft_compute_s": 0.25, "host_s": 0.25,
                                  "decode_rounds": 1, "host_us_per_round": 250000.0}
    clock.bind(Timed(timed=False), None)  # type: ignore[arg-type]  # a target without a clock
    clock.lap(clock.read(), clock.read())
    assert clock.timings(1.0) == {}
