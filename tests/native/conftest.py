"""Fixtures for the native tests: tiny synthetic GGUFs (llama, and qwen35 with recurrent layers).

Metadata is written with the PyPI ``gguf`` package using raw keys; every tensor is then created by
the arch's own loader and filled with seeded N(0, 0.1) through ``llama_model_init_from_user``, and
saved as a real GGUF with ``llama_model_save_to_file`` (LLAMACPP_NOTES §7.1-7.2).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("CI"):
    # CI installs power-native; there a broken extension must fail the run, not skip the native tier
    import power_native._llama  # noqa: F401
from native_helpers import make_tiny  # noqa: F401  (fixtures below build the tiny models)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-gguf")


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir) -> Path:
    return make_tiny(tiny_dir, "llama")


@pytest.fixture(scope="session")
def tiny_qwen35(tiny_dir) -> Path:
    return make_tiny(tiny_dir, "qwen35")


@pytest.fixture(scope="session", params=["llama", "qwen35"])
def tiny_model(request, tiny_llama, tiny_qwen35) -> Path:
    return {"llama": tiny_llama, "qwen35": tiny_qwen35}[request.param]
