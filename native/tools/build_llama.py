"""Fetch, verify and build the pinned llama.cpp, cached outside the repository.

The pinned source is the llama.cpp tree vendored in the ``llama-cpp-python==0.3.36`` sdist on
PyPI. The sdist is fetched with pip, its sha256 checked against :data:`SDIST_SHA256`, and
``vendor/llama.cpp`` extracted once into the cache. Builds are keyed by source hash + CMake flags,
so a second build with the same flags is a no-op taking seconds.

Usage::

    python native/tools/build_llama.py [--cuda] [--rpc] [--peers] [--print-dir] [--configure-only]

``--cuda`` turns on ``GGML_CUDA``; ``--rpc`` turns on ``GGML_RPC`` (llama.cpp's RPC backend: a
target's layers on remote ``rpc-server`` processes) and also builds ``rpc-server``. ``--peers``
also builds ``llama-completion``, ``llama-speculative-simple`` and ``llama-server`` for paired benchmarks
(the server without its web UI and without SSL/curl: nothing is downloaded at build time), and
``llama-quantize`` for the synthetic models of each quant type.

Power's reviewed changes to the pinned source live in ``native/patches/*.patch`` (unified diffs,
applied in name order with ``patch -p1`` to a fresh extraction); their sha256 is part of the
source and build cache keys and is recorded in ``power-build.json`` (and so in every receipt).
Each patch is inert until a Power call switches it on, so the peers built from the same tree
behave as stock llama.cpp.
Environment: ``POWER_NATIVE_CACHE`` (default ``~/.cache/power-native``), ``POWER_NATIVE_CUDA=1``,
``POWER_NATIVE_RPC=1`` (the same as the flags; ``pip install ./native`` passes them through),
``POWER_NATIVE_MARCH`` (the ``-march`` level; default ``native``), ``POWER_NATIVE_CPU_VARIANTS=1``
(runtime CPU dispatch instead of one ``-march``: see :data:`CPU_VARIANT_FLAGS`), ``POWER_NATIVE_CUDA_ARCHS``
(``CMAKE_CUDA_ARCHITECTURES``; default ``native`` where a GPU is present, required where none is).

A CUDA build machine needs no GPU: a toolkit without cuBLAS gets it from NVIDIA's PyPI wheel (merged
with the system toolkit into ``cuda-root-*`` in the cache), and without a linkable ``libcuda``
ggml-cuda is built with ``GGML_CUDA_NO_VMM=ON`` (recorded as ``cuda_no_vmm`` in ``power-build.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
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


#: ``POWER_NATIVE_CPU_VARIANTS=1`` (``nox -s dist``): runtime CPU dispatch, as upstream's packages build it.
#: ggml-cpu becomes modules loaded at run time (``libggml-cpu-<variant>.so``, from the ``x64`` baseline
#: up to AVX-512), none linked; ``power_native`` loads the best one this CPU runs at import
#: (``ggml_backend_load_all_from_path``) and reaches Power's switches through the backend registry. The
#: AMX variant is left out (patch 0007): its kernels are outside the batch-invariant patches.
CPU_VARIANT_FLAGS = ("-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON", "-DGGML_CPU_ALL_VARIANTS_NO_AMX=ON")


def cpu_variants() -> bool:
    """Whether this build dispatches on the CPU at run time (``POWER_NATIVE_CPU_VARIANTS=1``)."""
    return os.environ.get("POWER_NATIVE_CPU_VARIANTS") == "1"


def _isa_flags() -> tuple[str, ...]:
    """The build's ISA: :data:`CPU_VARIANT_FLAGS` with ``POWER_NATIVE_CPU_VARIANTS=1`` (each variant
    brings its own flags), else one ``-march``: ``POWER_NATIVE_MARCH`` (default ``native``, this
    machine's ISA minus AMX; e.g. ``x86-64-v3`` to check AVX2 kernels here). Part of the cache key."""
    rpath = "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON"
    if cpu_variants():
        if "POWER_NATIVE_MARCH" in os.environ:
            raise SystemExit("POWER_NATIVE_CPU_VARIANTS=1 builds every CPU variant with its own flags; "
                             "unset POWER_NATIVE_MARCH")
        return (*CPU_VARIANT_FLAGS, rpath)
    march = os.environ.get("POWER_NATIVE_MARCH", "native")
    cflags = f"-march={march} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return (f"-DCMAKE_C_FLAGS={cflags}", f"-DCMAKE_CXX_FLAGS={cflags}", rpath)
RPC_FLAGS = ("-DGGML_RPC=ON",)


# --- CUDA -------------------------------------------------------------------------------------------
# A CUDA build needs nvcc + cudart + cuBLAS at build time; a GPU and its driver (libcuda) only at run
# time. On a GPU-less build machine: cuBLAS missing from the toolkit comes from NVIDIA's PyPI wheel
# (assembled with the system toolkit into one root in the cache), GGML_CUDA_NO_VMM=ON when libcuda is
# absent (ggml-cuda then does not link the driver), and the architectures must be named.

#: cuBLAS wheel per toolkit major version (CUDA 13's wheels dropped the -cuNN suffix)
CUBLAS_WHEELS = {12: "nvidia-cublas-cu12", 13: "nvidia-cublas"}


class CudaError(SystemExit):
    """A CUDA build that cannot be configured here, with what to do about it."""


@dataclasses.dataclass(frozen=True)
class CudaSetup:
    toolkit: Path  # the system toolkit (bin/nvcc, include/cuda_runtime.h)
    version: tuple[int, int]  # nvcc's release (major, minor)
    archs: str  # CMAKE_CUDA_ARCHITECTURES
    no_vmm: bool  # libcuda not linkable here: GGML_CUDA_NO_VMM=ON
    cublas_spec: str | None  # the pip requirement cuBLAS comes from; None: the toolkit has it
    root: Path  # CUDAToolkit_ROOT: the toolkit, or the merged root in the cache

    @property
    def flags(self) -> tuple[str, ...]:
        flags = ("-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={self.archs}")
        if self.no_vmm:
            flags += ("-DGGML_CUDA_NO_VMM=ON",)
        if self.cublas_spec:
            flags += (f"-DCUDAToolkit_ROOT={self.root}", f"-DCMAKE_CUDA_COMPILER={self.toolkit / 'bin' / 'nvcc'}")
        return flags

    def info(self) -> dict:
        return {"cuda_toolkit": str(self.toolkit), "cuda_version": "{}.{}".format(*self.version),
                "cuda_archs": self.archs, "cuda_no_vmm": self.no_vmm, "cublas_from_wheel": self.cublas_spec}


def _is_toolkit(root: Path) -> bool:
    return (root / "bin" / "nvcc").is_file() and any(
        (d / "cuda_runtime.h").exists() for d in (root / "include", *root.glob("targets/*/include")))


def find_toolkit(env: dict | None = None) -> Path:
    """The CUDA toolkit: ``CUDAToolkit_ROOT``/``CUDA_HOME``/``CUDA_PATH``, then ``/usr/local/cuda``, then
    the one ``nvcc`` on PATH belongs to (resolved: distributions wrap or link it)."""
    env = os.environ if env is None else env
    cands = [Path(env[k]) for k in ("CUDAToolkit_ROOT", "CUDA_HOME", "CUDA_PATH") if env.get(k)]
    cands.append(Path("/usr/local/cuda"))
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        cands.append(Path(nvcc).resolve().parent.parent)
    for c in cands:
        if _is_toolkit(c):
            return c.resolve()
    raise CudaError("--cuda: no CUDA toolkit found (looked for bin/nvcc and include/cuda_runtime.h in "
                    + ", ".join(map(str, cands)) + "); set CUDA_HOME to the toolkit")


def nvcc_version(toolkit: Path) -> tuple[int, int]:
    out = subprocess.run([str(toolkit / "bin" / "nvcc"), "--version"], capture_output=True, text=True,
                         check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise CudaError(f"--cuda: cannot read the CUDA version from `{toolkit}/bin/nvcc --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def _lib_dirs(root: Path) -> list[Path]:
    return [root / "lib64", root / "lib", *sorted(root.glob("targets/*/lib"))]


def has_cublas(toolkit: Path) -> bool:
    """Whether the toolkit carries cuBLAS to build against (header and linkable library)."""
    header = any((d / "cublas_v2.h").exists() for d in (toolkit / "include", *toolkit.glob("targets/*/include")))
    return header and any((d / "libcublas.so").exists() for d in _lib_dirs(toolkit))


def _ldconfig_libs() -> set[str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return set()
    return {line.split()[0] for line in out.splitlines()[1:] if line.strip()}


def has_libcuda(toolkit: Path, ldconfig: set[str] | None = None) -> bool:
    """Whether CMake's ``CUDA::cuda_driver`` can be linked: a ``libcuda.so`` known to the loader, or the
    toolkit's stub (``lib64/stubs``), which a GPU machine's driver then satisfies at run time."""
    libs = _ldconfig_libs() if ldconfig is None else ldconfig
    if "libcuda.so" in libs:
        return True
    return any((d / name).exists() for d in _lib_dirs(toolkit) for name in ("libcuda.so", "stubs/libcuda.so"))


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU (``CMAKE_CUDA_ARCHITECTURES=native`` needs one)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
        return r.returncode == 0 and "GPU" in r.stdout
    return False


def cuda_archs(env: dict | None = None, gpu: bool | None = None) -> str:
    """``POWER_NATIVE_CUDA_ARCHS``; unset: ``native`` with a GPU here, a clear error without one."""
    env = os.environ if env is None else env
    archs = env.get("POWER_NATIVE_CUDA_ARCHS", "").strip()
    if archs:
        return archs
    if gpu_present() if gpu is None else gpu:
        return "native"
    raise CudaError("--cuda: no GPU on this machine, so CMAKE_CUDA_ARCHITECTURES=native cannot be detected; "
                    "name the target GPUs' architectures, e.g. POWER_NATIVE_CUDA_ARCHS=90 (H100/H200), "
                    "80 (A100), 89 (L4/L40/RTX 4090), 120 (RTX 50xx), or several: \"80;90\"")


def cublas_spec(version: tuple[int, int]) -> str:
    """The pip requirement of the cuBLAS that matches toolkit ``major.minor`` (cuBLAS tracks the toolkit)."""
    major, minor = version
    if major not in CUBLAS_WHEELS:
        raise CudaError(f"--cuda: the CUDA {major}.{minor} toolkit lacks cuBLAS and no cuBLAS wheel is known "
                        f"for CUDA {major} (known: {sorted(CUBLAS_WHEELS)}); install cuBLAS into the toolkit")
    return f"{CUBLAS_WHEELS[major]}=={major}.{minor}.*"


def merged_root(root: Path, toolkit: Path, spec: str) -> Path:
    key = hashlib.sha256(f"{toolkit}\n{spec}".encode()).hexdigest()[:12]
    return root / f"cuda-root-{key}"


def cuda_setup(env: dict | None = None, root: Path | None = None, gpu: bool | None = None,
               ldconfig: set[str] | None = None) -> CudaSetup:
    """Decide the CUDA build here (no download, no build): toolkit, archs, VMM, where cuBLAS comes from."""
    toolkit = find_toolkit(env)
    version = nvcc_version(toolkit)
    archs = cuda_archs(env, gpu)
    spec = None if has_cublas(toolkit) else cublas_spec(version)
    cuda_root = merged_root(root or cache_root(), toolkit, spec) if spec else toolkit
    return CudaSetup(toolkit, version, archs, not has_libcuda(toolkit, ldconfig), spec, cuda_root)


def _link_entries(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for e in src.iterdir():
        if not (dst / e.name).exists():
            (dst / e.name).symlink_to(e.resolve())


def assemble_cuda_root(setup: CudaSetup) -> Path:
    """Make ``setup.root``: the system toolkit (symlinked) plus cuBLAS from its PyPI wheel, with the
    unversioned ``libcublas*.so`` links the wheel lacks. Once; later builds find it complete."""
    out = setup.root
    if setup.cublas_spec is None or (out / ".complete").exists():
        return out
    if out.exists():
        shutil.rmtree(out)
    wheels = out.parent / f"{out.name}.wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        setup.cublas_spec, "-d", str(wheels)], check=True)
    (whl,) = wheels.glob("*.whl")
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{out.name}.tmp"))
    try:
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(tmp / "wheel")
        for entry in setup.toolkit.iterdir():  # bin, nvvm, share ...: as they are
            if entry.name not in ("include", "lib", "lib64", "targets"):
                (tmp / entry.name).symlink_to(entry.resolve())
        inc, lib = tmp / "include", tmp / "lib"
        for d in (setup.toolkit / "include", *setup.toolkit.glob("targets/*/include")):
            if d.is_dir():
                _link_entries(d, inc)
        for d in _lib_dirs(setup.toolkit):
            if d.is_dir():
                _link_entries(d, lib)
        (tmp / "lib64").symlink_to("lib")
        for h in (tmp / "wheel").glob("nvidia/*/include/*.h"):
            (inc / h.name).unlink(missing_ok=True)
            (inc / h.name).symlink_to(os.path.relpath(h, inc))  # relative: tmp is renamed below
        for so in (tmp / "wheel").glob("nvidia/*/lib/lib*.so.*"):
            (lib / so.name).unlink(missing_ok=True)
            (lib / so.name).symlink_to(os.path.relpath(so, lib))
            plain = lib / (so.name.split(".so.")[0] + ".so")  # libcublas.so -> libcublas.so.13
            if not plain.exists():
                plain.symlink_to(so.name)
        if not has_cublas(tmp):
            raise CudaError(f"--cuda: {whl.name} did not provide cublas_v2.h and libcublas.so")
        (tmp / ".complete").write_text(whl.name + "\n")
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    shutil.rmtree(wheels)  # unpacked into out/wheel; its name is in out/.complete
    return out
#: llama.cpp's own tools for paired benchmarks and tests; ``llama-quantize`` writes the synthetic models of every
#: quant type that the numerics tests and ``bench_numerics`` run (tests/native/native_helpers.py ``make_wide``)
PEER_TARGETS = ("llama-completion", "llama-speculative-simple", "llama-server", "llama-quantize")
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


def build_flags(cuda: bool | CudaSetup, rpc: bool | None = None) -> tuple[str, ...]:
    """CMake flags; ``cuda``: False, True (decided here by :func:`cuda_setup`) or a decided setup."""
    rpc = _env_rpc() if rpc is None else rpc
    if cuda is True:
        cuda = cuda_setup()
    return BASE_FLAGS + _isa_flags() + (cuda.flags if cuda else ()) + (RPC_FLAGS if rpc else ())


def build_dir(cuda: bool | CudaSetup, root: Path | None = None, rpc: bool | None = None) -> Path:
    root = root or cache_root()
    flags = build_flags(cuda, rpc)
    key = hashlib.sha256("\n".join((SDIST_SHA256, _patch_key()) + flags).encode()).hexdigest()[:12]
    variants = "-variants" if CPU_VARIANT_FLAGS[0] in flags else ""
    return root / f"build-{'cuda' if cuda else 'cpu'}{variants}{'-rpc' if RPC_FLAGS[0] in flags else ''}-{key}"


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


def build(cuda: bool = False, peers: bool = False, rpc: bool | None = None, configure_only: bool = False) -> Path:
    """Configure (once) and build libllama (+ peers, + rpc-server); return the build directory.
    ``configure_only``: stop after CMake's configure step (no compile, no ``power-build.json``)."""
    with _locked(cache_root() / ".lock"):
        return _build(cuda, peers, _env_rpc() if rpc is None else rpc, configure_only)


def _build(cuda: bool, peers: bool, rpc: bool, configure_only: bool = False) -> Path:
    setup = cuda_setup() if cuda else None
    if setup is not None:
        assemble_cuda_root(setup)
    flags = build_flags(setup or False, rpc)
    src = source_dir()
    bdir = build_dir(setup or False, rpc=rpc)
    cache = bdir / "CMakeCache.txt"
    if not cache.exists():
        subprocess.run(["cmake", "-S", str(src), "-B", str(bdir), "-G", "Ninja", *flags,
                        *(PEER_FLAGS if peers else ())], check=True)
    elif peers and not _configured(cache, PEER_FLAGS):  # a build dir configured without them: add them in place
        subprocess.run(["cmake", "-S", str(src), "-B", str(bdir), *flags, *PEER_FLAGS], check=True)
    if configure_only:
        return bdir
    targets = ["llama"] + (list(PEER_TARGETS) if peers else []) + ([RPC_SERVER] if rpc else [])
    subprocess.run(["cmake", "--build", str(bdir), "--target", *targets], check=True)
    info = {"sdist": SDIST_FILE, "sdist_sha256": SDIST_SHA256, "llama_cpp_commit": LLAMA_CPP_COMMIT,
            "flags": list(flags), "patches": [f"{n} sha256:{h}" for n, h in patches()],
            "rpc": rpc, "source": str(src), "build": str(bdir)}
    if setup is not None:
        info.update(setup.info())
        if setup.cublas_spec:
            info["cublas_wheel"] = (setup.root / ".complete").read_text().strip()
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
    ap.add_argument("--configure-only", action="store_true",
                    help="run CMake's configure step (and fetch cuBLAS if needed), compile nothing")
    args = ap.parse_args(argv)
    if args.print_dir:
        print(build_dir(args.cuda, rpc=args.rpc))
        return 0
    print(build(cuda=args.cuda, peers=args.peers, rpc=args.rpc, configure_only=args.configure_only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
