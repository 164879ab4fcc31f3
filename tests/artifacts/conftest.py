from pathlib import Path

import pytest

from power_core.artifacts import synthetic


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("POWER_CACHE_DIR", str(tmp_path_factory.mktemp("power-cache")))
    monkeypatch.delenv("POWER_REQUIRE_BINDING", raising=False)


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory) -> dict[str, Path]:
    return synthetic.write_fixture_set(tmp_path_factory.mktemp("fixtures"))


@pytest.fixture
def fx(fixtures_dir, tmp_path) -> dict[str, Path]:
    """A private copy per test (binding tests write sidecars next to the files)."""
    out = {}
    for role, p in fixtures_dir.items():
        q = tmp_path / p.name
        q.write_bytes(p.read_bytes())
        out[role] = q
    return out
