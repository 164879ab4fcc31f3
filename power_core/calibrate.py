"""``power calibrate``: paired answer-quality calibration of speculative modes against ``--mode off``.

A task file (JSONL, one task per line) gives each task an ``id``, a ``prompt`` (plain text) or
``messages`` (a chat, rendered with the model's chat template or ``--chat-template FILE``), the
expected ``answer``, and how to ``extract`` an answer from the output: ``{"regex": "..."}`` (the first
group that took part in the match, else the whole match), ``"first_number"`` (the first number in the
output, thousands separators dropped) or ``"exact"`` (the whole output, stripped; the default).
Answers are compared after normalization (:func:`answer_key`): numbers by value; text without case,
surrounding punctuation and repeated whitespace.

Every mode answers every task in ``orders`` rotated orders (order *i* starts at mode *i*), interleaved
per task like ``power bench``'s paired runs, each run in a fresh session (``power bench``'s cells: no run
learns from an earlier one). ``off`` is always run: it is the reference. For each task and mode the
report has the extracted answer, whether it is correct, whether it equals ``off``'s answer (*answer
parity*) and whether the whole output equals ``off``'s token for token (*output parity*, the receipts'
``output_sha256``), outputs cut by ``max_tokens``, request-wide tok/s (output tokens per second of
prefill + decode) and acceptance. With ``exact`` numerics every output should equal ``off``'s; with
``stock`` each output that differs is listed (first differing token, both answers, both texts, and
whether the target's batch numerics explain it) — never averaged into a score.

Bad input (a missing, empty or non-UTF-8 task file, a malformed line, an unknown mode or extractor, a
regex that does not compile, a task without an answer) is a :class:`~power_core.errors.ConfigError`
naming the line and key, raised before any model loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from power_core.bench import (
    BarPanel,
    BenchSpec,
    _fmt,
    _numerics_probe,
    _PowerCell,
    _stats,
    check_dependencies,
    plot_bars,
    write_evidence,
)
from power_core.errors import ConfigError, PowerError

__all__ = ["CalibrateSpec", "Task", "Extractor", "DEFAULT_TASKS", "load_tasks", "answer_key", "run_calibrate"]

#: the shipped task set: short chat tasks (arithmetic, copying, lookup from context, short facts)
DEFAULT_TASKS = Path(__file__).resolve().parent / "data" / "calibration.jsonl"
TASK_KEYS = ("id", "prompt", "messages", "answer", "extract")
EXTRACTORS = ("exact", "first_number", "regex")
_NUMBER = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?")
_PUNCT = " \t\n.,;:!?\"'`()[]{}*_"


@attrs.frozen
class Extractor:
    """How an answer is read from an output: ``exact``, ``first_number`` or ``regex`` (with ``pattern``)."""

    kind: str
    pattern: re.Pattern[str] | None = None

    def __call__(self, text: str | None) -> str | None:
        if text is None:
            return None
        if self.kind == "exact":
            return text.strip()
        if self.kind == "first_number":
            m = _NUMBER.search(text)
            return m.group(0).replace(",", "") if m else None
        assert self.pattern is not None
        m = self.pattern.search(text)
        if m is None:
            return None
        return next((g for g in m.groups() if g is not None), m.group(0))

    def describe(self) -> str | dict[str, str]:
        return {"regex": self.pattern.pattern} if self.pattern is not None else self.kind


def answer_key(answer: str | None, kind: str) -> str | None:
    """What two answers are compared by: a number's value (``first_number``), else the text without
    case, surrounding punctuation and repeated whitespace (``None``: no answer)."""
    if answer is None:
        return None
    if kind == "first_number":
        try:
            value = float(answer.replace(",", ""))
        except ValueError:
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    key = " ".join(answer.split()).strip(_PUNCT).casefold()
    return key or None


@attrs.frozen
class Task:
    id: str
    answer: str
    extract: Extractor
    line: int
    prompt: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None

    def key(self, answer: str | None) -> str | None:
        return answer_key(answer, self.extract.kind)

    def correct(self, answer: str | None) -> bool:
        got = self.key(answer)
        return got is not None and got == self.key(self.answer)


def _task(obj: Any, n: int, path: Path) -> Task:
    where = f"{path} line {n}"

    def bad(field: str, value: Any, allowed: str, detail: str = "") -> ConfigError:
        return ConfigError(f"tasks line {n}: {field}", value, allowed, f"{where}{': ' + detail if detail else ''}")

    if not isinstance(obj, dict):
        raise bad("task", obj, 'a JSON object: {"id", "prompt" or "messages", "answer", "extract"}')
    unknown = sorted(set(obj) - set(TASK_KEYS))
    if unknown:
        raise bad(unknown[0], obj[unknown[0]], f"only the keys {', '.join(TASK_KEYS)}", f"unknown key(s) {unknown}")
    tid = obj.get("id")
    if isinstance(tid, bool) or not isinstance(tid, (str, int)) or not str(tid).strip():
        raise bad("id", tid, "a non-empty string (or an integer) naming the task")
    tid = str(tid)
    answer = obj.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise bad("answer", answer, "the expected answer: a non-empty string or a number", f"task {tid!r}")
    answer = str(answer)
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise bad("prompt", prompt, 'exactly one of "prompt" (text) or "messages" (a chat)', f"task {tid!r}")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise bad("prompt", prompt, "a non-empty string", f"task {tid!r}")
    msgs: tuple[Mapping[str, str], ...] | None = None
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise bad("messages", messages, 'a non-empty list of {"role": str, "content": str} objects',
                      f"task {tid!r}")
        msgs = tuple({"role": m["role"], "content": m["content"]} for m in messages)
    spec = obj.get("extract", "exact")
    if isinstance(spec, dict):
        if set(spec) != {"regex"} or not isinstance(spec["regex"], str) or not spec["regex"]:
            raise bad("extract", spec, '{"regex": "PATTERN"}, "first_number" or "exact"', f"task {tid!r}")
        try:
            extractor = Extractor("regex", re.compile(spec["regex"]))
        except re.error as exc:
            raise bad("extract.regex", spec["regex"], "a Python regular expression that compiles",
                      f"task {tid!r}: {exc}") from None
    elif spec in ("exact", "first_number"):
        extractor = Extractor(spec)
    else:
        raise bad("extract", spec, '{"regex": "PATTERN"}, "first_number" or "exact"', f"task {tid!r}")
    if extractor.kind == "first_number" and answer_key(answer, "first_number") is None:
        raise bad("answer", answer, 'a number (the task extracts "first_number")', f"task {tid!r}")
    return Task(id=tid, answer=answer, extract=extractor, line=n, prompt=prompt, messages=msgs)


def load_tasks(path: Path) -> tuple[Task, ...]:
    """Read and check a JSONL task file; every problem is a :class:`ConfigError` naming the line."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError("tasks", str(path), "an existing, readable JSONL task file (one task per line)",
                          exc.strerror or str(exc)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = raw[:exc.start].count(b"\n") + 1
        raise ConfigError("tasks", str(path), "a UTF-8 JSONL file",
                          f"line {at}: byte {raw[exc.start]:#04x} is not UTF-8 ({exc.reason})") from None
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"tasks line {n}", line[:60], "one JSON object per line",
                              f"{path} line {n}, column {exc.colno}: {exc.msg}") from None
        task = _task(obj, n, Path(path))
        if task.id in seen:
            raise ConfigError(f"tasks line {n}: id", task.id, "an id no other task has",
                              f"{path}: line {seen[task.id]} has it too")
        seen[task.id] = n
        tasks.append(task)
    if not tasks:
        raise ConfigError("tasks", str(path), "at least one task (one JSON object per line)", "the file has none")
    return tuple(tasks)


@attrs.frozen
class CalibrateSpec:
    tasks: Path = DEFAULT_TASKS
    #: the modes to compare (``off`` is always added: the reference); no default here, as in ``BenchSpec``:
    #: ``power calibrate --modes`` holds it, and the core names no first-party strategy
    modes: tuple[str, ...] = attrs.field(kw_only=True)
    numerics: str = "exact"
    #: rotated mode orders per task (order i starts at mode i)
    orders: int = 2
    max_tokens: int = 48
    model: str | None = None
    draft: str | None = None
    backend: str | None = None
    threads: int = 2
    n_ctx: int = 2048
    stop: tuple[str, ...] = ()
    #: a Jinja chat template for ``messages`` tasks (None: the GGUF's ``tokenizer.chat_template``)
    chat_template: Path | None = None
    out: Path = Path("evidence/calibrate")


def check_spec(spec: CalibrateSpec, known_modes: Sequence[str]) -> tuple[tuple[Task, ...], str | None]:
    """Bad input is a typed error before any model loads: the tasks and the chat template's source."""
    for key, value, lo in (("orders", spec.orders, 1), ("max_tokens", spec.max_tokens, 1), ("threads", spec.threads, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ConfigError(key, value, f"an integer >= {lo}")
    if not spec.modes:
        raise ConfigError("modes", "", "a comma-separated list of modes, e.g. off,suffix")
    for m in spec.modes:
        if m not in known_modes:
            raise ConfigError("modes", m, f"an installed strategy: {', '.join(sorted(known_modes))}")
    if spec.numerics not in ("exact", "stock"):
        raise ConfigError("numerics", spec.numerics, "exact or stock")
    tasks = load_tasks(spec.tasks)
    template = None
    if spec.chat_template is not None:
        try:
            template = Path(spec.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("chat_template", str(spec.chat_template), "a readable UTF-8 Jinja file",
                              str(exc)) from None
    return tasks, template


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def run_calibrate(spec: CalibrateSpec, *, progress: bool = True, plugins: Any = None) -> dict[str, Any]:
    """Run every task in every mode; write report.json, report.md and calibration.png under ``spec.out``."""
    check_dependencies("power calibrate (calibration.png)")
    from rich.progress import Progress

    from power_core.plugins import get_plugins

    plugins = plugins or get_plugins()
    tasks, template = check_spec(spec, plugins.strategies.names())
    modes = ("off", *dict.fromkeys(m for m in spec.modes if m != "off"))
    bench = BenchSpec(model=spec.model, modes=modes, prompts=(), tokens=spec.max_tokens, threads=spec.threads,
                      draft=spec.draft, out=spec.out, n_ctx=spec.n_ctx, numerics=spec.numerics, backend=spec.backend)
    report: dict[str, Any] = {
        "schema": "power.calibrate/1", "model": spec.model, "modes": list(modes), "numerics": spec.numerics,
        "orders": spec.orders, "max_tokens": spec.max_tokens, "threads": spec.threads, "stop": list(spec.stop),
        "tasks_file": Path(spec.tasks).name, "tasks_sha256": _sha256(Path(spec.tasks).read_bytes()),
        "chat_template": ({"file": Path(spec.chat_template).name, "sha256": _sha256(template.encode())}
                          if spec.chat_template is not None and template is not None else "the model's"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "loadavg_start": _loadavg()},
    }
    cells: dict[str, _PowerCell] = {}
    cpu = _cpu()
    try:
        cells["off"] = _PowerCell(bench, "off", plugins)
        session = cells["off"].session
        prompts = [_render(session, t, template) for t in tasks]  # a task the model cannot take fails now
        for m in modes[1:]:
            cells[m] = _PowerCell(bench, m, plugins)
        report["model_path"] = session.opened.model_path
        report["backend"] = session.backend.name
        info = session.opened.backend_info
        report["build"] = {k: info.get(k) for k in ("llama_cpp_commit", "sdist_sha256", "flags", "patches")}
        raw: dict[str, dict[str, list[dict[str, Any]]]] = {t.id: {m: [] for m in modes} for t in tasks}
        with Progress(disable=not progress, transient=True) as bar:
            job = bar.add_task("power calibrate", total=len(tasks) * spec.orders * len(modes))
            for task, ids in zip(tasks, prompts, strict=True):
                for i in range(spec.orders):
                    r = i % len(modes)
                    for pos, m in enumerate(modes[r:] + modes[:r]):
                        run = cells[m].run(ids, spec.max_tokens, stop=spec.stop or None)
                        run.update(order=i, position=pos, answer=task.extract(run["text"]))
                        raw[task.id][m].append(run)
                        bar.advance(job)
        _summarize(report, tasks, prompts, modes, raw, cells)
    finally:
        for c in cells.values():
            c.close()
    report["machine"].update(loadavg_end=_loadavg(), foreign_cpu=_foreign_share(cpu))
    write_evidence(spec.out, report, _markdown, _plot, "calibration.png")
    return report


def _loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages (None where the platform has none): tok/s on a busy machine is noisy."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _cpu() -> tuple[float, float, float] | None:
    """(wall s, the machine's busy CPU s, this process's CPU s), or None without /proc/stat (not Linux)."""
    import resource
    import time

    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), busy, own.ru_utime + own.ru_stime


def _foreign_share(start: tuple[float, float, float] | None) -> float | None:
    """The share of the machine's CPU other processes used since ``start`` (0: none, 1: every core)."""
    end = _cpu()
    if start is None or end is None or end[0] <= start[0]:
        return None
    share = ((end[1] - start[1]) - (end[2] - start[2])) / ((end[0] - start[0]) * (os.cpu_count() or 1))
    return round(min(1.0, max(0.0, share)), 3)


def _render(session: Any, task: Task, template: str | None) -> list[int]:
    if task.messages is None:
        assert task.prompt is not None
        return [int(t) for t in session.encode(task.prompt)]
    try:
        return [int(t) for t in session.chat_prompt(list(task.messages), chat_template=template)]
    except PowerError as exc:
        raise ConfigError(f"tasks line {task.line}: messages", f"task {task.id!r}",
                          "a chat the model's chat template renders (or a plain \"prompt\" task)",
                          f"{exc}; a model without a chat template needs --chat-template FILE "
                          "(e.g. docs/examples/plain-qa.jinja)") from None


def _request_tok_s(run: Mapping[str, Any]) -> float:
    return run["n"] / run["seconds"] if run["seconds"] > 0 else 0.0


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where two token lists differ (the shorter length when one is a prefix of the other)."""
    for j, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def _summarize(report: dict[str, Any], tasks: Sequence[Task], prompts: Sequence[list[int]], modes: Sequence[str],
               raw: Mapping[str, Mapping[str, list[dict[str, Any]]]], cells: Mapping[str, _PowerCell]) -> None:
    per_task: dict[str, Any] = {}
    answer_failures: list[dict[str, Any]] = []
    differences: list[dict[str, Any]] = []
    for task, ids in zip(tasks, prompts, strict=True):
        ref = raw[task.id]["off"][0]
        cells_out: dict[str, Any] = {}
        for m in modes:
            runs = raw[task.id][m]
            first = runs[0]
            answer_parity = all(task.key(r["answer"]) == task.key(ref["answer"]) for r in runs)
            output_parity = all(r["digest"] == ref["digest"] for r in runs)
            accepted, proposed = sum(r["accepted"] for r in runs), sum(r["proposed"] for r in runs)
            cell: dict[str, Any] = {
                "answer": first["answer"], "correct": sum(task.correct(r["answer"]) for r in runs) / len(runs),
                "answer_parity": answer_parity, "output_parity": output_parity,
                "output_sha256": first["digest"], "stable": all(r["digest"] == first["digest"] for r in runs),
                "tokens": first["n"], "finish_reason": first["finish_reason"],
                "truncated": any(r["finish_reason"] == "max_tokens" for r in runs), "text": first["text"],
                "request_tok_s": _stats([_request_tok_s(r) for r in runs]),
                "acceptance": accepted / proposed if proposed else None,
                "runs": [{"order": r["order"], "position": r["position"], "answer": r["answer"],
                          "output_sha256": r["digest"], "tokens": r["n"], "finish_reason": r["finish_reason"],
                          "request_tok_s": _request_tok_s(r), "decode_tok_s": r["tok_s"],
                          "acceptance": r["acceptance"]} for r in runs]}
            if not answer_parity:
                bad = next(r for r in runs if task.key(r["answer"]) != task.key(ref["answer"]))
                answer_failures.append({"task": task.id, "mode": m, "order": bad["order"], "off": ref["answer"],
                                        "answer": bad["answer"]})
            if not output_parity:
                bad = next(r for r in runs if r["digest"] != ref["digest"])
                d = _first_divergence(ref["tokens"], bad["tokens"])
                probe = None
                if m != "off" and d is not None and 0 < d < len(ref["tokens"]):
                    probe = _numerics_probe(cells[m], ids, ref["tokens"], d, bad["rounds"])
                cell["first_divergence"] = d
                differences.append({
                    "task": task.id, "mode": m, "order": bad["order"], "first_divergence": d,
                    "off_tokens": ref["n"], "tokens": bad["n"], "off_answer": ref["answer"], "answer": bad["answer"],
                    "answer_changed": task.key(bad["answer"]) != task.key(ref["answer"]),
                    "off_correct": task.correct(ref["answer"]), "correct": task.correct(bad["answer"]),
                    "off_text": ref["text"], "text": bad["text"], "numerics": probe})
            cells_out[m] = cell
        per_task[task.id] = {"expected": task.answer, "extract": task.extract.describe(),
                             "prompt_tokens": len(ids), "modes": cells_out}
    report["tasks"] = per_task
    report["answer_parity_failures"] = answer_failures
    report["output_differences"] = differences
    report["summary"] = {m: _mode_summary(m, tasks, raw, per_task, len(modes)) for m in modes}


def _mode_summary(m: str, tasks: Sequence[Task], raw: Mapping[str, Mapping[str, list[dict[str, Any]]]],
                  per_task: Mapping[str, Any], n_modes: int) -> dict[str, Any]:
    cells = {t.id: per_task[t.id]["modes"][m] for t in tasks}
    orders = len(next(iter(raw.values()))[m])
    same = [t.id for t in tasks if cells[t.id]["output_parity"]]

    def rate(mode: str, order: int, ids: Sequence[str]) -> float | None:
        n = sum(raw[t][mode][order]["n"] for t in ids)
        s = sum(raw[t][mode][order]["seconds"] for t in ids)
        return n / s if s > 0 else None

    totals = [rate(m, i, [t.id for t in tasks]) for i in range(orders)]
    ratios = []
    for i in range(orders):
        a, b = rate(m, i, same), rate("off", i, same)
        if same and a is not None and b:
            ratios.append(a / b)
    proposed = sum(r["proposed"] for t in tasks for r in raw[t.id][m])
    accepted = sum(r["accepted"] for t in tasks for r in raw[t.id][m])
    return {
        "score": sum(c["correct"] for c in cells.values()) / len(tasks),
        "correct": sum(c["correct"] for c in cells.values()), "tasks": len(tasks),
        "answers_equal_off": sum(c["answer_parity"] for c in cells.values()),
        "outputs_equal_off": len(same),
        "answers_differ": [t for t, c in cells.items() if not c["answer_parity"]],
        "outputs_differ": [t for t, c in cells.items() if not c["output_parity"]],
        "truncated": [t for t, c in cells.items() if c["truncated"]],
        "unstable": [t for t, c in cells.items() if not c["stable"]],
        "request_tok_s": _stats([x for x in totals if x is not None]),
        "ratio_to_off": _stats(ratios), "ratio_tasks": len(same),
        "proposed": proposed, "accepted": accepted, "acceptance": accepted / proposed if proposed else None,
    }


# -- the report ------------------------------------------------------------------------------------------------------

def _cell_text(value: str | None, limit: int = 40) -> str:
    if value is None:
        return "—"
    text = value.replace("\n", "⏎").replace("|", "\\|").replace("`", "'")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _score(summary: Mapping[str, Any]) -> str:
    c = summary["correct"]
    shown = f"{c:.0f}" if float(c).is_integer() else f"{c:.2f}"
    return f"{shown}/{summary['tasks']} ({summary['score']:.0%})"


def _tail(text: str | None, at: int, width: int = 48) -> str:
    if text is None:
        return "—"
    return _cell_text(("…" if at > 0 else "") + text[at: at + width], width + 2)


def _markdown(report: dict[str, Any]) -> str:
    modes, tasks = report["modes"], report["tasks"]
    name = Path(report.get("model_path") or report["model"] or "embedded model").name
    template = report["chat_template"]
    template_text = (f"`{template['file']}` (sha256 {template['sha256'][:12]}…)" if isinstance(template, dict)
                     else "the model's own (for `messages` tasks)")
    stop = f", stop strings {report['stop']}" if report["stop"] else ""
    lines = [f"# power calibrate: {name}", "",
             f"{len(tasks)} tasks from `{report['tasks_file']}` (sha256 {report['tasks_sha256'][:12]}…), greedy, at most "
             f"{report['max_tokens']} tokens{stop}; numerics {report['numerics']}; chat template {template_text}; "
             f"{report['threads']} thread{'' if report['threads'] == 1 else 's'}, backend {report.get('backend')}. Every mode answers every task in "
             f"{report['orders']} rotated orders, interleaved per task, each run in a fresh session.", "",
             "*score*: extracted answers equal to the expected one; *answers = off* / *outputs = off*: the extracted "
             "answer / the complete output (token digest) equals `--mode off`'s in every order; *truncated*: outputs "
             "cut at max_tokens; *request tok/s*: output tokens per second of whole requests (prefill + decode) over "
             "all tasks, median (min–max) over the orders; *× off*: the same ratio per order, on the tasks whose "
             "output equals off's.", "",
             "| mode | score | answers = off | outputs = off | truncated | request tok/s | × off | acceptance |",
             "|---|---|---|---|---|---|---|---|"]
    for m in modes:
        s = report["summary"][m]
        acc = ("—" if m == "off" else "— (nothing proposed)") if s["acceptance"] is None else (
            f"{s['acceptance']:.2f} ({s['accepted']}/{s['proposed']})")
        lines.append(f"| {m} | {_score(s)} | {s['answers_equal_off']}/{s['tasks']} | {s['outputs_equal_off']}/"
                     f"{s['tasks']} | {len(s['truncated'])} | {_fmt(s['request_tok_s'])} | "
                     f"{_fmt(s['ratio_to_off'], 3)} | {acc} |")
    lines.append("")
    diffs = report["output_differences"]
    if not diffs:
        lines += [f"Every complete output equals `--mode off`'s ({report['numerics']} numerics), so every answer "
                  "does too.", ""]
    else:
        failures = report["answer_parity_failures"]
        lines += [f"**{len(diffs)} outputs differ from `--mode off`** ({report['numerics']} numerics; "
                  f"{len(failures)} of them with another answer). Each is listed, none is averaged away:", ""]
        for d in diffs:
            at = d["first_divergence"]
            off_text, text = d["off_text"], d["text"]
            char = next((j for j, (a, b) in enumerate(zip(off_text or "", text or "", strict=False)) if a != b),
                        min(len(off_text or ""), len(text or "")))
            answer = (f"answer `{_cell_text(d['off_answer'])}` → `{_cell_text(d['answer'])}`"
                      + (" (score " + ("kept" if d["off_correct"] == d["correct"] else
                                       "gained" if d["correct"] else "lost") + ")")
                      if d["answer_changed"] else f"same answer `{_cell_text(d['answer'])}`")
            n = d.get("numerics")
            why = ""
            if n and "max_abs_diff" in n:
                why = (f"; replaying the run's passes, the row predicting token {n['position']} differs from one-token "
                       f"decodes by up to {n['max_abs_diff']:.3g} (argmax {n['argmax_one_token']} one token at a time "
                       f"vs {n['argmax_in_run_pass']} in the verify pass): "
                       + ("the target's batch numerics explain it" if n["explained_by_batch_numerics"]
                          else "numerics do not explain it"))
            lines.append(f"- `{d['task']}` / {d['mode']} (order {d['order']}): first differing token {at} "
                         f"(off {d['off_tokens']} tokens, {d['mode']} {d['tokens']}); {answer}; off "
                         f"`{_tail(off_text, char)}` vs `{_tail(text, char)}`{why}")
        lines.append("")
    truncated = {m: report["summary"][m]["truncated"] for m in modes if report["summary"][m]["truncated"]}
    if truncated:
        lines += ["Truncated at max_tokens (the answer is read from the cut output): "
                  + "; ".join(f"{m}: {', '.join(ids)}" for m, ids in truncated.items()) + ".", ""]
    unstable = {m: report["summary"][m]["unstable"] for m in modes if report["summary"][m]["unstable"]}
    if unstable:
        lines += ["**Not repeatable** (a mode's outputs differ between its own orders): "
                  + "; ".join(f"{m}: {', '.join(ids)}" for m, ids in unstable.items()) + ".", ""]
    machine = report["machine"]
    if machine.get("foreign_cpu") is not None:
        start, end = machine.get("loadavg_start"), machine.get("loadavg_end")
        load = f" (1-minute load average {start[0]} at the start, {end[0]} at the end)" if start and end else ""
        lines += [f"Shared machine: other processes used {machine['foreign_cpu']:.0%} of its {machine['cpus']} CPUs "
                  f"during the run{load}; the modes ran interleaved, so contention reached each alike, but absolute "
                  "tok/s are only as good as the machine was quiet.", ""]
    lines += ["## Answers", "",
              "✓ correct, ✗ wrong; *≠ off*: the answer differs from off's; *output ≠ off*: same answer, other output; "
              "*cut*: truncated at max_tokens.", "",
              "| task | expected | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
    for tid, t in tasks.items():
        row = []
        for m in modes:
            c = t["modes"][m]
            mark = "✓" if c["correct"] == 1 else "✗" if c["correct"] == 0 else f"{c['correct']:.2f}"
            flags = [f for f, on in (("≠ off", not c["answer_parity"]),
                                     ("output ≠ off", c["answer_parity"] and not c["output_parity"]),
                                     ("cut", c["truncated"])) if on]
            row.append(f"{_cell_text(c['answer'])} {mark}" + (f" ({', '.join(flags)})" if flags else ""))
        lines.append(f"| `{tid}` | {_cell_text(t['expected'])} | " + " | ".join(row) + " |")
    lines += ["", "## Speed per task", "",
              "Request tok/s, median over the orders (acceptance for speculative modes); tokens: off's output length.",
              "", "| task | tokens | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
    for tid, t in tasks.items():
        row = []
        for m in modes:
            c = t["modes"][m]
            rate = c["request_tok_s"]["median"] if c["request_tok_s"] else float("nan")
            row.append(f"{rate:.1f}" + ("" if c["acceptance"] is None else f" ({c['acceptance']:.2f})"))
        lines.append(f"| `{tid}` | {t['modes']['off']['tokens']} | " + " | ".join(row) + " |")
    b = report.get("build") or {}
    lines += ["", f"Model {report.get('model_path')}; build: llama.cpp {b.get('llama_cpp_commit')}, patches "
              f"{b.get('patches')}; machine {report['machine']}; written {report.get('written')}."]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], path: Path) -> None:
    modes = list(report["modes"])
    summary = report["summary"]
    scores = [summary[m]["score"] for m in modes]
    rates = [summary[m]["request_tok_s"]["median"] if summary[m]["request_tok_s"] else float("nan") for m in modes]
    name = Path(report.get("model_path") or report["model"] or "embedded model").name
    plot_bars(path, [BarPanel(modes, {"score": scores}, "score (answers equal to the expected one)", ylim=(0.0, 1.0)),
                     BarPanel(modes, {"request tok/s": rates}, "request tok/s (median over orders)")],
              f"power calibrate: {name}, {report['numerics']} numerics")
