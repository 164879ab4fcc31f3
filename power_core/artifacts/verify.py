"""Full verification of a target (and draft) for one strategy: what ``select`` and ``power bind`` run.

Order: inspect both headers (bounded) and check the target on its own → the strategy's contract
validator → complete vocabulary comparison (draft strategies) → file digests → binding. Every
failure is a typed :class:`~power_core.errors.ArtifactError`; nothing native is touched.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from power_core.artifacts.binding import Binding, check_binding
from power_core.artifacts.identity import file_digest, vocab_digest
from power_core.artifacts.target import check_target
from power_core.artifacts.view import ArtifactView
from power_core.artifacts.vocab import VocabMatch, compare_vocab
from power_core.errors import ArtifactError, ArtifactMismatch, ConfigError
from power_core.logs import get_logger

__all__ = ["VerifiedArtifacts", "verify_artifacts"]

log = get_logger(__name__)


@attrs.frozen
class VerifiedArtifacts:
    """Everything proven about the files of one selection."""

    mode: str
    result: object  # the strategy validator's own typed result (e.g. contracts.Verified), None without a validator
    target_sha256: str
    draft_sha256: str | None = None
    vocab: VocabMatch | None = None
    vocab_sha256: str | None = None
    binding: Binding | None = None

    def artifacts(self) -> dict[str, str]:
        out = {"target": self.target_sha256}
        if self.draft_sha256:
            out["draft"] = self.draft_sha256
        return out


def _call_validator(strategy: Any, target: ArtifactView, draft: ArtifactView | None, config: Any) -> Any:
    if strategy.validate is None:
        return None
    try:
        return strategy.validate(target, draft, config)
    except (ArtifactError, ConfigError):  # a rejected artifact, or a configuration the contract refuses
        raise
    except Exception as exc:  # a plugin bug must not become a traceback or a pass
        raise ArtifactError(f"the {strategy.name!r} validator ({strategy.package}) crashed: {type(exc).__name__}: "
                            f"{exc}", reason="validator_crashed", evidence=strategy.name) from exc


def verify_artifacts(strategy: Any, target_path: str | os.PathLike[str], draft_path: str | os.PathLike[str] | None,
                     config: Any = None, *, require_binding: bool = True, target_view: ArtifactView | None = None,
                     progress: bool | None = None) -> VerifiedArtifacts:
    """Verify the target (and draft) for ``strategy`` or raise; see the module docstring for the order."""
    tv = check_target(target_view if target_view is not None else ArtifactView.from_gguf(target_path))
    if strategy.needs_draft and draft_path is None:
        raise ArtifactMismatch(f"spec_mode {strategy.name!r} needs a draft model file (--draft) and none was given",
                               reason="draft_missing", evidence="draft")
    if not strategy.needs_draft and draft_path is not None:
        raise ArtifactMismatch(f"spec_mode {strategy.name!r} takes no draft file, but {os.fspath(draft_path)} was "
                               "given; two draft mechanisms at once are refused", reason="draft_unexpected",
                               evidence=os.fspath(draft_path))
    dv = ArtifactView.from_gguf(draft_path) if draft_path is not None else None
    result = _call_validator(strategy, tv, dv, config)
    vocab = None
    if dv is not None:
        vocab = compare_vocab(tv, dv)
    t_sha = file_digest(tv.path, progress=progress).sha256
    d_sha = binding = v_sha = None
    if dv is not None:
        d_sha = file_digest(dv.path, progress=progress).sha256
        binding = check_binding(tv.path, t_sha, dv, d_sha, required=require_binding)
        v_sha = vocab_digest(dv.vocab)
    log.debug("artifact.verified", mode=strategy.name, target=t_sha, draft=d_sha)
    return VerifiedArtifacts(mode=strategy.name, result=result, target_sha256=t_sha, draft_sha256=d_sha, vocab=vocab,
                             vocab_sha256=v_sha, binding=binding)
