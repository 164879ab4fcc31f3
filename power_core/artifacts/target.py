"""The target's own check: what must hold before any backend loads a GGUF file as the target.

:meth:`ArtifactView.from_gguf` already proved the file is a well-formed GGUF whose every tensor
lies inside it (bounded header read; ``gguf_truncated``, ``gguf_tensor_out_of_bounds``,
``gguf_count_too_large``, ``gguf_bad_tensor_type``, ``gguf_bad_tensor_shape``,
``gguf_tensor_misaligned``, ...). A well-formed GGUF can still be no model the pinned llama.cpp
loads; this module adds those rules, each with a stable reason code:

* ``arch_missing`` — no ``general.architecture`` key;
* ``arch_unknown`` — an architecture the pinned llama.cpp cannot load (:data:`.archs.LLAMA_ARCHS`);
* ``target_no_tensors`` — a header without a single tensor is no model.

:func:`check_target` runs in :func:`power_core.selection.select` (so in ``power validate``,
``power run`` and ``Session.open``, before the backend opens the file) and in
:func:`power_core.artifacts.verify.verify_artifacts` (so in ``power bind``). It reads nothing
beyond the parsed header.
"""

from __future__ import annotations

from power_core.artifacts.archs import LLAMA_ARCHS, PINNED_LLAMA_CPP_COMMIT
from power_core.artifacts.view import ArtifactView
from power_core.errors import ArtifactError

__all__ = ["check_architecture", "check_target"]


def check_architecture(view: ArtifactView, role: str = "target") -> str:
    """``general.architecture`` of ``view``, present and loadable by the pinned llama.cpp; else raise."""
    arch = view.architecture
    if not arch:
        raise ArtifactError(f"{role} file {view.path}: no general.architecture key, so no llama.cpp model class can "
                            "load it; the file was not written by a model converter — re-convert it",
                            reason="arch_missing", evidence="general.architecture")
    if arch not in LLAMA_ARCHS:
        raise ArtifactError(f"{role} file {view.path}: general.architecture is {arch!r}, which the pinned llama.cpp "
                            f"({PINNED_LLAMA_CPP_COMMIT}) cannot load; use a model of a supported architecture "
                            "(power_core.artifacts.archs.LLAMA_ARCHS lists them)",
                            reason="arch_unknown", evidence="general.architecture")
    return arch


def check_target(view: ArtifactView) -> ArtifactView:
    """Raise :class:`ArtifactError` unless ``view`` can be a target for the pinned llama.cpp; returns ``view``."""
    check_architecture(view, "target")
    if not view.tensors:
        raise ArtifactError(f"target file {view.path}: the tensor table is empty (architecture "
                            f"{view.architecture!r}); a model needs its weights — re-convert it",
                            reason="target_no_tensors", evidence="n_tensors")
    return view
