"""The exactness transaction: the seed's seven steps, in order, every round.

1. ``checkpoint`` — retain target, proposer, sampler and decoder state.
2. ``propose``    — ask the proposer for at most the scheduled number of tokens.
3. ``verify``     — decode the anchor and the proposal block in one target pass.
4. ``accept``     — sample target rows only through the first mismatch.
5. ``commit``     — keep the accepted prefix; discard every rejected state row (in place, or by
   restoring the checkpoint and replaying the accepted prefix).
6. ``emit``       — append the accepted proposals plus exactly one correction or bonus token.
7. ``restore``    — on cancellation or any exception, return target, proposer, sampler and decoder
   to the last committed transaction (the start of the round) and re-raise.

Every call into the proposer goes through :meth:`Transaction._call`, the one place where an
exception that is not a :class:`~power_core.errors.PowerError` becomes an
:class:`~power_core.errors.AdapterFault` naming the proposer, the method and the exception.
Observers (``power_txn_phase`` wrappers) see each phase but cannot replace it: the transaction runs
the phase's step itself and takes its result, or its exception, from the step, not from the hook.

The target's memory holds every committed token except the *anchor*, the last emitted token; the
anchor opens the next verify block. The sampler draws emitted position ``p`` from a stream indexed
by ``p`` (:mod:`power_core.sampling`), so a rejected suffix never advances it.

The transaction knows no adapter and no backend: only the protocols in :mod:`power_core.runtime`.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn

import attrs
import numpy as np

from power_core.constraint import Constraint
from power_core.errors import AdapterFault, Cancelled, CapacityError, ConfigError, PluginError, PowerError, RuntimeFault
from power_core.logs import get_logger
from power_core.memory import reusable_prefix
from power_core.rounds import CancelToken, PendingRound, RoundRecord, TokenLogprob  # its values, re-exported
from power_core.runtime import (
    DecodeResult,
    Proposal,
    ProposalContext,
    Proposer,
    ProposerCapabilities,
    RequestScope,
    TargetRuntime,
    TokenArray,
)
from power_core.sampling import TargetSampler
from power_core.scheduler import PassLoad, RoundOutcome, RoundPlan, Scheduler

__all__ = ["PHASES", "CancelToken", "PendingRound", "RoundRecord", "TokenLogprob", "Transaction"]

log = get_logger(__name__)

PHASES = ("checkpoint", "propose", "verify", "accept", "commit", "emit", "restore")
#: greedy rows of at most this many floats in all are argmax'ed in one call (tiny vocabularies); larger
#: ones one row at a time, through the first mismatch only (a 262,144-float row costs more than a call)
_BATCH_ARGMAX = 1 << 16
_EMPTY = np.zeros(0, dtype=np.int32)


def _described(value: object) -> str:
    """A returned value's type, with dtype and shape for an array (what an adapter sees in its code)."""
    if isinstance(value, np.ndarray):
        return f"a bare array ({value.dtype}{list(value.shape)})"
    return "None" if value is None else f"a {type(value).__name__}"


def _given(value: Any) -> Any:
    """A phase step that returns what it is given (round 0's verify pass: the prefill's row)."""
    return value


@attrs.define(eq=False)
class Transaction:
    """Request-local decoder: owns the emitted tokens and runs rounds over target and proposer."""

    target: TargetRuntime
    proposer: Proposer | None
    sampler: TargetSampler
    scheduler: Scheduler
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    cancel: CancelToken = attrs.field(factory=CancelToken)
    phase_hook: Callable[..., Any] | None = None
    trace: bool = False
    #: text stop strings (see :class:`power_core.text.TextAssembler`): called in the accept phase with
    #: the committed tokens and the round's tokens; returns how many of the round's tokens to keep when
    #: a stop string completes in them (the rest are never committed), else ``None``
    stop_text: Callable[[Sequence[int], list[int]], int | None] | None = None
    #: record a :class:`TokenLogprob` with this many alternatives for every emitted token (None: off)
    top_logprobs: int | None = None
    #: config ``sampling_in_graph``: take greedy token ids from the target's graph when the request
    #: allows it, where it pays (``"auto"``) or wherever the runtime can (``"on"``); see :attr:`in_graph`
    sampling_in_graph: str = "off"
    #: the request's greedy ids come from the target's graph (``TargetCapabilities.sample_in_graph``), not
    #: from logits rows on the host; decided in :meth:`start_prefill`
    in_graph: bool = False
    #: what the output must match (:mod:`power_core.constraint`): it masks every sampled row and cuts
    #: proposals at the first token it forbids; advanced once per emitted token, rolled back on restore
    constraint: Constraint | None = None
    #: what the request's proposer declared it can do (:meth:`ProposerCapabilities.of`), read in
    #: :meth:`start_prefill`; nothing for a target-only request
    proposer_caps: ProposerCapabilities = attrs.field(init=False, factory=ProposerCapabilities)
    #: whom the request runs for (config ``tenant``), told to a proposer that asks for it
    #: (:attr:`ProposerCapabilities.request_scope`) right before its ``begin``
    scope: RequestScope = attrs.field(factory=RequestScope)
    # decoder state
    _hist: np.ndarray = attrs.field(factory=lambda: np.zeros(0, dtype=np.int32))  # prompt + emitted, grown x2
    _n_hist: int = 0
    _prefilled: DecodeResult | None = None  # the prefill's last row, consumed by round 0
    emitted: list[int] = attrs.field(factory=list)
    #: one per emitted token when ``top_logprobs`` is set
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    _round_logprobs: list[TokenLogprob] = attrs.field(factory=list)
    anchor: int = -1
    finished: str | None = None
    rounds: list[RoundRecord] = attrs.field(factory=list)
    target_passes: int = 0
    #: width of each target pass this transaction decoded (verify and replay) -> how many: the
    #: block's width, or the runtime's ``verify_capacity`` when it pads (receipt ``backend.verify_widths``)
    verify_widths: dict[int, int] = attrs.field(factory=dict)
    #: prompt tokens whose target state was kept from the previous request (``prefill(resident=...)``)
    reused: int = 0
    #: why the target's state is unknown (a failed restore), else ``None``
    state_lost: str | None = None
    _prompt: np.ndarray = attrs.field(factory=lambda: _EMPTY)

    @property
    def history(self) -> TokenArray:
        """Prompt plus emitted tokens (a read-only view; its last element is the anchor)."""
        view = self._hist[: self._n_hist]
        view.flags.writeable = False
        return view

    # -- request start -------------------------------------------------------------------------
    def start_prefill(self, prompt: Iterable[int], resident: TokenArray | None = None) -> TokenArray:
        """Check the prompt, keep what the target's memory shares with it (``resident``), begin the
        proposer, and return the prompt tokens still to be decoded (:meth:`prefill` decodes them).
        On failure the target is reset."""
        tokens = np.ascontiguousarray(np.asarray(list(prompt), dtype=np.int32))
        caps = self.target.capabilities
        if tokens.ndim != 1 or tokens.shape[0] == 0:
            raise CapacityError("the prompt is empty; give at least one token (e.g. BOS)")
        bad = tokens[(tokens < 0) | (tokens >= caps.n_vocab)]
        if bad.size:
            raise CapacityError(f"prompt token id {int(bad[0])} is outside the vocabulary [0, {caps.n_vocab})")
        if tokens.shape[0] >= caps.n_ctx:
            raise CapacityError(f"the prompt has {tokens.shape[0]} tokens but the context holds {caps.n_ctx}; "
                                "raise n_ctx or shorten the prompt (one slot is needed to generate)")
        for tok, _ in self.sampler.logit_bias:
            if tok >= caps.n_vocab:
                raise ConfigError("logit_bias", tok, f"token ids in [0, {caps.n_vocab}) (the model's vocabulary)")
        self._choose_sampling()
        keep = 0
        if resident is not None and resident.shape[0]:
            keep = reusable_prefix(resident, tokens, trims=caps.trims_prefix)
            if keep and (caps.keep_prefix is None or not caps.keep_prefix(keep)):
                keep = 0
        if keep == 0:
            self.target.reset()
        self.reused = keep
        try:
            if self.proposer is not None:
                # begin first: the proposer sees every prefill batch (llama.cpp feeds its drafters the
                # prompt's ubatches too), e.g. to fill an MTP or DFlash draft KV from the target's taps
                if (told := self.proposer_caps.request_scope) is not None:
                    self._call("request_scope", self.scope, fn=told)
                self._call("begin", tokens)
        except BaseException:
            self.target.reset()
            raise
        self._prompt = tokens
        return tokens[keep:]

    def _choose_sampling(self) -> None:
        """In-graph greedy ids when the config asks for them (``on``, or ``auto`` where the runtime
        says they pay), the request is greedy, wants no logprobs, its proposer reads no target rows
        and the runtime can; otherwise the runtime hands over logits rows (it is told either way: a
        previous request may have turned its graph sampling on). Both sides' capabilities are read
        here, once per request."""
        if self.proposer is not None:
            self.proposer_caps = ProposerCapabilities.of(self.proposer)
        rows = self.proposer_caps.reads_target_rows
        caps = self.target.capabilities
        if caps.sample_in_graph is None:
            self.in_graph = False
            return
        mode = self.sampling_in_graph
        wanted = mode == "on" or (mode == "auto" and caps.graph_sampling_pays)
        want = (wanted and self.sampler.greedy and self.top_logprobs is None and not rows
                and not self.sampler.adjusts and self.constraint is None)
        self.in_graph = caps.sample_in_graph(want)

    def prefill(self, prompt: Iterable[int], resident: TokenArray | None = None) -> None:
        """Process the whole prompt in one prefill; its last row is the first round's verify row.

        The last prompt token is the first anchor. Because the prefill already placed it in memory
        and produced its row, round 0 is a zero-proposal round whose verify pass is the prefill —
        exactly how llama.cpp's own tools start generating.

        ``resident``: the tokens the target's memory holds now (the previous request's committed
        history, for prompt reuse). Their longest common prefix with the prompt, short of its last
        token, is kept when the runtime can trim to it (``TargetCapabilities.keep_prefix``), and only
        the rest is prefilled; :attr:`reused` says how many. The proposer still begins on the whole
        prompt and observes the chunks actually decoded.
        """
        rest = self.start_prefill(prompt, resident)
        try:
            row = self.target.prefill(rest, self.observe_prompt if self.proposer is not None else None)
        except BaseException:
            # nothing stays half-loaded: the request starts over (begin included) when it is run again
            self.target.reset()
            raise
        self.finish_prefill(row)

    def finish_prefill(self, row: Any) -> None:
        """The prompt is in the target's memory and ``row`` is its last token's logits row (or the
        runtime's :class:`DecodeResult` of it, with in-graph greedy ids): round 0 can run. (A round
        driver that decodes prompt chunks itself calls this after the last one.)"""
        tokens = self._prompt
        if isinstance(row, DecodeResult):
            self._prefilled = attrs.evolve(row, tokens=tokens[-1:], kind="prompt")
        else:
            self._prefilled = DecodeResult(tokens=tokens[-1:], logits=np.asarray(row).reshape(1, -1), kind="prompt")
        self._hist = np.empty(max(64, 2 * tokens.shape[0]), dtype=np.int32)
        self._hist[: tokens.shape[0]] = tokens
        self._n_hist = tokens.shape[0]
        self.anchor = int(tokens[-1])

    def observe_prompt(self, res: DecodeResult) -> None:
        """A prompt chunk was decoded (by :meth:`prefill`, or by a round driver between
        :meth:`start_prefill` and :meth:`finish_prefill`): the proposer observes it, e.g. to fill
        an MTP or DFlash draft KV from its taps."""
        if self.proposer is not None:
            # a prompt chunk, whatever the runtime said (a third-party runtime may not set ``kind``)
            self._call("observe", res if res.kind == "prompt" else attrs.evolve(res, kind="prompt"))

    # -- the one door into the proposer ---------------------------------------------------------------
    def _call(self, method: str, *args: Any, fn: Callable[..., Any] | None = None) -> Any:
        """Call ``proposer.<method>(*args)`` (or ``fn``, the ability of that name it declared in its
        capabilities); a foreign exception becomes :class:`AdapterFault`.

        A :class:`PowerError` (e.g. a native runtime's typed error) passes through unchanged, and so
        does a ``BaseException`` that is not an ``Exception`` (``KeyboardInterrupt``). The caller's
        round then restores, as for any failure.
        """
        try:
            return (fn or getattr(self.proposer, method))(*args)
        except PowerError:
            raise
        except Exception as exc:
            name = type(self.proposer).__name__
            raise AdapterFault(f"proposer {name}.{method} raised {type(exc).__name__}: {exc} (round "
                               f"{len(self.rounds)}); Power restores the last committed state. Fix the adapter: "
                               "a proposer raises only power_core errors on purpose", proposer=name,
                               method=method) from exc

    # -- phases ------------------------------------------------------------------------------------
    def _phase(self, name: str, step: Callable[..., Any], *args: Any, required: bool = False) -> Any:
        """Run one phase, ``step(*args)``, through the observers' ``power_txn_phase`` wrappers when there
        are any (none: a direct call, the hot path).

        The result (or exception) is the step's own: a wrapper may time, log or raise (a failure of
        the round, which then restores), but cannot swallow the step's exception or replace its
        result. A ``required`` phase (restore) runs even when an observer fails before it, and an
        observer's exception there never replaces the round's own.
        """
        if self.phase_hook is None:
            return step(*args)
        outcome: list[tuple[bool, Any]] = []

        def run() -> Any:
            try:
                value = step(*args)
            except BaseException as exc:
                outcome.append((False, exc))
                raise
            outcome.append((True, value))
            return value

        try:
            self.phase_hook(phase=name, round_index=len(self.rounds), step=run)
        except BaseException as exc:
            if outcome and not outcome[0][0]:
                raise outcome[0][1] from None  # the step's own failure, whatever the observer made of it
            if not required:
                raise
            log.warning("txn.observer_failed", phase=name, error=f"{type(exc).__name__}: {exc}")
            if not outcome:
                run()
        if not outcome:
            raise PluginError(f"the {name!r} phase of round {len(self.rounds)} never ran: a plugin answered "
                              "power_txn_phase instead of Power's core. Only observers may implement it, with "
                              "@hookimpl(wrapper=True)")
        ok, value = outcome[0]
        if not ok:
            raise value  # an observer swallowed the step's exception; the transaction still fails
        return value

    def _check_cancel(self) -> None:
        if self.cancel.cancelled:
            raise Cancelled(f"generation cancelled in round {len(self.rounds)}; "
                            f"{len(self.emitted)} committed tokens are kept and generation can resume")

    def _width(self, planned: int, room: int, max_block: int) -> int:
        """Clamp the planned width so the round never emits past max_tokens or the context (``room``:
        the free slots after the anchor's)."""
        remaining = self.max_tokens - len(self.emitted)
        return max(0, min(planned, remaining - 1, room, max_block - 1))

    def _propose(self, ask: ProposalContext | None, given: Proposal | None = None) -> Proposal:
        """Ask for at most ``ask.k`` ids (or take ``given``, the answer of a batch that asked for
        them) and check the :class:`Proposal` (the one place a proposal is checked): 1-D integer
        ids, at most ``k``, inside the vocabulary; a confidence in ``[0, 1]`` per id; statistics a
        mapping. Returns it with ``ids`` as ``int32``."""
        if ask is None:
            return Proposal.none()
        k = ask.k
        got = given if given is not None else self._call("propose", ask)
        if not isinstance(got, Proposal):
            self._refuse(f"returned {_described(got)}, not a Proposal; return power_core.Proposal(ids) "
                         "(e.g. Proposal(np.asarray(ids, dtype=np.int32)), Proposal.none() for no proposal)")
        props = np.asarray(got.ids)
        if props.ndim != 1 or (props.size and props.dtype.kind not in "iu"):  # signed or unsigned integers
            self._refuse(f"returned {props.dtype}{list(props.shape)}; expected 1-D integer ids")
        if props.shape[0] > k:
            self._refuse(f"returned {props.shape[0]} tokens but the round allows at most ctx.k={k}")
        n_vocab = self.target.capabilities.n_vocab
        ids = props.tolist()  # a few ids: Python's min/max beat two numpy reductions
        if ids and (min(ids) < 0 or max(ids) >= n_vocab):
            self._refuse(f"returned token id outside [0, {n_vocab}) (the target's n_vocab): {ids}")
        conf = got.confidence
        if conf is not None:
            try:
                p = [float(x) for x in conf]
            except (TypeError, ValueError):
                self._refuse(f"returned a confidence of {_described(conf)}; expected one float per id, or None")
            if len(p) != len(ids):
                self._refuse(f"returned {len(p)} confidences for {len(ids)} ids; give one per id, or None")
            if not all(0.0 <= x <= 1.0 for x in p):  # NaN fails too
                self._refuse(f"returned a confidence outside [0, 1]: {p}")
        stats = got.stats
        if stats is not None:
            if not isinstance(stats, Mapping):
                self._refuse(f"returned stats of type {type(stats).__name__}; expected a mapping of names to numbers")
            # names to finite floats are taken as they are (the hot path: no copy, no evolve)
            if not all(type(k) is str and type(v) is float and math.isfinite(v) for k, v in stats.items()):
                if not all(isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
                           and math.isfinite(v) for k, v in stats.items()):
                    self._refuse(f"returned stats {dict(stats)!r}; expected names (str) to finite numbers")
                stats = {k: float(v) for k, v in stats.items()}
        if got.source is not None and not isinstance(got.source, str):
            self._refuse(f"returned a source of type {type(got.source).__name__}; expected a name (str) or None")
        if props.dtype != np.int32 or props is not got.ids or stats is not got.stats:
            return attrs.evolve(got, ids=props.astype(np.int32), stats=stats)
        return got

    def _refuse(self, what: str) -> NoReturn:
        name = type(self.proposer).__name__
        raise AdapterFault(f"proposer {name}.propose in round {len(self.rounds)} {what}", proposer=name)

    def _choose_width(self, proposal: Proposal, load: PassLoad | None) -> tuple[TokenArray, dict[str, Any] | None]:
        """Cost-aware width: verify the prefix the scheduler finds worth its pass (cost curve x the
        proposal's confidence; all of it when either is missing)."""
        props = proposal.ids
        if self.scheduler.costs is None or props.shape[0] == 0 or proposal.confidence is None:
            return props, None
        w, info = self.scheduler.choose_width(proposal.confidence, props.shape[0], load)
        return props[:w], info

    def _verify(self, block: TokenArray, res: DecodeResult | None = None) -> DecodeResult:
        """The verify pass over ``block``: decoded here, or ``res`` when a round driver decoded it
        together with other requests' blocks (one target pass shared by the batch)."""
        if res is None:
            res = self._decode(block)
        else:
            self.target_passes += 1
        if res.greedy_ids is not None:
            if res.greedy_ids.shape[0] < block.shape[0]:
                raise RuntimeFault(f"target returned {res.greedy_ids.shape[0]} greedy ids for a "
                                   f"{block.shape[0]}-token block")
            return self._observe(res)
        shape = getattr(res.logits, "shape", None)
        if shape is None or len(shape) != 2 or shape[0] < block.shape[0]:
            raise RuntimeFault(f"target returned logits of shape {shape} for a {block.shape[0]}-token block")
        return self._observe(res)

    def _decode(self, block: TokenArray) -> DecodeResult:
        """One target pass of this transaction's own, counted by its width."""
        res = self.target.decode(block)
        self.target_passes += 1
        width = max(block.shape[0], self.target.capabilities.verify_capacity)
        self.verify_widths[width] = self.verify_widths.get(width, 0) + 1
        return res

    def _observe(self, res: DecodeResult) -> DecodeResult:
        if self.proposer is not None:
            self._call("observe", res)
        return res

    def _accept(self, props: TokenArray, res: DecodeResult) -> tuple[list[int], int, str | None]:
        """Sample rows through the first mismatch. Returns (emitted, accepted, stop reason).

        With a constraint, each emitted token advances it as soon as it is sampled (the next row's
        mask is the state after it); :meth:`_cut_at_stop_text` and :meth:`_restore` roll it back."""
        out: list[int] = []
        accepted = 0
        base = len(self.emitted)
        n = props.shape[0]
        lp = self._round_logprobs
        lp.clear()
        greedy = self.sampler.greedy
        plain = not self.sampler.adjusts and self.constraint is None
        ids = res.greedy_ids if greedy else None  # the graph's first maximum: np.argmax's
        if ids is None and greedy and plain and res.logits.shape[1] * (n + 1) <= _BATCH_ARGMAX:
            ids = res.logits[: n + 1].argmax(axis=1)  # small rows: one call beats a call per row
        first = ids[: n + 1].tolist() if ids is not None and plain else None
        drafted = props.tolist()
        for j in range(n + 1):
            if first is not None:
                tok = first[j]
            elif plain:
                tok = self.sampler.sample(res.logits[j], base + j)
            else:
                tok = self._pick(res.logits[j], base + j, out)
            out.append(tok)
            if self.top_logprobs is not None:
                lp.append(TokenLogprob.from_row(res.logits[j], tok, self.top_logprobs))
            hit = j < n and tok == drafted[j]
            accepted += hit
            if tok in self.stop_ids:
                return out, accepted, "stop"
            if base + len(out) >= self.max_tokens:
                return out, accepted, "max_tokens"
            if not hit:
                break
        return out, accepted, None

    def _pick(self, row: Any, position: int, out: list[int]) -> int:
        """One row through the request's bias and penalties (over the history this row would have had
        autoregressively: committed tokens plus ``out``, the round's tokens before it) and its
        constraint, then the sampler. The constraint advances over the token."""
        sampler, constraint = self.sampler, self.constraint
        x = row
        if sampler.adjusts:
            hist = self._hist[: self._n_hist]
            x = sampler.adjust(row, np.concatenate((hist, np.asarray(out, dtype=np.int32))) if out else hist)
        if constraint is None:
            return sampler.sample(x, position)
        if sampler.greedy:
            tok = int(np.argmax(x))  # the first maximum is the masked row's when the grammar allows it
            if constraint.allows((tok,)) == 0:
                tok = int(np.argmax(constraint.mask(x)))
        else:
            tok = sampler.sample(constraint.mask(x), position)
        constraint.advance((tok,))
        return tok

    def _accept_round(self, props: TokenArray, res: DecodeResult) -> tuple[list[int], int, str | None]:
        """The accept phase: :meth:`_accept`, cut at a completed stop string."""
        return self._cut_at_stop_text(*self._accept(props, res))

    def _cut_at_stop_text(self, out: list[int], accepted: int, stop: str | None) -> tuple[list[int], int, str | None]:
        """End the round after the token that completes a stop string; later tokens are not emitted."""
        if self.stop_text is not None:
            keep = self.stop_text(self.emitted, out)
            if keep is not None:
                if self.constraint is not None:
                    self.constraint.rollback(len(out) - keep)
                return out[:keep], min(accepted, keep), "stop"
        return out, accepted, stop

    def _commit(self, cp: Any, block: TokenArray, out: list[int], accepted: int) -> bool:
        """Keep the anchor and the accepted proposals; discard the rest. True when it replayed."""
        keep = len(out)  # the anchor plus every emitted token but the last (the next anchor)
        replayed = False
        if keep < block.shape[0] and not self.target.rollback(cp, keep):
            self._decode(block[:keep])  # exact replay of the accepted prefix
            replayed = True
        if self.proposer is not None:
            self._call("commit", accepted, np.asarray(out, dtype=np.int32))
        return replayed

    # -- one round -------------------------------------------------------------------------------
    def step(self) -> RoundRecord | None:
        """Run one round (a solo pass). Returns its record, or ``None`` when the request had already finished."""
        pending = self.open_round()
        return None if pending is None else self.close_round(pending)

    def open_round(self, load: PassLoad | None = None) -> PendingRound | None:
        """Steps 1-2 of a round: checkpoint, propose. Returns the verify block to decode (``None``
        when the request has finished). ``load``: what the shared pass already holds, so the
        cost-aware width weighs this request's block against the whole pass (``None``: a solo pass). A
        round driver that batches several requests' verify passes decodes ``pending.block`` itself and
        hands the rows to :meth:`close_round`; the round is then open until :meth:`close_round` or
        :meth:`abort_round` (on any failure of the shared pass). It is :meth:`begin_round` then
        :meth:`offer`, which a driver that asks several proposers together calls apart."""
        pending = self.begin_round()
        return None if pending is None else self.offer(pending, None, load)

    def begin_round(self) -> PendingRound | None:
        """Step 1: checkpoint, and what the proposer is to be asked (``pending.ask``: ``None`` when
        the round proposes nothing). ``None`` when the request has finished. The round is open from
        here: :meth:`offer` next, or :meth:`abort_round` on a failure before it."""
        if self.finished is not None:
            return None
        t0 = time.perf_counter()
        caps = self.target.capabilities
        room = caps.n_ctx - self.target.n_past - 1  # the anchor needs one slot
        if room < 0:
            self.finished = "context"
            return None
        first = self._prefilled
        plan = RoundPlan(0, "prefill") if first is not None else self.scheduler.plan()
        k = self._width(plan.k, room, caps.max_block)
        self._check_cancel()
        cp_target, cp_proposer = self._phase("checkpoint", self._checkpoint)
        decoder = (len(self.emitted), self.anchor, self.finished)  # sampler state is len(emitted)
        ask = None if k == 0 or self.proposer is None else ProposalContext(
            history=self.history, anchor=self.anchor, k=k, round_index=len(self.rounds))
        return PendingRound(t0=t0, plan=plan, first=first, cp_target=cp_target, cp_proposer=cp_proposer,
                            decoder=decoder, ask=ask)

    def offer(self, pending: PendingRound, proposal: Proposal | None = None,
              load: PassLoad | None = None) -> PendingRound:
        """Step 2: the proposal for ``pending.ask`` — ``proposal`` when a driver asked the proposer
        together with others (:class:`~power_core.runtime.ProposalBatch`), else the proposer's own
        ``propose`` — checked, cut to the width worth verifying and at the first token the
        constraint forbids; ``pending.block`` is then the verify block. On a failure the round
        restores and the exception propagates."""
        try:
            self._check_cancel()
            got = self._phase("propose", self._propose, pending.ask, proposal)
            pending.proposal = got
            props, pending.width = self._choose_width(got, load)
            if self.constraint is not None and props.shape[0]:
                ok = self.constraint.allows(props.tolist())
                pending.cut = props.shape[0] - ok
                if pending.cut:
                    self.constraint.stats.cuts += 1
                    self.constraint.stats.cut_tokens += pending.cut
                props = props[:ok]
            self._check_cancel()
            block = np.empty(props.shape[0] + 1, dtype=np.int32)
            block[0] = self.anchor
            block[1:] = props
            pending.props, pending.block = props, block
        except BaseException as exc:
            self.abort_round(pending, exc)
            raise
        return pending

    def read_round(self, pending: PendingRound, rows: DecodeResult | None = None, *, restore: bool = True) -> None:
        """Steps 3-4: verify (decode ``pending.block`` here, or take ``rows`` from a round driver's
        shared pass; the proposer observes them) and accept; ``pending`` keeps what was accepted. After
        this the round reads no row again, so a driver whose shared pass other rounds may decode over
        (a replay in their commit, or in a restore) reads every round's rows first, then closes them
        (:meth:`close_round`). On any failure, step 7 (restore) and re-raise; with ``restore`` False the
        round stays open instead, and the driver restores it (:meth:`abort_round`) once the other rounds
        of its pass have read their rows."""
        first = pending.first
        try:
            # round 0's verify pass is the prefill, which the proposer has already observed
            res = self._phase("verify", self._verify, pending.block, rows) if first is None else \
                self._phase("verify", _given, first)
            self._check_cancel()
            pending.accept = self._phase("accept", self._accept_round, pending.props, res)
        except BaseException as exc:
            if restore:
                self.abort_round(pending, exc)
            raise

    def close_round(self, pending: PendingRound, rows: DecodeResult | None = None) -> RoundRecord:
        """Steps 3-6: :meth:`read_round` (unless the driver has read it), then commit and emit; on any
        failure, step 7 (restore) and re-raise."""
        if pending.accept is None:
            self.read_round(pending, rows)
        assert pending.accept is not None
        first, block, props = pending.first, pending.block, pending.props
        out, accepted, stop = pending.accept
        try:
            self._check_cancel()
            replayed = self._phase("commit", self._commit, pending.cp_target, block, out, accepted)
            self._phase("emit", self._emit, out, stop)
        except BaseException as exc:
            self.abort_round(pending, exc)
            raise
        # the round is committed: record it (pure bookkeeping, cannot fail)
        plan = pending.plan
        if first is None:
            self.scheduler.record(plan, RoundOutcome(proposed=props.shape[0], accepted=accepted, replayed=replayed,
                                                     offered=pending.proposal.ids.shape[0]))
        self._prefilled = None
        record = RoundRecord(index=len(self.rounds), planned=plan.k, reason=plan.reason, proposed=props.shape[0],
                             accepted=accepted, emitted=len(out), replayed=replayed, shape=block.shape[0],
                             stop=self.finished, seconds=time.perf_counter() - pending.t0,
                             proposal=tuple(int(t) for t in props) if self.trace else None, width=pending.width,
                             cut=pending.cut, source=pending.proposal.source,
                             stats=None if pending.proposal.stats is None else dict(pending.proposal.stats))
        self.rounds.append(record)
        if log.isEnabledFor(logging.DEBUG):  # per-round detail costs nothing when debug is off
            log.debug("txn.commit", round=record)
        return record

    def abort_round(self, pending: PendingRound, exc: BaseException) -> None:
        """Step 7: return target, proposer, sampler and decoder to the start of the open round."""
        self._phase("restore", self._restore, pending.cp_target, pending.cp_proposer, pending.decoder, exc,
                    required=True)

    def _checkpoint(self) -> tuple[Any, Any]:
        cp_target = self.target.checkpoint()
        try:
            cp_proposer = self._call("checkpoint") if self.proposer is not None else None
        except BaseException:
            self.target.restore(cp_target)  # the proposer has no checkpoint to restore to
            raise
        return cp_target, cp_proposer

    def _restore(self, cp_target: Any, cp_proposer: Any, decoder: tuple[int, int, str | None],
                 exc: BaseException) -> None:
        # the decoder first (pure bookkeeping, cannot fail), then the target, then the proposer
        n_emitted, self.anchor, self.finished = decoder
        if self.constraint is not None:  # it has advanced over every token sampled since: emitted or not
            self.constraint.rollback(self.constraint.consumed - n_emitted)
        self._n_hist -= len(self.emitted) - n_emitted
        del self.emitted[n_emitted:]
        del self.logprobs[n_emitted:]
        try:
            self.target.restore(cp_target)
        except BaseException as lost:
            # the target's state is unknown now: its session must refuse every later request
            self.state_lost = f"restore after {type(exc).__name__} failed: {type(lost).__name__}: {lost}"
            raise
        log.info("txn.restore", round=len(self.rounds), error=type(exc).__name__, n_past=self.target.n_past)
        if self.proposer is None:
            return
        try:
            self._call("restore", cp_proposer)
        except Exception as fault:
            # the proposer's state is unknown: finish this request without it (exact, target-only);
            # the next request begins it afresh
            name = type(self.proposer).__name__
            self.proposer = None
            log.warning("txn.proposer_lost", round=len(self.rounds), error=str(fault))
            raise AdapterFault(f"{fault} (while restoring after {type(exc).__name__}: {exc}). The target was "
                               "restored; the rest of this request runs target-only (still exact) and the next "
                               "request calls begin() again", proposer=name, method="restore") from fault

    def _emit(self, out: list[int], stop: str | None) -> None:
        self.emitted.extend(out)
        if self.top_logprobs is not None:
            self.logprobs.extend(self._round_logprobs[: len(out)])
        need = self._n_hist + len(out)
        if need > self._hist.shape[0]:
            grown = np.empty(2 * need, dtype=np.int32)
            grown[: self._n_hist] = self._hist[: self._n_hist]
            self._hist = grown
        self._hist[self._n_hist:need] = out
        self._n_hist = need
        self.anchor = out[-1]
        if stop is not None:
            self.finished = stop
        elif len(self.emitted) >= self.max_tokens:
            self.finished = "max_tokens"
