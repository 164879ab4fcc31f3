"""The draft-model proposer and the plugin end to end through ``power_core.session.Session`` on tiny
synthetic models: target-only vs speculative parity, 100% acceptance when the target drafts for
itself, a different draft, vocabulary mismatch, and the registered backend/strategy."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

from native_helpers import make_tiny  # noqa: E402

from power_core.config import PowerConfig  # noqa: E402
from power_core.errors import ArtifactMismatch  # noqa: E402
from power_core.plugins import get_plugins  # noqa: E402
from power_core.session import Session  # noqa: E402
from tests.helpers import check_host_split  # noqa: E402

pytestmark = pytest.mark.native

PROMPT = [1, 17, 42, 99, 5, 63, 8]


def _cfg(mode: str, k: int = 4, s: int | None = None, n: int = 40) -> PowerConfig:
    return PowerConfig(spec_mode=mode, spec_draft_max=k, spec_recurrent_snapshots=s, max_tokens=n,
                       n_ctx=256, n_threads=2)


def test_plugin_registers_backend_and_strategy():
    plugins = get_plugins(refresh=True)
    assert "llama" in plugins.backends.names()
    st = plugins.strategy("draft-model")
    assert st.experimental and st.needs_draft and st.backends == frozenset({"llama"})
    assert plugins.backends["llama"].accepts(None) and plugins.backends["llama"].accepts("x.gguf")


@pytest.mark.parametrize("k,s", [(4, None), (4, 1)])
def test_self_draft_full_acceptance_and_parity(tiny_model, k, s):
    with Session.open(_cfg("off"), model=str(tiny_model)) as off:
        ref = off.generate(PROMPT)
    with Session.open(_cfg("draft-model", k, s), model=str(tiny_model), draft=str(tiny_model)) as spec:
        got = spec.generate(PROMPT)
        info = spec.opened.backend_info
    assert got.tokens == ref.tokens
    summary = got.receipt.summary()
    assert summary["proposed"] > 0 and summary["accepted"] == summary["proposed"], summary
    # the proposer's statistics, computed by the core (the native proposer keeps none): all accepted
    p = got.receipt.to_dict()["proposer"]
    assert set(p) == {"drafts", "drafted", "accepted", "accepted_per_position", "sources", "stats"}
    assert p["drafted"] == p["accepted"] == summary["proposed"] == sum(p["accepted_per_position"])
    assert p["drafts"] == p["accepted_per_position"][0] == sum(1 for r in got.receipt.rounds if r["proposed"])
    assert info["llama_cpp_commit"] and info["sdist_sha256"]
    check_host_split(ref.receipt, draft_timed=False)
    check_host_split(got.receipt, draft_timed=True)  # the draft context's decodes


def test_other_draft_exact_with_partial_acceptance(tiny_model, tiny_dir):
    other = make_tiny(tiny_dir, "llama", seed=7, name="llama-seed7")
    with Session.open(_cfg("off"), model=str(tiny_model)) as off:
        ref = off.generate(PROMPT)
    with Session.open(_cfg("draft-model", 4, 1), model=str(tiny_model), draft=str(other)) as spec:
        got = spec.generate(PROMPT)
    assert got.tokens == ref.tokens
    summary = got.receipt.summary()
    assert summary["proposed"] > 0 and summary["accepted"] < summary["proposed"]


def test_vocabulary_mismatch_is_refused(tiny_llama, tiny_dir):
    alien = make_tiny(tiny_dir, "llama", name="llama-othervocab", token_prefix="piece_")
    with pytest.raises(ArtifactMismatch) as err:  # the core's complete vocabulary comparison
        Session.open(_cfg("draft-model"), model=str(tiny_llama), draft=str(alien))
    assert err.value.code.startswith("vocab_") and "token" in str(err.value)


def test_self_draft_is_selected_and_bound_without_a_draft_argument(tiny_llama):
    with Session.open(_cfg("draft-model"), model=str(tiny_llama)) as s:
        assert "the target drafting for itself" in s.selection.reason
        res = s.generate(PROMPT)
    assert res.receipt.artifacts["target"] == res.receipt.artifacts["draft"]
    assert res.receipt.summary()["acceptance"] == 1.0


def test_repeated_requests_on_one_session(tiny_qwen35):
    with Session.open(_cfg("draft-model", 4, 2), model=str(tiny_qwen35), draft=str(tiny_qwen35)) as spec:
        a = spec.generate(PROMPT)
        b = spec.generate(PROMPT[:3])
        c = spec.generate(PROMPT)
    assert a.tokens == c.tokens and len(b.tokens) == 40
    assert np.all(np.asarray(a.tokens) < 128)
