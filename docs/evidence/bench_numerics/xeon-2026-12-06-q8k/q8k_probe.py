import ctypes, sys, numpy as np
B = sys.argv[1]
base = ctypes.CDLL(f"{B}/libggml-base.so", mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(f"{B}/libggml-cpu.so", mode=ctypes.RTLD_GLOBAL)
FF = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
class T(ctypes.Structure):
    _fields_ = [("from_float", FF), ("vec_dot", ctypes.c_void_p), ("vdt", ctypes.c_int), ("nrows", ctypes.c_int64)]
cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(T)
cpu.ggml_cpu_init()
ff = cpu.ggml_get_type_traits_cpu(15).contents.from_float
ref = base.quantize_row_q8_K_ref; ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]; cpu.ggml_cpu_set_batch_invariant.argtypes = [ctypes.c_bool]
rng = np.random.default_rng(0)
def blocks():
    for s in [1e-30, 1e-3, 1.0, 7.5, 1e4, 1e30]:
        for _ in range(200):
            yield (rng.standard_normal(256) * s).astype(np.float32)
    for _ in range(500):  # ties between +a and -a, first one decides
        x = rng.standard_normal(256).astype(np.float32); a = np.float32(5.0)
        i, j = rng.choice(256, 2, replace=False); x[i] = a * rng.choice([-1, 1]); x[j] = -x[i]; yield x
    for _ in range(300):  # small integers / halves: exact ties in rounding
        yield (rng.integers(-254, 255, 256) / 2).astype(np.float32)
    yield np.zeros(256, np.float32)
    yield np.full(256, -0.0, np.float32)
    x = np.zeros(256, np.float32); x[255] = -3; yield x
    yield np.full(256, np.float32(1e-45))
n = bad = 0
for x in blocks():
    x = np.ascontiguousarray(np.tile(x, 3))
    a = np.zeros(292 * 3, np.uint8); b = np.zeros(292 * 3, np.uint8)
    cpu.ggml_cpu_set_batch_invariant(True); ff(x.ctypes.data, a.ctypes.data, x.size)
    ref(x.ctypes.data, b.ctypes.data, ctypes.c_int64(x.size))
    n += 1
    if not np.array_equal(a, b):
        bad += 1
        if bad < 4: print("diff", np.nonzero(a != b)[0][:10], x[:4])
cpu.ggml_cpu_set_batch_invariant(False)
c = np.zeros(292, np.uint8); x = np.ones(256, np.float32); ff(x.ctypes.data, c.ctypes.data, 256)
print(f"{n} blocks x3, {bad} differ")
import time
x = rng.standard_normal(2048*64).astype(np.float32); o = np.zeros(292*8*64, np.uint8)
for on in (True, False):
    cpu.ggml_cpu_set_batch_invariant(on); t=time.perf_counter()
    for _ in range(200): ff(x.ctypes.data, o.ctypes.data, x.size)
    print("bi" if on else "ref", f"{(time.perf_counter()-t)/200/ (x.size/256)*1e9:.1f} ns/block")
