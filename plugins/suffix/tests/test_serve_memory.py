"""``power serve --mode suffix --suffix-memory N``: the tenant of each request (the API key, then the
OpenAI ``user`` field) reaches the suffix memory, so one user's text reaches another's drafts only with
``--suffix-share-tenants``; receipts and ``/metrics`` count the draft tokens of each source."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from power_core import PowerConfig, Session  # noqa: E402
from power_core.serve import ServeOptions, create_app, open_sessions  # noqa: E402

MODEL = "reference:recurrent=0"


@pytest.mark.parametrize("share", [False, True])
def test_users_draft_from_each_others_text_only_when_shared(share):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 200, 24).tolist()
    with Session.open(PowerConfig(spec_mode="off", max_tokens=1, n_ctx=256), model=MODEL) as s:
        t1 = s.generate(x).tokens[0]  # what the model emits after x
    secret = rng.integers(0, 200, 30).tolist()  # follows x and t1 only in alice's prompt
    config = PowerConfig(spec_mode="suffix", n_ctx=256, max_tokens=12, spec_suffix_memory_tokens=100_000,
                         spec_suffix_learn_prompts=True, spec_suffix_share_tenants=share)
    slots = open_sessions(config, 2, model=MODEL)
    try:
        app = create_app(slots.engine, ServeOptions(model_name="m", api_key="k"))
        state = app.state.power

        async def requests() -> tuple[list[dict], str]:
            transport = httpx.ASGITransport(app=app)
            headers = {"authorization": "Bearer k"}
            async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as client:
                async def ask(prompt: list[int], user: str) -> dict:
                    r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 12,
                                                                   "user": user})
                    assert r.status_code == 200, r.text
                    got = await client.get(f"/v1/receipts/{r.json()['id']}")
                    return got.json()["receipt"]

                out = [await ask(x + [t1] + secret, "alice"), await ask(x, "bob"), await ask(x, "alice")]
                return out, (await client.get("/metrics")).text

        receipts, metrics = asyncio.run(requests())
        state.executor.shutdown(wait=True)
    finally:
        slots.close()
    alice, bob, alice_again = (r["proposer"]["sources"] for r in receipts)
    assert ("shared" in bob) == share  # bob drafts from alice's prompt only when tenants share
    assert alice_again["shared"]["drafted"] > 0  # alice drafts from her own earlier request, in any slot
    assert receipts[1]["config"]["tenant"].endswith("/user:bob")
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line and not line.startswith("#")}
    drafted = sum(r["proposer"]["sources"].get("shared", {}).get("drafted", 0) for r in receipts)
    assert drafted > 0
    assert values['power:spec_decode_num_draft_tokens_by_source_total{source="shared"}'] <= drafted
