"""``/metrics`` counts the draft and accepted tokens of each proposal source (``Proposal.source``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("prometheus_client")

from power_core.serve.jobs import Metrics  # noqa: E402
from power_core.transaction import RoundRecord  # noqa: E402


def _round(proposed: int, accepted: int, source: str | None) -> RoundRecord:
    return RoundRecord(index=1, planned=proposed, reason="k", proposed=proposed, accepted=accepted,
                       emitted=accepted + 1, replayed=False, shape=proposed + 1, stop=None, seconds=0.0,
                       source=source)


def test_metrics_count_tokens_by_source() -> None:
    m = Metrics()
    m.rounds([_round(4, 3, "shared"), _round(2, 0, "request"), _round(5, 5, "shared"), _round(3, 1, None),
              _round(0, 0, "corpus")])  # one request's rounds, summed before they reach the counters
    value = m.registry.get_sample_value
    assert value("power:spec_decode_num_accepted_tokens_by_source_total", {"source": "shared"}) == 8
    assert value("power:spec_decode_num_draft_tokens_by_source_total", {"source": "shared"}) == 9
    assert value("power:spec_decode_num_accepted_tokens_by_source_total", {"source": "request"}) == 0
    assert value("power:spec_decode_num_draft_tokens_by_source_total", {"source": "request"}) == 2
    assert value("power:spec_decode_num_accepted_tokens_by_source_total", {"source": "corpus"}) is None
    assert value("power:spec_decode_num_accepted_tokens_total") == 9


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), max_size=40))
def test_a_requests_rounds_count_their_accepted_positions_as_one_inc_each_would(spec: list[tuple[int, int]]) -> None:
    """The per-position counter takes a request's rounds at once (one increment per position): the same
    samples as one ``inc`` per accepted position of each draft."""
    rounds = [_round(p, min(a, p), None) for p, a in spec]
    m, ref = Metrics(), Metrics()
    m.rounds(rounds)
    for r in rounds:
        for pos in range(r.accepted if r.proposed else 0):
            ref.accepted_per_pos.labels(position=str(pos)).inc()

    def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        family = next(f for f in metrics.registry.collect() if f.name == "power:spec_decode_num_accepted_tokens_per_pos")
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples
                if not s.name.endswith("_created")}

    assert samples(m) == samples(ref)
