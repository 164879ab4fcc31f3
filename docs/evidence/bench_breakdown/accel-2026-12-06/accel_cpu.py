"""The event loop's CPU time and the wall time per streamed request of one `power serve` checkout, with
uvicorn's C HTTP parser and event loop (httptools, uvloop: the `serve` extra) and without them (both
imports blocked by a `sitecustomize` on PYTHONPATH, so uvicorn falls back to h11 and asyncio), alternating.
The server's main thread is the event loop (/proc/PID/task/PID/stat).

    python accel_cpu.py REQUESTS TOKENS ROUNDS [MODE]      # e.g. 100 64 6 off
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "native"), str(ROOT / "tests" / "bench")]
from openai import OpenAI  # noqa: E402

from tests.serve_helpers import served  # noqa: E402

N, TOK, ROUNDS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
MODE = sys.argv[4] if len(sys.argv) > 4 else "off"
if MODE == "off":
    from native_helpers import make_tiny
    model, extra = make_tiny(Path("/tmp/pd"), "llama"), ()
else:  # a bench_drafts suite: mtp, mtp-predictable, dflash, dspark
    from bench_drafts import _fixtures
    target, draft = _fixtures(MODE, Path("/tmp/pd"))
    model = target
    extra = ("--mode", MODE.split("-")[0], *(("--draft", str(draft)) if draft else ()), "--draft-max", "7")
block = Path(tempfile.mkdtemp(prefix="noaccel-"))
(block / "sitecustomize.py").write_text("import sys\nsys.modules['httptools'] = None\nsys.modules['uvloop'] = None\n")


def cpu(pid: int) -> float:
    f = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


res: dict[str, list[tuple[float, float]]] = {"h11+asyncio": [], "httptools+uvloop": []}
variants = (("h11+asyncio", {"PYTHONPATH": str(block)}), ("httptools+uvloop", {}))
for r in range(ROUNDS):
    for name, env in variants if r % 2 == 0 else variants[::-1]:
        args = ("--model", str(model), "--threads", "2", "--n-ctx", "512", *(extra or ("--mode", "off")))
        with served(*args, env=env) as s:
            oa = OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
            model_id = oa.models.list().data[0].id

            def go(n: int) -> None:
                for i in range(n):
                    for _ in oa.completions.create(model=model_id, prompt=f"hello {i}", max_tokens=TOK,
                                                   temperature=0, stream=True):
                        pass
            go(5)
            c0, t0 = cpu(s.proc.pid), time.perf_counter()
            go(N)
            c1, t1 = cpu(s.proc.pid), time.perf_counter()
        res[name].append(((c1 - c0) / N * 1e3, (t1 - t0) / N * 1e3))
        print(name, f"event loop cpu {res[name][-1][0]:.2f} ms/request, wall {res[name][-1][1]:.2f} ms/request", flush=True)
for name, xs in res.items():
    print(name, "median event-loop cpu", f"{statistics.median(x[0] for x in xs):.2f}", "ms/request, wall",
          f"{statistics.median(x[1] for x in xs):.2f}")
a, b = res["h11+asyncio"], res["httptools+uvloop"]
print("paired wall ratio (h11+asyncio / httptools+uvloop):", [round(x[1] / y[1], 3) for x, y in zip(a, b)])
