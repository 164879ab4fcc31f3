"""One contract discriminator (``discriminate_draft``) behind ``classify_draft`` and the opening checks of the
DFlash v1, DFlash2 and DSpark validators; one Strategy factory (``block_strategy``) behind their plugins."""

import pytest

from power_core.artifacts import ArtifactView
from power_core.artifacts.contracts import BLOCK_CONTRACTS, classify_draft, discriminate_draft
from power_core.errors import ArtifactError, ArtifactMismatch

DRAFTS = ("dflash", "dflash2", "dspark")


@pytest.mark.parametrize("found", DRAFTS)
def test_classify_is_the_discriminator_without_an_expected_contract(fixtures_dir, found):
    view = ArtifactView.from_gguf(fixtures_dir[found])
    assert classify_draft(view) == discriminate_draft(view)
    assert classify_draft(view)[0] == found


@pytest.mark.parametrize("expect", DRAFTS)
@pytest.mark.parametrize("found", DRAFTS)
def test_expected_contract(fixtures_dir, expect, found):
    view = ArtifactView.from_gguf(fixtures_dir[found])
    if expect == found:
        assert discriminate_draft(view, expect)[0] == found
        return
    with pytest.raises(ArtifactError) as ei:
        discriminate_draft(view, expect)
    want = "dflash_v1" if found == "dflash" else found
    assert ei.value.reason == f"contract_is_{want}"
    assert f"not {BLOCK_CONTRACTS[expect]}; use spec_mode '{found}'" in str(ei.value)


@pytest.mark.parametrize("expect", DRAFTS)
def test_missing_draft(expect):
    with pytest.raises(ArtifactMismatch, match=f"spec_mode '{expect}' needs a {BLOCK_CONTRACTS[expect]} draft file") as ei:
        discriminate_draft(None, expect)
    assert ei.value.reason == "draft_missing"


def test_unknown_expected_contract(fixtures_dir):
    with pytest.raises(ValueError, match="mtp"):
        discriminate_draft(ArtifactView.from_gguf(fixtures_dir["dflash"]), "mtp")


@pytest.mark.parametrize("expect", DRAFTS)
def test_validators_open_with_the_discriminator(fixtures_dir, expect):
    """Each validator rejects a foreign draft with exactly the discriminator's error."""
    import importlib

    validate = getattr(importlib.import_module(f"power_{expect}.validate"), f"validate_{expect}")
    target = ArtifactView.from_gguf(fixtures_dir["target_plain"])
    for found in DRAFTS:
        if found == expect:
            continue
        view = ArtifactView.from_gguf(fixtures_dir[found])
        with pytest.raises(ArtifactError) as by_validator:
            validate(target, view)
        with pytest.raises(ArtifactError) as by_discriminator:
            discriminate_draft(view, expect)
        assert (by_validator.value.reason, str(by_validator.value)) == (
            by_discriminator.value.reason, str(by_discriminator.value))


@pytest.mark.parametrize("name", DRAFTS)
def test_plugins_register_through_the_block_strategy_factory(name):
    import importlib

    plugin = importlib.import_module(f"power_{name}.plugin")
    got = []
    plugin.power_register_strategies(got.append)
    (s,) = got
    assert (s.name, s.package, s.kind, s.needs_draft, s.backends) == (
        name, f"power-{name}", "model-backed", True, frozenset({"llama"}))
    assert s.proposer.__qualname__.startswith("block_strategy.")
    assert callable(s.target_features) and s.target_features.__qualname__.startswith("block_strategy.")
    assert s.validate.__name__ == f"validate_{name}"
