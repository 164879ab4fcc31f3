"""The ASGI application of ``power serve``: its routes, the guard in front of them, and each request from its
body to its admission and the start of its decode.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (answered by
:mod:`power_core.serve.responses`: JSON, or SSE with ``data: [DONE]``), ``GET /v1/models``,
``GET /v1/receipts/{id}``, ``GET /health``, ``GET /metrics``. A request picks one of the server's strategies
with its own ``power.strategy``: every sequence carries every strategy (:class:`~power_core.opening.Lane`), so
a request of any strategy runs on any free sequence, in the same shared target passes as the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from power_core.chat import ChatTemplate
from power_core.constraint import NO_PRESERVED, Constraint
from power_core.engine import Engine, Ticket
from power_core.errors import ConfigError, ConstraintError, Overloaded, PowerError, RuntimeFault, SessionBusy
from power_core.logs import get_logger
from power_core.opening import Lane
from power_core.prediction import Prediction
from power_core.serve.audit import Auditor
from power_core.serve.errors import APIError, constraint_error, error_response, from_power_error
from power_core.serve.jobs import Following, Job, Metrics, Outcome, ReceiptStore, proposer_stores, run_job
from power_core.serve.protocol import ChatRequest, CompletionRequest, Structure, parse_request
from power_core.serve.responses import Prepared, StreamAnswer, WholeAnswer
from power_core.serve.state import ServeOptions, ServerState
from power_core.session import Session
from power_core.tools import template_renders_tools

__all__ = ["create_app"]

log = get_logger(__name__)


# -- errors ---------------------------------------------------------------------------------------------
async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(APIError(exc.status_code, str(exc.detail), code=code))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _power_error(request: Request, exc: Exception) -> Response:
    return error_response(from_power_error(exc))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("serve.unhandled", path=request.url.path, exc_info=exc)
    return error_response(APIError(500, "internal error; the server log has the details", type="server_error",
                                   code="internal_error"))


# -- middleware: auth and body limit --------------------------------------------------------------------
class Guard:
    """Pure ASGI middleware: Bearer auth (constant-time) on everything but ``/health``, and the body
    size limit (by ``Content-Length`` up front, and by counting for chunked bodies)."""

    def __init__(self, app: Any, options: ServeOptions) -> None:
        self.app = app
        self.options = options

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self.options.api_key
        if key is not None and scope["path"] != "/health":
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                what = "missing" if not given else "incorrect"
                err = APIError(401, f"{what} API key: send 'Authorization: Bearer <key>' with the server's "
                               "--api-key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(err)(scope, receive, send)
                return
        limit = self.options.max_body
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            err = APIError(413, f"the request body has {length} bytes; the limit is {limit} (--max-body)",
                           code="request_too_large")
            await error_response(err)(scope, receive, send)
            return
        seen = 0

        async def bounded() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise APIError(413, f"the request body exceeds the limit of {limit} bytes (--max-body)",
                                   code="request_too_large")
            return message

        await self.app(scope, bounded, send)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_json") from None

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(text, parse_constant=no_constants)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.power
    return state


# -- shared request path --------------------------------------------------------------------------------
async def _check_structure(state: ServerState, structure: Structure) -> Constraint | None:
    """Compile every constraint of the request before it is admitted, so a schema, grammar or tool
    definition the engine refuses is a 400 naming its field (also for a stream, before it begins) and
    never takes a slot. A compile costs about a millisecond (the first one builds the vocabulary's
    tokenizer for the engine). Returns the output's constraint compiled (``None``: the request has
    none), which its decode uses as it is (:meth:`Session.start` does not compile it again); each
    tool's parameter schema is compiled only to check it."""
    specs = structure.specs()
    if not specs:
        return None
    session = state.sessions[0]

    def compile_all() -> Constraint | None:
        compiled = [session.compile(spec) for spec in specs]
        return compiled[-1] if structure.constraint is not None else None

    try:
        return await asyncio.get_running_loop().run_in_executor(None, compile_all)
    except ConstraintError as exc:
        raise constraint_error(exc) from None


def _prepare(state: ServerState, req: Any, prompt: Any, param: str, limit: int | None, top_logprobs: int | None,
             kind: str, structure: Structure | None = None, constraint: Constraint | None = None) -> Prepared:
    if req.model != state.options.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist here; this server serves "
                       f"{state.options.model_name!r} (GET /v1/models)", param="model", code="model_not_found")
    session = state.sessions[0]
    n_vocab = session.opened.target.capabilities.n_vocab
    if isinstance(prompt, np.ndarray):
        if prompt.size and (int(prompt.min()) < 0 or int(prompt.max()) >= n_vocab):
            raise APIError(400, f"prompt token ids must be in [0, {n_vocab})", param=param, code="invalid_value")
        ids = prompt.astype(np.int32)
    else:
        try:
            ids = session.encode(prompt)
        except PowerError as exc:
            raise from_power_error(exc) from None
    if ids.size == 0:
        raise APIError(400, "the prompt is empty", param=param, code="invalid_value")
    n_ctx = state.n_ctx
    room = n_ctx - int(ids.size)
    if room < 1:
        raise APIError(400, f"this model's context holds {n_ctx} tokens; the prompt has {ids.size} tokens and at "
                       "least one more is needed to answer. Shorten the prompt (or start the server with a larger "
                       "--n-ctx)", param=param, code="context_length_exceeded")
    strategy = req.power.strategy if req.power is not None else None
    lane = _lane(session, strategy)  # (a 400 for a strategy the server does not run, before the request waits)
    try:
        lane.request_k(req.spec_draft_max)  # (a 400 before the request waits, as for the strategy)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="spec_draft_max", code="invalid_value") from None
    prediction = None
    if req.prediction is not None:  # tokenized once, here: too many tokens is a 400 before the request waits
        try:
            prediction = Prediction.from_text(req.prediction.text, session.opened.tokenizer, n_ctx)
        except ConfigError as exc:
            raise APIError(400, f"invalid value for 'prediction': {exc}", param="prediction",
                           code="invalid_value") from None
    # unset: the rest of the context (OpenAI's default, llama-server's n_predict = -1), never more than
    # the operator's cap (--max-tokens) or the room the context has left
    cap = state.options.max_tokens
    max_tokens = min(limit if limit is not None else room, cap if cap is not None else room, room)
    job = Job(prompt=ids, max_tokens=max_tokens, stop=req.stops, sampling=req.sampling(),
              top_logprobs=top_logprobs, stream=req.stream, prefix="chatcmpl-" if kind == "chat.completion" else "cmpl-",
              target_only=state.auditor.target_only is not None, tenant=_tenant(state.options, req.user),
              constraint=constraint, strategy=strategy, draft_max=req.spec_draft_max, prediction=prediction)
    tools = structure.tools if structure is not None and structure.tools is not None and structure.tools.active \
        else None
    return Prepared(kind=kind, job=job, req=req, prompt_tokens=int(ids.size), tools=tools,
                    preserved=constraint.preserved if constraint is not None else NO_PRESERVED)


def _lane(session: Session, strategy: str | None) -> Lane:
    """The lane (strategy) a request asking for ``strategy`` runs in; a 400 naming ``power.strategy``
    for one the server was not started with."""
    try:
        return session.lane(strategy)
    except ConfigError:
        raise APIError(400, f"strategy {strategy!r} is not one this server runs; it runs "
                       f"{', '.join(session.strategy_names)} (power serve --mode a,b,c starts it with several; "
                       "GET /v1/models lists them)", param="power.strategy", code="strategy_not_available") from None


def _tenant(options: ServeOptions, user: str | None) -> str:
    """Whom a request runs for (config ``tenant``: whose saved prompt states it may restore): the API
    key it authenticated with (a digest of it, never the key), and within it the OpenAI ``user``
    field; without keys, the ``user`` field alone (none: the default tenant)."""
    parts = []
    if options.api_key is not None:
        parts.append("key:" + hashlib.sha256(options.api_key.encode()).hexdigest()[:16])
    if user:
        parts.append("user:" + user)
    return "/".join(parts)


def _shutting_down(why: str = "") -> APIError:
    return APIError(503, f"the server is shutting down{why}; retry on another instance", type="server_error",
                    code="shutting_down", headers={"Retry-After": "5"})


async def _wait_turn(state: ServerState, job: Job, ticket: Ticket[Session]) -> None:
    """Wait in the engine's queue until ``ticket`` is given a sequence (or its wait ends without one); a 503
    when the request's timeout passes first. The ticket leaves the queue when the wait is given up."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def ready_now() -> None:
        if not ready.done():
            ready.set_result(None)

    def wake() -> None:  # the thread that freed a sequence -> the event loop
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody waits
            loop.call_soon_threadsafe(ready_now)

    ticket.on_ready(wake)
    remaining = max(0.0, state.options.timeout - (time.perf_counter() - job.arrived))
    try:
        await asyncio.wait_for(asyncio.shield(ready), remaining)
    except (TimeoutError, asyncio.CancelledError) as exc:
        ticket.withdraw()  # leaves the queue; a sequence handed over meanwhile goes to the next one
        if isinstance(exc, TimeoutError):
            raise APIError(503, "server busy: the request's timeout passed while it waited for a slot; "
                           "retry later", type="server_error", code="server_overloaded",
                           headers={"Retry-After": "1"}) from None
        raise


async def _respond(request: Request, state: ServerState, prepared: Prepared) -> Response:
    """The request admitted to a sequence of the engine (at once, or after its turn in the engine's queue:
    a 503 when the queue is full or the request's timeout passes first), started there, and answered: whole,
    or streamed. On shared passes its rounds run in the driver, which hands each commit straight to the
    event loop (:class:`Following`: no thread waits for the request; a worker begins it, for its
    ``power_request_start`` observers); on a sequence that decodes alone a worker reads them from the
    compute thread (:func:`run_job`). Its timeout stops it; its receipt is kept and offered to the audit when
    it ends (:func:`_ended`)."""
    job, engine = prepared.job, state.engine
    if state.draining:
        raise _shutting_down()
    # a request whose strategy reuses no prompt (its proposer reads the target's hidden states) has no
    # use for the sequence holding most of its prompt: it takes the one freed longest ago, and leaves that
    reuses = state.sessions[0].lane(job.strategy).reuses_prompts
    try:
        ticket = engine.reserve(prompt=job.prompt if reuses else None, tenant=job.tenant)
    except Overloaded as exc:
        raise APIError(503, f"server busy: {exc} (--queue); retry later", type="server_error",
                       code="server_overloaded", headers={"Retry-After": "1"}) from None
    except SessionBusy as exc:  # the engine is closing
        raise _shutting_down(f" ({exc})") from None
    if not ticket.ready:
        await _wait_turn(state, job, ticket)
    session = ticket.session
    if session is None:  # the wait ended without a sequence: the engine closed, failed, or they were lost
        if isinstance(ticket.failure, RuntimeFault):  # StateLost, or the engine's driver failed
            raise from_power_error(ticket.failure)
        raise _shutting_down()
    state.metrics.prompt_tokens.inc(int(job.prompt.size))
    try:
        gen = session.start(job.prompt, cancel=job.cancel, max_tokens=job.max_tokens, stop=job.stop,
                            sampling=job.sampling, logprobs=job.top_logprobs, target_only=job.target_only,
                            tenant=job.tenant, constraint=job.constraint, strategy=job.strategy,
                            prediction=job.prediction, draft_max=job.draft_max)
    except BaseException:
        engine.release(session)  # refused before it ran: the sequence goes back at once
        raise
    stream = StreamAnswer(state, prepared, session, gen) if job.stream else None
    post = stream.post if stream is not None else None
    loop = asyncio.get_running_loop()
    if engine.runtime is not None:
        following = Following(state.executor, job, gen, state.metrics, post,
                              observed=session.plugins.observes_requests())
        following.start(engine)
        fut = following.outcome
    else:
        fut = loop.run_in_executor(state.executor, run_job, engine, gen, job, state.metrics, post)
    timer = loop.call_later(max(0.0, state.options.timeout - (time.perf_counter() - job.arrived)), job.stop_now,
                            "timeout")
    state.jobs[job] = fut
    fut.add_done_callback(functools.partial(_ended, state, job, timer))
    if stream is not None:
        return stream.response(fut)
    return await WholeAnswer(state, prepared, session).response(request, fut)


def _ended(state: ServerState, job: Job, timer: asyncio.TimerHandle, fut: asyncio.Future[Outcome]) -> None:
    """``job`` ended (the engine gave its sequence back): its receipt kept and offered to the audit."""
    timer.cancel()
    state.jobs.pop(job, None)
    if not fut.cancelled() and fut.exception() is None:
        out = fut.result()
        state.receipts.put(job.id, {"id": job.id, "object": "power.receipt", "cancel_reason": job.cancel_reason,
                                    "receipt": out.receipt}, out.receipt_bytes)  # rendered when asked for
        state.auditor.consider(job, out)


# -- endpoints ------------------------------------------------------------------------------------------
async def completions(request: Request) -> Response:
    state = _state(request)
    req: CompletionRequest = parse_request(CompletionRequest, await _json_body(request))
    prompt = req.prompt_value
    structure = req.structure()
    constraint = await _check_structure(state, structure)
    prepared = _prepare(state, req, np.asarray(prompt, dtype=np.int64) if isinstance(prompt, list) else prompt,
                        "prompt", req.max_tokens, req.top_logprobs, "text_completion", structure, constraint)
    return await _respond(request, state, prepared)


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    req: ChatRequest = parse_request(ChatRequest, await _json_body(request))
    session = state.sessions[0]
    structure = req.structure(state.tool_format)
    messages = req.template_messages()
    constraint = await _check_structure(state, structure)
    template: ChatTemplate | None = state.chat_template
    extra: dict[str, Any] = {}
    if structure.tools is not None and structure.tools.active:
        template = state.tool_template
        if template is None or not template_renders_tools(template.source):
            raise APIError(400, "this model's chat template does not render tools, so the model would never see "
                           "them; start the server with --chat-template FILE whose template does (e.g. "
                           "docs/examples/hermes-tools.jinja), or send tool_choice \"none\"", param="tools",
                           code="unsupported_value")
        extra = structure.tools.template_vars()
    try:
        ids = session.chat_prompt(messages, chat_template=template, **extra)
    except PowerError as exc:
        err = from_power_error(exc)
        raise APIError(err.status, err.message, type=err.type, param="messages", code=err.code) from None
    prepared = _prepare(state, req, ids, "messages", req.limit, req.top_logprobs_n, "chat.completion", structure,
                        constraint)
    return await _respond(request, state, prepared)


async def models(request: Request) -> Response:
    state = _state(request)
    s = state.sessions[0]
    strategies = [{"name": lane.mode, "strategy": lane.name, "kind": lane.selection.strategy.kind,
                   "draft_max": lane.config.draft_max if lane.proposer is not None else 0,
                   "selection": lane.selection.reason} for lane in s.lanes]
    return JSONResponse({"object": "list", "data": [{
        "id": state.options.model_name, "object": "model", "created": state.created, "owned_by": "power",
        "power": {"strategy": s.selection.strategy.name, "selection": s.selection.reason,
                  # what a request may ask for (power.strategy): the first is the default
                  "strategies": strategies, "auto": {"name": s.lane("auto").mode, "selection": s.auto_reason},
                  "numerics": s.config.numerics, "n_ctx": state.n_ctx, "parallel": len(state.sessions),
                  "shared_passes": state.engine.runtime is not None, "memory": state.memory,
                  "model_path": s.opened.model_path}}]})


async def receipt(request: Request) -> Response:
    state = _state(request)
    rid = str(request.path_params["rid"])
    found = state.receipts.get(rid)
    if found is None:
        budget = f"{state.options.receipts_bytes / (1 << 20):g} MiB"
        size = state.receipts.too_large(rid)
        if size is not None:
            raise APIError(410, f"receipt {rid!r} was not kept: its {size} bytes exceed the whole receipt budget "
                           f"({budget}, --receipts-ram)", param="id", code="receipt_too_large")
        raise APIError(404, f"no receipt {rid!r}: unknown, or older than the {state.options.receipts} most recent "
                       f"requests or the {budget} of receipts kept (--receipts, --receipts-ram)", param="id",
                       code="receipt_not_found")
    return JSONResponse({**found, "receipt": found["receipt"].to_dict()})


async def health(request: Request) -> Response:
    state = _state(request)
    if state.engine.failure is not None:  # its driver died: every request fails, so send none here
        return JSONResponse({"status": "failed", "error": state.engine.failure}, status_code=503)
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    running = state.engine.busy
    return JSONResponse({"status": "ok", "slots_idle": len(state.sessions) - running,
                         "slots_processing": running, "requests_waiting": state.engine.waiting,
                         "target_only": state.auditor.target_only})


async def metrics(request: Request) -> Response:
    state = _state(request)
    state.metrics.cache(state.sessions[0].prompt_cache)
    state.metrics.receipts(state.receipts)
    state.metrics.stores(proposer_stores(lane.proposer for s in state.sessions for lane in s.lanes))
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# -- the application ------------------------------------------------------------------------------------
def create_app(engine: Engine[Session], options: ServeOptions) -> Starlette:
    """The ASGI app over ``engine`` (its sequences are the slots; it admits and runs every request).
    Closing the engine is the caller's job, after the app has shut down (its lifespan waits for
    in-flight decodes first)."""
    metrics_ = Metrics()
    metrics_.running.set_function(lambda: engine.busy)
    metrics_.waiting.set_function(lambda: engine.waiting)
    receipts = ReceiptStore(options.receipts, options.receipts_bytes)
    executor = ThreadPoolExecutor(max_workers=len(engine.sessions), thread_name_prefix="power-slot")
    auditor = Auditor(rate=options.audit_rate, engine=engine, metrics=metrics_, receipts=receipts, executor=executor,
                      require_identical=engine.sessions[0].config.require_identical)
    # read before any request runs (the contexts are sized: llama.cpp reserves the widest pass's buffers)
    read_memory = engine.sessions[0].opened.target.capabilities.memory
    memory = read_memory() if read_memory is not None else None
    if memory is not None:
        metrics_.set_memory(memory)
        log.info("serve.memory", **{k: v for k, v in memory.items()})
    state = ServerState(options=options, engine=engine, metrics=metrics_, receipts=receipts, executor=executor,
                        auditor=auditor, memory=memory)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        audits = auditor.start()
        yield
        if audits is not None:
            audits.cancel()
        if auditor.running is not None:
            auditor.running.cancel()
        # uvicorn has stopped serving (in-flight requests finished or were cancelled): stop what still
        # decodes and wait for the workers, so every session is idle when the caller closes it
        state.draining = True
        for job in list(state.jobs):
            job.stop_now("shutdown")
        # the requests end (on shared passes no thread waits for them: their outcomes do), then the workers
        await asyncio.gather(*state.jobs.values(), return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(None, functools.partial(state.executor.shutdown, wait=True))

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/receipts/{rid}", receipt, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        middleware=[Middleware(Guard, options=options)],
        exception_handlers={HTTPException: _http_exception, APIError: _api_error, PowerError: _power_error,
                            Exception: _unexpected},
        lifespan=lifespan,
    )
    app.state.power = state
    return app
