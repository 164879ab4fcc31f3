"""A tiny deterministic numpy decoder that behaves like llama.cpp's memory, for tests and authors.

One attention layer with a KV cache (rolls back in place at any depth, like ``seq_rm`` on attention
KV) and one recurrent layer whose state can only be rolled back through resident snapshots, exactly
as llama.cpp's ``n_rs_seq``: a decode of ``n`` tokens keeps the states after its last
``min(n, S + 1)`` tokens; one rollback of depth ``d ≤ min(S, n − 1)`` is allowed per decode; deeper
ones need the checkpoint (recurrent state only, like ``PARTIAL_ONLY``) and an exact replay.

Every token is computed on its own, in order, with the same numpy operations whatever the block
size, so a speculative block produces bit-identical rows to one-token-at-a-time decoding.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from power_core.errors import CapacityError, ConfigError, RuntimeFault, StateLost
from power_core.runtime import DecodeResult, TargetCapabilities, TokenArray

__all__ = ["ReferenceModel", "ReferenceTarget", "ReferenceCheckpoint", "parse_spec"]

_SPEC_RE = re.compile(r"^reference(?::(.*))?$")
_SPEC_KEYS = {"seed": int, "vocab": int, "dim": int, "recurrent": int, "eos": int, "sharp": float}


def parse_spec(spec: str | None) -> dict[str, Any]:
    """Parse ``reference[:key=value,...]`` (keys: seed, vocab, dim, recurrent, eos, sharp)."""
    if spec is None:
        return {}
    m = _SPEC_RE.match(spec)
    if not m:
        raise ConfigError("model", spec, "'reference' or 'reference:key=value,...'")
    out: dict[str, Any] = {}
    for part in filter(None, (m.group(1) or "").split(",")):
        key, _, value = part.partition("=")
        if key not in _SPEC_KEYS:
            raise ConfigError("model", spec, f"reference keys {', '.join(_SPEC_KEYS)}", f"unknown key {key!r}")
        try:
            out[key] = _SPEC_KEYS[key](value)
        except ValueError:
            raise ConfigError("model", spec, f"{key}=<{_SPEC_KEYS[key].__name__}>") from None
    return out


@attrs.frozen(eq=False)
class ReferenceModel:
    """Random but fixed weights: embedding → attention (KV) → recurrent layer → logits."""

    seed: int
    vocab: int
    dim: int
    recurrent: bool
    eos: int
    sharp: float
    emb: npt.NDArray[np.float64]
    pos: npt.NDArray[np.float64]
    wq: npt.NDArray[np.float64]
    wk: npt.NDArray[np.float64]
    wv: npt.NDArray[np.float64]
    wa: npt.NDArray[np.float64]
    wb: npt.NDArray[np.float64]
    out: npt.NDArray[np.float64]

    @classmethod
    def create(cls, seed: int = 0, vocab: int = 288, dim: int = 24, recurrent: int = 1, eos: int | None = None,
               sharp: float = 3.0, max_pos: int = 4096) -> ReferenceModel:
        if not 4 <= vocab <= 1 << 16:
            raise ConfigError("model.vocab", vocab, "an integer in [4, 65536]")
        if not 2 <= dim <= 512:
            raise ConfigError("model.dim", dim, "an integer in [2, 512]")
        eos = vocab - 1 if eos is None else eos
        if not 0 <= eos < vocab:
            raise ConfigError("model.eos", eos, f"an id in [0, {vocab})")
        rng = np.random.default_rng(seed)
        s = 1.0 / np.sqrt(dim)
        t = np.arange(max_pos)[:, None] / (10.0 ** (np.arange(dim)[None, :] / dim))
        return cls(
            seed=seed, vocab=vocab, dim=dim, recurrent=bool(recurrent), eos=eos, sharp=sharp,
            emb=rng.normal(0, 1, (vocab, dim)), pos=0.3 * np.sin(t + (np.arange(dim) % 2) * np.pi / 2),
            wq=rng.normal(0, s, (dim, dim)), wk=rng.normal(0, s, (dim, dim)), wv=rng.normal(0, s, (dim, dim)),
            wa=rng.normal(0, 0.8 * s, (dim, dim)), wb=rng.normal(0, s, (dim, dim)),
            out=rng.normal(0, sharp * s, (dim, vocab)),
        )

    @classmethod
    def from_spec(cls, spec: str | None, **defaults: Any) -> ReferenceModel:
        return cls.create(**{**defaults, **parse_spec(spec)})

    @property
    def max_pos(self) -> int:
        return self.pos.shape[0]


@attrs.frozen
class ReferenceCheckpoint:
    """Position mark plus the recurrent state (never the attention KV)."""

    n_past: int
    state: npt.NDArray[np.float64] | None
    serial: int


@attrs.define(eq=False)
class ReferenceTarget:
    """:class:`~power_core.runtime.TargetRuntime` over a :class:`ReferenceModel`.

    ``snapshots`` is the resident rollback window S (only meaningful with a recurrent layer).
    ``fail_on`` lets tests inject a :class:`RuntimeFault` on the n-th decode call.
    """

    model: ReferenceModel
    n_ctx: int = 512
    snapshots: int = 7
    max_block: int = 64
    keys: npt.NDArray[np.float64] = attrs.field(init=False)
    values: npt.NDArray[np.float64] = attrs.field(init=False)
    _n_past: int = attrs.field(init=False, default=0)
    _state: npt.NDArray[np.float64] = attrs.field(init=False)
    _ring: list[npt.NDArray[np.float64]] = attrs.field(init=False, factory=list)  # states after last tokens
    _last_n: int = attrs.field(init=False, default=0)
    _rolled: bool = attrs.field(init=False, default=False)
    _serial: int = attrs.field(init=False, default=0)
    decode_calls: int = attrs.field(init=False, default=0)
    decoded_tokens: int = attrs.field(init=False, default=0)
    _compute_s: float = attrs.field(init=False, default=0.0)
    #: rollback accounting over the target's life, as the llama target keeps it (:meth:`counters`)
    stats: dict[str, int] = attrs.field(init=False, factory=lambda: dict.fromkeys(
        ("rollback_in_place", "rollback_restored", "restores", "decodes"), 0))
    fail_on: int | None = None
    #: a modelled CPU-like verify-cost curve (a pass of b tokens costs 1 + 0.5 (b - 1) one-token
    #: passes) for cost-aware strategies; the reference backend computes every row at the same cost
    verify_cost: tuple[float, ...] | None = None
    #: B > 0: every decode runs exactly B tokens (config ``verify_capacity``); the padding (the last
    #: token repeated at the following positions) gets no logits row and leaves no memory behind
    verify_capacity: int = 0
    #: config ``numerics = "stock"``: model llama.cpp's stock kernels, whose rows depend on what else a
    #: shared pass holds (:meth:`ReferenceBatch.decode_batch` perturbs them), so output under concurrent
    #: load may differ from a solo run, as it does there
    stock: bool = False
    #: who may load its saved states (``TargetCapabilities.state_format``; the opener sets it from the
    #: model's digest and numerics); ``None``: it saves none
    state_format: str | None = None

    def __attrs_post_init__(self) -> None:
        b = self.verify_capacity
        if b and self.model.recurrent:
            raise ConfigError("verify_capacity", b, "0 for a target with a recurrent layer",
                              "padding would advance the recurrent state, which rolls back only once per pass "
                              "(within the resident snapshots) and the round's own rollback needs that")
        if b and self.max_block > b:
            raise ConfigError("verify_capacity", b, f"at least max_block={self.max_block}")
        if self.n_ctx + b > self.model.max_pos:
            raise ConfigError("n_ctx", self.n_ctx, f"at most {self.model.max_pos - b} for the reference model"
                              + (f" with verify_capacity={b}" if b else ""))
        self.keys = np.zeros((self.n_ctx + b, self.model.dim))  # + B cells: the padding of the last pass
        self.values = np.zeros((self.n_ctx + b, self.model.dim))
        self._state = np.zeros(self.model.dim)

    # -- protocol ------------------------------------------------------------------------------------
    @property
    def capabilities(self) -> TargetCapabilities:
        return TargetCapabilities(
            name="reference", n_vocab=self.model.vocab, n_ctx=self.n_ctx, max_block=self.max_block,
            rollback_window=self.snapshots if self.model.recurrent else None,
            eog_ids=frozenset({self.model.eos}), features=frozenset({"hidden"}), verify_cost=self.verify_cost,
            verify_capacity=self.verify_capacity,
            keep_prefix=self.keep_prefix, counters=self.counters, compute_seconds=self.compute_seconds,
            save_state=self.save_state if self.state_format else None,
            load_state=self.load_state if self.state_format else None, state_format=self.state_format,
        )

    @property
    def n_past(self) -> int:
        return self._n_past

    def reset(self) -> None:
        self._n_past = 0
        self._state = np.zeros(self.model.dim)
        self._ring = []
        self._last_n = 0
        self._rolled = False

    def decode(self, tokens: TokenArray) -> DecodeResult:
        return self._pass(tokens, self.verify_capacity)

    def compute_seconds(self) -> float:
        """Seconds spent in its passes (``TargetCapabilities.compute_seconds``)."""
        return self._compute_s

    def _pass(self, tokens: TokenArray, width: int) -> DecodeResult:
        """Decode ``tokens`` in a pass of ``max(width, len(tokens))`` tokens: the rest is padding
        (the last token again at the next positions) whose KV rows lie past ``n_past`` afterwards
        (free cells, overwritten by the next pass) and which gets no logits row."""
        tokens = np.asarray(tokens, dtype=np.int32)
        n = tokens.shape[0]
        if n == 0 or n > self.max_block:
            raise CapacityError(f"decode of {n} tokens; the reference target takes 1..{self.max_block} per pass")
        if self._n_past + n > self.n_ctx:
            raise CapacityError(f"decode would reach {self._n_past + n} tokens; the context holds {self.n_ctx}")
        if tokens.min() < 0 or tokens.max() >= self.model.vocab:
            raise RuntimeFault(f"token id outside [0, {self.model.vocab}) in {tokens.tolist()}")
        self.decode_calls += 1
        if self.fail_on is not None and self.decode_calls == self.fail_on:
            raise RuntimeFault(f"injected decode failure on call {self.decode_calls}")
        t0 = time.perf_counter()
        try:
            return self._forward(tokens, n, width)
        finally:
            self._compute_s += time.perf_counter() - t0

    def _forward(self, tokens: TokenArray, n: int, width: int) -> DecodeResult:
        m = self.model
        logits = np.empty((n, m.vocab), dtype=np.float32)
        hidden = np.empty((n, m.dim), dtype=np.float32)
        keep_ring = self.snapshots + 1 if m.recurrent else 0
        ring: list[npt.NDArray[np.float64]] = []
        state = self._state
        pass_tokens = np.concatenate([tokens, np.full(width - n, tokens[-1], dtype=np.int32)]) if width > n else tokens
        for i in range(pass_tokens.shape[0]):
            p = self._n_past + i
            x = m.emb[pass_tokens[i]] + m.pos[p]
            self.keys[p] = x @ m.wk
            self.values[p] = x @ m.wv
            q = x @ m.wq
            att = self.keys[: p + 1] @ q
            att = np.exp(att - att.max())
            x = x + (att / att.sum()) @ self.values[: p + 1]
            if i >= n:
                continue  # padding: no recurrent layer (refused with padding), no logits row
            if m.recurrent:
                state = np.tanh(state @ m.wa + x @ m.wb)
                x = x + state
                if n - i <= keep_ring:
                    ring.append(state)
            logits[i] = x @ m.out
            hidden[i] = x
        self._state = state
        self._ring = ring
        self._n_past += n
        self._last_n = n
        self._rolled = False
        self.decoded_tokens += n
        self.stats["decodes"] += 1
        return DecodeResult(tokens=tokens, logits=logits, features={"hidden": hidden}, kind="verify")

    def prefill(self, tokens: TokenArray,
                observe: Callable[[DecodeResult], None] | None = None) -> npt.NDArray[np.float32]:
        tokens = np.asarray(tokens, dtype=np.int32)
        for start in range(0, tokens.shape[0], self.max_block):
            res = self._pass(tokens[start:start + self.max_block], 0)  # prompt chunks are never padded
            if observe is not None:
                observe(DecodeResult(tokens=res.tokens, logits=res.logits[:0], features=res.features, kind="prompt"))
        return res.logits[-1]

    def keep_prefix(self, n: int) -> bool:
        """Keep the first ``n`` tokens of memory (prompt reuse). KV trims to any depth; a recurrent
        state cannot go back, so only ``n == n_past`` is possible there."""
        if not 0 < n <= self._n_past or (self.model.recurrent and n != self._n_past):
            return False
        self._n_past = n
        self._ring = []
        self._last_n = 0
        self._rolled = True
        return True

    def save_state(self) -> bytes:
        """The whole memory (``TargetCapabilities.save_state``): the KV rows of the ``n_past`` tokens and
        the recurrent state."""
        n = self._n_past
        return self.keys[:n].tobytes() + self.values[:n].tobytes() + self._state.tobytes()

    def load_state(self, data: bytes, n: int) -> bool:
        """Replace the memory by a :meth:`save_state` of ``n`` tokens (``TargetCapabilities.load_state``);
        False, with the memory empty, when ``data`` is not one."""
        self.reset()
        row = self.model.dim * 8
        if not 0 < n <= self.n_ctx or len(data) != (2 * n + 1) * row:
            return False
        self.keys[:n] = np.frombuffer(data, dtype=np.float64, count=n * self.model.dim).reshape(n, -1)
        self.values[:n] = np.frombuffer(data, dtype=np.float64, count=n * self.model.dim,
                                        offset=n * row).reshape(n, -1)
        self._state = np.frombuffer(data, dtype=np.float64, offset=2 * n * row).copy()
        self._n_past = n
        self._rolled = True
        return True

    def checkpoint(self) -> ReferenceCheckpoint:
        self._serial += 1
        return ReferenceCheckpoint(self._n_past, self._state.copy() if self.model.recurrent else None, self._serial)

    def rollback(self, checkpoint: ReferenceCheckpoint, keep: int) -> bool:
        if not 0 < keep <= self._last_n:
            raise RuntimeFault(f"rollback keep={keep} outside 1..{self._last_n} (tokens of the last decode)")
        depth = self._last_n - keep
        if depth == 0:
            return True
        if not self.model.recurrent:
            self._n_past -= depth
            self._rolled = True
            self.stats["rollback_in_place"] += 1
            return True
        if not self._rolled and depth <= min(self.snapshots, self._last_n - 1):
            # ring[-1] is the state after the last token; ring[-1 - depth] after token keep-1
            self._state = self._ring[-1 - depth]
            self._n_past -= depth
            self._rolled = True
            self.stats["rollback_in_place"] += 1
            return True
        self.restore(checkpoint)
        self.stats["rollback_restored"] += 1
        return False

    def restore(self, checkpoint: ReferenceCheckpoint) -> None:
        if checkpoint.n_past > self._n_past:
            # positions past n_past were discarded; their KV rows may be overwritten already
            raise StateLost(f"checkpoint at {checkpoint.n_past} is ahead of memory at {self._n_past}")
        self._n_past = checkpoint.n_past
        if self.model.recurrent:
            assert checkpoint.state is not None
            self._state = checkpoint.state.copy()
        self._ring = []
        self._last_n = 0
        self._rolled = True
        self.stats["restores"] += 1

    def counters(self) -> dict[str, int]:
        """A snapshot of :attr:`stats` (``TargetCapabilities.counters``: the core reports the
        difference over a request in its receipt's ``backend.rollback``)."""
        return dict(self.stats)
