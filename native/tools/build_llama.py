"""Fetch, verify and build the pinned llama.cpp, cached outside the repository.

The pinned source is the llama.cpp tree vendored in the ``llama-cpp-python==0.3.36`` sdist on
PyPI. The sdist is fetched with pip, its sha256 checked against :data:`SDIST_SHA256`, and
``vendor/llama.cpp`` extracted once into the cache. Builds are keyed by source hash + CMake flags,
so a second build with the same flags is a no-op taking seconds.

Usage::

    python native/tools/build_llama.py [--cuda] [--rpc] [--peers] [--print-dir]

``--cuda`` turns on ``GGML_CUDA``; ``--rpc`` turns on ``GGML_RPC`` (llama.cpp's RPC backend: a
target's layers on remote ``rpc-server`` processes) and also builds ``rpc-server``. ``--peers``
also builds ``llama-completion``, ``llama-speculative-simple`` and ``llama-server`` for paired benchmarks
(the server without its web UI and without SSL/curl: nothing is downloaded at build time).

Power's reviewed changes to the pinned source live in ``native/patches/*.patch`` (unified diffs,
applied in name order with ``patch -p1`` to a fresh extraction); their sha256 is part of the
source and build cache keys and is recorded in ``power-build.json`` (and so in every receipt).
Each patch is inert until a Power call switches it on, so the peers built from the same tree
behave as stock llama.cpp.
Environment: ``POWER_NATIVE_CACHE`` (default ``~/.cache/power-native``), ``POWER_NATIVE_CUDA=1``,
``POWER_NATIVE_RPC=1`` (the same as the flags; ``pip install ./native`` passes them through),
``POWER_NATIVE_MARCH`` (the ``-march`` level; default ``native``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# The upstream commit of the vendored tree (the sdist carries no .git).
LLAMA_CPP_COMMIT = "0c1e570"

BASE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DGGML_CCACHE=OFF",
    # the build machine's ISA (like GGML_NATIVE) minus AMX: CPUs here advertise AMX tiles that the
    # sandbox does not execute (SIGILL in ggml's AMX q4_1 kernel on SmolLM2); ggml's own flags
    # (AVX2/FMA/F16C, added after these) only add to -march=native
    "-DGGML_NATIVE=OFF",
)


def _isa_flags() -> tuple[str, ...]:
    """``-march`` of the build: ``POWER_NATIVE_MARCH`` (default ``native``, this machine's ISA minus AMX).
    Wheels meant for other machines (``nox -s dist``) set a portable level, e.g. ``x86-64-v3``
    (AVX2/FMA/F16C: every x86-64 CPU since 2013-2015); the level is part of the cache key."""
    march = os.environ.get("POWER_NATIVE_MARCH", "native")
    cflags = f"-march={march} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return (f"-DCMAKE_C_FLAGS={cflags}", f"-DCMAKE_CXX_FLAGS={cflags}", "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON")
# "native" needs a GPU at configure time; POWER_NATIVE_CUDA_ARCHS (e.g. "90") builds on a machine without one
CUDA_FLAGS = ("-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('POWER_NATIVE_CUDA_ARCHS', 'native')}")
RPC_FLAGS = ("-DGGML_RPC=ON",)
PEER_TARGETS = ("llama-completion", "llama-speculative-simple", "llama-server")
#: switched on only for ``--peers``: they add tools/server (and tools/ui, tools/cli) to the build graph and
#: change no artifact of another target, so they stay out of the cache key (like the target list): a cached
#: build dir is reconfigured in place and builds only the new targets. The web UI is neither built (npm) nor
#: downloaded (its prebuilt assets come from a Hugging Face bucket by default); the server serves no UI.
PEER_FLAGS = ("-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
RPC_SERVER = "ggml-rpc-server"  # tools/rpc: llama.cpp's rpc-server


def _env_rpc() -> bool:
    return os.environ.get("POWER_NATIVE_RPC") == "1"


def cache_root() -> Path:
    return Path(os.environ.get("POWER_NATIVE_CACHE", Path.home() / ".cache" / "power-native"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(root: Path) -> Path:
    """Return the verified sdist path, downloading it with pip when absent."""
    dist = root / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    target = dist / SDIST_FILE
    if not target.exists():
        with tempfile.TemporaryDirectory(dir=dist) as tmp:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "--no-build-isolation", f"{SDIST_NAME}=={SDIST_VERSION}", "-d", tmp],
                check=True,
            )
            os.replace(Path(tmp) / SDIST_FILE, target)
    digest = _sha256(target)
    if digest != SDIST_SHA256:
        target.unlink()
        raise SystemExit(f"{SDIST_FILE}: sha256 {digest} != pinned {SDIST_SHA256}; refusing to build")
    return target


PATCH_DIR = Path(__file__).resolve().parent.parent / "patches"


def patches() -> list[tuple[str, str]]:
    """(name, sha256) of every patch applied to the pinned source, in application order."""
    return [(p.name, _sha256(p)) for p in sorted(PATCH_DIR.glob("*.patch"))]


def _patch_key() -> str:
    return hashlib.sha256("\n".join(f"{n}:{h}" for n, h in patches()).encode()).hexdigest()[:12]


def source_dir(root: Path | None = None) -> Path:
    """Extract ``vendor/llama.cpp`` and apply Power's patches once; return its path."""
    root = root or cache_root()
    src = root / f"src-{SDIST_SHA256[:12]}-{_patch_key()}" / "llama.cpp"
    if (src / "include" / "llama.h").exists():
        return src
    sdist = fetch_sdist(root)
    parent = src.parent
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        prefix = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers() if m.name.startswith(prefix)]
            tf.extractall(tmp, members=members, filter="data")
        tree = Path(tmp) / prefix.rstrip("/")
        for p in sorted(PATCH_DIR.glob("*.patch")):
            subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(p)], cwd=tree, check=True)
        if parent.exists():
            shutil.rmtree(parent)
        parent.mkdir(parents=True)
        os.replace(tree, src)
    return src


def build_flags(cuda: bool, rpc: bool | None = None) -> tuple[str, ...]:
    rpc = _env_rpc() if rpc is None else rpc
    return BASE_FLAGS + _isa_flags() + (CUDA_FLAGS if cuda else ()) + (RPC_FLAGS if rpc else ())


def build_dir(cuda: bool, root: Path | None = None, rpc: bool | None = None) -> Path:
    root = root or cache_root()
    flags = build_flags(cuda, rpc)
    key = hashlib.sha256("\n".join((SDIST_SHA256, _patch_key()) + flags).encode()).hexdigest()[:12]
    return root / f"build-{'cuda' if cuda else 'cpu'}{'-rpc' if RPC_FLAGS[0] in flags else ''}-{key}"


@contextlib.contextmanager
def _locked(path: Path):
    """Serialise concurrent builds of one cache entry (two pip installs, a test and a bench)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build(cuda: bool = False, peers: bool = False, rpc: bool | None = None) -> Path:
    """Configure (once) and build libllama (+ peers, + rpc-server); return the build directory."""
    with _locked(cache_root() / ".lock"):
        return _build(cuda, peers, _env_rpc() if rpc is None else rpc)


def _build(cuda: bool, peers: bool, rpc: bool) -> Path:
    src = source_dir()
    bdir = build_dir(cuda, rpc=rpc)
    cache = bdir / "CMakeCache.txt"
    if not cache.exists():
        subprocess.run(["cmake", "-S", str(src), "-B", str(bdir), "-G", "Ninja", *build_flags(cuda, rpc),
                        *(PEER_FLAGS if peers else ())], check=True)
    elif peers and not _configured(cache, PEER_FLAGS):  # a build dir configured without them: add them in place
        subprocess.run(["cmake", "-S", str(src), "-B", str(bdir), *build_flags(cuda, rpc), *PEER_FLAGS], check=True)
    targets = ["llama"] + (list(PEER_TARGETS) if peers else []) + ([RPC_SERVER] if rpc else [])
    subprocess.run(["cmake", "--build", str(bdir), "--target", *targets], check=True)
    info = {"sdist": SDIST_FILE, "sdist_sha256": SDIST_SHA256, "llama_cpp_commit": LLAMA_CPP_COMMIT,
            "flags": list(build_flags(cuda, rpc)), "patches": [f"{n} sha256:{h}" for n, h in patches()],
            "rpc": rpc, "source": str(src), "build": str(bdir)}
    (bdir / "power-build.json").write_text(json.dumps(info, indent=2))
    return bdir


def _configured(cache: Path, flags: tuple[str, ...]) -> bool:
    """Whether a CMakeCache.txt already holds every ``-DNAME=VALUE`` of ``flags``."""
    entries = {}
    for line in cache.read_text(errors="replace").splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.startswith(("#", "//")):
            entries[name.split(":", 1)[0]] = value
    return all(entries.get(f[2:].partition("=")[0]) == f.partition("=")[2] for f in flags)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", default=os.environ.get("POWER_NATIVE_CUDA") == "1")
    ap.add_argument("--rpc", action="store_true", default=_env_rpc(),
                    help="GGML_RPC=ON (llama.cpp's RPC backend) and the rpc-server tool")
    ap.add_argument("--peers", action="store_true")
    ap.add_argument("--print-dir", action="store_true", help="print the build dir and exit")
    args = ap.parse_args(argv)
    if args.print_dir:
        print(build_dir(args.cuda, rpc=args.rpc))
        return 0
    print(build(cuda=args.cuda, peers=args.peers, rpc=args.rpc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
