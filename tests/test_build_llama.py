"""The CUDA decisions of native/tools/build_llama.py, on fake toolkits in tmp dirs (nothing is compiled
or downloaded): cuBLAS from the toolkit or its wheel, GGML_CUDA_NO_VMM without libcuda, the
architectures, and the CPU build's flags and cache key left as they were."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import build_tools


@pytest.fixture(scope="module")
def bl():
    return build_tools()


def fake_toolkit(root: Path, version: str = "13.0", cublas: bool = False, libcuda: str | None = None) -> Path:
    (root / "bin").mkdir(parents=True)
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {version}, V{version}.88'\n")
    nvcc.chmod(0o755)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    lib = root / "lib64"
    lib.mkdir()
    (lib / "libcudart.so").write_text("")
    if cublas:
        (root / "include" / "cublas_v2.h").write_text("")
        (lib / "libcublas.so").write_text("")
    if libcuda:  # "lib" (a libcuda.so next to cudart) or "stub" (lib64/stubs/libcuda.so)
        d = lib / "stubs" if libcuda == "stub" else lib
        d.mkdir(exist_ok=True)
        (d / "libcuda.so").write_text("")
    return root


def env_for(tk: Path, **extra: str) -> dict:
    return {"CUDA_HOME": str(tk), "PATH": "/nonexistent", **extra}


def test_toolkit_with_cublas_and_libcuda(bl, tmp_path):
    tk = fake_toolkit(tmp_path / "cuda", cublas=True, libcuda="lib")
    s = bl.cuda_setup(env_for(tk, POWER_NATIVE_CUDA_ARCHS="90"), root=tmp_path / "cache", gpu=False, ldconfig=set())
    assert s.version == (13, 0) and s.toolkit == tk.resolve() and s.root == tk.resolve()
    assert s.flags == ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90")  # a real GPU build: VMM kept
    assert s.info()["cuda_no_vmm"] is False and s.info()["cublas_from_wheel"] is None


def test_libcuda_stub_or_loader_keeps_vmm(bl, tmp_path):
    stub = fake_toolkit(tmp_path / "stub", cublas=True, libcuda="stub")
    assert bl.has_libcuda(stub, ldconfig=set())
    bare = fake_toolkit(tmp_path / "bare", cublas=True)
    assert bl.has_libcuda(bare, ldconfig={"libcuda.so", "libcuda.so.1"})
    assert not bl.has_libcuda(bare, ldconfig={"libcuda.so.1"})  # the driver alone cannot be linked against


def test_no_libcuda_builds_without_vmm(bl, tmp_path):
    tk = fake_toolkit(tmp_path / "cuda", cublas=True)
    s = bl.cuda_setup(env_for(tk, POWER_NATIVE_CUDA_ARCHS="90"), root=tmp_path / "cache", gpu=False, ldconfig=set())
    assert s.no_vmm and "-DGGML_CUDA_NO_VMM=ON" in s.flags
    assert s.info()["cuda_no_vmm"] is True


@pytest.mark.parametrize(("version", "spec"), [("13.0", "nvidia-cublas==13.0.*"),
                                               ("12.4", "nvidia-cublas-cu12==12.4.*")])
def test_missing_cublas_comes_from_the_wheel(bl, tmp_path, version, spec):
    tk = fake_toolkit(tmp_path / "cuda", version=version, libcuda="lib")
    s = bl.cuda_setup(env_for(tk, POWER_NATIVE_CUDA_ARCHS="80;90"), root=tmp_path / "cache", gpu=False,
                      ldconfig=set())
    assert s.cublas_spec == spec
    assert s.root.parent == tmp_path / "cache" and s.root.name.startswith("cuda-root-")
    assert s.flags == ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=80;90", f"-DCUDAToolkit_ROOT={s.root}",
                       f"-DCMAKE_CUDA_COMPILER={tk.resolve() / 'bin' / 'nvcc'}")
    assert not s.root.exists()  # deciding downloads nothing


def test_unknown_major_without_cublas_is_a_clear_error(bl, tmp_path):
    tk = fake_toolkit(tmp_path / "cuda", version="11.8")
    with pytest.raises(bl.CudaError, match="no cuBLAS wheel is known for CUDA 11"):
        bl.cuda_setup(env_for(tk, POWER_NATIVE_CUDA_ARCHS="80"), root=tmp_path, gpu=False, ldconfig=set())


def test_assemble_merges_toolkit_and_wheel(bl, tmp_path):
    import zipfile

    tk = fake_toolkit(tmp_path / "cuda")
    s = bl.cuda_setup(env_for(tk, POWER_NATIVE_CUDA_ARCHS="90"), root=tmp_path / "cache", gpu=False, ldconfig=set())
    wheels = s.root.parent / f"{s.root.name}.wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "nvidia_cublas-13.0.2.14-py3-none-manylinux_2_27_x86_64.whl", "w") as zf:
        zf.writestr("nvidia/cu13/include/cublas_v2.h", "")
        zf.writestr("nvidia/cu13/lib/libcublas.so.13", "x")
        zf.writestr("nvidia/cu13/lib/libcublasLt.so.13", "y")
    root = bl.assemble_cuda_root(s)  # the .whl is already there: pip is not called
    assert bl.has_cublas(root) and bl._is_toolkit(root)
    assert (root / "lib" / "libcublasLt.so").resolve().read_text() == "y"
    assert (root / "lib64" / "libcudart.so").resolve() == (tk / "lib64" / "libcudart.so").resolve()
    assert (root / "bin" / "nvcc").resolve() == (tk / "bin" / "nvcc").resolve()
    assert bl.assemble_cuda_root(s) == root  # complete: left as it is


def test_archs_native_with_a_gpu_error_without(bl):
    assert bl.cuda_archs({}, gpu=True) == "native"
    assert bl.cuda_archs({"POWER_NATIVE_CUDA_ARCHS": "90"}, gpu=False) == "90"
    with pytest.raises(bl.CudaError, match="POWER_NATIVE_CUDA_ARCHS=90"):
        bl.cuda_archs({}, gpu=False)


def test_no_toolkit_is_a_clear_error(bl, tmp_path, monkeypatch):
    monkeypatch.setattr(bl, "_is_toolkit", lambda root: False)
    with pytest.raises(bl.CudaError, match="no CUDA toolkit found"):
        bl.find_toolkit({"PATH": str(tmp_path)})


def test_cpu_flags_and_cache_key_unchanged(bl, tmp_path, monkeypatch):
    """The CPU build needs no CUDA decision and keeps its flags, so its cache directories stay valid."""
    monkeypatch.setattr(bl, "cuda_setup", lambda *a, **k: pytest.fail("CPU build consulted CUDA"))
    monkeypatch.delenv("POWER_NATIVE_MARCH", raising=False)
    monkeypatch.delenv("POWER_NATIVE_CPU_VARIANTS", raising=False)
    assert bl.build_flags(False, rpc=False) == bl.BASE_FLAGS + bl._isa_flags()
    assert bl.build_flags(False, rpc=True) == bl.BASE_FLAGS + bl._isa_flags() + ("-DGGML_RPC=ON",)
    assert bl.build_dir(False, root=tmp_path, rpc=False).name.startswith("build-cpu-")
    assert bl.build_dir(False, root=tmp_path, rpc=True).name.startswith("build-cpu-rpc-")


def test_cpu_variants_dispatch_at_run_time(bl, tmp_path, monkeypatch):
    """POWER_NATIVE_CPU_VARIANTS=1 (the portable wheels): ggml-cpu as run-time modules, one per variant with
    its own flags (no -march for the whole build, no AMX variant), in a cache directory of its own; naming a
    -march as well is a clear error, not a silent pick."""
    monkeypatch.delenv("POWER_NATIVE_MARCH", raising=False)
    monkeypatch.setenv("POWER_NATIVE_CPU_VARIANTS", "1")
    flags = bl.build_flags(False, rpc=False)
    assert {"-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON", "-DGGML_CPU_ALL_VARIANTS_NO_AMX=ON"} <= set(flags)
    assert not any("-march" in f for f in flags)
    assert bl.build_dir(False, root=tmp_path, rpc=False).name.startswith("build-cpu-variants-")
    monkeypatch.delenv("POWER_NATIVE_CPU_VARIANTS")
    assert bl.build_dir(False, root=tmp_path, rpc=False).name.startswith("build-cpu-") and "-variants" not in \
        bl.build_dir(False, root=tmp_path, rpc=False).name
    monkeypatch.setenv("POWER_NATIVE_CPU_VARIANTS", "1")
    monkeypatch.setenv("POWER_NATIVE_MARCH", "x86-64-v3")
    with pytest.raises(SystemExit, match="unset POWER_NATIVE_MARCH"):
        bl.build_flags(False, rpc=False)
