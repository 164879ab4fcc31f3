"""Draft-to-target binding and the model manifest.

A draft is bound to exactly one target digest. Two carriers, checked together:

* **in the draft** — the GGUF string key ``power.bound_target_sha256`` (64 hex digits), written by a
  publisher at conversion time; it cannot go stale because it is part of the draft's own bytes;
* **beside the draft** — ``<draft>.power.json`` (format ``power.binding/1``) with the draft's and the
  target's sha256, the contract and the vocabulary digest; ``power bind`` writes it for a user's own
  pair after full verification. It records the draft digest, so editing the draft makes it stale.

If both exist they must agree. A draft bound to another target fails closed with both digests.

The **model manifest** ``<model>.power.json`` (format ``power.manifest/1``) names external
artifacts for a target: ``{"format": ..., "target_sha256": ..., "drafts": [{"mode", "path",
"sha256"}]}`` (``path`` relative to the manifest). ``auto`` picks the first entry that verifies.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import attrs

from power_core.artifacts.view import ArtifactView
from power_core.errors import ArtifactError, ArtifactMismatch

__all__ = [
    "BINDING_KEY", "BINDING_FORMAT", "MODEL_FORMAT", "MANIFEST_SUFFIX", "Binding", "ManifestEntry",
    "sidecar_path", "read_binding", "check_binding", "write_binding", "read_model_manifest", "register_draft",
]

BINDING_KEY = "power.bound_target_sha256"
BINDING_FORMAT = "power.binding/1"
MODEL_FORMAT = "power.manifest/1"
MANIFEST_SUFFIX = ".power.json"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_MAX_JSON = 1 << 20


@attrs.frozen
class Binding:
    """The target digest a draft is bound to, and where that was read."""

    target_sha256: str
    source: str  # "metadata" | "manifest" | "metadata+manifest"
    mode: str | None = None


@attrs.frozen
class ManifestEntry:
    """One external artifact the model manifest names."""

    mode: str
    path: Path
    sha256: str


def sidecar_path(artifact: str | os.PathLike[str]) -> Path:
    """``<artifact>.power.json``."""
    return Path(os.fspath(artifact) + MANIFEST_SUFFIX)


def _load_json(path: Path, reason: str) -> dict[str, Any] | None:
    try:
        if path.stat().st_size > _MAX_JSON:
            raise ArtifactError(f"{path}: larger than {_MAX_JSON} bytes", reason=reason, evidence=str(path))
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: not readable JSON ({exc}); fix or delete it", reason=reason,
                            evidence=str(path)) from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: expected a JSON object", reason=reason, evidence=str(path))
    return data


def _hex(value: Any, path: Any, field: str, reason: str) -> str:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise ArtifactError(f"{path}: {field} must be 64 lowercase hex digits, found {value!r}", reason=reason,
                            evidence=field)
    return value


def read_binding(draft: ArtifactView, draft_sha256: str) -> Binding | None:
    """The draft's binding from its metadata key and/or its sidecar; stale or conflicting carriers fail."""
    meta = None
    if BINDING_KEY in draft.metadata:
        meta = _hex(draft.metadata[BINDING_KEY], draft.path, BINDING_KEY, "binding_invalid")
    side_path = sidecar_path(draft.path)
    data = _load_json(side_path, "binding_invalid")
    side = mode = None
    if data is not None:
        if data.get("format") != BINDING_FORMAT:
            raise ArtifactError(f"{side_path}: format {data.get('format')!r}, expected {BINDING_FORMAT!r}",
                                reason="binding_invalid", evidence="format")
        dsha = _hex(data.get("draft_sha256"), side_path, "draft_sha256", "binding_invalid")
        side = _hex(data.get("target_sha256"), side_path, "target_sha256", "binding_invalid")
        mode = data.get("mode") if isinstance(data.get("mode"), str) else None
        if dsha != draft_sha256:
            raise ArtifactMismatch(
                f"{side_path} binds draft sha256 {dsha}, but {draft.path} now has sha256 {draft_sha256}; the draft "
                "changed after binding — re-run power bind", reason="binding_stale", evidence="draft_sha256")
    if meta and side and meta != side:
        raise ArtifactMismatch(f"{draft.path}: {BINDING_KEY}={meta} but {side_path} binds target {side}; the two "
                               "carriers disagree", reason="binding_conflict", evidence=BINDING_KEY)
    if meta:
        return Binding(meta, "metadata+manifest" if side else "metadata", mode)
    if side:
        return Binding(side, "manifest", mode)
    return None


def check_binding(target_path: str, target_sha256: str, draft: ArtifactView, draft_sha256: str, *,
                  required: bool) -> Binding | None:
    """Fail closed when the draft is bound to another target, or unbound while ``required``."""
    b = read_binding(draft, draft_sha256)
    if b is not None and b.target_sha256 != target_sha256:
        raise ArtifactMismatch(
            f"draft {draft.path} (sha256 {draft_sha256}) is bound to target sha256 {b.target_sha256} ({b.source}), "
            f"but the target {target_path} has sha256 {target_sha256}; use the target it was made for",
            reason="binding_other_target", evidence=BINDING_KEY if "metadata" in b.source else "target_sha256")
    if b is None and required:
        raise ArtifactMismatch(
            f"draft {draft.path} (sha256 {draft_sha256}) is not bound to target {target_path} (sha256 "
            f"{target_sha256}); verify and bind the pair with: power bind --target {target_path} --draft "
            f"{draft.path}", reason="binding_missing", evidence=BINDING_KEY)
    return b


def _atomic_write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ArtifactError(f"{path}: cannot write ({exc.strerror or exc})", reason="file_unwritable",
                            evidence=str(path)) from None


def write_binding(draft_path: str | os.PathLike[str], *, draft_sha256: str, target_sha256: str, mode: str,
                  vocab_sha256: str | None = None, target_name: str | None = None) -> Path:
    """Write ``<draft>.power.json``; callers verify the pair first (``power bind`` does)."""
    path = sidecar_path(draft_path)
    _atomic_write(path, {"format": BINDING_FORMAT, "draft_sha256": draft_sha256, "target_sha256": target_sha256,
                         "mode": mode, "vocab_sha256": vocab_sha256, "target_name": target_name,
                         "created_by": "power bind"})
    return path


def read_model_manifest(model_path: str | os.PathLike[str], target_sha256: str | None = None) -> list[ManifestEntry]:
    """The drafts the model manifest names ([] when there is none); a malformed manifest fails."""
    path = sidecar_path(model_path)
    data = _load_json(path, "manifest_invalid")
    if data is None:
        return []
    if data.get("format") != MODEL_FORMAT:
        raise ArtifactError(f"{path}: format {data.get('format')!r}, expected {MODEL_FORMAT!r}",
                            reason="manifest_invalid", evidence="format")
    if target_sha256 is not None and data.get("target_sha256") not in (None, target_sha256):
        raise ArtifactMismatch(f"{path} describes target sha256 {data.get('target_sha256')}, but {model_path} has "
                               f"sha256 {target_sha256}", reason="manifest_stale", evidence="target_sha256")
    drafts = data.get("drafts", [])
    if not isinstance(drafts, list):
        raise ArtifactError(f"{path}: 'drafts' must be a list", reason="manifest_invalid", evidence="drafts")
    out = []
    for i, d in enumerate(drafts):
        if not isinstance(d, dict) or not isinstance(d.get("mode"), str) or not isinstance(d.get("path"), str):
            raise ArtifactError(f"{path}: drafts[{i}] needs string 'mode' and 'path'", reason="manifest_invalid",
                                evidence=f"drafts[{i}]")
        sha = _hex(d.get("sha256"), path, f"drafts[{i}].sha256", "manifest_invalid")
        p = Path(d["path"])
        out.append(ManifestEntry(d["mode"], p if p.is_absolute() else path.parent / p, sha))
    return out


def register_draft(model_path: str | os.PathLike[str], *, target_sha256: str, mode: str,
                   draft_path: str | os.PathLike[str], draft_sha256: str) -> Path:
    """Add or replace the draft's entry in the model manifest (``power bind`` does this by default)."""
    path = sidecar_path(model_path)
    entries = read_model_manifest(model_path, target_sha256)
    dp = Path(os.path.abspath(draft_path))
    try:
        rel = os.path.relpath(dp, path.parent.resolve())
    except ValueError:
        rel = str(dp)
    kept = [e for e in entries if e.path.resolve() != dp.resolve()]
    drafts = [{"mode": e.mode, "path": str(e.path), "sha256": e.sha256} for e in kept]
    drafts.insert(0, {"mode": mode, "path": rel, "sha256": draft_sha256})
    _atomic_write(path, {"format": MODEL_FORMAT, "target_sha256": target_sha256, "drafts": drafts})
    return path
