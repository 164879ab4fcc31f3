"""Fixtures for the native tests: tiny synthetic GGUFs (llama, and qwen35 with recurrent layers).

Metadata is written with the PyPI ``gguf`` package using raw keys; every tensor is then created by
the arch's own loader and filled with seeded N(0, 0.1) through ``llama_model_init_from_user``, and
saved as a real GGUF with ``llama_model_save_to_file`` (as llama.cpp's ``tests/test-llama-archs.cpp`` does).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("CI"):
    # CI installs power-native; there a broken extension must fail the run, not skip the native tier
    import power_native._llama  # noqa: F401
from native_helpers import make_tiny, make_tiny_mtp  # noqa: E402

from tests.helpers import build_tools  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def peer_bin() -> Path:
    """``bin/`` of the cached pinned build with llama.cpp's own tools (``--peers``, built on first use)."""
    tools = build_tools()
    bin_dir = tools.build_dir(False) / "bin"
    if not all((bin_dir / exe).exists() for exe in tools.PEER_TARGETS):
        subprocess.run([sys.executable, str(ROOT / "native" / "tools" / "build_llama.py"), "--peers"], check=True)
    for exe in tools.PEER_TARGETS:
        assert (bin_dir / exe).exists(), f"{bin_dir / exe} was not built"
    return bin_dir


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-gguf")


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir) -> Path:
    return make_tiny(tiny_dir, "llama")


@pytest.fixture(scope="session")
def tiny_qwen35(tiny_dir) -> Path:
    return make_tiny(tiny_dir, "qwen35")


@pytest.fixture(scope="session")
def tiny_qwen35_mtp(tiny_dir) -> Path:
    """qwen35 hybrid (recurrent rollback through n_rs_seq) + one MTP block."""
    return make_tiny_mtp(tiny_dir, "qwen35")


@pytest.fixture(scope="session")
def tiny_qwen3next_mtp(tiny_dir) -> Path:
    """qwen3next + one MTP block: not in llama.cpp's n_rs_seq list, so every rollback is a checkpoint."""
    return make_tiny_mtp(tiny_dir, "qwen3next")


@pytest.fixture(scope="session", params=["llama", "qwen35"])
def tiny_model(request, tiny_llama, tiny_qwen35) -> Path:
    return {"llama": tiny_llama, "qwen35": tiny_qwen35}[request.param]
