"""Committed tokens to text: incremental detokenization, UTF-8 hold-back and stop strings.

One :class:`TextAssembler` follows one request. It only ever sees *committed* tokens (the
transaction's ``emitted`` list), so no text from a rejected or unverified suffix can reach it.

* **UTF-8 across tokens.** A token may end inside a multibyte character (byte-fallback and
  byte-level BPE vocabularies split characters). Tokenizers decode an incomplete tail to U+FFFD;
  the assembler keeps such tokens *pending* and re-decodes them with the next tokens, and a stream
  holds back trailing U+FFFD until the character is complete (or the request ends).
* **Stop strings** are matched on the decoded text, across token boundaries. The transaction asks
  :meth:`TextAssembler.find_stop` in its accept phase how many of a round's tokens to keep; the token
  that completes a stop string is the last one committed, and the text ends right before the stop
  string. A stream holds back any tail that could still become a stop string.

It assumes what llama.cpp's detokenizer and the reference byte tokenizer guarantee: decoding is
concatenative at character boundaries (``decode(a + b) == decode(a) + decode(b)`` when ``a``
decodes without a trailing U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from power_core.runtime import TokenArray

__all__ = ["TextAssembler"]

_REPLACEMENT = "\ufffd"


class TextAssembler:
    """Text of a request's committed tokens, cut at its stop strings, handed out as deltas."""

    def __init__(self, decode: Callable[[TokenArray], str], stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self.stops = tuple(stops)
        self._lead = max((len(s) for s in self.stops), default=1) - 1  # chars a match may reach back
        self._n = 0  # committed tokens absorbed
        self._stable = ""  # text of the absorbed tokens before the pending ones
        self._pending: list[int] = []  # tokens whose text may still end inside a character
        self._tail = ""  # decode(pending)
        self._sent = 0  # chars handed out by take()

    def _dec(self, tokens: Sequence[int]) -> str:
        return self._decode(np.asarray(tokens, dtype=np.int32)) if len(tokens) else ""

    # -- committed tokens ------------------------------------------------------------------------
    def sync(self, committed: Sequence[int]) -> None:
        """Absorb the committed tokens not seen yet (``committed`` only ever grows)."""
        n = len(committed)
        if n < self._n:
            raise ValueError(f"committed tokens shrank from {self._n} to {n}")
        if n == self._n:
            return
        self._pending.extend(int(t) for t in committed[self._n:])
        self._n = n
        tail = self._dec(self._pending)
        if tail.endswith(_REPLACEMENT):
            self._tail = tail  # may end inside a character: decode again with the next tokens
        else:
            self._stable += tail
            self._pending.clear()
            self._tail = ""

    @property
    def full_text(self) -> str:
        """Everything the absorbed tokens decode to (not cut at a stop string)."""
        return self._stable + self._tail

    def _earliest(self, text: str, start: int = 0) -> int | None:
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def text(self) -> str:
        """The request's text: the committed text, ending right before the first stop string."""
        full = self.full_text
        cut = self._earliest(full)
        return full if cut is None else full[:cut]

    # -- the transaction's stop check ----------------------------------------------------------
    def find_stop(self, committed: Sequence[int], out: Sequence[int]) -> int | None:
        """How many of ``out`` (a round's tokens, not committed yet) to keep: up to and including
        the token that completes the first stop string, or ``None`` when none completes."""
        self.sync(committed)
        if not self.stops or not len(out):
            return None
        lead = self._stable[-self._lead:] if self._lead else ""
        if self._earliest(lead + self._dec(self._pending + list(out))) is None:
            return None
        for m in range(1, len(out) + 1):  # the round that stops: find its first stopping token
            if self._earliest(lead + self._dec(self._pending + list(out[:m]))) is not None:
                return m
        return len(out)  # pragma: no cover - the whole round matched above

    # -- streaming -------------------------------------------------------------------------------
    def _held_back(self, text: str) -> int:
        """Chars at the end of ``text`` that may still change meaning: an incomplete character
        (trailing U+FFFD of pending tokens) or a tail that could grow into a stop string."""
        end = len(text)
        if self._tail:
            end = len(text.rstrip(_REPLACEMENT))
        hold = len(text) - end
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, end), best, -1):
                if text.endswith(s[:k], 0, end):
                    best = k
                    break
        return hold + best

    def take(self, final: bool) -> str:
        """The text not handed out yet. Until ``final`` (the request ended) it withholds what may
        still change; a final take hands out the rest, cut at the stop string."""
        if final:
            text = self.text()
            end = len(text)
        else:
            text = self.full_text
            end = len(text) - self._held_back(text)
            cut = self._earliest(text, max(0, self._sent - self._lead))
            if cut is not None:
                end = min(end, cut)
        if end <= self._sent:
            return ""
        delta = text[self._sent:end]
        self._sent = end
        return delta
