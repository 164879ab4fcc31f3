"""One request's answer in OpenAI's response shapes, one class per kind: :class:`WholeAnswer` (one JSON body
once the decode has ended) and :class:`StreamAnswer` (its text as server-sent events while it decodes,
``data: [DONE]`` last).

Every answer carries the extension object ``power`` (the last chunk when streaming): the receipt's summary
(the strategy that ran included) and the id under which ``/v1/receipts/{id}`` returns the full receipt.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

import attrs
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from power_core.constraint import NO_PRESERVED, PreservedTokens
from power_core.errors import PowerError
from power_core.generation import Generation
from power_core.logs import get_logger
from power_core.passes import Commit
from power_core.runtime import TokenArray
from power_core.serve.errors import APIError, from_power_error
from power_core.serve.jobs import Delta, Job, Outcome
from power_core.serve.protocol import ChatRequest, CompletionRequest
from power_core.serve.state import ServerState
from power_core.session import Session
from power_core.tools import ParsedDelta, ToolCallParser, ToolPlan
from power_core.transaction import TokenLogprob

__all__ = ["Prepared", "StreamAnswer", "WholeAnswer", "finish_reason"]

log = get_logger(__name__)

#: a tokenizer's decode: token ids to text
Decode = Callable[[TokenArray], str]


@attrs.frozen
class Prepared:
    """A request parsed and checked, ready to be admitted: its job, and what its answer needs."""

    kind: str  # "text_completion" | "chat.completion"
    job: Job
    req: ChatRequest | CompletionRequest
    prompt_tokens: int
    #: the request's tools (``None``: none, or ``tool_choice`` ``none``): its output is parsed for calls
    tools: ToolPlan | None = None
    #: the control tokens its constraint preserves (tool-call markers): its logprobs show them as text
    preserved: PreservedTokens = NO_PRESERVED


# -- the bodies' parts ----------------------------------------------------------------------------------
def finish_reason(power_finish: str | None, status: str) -> str | None:
    """OpenAI's finish reason for the transaction's: a stop token or string -> ``stop``; the token
    limit or the context -> ``length``; a cancelled request (timeout, drain) -> ``length`` too (the
    ``power`` extension's ``status`` says it was cancelled)."""
    if power_finish == "stop":
        return "stop"
    if power_finish in ("max_tokens", "context") or status == "cancelled":
        return "length"
    return None


def _piece(decode: Decode, token: int) -> str:
    return decode(np.array([token], dtype=np.int32))


def chat_logprobs(items: Sequence[TokenLogprob], decode: Decode) -> dict[str, Any]:
    """Chat's ``choices[0].logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        piece = _piece(decode, token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in items], "refusal": None}


def completion_logprobs(items: Sequence[TokenLogprob], decode: Decode, offset: int = 0) -> dict[str, Any]:
    """Completions' ``choices[0].logprobs``: parallel lists of tokens, their log-probabilities,
    the top alternatives (a mapping per token) and each token's character offset in the text."""
    tokens, offsets = [], []
    for lp in items:
        piece = _piece(decode, lp.token)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{_piece(decode, t): v for t, v in lp.top} for lp in items],
            "text_offset": offsets}


def _power_extension(job: Job, outcome: Outcome) -> dict[str, Any]:
    r = outcome.receipt
    s = r.summary()
    return {"receipt_id": job.id, "status": r.status, "cancel_reason": job.cancel_reason,
            "strategy": r.strategy["name"], "numerics": r.config.get("numerics"), "acceptance": s["acceptance"],
            "tokens_per_target_pass": s["verified_tokens_per_pass"], "rounds": s["rounds"],
            "proposed": s["proposed"], "accepted": s["accepted"], "prompt_reused": r.prompt_reused,
            "output_tokens": r.output_tokens,
            "output_sha256": r.output_sha256, "receipt_sha256": r.digest(),
            "decode_tok_s": r.timings.get("decode_tok_s")}


def _usage(prepared: Prepared, outcome: Outcome) -> dict[str, Any]:
    n = len(outcome.tokens)
    usage: dict[str, Any] = {"prompt_tokens": prepared.prompt_tokens, "completion_tokens": n,
                             "total_tokens": prepared.prompt_tokens + n}
    predicted = outcome.receipt.prediction
    if predicted is not None:  # OpenAI's counts of a prediction (docs/serving.md#predicted-outputs)
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": predicted["accepted"],
                                              "rejected_prediction_tokens": predicted["rejected"]}
    return usage


def around_text(render: Callable[[str], str]) -> tuple[str, str] | None:
    """``render``'s JSON (a chunk of one text) as what comes before and after its text: for every text ``t``,
    ``before + encode_basestring_ascii(t) + after == render(t)`` (the JSON string of ``t`` is what
    ``json.dumps`` writes for it). ``None`` where the rest of the JSON spells the probe (the text is then not
    where the split would put it)."""
    probe = "\x00\x01\x02"
    parts = render(probe).split(encode_basestring_ascii(probe))
    return (parts[0], parts[1]) if len(parts) == 2 else None


# -- the outcome ----------------------------------------------------------------------------------------
async def _outcome(fut: asyncio.Future[Outcome]) -> Outcome:
    """The request's outcome; a request the engine or the session refused to begin (a typed error) is
    that error, and a defect is a 500 without its details (logged), also where a stream has begun."""
    try:
        return await asyncio.shield(fut)
    except PowerError as exc:
        raise from_power_error(exc) from None
    except Exception as exc:
        log.error("serve.request_crashed", exc_info=exc)
        raise from_power_error(exc) from None


def _raise_failure(outcome: Outcome) -> None:
    """A request that failed (not one that was cancelled) answers with its error."""
    if outcome.error is not None and outcome.receipt.status == "failed":
        raise from_power_error(outcome.error)


async def _watch_disconnect(receive: Receive, job: Job, fut: asyncio.Future[Outcome]) -> None:
    """Stop the job when its client goes away: the body is read, so the server's next message for this
    request is ``http.disconnect`` (awaited, not polled; cancelled once the outcome is there)."""
    while not fut.done():
        if (await receive())["type"] == "http.disconnect":
            job.stop_now("disconnected")
            return


# -- the answers ----------------------------------------------------------------------------------------
class _Answer:
    """What both kinds of answer know: the request, when it was answered, and the tokenizer's decode."""

    def __init__(self, state: ServerState, prepared: Prepared, session: Session) -> None:
        self.state = state
        self.prepared = prepared
        self.job = prepared.job
        self.chat = prepared.kind == "chat.completion"
        self.created = int(time.time())
        assert session.opened.tokenizer is not None  # (a server's model has one: it checked at start)
        #: a token's text as the output shows it (:class:`~power_core.generation.Generation`'s detokenize)
        self.decode: Decode = prepared.preserved.decoder(session.opened.tokenizer.decode)


class WholeAnswer(_Answer):
    """A whole answer: the decode runs to its end (stopped when the client goes away), then one JSON body."""

    async def response(self, request: Request, fut: asyncio.Future[Outcome]) -> JSONResponse:
        """The body once ``fut`` (the request's decode) has its outcome; the request's error where it failed."""
        job = self.job
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, job, fut))
        try:
            outcome = await _outcome(fut)
        except asyncio.CancelledError:  # the server stopped waiting (drain timeout): stop the decode too
            job.stop_now("shutdown")
            raise
        finally:
            watcher.cancel()
        _raise_failure(outcome)
        return JSONResponse(self.body(outcome))

    def body(self, outcome: Outcome) -> dict[str, Any]:
        """OpenAI's completion (or chat completion) object of ``outcome``, with the ``power`` extension."""
        job, prepared = self.job, self.prepared
        fr = finish_reason(outcome.receipt.finish_reason, outcome.receipt.status)
        if self.chat:
            lp = chat_logprobs(outcome.logprobs, self.decode) if job.top_logprobs is not None else None
            message: dict[str, Any] = {"role": "assistant", "content": outcome.text, "refusal": None}
            if prepared.tools is not None:
                parsed = prepared.tools.parse(outcome.text)
                message["content"] = parsed.content
                if parsed.tool_calls:
                    message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
                    fr = "tool_calls" if fr == "stop" else fr
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": lp, "finish_reason": fr}
        else:
            lp = completion_logprobs(outcome.logprobs, self.decode) if job.top_logprobs is not None else None
            choice = {"index": 0, "text": outcome.text, "logprobs": lp, "finish_reason": fr}
        return {"id": job.id, "object": prepared.kind, "created": self.created, "model": self.state.options.model_name,
                "choices": [choice], "usage": _usage(prepared, outcome), "power": _power_extension(job, outcome)}


class _EventStream(Response):
    """The server-sent events of one stream, written straight to the server: each event one ``data:`` line
    (nothing between the events and the socket but the send). A client that goes away stops the decode at once
    (its ``http.disconnect``, awaited beside the stream), and the stream ends quietly: a server of ASGI 2.4
    raises at the next write (:class:`OSError`), an older one drops the writes. Its events are closed at once
    either way (their request stopped), not when the collector finds them."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], headers: Mapping[str, str], job: Job,
                 fut: asyncio.Future[Outcome]) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self.events, self.job, self.fut = events, job, fut

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_watch_disconnect(receive, self.job, self.fut))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client has gone away (an ASGI 2.4 server raises at the next write)
            pass
        finally:
            watcher.cancel()
            await self.events.aclose()


class StreamAnswer(_Answer):
    """A streamed answer: a chunk per commit that adds text or logprobs, as the request's rounds close (the
    commits waiting when the loop reads leave as one; a chat stream opens with the assistant's role;
    tool-call markup never reaches the client), then the finish
    reason, the usage where asked for, the ``power`` object and ``[DONE]``. An error once the stream has
    begun is its last event. Its text comes from the request's own assembler (:meth:`Generation.take_text`:
    UTF-8 hold-back, stop strings, the tool-call markers its constraint preserves shown, as the tool parser
    reads them), on the event loop."""

    def __init__(self, state: ServerState, prepared: Prepared, session: Session, gen: Generation) -> None:
        super().__init__(state, prepared, session)
        self.loop = asyncio.get_running_loop()
        self.gen = gen
        #: the request's commits in order, then ``None``: its decode ended (:meth:`events` reads this alone). The
        #: driver appends; the loop is woken once for every commit that arrives while it waits (:meth:`post`)
        self.arrived: deque[Commit | None] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the reader, waiting for a commit
        self._woken = False  # a wake is on its way to the loop: later commits ride along with it
        #: the committed tokens streamed so far (the commits' snapshot, never the request the driver changes)
        self.tokens: list[int] = []
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        #: the characters streamed so far (completions' logprobs count their offsets from it)
        self.offset = 0
        #: takes tool calls out of the text as it streams (the markup never reaches the client)
        self.calls: ToolCallParser | None = prepared.tools.parser() if prepared.tools is not None else None
        #: a text delta's chunk as the JSON before and after its text (the general path's own output, split
        #: once), where the stream's chunks carry neither logprobs nor tool calls: the hot path of a stream
        self.plain = self._plain_template()

    def post(self, commit: Commit) -> None:
        """Hands ``commit`` from the thread that drives the request (the shared passes' driver, or the
        worker of a solo sequence) to the event loop: it joins :attr:`arrived`, and the loop is woken unless a
        wake is already on its way (that wake runs after this append, so the reader finds the commit)."""
        self.arrived.append(commit)
        if self._woken:
            return
        self._woken = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is gone (shutdown): nobody is reading
            pass

    def _wake(self) -> None:
        """On the loop: the reader (if it waits) reads what arrived; a commit appended after this wakes again."""
        self._woken = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def response(self, fut: asyncio.Future[Outcome]) -> Response:
        """The SSE response of the decode ``fut``, whose commits arrive through :meth:`post`."""
        return _EventStream(self.events(fut), {"X-Request-Id": self.job.id, "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"}, self.job, fut)

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> str:
        body = {"id": self.job.id, "object": self.object, "created": self.created,
                "model": self.state.options.model_name, "choices": [choice] if choice is not None else [], **extra}
        return json.dumps(body, separators=(",", ":"))

    def _plain_template(self) -> tuple[str, str] | None:
        if self.job.top_logprobs is not None or self.calls is not None:
            return None
        return around_text(lambda text: self._chunk(self._delta_choice(Delta(text))))

    def _delta_choice(self, d: Delta) -> dict[str, Any] | None:
        top = self.job.top_logprobs is not None
        if self.chat:
            lp = chat_logprobs(d.logprobs, self.decode) if top else None
            if self.calls is None:
                return {"index": 0, "delta": {"content": d.text}, "logprobs": lp, "finish_reason": None}
            return self._tool_choice(self.calls.feed(d.text), lp)
        lp = completion_logprobs(d.logprobs, self.decode, self.offset) if top else None
        return {"index": 0, "text": d.text, "logprobs": lp, "finish_reason": None}

    @staticmethod
    def _tool_choice(parsed: ParsedDelta, lp: Any = None) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        if not delta and lp is None:
            return None  # markup, or text held back until it is resolved
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": None}

    def _chunks(self, d: Delta) -> list[str]:
        if self.plain is not None:
            return [self.plain[0] + encode_basestring_ascii(d.text) + self.plain[1]]
        choice = self._delta_choice(d)
        self.offset += len(d.text)
        return [self._chunk(choice)] if choice is not None else []

    def _commit(self, commits: list[Commit]) -> list[str]:
        """The chunk of ``commits`` (in order): the text they add (held back while it may still change) and
        their logprobs."""
        lps: tuple[TokenLogprob, ...] = ()
        for commit in commits:
            self.tokens.extend(commit.tokens)
            lps += commit.logprobs
        text = self.gen.take_text(self.tokens, final=commits[-1].finished)
        return self._chunks(Delta(text, lps)) if text or lps else []

    def _rest(self, outcome: Outcome) -> list[str]:
        """The chunk of what the request's end releases: the text held back, and logprobs not sent yet."""
        text = self.gen.take_text(outcome.tokens, final=True)
        lps = outcome.logprobs[len(self.tokens):] if self.job.top_logprobs is not None else ()
        return self._chunks(Delta(text, lps)) if text or lps else []

    async def events(self, fut: asyncio.Future[Outcome]) -> AsyncGenerator[str, None]:
        """The stream's events: its deltas as they arrive, then how it ended. The end joins :attr:`arrived`
        when ``fut`` completes, behind every commit (the thread that drives the request appends its commits
        before its end reaches the loop), so waiting for :attr:`arrived` is all the waiting there is. Commits
        that arrived while the loop was busy (other requests' chunks, a slow client) leave as one chunk: the
        same text and logprobs in fewer events, so a loop that falls behind the driver catches up instead of
        writing ever more events per round."""
        arrived = self.arrived

        def end(_: object) -> None:
            arrived.append(None)
            self._wake()

        fut.add_done_callback(end)
        try:
            if self.chat:
                yield self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
            ended = False
            while not ended:
                while not arrived:
                    self._waiter = self.loop.create_future()
                    await self._waiter
                commits: list[Commit] = []
                while arrived:
                    if (commit := arrived.popleft()) is None:
                        ended = True
                        break
                    commits.append(commit)
                if commits:
                    for chunk in self._commit(commits):
                        yield chunk
            try:
                outcome = await _outcome(fut)
                for c in self._rest(outcome):
                    yield c
                _raise_failure(outcome)
            except APIError as exc:  # the stream has begun: the error is its last event
                yield json.dumps(exc.body())
                return
            fr = finish_reason(outcome.receipt.finish_reason, outcome.receipt.status)
            if self.calls is not None:
                held = self._tool_choice(self.calls.finish())
                if held is not None:
                    yield self._chunk(held)
                if self.calls.calls and fr == "stop":
                    fr = "tool_calls"
            ext = _power_extension(self.job, outcome)
            last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": fr} if self.chat else \
                {"index": 0, "text": "", "logprobs": None, "finish_reason": fr}
            if self.prepared.req.include_usage:
                yield self._chunk(last)
                yield self._chunk(None, usage=_usage(self.prepared, outcome), power=ext)
            else:
                yield self._chunk(last, power=ext)
            yield "[DONE]"
        finally:
            if not fut.done():  # the client went away (or the server is stopping) mid-stream
                self.job.stop_now("disconnected" if not self.state.draining else "shutdown")
