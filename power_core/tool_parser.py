"""Tool calls out of model text, whole or as it streams, in any :class:`~power_core.tool_formats.ToolFormat`.

:class:`ToolCallParser` walks the format's call pattern over the text as it arrives: free text is
content until the format's trigger; then each literal of the pattern is matched (whitespace in it is
optional, and more whitespace where it has some is taken: models space their markup differently),
a name or id is a run of name characters, JSON arguments are scanned value by value (and streamed as
they are written), and XML parameters are collected until their closing text (a string parameter's
text is its value, anything else is read as JSON). A call written as one JSON object with its keys in
another order is parsed whole (``keys``). Text that cannot be a call of the format after its
trigger stays content; a call cut off before its name is dropped, one cut off later keeps what it has.
Streamed pieces join into exactly what the whole-text parse gives, however the text is split.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from power_core.tool_formats import Part, ToolFormat

__all__ = ["ParsedDelta", "ParsedMessage", "ToolCall", "ToolCallDelta", "ToolCallParser", "new_call_id", "parse"]


@attrs.frozen
class ToolCall:
    """A call the model made: ``arguments`` is JSON text, as OpenAI's ``function.arguments``."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class ToolCallDelta:
    """One piece of a streamed call, as OpenAI's ``delta.tool_calls[i]``: the first piece of a call
    has its ``id`` and ``name``; every piece may carry a fragment of ``arguments``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class ParsedDelta:
    """What a piece of output adds: content text and tool-call pieces (empty: nothing yet)."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@attrs.frozen
class ParsedMessage:
    """A whole answer: its content without the tool-call markup (``None`` when it made calls and said
    nothing else) and its calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]


def new_call_id(index: int) -> str:
    """A fresh OpenAI-style call id."""
    return "call_" + uuid.uuid4().hex[:24]


_OK, _MORE, _FAIL = 1, 0, -1
#: a name, id or parameter key
_WORD = re.compile(r"[A-Za-z0-9_.$-]*")
_CDATA = re.compile(r"\A<!\[CDATA\[(.*)\]\]>\Z", re.S)


def _match(buf: str, lit: str) -> tuple[int, int]:
    """Does ``buf`` start with ``lit`` (leading whitespace skipped, whitespace in ``lit`` optional and
    elastic)? ``(_OK, characters taken)``, ``(_MORE, 0)`` when the text so far cannot tell, ``(_FAIL, 0)``."""
    i, n = 0, len(buf)
    while i < n and buf[i].isspace():
        i += 1
    if i == n:
        return _MORE, 0
    for ch in lit:
        if ch.isspace():
            while i < n and buf[i].isspace():
                i += 1
            if i == n:
                return _MORE, 0
            continue
        if i == n:
            return _MORE, 0
        if buf[i] != ch:
            return _FAIL, 0
        i += 1
    return _OK, i


class _JsonScan:
    """Finds where one JSON value ends, as its text arrives."""

    def __init__(self, depth: int = 0) -> None:
        self.depth = depth
        self.started = depth > 0
        self.in_str = False
        self.escape = False

    def feed(self, text: str) -> int | None:
        """How much of ``text`` completes the value (``None``: all of it, and it goes on)."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
                if ch in "{[":
                    self.depth = 1
                elif ch == '"':
                    self.in_str = True
                continue
            if self.in_str:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_str = False
                    if self.depth == 0:
                        return i + 1
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.depth == 0:  # a bare scalar ended at its container's bracket
                    return i
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.depth == 0 and (ch == "," or ch.isspace()):
                return i
        return None


_TEXT, _CALL, _AFTER, _OBJECT, _SKIP = "text", "call", "after", "object", "skip"


class ToolCallParser:
    """Takes tool calls out of output text as it arrives (committed deltas, in order).

    :meth:`feed` returns what the new text adds: content (the text outside calls, without the markup)
    and :class:`ToolCallDelta` pieces — a call's ``id`` and ``name`` as soon as its name is written,
    then its ``arguments`` (JSON arguments as they arrive, exactly the text the model wrote; XML
    parameters as one JSON object once they are complete). Text that may be the start of the trigger is
    held back until it is resolved; whitespace just before a call (or after the last one) is not
    content. :meth:`finish` flushes; :meth:`message` is the whole answer. ``strings`` says, per
    function, which parameters are strings (XML formats read the others as JSON).
    """

    def __init__(self, fmt: ToolFormat, new_id: Callable[[int], str] = new_call_id,
                 strings: Mapping[str, Mapping[str, bool]] | None = None) -> None:
        self.format = fmt
        self._new_id = new_id
        self._strings = strings or {}
        self._buf = ""
        self._mode = _TEXT
        self._queue: list[Part] = []
        self._raw = ""  # the current call's text so far (from its trigger), for the fallbacks
        self._named = False
        self._scan: _JsonScan | None = None
        self._object_text = ""  # a whole JSON call object scanned so far
        self._params: dict[str, str] = {}
        self._key = ""
        self._pending_ws = ""
        self._content: list[str] = []
        self._calls: list[list[str]] = []  # [id, name, arguments]

    # -- public --------------------------------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._step(content, calls):
            pass
        return self._delta(content, calls)

    def finish(self) -> ParsedDelta:
        """The output ended: held-back text is content; a call cut off before its name is dropped (one
        cut off later keeps what it has)."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self._mode in (_TEXT, _AFTER):
            self._emit(self._buf, content)
        elif self._mode == _CALL and self._named and self.format.param is not None and not self._calls[-1][2]:
            self._params_done(calls)  # cut off in its XML parameters: the complete ones
        self._buf, self._mode = "", _TEXT
        if self._pending_ws and not self._calls:
            content.append(self._pending_ws)
            self._content.append(self._pending_ws)
        self._pending_ws = ""
        return self._delta(content, calls)

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(id=c[0], name=c[1], arguments=c[2]) for c in self._calls)

    @property
    def content(self) -> str:
        return "".join(self._content)

    def message(self) -> ParsedMessage:
        content = self.content
        return ParsedMessage(content=None if self._calls and not content else content, tool_calls=self.calls)

    # -- output --------------------------------------------------------------------------------
    def _delta(self, content: list[str], calls: list[ToolCallDelta]) -> ParsedDelta:
        merged: list[ToolCallDelta] = []
        for d in calls:  # consecutive argument fragments of one call travel as one piece
            if merged and merged[-1].index == d.index and d.id is None:
                last = merged[-1]
                merged[-1] = attrs.evolve(last, arguments=last.arguments + d.arguments)
            else:
                merged.append(d)
        return ParsedDelta("".join(content), tuple(merged))

    def _emit(self, text: str, out: list[str]) -> None:
        """Content, with a trailing whitespace run held back (it is dropped if a call follows)."""
        if not text:
            return
        text = self._pending_ws + text
        stripped = text.rstrip()
        self._pending_ws = text[len(stripped):]
        if stripped:
            out.append(stripped)
            self._content.append(stripped)

    def _new_call(self, name: str, calls: list[ToolCallDelta], arguments: str = "") -> None:
        index = len(self._calls)
        call_id = self._new_id(index)
        self._calls.append([call_id, name, arguments])
        calls.append(ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments))

    def _add_arguments(self, piece: str, calls: list[ToolCallDelta]) -> None:
        if piece:
            self._calls[-1][2] += piece
            calls.append(ToolCallDelta(index=len(self._calls) - 1, arguments=piece))

    def _take(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._raw += taken
        return taken

    # -- the states ----------------------------------------------------------------------------
    def _lead(self) -> str:
        """What the next call after a separator must start with (a JSON call object's start is not part
        of it: its keys may come in another order)."""
        prefix = self.format.prefix
        cut = prefix.find('{"') if self.format.keys is not None else -1
        return prefix[:cut] if cut >= 0 else prefix

    def _start_call(self, first: bool) -> None:
        fmt = self.format
        self._mode = _CALL
        self._named = False
        self._params, self._key, self._scan = {}, "", None
        rest = (fmt.begin + fmt.prefix)[len(fmt.trigger):] if first else fmt.prefix[len(self._lead()):]
        self._queue = ([("lit", rest)] if rest.strip() else []) + list(fmt.call_parts[1:])

    def _step(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """Advance over the buffer once; False when it needs more text."""
        if self._mode == _TEXT:
            return self._text(content)
        if self._mode == _AFTER:
            return self._after()
        if self._mode == _OBJECT:
            return self._object(calls)
        if self._mode == _SKIP:
            return self._skip()
        if not self._queue:
            self._mode = _AFTER
            return True
        kind, text = self._queue[0]
        if kind == "lit":
            status, n = _match(self._buf, text)
            if status == _MORE:
                return False
            if status == _FAIL:
                return self._fail(content, calls)
            self._take(n)
            self._queue.pop(0)
            return True
        if kind in ("name", "id", "key"):
            m = _WORD.match(self._buf)
            assert m is not None
            if m.end() == len(self._buf):
                return False
            if not m.group():
                return self._fail(content, calls)
            word = self._take(m.end())
            self._queue.pop(0)
            if kind == "name":
                self._new_call(word, calls)
                self._named = True
            elif kind == "key":
                self._key = word
            return True
        if kind == "args":
            return self._arguments(calls)
        if kind == "value":
            return self._value()
        return self._param_or_next(content, calls)

    def _text(self, content: list[str]) -> bool:
        trigger = self.format.trigger
        buf = self._buf
        at = buf.find(trigger)
        if at < 0:
            keep = _partial_suffix(buf, trigger)
            self._emit(buf[: len(buf) - keep], content)
            self._buf = buf[len(buf) - keep:]
            return False
        self._emit(buf[:at], content)
        self._pending_ws = ""  # whitespace before a call is not content
        self._buf = buf[at + len(trigger):]
        self._raw = trigger
        self._start_call(first=True)
        return True

    def _after(self) -> bool:
        """A call ended: another one follows (its separator), the calls end, or text follows."""
        fmt = self.format
        if not fmt.end:
            self._mode = _TEXT
            return True
        more = _match(self._buf, fmt.sep + self._lead())
        if more[0] == _OK:
            self._raw = ""
            self._take(more[1])
            self._start_call(first=False)
            return True
        done = _match(self._buf, fmt.end)
        if done[0] == _OK:
            self._take(done[1])
            self._mode = _TEXT
            return True
        if _MORE in (more[0], done[0]):
            return False
        self._mode = _TEXT
        return True

    def _arguments(self, calls: list[ToolCallDelta]) -> bool:
        if self._scan is None:
            self._scan = _JsonScan()
        end = self._scan.feed(self._buf)
        piece = self._take(len(self._buf) if end is None else end)
        self._add_arguments(piece.lstrip() if not self._calls[-1][2] else piece, calls)
        if end is None:
            return False
        self._scan = None
        self._queue.pop(0)
        return True

    def _value(self) -> bool:
        """An XML parameter's text, up to its closing text (the next literal)."""
        close = self._queue[1][1].strip() if len(self._queue) > 1 else ""
        at = self._buf.find(close) if close else len(self._buf)
        if at < 0:
            return False
        raw = self._take(at).strip()
        m = _CDATA.match(raw)
        self._params[self._key] = m.group(1) if m else raw
        self._queue.pop(0)
        return True

    def _param_or_next(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """At ``⟨params⟩``: another parameter, or the text after the parameters."""
        pp = self.format.param_parts
        first = _match(self._buf, pp[0][1])
        if first[0] == _OK:
            self._take(first[1])
            self._queue[:0] = list(pp[1:])
            return True
        after = self._queue[1] if len(self._queue) > 1 else None
        nxt = _match(self._buf, after[1]) if after is not None else (_OK, 0)
        if nxt[0] == _OK:
            self._queue.pop(0)
            self._params_done(calls)
            return True
        if _MORE in (first[0], nxt[0]):
            return False
        return self._fail(content, calls)

    def _params_done(self, calls: list[ToolCallDelta]) -> None:
        strings = self._strings.get(self._calls[-1][1], {})
        args: dict[str, Any] = {}
        for key, raw in self._params.items():
            if strings.get(key):
                args[key] = raw
                continue
            try:
                args[key] = json.loads(raw)
            except ValueError:
                args[key] = raw
        self._params = {}
        self._add_arguments(json.dumps(args, ensure_ascii=False), calls)

    def _fail(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """The text stopped matching the call's pattern."""
        fmt = self.format
        if self._named:  # keep the call as it is; skip to its end
            if fmt.keys is not None:
                self._scan = _JsonScan(depth=1)
                self._mode = _SKIP
            else:
                close = fmt.call_parts[-1][1].strip() if fmt.call_parts[-1][0] == "lit" else ""
                self._queue = [("skipto", close)] if close else []
                self._mode = _SKIP if close else _AFTER
            return True
        raw = self._raw + self._buf
        brace = raw.find("{")
        if fmt.keys is not None and brace >= 0:  # one JSON object, keys in another order: parse it whole
            self._buf = raw[brace:]
            self._scan = _JsonScan()
            self._mode = _OBJECT
            return True
        # not a call after all: its text is content
        self._emit(self._raw, content)
        self._mode = _TEXT
        return True

    def _tail_after_object(self) -> None:
        """After a whole JSON call object: the rest of the call's closing text."""
        last = self.format.call_parts[-1]
        tail = last[1][last[1].rfind("}") + 1:] if last[0] == "lit" else ""
        self._queue = [("lit", tail)] if tail.strip() else []
        self._mode = _CALL

    def _object(self, calls: list[ToolCallDelta]) -> bool:
        assert self._scan is not None and self.format.keys is not None
        end = self._scan.feed(self._buf)
        if end is None:
            self._object_text += self._buf
            self._buf = ""
            return False
        raw, self._buf = self._object_text + self._buf[:end], self._buf[end:]
        self._object_text = ""
        self._scan = None
        name_key, args_key = self.format.keys
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get(name_key), str):
            args = obj.get(args_key, {})
            self._new_call(obj[name_key], calls, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
            self._named = True
        # (not a call this format knows: the markup is dropped, not shown as content)
        self._tail_after_object()
        return True

    def _skip(self) -> bool:
        if self._scan is not None:  # the rest of the call's JSON object
            end = self._scan.feed(self._buf)
            if end is None:
                self._buf = ""
                return False
            self._buf = self._buf[end:]
            self._scan = None
            self._tail_after_object()
            return True
        close = self._queue[0][1]
        at = self._buf.find(close)
        if at < 0:
            keep = _partial_suffix(self._buf, close)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._buf = self._buf[at + len(close):]
        self._queue = []
        self._mode = _AFTER
        return True


def parse(fmt: ToolFormat, text: str, new_id: Callable[[int], str] = new_call_id,
          strings: Mapping[str, Mapping[str, bool]] | None = None) -> ParsedMessage:
    """A whole output's content and calls in ``fmt`` (the same as feeding it to a
    :class:`ToolCallParser` piece by piece)."""
    p = ToolCallParser(fmt, new_id, strings)
    p.feed(text)
    p.finish()
    return p.message()


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
