"""Strategy selection: which proposal mechanism runs, proven before anything native loads.

Rules:

* an explicit ``spec_mode`` selects that strategy or fails closed (never a silent downgrade): a
  missing package names itself, a needed draft is required (or taken from the model manifest for
  that same mode), a draft where none belongs is refused, and the validator plus vocabulary,
  digest and binding checks run on GGUF files;
* every GGUF target is first checked on its own (:func:`~power_core.artifacts.target.check_target`:
  well-formed, all tensor data inside the file, an architecture the pinned llama.cpp loads), in
  every mode including ``off``;
* ``auto``: an explicit draft is classified (DFlash v1 / DFlash2 / DSpark) and must verify; else the
  first verified draft named in the model manifest wins; else the first installed strategy, in
  ``Strategy.auto_rank`` order, whose ``auto_detect`` finds what it needs in the target (MTP layers for
  ``power-mtp``) and whose validator passes; else target-only (``off``). The order is the strategies'
  own declaration, not names in the core. Never two draft mechanisms at once;
* models that are not GGUF files (``None``, ``reference:...``) skip inspection; ``auto`` then means
  ``off`` and an explicit mode is resolved by name;
* ``only`` (a session that runs several strategies, e.g. ``power serve --mode mtp,suffix,off``): ``auto``
  follows the same rules among those strategies alone (a draft, a manifest draft or a detected
  strategy outside them is passed over); with none of them found, target-only.

The :class:`Selection` carries the reason, which the session puts into the receipt.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from power_core.artifacts.binding import read_model_manifest
from power_core.artifacts.contracts import classify_draft, classify_target
from power_core.artifacts.identity import file_digest
from power_core.artifacts.target import check_target
from power_core.artifacts.verify import VerifiedArtifacts, verify_artifacts
from power_core.artifacts.view import ArtifactView
from power_core.errors import ArtifactError, ArtifactMismatch, ConfigError
from power_core.logs import get_logger
from power_core.spec import FIRST_PARTY_PACKAGES, Strategy

__all__ = ["Selection", "select", "is_gguf_model"]

log = get_logger(__name__)


@attrs.frozen
class Selection:
    """The chosen strategy, why, what its validator proved, the draft path and role -> sha256."""

    strategy: Strategy
    reason: str
    verified: VerifiedArtifacts | None = None
    draft: str | None = None
    artifacts: dict[str, str] = attrs.field(factory=dict)


def is_gguf_model(model: str | None) -> bool:
    """True for a path Power must inspect (an existing file, or a name ending in .gguf)."""
    if model is None or model.startswith("reference:"):
        return False
    return os.path.exists(model) or model.lower().endswith(".gguf")


def _pick(sv: VerifiedArtifacts, strategy: Strategy, reason: str, draft: str | None) -> Selection:
    log.info("artifact.selected", mode=strategy.name, reason=reason, **sv.artifacts())
    return Selection(strategy=strategy, reason=reason, verified=sv, draft=draft, artifacts=sv.artifacts())


def select(plugins: Any, config: Any, *, model: str | None, draft: str | None,
           require_binding: bool | None = None, progress: bool | None = None,
           only: frozenset[str] | None = None) -> Selection:
    """Resolve ``config.spec_mode`` against the installed strategies and the files; fail closed.

    A draft bound to another target always fails. ``require_binding`` additionally refuses an
    unbound draft (``power bind`` creates the binding); ``None`` reads ``POWER_REQUIRE_BINDING``
    (``1``/``true`` = required, default not required). Drafts named in the model manifest are bound
    through the manifest's digests. ``only``: the strategies ``auto`` may pick (``None``: any
    installed). Raises :class:`~power_core.errors.PowerError` subclasses only.
    """
    if require_binding is None:
        require_binding = os.environ.get("POWER_REQUIRE_BINDING", "").strip().lower() in ("1", "true", "yes", "on")
    mode = config.spec_mode
    draft = os.fspath(draft) if draft is not None else None
    if not is_gguf_model(model):
        return _select_by_name(plugins, mode, draft, model)
    assert model is not None
    target = check_target(ArtifactView.from_gguf(model))  # before any backend loads the file
    if mode == "off":
        if draft is not None:
            raise ConfigError("draft", draft, "no draft file when spec_mode = 'off'",
                              "drop the draft or choose a speculative spec_mode")
        return Selection(strategy=plugins.strategy("off"), reason="spec_mode=off: target-only decoding",
                         artifacts={"target": file_digest(model, progress=progress).sha256})
    if mode != "auto":
        return _select_explicit(plugins, config, mode, target, model, draft, require_binding, progress)
    return _select_auto(plugins, config, target, model, draft, require_binding, progress, only)


def _select_by_name(plugins: Any, mode: str, draft: str | None, model: str | None) -> Selection:
    what = "no model file" if model is None else f"model {model!r} is not a GGUF file"
    if mode == "auto":
        return Selection(strategy=plugins.strategy("off"), reason=f"auto: {what}; target-only", draft=None)
    strategy = plugins.strategy(mode)
    return Selection(strategy=strategy, reason=f"spec_mode={mode} (explicit); {what}, artifact validation skipped",
                     draft=draft)


def _select_explicit(plugins: Any, config: Any, mode: str, target: ArtifactView, model: str, draft: str | None,
                     require_binding: bool, progress: bool | None) -> Selection:
    strategy = plugins.strategy(mode)  # StrategyNotInstalled names the package
    source = "given"
    if strategy.needs_draft and draft is None:
        entry = next((e for e in read_model_manifest(model) if e.mode == mode), None)
        if entry is None and strategy.self_draft:
            draft, source = model, "the target drafting for itself"
            require_binding = False  # the same file: trivially bound
        elif entry is None:
            raise ArtifactMismatch(f"spec_mode {mode!r} needs a draft model file; pass one (--draft) or name one for "
                                   f"mode {mode!r} in the model manifest {model}.power.json", reason="draft_missing",
                                   evidence="draft")
        else:
            draft, source = str(entry.path), "from the model manifest"
            _check_manifest_digest(entry.path, entry.sha256, progress)
            require_binding = False  # the manifest's digest binds it
    sv = verify_artifacts(strategy, model, draft, config, require_binding=require_binding, target_view=target,
                          progress=progress)
    what = f"draft {draft} ({source}) verified" if draft else "target verified"
    return _pick(sv, strategy, f"spec_mode={mode} (explicit); {what}", draft)


def _check_manifest_digest(path: Any, sha: str, progress: bool | None) -> None:
    got = file_digest(path, progress=progress).sha256
    if got != sha:
        raise ArtifactMismatch(f"the model manifest names {path} with sha256 {sha}, but the file has sha256 {got}",
                               reason="manifest_stale", evidence=str(path))


def _select_auto(plugins: Any, config: Any, target: ArtifactView, model: str, draft: str | None,
                 require_binding: bool, progress: bool | None, only: frozenset[str] | None = None) -> Selection:
    def allowed(name: str) -> bool:
        return only is None or name in only

    contract, evidence = "", ""
    if draft is not None:
        try:
            contract, evidence = classify_draft(ArtifactView.from_gguf(draft))
        except ArtifactError:
            if only is None:
                raise
            # several strategies: the draft is for one that reads it as it is (draft-model's); auto goes on without it
            draft = None
    if draft is not None and allowed(contract):
        strategy = plugins.strategy(contract)  # the user gave a draft: a missing package fails closed
        sv = verify_artifacts(strategy, model, draft, config, require_binding=require_binding, target_view=target,
                              progress=progress)
        return _pick(sv, strategy, f"auto: draft {draft} is {contract} ({evidence}) and verified", draft)
    skipped: list[str] = []
    for entry in read_model_manifest(model):
        if not allowed(entry.mode):
            skipped.append(f"{entry.path} ({entry.mode}: not among this session's strategies)")
            continue
        if entry.mode not in plugins.strategies:
            pkg = FIRST_PARTY_PACKAGES.get(entry.mode)
            skipped.append(f"{entry.path} ({entry.mode}: not installed{'; pip install ' + pkg if pkg else ''})")
            continue
        strategy = plugins.strategies[entry.mode]
        if strategy.proposer is None:  # auto picks what can run; an explicit mode would fail closed instead
            skipped.append(f"{entry.path} ({entry.mode}: no execution path in {strategy.package} {strategy.version})")
            continue
        try:
            _check_manifest_digest(entry.path, entry.sha256, progress)
            sv = verify_artifacts(strategy, model, str(entry.path), config, require_binding=False,
                                  target_view=target, progress=progress)
        except ArtifactError as exc:
            log.warning("artifact.manifest_draft_rejected", path=str(entry.path), mode=entry.mode, code=exc.code)
            skipped.append(f"{entry.path} ({entry.mode}: {exc.code})")
            continue
        return _pick(sv, strategy, f"auto: manifest draft {entry.path} ({entry.mode}) verified", str(entry.path))
    note = f"; skipped manifest drafts: {', '.join(skipped)}" if skipped else ""
    reasons: list[str] = []
    for strategy in sorted((s for s in plugins.strategies if s.auto_detect is not None and allowed(s.name)),
                           key=lambda s: (s.auto_rank, s.name)):
        evidence = strategy.auto_detect(target)
        if evidence is None:
            continue
        if strategy.proposer is None:
            reasons.append(f"target carries {evidence} but {strategy.package} {strategy.version} has no execution "
                           "path yet")
            continue
        try:
            sv = verify_artifacts(strategy, model, None, config, require_binding=require_binding,
                                  target_view=target, progress=progress)
        except ArtifactError as exc:
            log.warning("artifact.target_strategy_rejected", mode=strategy.name, code=exc.code, evidence=exc.evidence)
            reasons.append(f"target {evidence} rejected for {strategy.name} ({exc.code}: {exc.evidence})")
            continue
        return _pick(sv, strategy, f"auto: target carries {evidence}, verified{note}", None)
    known = classify_target(target)
    if known is not None and known[0] not in plugins.strategies:  # a first-party strategy would run here
        pkg = FIRST_PARTY_PACKAGES.get(known[0], known[0])
        reasons.append(f"target carries {known[1]} but {pkg} is not installed (pip install {pkg})")
    if reasons:
        reason = f"auto: {'; '.join(reasons)}; target-only{note}"
    else:
        reason = f"auto: no verified external draft and no installed strategy runs on the target alone; target-only{note}"
    return Selection(strategy=plugins.strategy("off"), reason=reason, artifacts={"target": file_digest(model, progress=progress).sha256})
