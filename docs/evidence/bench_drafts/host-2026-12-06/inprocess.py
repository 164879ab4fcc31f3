"""One DFlash (or DSpark) request at a time in process, no HTTP: ms per request and the receipt's compute/host
split. Run from the repository root: python inprocess.py [REQUESTS] [dflash|dspark]
(the fixtures of tests/bench/bench_drafts.py, written to /tmp/pd)."""
import sys, time, tempfile
from pathlib import Path
sys.path.insert(0, "tests/native"); sys.path.insert(0, ".")
from native_helpers import make_tiny, make_tiny_draft
from power_core.session import Session
tmp = Path("/tmp/pd")
target = make_tiny(tmp, "qwen35")
mode = sys.argv[2] if len(sys.argv) > 2 else "dflash"
kw = {"dflash": dict(kind="dflash"), "dspark": dict(kind="dspark", block_size=16)}[mode]
draft = make_tiny_draft(tmp, target, name=f"bench-{mode}", **kw)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 10
with Session.open_engine(1, model=str(target), draft=str(draft), spec_mode=mode, n_threads=2, n_ctx=512, spec_draft_max=7) as eng:
    sess = eng.sessions[0]
    for i in range(2): sess.generate([1, 2, 3, 4 + i], max_tokens=192)
    t = time.perf_counter()
    for i in range(N): r = sess.generate([1, 2, 3, 4 + i % 50], max_tokens=192)
    dt = (time.perf_counter() - t) / N
    rc = r.receipt.to_dict()
    print(f"{dt*1e3:.2f} ms/request, tokens {len(r.tokens)}, rounds {len(rc['rounds'])}", flush=True)
    import json
    print(json.dumps(rc["timings"], indent=0)[:1500])
    print(json.dumps(rc["backend"].get("batch")), rc["rounds"][5])
