"""The two seams between the core and the world: :class:`TargetRuntime` and :class:`Proposer`.

The transaction drives both through these protocols only; it never learns which backend or which
adapter runs. They are shaped after llama.cpp's memory, recurrent-rollback and per-sequence state
calls (``include/llama.h``):

* the target's memory holds every committed token except the *anchor* (the last emitted token);
  a round decodes ``[anchor, p1..pk]`` in one pass and reads one logits row per position;
* attention KV can always be trimmed in place; recurrent state can be rolled back in place only
  within the resident snapshot window (llama.cpp ``n_rs_seq``, single use per decode); deeper
  rollbacks restore a saved checkpoint and the core replays the accepted prefix;
* hidden-state taps that an adapter needs (MTP ``h_nextn``, DFlash layer inputs) travel from the
  verify pass to the proposer as named feature arrays in :class:`DecodeResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

from power_core.errors import AdapterFault

__all__ = [
    "TokenArray",
    "TargetCapabilities",
    "DecodeResult",
    "DecodeKind",
    "TargetRuntime",
    "ProposalContext",
    "Proposal",
    "ProposerCapabilities",
    "ProposalBatch",
    "RequestScope",
    "Proposer",
    "BatchItem",
    "BatchRuntime",
    "runtime_counters",
]

#: 1-D ``int32`` token ids
TokenArray = npt.NDArray[np.int32]


def _callable_or_none(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{attribute.name} must be a callable (the runtime's or proposer's own method) or None, "
                        f"not {type(value).__name__}")


def _ability() -> Any:
    """An optional ability: the function that exercises it, or ``None`` where it is absent (never
    compared: two values that differ only in whose method they hold are the same capabilities)."""
    return attrs.field(default=None, eq=False, validator=_callable_or_none)


@attrs.frozen
class TargetCapabilities:
    """What a target runtime can do, declared once by the runtime (its ``capabilities``) and read
    from there by the core: the limits of its memory, and its optional abilities.

    ``rollback_window`` is the deepest in-place rollback (tokens) of the last decode: ``None`` for
    pure attention memory (unbounded), otherwise the resident snapshot count actually granted
    (llama.cpp may silently clamp ``n_rs_seq`` to 0; runtimes report what they got).

    An optional ability is the runtime's own function that exercises it, or ``None`` where the
    runtime lacks it; the core calls it from here and never looks for methods on the runtime:

    * ``keep_prefix(n) -> bool``: keep the first ``n`` tokens of memory and drop the rest (prompt
      reuse, config ``cache_prompt``); False when it cannot (the core then resets and prefills the
      whole prompt);
    * ``cancel()`` / ``clear_abort()`` (both or neither): stop a decode in flight, from any
      thread, and withdraw that for the next request;
    * ``sample_in_graph(on) -> bool``: greedy sampling in its own graph, so only token ids leave the
      backend: ``True`` makes the following passes (``decode`` and ``prefill``) return
      :attr:`DecodeResult.greedy_ids`, each row's first maximum exactly as ``numpy.argmax`` picks
      it, with zero logits rows; ``False`` brings the rows back. Returns whether the ids come from
      the graph now. The core turns it on only for a greedy request that wants no logprobs and whose
      proposer reads no target rows (config ``sampling_in_graph``); ``graph_sampling_pays`` is True
      where the rows would cross a device boundary, and ``sampling_in_graph = "auto"`` samples in
      the graph only then;
    * ``counters() -> Mapping[str, int]``: monotonic counts over its life (``rollback_in_place``,
      ``rollback_restored``, ``restores``, ``decodes``; the llama target adds ``state_copies``); a receipt
      reports the request's own
      difference (``backend.rollback``), never the running totals;
    * ``compute_seconds() -> float``: monotonic seconds its backend has spent computing (llama.cpp:
      inside ``llama_decode`` up to ``llama_synchronize``, so a GPU pass counts whole); a receipt's
      ``host_s`` is the decode time minus the target's and the draft's compute;
    * ``save_state() -> bytes`` / ``load_state(data, n) -> bool`` (both or neither, with a
      ``state_format``): the whole memory of the sequence (attention KV and recurrent state;
      llama.cpp ``llama_state_seq_get_data_ext``/``set_data_ext`` without flags) for the ``n_past``
      tokens it holds, and loading such a state of ``n`` tokens in place of the memory, from any
      sequence of any target whose ``state_format`` is equal (the prompt cache across requests,
      :class:`power_core.memory.PromptCache`). ``load_state`` returns False when it could not, and
      the memory is then empty (as after ``reset``), never half-loaded. ``state_format`` says what
      must match for a saved state to be this target's own: the model file, and what changes the
      numbers its memory holds (kernels, offload); ``None``: its states are never shared.
    * ``memory() -> Mapping[str, Any]``: the bytes it holds, for operators (``power serve`` reports
      them at startup, in ``/v1/models`` and ``/metrics``; never in a receipt: they depend on how
      many sequences share the context): ``{"target": {"weights", "context", "compute"}, "drafts":
      {kind: {...}}}``, a draft on the target's own weights counting none. Read it between passes.
    """

    name: str
    n_vocab: int
    n_ctx: int
    max_block: int
    rollback_window: int | None
    eog_ids: frozenset[int] = frozenset()
    features: frozenset[str] = frozenset()
    digest: str | None = None
    #: relative cost of a verify pass of 1..max_block tokens (``[0] == 1``), when measured
    verify_cost: tuple[float, ...] | None = None
    #: B > 0: every :meth:`TargetRuntime.decode` pass runs exactly B tokens (config
    #: ``verify_capacity``): the block, then padding whose logits are never computed or returned and
    #: whose memory cells are removed before ``decode`` returns, so the result and the memory are the
    #: unpadded pass's (``max_block <= B``); 0: a pass is as wide as its block
    verify_capacity: int = 0
    keep_prefix: Callable[[int], bool] | None = _ability()
    cancel: Callable[[], None] | None = _ability()
    clear_abort: Callable[[], None] | None = _ability()
    sample_in_graph: Callable[[bool], bool] | None = _ability()
    graph_sampling_pays: bool = False
    counters: Callable[[], Mapping[str, int]] | None = _ability()
    compute_seconds: Callable[[], float] | None = _ability()
    memory: Callable[[], Mapping[str, Any]] | None = _ability()
    save_state: Callable[[], bytes] | None = _ability()
    load_state: Callable[[bytes, int], bool] | None = _ability()
    state_format: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.cancel is None) != (self.clear_abort is None):
            raise TypeError(f"target {self.name!r} declares {'cancel' if self.cancel else 'clear_abort'} without "
                            f"{'clear_abort' if self.cancel else 'cancel'}: an interruptible runtime declares both")
        if (self.save_state is None) != (self.load_state is None) or (
                self.save_state is not None and not self.state_format):
            raise TypeError(f"target {self.name!r} declares save_state, load_state and state_format together, or "
                            "none of them: a saved state is only useful to a target that can load it")

    @property
    def saves_states(self) -> bool:
        """Its memory can be saved and loaded (:attr:`save_state`, :attr:`load_state`), and a loaded
        state kept for a prompt (:attr:`keep_prefix`)."""
        return (self.save_state is not None and self.load_state is not None and self.state_format is not None
                and self.keep_prefix is not None)

    @property
    def trims_prefix(self) -> bool:
        """Its memory can be cut back to any prefix of what it holds (``keep_prefix`` with ``n <
        n_past``): pure attention memory can, recurrent memory (a ``rollback_window``) only extends."""
        return self.keep_prefix is not None and self.rollback_window is None

    def in_place(self, depth: int) -> bool:
        """True when removing ``depth`` trailing tokens of the last decode needs no checkpoint."""
        return depth == 0 or self.rollback_window is None or depth <= self.rollback_window


#: what a target pass was: a chunk of the prompt (``"prompt"``: no logits rows, or only the last
#: token's) or a verify pass of ``[anchor, proposals...]`` (``"verify"``: one row per token)
DecodeKind = Literal["prompt", "verify"]


@attrs.frozen
class DecodeResult:
    """Rows of one target pass: ``logits[i]`` predicts the token after ``tokens[i]``.

    Arrays may be zero-copy views into runtime buffers; they are valid until the next pass on the
    runtime's context: the round's own replay (in its commit, before the proposer's ``commit``) or, in a
    shared pass, another sequence's. A proposer copies in ``observe`` what it keeps. ``features``
    carries hidden-state taps requested by the proposer. ``kind`` says what the pass was
    (:data:`DecodeKind`): the runtime that makes the result sets it (``prefill`` chunks are ``"prompt"``,
    ``decode`` passes ``"verify"``), so a proposer never infers it from the number of logits rows.
    """

    tokens: TokenArray
    logits: npt.NDArray[np.float32]
    features: Mapping[str, npt.NDArray[np.float32]] = attrs.field(factory=dict)
    kind: DecodeKind = attrs.field(default="verify", validator=attrs.validators.in_(("prompt", "verify")))
    #: each output row's greedy token id (its first maximum, numpy's ``argmax``), sampled in the
    #: target's graph (:attr:`TargetCapabilities.sample_in_graph`); ``logits`` then has zero rows
    greedy_ids: TokenArray | None = None


@runtime_checkable
class TargetRuntime(Protocol):
    """The authoritative model. Implemented by ``power_native.LlamaTarget`` and the reference backend."""

    @property
    def capabilities(self) -> TargetCapabilities:
        """What it is and can do, declared once (its optional abilities included: the core reads
        them here and never looks for methods on the runtime)."""
        ...

    @property
    def n_past(self) -> int:
        """Tokens currently held in the target's memory."""
        ...

    def decode(self, tokens: TokenArray) -> DecodeResult:
        """Append ``tokens`` at ``n_past`` in one pass and return one logits row per token (padded to
        ``capabilities.verify_capacity`` tokens when that is set; the rows and memory are the block's)."""
        ...

    def prefill(self, tokens: TokenArray,
                observe: Callable[[DecodeResult], None] | None = None) -> npt.NDArray[np.float32] | DecodeResult:
        """Append ``tokens`` at ``n_past`` (prompt processing, in whatever chunking the runtime
        prefers; llama.cpp decodes ``n_batch`` at a time like its own tools) and return the logits
        row of the last token only (or, while greedy sampling runs in the graph, a ``"prompt"``
        :class:`DecodeResult` of the last token with its ``greedy_ids``). ``observe`` (the proposer's) is called once per chunk, right
        after it was decoded, with a :class:`DecodeResult` whose ``tokens`` are the chunk,
        ``logits`` has zero rows and ``features`` holds the requested taps for every chunk token."""
        ...

    def checkpoint(self) -> Any:
        """Retain the current state so that a failure, or a rollback deeper than the resident
        window, can return to it exactly. For attention-only memory this is a position mark; for
        recurrent memory it also holds the recurrent state (llama.cpp ``PARTIAL_ONLY``), never the
        full attention KV."""
        ...

    def rollback(self, checkpoint: Any, keep: int) -> bool:
        """Keep the first ``keep`` tokens of the last decode and discard the rest.

        Returns ``True`` when done in place. Returns ``False`` when the runtime instead restored
        ``checkpoint``; the caller must then replay the ``keep`` accepted tokens."""
        ...

    def restore(self, checkpoint: Any) -> None:
        """Return exactly to ``checkpoint`` (after a failure or cancellation), or raise
        :class:`~power_core.errors.StateLost`."""
        ...

    def reset(self) -> None:
        """Forget every token (new request)."""
        ...


def runtime_counters(target: TargetRuntime) -> dict[str, int]:
    """A snapshot of the target's counters (:attr:`TargetCapabilities.counters`); ``{}`` for a runtime without them."""
    counters = target.capabilities.counters
    return {} if counters is None else {str(k): int(v) for k, v in counters().items()}


@attrs.frozen
class BatchItem:
    """One sequence's tokens in a shared pass: ``rows`` says which logits rows it needs — ``"all"``
    (a verify block), ``"last"`` (a prompt's final chunk) or ``"none"`` (an earlier prompt chunk)."""

    target: TargetRuntime
    tokens: TokenArray
    rows: str = "all"

    def __attrs_post_init__(self) -> None:
        if self.rows not in ("all", "last", "none"):
            raise ValueError(f"BatchItem.rows must be 'all', 'last' or 'none', not {self.rows!r}")

    @property
    def n_rows(self) -> int:
        return {"all": int(self.tokens.shape[0]), "last": 1, "none": 0}[self.rows]


@runtime_checkable
class BatchRuntime(Protocol):
    """Several sequences of one model (each a :class:`TargetRuntime` with its own memory) whose
    tokens one target pass decodes together: llama.cpp's continuous batching.

    :meth:`decode_batch` appends each item's tokens to its sequence (at its ``n_past``) in one pass
    and returns, per item, the rows it asked for; a sequence appears at most once per pass. The
    runtime guarantees nothing about one sequence's rows depending on the others' — whether they
    are bit-identical to a solo pass is what ``power selftest``'s batch probe measures. Each
    result (rows and ``features``: one row per item token) stays valid until the next pass on the
    batch's context: the next :meth:`decode_batch`, or a sequence's own :meth:`TargetRuntime.decode` (a
    replay in its round's commit, or in a :meth:`TargetRuntime.restore`). The round driver reads every
    round's rows of a pass (:meth:`~power_core.transaction.Transaction.read_round`) before any round
    commits or restores, so the runtime hands out views and copies nothing.
    """

    @property
    def sequences(self) -> Sequence[TargetRuntime]: ...

    @property
    def token_budget(self) -> int:
        """The most tokens one pass may hold."""
        ...

    def decode_batch(self, items: Sequence[BatchItem]) -> list[DecodeResult]: ...

    def compute_seconds(self) -> float:
        """Monotonic seconds the shared passes have spent computing (as
        :attr:`TargetCapabilities.compute_seconds`); the engine reads it around each pass."""
        ...

    def close(self) -> None: ...


@attrs.frozen
class ProposalContext:
    """What a proposer may read when asked for tokens: committed history and the round's width."""

    history: TokenArray
    anchor: int
    k: int
    round_index: int


@attrs.frozen(eq=False)
class Proposal:
    """What :meth:`Proposer.propose` returns: the proposed ids, and what the proposer knows of them.

    ``ids``: at most ``ctx.k`` token ids (1-D, integer, within the target's vocabulary) to follow
    ``ctx.anchor``; may be empty (:meth:`none`). ``confidence``: ``None`` (no estimate), or one
    float in ``[0, 1]`` per id, the probability that it is accepted given that the previous one
    was; cost-aware strategies (``Strategy.cost_aware``) use it to choose how much of the
    proposal to verify, and ``observe`` then shows the proposer the block actually verified.
    ``stats``: a few named numbers about how the proposal was made (e.g. a match length); the round
    records them when it commits (a copy) and the receipt sums them over the request (``proposer.stats``).
    ``source``: which
    of the proposer's sources the proposal came from (e.g. a suffix index's ``"request"``,
    ``"shared"`` or ``"corpus"``), when it has several; the receipt counts the tokens offered and
    accepted per source (``proposer.sources``), and ``power serve`` in ``/metrics``.

    The transaction checks every proposal in one place before the target sees it, and refuses a
    bad one with :class:`~power_core.errors.AdapterFault` naming the proposer. A value, compared
    by identity (its arrays have no single truth value): compare ``ids`` instead.
    """

    ids: TokenArray
    confidence: Sequence[float] | npt.NDArray[np.floating[Any]] | None = None
    stats: Mapping[str, float] | None = None
    source: str | None = None

    @classmethod
    def none(cls) -> Proposal:
        """The empty proposal: nothing worth verifying this round."""
        return _NO_PROPOSAL


_NO_PROPOSAL = Proposal(ids=np.zeros(0, dtype=np.int32))


@attrs.frozen
class RequestScope:
    """Whom a request runs for, as a proposer that keeps memories across requests needs to know it
    (:attr:`ProposerCapabilities.request_scope`). ``tenant``: the request's configuration key
    ``tenant`` (``""``: the default tenant); what one tenant's requests taught such a proposer must
    never reach another tenant's proposals unless the proposer was told to share them."""

    tenant: str = ""


@runtime_checkable
class ProposalBatch(Protocol):
    """Draft passes shared by the proposers of several sequences: one draft context holds a
    sequence per request, and each draft step decodes every asking request's tokens in one pass
    (llama.cpp's ``common_speculative_draft`` over its slots).

    The proposers that can be asked together declare the same object as
    :attr:`ProposerCapabilities.batch`; the engine then asks it once per shared target pass for
    every request of the pass whose proposer declared it, instead of each proposer's ``propose``.
    :meth:`propose_many` returns one :class:`Proposal` per ask, in order, each exactly what that
    proposer's ``propose(ctx)`` returns alone (rows are addressed by each sequence's own positions,
    never by where its tokens sit in the pass); a request that asks for fewer tokens leaves the
    pass early. Each proposer's ``compute_seconds`` counts every shared draft pass it took part in,
    as a shared target pass counts for every request in it. When it raises, the proposers' own
    state must be what it was before the call: the engine logs the failure and asks each of them
    alone (its ``propose``), so a fault of one request's draft ends that request only.
    """

    def propose_many(self, asks: Sequence[tuple[Proposer, ProposalContext]]) -> list[Proposal]: ...


@attrs.frozen
class ProposerCapabilities:
    """What a :class:`Proposer` can do beyond the protocol, declared once by the proposer (its
    ``capabilities``, fixed when the strategy's factory made it) and read from there by the core
    through :meth:`of`. ``ProposerCapabilities()`` declares none: a model-free proposer that reads
    no target rows and computes on the host.

    * ``reads_target_rows``: its ``observe`` reads the target's logits rows, so greedy ids are
      not sampled in the target's graph for its requests;
    * ``samples_in_graph``: for a proposer whose drafts are each row's argmax (a draft model or
      head), whether its draft context samples those ids in its own graph (config
      ``sampling_in_graph``) or on the host; the receipt's ``backend.draft_sampling`` says which.
      ``None``: its proposals are no model's argmax;
    * ``compute_seconds() -> float``: monotonic seconds its draft model has spent computing (the
      receipt's ``draft_compute_s``); ``None``: it computes on the host, all of its time is host time;
    * ``close()``: releases what it holds (a draft context); the session calls it once, when it closes;
    * ``request_scope(scope)``: takes the request's :class:`RequestScope`; the transaction calls it
      right before every ``begin`` (a proposer whose memory outlives a request keeps tenants apart
      with it). ``None``: the proposer never needs to know whom a request runs for;
    * ``request_end()``: the request it served has finished (stop, ``max_tokens`` or the context),
      after its last ``commit``: what it committed is final (a proposer that learns across requests
      learns it now, not at the next ``begin``). Called once per finished request, never for one
      that was cancelled or failed; an exception is logged, never the request's failure;
    * ``batch``: the :class:`ProposalBatch` that can ask it together with the proposers of the other
      sequences of its target (the same object for all of them); ``None``: it drafts alone.
    """

    reads_target_rows: bool = False
    samples_in_graph: bool | None = None
    compute_seconds: Callable[[], float] | None = _ability()
    close: Callable[[], None] | None = _ability()
    request_scope: Callable[[RequestScope], None] | None = _ability()
    request_end: Callable[[], None] | None = _ability()
    batch: ProposalBatch | None = attrs.field(default=None, eq=False)

    @classmethod
    def of(cls, proposer: Proposer) -> ProposerCapabilities:
        """``proposer.capabilities``, checked: the one place the core reads them. A proposer that
        declares none, or declares something else, is an :class:`~power_core.errors.AdapterFault`."""
        name = type(proposer).__name__
        try:
            caps = proposer.capabilities
        except AttributeError as exc:
            raise AdapterFault(f"proposer {name} declares no capabilities ({exc}); give the class "
                               "`capabilities = ProposerCapabilities()` (power_core.ProposerCapabilities), with the "
                               "abilities it has, e.g. ProposerCapabilities(close=self.close)", proposer=name,
                               method="capabilities") from None
        if not isinstance(caps, ProposerCapabilities):
            raise AdapterFault(f"proposer {name}.capabilities is a {type(caps).__name__}; expected a "
                               "power_core.ProposerCapabilities", proposer=name, method="capabilities")
        return caps


@runtime_checkable
class Proposer(Protocol):
    """A proposal mechanism. Advisory only: the target verifies every token it proposes.

    One proposer per session (the strategy's factory runs in ``Session.open``). Per request:
    ``begin(prompt)``, then ``observe`` once per prefill chunk (zero logits rows, the taps in
    ``features``); a failed or cancelled prefill resets the target and a re-run calls ``begin``
    again. Round 0 emits from the prefill's last row: ``checkpoint`` → ``commit(0, [first token])``
    with no ``propose`` (its width is 0) and no ``observe`` (the prefill was its verify pass).
    Every later round: ``checkpoint`` → ``propose`` (skipped when ``k`` would be 0) → ``observe``
    (the verify pass of ``[anchor, proposals...]``) → ``commit``; on failure or cancel ``restore``
    with the round's checkpoint instead of (or after) ``commit``. A foreign exception from any
    method becomes :class:`~power_core.errors.AdapterFault`. Token arrays are 1-D ``int32``;
    ``ctx.history`` is a read-only view, valid during the call. ``DecodeResult.kind`` tells a
    prefill chunk (``"prompt"``) from a verify pass (``"verify"``).

    ``propose`` returns a :class:`Proposal`: the ids, and optionally one confidence per id (the
    probability that it is accepted given that the previous one was) and a few statistics.
    ``capabilities`` declares what it can do beyond this protocol (:class:`ProposerCapabilities`:
    a compute clock, a ``close`` for the session's end, ...).

    While greedy sampling runs in the target's graph (:attr:`TargetCapabilities.sample_in_graph`),
    ``observe`` gets zero logits rows and :attr:`DecodeResult.greedy_ids`; a proposer that reads the
    target's logits rows says so (:attr:`ProposerCapabilities.reads_target_rows`) and its requests
    keep the rows.
    """

    #: hidden-state taps this proposer needs from the target's verify pass (may be empty)
    features: frozenset[str]

    @property
    def capabilities(self) -> ProposerCapabilities:
        """What it can do beyond this protocol (``ProposerCapabilities()``: nothing)."""
        ...

    def begin(self, prompt: TokenArray) -> None:
        """Start a request on ``prompt`` (everything before the first anchor, plus the anchor)."""
        ...

    def checkpoint(self) -> Any: ...

    def propose(self, ctx: ProposalContext) -> Proposal:
        """Return at most ``ctx.k`` token ids to follow ``ctx.anchor`` (may be none), as a :class:`Proposal`."""
        ...

    def observe(self, result: DecodeResult) -> None:
        """See the target's verify pass (rows and features) before acceptance is decided."""
        ...

    def commit(self, n_accepted: int, emitted: TokenArray) -> None:
        """Keep the first ``n_accepted`` proposals; ``emitted`` is everything the round emitted
        (accepted proposals followed by the correction or bonus token)."""
        ...

    def restore(self, checkpoint: Any) -> None: ...
