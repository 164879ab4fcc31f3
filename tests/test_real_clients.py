"""The frameworks agents are written with, unchanged, against a real ``power serve`` (issue 45, item 4).

langchain-openai, instructor, the openai-agents SDK and pydantic-ai run their standard flows (text,
streaming, structured output, tools, an agent loop with parallel calls) against SmolLM2 served with
``docs/examples/hermes-tools.jinja``. A 135M model often writes junk; what is asserted is the protocol
and exactness:

* every HTTP exchange of a flow is a ``200`` (no request a framework builds is refused), and the flow
  ends with the framework's own result or its own validation error (never a transport or protocol one);
* a flow against ``--mode suffix`` sends the same requests and gets byte-identical answers (text, tool
  names and arguments, finish reasons) as against ``--mode off``, run alone and 4 at once.

The clients never reach the network: a dummy API key, every framework's tracing off, and a socket
guard that refuses any address but the loopback. Needs the ``clients`` extra (``pip install
'power-core[clients]'``; ``nox -s tests`` installs it).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import socket
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
from pydantic import BaseModel, ValidationError

from tests.serve_helpers import Served, served

pytestmark = [pytest.mark.native, pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
HERMES = ROOT / "docs" / "examples" / "hermes-tools.jinja"
NAME = "smollm2"
#: the operator's cap on an answer (the frameworks send no max_tokens: the rest of the context otherwise)
CAP = 96
#: the frameworks' switches that would send traces or telemetry out (each off)
QUIET_ENV = {"OPENAI_API_KEY": "sk-unused", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
             "OPENAI_AGENTS_DISABLE_TRACING": "1", "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false",
             "LANGCHAIN_TRACING": "false", "LOGFIRE_SEND_TO_LOGFIRE": "false", "DO_NOT_TRACK": "1"}


class City(BaseModel):
    """What the structured-output flows ask for."""

    name: str
    country: str


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"21 C and sunny in {city}"


# -- no network ------------------------------------------------------------------------------------------
def _loopback(host: Any) -> bool:
    return host in ("127.0.0.1", "::1", "localhost")


def _framework(name: str) -> Any:
    """The framework module ``name``: skipped where the ``clients`` extra is missing, failed in CI (which
    installs it)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            f"{name} is not installed ({exc}): pip install 'power-core[clients]'")


@pytest.fixture(scope="module", autouse=True)
def _offline() -> Iterator[list[Any]]:
    """Dummy credentials, tracing off, and sockets that refuse any host but the loopback (every attempt is
    also counted, so one a framework swallows in a background thread still fails the module)."""
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo
    attempts: list[Any] = []

    def refuse(host: Any) -> None:
        attempts.append(host)
        raise AssertionError(f"a client tried to reach {host!r}: the real-client tests stay on the loopback")

    def guarded_connect(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            refuse(address[0])
        return connect(self, address)

    def guarded_connect_ex(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            refuse(address[0])
        return connect_ex(self, address)

    def guarded_getaddrinfo(host: Any, *args: Any, **kw: Any) -> Any:
        if not _loopback(host.decode() if isinstance(host, bytes) else host):
            refuse(host)
        return getaddrinfo(host, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        for key, value in QUIET_ENV.items():
            mp.setenv(key, value)
        mp.setattr(socket.socket, "connect", guarded_connect)
        mp.setattr(socket.socket, "connect_ex", guarded_connect_ex)
        mp.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
        for name in ("langchain_openai", "instructor", "pydantic_ai"):
            _framework(name)
        agents = _framework("agents")
        agents.set_tracing_disabled(True)
        try:
            yield attempts
        finally:
            agents.set_tracing_disabled(False)
    assert not attempts, f"clients tried to leave the loopback: {attempts}"


def test_the_socket_guard_refuses_the_network(_offline):
    """The guard the suite relies on: a client that tried to leave the loopback would fail, not pass."""
    with pytest.raises(AssertionError, match="loopback"):
        socket.getaddrinfo("api.openai.com", 443)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(AssertionError, match="loopback"):
            s.connect(("192.0.2.1", 443))
    finally:
        s.close()
    assert _offline == ["api.openai.com", "192.0.2.1"]
    _offline.clear()  # (these two were this test's own)


# -- the servers -----------------------------------------------------------------------------------------
def _server(mode: str, parallel: int) -> Iterator[Served]:
    pytest.importorskip("power_native")
    from tests.native.test_models import _model_path

    with served("--model", _model_path("smollm2"), "--mode", mode, "--threads", "1", "--parallel", str(parallel),
                "--chat-template", str(HERMES), "--served-model-name", NAME, "--max-tokens", str(CAP)) as s:
        yield s


@pytest.fixture(scope="module")
def off() -> Iterator[Served]:
    yield from _server("off", 1)


@pytest.fixture(scope="module")
def spec() -> Iterator[Served]:
    yield from _server("suffix", 4)


# -- what a flow sent and got ------------------------------------------------------------------------------
def _answer(choices: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Per choice: its text, its calls (name, arguments as sent) and why it ended."""
    out = []
    for c in choices:
        msg = c.get("message") or {}
        calls = [(t["function"]["name"], t["function"]["arguments"]) for t in msg.get("tool_calls") or []]
        out.append((msg.get("content"), calls, c.get("finish_reason")))
    return out


def _streamed(body: str) -> tuple[list[tuple[Any, ...]], Any]:
    """A server-sent event stream assembled as the openai client does (by index, arguments appended), and
    its usage."""
    content: dict[int, str] = {}
    calls: dict[int, dict[int, list[str]]] = {}
    finish: dict[int, Any] = {}
    usage = None
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage  # (with stream_options.include_usage: the last chunk's)
        for c in chunk.get("choices") or []:
            i, delta = c["index"], c.get("delta") or {}
            content[i] = content.get(i, "") + (delta.get("content") or "")
            for t in delta.get("tool_calls") or []:
                got = calls.setdefault(i, {}).setdefault(t["index"], ["", ""])
                fn = t.get("function") or {}
                got[0] += fn.get("name") or ""
                got[1] += fn.get("arguments") or ""
            finish[i] = c.get("finish_reason") or finish.get(i)
    return [(content.get(i), [tuple(v) for _, v in sorted(calls.get(i, {}).items())], finish.get(i))
            for i in sorted(content)], usage


@attrs.define
class Transcript:
    """Every HTTP exchange of one flow: path, status and the answer (ids and timings left out)."""

    exchanges: list[tuple[str, int, Any]] = attrs.field(factory=list)

    async def record(self, response: httpx.Response) -> None:
        await response.aread()
        path = response.request.url.path
        if response.status_code != 200:
            self.exchanges.append((path, response.status_code, response.text))
        elif response.headers.get("content-type", "").startswith("text/event-stream"):
            self.exchanges.append((path, 200, _streamed(response.text)))
        else:
            body = response.json()
            if "choices" in body:  # an answer, and what it counted
                self.exchanges.append((path, 200, (_answer(body["choices"]), body["usage"])))
            else:
                self.exchanges.append((path, 200, body))

    def refused(self) -> list[tuple[str, int, Any]]:
        return [e for e in self.exchanges if e[1] != 200]


@attrs.define
class Client:
    """One flow's view of a server: an ``openai.AsyncOpenAI`` whose every exchange is in ``transcript``."""

    base_url: str
    transcript: Transcript = attrs.field(factory=Transcript)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"response": [self.transcript.record]}, timeout=600)

    def openai(self) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="sk-unused", max_retries=0,
                                  http_client=self.http())


#: a flow: a client in, the framework's result (made comparable) out
Flow = Callable[[Client], Awaitable[Any]]


async def _own_error(run: Awaitable[Any], *errors: type[BaseException], said: bool = True) -> Any:
    """The flow's result, or the framework's own error (a small model's junk fails validation): its type
    and, with ``said``, its message (equal on every side too: the error is deterministic)."""
    try:
        return await run
    except errors as exc:
        return ("raised", type(exc).__name__, str(exc) if said else None)


def _plain(result: Any) -> Any:
    """A result as data: a pydantic model as its fields (instructor attaches the raw response, ids and all)."""
    if isinstance(result, BaseModel):
        return type(result).__name__, result.model_dump()
    if isinstance(result, (list, tuple)):
        return type(result)(_plain(r) for r in result)
    return result


def _run(server: Served, flow: Flow, n: int) -> list[tuple[Any, Transcript]]:
    """``flow`` ``n`` times at once against ``server``: each one's result and transcript."""
    async def go() -> list[tuple[Any, Transcript]]:
        clients = [Client(server.base_url) for _ in range(n)]
        results = await asyncio.gather(*(flow(c) for c in clients))
        return [(_plain(r), c.transcript) for r, c in zip(results, clients, strict=True)]

    return asyncio.run(go())


def check_flow(off: Served, spec: Served, flow: Flow) -> tuple[Any, Transcript]:
    """The flow completes on every side without a refused request, and speculation alone and 4 at once
    equals ``--mode off`` exchange by exchange; the off side's result and transcript."""
    ((want, wanted),) = _run(off, flow, 1)
    assert wanted.exchanges and not wanted.refused(), wanted.refused()
    for n in (1, 4):
        for got, transcript in _run(spec, flow, n):
            assert not transcript.refused(), transcript.refused()
            assert transcript.exchanges == wanted.exchanges, f"{n} at once"
            assert got == want, f"{n} at once"
    return want, wanted


# -- langchain-openai ----------------------------------------------------------------------------------
def _chat_openai(client: Client, **kw: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=NAME, base_url=client.base_url, api_key="sk-unused", max_retries=0,
                      http_async_client=client.http(), **kw)


async def lc_invoke_and_stream(client: Client) -> Any:
    llm = _chat_openai(client)
    said = (await llm.ainvoke("Name three colours.")).content
    streamed = "".join([chunk.content async for chunk in llm.astream("Name three colours.")])
    return said, streamed


async def lc_structured(client: Client) -> Any:
    from langchain_core.exceptions import OutputParserException

    llm = _chat_openai(client)
    ask = "Paris is the capital of France. Extract the city."
    return [await _own_error(llm.with_structured_output(City, method=method).ainvoke(ask),
                             OutputParserException, ValidationError)
            for method in ("json_schema", "function_calling", "json_mode")]


async def lc_tools(client: Client) -> Any:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = tool(get_weather)
    llm = _chat_openai(client).bind_tools([weather], tool_choice="any")
    history: list[Any] = [HumanMessage("What is the weather in Paris?")]
    first = await llm.ainvoke(history)
    history.append(first)
    for call in first.tool_calls:  # the loop: each call's result back, then the answer
        try:
            result = weather.invoke(call["args"]) if call["name"] == "get_weather" else "unknown tool"
        except ValidationError as exc:  # (the model's arguments, not the protocol: sent back as the error)
            result = f"invalid arguments: {exc.error_count()} errors"
        history.append(ToolMessage(result, tool_call_id=call["id"]))
    last = await _chat_openai(client).bind_tools([weather]).ainvoke(history)
    return [(c["name"], c["args"]) for c in first.tool_calls], last.content, [c["name"] for c in last.tool_calls]


# -- instructor -------------------------------------------------------------------------------------------
def _instructor(mode_name: str) -> Flow:
    async def flow(client: Client) -> Any:
        import instructor
        from instructor.core import InstructorRetryException

        ic = instructor.from_openai(client.openai(), mode=instructor.Mode[mode_name])
        return await _own_error(ic.chat.completions.create(
            model=NAME, response_model=City, max_retries=1,
            messages=[{"role": "user", "content": "Paris is the capital of France. Extract the city."}]),
            InstructorRetryException, said=False)  # (its message quotes the completions, ids and all)

    flow.__name__ = f"instructor_{mode_name.lower()}"
    return flow


# -- openai-agents ----------------------------------------------------------------------------------------
async def agents_parallel_tools(client: Client) -> Any:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

    model = OpenAIChatCompletionsModel(model=NAME, openai_client=client.openai())
    agent = Agent(name="weather", instructions="Answer with the tools. Call one tool per city.", model=model,
                  tools=[function_tool(get_weather)],
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=True))
    result = await _own_error(Runner.run(agent, "What is the weather in Paris and in Oslo?", max_turns=4),
                              MaxTurnsExceeded, ModelBehaviorError)
    if isinstance(result, tuple):
        return result
    calls = [item.raw_item.arguments for item in result.new_items if item.type == "tool_call_item"]
    return calls, result.final_output


async def agents_structured(client: Client) -> Any:
    from agents import Agent, OpenAIChatCompletionsModel, Runner
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

    model = OpenAIChatCompletionsModel(model=NAME, openai_client=client.openai())
    agent = Agent(name="extract", instructions="Extract the city.", model=model, output_type=City)
    result = await _own_error(Runner.run(agent, "Paris is the capital of France.", max_turns=2),
                              MaxTurnsExceeded, ModelBehaviorError)
    return result if isinstance(result, tuple) else result.final_output


async def agents_streamed(client: Client) -> Any:
    """The SDK's streamed run: tool-call deltas assembled by the SDK, the calls run, the loop streamed on."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

    model = OpenAIChatCompletionsModel(model=NAME, openai_client=client.openai())
    agent = Agent(name="weather", instructions="Answer with the tools.", model=model,
                  tools=[function_tool(get_weather)], model_settings=ModelSettings(tool_choice="required"))
    run = Runner.run_streamed(agent, "What is the weather in Oslo?", max_turns=3)

    async def events() -> list[str]:
        return [event.item.type async for event in run.stream_events() if event.type == "run_item_stream_event"]

    seen = await _own_error(events(), MaxTurnsExceeded, ModelBehaviorError)
    return seen, run.final_output


# -- pydantic-ai ------------------------------------------------------------------------------------------
async def pydantic_ai_output_and_tool(client: Client) -> Any:
    from pydantic_ai import Agent, UsageLimits
    from pydantic_ai.exceptions import UnexpectedModelBehavior, UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(NAME, provider=OpenAIProvider(openai_client=client.openai()))
    # seeded sampling: the stochastic path, exact all the same
    agent = Agent(model, output_type=City, tools=[get_weather], retries=1,
                  model_settings={"temperature": 0.7, "seed": 11})
    out = await _own_error(agent.run("What is the weather in Paris?"), UnexpectedModelBehavior)
    # the tool loop (the small model calls get_weather again and again: the run's own limit ends it)
    called: list[str] = []

    def weather(city: str) -> str:
        """Get the current weather in a city."""
        called.append(city)
        return get_weather(city)

    looping = Agent(model, output_type=City, tools=[weather], retries=1)
    loop = await _own_error(looping.run("Use weather for Paris, then give the city and its country.",
                                        usage_limits=UsageLimits(request_limit=3)),
                            UnexpectedModelBehavior, UsageLimitExceeded)
    return (out.output if not isinstance(out, tuple) else out), (loop.output if not isinstance(loop, tuple) else loop), \
        called


#: the flows checked for the protocol and exactness alone (the agent loop has its own test, below)
FLOWS: list[Flow] = [lc_invoke_and_stream, lc_structured, lc_tools, _instructor("TOOLS"), _instructor("JSON"),
                     agents_structured, agents_streamed, pydantic_ai_output_and_tool]


@pytest.mark.parametrize("flow", FLOWS, ids=[f.__name__ for f in FLOWS])
def test_a_framework_flow_is_served_and_speculation_equals_off(off, spec, flow):
    check_flow(off, spec, flow)


def test_the_agent_loop_sends_parallel_calls_back_and_is_answered(off, spec):
    """The agents SDK's loop: one answer with two calls (``required``, parallel), both results sent back
    in the next request; the next answer is served (not refused) and equals ``--mode off``'s."""
    _, transcript = check_flow(off, spec, agents_parallel_tools)
    (first, *rest) = [answer for path, _, (answer, _) in transcript.exchanges if path.endswith("/chat/completions")]
    ((_, calls, finish),) = first
    assert finish == "tool_calls" and len(calls) >= 2, first
    assert rest, "the loop sent the calls' results back"
