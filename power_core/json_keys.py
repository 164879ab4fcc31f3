"""The duplicate-key watcher of constrained JSON output: :class:`JsonKeys` follows the JSON a constrained
output writes (from its start, or after a marker such as a tool call's opening tag) and cuts any token that
would make an object hold a key twice, which a grammar cannot say; :class:`KeyTables` is a vocabulary as it
reads it. :class:`power_core.constraint.GrammarConstraint` drives it beside its grammar."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["JsonKeys", "KeyTables"]

_SCAN, _JSON, _DONE = 0, 1, 2
_WS = frozenset(b" \t\n\r")
_QUOTE, _BACKSLASH = 0x22, 0x5C
#: an open container: (is an object, the keys it holds, the next string is a key, the keys' bytes as written)
_Frame = tuple[bool, frozenset[str], bool, tuple[bytes, ...]]
#: (mode, the text seen that may begin the marker, open containers, 0 / in a string / after its
#: backslash, the bytes of the key being written or None)
_KeyState = tuple[int, bytes, tuple[_Frame, ...], int, bytes | None]
#: how many tokens deep :meth:`JsonKeys._fresh_ahead` looks for a key an object does not hold yet
#: before it assumes there is one
_SEARCH_DEPTH = 64


def _key_text(raw: bytes) -> str:
    try:
        return str(json.loads(b'"' + raw + b'"'))
    except ValueError:
        return raw.decode("utf-8", errors="replace")


@attrs.frozen(eq=False)
class KeyTables:
    """A vocabulary as :class:`JsonKeys` reads it (built once per vocabulary): each token's bytes (a
    special token, ``0xff``-prefixed, is no text), the text tokens that hold a ``"`` or a ``,`` (only
    they can end a key or start the next), those that are all whitespace, and each piece's id."""

    pieces: tuple[bytes, ...]
    structural: npt.NDArray[np.intp]
    blank: npt.NDArray[np.intp]
    by_piece: Mapping[bytes, int]

    @classmethod
    def of(cls, pieces: Sequence[bytes]) -> KeyTables:
        text = [(i, p) for i, p in enumerate(pieces) if p and p[:1] != b"\xff"]
        by_piece: dict[bytes, int] = {}
        for i, p in text:
            by_piece.setdefault(p, i)
        return cls(pieces=tuple(pieces),
                   structural=np.asarray([i for i, p in text if b'"' in p or b"," in p], dtype=np.intp),
                   blank=np.asarray([i for i, p in text if not p.strip(b" \t\n\r")], dtype=np.intp),
                   by_piece=by_piece)


class JsonKeys:
    """Watches the JSON an output writes, so that no object of it holds a key twice (keys compared as
    decoded strings: ``"a"`` and ``"\\u0061"`` are one key).

    A token is refused when it would complete a key its object holds, and when after it the object
    could take no key it does not hold (every key the grammar still allows from there is taken: the
    grammar is asked, token by token along the held keys), so the output never reaches a point where
    the grammar's every continuation repeats a key.

    JSON values start after each occurrence of ``marker`` (``""``: one value, at the start of the
    output); outside them the text is only scanned for the marker. The state after every consumed
    token is kept, so a rollback is a pop. The grammar's matcher (``m``: llguidance's ``LLMatcher``,
    at the consumed tokens) is advanced and rolled back to look ahead, and left where it was.
    """

    def __init__(self, marker: str, tables: KeyTables) -> None:
        self._marker = marker.encode()
        self._t = tables
        self._states: list[_KeyState] = [(_SCAN if self._marker else _JSON, b"", (), 0, None)]

    @property
    def state(self) -> _KeyState:
        return self._states[-1]

    def _root_done(self) -> _KeyState:
        return (_SCAN, b"", (), 0, None) if self._marker else (_DONE, b"", (), 0, None)

    def step(self, state: _KeyState, data: bytes) -> _KeyState | None:
        """``state`` after ``data``, or ``None`` when ``data`` completes a key its object holds."""
        if not data or data[:1] == b"\xff":
            return state
        mode, tail, stack, in_str, key = state
        marker = self._marker
        i, n = 0, len(data)
        while i < n and mode != _DONE:
            if mode == _SCAN:
                seen = tail + data[i:]
                at = seen.find(marker)
                if at < 0:
                    keep = next((seen[-k:] for k in range(min(len(marker) - 1, len(seen)), 0, -1)
                                 if marker.startswith(seen[-k:])), b"")
                    return (_SCAN, keep, (), 0, None)
                i += at + len(marker) - len(tail)
                mode, tail = _JSON, b""
                continue
            b = data[i]
            i += 1
            if in_str:
                if in_str == 2:
                    in_str = 1
                elif b == _BACKSLASH:
                    in_str = 2
                elif b == _QUOTE:
                    in_str = 0
                    if key is not None:
                        name = _key_text(key)
                        _, names, _, raws = stack[-1]
                        if name in names:
                            return None
                        stack = (*stack[:-1], (True, names | {name}, False, (*raws, key)))
                        key = None
                    elif not stack:  # a string was the whole value
                        mode, tail, stack, in_str, key = self._root_done()
                    continue
                if key is not None:
                    key += bytes((b,))
                continue
            if b in _WS:
                continue
            if b == 0x7B:  # {
                stack = (*stack, (True, frozenset(), True, ()))
            elif b == 0x5B:  # [
                stack = (*stack, (False, frozenset(), False, ()))
            elif b in (0x7D, 0x5D):  # } ]
                stack = stack[:-1]
                if not stack:
                    mode, tail, stack, in_str, key = self._root_done()
            elif b == _QUOTE:
                in_str = 1
                key = b"" if stack and stack[-1][0] and stack[-1][2] else None
            elif b == 0x2C:  # ,
                if stack and stack[-1][0]:
                    is_obj, names, _, raws = stack[-1]
                    stack = (*stack[:-1], (is_obj, names, True, raws))
            elif b != 0x3A and not stack:  # a number or literal was the whole value
                mode, tail, stack, in_str, key = self._root_done()
        return (mode, tail, stack, in_str, key)

    @staticmethod
    def _watching(state: _KeyState) -> bool:
        """Some open object holds a key (else nothing can repeat one)."""
        return state[0] == _JSON and any(frame[0] and frame[1] for frame in state[2])

    @staticmethod
    def _risky(state: _KeyState) -> bool:
        """Between an object's keys, or inside a key that may still become one it holds: a key it does
        not hold must still be writable from here."""
        mode, _, stack, in_str, key = state
        if mode != _JSON or not stack or not stack[-1][0] or not stack[-1][1]:
            return False
        if not in_str:
            return stack[-1][2]
        return key is not None and any(raw.startswith(key) for raw in stack[-1][3])

    def _fresh_ahead(self, m: Any, state: _KeyState, depth: int = 0) -> bool:
        """Can the object still take a key it does not hold, from ``state`` (risky: :meth:`_risky`) and
        the matcher's state? Tokens the grammar allows are tried in turn: one that leaves the risky
        state (it completes a key the object does not hold, or writes bytes no held key has there) says
        yes; one that stays in it is followed (the matcher advanced and rolled back), so only paths
        along the held keys are searched, to ``_SEARCH_DEPTH`` tokens (then: yes)."""
        if depth >= _SEARCH_DEPTH:
            return True
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        pieces = self._t.pieces
        follow: list[tuple[int, _KeyState]] = []
        allowed = np.flatnonzero(bits[: len(pieces)])
        for start in range(0, allowed.shape[0], 64):  # (most often the first token already says yes)
            for tok in allowed[start:start + 64].tolist():
                nxt = self.step(state, pieces[tok])
                if nxt is None:
                    continue  # it completes a held key
                if not self._risky(nxt):
                    return True
                follow.append((tok, nxt))
        for tok, nxt in follow:
            if not m.consume_token(tok):
                continue
            try:
                if self._fresh_ahead(m, nxt, depth + 1):
                    return True
            finally:
                m.rollback(1)
        return False

    def allows(self, tokens: Sequence[int], m: Any) -> int:
        """How many leading ``tokens`` (each one the grammar allows in turn) keep every object free of a
        repeated key and able to take a new one (no advance)."""
        state = self.state
        consumed = 0
        try:
            for i, tok in enumerate(tokens):
                nxt = self.step(state, self._t.pieces[tok])
                if nxt is None:
                    return i
                if self._risky(nxt):
                    m.consume_tokens(list(tokens[consumed:i + 1]))
                    consumed = i + 1
                    if not self._fresh_ahead(m, nxt):
                        return i
                state = nxt
            return len(tokens)
        finally:
            if consumed:
                m.rollback(consumed)

    def restrict(self, allowed: npt.NDArray[np.bool_], m: Any) -> bool:
        """Clear ``allowed`` for every token :meth:`allows` refuses now; False when that clears every
        allowed token."""
        state = self.state
        if not self._watching(state):
            return True
        pieces, t = self._t.pieces, self._t
        cleared: list[int] = []
        ahead: list[tuple[int, _KeyState]] = []
        structural = t.structural[t.structural < allowed.shape[0]]
        for tok in structural[allowed[structural]].tolist():
            nxt = self.step(state, pieces[tok])
            if nxt is None:
                cleared.append(tok)
            elif self._risky(nxt):
                ahead.append((tok, nxt))
        if self._risky(state):  # tokens with no '"' or ',' that keep it so: the key's next bytes, blanks
            _, _, stack, in_str, key = state
            near: set[int] = set()
            if in_str and key is not None:
                for raw in stack[-1][3]:
                    if raw.startswith(key):
                        near.update(t.by_piece.get(raw[len(key):j], -1) for j in range(len(key) + 1, len(raw) + 1))
            else:
                near.update(t.blank.tolist())
            for tok in sorted(near - {-1} - set(structural.tolist())):
                if tok < allowed.shape[0] and allowed[tok]:
                    nxt = self.step(state, pieces[tok])
                    if nxt is not None and self._risky(nxt):
                        ahead.append((tok, nxt))
        seen: dict[_KeyState, bool] = {}  # one search per state (',' and ', ' leave the same one)
        for tok, nxt in ahead:
            if nxt not in seen:
                if not m.consume_token(tok):
                    continue
                try:
                    seen[nxt] = self._fresh_ahead(m, nxt)
                finally:
                    m.rollback(1)
            if not seen[nxt]:
                cleared.append(tok)
        if not cleared:
            return True
        allowed[cleared] = False
        return bool(allowed.any())

    def advance(self, tokens: Sequence[int]) -> bool:
        """Consume ``tokens``; False (and nothing consumed) if one completes a key twice."""
        states = []
        state: _KeyState | None = self.state
        for tok in tokens:
            assert state is not None
            state = self.step(state, self._t.pieces[tok])
            if state is None:
                return False
            states.append(state)
        self._states.extend(states)
        return True

    def hold(self) -> None:
        """Consume a token that writes no text (an end of generation past the grammar's end)."""
        self._states.append(self.state)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n > 0:
            del self._states[len(self._states) - n:]
