"""cProfile of the shared passes' driver thread (SharedPasses._loop) over REQUESTS in-process DFlash requests.
Run from the repository root: python driver_profile.py [REQUESTS] [dflash|dspark] [sort]"""
import sys, time, cProfile, pstats, io
from pathlib import Path
sys.path.insert(0, "tests/native"); sys.path.insert(0, ".")
from native_helpers import make_tiny, make_tiny_draft
from power_core.session import Session
import power_core.passes as P
prof = cProfile.Profile()
orig = P.SharedPasses._loop
def loop(self):
    prof.enable()
    try: orig(self)
    finally: prof.disable()
P.SharedPasses._loop = loop
tmp = Path("/tmp/pd")
target = make_tiny(tmp, "qwen35")
mode = sys.argv[2] if len(sys.argv) > 2 else "dflash"
kw = {"dflash": dict(kind="dflash"), "dspark": dict(kind="dspark", block_size=16)}[mode]
draft = make_tiny_draft(tmp, target, name=f"bench-{mode}", **kw)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 10
with Session.open_engine(1, model=str(target), draft=str(draft), spec_mode=mode, n_threads=2, n_ctx=512, spec_draft_max=7) as eng:
    sess = eng.sessions[0]
    for i in range(N): r = sess.generate([1, 2, 3, 4 + i % 50], max_tokens=192)
st = pstats.Stats(prof); st.sort_stats(sys.argv[3] if len(sys.argv) > 3 else "tottime").print_stats(45)
