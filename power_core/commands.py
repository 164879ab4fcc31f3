"""What each ``power`` subcommand does (``plugins``, ``run``, ``selftest``, ``bench``, ``calibrate``,
``serve``), given its parsed flags (:mod:`power_core.cli` parses them and turns failures into exit codes).

``power run`` prints the text to stdout as rounds commit, then one summary line to stderr; the full
receipt goes to ``--receipt FILE`` or, with ``--json``, into the one JSON object printed at the end.
Ctrl-C cancels the request at the next step (a decode in flight is aborted): the committed text stays
printed, the receipt says ``cancelled``, and the exit code is 130. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from power_core.errors import Cancelled, ConfigError

if TYPE_CHECKING:
    from power_core.config import PowerConfig

__all__ = ["UsageError", "cmd_bench", "cmd_calibrate", "cmd_plugins", "cmd_run", "cmd_selftest", "cmd_serve",
           "strategy_keys"]

DEFAULT_PROMPT = "Speculative decoding lets a small model propose tokens that a large model verifies."


class UsageError(Exception):
    """Flags the command refuses (``power`` exits 1 and prints the message, no traceback)."""


def cmd_plugins(args: argparse.Namespace) -> int:
    """``power plugins``: the installed plugins, their strategies and backends (``--json``: as JSON)."""
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
        "spec_recurrent_snapshots": args.snapshots,
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
        "spec_adaptive": True if args.adaptive else None,
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
    overrides.update({key.name: getattr(args, key.name, None) for key in strategy_keys()})
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


def cmd_run(args: argparse.Namespace) -> int:
    """``power run``: one request, its text streamed to stdout, then its summary line (and receipt)."""
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


def cmd_selftest(args: argparse.Namespace) -> int:
    """``power selftest``: are the target's verify rows bit-identical to one-token decodes (exit 0 yes, 3 no)?"""
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


def cmd_bench(args: argparse.Namespace) -> int:
    """``power bench``: the paired, interleaved benchmark of modes (and llama.cpp peers), as evidence."""
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


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``power calibrate``: each mode's answers to a task set against ``--mode off``'s, as evidence."""
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


def strategy_keys() -> tuple[Any, ...]:
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
    defaults = {key.name: key.serve_default for key in strategy_keys()
                if key.serve_default is not None and getattr(args, key.name, None) is None
                and key.name not in in_file and running & set(key_owners(key.name))}
    return attrs.evolve(config, **defaults) if defaults else config


def cmd_serve(args: argparse.Namespace) -> int:
    """``power serve``: the OpenAI-compatible server, until it is told to stop."""
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
