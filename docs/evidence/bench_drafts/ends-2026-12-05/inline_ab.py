"""A served request's begin and end on the event loop vs on a worker, paired in one process: python inline_ab.py N MODEL."""
import asyncio, time, statistics, httpx, sys
from power_core.config import PowerConfig
from power_core.session import Session
from power_core.serve import ServeOptions, create_app
from power_core.plugins import PowerPlugins
flag = {"v": False}
PowerPlugins.observes_requests = lambda self: flag["v"]
cfg = PowerConfig(spec_mode="mtp", max_tokens=192, n_threads=2, spec_draft_max=7, n_ctx=512)
res = {False: [], True: []}
with Session.open_engine(4, cfg, model=sys.argv[2]) as engine:
    app = create_app(engine, ServeOptions(model_name="m"))
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            for i in range(int(sys.argv[1])):
                for v in ((False, True) if i % 2 else (True, False)):
                    flag["v"] = v
                    t = time.perf_counter()
                    r = await c.post("/v1/completions", json={"model": "m", "prompt": "hello world, this is a test", "max_tokens": 192})
                    r.raise_for_status()
                    if i >= 3: res[v].append(time.perf_counter() - t)
    asyncio.run(go())
    app.state.power.executor.shutdown(wait=True)
a, b = statistics.median(res[False]), statistics.median(res[True])
d = statistics.median(x - y for x, y in zip(res[False], res[True]))
print(f"inline {a*1e3:.3f} ms  worker {b*1e3:.3f} ms  median paired diff {d*1e3:.3f} ms")
