"""What a running ``power serve`` holds: the operator's options (:class:`ServeOptions`) and the
server's state every request reads (:class:`ServerState`: the engine, metrics, receipts, templates).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from power_core.chat import ChatTemplate, template_for
from power_core.engine import Engine
from power_core.errors import ConfigError
from power_core.serve.audit import Auditor
from power_core.serve.jobs import Job, Metrics, Outcome, ReceiptStore
from power_core.session import Session
from power_core.tools import HERMES, ToolFormat, detect_format

__all__ = ["ServeOptions", "ServerState"]


@attrs.frozen
class ServeOptions:
    """What the server decides beyond the sessions' configuration."""

    model_name: str
    queue: int = 16
    #: seconds from arrival to the end of a request (queue wait included); the request is cancelled then
    timeout: float = 600.0
    api_key: str | None = None
    max_body: int = 1 << 20
    receipts: int = 256
    #: bytes of receipts (their canonical JSON, which receipt_sha256 hashes) kept besides their count (``--receipts-ram`` MiB), the oldest dropped first;
    #: a receipt larger than all of it is not kept (asking for it answers ``410 receipt_too_large``)
    receipts_bytes: int = attrs.field(default=64 << 20, validator=attrs.validators.ge(1))
    #: the chat template instead of the GGUF's (``None``): a :class:`~power_core.chat.ChatTemplate`, or Jinja
    #: source, which the server builds into one (with the GGUF's BOS/EOS) and compiles once, when it is created
    chat_template: str | ChatTemplate | None = None
    #: seconds in-flight requests get to finish once the server is told to stop
    drain_timeout: float = 30.0
    #: the fraction of completed speculative requests the audit re-decodes target-only (0: off)
    audit_rate: float = 0.0
    #: the operator's cap on the tokens one answer writes (``--max-tokens``; llama-server's ``--n-predict``):
    #: a request's ``max_tokens`` above it, or none, gets it. ``None``: no cap; a request without
    #: ``max_tokens`` writes up to the rest of the context, as OpenAI's and llama-server's do
    max_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))


def _server_template(state: ServerState) -> ChatTemplate | None:
    """``options.chat_template`` built and compiled once per server (requests render it, never compile)."""
    source = state.options.chat_template
    if source is None:
        return None
    template = template_for(state.sessions[0].opened.model_path, source)
    template.compile()
    return template


def _tool_template(state: ServerState) -> ChatTemplate | None:
    """The template tools render through: the server's, else the GGUF's (``None``: the model has none)."""
    if state.chat_template is not None:
        return state.chat_template
    try:
        return template_for(state.sessions[0].opened.model_path, None)
    except ConfigError:
        return None


@attrs.define(eq=False)
class ServerState:
    """What every request of one server reads: its options, its engine and what it keeps."""

    options: ServeOptions
    #: the engine every request runs through: admission (its sequences and queue) and rounds
    engine: Engine[Session]
    metrics: Metrics
    receipts: ReceiptStore
    executor: ThreadPoolExecutor
    auditor: Auditor
    #: the bytes the model's contexts hold, read at startup (``TargetCapabilities.memory``; None: not reported)
    memory: Mapping[str, Any] | None = None
    #: the requests decoding now, and their outcomes (the drain waits for them)
    jobs: dict[Job, asyncio.Future[Outcome]] = attrs.field(factory=dict)
    draining: bool = False
    created: int = attrs.field(factory=lambda: int(time.time()))
    #: the chat template every chat request renders (``None``: each session's GGUF template)
    chat_template: ChatTemplate | None = attrs.field(default=attrs.Factory(_server_template, takes_self=True))
    #: the template requests with tools render (the server's or the GGUF's), and the tool-call format it declares
    tool_template: ChatTemplate | None = attrs.field(default=attrs.Factory(_tool_template, takes_self=True))

    @property
    def tool_format(self) -> ToolFormat:
        """The format the template declares where recognisable (:func:`~power_core.tools.detect_format`), else Hermes."""
        found = detect_format(self.tool_template.source) if self.tool_template is not None else None
        return found or HERMES

    @property
    def sessions(self) -> tuple[Session, ...]:
        return self.engine.sessions

    @property
    def n_ctx(self) -> int:
        return self.sessions[0].opened.target.capabilities.n_ctx
