"""Power's llama.cpp runtime: Cython bindings into the pinned llama.cpp (``power_native._llama``),
:class:`~power_native.target.LlamaTarget`, the ``llama`` backend and the ``draft-model`` proposer.

Plugin packages compile against ``get_include()`` (the ``.pxd`` files plus ``llama.h``,
``llama-ext.h`` and ``ggml`` headers) and link ``libllama`` from ``get_library_dir()``.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

__all__ = ["get_include", "get_library_dir", "build_info", "__version__"]
__version__ = "0.1.0"

_HERE = Path(__file__).resolve().parent


def get_include() -> list[str]:
    """Include directories for ``cimport power_native.llama`` and the C/C++ headers."""
    return [str(_HERE.parent), str(_HERE / "include")]


def get_library_dir() -> str:
    """The directory holding ``libllama.so.0`` and ``libggml*.so.0`` (link with ``-lllama``)."""
    return str(_HERE)


@cache
def build_info() -> dict:
    """The pinned source and build flags this extension was compiled against."""
    path = _HERE / "build-info.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    return {k: info.get(k) for k in ("sdist", "sdist_sha256", "llama_cpp_commit", "flags", "patches")}
