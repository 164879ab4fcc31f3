"""Patch 0013: batch-invariant mode's SIMD q8_K row quantizer writes ``quantize_row_q8_K_ref``'s bytes.

Every activation row a K-quant matmul reads in batch-invariant mode is quantized by ggml-cpu's ``from_float``
for q8_K (0009), which 0013 makes AVX2 + FMA. Rows agree across batch sizes whatever it computes (one function
for every row; ``test_quant_types`` checks that), but it is meant to be ``_ref`` itself, only faster: this test
holds it to ``_ref``'s bytes on blocks that probe each step (the scale's sign from the first largest |x|,
rounding ties, a zero block, a block of denormals whose scale overflows). ``_ref`` lives in ggml-base, whose
``nearest_int`` GCC contracts into an FMA only where ggml-base is built with FMA: a ``-march=native`` build,
as CI's is; elsewhere the test skips.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("power_native._llama")

import power_native  # noqa: E402
from power_native import _llama  # noqa: E402

pytestmark = pytest.mark.native

QK_K = 256
BLOCK_BYTES = 4 + QK_K + 2 * (QK_K // 16)  # float d, int8 qs[256], int16 bsums[16]
GGML_TYPE_Q8_K = 15
FromFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _TraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", FromFloat), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def _libraries() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    libdir = Path(power_native.get_library_dir())
    flags = " ".join(power_native.build_info().get("flags", []))
    info = _llama.system_info()
    if platform.machine().lower() not in ("x86_64", "amd64") or "AVX2 = 1" not in info or "FMA = 1" not in info:
        pytest.skip("0013's quantizer is AVX2 + FMA x86 code")
    if "-march=native" not in flags or not (libdir / "libggml-cpu.so.0").exists():
        pytest.skip("ggml-base and ggml-cpu are built with other flags (a CPU-variants build): _ref's rounding "
                    "may not be the FMA the quantizer uses")
    base = ctypes.CDLL(str(libdir / "libggml-base.so.0"))
    cpu = ctypes.CDLL(str(libdir / "libggml-cpu.so.0"))
    base.quantize_row_q8_K_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCpu)
    cpu.ggml_cpu_set_batch_invariant.argtypes = [ctypes.c_bool]
    cpu.ggml_cpu_get_batch_invariant.restype = ctypes.c_bool
    return base, cpu


def _blocks() -> Iterator[np.ndarray]:
    rng = np.random.default_rng(13)
    for scale in (1e-30, 1e-3, 1.0, 7.5, 1e4, 1e30):
        for _ in range(100):
            yield (rng.standard_normal(QK_K) * scale).astype(np.float32)
    for _ in range(200):  # +a and -a both present: the first one's sign is the scale's
        x = rng.standard_normal(QK_K).astype(np.float32)
        i, j = rng.choice(QK_K, 2, replace=False)
        x[i] = np.float32(5.0) * rng.choice([-1, 1])
        x[j] = -x[i]
        yield x
    for _ in range(200):  # halves: ties in nearest_int
        yield (rng.integers(-254, 255, QK_K) / 2).astype(np.float32)
    yield np.zeros(QK_K, np.float32)
    yield np.full(QK_K, -0.0, np.float32)
    last = np.zeros(QK_K, np.float32)
    last[-1] = -3.0
    yield last
    yield np.full(QK_K, 1e-45, np.float32)  # iscale = -inf: each value keeps its low byte, as _ref's store does


@contextlib.contextmanager
def _from_float(cpu: ctypes.CDLL, batch_invariant: bool) -> Iterator[Any]:
    """ggml-cpu's q8_K ``from_float`` with batch-invariant mode set as asked, the mode restored afterwards."""
    was = cpu.ggml_cpu_get_batch_invariant()
    cpu.ggml_cpu_set_batch_invariant(batch_invariant)
    try:
        yield cpu.ggml_get_type_traits_cpu(GGML_TYPE_Q8_K).contents.from_float
    finally:
        cpu.ggml_cpu_set_batch_invariant(was)


def test_batch_invariant_q8k_row_quantizer_writes_refs_bytes() -> None:
    base, cpu = _libraries()
    differ = []
    with _from_float(cpu, True) as from_float:
        for n, block in enumerate(_blocks()):
            x = np.ascontiguousarray(np.tile(block, 3))  # three blocks per row: the block loop, not one block
            simd = np.zeros(3 * BLOCK_BYTES, np.uint8)
            ref = np.zeros(3 * BLOCK_BYTES, np.uint8)
            from_float(x.ctypes.data, simd.ctypes.data, x.size)
            base.quantize_row_q8_K_ref(x.ctypes.data, ref.ctypes.data, x.size)
            if not np.array_equal(simd, ref):
                differ.append(n)
    assert not differ, f"blocks {differ[:10]} quantize to other bytes than quantize_row_q8_K_ref's"


def test_stock_mode_keeps_refs_quantizer() -> None:
    """Outside batch-invariant mode ``from_float`` is upstream's, ``_ref`` itself (0013 is inert there)."""
    _, cpu = _libraries()
    x = np.zeros(QK_K, np.float32)  # _ref leaves a zero block's bsums as they were; 0013 zeroes them
    out = np.full(BLOCK_BYTES, 0x55, np.uint8)
    with _from_float(cpu, False) as from_float:
        from_float(x.ctypes.data, out.ctypes.data, QK_K)
    assert (out[4 + QK_K:] == 0x55).all()
