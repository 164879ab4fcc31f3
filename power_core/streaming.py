"""Streams: a request's committed text, delta by delta, with its receipt at the end.

``Session.stream(prompt)`` (and ``Session.chat_stream(messages)``) return a :class:`Stream`::

    with session.stream("Once upon a time", max_tokens=64) as stream:
        for delta in stream:          # str deltas, as rounds commit
            print(delta, end="", flush=True)
    print(stream.receipt.summary())   # set once the stream is exhausted (or ended by an error)

The deltas concatenate to exactly ``Result.text`` of the same request run with ``generate``: only
committed tokens are decoded, an incomplete UTF-8 character is held back until its last byte
arrives, and text that could still turn into a stop string is held back until it is resolved.

Nothing runs before the first ``next()``. While a stream is unfinished its session is busy (another
request raises :class:`~power_core.errors.SessionBusy`); leaving the loop early and closing the stream
(``close()``, the ``with`` block, or dropping the last reference) ends the request with status
``cancelled``. A stream interrupted by its cancel token raises
:class:`~power_core.errors.Cancelled`; ``stream.generation.stream()`` resumes from the last commit.
"""

from __future__ import annotations

import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from power_core.errors import SessionBusy

if TYPE_CHECKING:
    from power_core.receipt import Receipt

__all__ = ["Stream", "StreamSource"]

ResultT = TypeVar("ResultT")


class StreamSource(Protocol[ResultT]):
    """What a :class:`Stream` reads from: the request behind it (a
    :class:`~power_core.generation.Generation`, whose result type is :class:`~power_core.generation.Result`).

    A protocol, so that this module does not depend on the session that builds streams.
    """

    @property
    def receipt(self) -> Receipt | None:
        """The request's receipt once it ended, else ``None``."""
        ...

    def result(self) -> ResultT:
        """The finished request's result."""
        ...

    def stream(self) -> Stream[ResultT]:
        """Run (or resume) the request as a new stream."""
        ...


class Stream(Generic[ResultT]):
    """Iterator of committed text deltas of one request; ``receipt`` and ``result`` when it ended."""

    def __init__(self, generation: StreamSource[ResultT], deltas: Generator[str, None, None]) -> None:
        self.generation = generation
        self._deltas = deltas
        self._reading = threading.Lock()
        self._parts: list[str] = []
        self._result: ResultT | None = None

    def __iter__(self) -> Stream[ResultT]:
        return self

    def __next__(self) -> str:
        if not self._reading.acquire(blocking=False):
            raise SessionBusy("this stream is being read by another thread; read a stream from one thread")
        try:
            delta = next(self._deltas)
        except StopIteration:
            self._result = self.generation.result()
            raise
        finally:
            self._reading.release()
        self._parts.append(delta)
        return delta

    def close(self) -> None:
        """End the request now (status ``cancelled`` if it had not finished); committed tokens stay."""
        self._deltas.close()

    def __enter__(self) -> Stream[ResultT]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def text(self) -> str:
        """The text handed out so far."""
        return "".join(self._parts)

    @property
    def receipt(self) -> Receipt | None:
        """The request's receipt once it ended (exhausted, failed, cancelled or closed), else ``None``."""
        return self.generation.receipt

    @property
    def result(self) -> ResultT | None:
        """Tokens, text and receipt once the stream is exhausted, else ``None``."""
        return self._result
