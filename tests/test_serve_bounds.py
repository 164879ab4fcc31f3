"""``power serve`` stays bounded whatever clients and proposers send (issue 44, item 6): receipts by
bytes as well as count, the proposal-source label's cardinality; and ``/metrics`` exports a proposer
memory's durable store (``--suffix-store``) through a typed seam, without the core naming the plugin."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

pytest.importorskip("prometheus_client")

from power_core.serve.jobs import SOURCE_LABELS_MAX, Metrics, ReceiptStore, proposer_stores  # noqa: E402
from power_core.transaction import RoundRecord  # noqa: E402
from tests.serve_helpers import asgi  # noqa: E402


def _sample(text: str, name: str, **labels: str) -> float | None:
    """A sample's value in Prometheus text (``None``: absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return None


# -- receipts: a byte budget besides the count ------------------------------------------------------------
def _env(rid: str) -> dict[str, Any]:
    return {"id": rid, "object": "power.receipt", "receipt": rid}


def test_receipts_are_bounded_by_bytes_oldest_first() -> None:
    store = ReceiptStore(capacity=100, budget_bytes=1000)
    for i in range(4):
        store.put(f"r{i}", _env(f"r{i}"), 300)
    assert store.usage() == (3, 900)  # the fourth pushed the first out
    assert store.get("r0") is None and store.get("r1") is not None and store.get("r3") is not None
    store.put("big", _env("big"), 700)  # the oldest go until it fits
    assert store.usage() == (2, 1000)
    assert store.get("r2") is None and store.get("r3") is not None and store.get("big") is not None
    store.put("r3", _env("r3"), 100)  # a re-put replaces its bytes, not adds them
    assert store.usage() == (2, 800)


def test_a_receipt_larger_than_the_whole_budget_is_not_kept_and_says_so() -> None:
    store = ReceiptStore(capacity=2, budget_bytes=1000)
    store.put("small", _env("small"), 10)
    store.put("huge", _env("huge"), 1001)
    assert store.get("huge") is None and store.too_large("huge") == 1001
    assert store.get("small") is not None and store.usage() == (1, 10)  # nothing else was evicted for it
    for i in range(3):  # the ids of those not kept are bounded by the count too
        store.put(f"huge{i}", _env("x"), 5000)
    assert store.too_large("huge") is None and store.too_large("huge2") == 5000


def test_the_count_bound_still_holds_and_annotations_are_counted() -> None:
    store = ReceiptStore(capacity=2, budget_bytes=10_000)
    for i in range(3):
        store.put(f"r{i}", _env(f"r{i}"), 10)
    assert store.usage() == (2, 20) and store.get("r0") is None
    store.annotate("r1", "audit", {"identical": True})
    kept, nbytes = store.usage()
    assert kept == 2 and nbytes > 20
    assert store.get("r1")["audit"] == {"identical": True}


def test_the_server_budgets_receipts_and_answers_410_for_one_too_large() -> None:
    from power_core.serve import ServeOptions, create_app
    from tests.helpers import open_session

    body = {"model": "m", "prompt": "abc", "max_tokens": 8}
    results = {}
    with open_session("reference", "ref-draft") as s:
        for budget in (64 << 20, 64):  # the default, and less than any receipt
            app = create_app(s.driver(), ServeOptions(model_name="m", receipts_bytes=budget))
            done = asgi(app, ("POST", "/v1/completions", body))[0]
            rid = done.json()["power"]["receipt_id"]
            got, missing, metrics = asgi(app, ("GET", f"/v1/receipts/{rid}", None),
                                          ("GET", "/v1/receipts/cmpl-nope", None), ("GET", "/metrics", None))
            app.state.power.executor.shutdown(wait=True)
            results[budget] = done, got, missing, metrics
    done, got, missing, metrics = results[64 << 20]
    assert got.status_code == 200 and got.json()["receipt"]["receipt_sha256"] == done.json()["power"]["receipt_sha256"]
    assert _sample(metrics.text, "power:receipts_kept") == 1
    assert 64 < _sample(metrics.text, "power:receipts_bytes") <= 64 << 20
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "receipt_not_found"
    done, got, missing, metrics = results[64]
    assert done.status_code == 200  # the response itself is whole; only the kept copy is refused
    err = got.json()["error"]
    assert got.status_code == 410 and err["code"] == "receipt_too_large" and err["param"] == "id"
    assert "--receipts-ram" in err["message"] and "was not kept" in err["message"]
    assert _sample(metrics.text, "power:receipts_kept") == 0 and _sample(metrics.text, "power:receipts_bytes") == 0


def test_an_answer_renders_its_receipt_once_and_the_store_counts_that(monkeypatch) -> None:
    """Between a request's end and its answer the receipt is rendered once, as the canonical JSON its digest
    (in the answer) hashes, and the store budgets those bytes; its full JSON is made only when asked for."""
    import hashlib
    import json

    import orjson

    from power_core.receipt import Receipt
    from power_core.serve import ServeOptions, create_app
    from tests.helpers import open_session

    renders: list[str] = []
    dumps, odumps = json.dumps, orjson.dumps

    def counted(obj: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(obj, dict) and "rounds" in obj and "output_sha256" in obj:  # a receipt's body
            renders.append("full")
        return dumps(obj, *args, **kwargs)

    def canonical_counted(obj: Any, *args: Any, **kwargs: Any) -> bytes:
        if isinstance(obj, dict) and "rounds" in obj and "output_sha256" in obj:
            renders.append("canonical")
        return odumps(obj, *args, **kwargs)

    monkeypatch.setattr("power_core.receipt.json.dumps", counted)
    monkeypatch.setattr("power_core.receipt.orjson.dumps", canonical_counted)
    kept: list[Receipt] = []
    with open_session("reference", "ref-draft") as s:
        app = create_app(s.driver(), ServeOptions(model_name="m"))
        done = asgi(app, ("POST", "/v1/completions", {"model": "m", "prompt": "abc", "max_tokens": 8}))[0]
        assert renders == ["canonical"]
        [(envelope, nbytes)] = app.state.power.receipts._items.values()
        kept.append(envelope["receipt"])
        rid = done.json()["power"]["receipt_id"]
        got = asgi(app, ("GET", f"/v1/receipts/{rid}", None))[0]
        app.state.power.executor.shutdown(wait=True)
    assert renders == ["canonical", "full"]  # the GET rendered it; the digest was not made again
    receipt = kept[0]
    canonical = odumps(receipt._body(False), option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    assert nbytes == receipt.canonical_bytes == len(canonical) > 64
    assert hashlib.sha256(canonical).hexdigest() == receipt.digest() == done.json()["power"]["receipt_sha256"]
    assert got.json()["receipt"]["receipt_sha256"] == receipt.digest()


def test_receipts_ram_must_be_at_least_one_mib(capsys) -> None:
    from power_core.cli import main

    assert main(["serve", "--backend", "reference", "--receipts-ram", "0"]) != 0
    assert "--receipts-ram must be at least 1" in capsys.readouterr().err


# -- the proposal-source label: bounded cardinality -------------------------------------------------------
def _round(proposed: int, accepted: int, source: str | None) -> RoundRecord:
    return RoundRecord(index=1, planned=proposed, reason="k", proposed=proposed, accepted=accepted,
                       emitted=accepted + 1, replayed=False, shape=proposed + 1, stop=None, seconds=0.0,
                       source=source)


def test_the_source_label_has_bounded_cardinality() -> None:
    m = Metrics()
    m.rounds([_round(2, 1, "request")])
    for i in range(SOURCE_LABELS_MAX * 4):  # a proposer that names every proposal differently
        m.rounds([_round(1, 1, f"doc-{i}")])
    m.rounds([_round(3, 2, "x" * 500)])  # not a short plain name: never a label of its own
    m.rounds([_round(3, 0, 'a"b\nc')])
    m.rounds([_round(2, 2, "request")])  # one labelled before keeps its label
    families = {f.name: f for f in m.registry.collect()}
    labels = {s.labels["source"] for s in families["power:spec_decode_num_accepted_tokens_by_source"].samples
              if s.name.endswith("_total")}
    assert len(labels) == SOURCE_LABELS_MAX + 1 and "other" in labels and "request" in labels
    value = m.registry.get_sample_value
    assert value("power:spec_decode_num_accepted_tokens_by_source_total", {"source": "request"}) == 3
    other = SOURCE_LABELS_MAX * 4 - (SOURCE_LABELS_MAX - 1)
    assert value("power:spec_decode_num_accepted_tokens_by_source_total", {"source": "other"}) == other + 2
    assert value("power:spec_decode_num_draft_tokens_by_source_total", {"source": "other"}) == other + 6
    assert value("power:spec_decode_num_accepted_tokens_total") == 3 + SOURCE_LABELS_MAX * 4 + 2


# -- a proposer memory's durable store in /metrics --------------------------------------------------------
@attrs.frozen
class _Report:
    path: str = "/s/suffix-memory.bin"
    open: bool = True
    healthy: bool = True
    bytes: int = 123
    records: int = 4
    appended: int = 3
    synced: int = 2
    syncs: int = 1
    compactions: int = 0
    last_sync_age_s: float | None = 0.5
    corrupt_moved_aside: int = 1
    torn_bytes_cut: int = 7
    stale_tmp_removed: int = 0
    write_errors: int = 2


@attrs.define
class _Memory:
    report: _Report | None
    asked: int = 0

    def store_stats(self) -> _Report | None:
        self.asked += 1
        return self.report


@attrs.define
class _Proposer:
    memory: Any


def test_store_counters_come_from_proposers_whose_memory_has_a_store() -> None:
    shared = _Memory(_Report())
    proposers = [_Proposer(shared), _Proposer(shared), _Proposer(None), _Proposer(_Memory(None)),
                 _Proposer(object()), object(), None, _Proposer(_Memory("not a report"))]  # type: ignore[arg-type]
    reports = proposer_stores(proposers)
    assert reports == [_Report()] and shared.asked == 1  # a memory the sessions share counts once
    m = Metrics()
    m.stores(reports)
    value = m.registry.get_sample_value
    store = {"store": "/s/suffix-memory.bin"}
    assert value("power:proposer_store_healthy", store) == 1
    assert value("power:proposer_store_corrupt_moved_aside", store) == 1
    assert value("power:proposer_store_torn_bytes_cut", store) == 7
    assert value("power:proposer_store_write_errors", store) == 2
    assert value("power:proposer_store_last_sync_age_seconds", store) == 0.5
    m.stores([attrs.evolve(_Report(), healthy=False, last_sync_age_s=None, write_errors=3)])
    assert value("power:proposer_store_healthy", store) == 0
    assert value("power:proposer_store_write_errors", store) == 3
    assert value("power:proposer_store_last_sync_age_seconds", store) is None


def test_a_suffix_store_is_in_metrics(tmp_path) -> None:
    """End to end with the suffix plugin: its ``SuffixProposer``/``SuffixMemory``/``StoreStats`` fit the seam."""
    pytest.importorskip("power_suffix")
    from power_core import PowerConfig, Session
    from power_core.serve import ServeOptions, create_app

    store = tmp_path / "store"
    cfg = PowerConfig(spec_mode="suffix", n_ctx=256, spec_suffix_memory_tokens=4096, spec_suffix_store=str(store),
                      spec_suffix_store_sync_requests=1)
    with Session.open(cfg, model="reference") as s:
        app = create_app(s.driver(), ServeOptions(model_name="m"))
        done, metrics = asgi(app, ("POST", "/v1/completions", {"model": "m", "prompt": "abcabcabc", "max_tokens": 8}),
                              ("GET", "/metrics", None))
        app.state.power.executor.shutdown(wait=True)
        path = s.proposer.memory.store_stats().path
    assert done.status_code == 200
    assert path.startswith(str(store))
    text = metrics.text
    assert _sample(text, "power:proposer_store_healthy", store=path) == 1
    assert _sample(text, "power:proposer_store_open", store=path) == 1
    assert _sample(text, "power:proposer_store_appended", store=path) >= 1
    for name in ("corrupt_moved_aside", "torn_bytes_cut", "write_errors", "stale_tmp_removed"):
        assert _sample(text, f"power:proposer_store_{name}", store=path) == 0, name


def test_no_store_no_store_metrics() -> None:
    from power_core.serve import ServeOptions, create_app
    from tests.helpers import open_session

    with open_session("reference", "ref-draft") as s:
        app = create_app(s.driver(), ServeOptions(model_name="m"))
        (metrics,) = asgi(app, ("GET", "/metrics", None))
        app.state.power.executor.shutdown(wait=True)
    assert "power:proposer_store_healthy{" not in metrics.text


def test_a_rounds_tokens_at_once_are_what_one_observation_each_records() -> None:
    """``RoundHistogram.observe_rounds`` (a request's rounds at once; a round's tokens share one latency) leaves
    every bucket, the count and the sum as ``n`` calls of ``observe`` a round do, at bucket bounds too."""
    from prometheus_client import CollectorRegistry, Histogram

    from power_core.serve.jobs import RoundHistogram

    bounds = (0.001, 0.01, 0.1, 1.0)
    many = RoundHistogram("many", "h", buckets=bounds, registry=CollectorRegistry())
    each = Histogram("each", "h", buckets=bounds, registry=CollectorRegistry())
    rounds = [(0.0005, 3), (0.001, 2), (0.0011, 5), (0.1, 1), (0.5, 4), (7.0, 2), (0.0, 1), (0.0011, 0)]
    many.observe_rounds(iter(rounds))
    for amount, n in rounds:
        for _ in range(n):
            each.observe(amount)
    got = {s.name.removeprefix("many") + str(s.labels): s.value for m in many.collect() for s in m.samples
           if not s.name.endswith("_created")}
    want = {s.name.removeprefix("each") + str(s.labels): s.value for m in each.collect() for s in m.samples
            if not s.name.endswith("_created")}
    assert got.keys() == want.keys() and len(got) == len(bounds) + 1 + 2
    assert all(got[k] == pytest.approx(want[k]) for k in got)
    assert got["_count{}"] == 18
