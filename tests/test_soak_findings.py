"""Defects the chaos soak (``tests/soak/``) found in ``power serve``, each pinned by a focused test."""

from __future__ import annotations

import asyncio
import json
import time

from power_core.serve import ServeOptions, create_app
from power_core.spec import hookimpl
from tests.helpers import open_session


class _SlowRounds:
    """An observer that makes every verify phase take 20 ms (a stream that is still decoding)."""

    __name__ = "slow-rounds"

    @hookimpl(wrapper=True)
    def power_txn_phase(self, phase, round_index):
        if phase == "verify":
            time.sleep(0.02)
        result = yield
        return result


def _asgi_stream_then_disconnect(app, body: dict, settle=None, spec: str = "2.3") -> tuple[list[str], int]:
    """POST ``body`` to ``/v1/completions`` on the ASGI ``app`` in process, read the stream's first
    event, then go away (``http.disconnect``); the events read, and the tasks still pending on an
    ``asyncio.Queue`` once the response has ended. ``settle``: a coroutine function awaited on the same
    loop once the response has ended (e.g. for the request's outcome). ``spec`` "2.4": every write after
    the first event raises ``OSError``, as an ASGI 2.4 server's ``send`` does once its client has gone."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1", "method": "POST",
             "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}

    async def go() -> tuple[list[str], int]:
        first = asyncio.Event()
        events: list[str] = []
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await first.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if spec == "2.4" and first.is_set():
                raise OSError("the client has gone")
            if message["type"] == "http.response.body" and message.get("body"):
                events.append(message["body"].decode())
                first.set()

        await asyncio.wait_for(app(scope, receive, send), 30)
        if settle is not None:
            await settle()
        await asyncio.sleep(0.2)  # (a cancelled task finishes at the loop's next turns)
        me = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not me and not t.done() and "Queue.get" in repr(t)]
        return events, len(pending)

    return asyncio.run(go())


def test_a_stream_whose_client_leaves_leaves_no_task_pending():
    """A client that closes a stream while the server waits for the next delta: the wait for it is
    cancelled with the stream, not left pending on a queue nobody reads (the soak's server log had a
    ``Task was destroyed but it is pending!`` error for each such client, when the task was collected)."""
    with open_session("reference", "off", None, _SlowRounds()) as s:
        app = create_app(s.driver(), ServeOptions(model_name="m"))
        events, pending = _asgi_stream_then_disconnect(
            app, {"model": "m", "prompt": "hello there", "max_tokens": 200, "stream": True})
        app.state.power.executor.shutdown(wait=True)
    assert events and events[0].startswith("data: ")  # it streamed before the client left
    assert pending == 0
