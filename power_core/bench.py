"""``power bench``: paired, interleaved evidence for any strategy, with llama.cpp's own tools as peers.

Every mode runs on every prompt ``--runs`` times, interleaved with ``--mode off`` (the order of the
cells alternates from run to run, so drift on a shared machine hits every cell alike). Each Power
run is a fresh session (no run learns from an earlier one); figures are decode tok/s (the receipt's
``decode_tok_s``: tokens after the first, which the prompt pass produces, per decode second).

With ``--peer-bin DIR`` (llama.cpp's ``llama-completion`` and ``llama-speculative-simple`` of the
same pinned build, e.g. ``native/tools/build_llama.py --peers``) each prompt also runs
``llama-completion`` and ``llama-speculative-simple`` with each n-gram type, on the same workload:
the same prompt text on both sides (a prompt file is read as llama.cpp's ``-f`` reads it, one
trailing newline dropped, and the peer gets that text through ``-p``) and equal generated-token counts: ``llama-speculative-simple -n`` overshoots by
up to one draft, so Power's speculative modes are also run at the count the peer decoded. The peers
run with Power's numerics unless ``--peer-numerics`` says otherwise: ``exact`` starts them with
``GGML_CPU_BATCH_INVARIANT=1`` (the batch-invariant kernels Power's ``exact`` uses, from the same
patched build, repacked weights included), so both sides write the same text; ``stock`` is llama.cpp as shipped.
Each peer's generated text is compared with Power's ``--mode off`` text at the same count
(``same_text``), so the report says whether the workloads really were the same.

Every Power mode's tokens are checked against ``--mode off`` at the same count; a mode that
differs is a **parity failure**: flagged in the report, never averaged in, and the exit code is 1.
Output: ``report.json`` (per cell median/min/max tok/s, ratios to off and to the best peer n-gram
type, acceptance, tokens per pass, replays, output digests, machine, build, config hashes),
``report.md`` and ``speedup.png`` (the plot needs matplotlib, ``pip install 'power-core[bench]'``: without
it :func:`run_bench` raises :class:`~power_core.errors.MissingDependency` before anything runs).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from power_core.config import PowerConfig, device_names
from power_core.errors import ConfigError, MissingDependency

__all__ = ["BenchSpec", "run_bench", "check_dependencies", "peer_env", "peer_offload", "NGRAM_TYPES",
           "OPTIONAL_DEPENDENCIES"]

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
PEERS = ("llama-completion", "llama-speculative-simple")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_ACCEPT = re.compile(r"accept\s+=\s+([\d.]+)%")
_EVAL = re.compile(r"(?<!prompt )eval time =\s+[\d.]+ ms /\s+(\d+) runs")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s+([\d.]+) ms")
_TOTAL = re.compile(r"total time =\s+([\d.]+) ms")
#: (module, power-core extra that installs it) for each optional module the bench needs
OPTIONAL_DEPENDENCIES = (("matplotlib", "bench"),)


@attrs.frozen
class BenchSpec:
    model: str | None
    modes: tuple[str, ...]
    prompts: tuple[Path, ...]
    runs: int = 5
    tokens: int = 128
    threads: int = 2
    draft: str | None = None
    peer_bin: Path | None = None
    out: Path = Path("evidence/bench")
    n_ctx: int = 2048
    #: the target's kernels for every Power run (``exact``: speculative output equals ``off``)
    numerics: str = "exact"
    #: the llama.cpp peers' kernels (default: the same as ``numerics``, so both sides write the same text)
    peer_numerics: str = attrs.field(default=attrs.Factory(lambda self: self.numerics, takes_self=True))
    #: force a backend for Power's runs (None: the one that accepts ``model``)
    backend: str | None = None
    #: offload, the config keys of the same names, for Power's runs and the peers alike (:func:`peer_offload`)
    n_gpu_layers: int = 0
    devices: tuple[str, ...] = attrs.field(default=(), converter=device_names)
    flash_attn: str = "auto"
    draft_gpu_layers: int = 0


def _stats(xs: Sequence[float]) -> dict[str, float] | None:
    xs = [float(x) for x in xs]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def check_spec(spec: BenchSpec, known_modes: Sequence[str]) -> None:
    """Bad input is a typed error before anything runs."""
    if spec.runs < 1:
        raise ConfigError("runs", spec.runs, "an integer >= 1")
    if not spec.modes:
        raise ConfigError("modes", "", "a comma-separated list of modes, e.g. off,suffix")
    for m in spec.modes:
        if m not in known_modes:
            raise ConfigError("modes", m, f"an installed strategy: {', '.join(sorted(known_modes))}")
    if not spec.prompts:
        raise ConfigError("prompts", "", "one or more UTF-8 prompt files")
    for p in spec.prompts:
        if not p.is_file():
            raise ConfigError("prompts", str(p), "an existing UTF-8 prompt file", "check the path")
        try:
            p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError("prompts", str(p), "a UTF-8 text file", str(exc)) from None
    for key, value in (("numerics", spec.numerics), ("peer_numerics", spec.peer_numerics)):
        if value not in ("exact", "stock"):
            raise ConfigError(key, value, "exact or stock")
    if spec.peer_bin is not None:
        missing = [exe for exe in PEERS if not (spec.peer_bin / exe).is_file()]
        if missing:
            raise ConfigError("peer_bin", str(spec.peer_bin), f"a directory with {', '.join(PEERS)}",
                              f"missing {', '.join(missing)}; build them with native/tools/build_llama.py --peers")


def check_dependencies(needed_for: str = "power bench (speedup.png)") -> None:
    """Every optional module the bench needs imports, or a typed error before anything runs (not a
    traceback at the plot step after the whole matrix has run). ``power calibrate`` checks the same."""
    for module, extra in OPTIONAL_DEPENDENCIES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingDependency(module, extra, needed_for) from exc


def read_prompt(path: Path) -> str:
    """A prompt file as llama.cpp's ``-f`` reads it (one trailing newline dropped); both sides then get
    this same text (the peer through ``-p``)."""
    text = path.read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


class _PowerCell:
    """One mode. Every run opens a fresh session (the weights reload; the verify-cost curve comes from
    its cache), so no run learns from an earlier one: a session-level memory (e.g. a proposer that
    indexes earlier requests, or learns acceptance) would otherwise copy the previous run's answer."""

    def __init__(self, spec: BenchSpec, mode: str, plugins: Any) -> None:
        self.spec, self.mode, self.plugins = spec, mode, plugins
        self.session = self._open()  # the first open also validates the mode and measures costs

    def _open(self) -> Any:
        from power_core.session import Session

        spec = self.spec
        # trace: each round's proposals, so a parity failure can be replayed pass by pass (_numerics_probe)
        cfg = PowerConfig(spec_mode=self.mode, n_threads=spec.threads, n_ctx=spec.n_ctx, max_tokens=spec.tokens,
                          trace=True, numerics=spec.numerics, n_gpu_layers=spec.n_gpu_layers, devices=spec.devices,
                          flash_attn=spec.flash_attn, draft_gpu_layers=spec.draft_gpu_layers)
        # the draft goes to model-backed strategies only: a model-free one (suffix) refuses a second mechanism
        kind = self.plugins.strategy(self.mode).kind
        return Session.open(cfg, model=spec.model, draft=spec.draft if kind == "model-backed" else None,
                            backend=spec.backend, plugins=self.plugins)

    def run(self, prompt: Any, tokens: int, stop: Sequence[str] | None = None) -> dict[str, Any]:
        self.session.close()
        self.session = self._open()
        res = self.session.generate(prompt, max_tokens=tokens, stop=stop)
        r = res.receipt
        s = r.summary()
        return {"tok_s": r.timings["decode_tok_s"], "tokens": list(res.tokens), "digest": r.output_sha256,
                "text": res.text,
                "acceptance": s["acceptance"], "tokens_per_pass": s["verified_tokens_per_pass"],
                "replays": s["replays"], "config_sha256": r.config_sha256, "n": len(res.tokens),
                "rounds": [(rd.get("proposal", []), rd["emitted"]) for rd in r.rounds],
                "finish_reason": r.finish_reason, "proposed": s["proposed"], "accepted": s["accepted"],
                "seconds": r.timings["prefill_s"] + r.timings["decode_s"]}  # the whole request: prefill + decode

    def close(self) -> None:
        self.session.close()


def peer_env(numerics: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment (``env``, default this process's) that starts a llama.cpp tool of the pinned build
    (``llama-completion``, ``llama-speculative-simple``, ``llama-server``) with ``numerics``:
    ``exact`` sets ``GGML_CPU_BATCH_INVARIANT=1`` (the kernels of Power's exact numerics, patches 0002 and
    0005, read at ggml_cpu_init, before the model is loaded: the repacked layouts it keeps are chosen then);
    ``stock`` is llama.cpp as shipped. Both repack weights, as Power's targets do."""
    out = {k: v for k, v in (os.environ if env is None else env).items() if k != "GGML_CPU_BATCH_INVARIANT"}
    if numerics == "exact":
        out["GGML_CPU_BATCH_INVARIANT"] = "1"
    return out


def peer_offload(n_gpu_layers: int, devices: Sequence[str] = (), flash_attn: str = "auto") -> list[str]:
    """A llama.cpp tool's arguments for Power's offload keys. Always explicit: the tools' own default
    (``-ngl auto``) offloads every layer on a GPU build, where Power's default (0) keeps them on the CPU."""
    args = ["-ngl", "all" if n_gpu_layers < 0 else str(n_gpu_layers), "-fa", flash_attn]
    return args + (["-dev", ",".join(devices)] if devices else [])


def graph_reuse(env: Mapping[str, str] | None = None) -> bool:
    """Whether llama.cpp contexts reuse their last graph, as every context of this process and its peers
    reads it (``LLAMA_GRAPH_REUSE_DISABLE``, ``atoi`` != 0 turns reuse off)."""
    m = re.match(r"\s*[+-]?\d+", (os.environ if env is None else env).get("LLAMA_GRAPH_REUSE_DISABLE", ""))
    return not (m and int(m.group()) != 0)


def completion_rate(stderr: str) -> tuple[int, float] | None:
    """``llama-completion``'s decode as Power's receipt counts it: (tokens generated, tokens after the
    first per decode second of wall time). Its ``eval time`` counts only the time inside ``llama_decode``; Power's
    ``decode_tok_s`` counts everything after the prompt pass (sampling, detokenizing, the host's
    work between passes), so the peer's rate is its tokens over its ``total time`` less its ``prompt
    eval time`` (both from the same perf counters). ``None`` when the summary is missing."""
    ev, pe, tot = _EVAL.search(stderr), _PROMPT_EVAL.search(stderr), _TOTAL.search(stderr)
    if not (ev and pe and tot):
        return None
    runs, wall_ms = int(ev.group(1)), float(tot.group(1)) - float(pe.group(1))
    return (runs + 1, runs / (wall_ms * 1e-3)) if wall_ms > 0 and runs > 0 else None


def _peer(spec: BenchSpec, model: str, exe: str, prompt: str, extra: list[str]) -> dict[str, Any]:
    assert spec.peer_bin is not None
    cmd = [str(spec.peer_bin / exe), "-m", model, "-p", prompt, "-n", str(spec.tokens),
           "-t", str(spec.threads), "--temp", "0", "--top-k", "1", "-c", str(spec.n_ctx), *extra,
           *peer_offload(spec.n_gpu_layers, spec.devices, spec.flash_attn)]
    if exe == "llama-completion":
        cmd.append("-no-cnv")
    env = peer_env(spec.peer_numerics)
    for _ in range(2):  # a run that ends without its summary (rare here) is retried once
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{exe} exited {proc.returncode}: {proc.stderr[-1500:]}")
        text = _generated(proc.stdout, prompt)
        if exe == "llama-completion":
            rate = completion_rate(proc.stderr)
            if rate is not None:
                return {"tok_s": rate[1], "n": rate[0], "acceptance": None, "text": text}
        else:
            m = _DECODED.search(proc.stderr)
            if m:
                a = _ACCEPT.search(proc.stderr)
                return {"tok_s": float(m.group(3)), "n": int(m.group(1)),
                        "acceptance": float(a.group(1)) / 100 if a else None, "text": text}
    raise RuntimeError(f"{exe} printed no timing summary: {proc.stderr[-800:]}")


def _generated(stdout: str, prompt: str) -> str | None:
    """The text a peer generated: what its stdout prints after the echoed prompt (``None`` when the echo
    cannot be found, e.g. a tokenizer that does not round-trip the prompt)."""
    tail = prompt[-64:]
    at = stdout.find(tail) if tail else -1
    return stdout[at + len(tail):] if at >= 0 else None


def same_text(peer: str | None, power: str) -> bool | None:
    """Whether a peer wrote Power's text: equal over the shorter of the two (a peer may decode a few tokens
    more, and llama.cpp's tools print trailing newlines of their own)."""
    if peer is None:
        return None
    a, b = peer.rstrip(), power.rstrip()
    if a.endswith("[end of text]"):  # llama-completion marks an end-of-generation token
        a = a[: -len("[end of text]")].rstrip()
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def run_bench(spec: BenchSpec, *, progress: bool = True, plugins: Any = None) -> dict[str, Any]:
    """Run the matrix; write report.json, report.md and speedup.png under ``spec.out``."""
    check_dependencies()
    from rich.progress import Progress

    from power_core.plugins import get_plugins

    plugins = plugins or get_plugins()
    check_spec(spec, plugins.strategies.names())
    modes = ("off", *[m for m in spec.modes if m != "off"])
    peers: list[tuple[str, list[str]]] = [("llama-completion", [])] if spec.peer_bin else []
    if spec.peer_bin:
        peers += [(t, ["--spec-type", t]) for t in NGRAM_TYPES]
    cells: dict[str, _PowerCell] = {}
    report: dict[str, Any] = {"schema": "power.bench/1", "model": spec.model, "modes": list(modes),
                              "runs": spec.runs, "tokens": spec.tokens, "threads": spec.threads,
                              "numerics": spec.numerics, "peer_numerics": spec.peer_numerics if spec.peer_bin else None,
                              "offload": {"n_gpu_layers": spec.n_gpu_layers, "devices": list(spec.devices),
                                          "flash_attn": spec.flash_attn, "draft_gpu_layers": spec.draft_gpu_layers},
                              "graph_reuse": graph_reuse(),
                              "machine": {"platform": platform.platform(), "processor": platform.processor(),
                                          "cpus": os.cpu_count()},
                              "prompts": {}, "parity_failures": []}
    try:
        for m in modes:
            cells[m] = _PowerCell(spec, m, plugins)
        backend = cells["off"].session.opened.backend_info
        report["model_path"] = cells["off"].session.opened.model_path
        report["build"] = {k: backend.get(k) for k in ("llama_cpp_commit", "sdist_sha256", "flags", "patches")}
        # per run: every Power mode and every peer once, and the speculative modes again at each n-gram peer's count
        total = len(spec.prompts) * spec.runs * (len(modes) + len(peers) + max(len(peers) - 1, 0) * (len(modes) - 1))
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("power bench", total=total)
            for path in spec.prompts:
                text = read_prompt(path)
                report["prompts"][path.name] = _bench_prompt(spec, text, modes, peers, cells, bar, task, report)
    finally:
        for c in cells.values():
            c.close()
    _write(spec, report)
    return report


def _bench_prompt(spec: BenchSpec, text: str, modes: Sequence[str], peers: list[tuple[str, list[str]]],
                  cells: dict[str, _PowerCell], bar: Any, task: Any, report: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    peer_raw: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in peers}
    matched: dict[str, dict[str, list[dict[str, Any]]]] = {}  # peer type -> mode -> runs at the peer's count
    ref_at: dict[int, dict[str, Any]] = {}  # token count -> off's run at that count
    for i in range(spec.runs):
        order = list(modes) + [p for p, _ in peers]
        if i % 2:
            order.reverse()
        for name in order:
            if name in cells:
                raw[name].append(cells[name].run(text, spec.tokens))
            else:
                extra = dict(peers)[name]
                r = _peer(spec, str(report["model_path"]),
                          "llama-completion" if name == "llama-completion" else "llama-speculative-simple", text, extra)
                peer_raw[name].append(r)
                if r["n"] not in ref_at:  # off's text at the peer's count (this run's off cell when it matches)
                    last = raw["off"][-1] if raw["off"] else None
                    ref_at[r["n"]] = last if last and last["n"] == r["n"] else cells["off"].run(text, r["n"])
                r["same_text"] = same_text(r.pop("text"), ref_at[r["n"]]["text"])
                if name != "llama-completion":  # Power's speculative modes at the count this peer decoded
                    for m in modes:
                        if m == "off":
                            continue
                        run = cells[m].run(text, r["n"])
                        matched.setdefault(name, {}).setdefault(m, []).append(run)
                        run["parity"] = run["digest"] == ref_at[r["n"]]["digest"]
                        bar.advance(task)
            bar.advance(task)
    out: dict[str, Any] = {"modes": {}, "peers": {}}
    off_digest = raw["off"][0]["digest"]
    off_rate = _stats([r["tok_s"] for r in raw["off"]])
    for m, runs in raw.items():
        parity = all(r["digest"] == off_digest for r in runs) and all(
            run.get("parity", True) for per in matched.values() for run in per.get(m, []))
        ratios = [r["tok_s"] / o["tok_s"] for r, o in zip(runs, raw["off"], strict=True)]
        cell = {"tok_s": _stats([r["tok_s"] for r in runs]), "ratio_to_off": _stats(ratios),
                "acceptance": _stats([r["acceptance"] for r in runs if r["acceptance"] is not None]),
                "tokens_per_pass": _stats([r["tokens_per_pass"] for r in runs]),
                "replays": _stats([r["replays"] for r in runs]), "output_sha256": runs[0]["digest"],
                "tokens": runs[0]["n"], "config_sha256": runs[0]["config_sha256"], "parity": parity}
        if not parity:
            first = next((j for j, (a, b) in enumerate(zip(runs[0]["tokens"], raw["off"][0]["tokens"], strict=False))
                          if a != b), None)
            cell["first_divergence"] = first
            cell["numerics"] = (_numerics_probe(cells[m], text, raw["off"][0]["tokens"], first, runs[0]["rounds"])
                                if first else None)
            report["parity_failures"].append({"mode": m, "first_divergence": first, "numerics": cell["numerics"]})
            cell["ratio_to_off"] = None  # never averaged in
        out["modes"][m] = cell
    out["off_tok_s"] = off_rate
    for name, runs in peer_raw.items():
        known = [r["same_text"] for r in runs if r["same_text"] is not None]
        peer = {"tok_s": _stats([r["tok_s"] for r in runs]), "tokens": runs[0]["n"],
                "same_text": all(known) if known else None,
                "acceptance": _stats([r["acceptance"] for r in runs if r["acceptance"] is not None])}
        for m, mruns in matched.get(name, {}).items():
            if all(r["parity"] for r in mruns):
                peer.setdefault("power_at_same_count", {})[m] = {
                    "tok_s": _stats([r["tok_s"] for r in mruns]),
                    "ratio": _stats([r["tok_s"] / p["tok_s"] for r, p in zip(mruns, runs, strict=True)])}
        out["peers"][name] = peer
    # the best peer is chosen among those that decoded the same workload: a peer whose text differs from
    # --mode off (llama.cpp's own speculative run is not exact on stock kernels) is listed, never the reference
    ngram = {n: p for n, p in out["peers"].items() if n != "llama-completion" and p["same_text"] is not False}
    out["peers_other_text"] = sorted(n for n, p in out["peers"].items() if p["same_text"] is False)
    if ngram:
        best = max(ngram, key=lambda n: ngram[n]["tok_s"]["median"])
        out["best_peer_ngram"] = best
        out["ratio_to_best_peer_ngram"] = {m: v["ratio"] for m, v in ngram[best].get("power_at_same_count", {}).items()}
    return out


def _numerics_probe(cell: _PowerCell, prompt: str | Sequence[int], off_tokens: list[int], d: int,
                    rounds: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Do the target's own batch numerics explain a divergence at emitted token ``d``?

    The failing run's passes are replayed on its own session's target (shaped for its widest pass)
    exactly as they ran (``rounds``: each round's traced proposals and emitted count; the tokens before ``d`` are the
    same in both runs), and the row that predicted token ``d`` inside its verify pass is compared with
    the same row from one-token decodes. If the pass's row picks another token, the divergence is the
    target's own verify-vs-decode numerics, not the transaction."""
    import numpy as np

    session = cell.session
    target = session.opened.target
    if (sample_in_graph := target.capabilities.sample_in_graph) is not None:
        sample_in_graph(False)  # the replay compares logits rows
    prompt_ids = session.encode(prompt)
    toks = [int(t) for t in off_tokens]

    def one_token_row() -> np.ndarray:
        target.reset()
        row = np.array(target.prefill(prompt_ids))
        for t in toks[:d]:
            row = np.array(target.decode(np.array([t], dtype=np.int32)).logits[-1])
        return row

    def structured_row() -> np.ndarray | None:
        target.reset()
        target.prefill(prompt_ids)
        p = 1  # round 0 emitted token 0 from the prefill
        for proposal, emitted in rounds[1:]:
            shape = len(proposal) + 1
            block = np.array([toks[p - 1], *proposal], dtype=np.int32)
            cp = target.checkpoint()
            res = target.decode(block)
            if p <= d < p + emitted:
                return np.array(res.logits[d - p])
            if emitted < shape and not target.rollback(cp, emitted):
                target.decode(block[:emitted])
            p += emitted
        return None

    a, b = one_token_row(), structured_row()
    target.reset()
    if b is None:
        return {"position": d, "reproduced": False}
    diff = float(np.max(np.abs(a - b)))
    return {"position": d, "max_abs_diff": diff, "argmax_one_token": int(np.argmax(a)),
            "argmax_in_run_pass": int(np.argmax(b)), "off_token": toks[d],
            "explained_by_batch_numerics": bool(int(np.argmax(b)) != toks[d])}


def write_evidence(out: Path, report: dict[str, Any], markdown: Callable[[dict[str, Any]], str],
                   plot: Callable[[dict[str, Any], Path], None], plot_name: str) -> None:
    """The evidence package under ``out``: ``report.json`` (stamped ``written``), ``report.md`` and a plot."""
    out.mkdir(parents=True, exist_ok=True)
    report["written"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    plot(report, out / plot_name)


def _write(spec: BenchSpec, report: dict[str, Any]) -> None:
    write_evidence(spec.out, report, _markdown, _plot, "speedup.png")


def _fmt(s: dict[str, float] | None, digits: int = 1) -> str:
    if not s:
        return "—"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def _markdown(report: dict[str, Any]) -> str:
    lines = [f"# power bench: {report['model'] or 'embedded model'}", "",
             f"{report['runs']} paired runs, {report['tokens']} tokens, {report['threads']} threads; "
             "decode tok/s median (min–max); ratios are per-run pairs. Numerics: Power "
             f"{report['numerics']}, llama.cpp peers {report.get('peer_numerics') or '—'}; *text = off*: the cell "
             "wrote `--mode off`'s text (Power: token for token; a peer: its printed text).", ""]
    off = report.get("offload") or {}
    if off.get("n_gpu_layers") or off.get("draft_gpu_layers"):
        lines += [f"Offload, both sides: {off['n_gpu_layers']} target layers (-1: all), draft "
                  f"{off['draft_gpu_layers']}, devices {','.join(off['devices']) or 'every GPU'}, flash attention "
                  f"{off['flash_attn']}; llama.cpp graph reuse {'on' if report.get('graph_reuse') else 'off'}.", ""]
    if report["parity_failures"]:
        lines += ["**Parity failures** (excluded from every ratio):", ""]
        for f in report["parity_failures"]:
            n = f.get("numerics")
            why = ("" if not n or "max_abs_diff" not in n else
                   f"; replaying the run's passes, the row predicting it differs from one-token decodes by up to "
                   f"{n['max_abs_diff']:.3g} (argmax {n['argmax_one_token']} one token at a time vs "
                   f"{n['argmax_in_run_pass']} in the run's verify pass): "
                   + ("the target's batch numerics explain it" if n["explained_by_batch_numerics"]
                      else "numerics do not explain it"))
            lines.append(f"- {f['mode']}: first differing token {f['first_divergence']}{why}")
        lines.append("")
    for name, p in report["prompts"].items():
        lines += [f"## {name}", "", "| cell | tok/s | × off | acceptance | tokens/pass | text = off |",
                  "|---|---|---|---|---|---|"]
        for m, c in p["modes"].items():
            lines.append(f"| power {m} | {_fmt(c['tok_s'])} | {_fmt(c['ratio_to_off'], 3)} | {_fmt(c['acceptance'], 2)} "
                         f"| {_fmt(c['tokens_per_pass'], 2)} | {'yes' if c['parity'] else 'NO'} |")
        for n, c in p["peers"].items():
            same = {True: "yes", False: "NO", None: "—"}[c.get("same_text")]
            lines.append(f"| llama.cpp {n} ({c['tokens']} tokens) | {_fmt(c['tok_s'])} | | {_fmt(c['acceptance'], 2)} "
                         f"| | {same} |")
        if "best_peer_ngram" in p:
            best = p["best_peer_ngram"]
            for m, r in p["ratio_to_best_peer_ngram"].items():
                lines.append(f"\npower {m} vs best llama.cpp n-gram type ({best}), same token count: ×{_fmt(r, 3)}")
        if p.get("peers_other_text"):
            lines.append(f"\nNot the same workload (their text differs from `--mode off`, so never the best peer): "
                         f"{', '.join(p['peers_other_text'])}.")
        lines.append("")
    b = report.get("build") or {}
    lines += [f"Build: llama.cpp {b.get('llama_cpp_commit')}, patches {b.get('patches')}; machine {report['machine']}."]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], path: Path) -> None:
    prompts = list(report["prompts"])
    series: dict[str, list[float]] = {}
    for i, name in enumerate(prompts):
        p = report["prompts"][name]
        off = p["off_tok_s"]["median"]
        for m, c in p["modes"].items():
            if m != "off":
                series.setdefault(f"power {m}", [float("nan")] * len(prompts))[i] = (
                    c["tok_s"]["median"] / off if c["parity"] else float("nan"))
        for n, c in p["peers"].items():
            series.setdefault(f"llama.cpp {n}", [float("nan")] * len(prompts))[i] = c["tok_s"]["median"] / off
    title = f"power bench: {Path(report['model']).name if report['model'] else 'embedded model'}"
    plot_bars(path, [BarPanel(prompts, series, "decode tok/s relative to power --mode off", 1.0)], title)


@attrs.frozen
class BarPanel:
    """One panel of grouped bars: ``series`` (label -> one value per group; NaN: no bar)."""

    groups: Sequence[str]
    series: Mapping[str, Sequence[float]]
    ylabel: str
    #: a horizontal reference line (e.g. 1.0 for ratios to off), or None
    reference: float | None = None
    #: the y axis' range (None: matplotlib's choice)
    ylim: tuple[float, float] | None = None


def plot_bars(path: Path, panels: Sequence[BarPanel], title: str) -> None:
    """Grouped bar panels side by side, saved as a PNG (matplotlib: the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = [max(3.0, 2.5 * len(p.groups)) for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.0, sum(widths)), 4), squeeze=False,
                             gridspec_kw={"width_ratios": widths})
    for ax, panel in zip(axes[0], panels, strict=True):
        width = 0.8 / max(1, len(panel.series))
        n = len(panel.groups)
        for j, (label, ys) in enumerate(panel.series.items()):
            ax.bar([i + j * width for i in range(n)], ys, width, label=label)
        if panel.reference is not None:
            ax.axhline(panel.reference, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(n)], list(panel.groups))
        ax.set_ylabel(panel.ylabel)
        if panel.ylim is not None:
            ax.set_ylim(*panel.ylim)
        if len(panel.series) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
