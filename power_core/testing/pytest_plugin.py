"""pytest plugin (entry point ``pytest11``) shipped with the conformance kit."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "power_conformance: a standard Power adapter conformance check")
