"""Every environment variable the code reads is documented in README.md's "Environment variables"
section, and every variable documented there is read somewhere: the table cannot drift.

The scan covers the core, the native package and its build (Python, Cython, CMake, llama.cpp
patches), the first-party plugins, the nox sessions, CI and the tests. Python files are read as
syntax trees (``os.environ.get("X")``, ``os.getenv("X")``, ``env["X"]``, ``"X" in os.environ``, and
``env[k] for k in ("X", "Y")``; ``os.environ.setdefault`` sets a default for child processes and is not
a read); other files by pattern (``getenv("X")``, ``$ENV{X}``, shell ``${X:-default}``)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: where code that reads the environment lives
SOURCES = (
    "power_core/**/*.py",
    "native/src/power_native/*.py", "native/src/power_native/*.pyx", "native/src/power_native/*.pxi",
    "native/tools/*.py", "native/CMakeLists.txt", "native/pyproject.toml", "native/patches/*.patch",
    "plugins/*/power_*/**/*.py", "plugins/*/power_*/*.pyx", "plugins/*/CMakeLists.txt", "plugins/*/pyproject.toml",
    "plugins/*/tests/*.py", "noxfile.py", ".ci/*", "tests/**/*.py", "tests/**/*.c", "tests/**/*.sh",
)
#: the operating system's and Python's own variables, read to find tools (``PATH``) or handed on to
#: child processes: documented by their owners, not here
STANDARD = frozenset({"PATH", "PYTHONPATH", "PIP_CACHE_DIR", "HOME"})
#: the README section that documents them
SECTION = "## Environment variables"
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


def _envish(node: ast.AST) -> bool:
    """``os.environ``, ``environ``, ``env`` (a mapping standing for the environment), or a choice of them."""
    if isinstance(node, ast.IfExp):
        return _envish(node.body) or _envish(node.orelse)
    if isinstance(node, ast.Name):
        return node.id in ("environ", "env")
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _strings(node: ast.AST) -> list[str]:
    return [e.value for e in getattr(node, "elts", ()) if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _python_reads(tree: ast.AST) -> Iterator[str]:
    loops: dict[str, list[str]] = {}  # a loop variable bound to a literal tuple of names
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            loops.setdefault(node.target.id, []).extend(_strings(node.iter))

    def names(arg: ast.AST) -> list[str]:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return [arg.value]
        return loops.get(arg.id, []) if isinstance(arg, ast.Name) else []

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            # not setdefault: a default handed on to child processes is a write (the readers count)
            if (isinstance(f, ast.Attribute) and f.attr in ("get", "pop") and _envish(f.value)) or (
                    isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name) and f.id == "getenv"):
                yield from names(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _envish(node.value):
            yield from names(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In) for op in node.ops) and \
                any(_envish(c) for c in node.comparators):
            yield from names(node.left)


_TEXT_READS = (
    re.compile(rf"""getenv\(\s*["']({_NAME})["']"""),  # C, Cython
    re.compile(rf"""environ(?:\.get)?\s*[\(\[]\s*["']({_NAME})["']"""),  # Cython .pxi
    re.compile(rf"\$ENV\{{({_NAME})\}}"),  # CMake
)
_SHELL_REF = re.compile(r"\$\{?([A-Z_][A-Z0-9_]*)")
_SHELL_DEFAULT = re.compile(r"\$\{([A-Z_][A-Z0-9_]*):?-")
_SHELL_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Z_][A-Z0-9_]*)=", re.M)


def _shell_reads(text: str) -> set[str]:
    """Variables a script reads from its environment: with a default (``${X:-...}``), or used and
    never assigned by the script (its own variables, e.g. ``OUT=...``, are not the environment)."""
    return set(_SHELL_DEFAULT.findall(text)) | (set(_SHELL_REF.findall(text)) - set(_SHELL_ASSIGN.findall(text)))


def env_reads() -> dict[str, set[str]]:
    """Variable name -> the files (relative to the repository) that read it."""
    found: dict[str, set[str]] = {}
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            if not path.is_file() or "vendor" in path.parts or "build" in path.parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if path.suffix == ".py":
                names = set(_python_reads(ast.parse(text, filename=str(path))))
            else:
                names = {m for rx in _TEXT_READS for m in rx.findall(text)}
                if path.suffix == ".sh" or text.startswith("#!/usr/bin/env bash"):
                    names |= _shell_reads(text)
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def documented() -> set[str]:
    """The variables in the README section's tables: the backticked names in each row's first cell."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    cells = re.findall(r"^\|([^|\n]*)\|", body, flags=re.M)
    return {name for cell in cells for name in re.findall(rf"`({_NAME})`", cell)}


def test_the_scan_finds_the_variables_it_must():
    reads = env_reads()
    for name, where in (("POWER_API_KEY", "power_core/commands.py"), ("POWER_LOAD_PLUGINS", "power_core/plugins.py"),
                        ("POWER_NATIVE_LOG_LEVEL", "native/src/power_native/_log.pxi"),
                        ("GGML_CPU_BATCH_INVARIANT", "native/patches/0002-batch-invariant-cpu.patch"),
                        ("CUDA_HOME", "native/tools/build_llama.py")):
        assert where in reads.get(name, ()), f"the scan missed {name} in {where}: {sorted(reads)}"


def test_every_variable_the_code_reads_is_documented():
    missing = {name: sorted(files) for name, files in env_reads().items()
               if name not in documented() and name not in STANDARD}
    assert not missing, f"read but not in README.md's {SECTION!r} table: {missing}"


def test_every_documented_variable_is_read_somewhere():
    stale = documented() - set(env_reads())
    assert not stale, f"in README.md's {SECTION!r} table but read nowhere: {sorted(stale)}"
