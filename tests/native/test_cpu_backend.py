"""How power-native reaches llama.cpp's CPU backend: loaded from its own folder at import, its Power
switches found through ggml's backend registry (patch 0007), never linked — so the same extension runs on
a build that links one ggml-cpu and on the wheels' one module per CPU variant (tests/wheels/check_wheels.py
runs the latter)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import power_native
import pytest
from power_native import _llama


def test_the_cpu_backend_is_a_file_of_this_package():
    name = _llama.cpu_backend()
    assert name.startswith("libggml-cpu"), name
    assert (Path(power_native.get_library_dir()) / name).is_file(), name


def test_the_batch_invariant_switch_goes_through_the_registry():
    before = _llama.batch_invariant()
    try:
        for on in (True, False, True):
            _llama.set_batch_invariant(on)
            assert _llama.batch_invariant() is on
    finally:
        _llama.set_batch_invariant(before)


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) reads the extension's NEEDED")
def test_the_extension_does_not_link_ggml_cpu():
    """With GGML_BACKEND_DL there is no libggml-cpu to link: every CPU-backend call goes through the registry."""
    (ext,) = Path(power_native.get_library_dir()).glob("_llama*.so")
    dynamic = subprocess.run(["readelf", "-d", str(ext)], capture_output=True, text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line]
    assert "libllama.so.0" in needed
    assert not [n for n in needed if n.startswith("libggml-cpu")], needed
