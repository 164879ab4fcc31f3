"""``power serve``: an OpenAI-compatible HTTP server over Power sessions (``pip install 'power-core[serve]'``).

:func:`open_sessions` loads the model (every startup error is raised here, before any port is
bound); :func:`serve` binds, serves until SIGTERM/SIGINT, drains and returns. See ``docs/serving.md``.
"""

from __future__ import annotations

import gc
import ipaddress
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import attrs

from power_core.config import PowerConfig
from power_core.engine import Engine
from power_core.errors import ConfigError
from power_core.logs import get_logger
from power_core.serve.app import create_app
from power_core.serve.state import ServeOptions
from power_core.session import Session

log = get_logger(__name__)

__all__ = ["ServeOptions", "Slots", "create_app", "open_sessions", "serve", "is_loopback"]


@attrs.define(eq=False)
class Slots:
    """The engine requests run on: sequences of one target sharing its passes, or independent
    sessions (one slot, ``--no-batch``, or a strategy/backend that cannot share passes: ``why``)."""

    engine: Engine[Session]
    why: str = ""

    @property
    def sessions(self) -> tuple[Session, ...]:
        return self.engine.sessions

    @property
    def shared(self) -> bool:
        return self.engine.runtime is not None

    def close(self) -> None:
        self.engine.close()


def open_sessions(config: PowerConfig, parallel: int, *, batch: bool = True, queue: int | None = None,
                  **open_kwargs: Any) -> Slots:
    """``parallel`` slots on one model, behind one engine that admits requests (at most ``queue``
    waiting). With ``batch`` and more than one slot, they are sequences of one target whose passes
    the engine shares between requests; when the backend or strategy cannot share passes,
    independent sessions (sharing the weights) and the reason. ``open_kwargs`` are
    :meth:`Session.open`'s (``strategies``: every slot runs a request of any of them); ``prompt_cache`` (a :class:`~power_core.memory.PromptCache`, ``power serve
    --cache-ram``) is every slot's store of saved prompt states. Nothing stays open if a step fails."""
    why = "one slot" if parallel == 1 else "--no-batch"
    if batch and parallel > 1:
        try:
            return Slots(engine=Session.open_engine(parallel, config, queue_max=queue, **open_kwargs))
        except ConfigError as exc:
            if exc.key != "parallel":
                raise
            why = str(exc)
    sessions: list[Session] = []
    try:
        for _ in range(parallel):
            sessions.append(Session.open(config, **open_kwargs))
    except BaseException:
        for s in sessions:
            s.close()
        raise
    if parallel > 1:  # every receipt says why its request did not share target passes
        for s in sessions:
            s.opened.backend_info["batch"] = {"shared_passes": 0, "independent_because": why}
    return Slots(engine=Session.independent_engine(sessions, queue_max=queue), why=why)


def _strategies(session: Session) -> str:
    """The announce line's strategies: ``strategy 'mtp'``, or ``strategies 'mtp' (default), 'suffix', 'off'``."""
    if len(session.lanes) == 1:
        return f"strategy {session.selection.strategy.name!r}"
    names = [repr(lane.name) if lane.mode == lane.name else f"{lane.mode!r} ({lane.name!r})" for lane in session.lanes]
    return f"strategies {names[0]} (default), {', '.join(names[1:])}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        raise ConfigError("port", f"{host}:{port}", "an address this machine can listen on", str(exc)) from None
    return sock


def freeze_heap() -> int:
    """Move every object alive now (the model's tables, the tokenizer, templates, the app; what a server
    holds until it stops) out of the cyclic garbage collector's reach, after a collection: its full
    collections then scan only what requests made since. Unfrozen, one came some 250 requests into serving
    the tiny MTP fixture and took 46-48 ms, on whichever thread allocated, with the GIL held: a stall of the
    driver's pass for every request decoding (docs/evidence/bench_drafts/served-2026-12-07). vLLM and SGLang
    freeze after warm-up too.
    Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("serve.heap_frozen", objects=frozen)
    return frozen


def serve(slots: Slots, options: ServeOptions, host: str = "127.0.0.1", port: int = 8080,
          *, log_level: str = "warning", announce: Callable[[str], None] | None = None) -> None:
    """Serve until told to stop; then refuse new requests, let in-flight ones finish (up to
    ``options.drain_timeout``), cancel the rest with receipts, and return. The caller closes ``slots``."""
    import uvicorn

    sessions = slots.sessions
    app = create_app(slots.engine, options)
    state = app.state.power

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            state.draining = True  # new requests get 503 while in-flight ones finish
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            freeze_heap()

    sock = _bind(host, port)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    # http/loop "auto" (uvicorn's default): httptools and uvloop, which the serve extra installs
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=max(1, round(options.drain_timeout)),
                            timeout_keep_alive=5)
    server = Server(config)
    (announce or (lambda line: print(line, file=sys.stderr, flush=True)))(
        f"power serve: listening on http://{shown}:{bound[1]} (model {options.model_name!r}, "
        f"{len(sessions)} slot{'s' if len(sessions) != 1 else ''}, "
        f"{'shared target passes' if slots.shared else 'independent: ' + slots.why}, "
        f"{_strategies(sessions[0])})")
    # uvicorn re-raises the signal that stopped it once it has shut down; the drain already handled it,
    # so the re-raised signal is a no-op here and the process exits normally (status 0)
    drained = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        server.run(sockets=[sock])
    finally:
        gc.unfreeze()
        sock.close()
        for sig, handler in drained.items():
            signal.signal(sig, handler)
