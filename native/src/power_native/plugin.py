"""The ``power.adapters`` entry point of power-native: the ``llama`` backend and the experimental
``draft-model`` strategy."""

from __future__ import annotations

from pathlib import Path

from power_core.spec import Backend, Strategy, hookimpl
from power_native import __version__

__all__ = ["power_register_backends", "power_register_strategies", "accepts"]


def accepts(model: str | None) -> bool:
    """``None`` (the embedded SmolLM2), an embedded alias, a ``.gguf`` name or an existing path."""
    from power_native.models import EMBEDDED

    if model is None or model in EMBEDDED:
        return True
    return model.endswith(".gguf") or Path(model).expanduser().exists()


def _resolve(model: str | None) -> str:
    from power_native.models import resolve_model

    return str(resolve_model(model))


def _open(req):
    from power_native.backend import open_llama

    return open_llama(req)


def _open_batch(req, n):
    from power_native.backend import open_llama_batch

    return open_llama_batch(req, n)


def _draft(req):
    from power_native.draft import make_draft_proposer

    return make_draft_proposer(req)


@hookimpl
def power_register_backends(register) -> None:
    register(Backend(name="llama", version=__version__, package="power-native", open=_open, accepts=accepts,
                     summary="llama.cpp (pinned, via Cython) target runtime", priority=10,
                     resolve=_resolve, open_batch=_open_batch))


@hookimpl
def power_register_strategies(register) -> None:
    register(Strategy(name="draft-model", version=__version__, package="power-native",
                      summary="greedy drafts from a second GGUF with the same vocabulary (experimental)",
                      kind="model-backed", needs_draft=True, self_draft=True, proposer=_draft,
                      backends=frozenset({"llama"}), experimental=True))
