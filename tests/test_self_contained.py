"""The repository is self-contained: no file reads or cites a path outside it.

A fresh clone has nothing beside it (no team folder ``../shared``), so every prompt, data file and
note the project uses lives in the repository: the bench workloads in ``docs/examples/``, the
numerics measurements in ``docs/numerics.md``.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()  # holds the patterns themselves
WORKLOADS = ("code-edit.txt", "quote-from-context.txt", "story.txt")
#: not the project's files: build outputs, caches, virtual environments (the tree walk without git)
_SKIP_DIRS = {".git", ".nox", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis",
              ".mypy_cache", ".ruff_cache", "vendor"}

OUTSIDE = re.compile(
    r"\.\./+(?:\.\./+)*shared\b"  # ../shared/bench/code-edit.txt
    r"|/work/shared\b"
    r"|\bshared/(?:bench|seed|hooks)\b"  # the team folder's subfolders, from wherever
    r"|\bshared/[A-Z][A-Z_]*\.md\b"  # shared/NUMERICS.md, shared/DESIGN.md, shared/STYLE.md
    r"|\bNUMERICS\.md\b|\bLLAMACPP_NOTES\b"  # the team's notes, cited by name
    r"|[\"']shared[\"']\s*/"  # ROOT.parent / "shared" / "bench"
    r"|join\([^)\n]*[\"']shared[\"']"  # os.path.join(root, "..", "shared", ...)
)


def _files() -> list[str]:
    """The repository's files: git's tracked and not-ignored files, or a walk of the tree without git."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        if Path(top).resolve() == ROOT:
            out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                 capture_output=True, check=True).stdout
            return sorted({f for f in out.decode().split("\0") if f and (ROOT / f).is_file()})
    except (OSError, subprocess.CalledProcessError):
        pass
    found = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        dirs = rel.parts[:-1]
        if path.is_file() and dirs[:1] != ("evidence",) and not any(
                p in _SKIP_DIRS or p.endswith(".egg-info") for p in dirs):
            found.append(rel.as_posix())
    return sorted(found)


def _text(rel: str) -> str | None:
    data = (ROOT / rel).read_bytes()
    return None if b"\0" in data else data.decode("utf-8", errors="replace")


def test_no_file_reads_or_cites_a_path_outside_the_repository():
    files = _files()
    scanned, offenders = [], []
    for rel in files:
        text = _text(rel)
        if rel == THIS or text is None:
            continue
        scanned.append(rel)
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    # the scan saw the project, not an empty or foreign tree
    assert len(scanned) >= 100, f"only {len(scanned)} files scanned: {scanned}"
    for must in ("README.md", "pyproject.toml", "noxfile.py", "power_core/bench.py", "tests/native/test_models.py",
                 "tests/bench/bench_native.py", "docs/numerics.md", "plugins/suffix/README.md"):
        assert must in scanned, must
    assert not offenders, "paths outside the repository (copy the file in, cite the in-repo copy):\n" + "\n".join(
        offenders)


@pytest.mark.parametrize("line", [
    'SHARED_BENCH = ROOT.parent / "shared" / "bench"',
    "power run --prompt-file ../shared/bench/code-edit.txt",
    "(see ../../shared/STYLE.md)",
    "one-token rows (shared/NUMERICS.md), and",
    "see ``shared/LLAMACPP_NOTES.md`` §1.5",
    "or key that decided (LLAMACPP_NOTES §3).",
    "cp /work/shared/seed/x .",
    'os.path.join(here, "..", "shared", "bench")',
    "prompts from shared/bench",
])
def test_the_pattern_catches_outside_paths(line):
    assert OUTSIDE.search(line)


@pytest.mark.parametrize("line", [
    "the shared backbone check shared by DFlash v1, DFlash2 and DSpark",
    'env = dict(os.environ, POWER_NATIVE_SHARED_WEIGHTS="1" if shared else "0")',
    't[f"blk.{b}.nextn.shared_head_norm.weight"] = ((n_embd,), "F32")',
    'res[key] = {"shared": shared, "private": private}',
    "from power_core.config import NUMERICS",
    "see docs/numerics.md and docs/examples/code-edit.txt",
])
def test_the_pattern_passes_the_repositorys_own_words(line):
    assert not OUTSIDE.search(line)


def test_the_bench_workloads_are_in_the_repository():
    """The three workloads live once, in docs/examples/, and every reference to a file there resolves."""
    examples = ROOT / "docs" / "examples"
    for name in WORKLOADS:
        text = (examples / name).read_text(encoding="utf-8")
        # no trailing newline: `power run --prompt-file` and llama.cpp's -f (`power bench`) read the same text
        assert text.strip() and not text.endswith("\n"), name
    cited = set()
    for rel in _files():
        text = _text(rel)
        if text is not None:
            cited.update(re.findall(r"docs/examples/([\w.-]+\.\w+)", text))
    assert {"code-edit.txt"} <= cited
    assert all((examples / name).is_file() for name in cited), sorted(cited)


def test_test_modules_have_unique_basenames():
    """tests/ and tests/native/ are rootdir-style (no packages): two test modules of one basename
    collide at collection ("import file mismatch") and stop the whole run."""
    root = Path(__file__).resolve().parent
    seen: dict[str, Path] = {}
    for path in sorted(root.rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename; rename one"
        seen[path.name] = path
