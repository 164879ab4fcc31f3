"""The ``power`` command line: its parser (every subcommand and its flags) and :func:`main`, which runs
the subcommand (:mod:`power_core.commands`) and turns its failures into exit codes.

Exit codes: 0 success, 1 usage error (bad flags), 2 rejected input (a :class:`PowerError`: bad
config, unusable file, fail-closed strategy; with ``--json`` also one ``{"ok": false, "code", "message",
"evidence"}`` object on stdout), 3 ``power selftest`` found verify rows that differ from one-token
decodes, 130 cancelled by Ctrl-C. No traceback reaches the user for an expected failure.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

import structlog

from power_core.commands import (
    UsageError,
    cmd_bench,
    cmd_calibrate,
    cmd_plugins,
    cmd_run,
    cmd_selftest,
    cmd_serve,
    strategy_keys,
)
from power_core.errors import Cancelled, PowerError

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


_HANDLER: logging.Handler | None = None


def _configure_logging(verbose: int) -> None:
    """The CLI is the application: it (not the library) decides that events go to stderr."""
    global _HANDLER
    from power_core.logs import render_event

    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    root = logging.getLogger()
    if _HANDLER is not None:
        root.removeHandler(_HANDLER)
    _HANDLER = logging.StreamHandler(sys.stderr)
    _HANDLER.setFormatter(logging.Formatter("%(levelname)-7s %(name)s: %(message)s"))
    root.addHandler(_HANDLER)
    root.setLevel(level)
    # code that calls structlog.get_logger directly (e.g. a plugin) follows the same route
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, render_event],
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )


def _model_flags(r: argparse.ArgumentParser, *, several_modes: bool = False) -> None:
    """The model, strategy and configuration flags ``run`` and ``serve`` share."""
    r.add_argument("--model", help="GGUF file, or reference[:k=v,...]; default: the embedded SmolLM2")
    r.add_argument("--draft", help="draft artifact for strategies that need one")
    r.add_argument("--mode", help="spec_mode: off | auto | an installed strategy (power plugins lists them)" + (
        "; or several, comma-separated (e.g. mtp,suffix,off): every slot runs each, a request picks one with "
        "its power.strategy, the first is the default" if several_modes else ""))
    r.add_argument("--backend", help="force a backend (llama, reference)")
    r.add_argument("--chat-template", metavar="FILE",
                   help="Jinja chat template to use instead of the GGUF's tokenizer.chat_template")
    r.add_argument("--max-tokens", type=int, help=(
        "the most tokens one answer writes: a cap on every request's max_tokens, as llama-server's --n-predict "
        "(unset: none; a request without max_tokens writes up to the rest of the context)") if several_modes
        else "tokens to emit at most (default 128)")
    r.add_argument("--seed", type=int)
    r.add_argument("--temperature", type=float)
    r.add_argument("--top-k", type=int)
    r.add_argument("--top-p", type=float)
    r.add_argument("--min-p", type=float)
    r.add_argument("--repeat-penalty", type=float, help="llama.cpp's repeat penalty (1: off)")
    r.add_argument("--repeat-last-n", type=int, help="the penalties' window in tokens (0: off, -1: the context)")
    r.add_argument("--frequency-penalty", type=float, help="subtracted per occurrence in the window (-2..2)")
    r.add_argument("--presence-penalty", type=float, help="subtracted once for a token in the window (-2..2)")
    r.add_argument("--draft-max", type=int, help="K: proposal width")
    r.add_argument("--snapshots", type=int, help="S: resident rollback snapshots (default K)")
    r.add_argument("--adaptive", action="store_true", help="request-local adaptive controller")
    r.add_argument("--trace", action="store_true", help="record each round's proposed token ids in the receipt")
    r.add_argument("--n-ctx", type=int)
    r.add_argument("--verify-capacity", type=int, metavar="B",
                   help="pad every target verify pass to exactly B tokens (one pass shape; 0: off)")
    r.add_argument("--threads", type=int)
    _numerics_flag(r)
    _offload_flags(r)
    r.add_argument("--draft-gpu-layers", type=int,
                   help="draft_gpu_layers: a draft model's layers offloaded to the GPU devices (-1: all)")
    r.add_argument("--sampling-in-graph", choices=("auto", "on", "off"),
                   help="greedy token ids from the target's graph (auto, default: where the rows would cross a "
                        "device boundary; on: wherever supported) or from logits rows on the host (off)")
    r.add_argument("--selftest", action="store_true",
                   help="probe the target's batch numerics at open and record it in the receipt")
    r.add_argument("--require-identical", action="store_true",
                   help="decode target-only (with the reason) unless verify rows equal one-token decodes")
    r.add_argument("--no-warmup", action="store_true",
                   help="skip the throwaway pass on each context at open (warmup = false)")
    r.add_argument("--config", help="TOML file with configuration keys")
    _strategy_flags(r)


def _strategy_flags(r: argparse.ArgumentParser) -> None:
    """One flag per strategy key that declares one (``ConfigKey.flag``), stored under the key's name."""
    from power_core.config import key_owners

    for key in strategy_keys():
        if key.flag is None:
            continue
        text = f"{key.name} ({', '.join(key_owners(key.name))}): {key.help}"
        if key.serve_default is not None:
            text += f" (default {key.default}; power serve: {key.serve_default})"
        if key.type is bool:
            r.add_argument(key.flag, dest=key.name, action="store_const", const=True, help=text)
        elif key.type is tuple:  # a list of values (the key's convert makes it its tuple)
            r.add_argument(key.flag, dest=key.name, nargs="+", metavar="VALUE", help=text)
        else:
            r.add_argument(key.flag, dest=key.name, type=key.type, help=text, choices=key.choices or None,
                           metavar=None if key.choices else {int: "N", float: "X"}.get(key.type, "TEXT"))


def _numerics_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numerics", choices=("exact", "stock"),
                   help="target kernels: exact (default; batch-invariant) or stock (as stock llama.cpp binaries)")
    p.add_argument("--rpc", metavar="HOST:PORT[,...]",
                   help="llama.cpp rpc-server endpoints that hold the target's layers (unauthenticated: loopback "
                        "or a private network only)")


def _offload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-layers", type=int,
                   help="n_gpu_layers: target layers offloaded to the GPU devices (-1: all; default 0, CPU only)")
    p.add_argument("--devices", metavar="DEV[,...]",
                   help="llama.cpp devices the offloaded layers go to, e.g. CUDA0,CUDA1 (default: every GPU)")
    p.add_argument("--flash-attn", choices=("auto", "on", "off"),
                   help="flash attention (default auto: llama.cpp decides per device)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="power", description="Exact speculative decoding on llama.cpp.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug logs on stderr")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plugins", help="list installed plugins, strategies and backends")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    r = sub.add_parser("run", help="generate with speculative decoding: stream the text, then a summary line")
    _model_flags(r)
    src = r.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from a UTF-8 file")
    r.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template")
    r.add_argument("--system", help="system message (with --chat)")
    r.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop string (repeatable): the output ends right before it")
    r.add_argument("--json", action="store_true", help="print one JSON object at the end: tokens, text, receipt")
    r.add_argument("--receipt", metavar="FILE", help="write the full receipt (JSON) to FILE ('-': print it after the text)")
    r.add_argument("--profile", action="store_true", help="time every transaction phase (PhaseTimer observer)")
    shape = r.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the output is JSON matching this JSON schema")
    shape.add_argument("--grammar", metavar="FILE", help="the output matches this grammar (GBNF, as llama.cpp "
                       "takes it, or an llguidance Lark grammar)")
    shape.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression (whole)")
    r.set_defaults(func=cmd_run)

    from power_core.memory import DEFAULT_CACHE_MIB  # (numpy: the parser is built once per command)

    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install 'power-core[serve]'); "
                       "see docs/serving.md")
    _model_flags(v, several_modes=True)
    v.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; any other needs --api-key or --no-auth)")
    v.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port, announced on stderr)")
    v.add_argument("--parallel", type=int, default=1, help="slots: sessions decoding at once (one set of weights)")
    v.add_argument("--no-batch", action="store_true",
                   help="slots decode independently instead of sharing target passes (continuous batching)")
    v.add_argument("--queue", type=int, default=16, help="requests waiting for a slot before 503 (default 16)")
    v.add_argument("--timeout", type=float, default=600.0,
                   help="seconds from arrival to the end of a request; it is cancelled then (default 600)")
    v.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $POWER_API_KEY)")
    v.add_argument("--no-auth", action="store_true", help="serve a non-loopback address without an API key")
    v.add_argument("--served-model-name", help="the model's name in the API (default: the GGUF's file name)")
    v.add_argument("--max-body", type=int, default=1 << 20, help="request body limit in bytes (default 1 MiB)")
    v.add_argument("--receipts", type=int, default=256, help="recent receipts kept for GET /v1/receipts/{id}")
    v.add_argument("--receipts-ram", type=int, default=64, metavar="MiB",
                   help="at most this many MiB of them (as canonical JSON), the oldest dropped first (default 64)")
    v.add_argument("--audit-rate", type=float, default=0.0, metavar="R",
                   help="re-decode this fraction of completed speculative requests target-only on an idle slot and "
                        "compare output digests (power:audit_* metrics; with --require-identical a mismatch switches "
                        "the server to target-only)")
    v.add_argument("--cache-ram", type=int, default=DEFAULT_CACHE_MIB, metavar="MiB",
                   help="host memory for saved prompt states across requests: a request restores the longest "
                        f"prefix of its prompt any earlier request computed (default {DEFAULT_CACHE_MIB}, as "
                        "llama-server's; 0: off, no prompt reuse unless the configuration sets cache_prompt)")
    v.add_argument("--cache-share-tenants", action="store_true",
                   help="let requests restore prompt states of other tenants (API key, else the 'user' field); a "
                        "restored prefix is faster, so a tenant could time its requests to learn another's prompts")
    v.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM (default 30)")
    v.set_defaults(func=cmd_serve)

    t = sub.add_parser("selftest", help="are the target's verify rows bit-identical to one-token decodes? "
                       "(exit 0 yes, 3 no)")
    t.add_argument("--model", help="GGUF file, or reference[:k=v,...]; default: the embedded SmolLM2")
    t.add_argument("--backend", help="force a backend (llama, reference)")
    t.add_argument("--threads", type=int)
    t.add_argument("--n-ctx", type=int, default=512)
    t.add_argument("--batch", type=int, metavar="N",
                   help="also probe shared passes of N sequences: a sequence's rows beside others' vs alone")
    _numerics_flag(t)
    _offload_flags(t)
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.set_defaults(func=cmd_selftest)

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
    b.add_argument("--numerics", choices=("exact", "stock"),
                   help="Power's target kernels (default exact)")
    b.add_argument("--peer-numerics", choices=("exact", "stock"),
                   help="the llama.cpp peers' kernels (default: the same as --numerics, so both sides write the "
                        "same text; stock: llama.cpp as shipped)")
    _offload_flags(b)
    b.add_argument("--draft-gpu-layers", type=int, default=0,
                   help="draft_gpu_layers for model-backed modes (-1: all); the peers get the target's offload")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("calibrate", help="paired answer-quality calibration: each mode's answers to a task set "
                       "against --mode off's -> evidence")
    c.add_argument("--tasks", metavar="FILE", help="JSONL task file (default: the shipped calibration set)")
    c.add_argument("--modes", default="off,suffix", help="comma-separated modes (off is always included: the reference)")
    c.add_argument("--model", help="GGUF file, or reference[:k=v,...] (default: the embedded SmolLM2)")
    c.add_argument("--draft", help="draft for model-backed modes (draft-model without one: the target drafts itself)")
    c.add_argument("--backend", help="force a backend (llama, reference)")
    c.add_argument("--numerics", choices=("exact", "stock"), help="the target's kernels (default exact)")
    c.add_argument("--orders", type=int, default=2, help="rotated mode orders per task, interleaved (default 2)")
    c.add_argument("--max-tokens", type=int, default=48, help="tokens per answer at most (default 48)")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--n-ctx", type=int, default=2048)
    c.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable), for every task")
    c.add_argument("--chat-template", metavar="FILE",
                   help="Jinja chat template for messages tasks instead of the GGUF's tokenizer.chat_template")
    c.add_argument("--out", default="evidence/calibrate", help="directory for report.json, report.md, calibration.png")
    c.add_argument("--require-parity", action="store_true",
                   help="exit 1 when any task's answer differs from --mode off's")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=cmd_calibrate)

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
    except UsageError as exc:
        print(f"usage error: {exc}", file=sys.stderr)
        return 1
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
