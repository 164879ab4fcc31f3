"""Where finish_job's time goes, median microseconds a request: python finish_parts.py MODEL."""
import sys, asyncio, time, statistics, httpx, collections
from power_core.config import PowerConfig
from power_core.session import Session
from power_core.serve import ServeOptions, create_app
import power_core.serve.jobs as jobs
from power_core import generation, receipt
T = collections.defaultdict(list)
def timed(owner, name, label):
    fn = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter()
        try: return fn(*a, **k)
        finally: T[label].append(time.perf_counter() - t)
    setattr(owner, name, w)
timed(jobs, "finish_job", "finish_job")
timed(jobs, "_round_metrics", "round_metrics")
timed(generation.Generation, "report", "report")
timed(receipt.Receipt, "to_json", "to_json")
timed(receipt.Receipt, "digest", "digest")
cfg = PowerConfig(spec_mode="mtp", max_tokens=192, n_threads=2, spec_draft_max=7, n_ctx=512)
with Session.open_engine(4, cfg, model=sys.argv[1]) as engine:
    app = create_app(engine, ServeOptions(model_name="m"))
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            for i in range(40):
                r = await c.post("/v1/completions", json={"model": "m", "prompt": "hello world, this is a test", "max_tokens": 192})
                r.raise_for_status()
    asyncio.run(go())
    app.state.power.executor.shutdown(wait=True)
for k, v in T.items():
    print(f"{k:15s} n={len(v):3d} median {statistics.median(v[5:])*1e6:8.1f} us  total/req {sum(v[5:])/35*1e6:8.1f} us")
