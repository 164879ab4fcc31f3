"""Memories that outlive a request: the prompt cache across requests (:class:`PromptCache`), and the policy
that decides what a target holds before a request's prefill (:func:`hold_prefix`, :func:`save_prefix`).

**The prompt cache.** A request's sequence keeps what its target computed for the prompt and the
committed output (attention KV, recurrent state). The next request on that sequence whose prompt
shares a prefix with it keeps that prefix and prefills only the rest (config ``cache_prompt``). A
:class:`PromptCache` keeps such states beyond their sequence: when a sequence is about to be
overwritten by a prompt that does not extend what it holds, its state is saved into the cache
(:attr:`~power_core.runtime.TargetCapabilities.save_state`), and a request restores the saved
state that shares the longest prefix with its prompt into whichever sequence it was given
(:attr:`~power_core.runtime.TargetCapabilities.load_state`), as llama-server's ``--cache-ram`` does.
The cache is bounded by bytes and evicts the least recently used states first.

States are saved lazily (when their sequence is reused for another prompt, or closed), not at the
end of every request: a conversation whose next turn lands on the same sequence (the engine admits
a request to the free sequence holding the longest prefix of its prompt) continues in place and
never pays for a copy.

**Tenants.** Every state is saved under the tenant of the request that computed it (config
``tenant``) and is restored only for requests of the same tenant, unless the cache was made with
``share_tenants=True``: a restored prefix makes a request faster, so a shared cache lets one tenant
learn, by timing its requests, whether another tenant sent a given prefix.

**Exactness.** A restored state holds the bytes the target computed; with batch-invariant numerics
(``numerics = "exact"``) those equal what a fresh prefill would compute, so every output equals a
cold run's. ``state_format`` binds a state to the targets that may load it (the model file, the
kernels, the offload).

One cache may serve many sessions and engines (``Session.open_engine(..., prompt_cache=)``); it is
thread-safe.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import attrs
import numpy as np

from power_core.errors import ConfigError, StateLost
from power_core.logs import get_logger
from power_core.runtime import TargetRuntime, TokenArray

__all__ = ["DEFAULT_CACHE_MIB", "PromptCache", "PromptCacheStats", "SavedState", "hold_prefix", "reusable_prefix",
           "save_prefix", "shares"]

log = get_logger(__name__)

#: llama-server's ``--cache-ram`` default (MiB); ``power serve --cache-ram`` takes the same
DEFAULT_CACHE_MIB = 8192


def reusable_prefix(held: TokenArray, prompt: TokenArray, *, trims: bool) -> int:
    """How many of ``prompt``'s tokens a memory holding ``held`` can keep: their common prefix, short
    of the prompt's last token (it is decoded again for its logits row). A memory that cannot be
    cut back (``trims`` False: recurrent state) keeps all of ``held`` or nothing."""
    n = min(int(held.shape[0]), int(prompt.shape[0]) - 1)
    if n <= 0:
        return 0
    differ = np.flatnonzero(held[:n] != prompt[:n])
    keep = int(differ[0]) if differ.size else n
    return keep if trims or keep == held.shape[0] else 0


@attrs.frozen(eq=False)
class SavedState:
    """A sequence's saved memory: the ``tokens`` it holds, the target's bytes for them (``data``),
    who may load it (``state_format``) and whose it is (``tenant``)."""

    tokens: TokenArray
    data: bytes
    state_format: str
    tenant: str

    @property
    def nbytes(self) -> int:
        """What it costs the cache's budget: the state and its tokens."""
        return len(self.data) + int(self.tokens.nbytes)


@attrs.frozen
class PromptCacheStats:
    """A snapshot of a :class:`PromptCache` (``power serve``'s ``/metrics``)."""

    budget_bytes: int
    bytes: int
    entries: int
    #: requests that looked for a saved state
    lookups: int
    #: ... and restored one
    restores: int
    #: prompt tokens those restores spared
    restored_tokens: int
    saves: int
    evictions: int
    #: restores the target could not load (the request prefilled from empty instead)
    failed_restores: int

    @property
    def hit_rate(self) -> float:
        return self.restores / self.lookups if self.lookups else 0.0


class PromptCache:
    """Saved target states in host memory, at most ``budget_bytes`` of them, least recently used
    evicted first; see the module's documentation. ``share_tenants``: any tenant's request may
    restore any tenant's state (a timing channel between tenants; off by default)."""

    def __init__(self, budget_bytes: int, *, share_tenants: bool = False) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ConfigError("cache_ram", budget_bytes, "a number of bytes >= 0")
        self.budget_bytes = budget_bytes
        self.share_tenants = share_tenants
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[int, SavedState] = collections.OrderedDict()  # oldest first
        self._next = 0
        self._bytes = 0
        self._counts = dict.fromkeys(("lookups", "restores", "restored_tokens", "saves", "evictions",
                                      "failed_restores"), 0)

    @classmethod
    def of_mib(cls, mib: int, *, share_tenants: bool = False) -> PromptCache | None:
        """A cache of ``mib`` MiB (``power serve --cache-ram``); ``None`` for 0 (no cache)."""
        if isinstance(mib, bool) or not isinstance(mib, int) or mib < 0:
            raise ConfigError("cache_ram", mib, "a number of MiB >= 0 (0: no prompt cache)")
        return cls(mib << 20, share_tenants=share_tenants) if mib else None

    def _visible(self, state: SavedState, state_format: str, tenant: str) -> bool:
        return state.state_format == state_format and (self.share_tenants or state.tenant == tenant)

    def lookup(self, prompt: TokenArray, *, state_format: str, tenant: str, trims: bool,
               n_ctx: int) -> tuple[SavedState, int] | None:
        """The saved state (of this format, visible to ``tenant``, at most ``n_ctx`` tokens) whose
        tokens a target can keep the most of for ``prompt`` (:func:`reusable_prefix`), and how
        many; ``None`` when none keeps any. The most recently used wins a tie."""
        best: tuple[SavedState, int] | None = None
        with self._lock:
            self._counts["lookups"] += 1
            for state in reversed(self._entries.values()):
                if state.tokens.shape[0] > n_ctx or not self._visible(state, state_format, tenant):
                    continue
                n = reusable_prefix(state.tokens, prompt, trims=trims)
                if n and (best is None or n > best[1]):
                    best = (state, n)
        return best

    def restored(self, state: SavedState, tokens: int) -> None:
        """``state`` was loaded for a request that keeps ``tokens`` of it: it becomes the most recently used."""
        with self._lock:
            self._counts["restores"] += 1
            self._counts["restored_tokens"] += tokens
            for key, entry in self._entries.items():
                if entry is state:
                    self._entries.move_to_end(key)
                    break

    def failed(self, state: SavedState) -> None:
        """The target could not load ``state``: it is dropped (it would fail again)."""
        with self._lock:
            self._counts["failed_restores"] += 1
            self._drop(lambda e: e is state)

    def covers(self, tokens: TokenArray, *, state_format: str, tenant: str, trims: bool) -> bool:
        """A saved state of ``tenant`` already holds ``tokens``, or (``trims``: for a target that can
        cut its memory back) a continuation of them."""
        n = int(tokens.shape[0])
        with self._lock:
            return any(e.state_format == state_format and e.tenant == tenant
                       and (e.tokens.shape[0] >= n if trims else e.tokens.shape[0] == n)
                       and np.array_equal(e.tokens[:n], tokens) for e in self._entries.values())

    def put(self, tokens: TokenArray, data: bytes, *, state_format: str, tenant: str, trims: bool) -> bool:
        """Save a state of ``tokens``. The same tenant's states of this format that it supersedes go:
        those of the same tokens, and (``trims``: a target that can cut its memory back) those of a
        prefix of them, since it serves every prompt they served. Then the least recently used
        states go until it fits. False when it alone exceeds the budget (nothing is evicted for it)."""
        tokens = np.array(tokens, dtype=np.int32)  # a copy of its own: the caller's array moves on
        tokens.flags.writeable = False
        state = SavedState(tokens=tokens, data=bytes(data), state_format=state_format, tenant=tenant)
        if state.nbytes > self.budget_bytes:
            return False
        n = int(tokens.shape[0])
        with self._lock:
            self._drop(lambda e: e.state_format == state_format and e.tenant == tenant
                       and (e.tokens.shape[0] <= n if trims else e.tokens.shape[0] == n)
                       and np.array_equal(tokens[:e.tokens.shape[0]], e.tokens))
            self._evict(state.nbytes)
            self._entries[self._next] = state
            self._next += 1
            self._bytes += state.nbytes
            self._counts["saves"] += 1
        return True

    def resize(self, budget_bytes: int) -> None:
        """A new budget; the least recently used states go at once until the cache fits it."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ConfigError("cache_ram", budget_bytes, "a number of bytes >= 0")
        with self._lock:
            self.budget_bytes = budget_bytes
            self._evict(0)

    def _evict(self, room: int) -> None:  # under the lock
        """Evict the least recently used states until ``room`` more bytes fit the budget."""
        while self._entries and self._bytes + room > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self._counts["evictions"] += 1

    def _drop(self, which: Callable[[SavedState], bool]) -> None:  # under the lock
        for key in [k for k, e in self._entries.items() if which(e)]:
            self._bytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def bytes(self) -> int:
        """Bytes held now (never more than :attr:`budget_bytes`)."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> PromptCacheStats:
        with self._lock:
            return PromptCacheStats(budget_bytes=self.budget_bytes, bytes=self._bytes, entries=len(self._entries),
                                    **self._counts)


# -- the policy: what a target holds before a request's prefill ----------------------------------------
def shares(cache: PromptCache | None, owner: str, tenant: str) -> bool:
    """May a request of ``tenant`` reuse what a request of ``owner`` left?"""
    return owner == tenant or (cache is not None and cache.share_tenants)


def hold_prefix(target: TargetRuntime, cache: PromptCache | None, held: tuple[TokenArray, str] | None,
                prompt: TokenArray, tenant: str, *, lost: Callable[[str], None]) -> TokenArray | None:
    """Make ``target`` hold the longest prefix of ``prompt`` it can get for a request of ``tenant``, on the
    thread that drives it, right before the prefill: what it holds (``held``: the tokens and their tenant,
    left by the previous request), or ``cache``'s saved state that keeps more of it, loaded now. Before
    what it holds is cut back or replaced, it is saved into the cache. Returns the tokens the target now
    holds (:meth:`Transaction.start_prefill` keeps the shared prefix), or ``None``: prefill from empty. A
    state that cannot be loaded leaves the memory empty; a target that cannot even be reset then is
    ``lost`` (its reason) and :class:`StateLost`."""
    caps = target.capabilities
    own = reusable_prefix(held[0], prompt, trims=caps.trims_prefix) \
        if held is not None and shares(cache, held[1], tenant) else 0
    cache = cache if caps.saves_states else None
    found = None
    if cache is not None:
        assert caps.state_format is not None
        found = cache.lookup(prompt, state_format=caps.state_format, tenant=tenant, trims=caps.trims_prefix,
                             n_ctx=caps.n_ctx)
        if found is not None and found[1] <= own:
            found = None
    if held is not None and (found is not None or own < held[0].shape[0]):
        save_prefix(target, cache, *held)  # it is about to be cut back or replaced
    if found is None:
        return held[0] if held is not None and own else None
    state, n = found
    assert cache is not None and caps.load_state is not None
    try:
        loaded = caps.load_state(state.data, int(state.tokens.shape[0]))
    except Exception as exc:
        log.warning("prompt_cache.restore_failed", error=f"{type(exc).__name__}: {exc}")
        loaded = False
    if not loaded:
        cache.failed(state)
        try:  # never half-loaded: the request prefills from empty
            target.reset()
        except BaseException as exc:
            lost(f"resetting after a failed prompt-cache restore: {type(exc).__name__}: {exc}")
            raise StateLost(f"the target's state was lost after a failed prompt-cache restore: {exc}") from exc
        return None
    cache.restored(state, n)
    return state.tokens


def save_prefix(target: TargetRuntime, cache: PromptCache | None, tokens: TokenArray, tenant: str) -> None:
    """Save what ``target`` holds (``tokens``, of ``tenant``) into ``cache``, unless it already keeps them; a
    state the target cannot copy is only not cached.

    On the thread that drives the target (the shared passes' driver), between passes, on purpose: the
    capture (``save_state``, the copy of the memory) must come before the memory changes and while no
    other thread decodes on the target (one llama.cpp context for every sequence of shared passes).
    Filing the captured state (``PromptCache.put``: no copy of the state, a scan of the entries) costs
    microseconds against the capture's copy, and filing it later, on the request's reader, made requests
    joining at the same pass boundary miss it (issue 44: measured with
    ``test_four_concurrent_requests_share_the_warm_cache_and_equal_cold_runs``), so it stays."""
    caps = target.capabilities
    if cache is None or not caps.saves_states or tokens.shape[0] == 0:
        return
    assert caps.save_state is not None and caps.state_format is not None
    if cache.covers(tokens, state_format=caps.state_format, tenant=tenant, trims=caps.trims_prefix):
        return
    try:
        data = caps.save_state()
    except Exception as exc:
        log.warning("prompt_cache.save_failed", error=f"{type(exc).__name__}: {exc}")
        return
    cache.put(tokens, data, state_format=caps.state_format, tenant=tenant, trims=caps.trims_prefix)
