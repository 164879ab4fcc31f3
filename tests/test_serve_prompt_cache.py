"""``power serve``'s prompt cache: on by default (``--cache-ram``), scoped per tenant (the API key,
within it the OpenAI ``user`` field), reported per request (``prompt_reused``) and in ``/metrics``."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import pytest
from helpers import core_plugins

from power_core import PowerConfig, PromptCache
from power_core.cli import build_parser
from power_core.memory import DEFAULT_CACHE_MIB
from power_core.serve import ServeOptions, create_app, open_sessions
from power_core.serve.app import _tenant
from tests.serve_helpers import power_cmd

PROMPT = list(range(40, 100))


def test_the_server_caches_prompts_by_default_and_zero_turns_it_off():
    args = build_parser().parse_args(["serve"])
    assert args.cache_ram == DEFAULT_CACHE_MIB == 8192 and not args.cache_share_tenants
    assert PromptCache.of_mib(0) is None
    assert PromptCache.of_mib(args.cache_ram).budget_bytes == 8192 << 20


def test_a_negative_budget_is_a_usage_error_before_binding():
    out = subprocess.run(power_cmd("serve", "--backend", "reference", "--port", "0", "--cache-ram", "-1"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "usage error" in out.stderr and "--cache-ram" in out.stderr, out.stderr
    assert "listening" not in out.stderr and "Traceback" not in out.stderr


def test_the_tenant_is_the_api_key_then_the_user_and_never_the_key_itself():
    keyed = ServeOptions(model_name="m", api_key="s3cret")
    assert _tenant(ServeOptions(model_name="m"), None) == ""
    assert _tenant(ServeOptions(model_name="m"), "alice") == "user:alice"
    assert _tenant(keyed, None).startswith("key:") and "s3cret" not in _tenant(keyed, "alice")
    assert _tenant(keyed, "alice") != _tenant(keyed, "bob") != _tenant(keyed, None)
    assert _tenant(ServeOptions(model_name="m", api_key="other"), None) != _tenant(keyed, None)


@pytest.mark.parametrize("share", [False, True])
def test_requests_reuse_only_their_own_tenant_s_prompts_unless_shared(share):
    cache = PromptCache(1 << 22, share_tenants=share)
    slots = open_sessions(PowerConfig(spec_mode="off", n_ctx=256, max_tokens=6), 2,
                          model="reference:recurrent=0", plugins=core_plugins(), prompt_cache=cache)
    try:
        app = create_app(slots.engine, ServeOptions(model_name="m", api_key="k"))
        state = app.state.power

        async def requests() -> tuple[list[dict], str]:
            transport = httpx.ASGITransport(app=app)
            headers = {"authorization": "Bearer k"}
            async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=headers) as client:
                async def ask(prompt: list[int], user: str | None) -> dict:
                    body = {"model": "m", "prompt": prompt, "max_tokens": 6, **({"user": user} if user else {})}
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    return r.json()

                out = [await ask(PROMPT, "alice")]
                out.append(await ask(PROMPT + [7, 8], "bob"))  # extends alice's prompt
                for i in range(3):  # other prompts push every sequence's state into the cache
                    out.append(await ask([i + 1] * 30, "carol"))
                out.append(await ask(PROMPT + [9], "bob"))
                out.append(await ask(PROMPT + [9], "alice"))
                receipt = await client.get(f"/v1/receipts/{out[-1]['id']}")
                assert receipt.json()["receipt"]["prompt_reused"] == out[-1]["power"]["prompt_reused"]
                assert receipt.json()["receipt"]["config"]["tenant"].endswith("/user:alice")
                metrics = (await client.get("/metrics")).text
                return out, metrics

        out, metrics = asyncio.run(requests())
        state.executor.shutdown(wait=True)
    finally:
        slots.close()
    reused = [o["power"]["prompt_reused"] for o in out]
    assert reused[0] == 0
    assert (reused[1] > 0) == share  # bob never reuses alice's prefix: his first request prefills it all
    assert reused[5] >= len(PROMPT)  # then his own state (restored from the cache) holds it
    assert reused[6] >= len(PROMPT)  # as alice's does for her
    assert cache.stats().restores >= 1
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line and not line.startswith("#")}
    assert values["power:prompt_cache_requests_total"] == len(out)
    assert values["power:prompt_cache_hits_total"] == sum(r > 0 for r in reused)
    assert values["power:prompt_cache_hit_rate"] == pytest.approx(sum(r > 0 for r in reused) / len(out))
    assert values["power:prompt_tokens_reused_total"] == sum(reused)
    assert 0 < values["power:prompt_cache_bytes"] <= values["power:prompt_cache_budget_bytes"] == 1 << 22
    assert values["power:prompt_cache_entries"] >= 1 and values["power:prompt_cache_restores"] >= 1
