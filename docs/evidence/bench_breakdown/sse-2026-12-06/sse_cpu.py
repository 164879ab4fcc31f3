"""The event loop's CPU time per streamed request: the server's main thread (/proc/PID/task/PID/stat) of
`power serve --mode off` on the tests' tiny llama, two checkouts interleaved: /tmp/wt-sse (the commit before
the change, sse-starlette; `git worktree add /tmp/wt-sse 9a1f6f4`) and this checkout.

    python sse_cpu.py REQUESTS TOKENS ROUNDS      # e.g. 150 64 6
"""
import os, sys, time, statistics
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "tests" / "native"))
from tests.serve_helpers import listening, power_cmd
from native_helpers import make_tiny
from openai import OpenAI
model = make_tiny(Path("/tmp/pd"), "llama")
N, TOK = int(sys.argv[1]), int(sys.argv[2])
def cpu(pid):
    f = open(f"/proc/{pid}/task/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
res = {"old": [], "new": []}
for r in range(int(sys.argv[3])):
    for v, cwd in (("old", "/tmp/wt-sse"), ("new", str(ROOT))) if r % 2 == 0 else (("new", str(ROOT)), ("old", "/tmp/wt-sse")):
        cmd = power_cmd("serve", "--port", "0", "--model", str(model), "--mode", "off", "--threads", "1", "--n-ctx", "512")
        with listening(cmd, cwd=Path(cwd)) as s:
            oa = OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
            name = oa.models.list().data[0].id
            def go(n):
                for i in range(n):
                    for _ in oa.completions.create(model=name, prompt=f"hello {i}", max_tokens=TOK, temperature=0, stream=True):
                        pass
            go(5)
            c0, t0 = cpu(s.proc.pid), time.perf_counter()
            go(N)
            c1, t1 = cpu(s.proc.pid), time.perf_counter()
        res[v].append(((c1 - c0) / N * 1e3, (t1 - t0) / N * 1e3))
        print(v, f"cpu {res[v][-1][0]:.2f} ms/request, wall {res[v][-1][1]:.2f}", flush=True)
for v in res:
    print(v, "median cpu", statistics.median(x[0] for x in res[v]), "wall", statistics.median(x[1] for x in res[v]))
