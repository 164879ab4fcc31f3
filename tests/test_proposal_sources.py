"""``/metrics`` counts the draft and accepted tokens of each proposal source (``Proposal.source``)."""

from __future__ import annotations

import pytest

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
