"""The draft contexts one target's sequences share (:class:`DraftPool`), and what a context holds in
memory."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from power_core.errors import RuntimeFault
from power_native import _llama


class SharedDraft(Protocol):
    """What a :class:`DraftPool` holds: a draft context (and its state) that the proposers of several
    sequences share; closed once, with the pool."""

    @property
    def ctx(self) -> _llama.Context: ...

    def close(self) -> None: ...


def context_memory(ctx: _llama.Context, *, weights: bool = True) -> dict[str, int]:
    """Bytes ``ctx`` holds, summed over its buffer types: ``weights`` (its model's; 0 when
    ``weights`` is False, for a context on a model counted elsewhere), ``context`` (KV cells,
    recurrent states and their rollback snapshots, for every sequence) and ``compute`` (llama.cpp
    reserves the widest pass's buffers when the context is made)."""
    total = {"weights": 0, "context": 0, "compute": 0}
    for part in ctx.memory().values():
        total["weights"] += part["model"] if weights else 0
        total["context"] += part["context"]
        total["compute"] += part["compute"]
    return total


_D = TypeVar("_D", bound=SharedDraft)


class DraftPool:
    """The draft contexts of one target's sequences: one per kind of draft (``key``), each holding a
    sequence per target sequence (``n_seq``), so one draft pass decodes every request's draft tokens
    (:class:`power_core.runtime.ProposalBatch`; llama.cpp's server drafts all its slots in one batch
    the same way). A target of its own has a pool of one sequence; a :class:`LlamaBatch` shares one
    pool among its sequences and closes it before its own context."""

    def __init__(self, n_seq: int) -> None:
        self.n_seq = n_seq
        self._shared: dict[tuple[object, ...], SharedDraft] = {}
        self._lock = threading.Lock()
        self._closed = False

    def shared(self, key: tuple[object, ...], make: Callable[[int], _D], kind: type[_D]) -> _D:
        """The pool's draft for ``key``, made by ``make(n_seq)`` the first time it is asked for; every
        setting that changes what the draft computes belongs in ``key`` (sequences configured apart
        get drafts apart)."""
        with self._lock:
            if self._closed:
                raise RuntimeFault("the target's draft pool is closed")
            found = self._shared.get(key)
            if found is None:
                found = self._shared[key] = make(self.n_seq)
        if not isinstance(found, kind):
            raise RuntimeFault(f"draft pool key {key!r} holds a {type(found).__name__}, not a {kind.__name__}")
        return found

    def memory(self, target_model: _llama.Model) -> dict[str, dict[str, int]]:
        """:func:`context_memory` of each draft context, by kind (the key's first part); a draft on the
        target's own model (an MTP head) counts no weights."""
        with self._lock:
            drafts = list(self._shared.items())
        out: dict[str, dict[str, int]] = {}
        for key, draft in drafts:
            name = str(key[0])
            name = name if name not in out else f"{name}#{len(out)}"
            out[name] = context_memory(draft.ctx, weights=draft.ctx.model is not target_model)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            shared, self._shared = list(self._shared.values()), {}
        failure: BaseException | None = None
        for draft in shared:
            try:
                draft.close()
            except BaseException as exc:  # close every one; report the first failure
                failure = failure or exc
        if failure is not None:
            raise failure
