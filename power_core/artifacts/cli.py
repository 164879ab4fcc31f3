"""``power inspect``, ``power validate`` and ``power bind``.

Exit codes: 0 verified/ok, 2 rejected (a stable reason code and a human message are printed),
1 usage error (the top-level parser's job), 3 an internal error (a bug; still no traceback).
With ``--json`` the result — including a rejection — is one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from power_core.errors import ConfigError, PowerError

__all__ = ["add_subcommands"]

EXIT_OK, EXIT_USAGE, EXIT_REJECTED, EXIT_INTERNAL = 0, 1, 2, 3


def _emit(args: argparse.Namespace, payload: dict[str, Any], human: str, *, err: bool = False) -> None:
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=2, sort_keys=True, default=str))
    else:
        print(human, file=sys.stderr if err else sys.stdout)


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn every failure into a reason code and an exit status; never a traceback."""

    def handler(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except PowerError as exc:
            evidence = getattr(exc, "evidence", None)
            payload = {"ok": False, "code": exc.code, "message": str(exc), "evidence": evidence}
            tail = f" [evidence: {evidence}]" if evidence else ""
            _emit(args, payload, f"error[{exc.code}]: {exc}{tail}", err=True)
            return EXIT_REJECTED
        except Exception as exc:  # a bug in Power: report it without a traceback
            payload = {"ok": False, "code": "internal_error", "message": f"{type(exc).__name__}: {exc}"}
            _emit(args, payload, f"error[internal_error]: {type(exc).__name__}: {exc} (this is a bug in Power; "
                  "please report it with the file)", err=True)
            return EXIT_INTERNAL

    handler.__name__ = fn.__name__
    handler.__doc__ = fn.__doc__
    return handler


def _require_file(path: str) -> None:
    from power_core.errors import ArtifactError

    if not os.path.exists(path):
        raise ArtifactError(f"{path}: no such file; check the path", reason="file_not_found", evidence=path)


def _describe(view: Any) -> dict[str, Any]:
    from power_core.artifacts.contracts import DFLASH_ARCH, EAGLE3_ARCH, classify_draft, mtp_evidence
    from power_core.artifacts.identity import vocab_digest
    from power_core.errors import ArtifactError

    info = view.summary()
    mech: dict[str, Any] = {}
    if view.architecture in (DFLASH_ARCH, EAGLE3_ARCH):
        try:
            contract, found = classify_draft(view)
            mech = {"draft_contract": contract, "evidence": found}
        except ArtifactError as exc:
            mech = {"draft_contract": None, "code": exc.code, "evidence": exc.evidence}
        if view.architecture == EAGLE3_ARCH:
            mech.update(_eagle3_facts(view))
    elif (ev := mtp_evidence(view)) is not None:
        mech = {"mtp": True, "evidence": ev}
    info["mechanism"] = mech
    info["vocab_sha256"] = vocab_digest(view.vocab) if view.vocab is not None else None
    return info


def _eagle3_facts(view: Any) -> dict[str, Any]:
    """What ``power inspect`` shows of an EAGLE3 draft: the tapped target layers as the file declares
    them (the validator checks them against a target) and its draft vocabulary (the ``d2t`` table's
    rows onto the target's ids, or the whole vocabulary)."""
    layers = view.metadata.get("eagle3.target_layers")
    n_tokens = len(view.vocab.tokens) if view.vocab is not None else None
    d2t = view.shape("d2t")
    return {"target_layers": list(layers) if isinstance(layers, tuple) else None,
            "draft_vocab": int(d2t[0]) if d2t else n_tokens, "vocab_mapping": "d2t" if d2t else "identity"}


@_guard
def cmd_inspect(args: argparse.Namespace) -> int:
    """Print what a GGUF file is: architecture, keys, tensors, vocabulary, draft contract."""
    from power_core.artifacts.identity import file_digest
    from power_core.artifacts.view import ArtifactView

    _require_file(args.file)
    view = ArtifactView.from_gguf(args.file)
    info = _describe(view)
    if args.sha256:
        info["sha256"] = file_digest(args.file).sha256
    info["ok"] = True
    if args.json:
        _emit(args, info, "")
        return EXIT_OK
    v = info["vocab"]
    lines = [
        f"file:          {view.path} ({view.size} bytes, GGUF v{view.version})",
        f"architecture:  {view.architecture}",
        f"metadata keys: {len(view.metadata)}",
        f"tensors:       {len(view.tensors)}",
        f"vocabulary:    {v['n_tokens']} tokens, model={v['model']!r}, pre={v['pre']!r}, special={v['special']}"
        if v else "vocabulary:    none",
    ]
    mech = info["mechanism"]
    if "draft_contract" in mech:
        lines.append(f"draft:         {mech['draft_contract'] or 'invalid (' + mech['code'] + ')'} "
                     f"(evidence: {mech['evidence']})")
    if "target_layers" in mech:
        lines.append(f"target layers: {mech['target_layers']}")
        lines.append(f"draft vocabulary: {mech['draft_vocab']} of {v['n_tokens'] if v else '?'} "
                     f"({mech['vocab_mapping']})")
    elif mech.get("mtp"):
        lines.append(f"mtp:           yes (evidence: {mech['evidence']})")
    if "sha256" in info:
        lines.append(f"sha256:        {info['sha256']}")
    if args.tensors:
        lines += [f"  {t['name']:<40} {t['type']:<6} {t['shape']}" for t in info["tensors"]]
    print("\n".join(lines))
    return EXIT_OK


def _config(mode: str) -> Any:
    from power_core.config import PowerConfig

    return PowerConfig(spec_mode=mode)


def _verified_payload(sel: Any) -> dict[str, Any]:
    v = sel.verified
    out: dict[str, Any] = {"ok": True, "mode": sel.strategy.name, "package": sel.strategy.package,
                           "reason": sel.reason, "artifacts": dict(sel.artifacts), "draft": sel.draft}
    res = getattr(v, "result", None)
    if res is not None:
        out["max_k"] = getattr(res, "max_k", None)
        facts = getattr(res, "facts", None)
        if facts is not None:
            out["facts"] = dict(facts)
    if getattr(v, "binding", None) is not None:
        out["binding"] = {"target_sha256": v.binding.target_sha256, "source": v.binding.source}
    elif v is not None and getattr(v, "draft_sha256", None):
        out["binding"] = None
    if getattr(v, "vocab", None) is not None:
        out["vocab"] = {"mapping": v.vocab.mapping, "n_target": v.vocab.n_target, "n_draft": v.vocab.n_draft}
    return out


@_guard
def cmd_validate(args: argparse.Namespace) -> int:
    """Verify a target (and draft) for a mode; exit 0 verified, 2 rejected."""
    from power_core.plugins import get_plugins
    from power_core.selection import select

    try:
        config = _config(args.mode)
    except ConfigError as exc:
        print(f"usage error: --mode: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _require_file(args.target)
    if args.draft is not None:
        _require_file(args.draft)
    sel = select(get_plugins(), config, model=args.target, draft=args.draft, require_binding=args.require_binding)
    payload = _verified_payload(sel)
    human = [f"verified: mode={sel.strategy.name} ({sel.strategy.package})", f"reason:   {sel.reason}"]
    human += [f"{role}:{' ' * (8 - len(role))}sha256 {sha}" for role, sha in sel.artifacts.items()]
    if payload.get("max_k") is not None:
        human.append(f"max K:    {payload['max_k']}")
    if "binding" in payload:
        b = payload["binding"]
        human.append(f"binding:  {'bound (' + b['source'] + ')' if b else 'unbound (power bind to bind it)'}")
    _emit(args, payload, "\n".join(human))
    return EXIT_OK


@_guard
def cmd_bind(args: argparse.Namespace) -> int:
    """Verify a user's draft against a target fully, then bind it (sidecar + model manifest entry)."""
    from power_core.artifacts.binding import register_draft, write_binding
    from power_core.artifacts.contracts import classify_draft
    from power_core.artifacts.verify import verify_artifacts
    from power_core.artifacts.view import ArtifactView
    from power_core.plugins import get_plugins

    _require_file(args.target)
    _require_file(args.draft)
    mode: str = args.mode if args.mode is not None else classify_draft(ArtifactView.from_gguf(args.draft))[0]
    try:
        config = _config(mode)
    except ConfigError as exc:
        print(f"usage error: --mode: {exc}", file=sys.stderr)
        return EXIT_USAGE
    strategy = get_plugins().strategy(mode)
    sv = verify_artifacts(strategy, args.target, args.draft, config, require_binding=False)
    assert sv.draft_sha256 is not None
    side = write_binding(args.draft, draft_sha256=sv.draft_sha256, target_sha256=sv.target_sha256, mode=mode,
                         vocab_sha256=sv.vocab_sha256, target_name=os.path.basename(args.target))
    manifest = None
    if not args.no_register:
        manifest = register_draft(args.target, target_sha256=sv.target_sha256, mode=mode, draft_path=args.draft,
                                  draft_sha256=sv.draft_sha256)
    payload = {"ok": True, "mode": mode, "target_sha256": sv.target_sha256, "draft_sha256": sv.draft_sha256,
               "binding": str(side), "manifest": str(manifest) if manifest else None}
    human = (f"bound: {args.draft} (sha256 {sv.draft_sha256}) -> {args.target} (sha256 {sv.target_sha256}) as "
             f"{mode}\nwrote {side}" + (f"\nregistered in {manifest}" if manifest else ""))
    _emit(args, payload, human)
    return EXIT_OK


def add_subcommands(subparsers: Any) -> None:
    """Add ``inspect``, ``validate`` and ``bind`` to an argparse subparsers object."""
    p = subparsers.add_parser("inspect", help="show what a GGUF file is (bounded header read)",
                              description=cmd_inspect.__doc__)
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--sha256", action="store_true", help="also hash the whole file (cached)")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.set_defaults(func=cmd_inspect)

    v = subparsers.add_parser("validate", help="verify a target (and draft) for a mode; exit 0 ok, 2 rejected",
                              description=cmd_validate.__doc__)
    v.add_argument("--target", required=True)
    v.add_argument("--draft")
    v.add_argument("--mode", default="auto", help="off | auto | mtp | dflash | dflash2 | dspark | installed name")
    v.add_argument("--require-binding", action="store_true", help="refuse a draft not bound to this target")
    v.add_argument("--json", action="store_true", help="one JSON object on stdout")
    v.set_defaults(func=cmd_validate)

    b = subparsers.add_parser("bind", help="verify a draft against a target, then bind it to the target's digest",
                              description=cmd_bind.__doc__)
    b.add_argument("--target", required=True)
    b.add_argument("--draft", required=True)
    b.add_argument("--mode", help="contract (default: detected from the draft)")
    b.add_argument("--no-register", action="store_true", help="do not add the draft to the target's manifest")
    b.add_argument("--json", action="store_true", help="one JSON object on stdout")
    b.set_defaults(func=cmd_bind)
