"""power-native's draft-model adapter runs the conformance kit exactly as a third party would, on tiny
llama.cpp targets: a pure-attention llama and a qwen35 hybrid whose recurrent rollback goes through
n_rs_seq (S < K then forces PARTIAL_ONLY checkpoint + replay on real llama.cpp)."""

from __future__ import annotations

import pytest

pytest.importorskip("power_native._llama")

from power_core.testing import AdapterConformance  # noqa: E402

pytestmark = pytest.mark.native


class _OnTinyModel(AdapterConformance):
    strategy_name = "draft-model"
    k = 4
    seeds = 6
    max_tokens = 24
    fixture_name = ""

    @pytest.fixture(autouse=True)
    def _tiny(self, request):
        path = str(request.getfixturevalue(self.fixture_name))
        self.model = path
        self.draft = path  # the target drafts for itself: every position is exercised


class TestDraftModelOnLlama(_OnTinyModel):
    fixture_name = "tiny_llama"


class TestDraftModelOnQwen35Hybrid(_OnTinyModel):
    fixture_name = "tiny_qwen35"

