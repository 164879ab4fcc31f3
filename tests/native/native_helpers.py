"""Drivers shared by the native tests: plain greedy decoding and a speculative loop that commits
exactly as ``power_core.transaction`` does (checkpoint → verify → accept → rollback or replay)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def greedy_reference(target, prompt, n: int) -> list[int]:
    """Autoregressive greedy decoding, one token per pass."""
    prompt = np.asarray(prompt, dtype=np.int32)
    target.reset()
    if prompt.shape[0] > 1:
        target.prefill(prompt[:-1])
    anchor, out = int(prompt[-1]), []
    while len(out) < n:
        res = target.decode(np.array([anchor], dtype=np.int32))
        anchor = int(np.argmax(res.logits[0]))
        out.append(anchor)
    return out


def speculative(target, prompt, n: int, k: int, propose: Callable[[list[int], int, int], list[int]]) -> dict:
    """Greedy speculative decoding with ``propose(history, k, round)``; returns tokens and counters."""
    prompt = np.asarray(prompt, dtype=np.int32)
    target.reset()
    if prompt.shape[0] > 1:
        target.prefill(prompt[:-1])
    history = [int(t) for t in prompt]
    out: list[int] = []
    proposed = accepted = replays = rounds = 0
    while len(out) < n:
        kk = max(0, min(k, n - len(out) - 1))
        props = [int(t) for t in propose(history, kk, rounds)][:kk]
        cp = target.checkpoint()
        block = np.array([history[-1], *props], dtype=np.int32)
        res = target.decode(block)
        emitted = []
        for j in range(len(props) + 1):
            tok = int(np.argmax(res.logits[j]))
            emitted.append(tok)
            if j == len(props) or tok != props[j]:
                break
        keep = len(emitted)
        if keep < block.shape[0] and not target.rollback(cp, keep):
            target.decode(block[:keep])
            replays += 1
        assert target.n_past == len(history) - 1 + keep
        proposed += len(props)
        accepted += keep - 1 if keep <= len(props) else len(props)
        history.extend(emitted)
        out.extend(emitted)
        rounds += 1
    return {"tokens": out[:n], "proposed": proposed, "accepted": accepted, "replays": replays, "rounds": rounds}


def oracle(reference: list[int], prompt_len: int, n_vocab: int):
    """Proposals from the known continuation, corrupted at index ``round % (k+1)`` so every
    acceptance depth 0..k occurs."""

    def propose(history: list[int], k: int, rnd: int) -> list[int]:
        done = len(history) - prompt_len
        props = list(reference[done:done + k])
        bad = rnd % (k + 1)
        if bad < len(props):
            props[bad] = (props[bad] + 1) % n_vocab
        return props

    return propose
