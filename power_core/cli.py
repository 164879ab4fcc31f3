"""The ``power`` command line.

Exit codes: 0 success, 1 usage error (bad flags), 2 rejected input (a :class:`PowerError`: bad
config, unusable file, fail-closed strategy; with ``--json`` also one ``{"ok": false, "code", "message",
"evidence"}`` object on stdout), 3 ``power selftest`` found verify rows that differ from one-token
decodes, 130 cancelled by Ctrl-C. No traceback reaches the user for an expected failure.

``power run`` prints the text to stdout as rounds commit, then one summary line to stderr; the full
receipt goes to ``--receipt FILE`` or, with ``--json``, into the one JSON object printed at the end.
Ctrl-C cancels the request at the next step (a decode in flight is aborted): the committed text stays
printed, the receipt says ``cancelled``, and the exit code is 130. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import structlog

from power_core.errors import Cancelled, ConfigError, PowerError

if TYPE_CHECKING:
    from power_core.config import PowerConfig

__all__ = ["main", "build_parser"]

DEFAULT_PROMPT = "Speculative decoding lets a small model propose tokens that a large model verifies."


class UsageError(Exception):
    pass


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


def _config_from_args(args: argparse.Namespace, mode: str | None = None):
    """The configuration the flags (and ``--config``) give; ``mode``: its ``spec_mode`` instead of ``--mode``."""
    from power_core.config import PowerConfig

    overrides: dict[str, Any] = {
        "spec_mode": mode or args.mode,
        "spec_draft_max": args.draft_max,
        "spec_mtp_recurrent_snapshots": args.snapshots,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "repeat_last_n": args.repeat_last_n,
        "frequency_penalty": args.frequency_penalty,
        "presence_penalty": args.presence_penalty,
        "n_ctx": args.n_ctx,
        "n_threads": args.threads,
        "spec_mtp_adaptive": True if args.adaptive else None,
        "trace": True if args.trace else None,
        "numerics": args.numerics,
        "sampling_in_graph": args.sampling_in_graph,
        "rpc_servers": args.rpc,
        "n_gpu_layers": args.gpu_layers,
        "devices": args.devices,
        "flash_attn": args.flash_attn,
        "draft_gpu_layers": args.draft_gpu_layers,
        "selftest": True if args.selftest else None,
        "require_identical": True if args.require_identical else None,
        "warmup": False if args.no_warmup else None,
        "verify_capacity": args.verify_capacity,
    }
    # the strategies' own keys: their flags store under the key's name (_strategy_flags)
    overrides.update({key.name: getattr(args, key.name, None) for key in _strategy_keys()})
    if args.config:
        return PowerConfig.from_toml(args.config, **overrides)
    return PowerConfig.from_mapping({}, **overrides)


def _constraint_from_args(args: argparse.Namespace) -> Any:
    """``--json-schema FILE``, ``--grammar FILE`` (GBNF or llguidance Lark) or ``--regex PATTERN`` as a
    :class:`~power_core.constraint.ConstraintSpec` (``None``: unconstrained). A file that cannot be read
    is a :class:`~power_core.errors.ConstraintError` naming the flag (exit 2); one the grammar engine
    refuses is too, when the request starts."""
    from power_core.constraint import ConstraintSpec
    from power_core.errors import ConstraintError

    if args.regex is not None:
        return ConstraintSpec.regex(args.regex, field="--regex")
    for flag, path in (("--json-schema", args.json_schema), ("--grammar", args.grammar)):
        if path is None:
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConstraintError(flag, f"cannot read {path}: {exc}") from None
        if flag == "--grammar":
            return ConstraintSpec.grammar(text, field=flag)
        return ConstraintSpec.json_schema(text, field=flag)
    return None


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("prompt_file", args.prompt_file, "a readable UTF-8 text file", str(exc)) from None
    return args.prompt if args.prompt is not None else DEFAULT_PROMPT


@contextlib.contextmanager
def _ctrl_c_cancels(cancel: Any) -> Iterator[None]:
    """First Ctrl-C: cancel the request (it ends at the next step, keeping what was committed);
    a second one raises KeyboardInterrupt as usual."""

    def handler(signum: int, frame: Any) -> None:
        if cancel.cancelled:
            raise KeyboardInterrupt
        cancel.cancel()

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: KeyboardInterrupt still counts as a cancel
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _summary_line(receipt: Any, receipt_path: str | None) -> str:
    s = receipt.summary()
    acc = "n/a" if s["acceptance"] is None else f"{s['acceptance']:.1%}"
    tpp = "n/a" if s["verified_tokens_per_pass"] is None else f"{s['verified_tokens_per_pass']:.2f}"
    line = (f"[{receipt.status}] finish={receipt.finish_reason} strategy={receipt.strategy['name']} "
            f"backend={receipt.backend['name']} tokens={receipt.output_tokens} rounds={s['rounds']} "
            f"acceptance={acc} tokens/pass={tpp} replays={s['replays']} "
            f"decode={receipt.timings['decode_tok_s']:.1f} tok/s")
    if "host_us_per_round" in receipt.timings:  # the target keeps a compute clock
        line += f" host={receipt.timings['host_us_per_round']:.1f} us/round"
    return line + (f" receipt={receipt_path}" if receipt_path else "")


def _cmd_run(args: argparse.Namespace) -> int:
    from power_core.observers import PhaseTimer
    from power_core.plugins import build_plugins
    from power_core.session import Session
    from power_core.transaction import CancelToken

    config = _config_from_args(args)
    prompt = _read_prompt(args)
    constraint = _constraint_from_args(args)
    if args.system is not None and not args.chat:
        raise UsageError("power run: --system needs --chat")
    timer = PhaseTimer() if args.profile else None
    plugins = build_plugins(extra=(timer,) if timer else ())
    cancel = CancelToken()
    cancelled = False
    out = sys.stdout
    with _ctrl_c_cancels(cancel), Session.open(config, model=args.model, draft=args.draft, backend=args.backend,
                                               plugins=plugins) as session:
        tokenizer = session.opened.tokenizer
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
            messages.append({"role": "user", "content": prompt})
            ids: Any = session.chat_prompt(messages, chat_template=_chat_template(args))
        elif tokenizer is None:
            # no tokenizer (synthetic models): the prompt is whitespace-separated token ids or bytes
            words = prompt.split()
            raw = [int(w) for w in words] if words and all(w.isdigit() for w in words) else list(prompt.encode())
            n_vocab = session.opened.target.capabilities.n_vocab
            ids = [i % n_vocab for i in raw]
        else:
            ids = prompt
        gen = session.start(ids, cancel=cancel, stop=args.stop, constraint=constraint)
        shown = 0  # tokens printed (models without a tokenizer print ids as they commit)
        try:
            if args.json:
                gen.run()
            elif tokenizer is not None:
                with gen.stream() as stream:
                    for delta in stream:
                        out.write(delta)
                        out.flush()
            else:
                for _ in gen.rounds():
                    fresh = gen.tokens[shown:]
                    out.write("".join(f"{t} " for t in fresh))
                    out.flush()
                    shown += len(fresh)
        except (Cancelled, KeyboardInterrupt):
            cancelled = True
        receipt = gen.receipt
        assert receipt is not None
        body = receipt.to_dict()
        if args.receipt and args.receipt != "-":
            try:
                Path(args.receipt).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
            except OSError as exc:
                raise ConfigError("receipt", args.receipt, "a writable file path", str(exc)) from None
        if args.json:
            obj: dict[str, Any] = {"tokens": list(gen.tokens), "text": gen.text(), "receipt": body}
            if timer:
                obj["phases"] = timer.summary()
            print(json.dumps(obj))
            return 130 if cancelled else 0
    out.write("\n")
    if args.receipt == "-":  # the full receipt on stdout, after the text
        out.write(json.dumps(body, indent=2) + "\n")
    out.flush()
    if timer:
        for phase, row in timer.summary().items():
            print(f"phase {phase:<10} {row['seconds'] * 1e3:9.2f} ms over {row['calls']:.0f} calls", file=sys.stderr)
    print(_summary_line(receipt, args.receipt if args.receipt != "-" else None), file=sys.stderr)
    return 130 if cancelled else 0


def _cmd_selftest(args: argparse.Namespace) -> int:
    from power_core.config import PowerConfig
    from power_core.session import Session

    config = PowerConfig.from_mapping({}, spec_mode="off", selftest=True, numerics=args.numerics,
                                      n_threads=args.threads, n_ctx=args.n_ctx, rpc_servers=args.rpc,
                                      n_gpu_layers=args.gpu_layers, devices=args.devices, flash_attn=args.flash_attn)
    with Session.open(config, model=args.model, backend=args.backend) as session:
        report = session.numerics
        assert report is not None
        out = {"model": session.opened.model_path, "backend": session.backend.name, "numerics": config.numerics,
               **report.to_dict()}
    batch = None
    if args.batch:
        from power_core.numerics import batch_probe

        if args.batch < 2:
            raise UsageError(f"power selftest: --batch needs at least 2 sequences, not {args.batch}")
        with Session.open_batch(args.batch, config, model=args.model, backend=args.backend) as sessions:
            batch = batch_probe(sessions.runtime)
        out["batch"] = batch.to_dict()
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['model']} ({out['backend']}, numerics={config.numerics}): {report.reason()}")
        for p in report.probes:
            print(f"  context {p['context']:>4} width {p['width']:>2}: {p['rows_differing']} rows differ, "
                  f"max |diff| {p['max_abs_diff']:.4g}, argmax flips {p['argmax_flips']}")
        if batch is not None:
            print(f"  shared passes: {batch.reason()}")
    return 0 if report.identical and (batch is None or batch.identical) else 3


def _cmd_bench(args: argparse.Namespace) -> int:
    from power_core.bench import BenchSpec, run_bench
    from power_core.errors import MissingDependency

    spec = BenchSpec(model=args.model, modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                     prompts=tuple(Path(p) for p in args.prompts), runs=args.runs, tokens=args.tokens,
                     threads=args.threads, draft=args.draft, n_ctx=args.n_ctx,
                     peer_bin=Path(args.peer_bin) if args.peer_bin else None, out=Path(args.out),
                     numerics=args.numerics or "exact", n_gpu_layers=args.gpu_layers or 0,
                     devices=args.devices or (), flash_attn=args.flash_attn or "auto",
                     draft_gpu_layers=args.draft_gpu_layers,
                     **({"peer_numerics": args.peer_numerics} if args.peer_numerics else {}))
    try:
        report = run_bench(spec, progress=not args.no_progress and sys.stderr.isatty())
    except MissingDependency as exc:  # an install to fix, found before any run: exit 1 as a usage error does
        print(f"error[{exc.code}]: {exc}", file=sys.stderr)
        return 1
    print((spec.out / "report.md").read_text())
    if report["parity_failures"]:
        print(f"parity failure: {report['parity_failures']}", file=sys.stderr)
        return 1
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from power_core.calibrate import DEFAULT_TASKS, CalibrateSpec, run_calibrate
    from power_core.errors import MissingDependency

    spec = CalibrateSpec(tasks=Path(args.tasks) if args.tasks else DEFAULT_TASKS,
                         modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                         numerics=args.numerics or "exact", orders=args.orders, max_tokens=args.max_tokens,
                         model=args.model, draft=args.draft, backend=args.backend, threads=args.threads,
                         n_ctx=args.n_ctx, stop=tuple(args.stop or ()),
                         chat_template=Path(args.chat_template) if args.chat_template else None, out=Path(args.out))
    try:
        report = run_calibrate(spec, progress=not args.no_progress and sys.stderr.isatty())
    except MissingDependency as exc:  # an install to fix, found before any run: exit 1 as power bench does
        print(f"error[{exc.code}]: {exc}", file=sys.stderr)
        return 1
    print((spec.out / "report.md").read_text())
    if report["output_differences"]:
        print(f"outputs that differ from --mode off ({spec.numerics} numerics): "
              f"{[(d['task'], d['mode']) for d in report['output_differences']]}", file=sys.stderr)
    if report["answer_parity_failures"]:
        print(f"answers that differ from --mode off: {report['answer_parity_failures']}", file=sys.stderr)
        if args.require_parity:
            return 1
    return 0


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


def _strategy_keys() -> tuple[Any, ...]:
    """The installed strategies' own configuration keys (none when a plugin fails to load: the command
    then reports that plugin's error when it opens a session)."""
    from power_core.config import CORE_KEYS
    from power_core.errors import PluginError
    from power_core.plugins import get_plugins

    try:
        keys = get_plugins().config_keys()
    except PluginError:
        return ()
    return keys[len(CORE_KEYS):]


def _strategy_flags(r: argparse.ArgumentParser) -> None:
    """One flag per strategy key that declares one (``ConfigKey.flag``), stored under the key's name."""
    from power_core.config import key_owners

    for key in _strategy_keys():
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


def _chat_template(args: argparse.Namespace) -> str | None:
    if not args.chat_template:
        return None
    try:
        return Path(args.chat_template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("chat_template", args.chat_template, "a readable UTF-8 Jinja file", str(exc)) from None


def _serve_strategies(mode: str | None) -> list[str] | None:
    """``power serve --mode a,b,c``: the strategies every slot runs (the first is the default); one
    name (or none): ``None``, the one ``spec_mode`` as ``power run`` takes it."""
    if mode is None or "," not in mode:
        return None
    names = [m.strip() for m in mode.split(",")]
    if not all(names) or len(set(names)) != len(names):
        why = "an empty name" if not all(names) else "a strategy named twice"
        raise ConfigError("spec_mode", mode, "strategy names separated by commas, each once (e.g. mtp,suffix,off)",
                          f"--mode has {why}")
    return names


def _config_file_keys(args: argparse.Namespace) -> set[str]:
    """The keys ``--config`` sets (none without it; the file loaded once already, so it parses)."""
    if not args.config:
        return set()
    import tomllib

    data = tomllib.loads(Path(args.config).read_text(encoding="utf-8"))
    if set(data) == {"power"} and isinstance(data["power"], dict):
        data = data["power"]
    return set(data)


def _serve_max_tokens(args: argparse.Namespace, configured: int) -> int | None:
    """``power serve``'s cap on an answer's tokens: ``--max-tokens``, or ``max_tokens`` in ``--config``;
    ``None`` when the operator set neither (an answer may then fill the context, as OpenAI's does)."""
    if args.max_tokens is not None or "max_tokens" in _config_file_keys(args):
        return configured
    return None


def _serve_config(args: argparse.Namespace, strategies: list[str] | None) -> PowerConfig:
    """The configuration ``power serve`` runs: the flags and ``--config``, then, for each key the operator
    set in neither, its ``serve_default`` where a strategy this server runs owns it (power-suffix's
    cross-request memory: on in a server, off in a library session)."""
    import attrs

    from power_core.config import key_owners

    # several strategies: the configuration carries every one's keys (as under auto); each takes its own
    config = _config_from_args(args, mode="auto" if strategies is not None else None)
    running = set(strategies or [config.spec_mode])
    in_file = _config_file_keys(args)
    defaults = {key.name: key.serve_default for key in _strategy_keys()
                if key.serve_default is not None and getattr(args, key.name, None) is None
                and key.name not in in_file and running & set(key_owners(key.name))}
    return attrs.evolve(config, **defaults) if defaults else config


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    try:
        from power_core.serve import ServeOptions, is_loopback, open_sessions, serve
    except ImportError as exc:
        raise UsageError(f"power serve needs the serve extra ({exc}): pip install 'power-core[serve]'") from None
    api_key = args.api_key or os.environ.get("POWER_API_KEY") or None
    if not is_loopback(args.host) and api_key is None and not args.no_auth:
        raise ConfigError("host", args.host, "a loopback address, or --api-key KEY (or POWER_API_KEY)",
                          "anyone who reaches the port could use the model; pass --no-auth to serve it open anyway")
    for flag, value, lo in (("--parallel", args.parallel, 1), ("--queue", args.queue, 0),
                            ("--max-body", args.max_body, 1024), ("--receipts", args.receipts, 1),
                            ("--receipts-ram", args.receipts_ram, 1)):
        if value < lo:
            raise UsageError(f"power serve: {flag} must be at least {lo}, not {value}")
    if not 0.0 <= args.audit_rate <= 1.0:
        raise UsageError(f"power serve: --audit-rate must be a fraction in [0, 1], not {args.audit_rate}")
    for flag, value in (("--timeout", args.timeout), ("--drain-timeout", args.drain_timeout)):
        if not value > 0:
            raise UsageError(f"power serve: {flag} must be a positive number of seconds, not {value}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"power serve: --port must be in [0, 65535], not {args.port}")
    if args.cache_ram < 0:
        raise UsageError(f"power serve: --cache-ram must be a number of MiB >= 0 (0: off), not {args.cache_ram}")
    strategies = _serve_strategies(args.mode)
    config = _serve_config(args, strategies)
    template = _chat_template(args)
    from power_core.memory import PromptCache

    cache = PromptCache.of_mib(args.cache_ram, share_tenants=args.cache_share_tenants)
    slots = open_sessions(config, args.parallel, batch=not args.no_batch, queue=args.queue, model=args.model,
                          draft=args.draft, backend=args.backend, prompt_cache=cache, strategies=strategies)
    sessions = slots.sessions
    try:
        if sessions[0].opened.tokenizer is None:
            raise ConfigError("model", sessions[0].opened.model_path, "a model with a tokenizer",
                              "the OpenAI API speaks text; this model has no tokenizer")
        chat_template = None
        if template is not None:
            from power_core.chat import template_for

            # built and compiled once per server, with the GGUF's BOS/EOS; every request renders this object
            chat_template = template_for(sessions[0].opened.model_path, template)
            chat_template.render([{"role": "user", "content": "ping"}])  # a broken template fails now, not per request
        name = args.served_model_name or Path(sessions[0].opened.model_path or "model").name.removesuffix(".gguf")
        options = ServeOptions(model_name=name, queue=args.queue, timeout=args.timeout, api_key=api_key,
                               max_body=args.max_body, receipts=args.receipts, receipts_bytes=args.receipts_ram << 20,
                               chat_template=chat_template, drain_timeout=args.drain_timeout, audit_rate=args.audit_rate,
                               max_tokens=_serve_max_tokens(args, config.max_tokens))
        serve(slots, options, args.host, args.port, log_level="info" if args.verbose else "warning")
    finally:
        slots.close()
    return 0


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
    p.set_defaults(func=_cmd_plugins)

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
    r.set_defaults(func=_cmd_run)

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
                   help="at most this many MiB of them (as JSON), the oldest dropped first (default 64)")
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
    v.set_defaults(func=_cmd_serve)

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
    t.set_defaults(func=_cmd_selftest)

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
    b.set_defaults(func=_cmd_bench)

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
    c.set_defaults(func=_cmd_calibrate)

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
