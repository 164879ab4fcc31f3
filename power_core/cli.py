"""The ``power`` command line.

Exit codes: 0 success, 1 usage error (bad flags), 2 rejected input (a :class:`PowerError`: bad
config, unusable file, fail-closed strategy; with ``--json`` also one ``{"ok": false, "code", "message",
"evidence"}`` object on stdout), 130 cancelled by Ctrl-C. No traceback reaches the user for an
expected failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import structlog

from power_core.errors import Cancelled, ConfigError, PowerError

__all__ = ["main", "build_parser"]

DEFAULT_PROMPT = "Speculative decoding lets a small model propose tokens that a large model verifies."


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _configure_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def _cmd_plugins(args: argparse.Namespace) -> int:
    from power_core.plugins import build_plugins

    plugins = build_plugins()
    info = plugins.describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for p in info:
        regs = ", ".join(p["strategies"] + [f"backend:{b}" for b in p["backends"]]) or "-"
        print(f"{p['name']:<20} {p['distribution']} {p['version']:<10} {regs}")
    return 0


def _config_from_args(args: argparse.Namespace):
    from power_core.config import PowerConfig

    overrides: dict[str, Any] = {
        "spec_mode": args.mode,
        "spec_draft_max": args.draft_max,
        "spec_mtp_recurrent_snapshots": args.snapshots,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "n_ctx": args.n_ctx,
        "n_threads": args.threads,
        "spec_mtp_adaptive": True if args.adaptive else None,
        "spec_mtp_fr_vocab_size": args.fr_vocab,
        "spec_draft_p_min": args.p_min,
        "trace": True if args.trace else None,
    }
    if args.config:
        return PowerConfig.from_toml(args.config, **overrides)
    return PowerConfig.from_mapping({}, **overrides)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("prompt_file", args.prompt_file, "a readable UTF-8 text file", str(exc)) from None
    return args.prompt if args.prompt is not None else DEFAULT_PROMPT


def _cmd_run(args: argparse.Namespace) -> int:
    from power_core.observers import PhaseTimer
    from power_core.plugins import build_plugins
    from power_core.session import Session

    config = _config_from_args(args)
    prompt = _read_prompt(args)
    timer = PhaseTimer() if args.profile else None
    plugins = build_plugins(extra=(timer,) if timer else ())
    with Session.open(config, model=args.model, draft=args.draft, backend=args.backend,
                      plugins=plugins) as session:
        if session.opened.tokenizer is None:
            # no tokenizer (synthetic models): the prompt is whitespace-separated token ids or bytes
            words = prompt.split()
            ids = [int(w) for w in words] if words and all(w.isdigit() for w in words) else list(prompt.encode())
            n_vocab = session.opened.target.capabilities.n_vocab
            result = session.generate([i % n_vocab for i in ids])
        else:
            result = session.generate(prompt)
    receipt = result.receipt.to_dict()
    if args.json:
        out: dict[str, Any] = {"tokens": list(result.tokens), "text": result.text, "receipt": receipt}
        if timer:
            out["phases"] = timer.summary()
        print(json.dumps(out))
        return 0
    if timer:
        for phase, row in timer.summary().items():
            print(f"phase {phase:<10} {row['seconds'] * 1e3:9.2f} ms over {row['calls']:.0f} calls", file=sys.stderr)
    print(result.text if result.text is not None else " ".join(map(str, result.tokens)))
    s = receipt["summary"]
    acc = "n/a" if s["acceptance"] is None else f"{s['acceptance']:.1%}"
    print(f"\n--- receipt ({receipt['schema']}) ---", file=sys.stderr)
    print(f"strategy={receipt['strategy']['name']} backend={receipt['backend']['name']} "
          f"tokens={receipt['output_tokens']} rounds={s['rounds']} acceptance={acc} "
          f"tokens/pass={s['verified_tokens_per_pass']:.2f} replays={s['replays']} "
          f"decode={receipt['timings']['decode_tok_s']:.1f} tok/s", file=sys.stderr)
    print(json.dumps(receipt, indent=2))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from power_core.bench import BenchSpec, run_bench

    spec = BenchSpec(model=args.model, modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                     prompts=tuple(Path(p) for p in args.prompts), runs=args.runs, tokens=args.tokens,
                     threads=args.threads, draft=args.draft, n_ctx=args.n_ctx,
                     peer_bin=Path(args.peer_bin) if args.peer_bin else None, out=Path(args.out))
    report = run_bench(spec, progress=not args.no_progress and sys.stderr.isatty())
    print((spec.out / "report.md").read_text())
    if report["parity_failures"]:
        print(f"parity failure: {report['parity_failures']}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="power", description="Exact speculative decoding on llama.cpp.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug logs on stderr")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plugins", help="list installed plugins, strategies and backends")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plugins)

    r = sub.add_parser("run", help="generate with speculative decoding and print the receipt")
    r.add_argument("--model", help="GGUF file, or reference[:k=v,...]; default: the embedded SmolLM2")
    r.add_argument("--draft", help="draft artifact for strategies that need one")
    r.add_argument("--mode", help="spec_mode: off | auto | mtp | dflash | dflash2 | dspark | draft-model | ...")
    r.add_argument("--backend", help="force a backend (llama, reference)")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from a UTF-8 file")
    r.add_argument("--max-tokens", type=int)
    r.add_argument("--seed", type=int)
    r.add_argument("--temperature", type=float)
    r.add_argument("--top-k", type=int)
    r.add_argument("--top-p", type=float)
    r.add_argument("--draft-max", type=int, help="K: proposal width")
    r.add_argument("--snapshots", type=int, help="S: resident rollback snapshots (default K)")
    r.add_argument("--adaptive", action="store_true", help="request-local adaptive controller")
    r.add_argument("--fr-vocab", type=int, help="spec_mtp_fr_vocab_size: MTP drafts only from the first N token ids")
    r.add_argument("--p-min", type=float, help="spec_draft_p_min: block drafters stop below this confidence")
    r.add_argument("--trace", action="store_true", help="record each round's proposed token ids in the receipt")
    r.add_argument("--n-ctx", type=int)
    r.add_argument("--threads", type=int)
    r.add_argument("--config", help="TOML file with configuration keys")
    r.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, receipt")
    r.add_argument("--profile", action="store_true", help="time every transaction phase (PhaseTimer observer)")
    r.set_defaults(func=_cmd_run)

    b = sub.add_parser("bench", help="paired, interleaved benchmark of modes (and llama.cpp peers) -> evidence")
    b.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    b.add_argument("--draft", help="draft artifact for modes that need one")
    b.add_argument("--modes", default="off,suffix", help="comma-separated modes (off is always included)")
    b.add_argument("--prompts", nargs="+", required=True, help="UTF-8 prompt files")
    b.add_argument("--runs", type=int, default=5)
    b.add_argument("--tokens", type=int, default=128)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--n-ctx", type=int, default=2048)
    b.add_argument("--peer-bin", help="directory with llama-completion and llama-speculative-simple")
    b.add_argument("--out", default="evidence/bench", help="directory for report.json, report.md, speedup.png")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_cmd_bench)

    try:
        from power_core.artifacts.cli import add_subcommands
    except ImportError:  # pragma: no cover - artifacts package always ships with power-core
        pass
    else:
        add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        print(f"usage error: {exc}", file=sys.stderr)
        return 1
    _configure_logging(args.verbose)
    try:
        return int(args.func(args))
    except Cancelled as exc:
        print(f"cancelled: {exc}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("cancelled", file=sys.stderr)
        return 130
    except PowerError as exc:
        evidence = getattr(exc, "evidence", None)
        if getattr(args, "json", False):  # --json callers get the rejection as one object, as validate does
            print(json.dumps({"ok": False, "code": exc.code, "message": str(exc), "evidence": evidence},
                             sort_keys=True, default=str))
        tail = f" [evidence: {evidence}]" if evidence else ""
        print(f"error[{exc.code}]: {exc}{tail}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
