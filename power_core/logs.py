"""Power's events: structlog calls delivered through the standard library's :mod:`logging`.

A library must not decide where its logs go. Every Power module logs through :func:`get_logger`,
which binds a structlog ``stdlib.BoundLogger`` to ``logging.getLogger(name)`` with its own small
processor chain. Nothing here touches structlog's global configuration, so a host's
``structlog.configure`` is neither needed nor disturbed, and the host's ``logging`` configuration
alone decides what is shown:

* nothing configured: Power prints nothing (each top-level package logger, ``power_core``,
  ``power_native``, ..., carries a :class:`logging.NullHandler`, so Python's "last resort" handler
  never prints Power's warnings to stderr);
* ``logging.basicConfig(level=logging.INFO)``: one ``request.end`` line per request;
* ``logging.getLogger("power_core").setLevel(logging.DEBUG)``: per-round ``txn.commit`` events.

A record's message is ``"event key=value ..."``; the structured event (a dict) travels in the
record's ``power_event`` attribute for JSON formatters. Per-round events are guarded with
``log.isEnabledFor(logging.DEBUG)`` so that disabled debug logging builds nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import MutableMapping
from typing import Any

import structlog

__all__ = ["get_logger", "render_event"]

_lock = threading.Lock()
_quiet: set[str] = set()


def render_event(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> dict[str, Any]:
    """Last processor: turn the event into ``logging`` keyword arguments (message + ``extra``)."""
    exc_info = event_dict.pop("exc_info", None)
    event = event_dict.get("event", "")
    parts = [str(event)] + [f"{k}={v!r}" for k, v in event_dict.items() if k != "event"]
    out: dict[str, Any] = {"msg": " ".join(parts), "extra": {"power_event": event_dict}}
    if exc_info:
        out["exc_info"] = exc_info
    return out


_PROCESSORS: list[Any] = [structlog.stdlib.filter_by_level, render_event]


def _silence_by_default(name: str) -> None:
    top = name.partition(".")[0]
    if top in _quiet:
        return
    with _lock:
        if top not in _quiet:
            logging.getLogger(top).addHandler(logging.NullHandler())
            _quiet.add(top)


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger for module ``name`` whose events go to ``logging.getLogger(name)``.

    Call it at import time (``log = get_logger(__name__)``); it never configures structlog
    globally. Plugins and backends should use it too, so that one ``logging`` configuration governs
    every Power package.
    """
    _silence_by_default(name)
    return structlog.stdlib.BoundLogger(logging.getLogger(name), processors=_PROCESSORS, context={})
