"""Sessions: load a target once, select a strategy, and run requests through the transaction.

A :class:`Session` owns one opened target (via a backend plugin) and at most one proposer: Power
never loads two draft mechanisms at once. Each request is a :class:`Generation`; when it is
cancelled or fails, its committed tokens stay and :meth:`Generation.run` continues from them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import structlog

from power_core.config import PowerConfig
from power_core.errors import AdapterFault, Cancelled, ConfigError, PowerError, StrategyNotFound
from power_core.plugins import (
    Backend,
    OpenedModel,
    OpenRequest,
    PowerPlugins,
    ProposerRequest,
    check_observers_only,
    get_plugins,
)
from power_core.receipt import Receipt, token_digest
from power_core.runtime import Proposer
from power_core.sampling import TargetSampler
from power_core.scheduler import Scheduler
from power_core.selection import Selection, select
from power_core.transaction import CancelToken, Transaction

__all__ = ["RequestInfo", "Result", "Generation", "Session"]

log = structlog.get_logger(__name__)


@attrs.frozen
class RequestInfo:
    """What observers learn when a request starts."""

    config: PowerConfig
    strategy: str
    backend: str
    prompt_tokens: int
    selection: str


@attrs.frozen
class Result:
    """Emitted tokens, their text (when the model has a tokenizer) and the receipt."""

    tokens: tuple[int, ...]
    text: str | None
    receipt: Receipt


def choose_backend(plugins: PowerPlugins, model: str | None, name: str | None) -> Backend:
    if name is not None:
        if name not in plugins.backends:
            hint = " (pip install power-native)" if name == "llama" else ""
            raise StrategyNotFound(f"backend {name!r} is not installed{hint}; installed: "
                                   f"{', '.join(plugins.backends.names())}")
        return plugins.backends[name]
    for backend in sorted(plugins.backends, key=lambda b: -b.priority):
        if backend.accepts(model):
            return backend
    raise ConfigError("model", model, "a model one installed backend accepts",
                      f"backends: {', '.join(plugins.backends.names())}; GGUF files need power-native")


@attrs.define(eq=False)
class Session:
    """One loaded target, one selected strategy, many requests."""

    config: PowerConfig
    plugins: PowerPlugins
    backend: Backend
    selection: Selection
    opened: OpenedModel
    proposer: Proposer | None
    stop_ids: frozenset[int]

    @classmethod
    def open(cls, config: PowerConfig | None = None, *, model: str | None = None, draft: str | None = None,
             backend: str | None = None, plugins: PowerPlugins | None = None,
             stop_ids: frozenset[int] | None = None, **overrides: Any) -> Session:
        """Select, verify and load. Nothing stays loaded if any step fails."""
        config = PowerConfig.from_mapping(attrs.asdict(config) if config else {}, **overrides)
        plugins = plugins or get_plugins()
        chosen = choose_backend(plugins, model, backend)
        model = chosen.resolve(model)  # e.g. None -> the embedded GGUF, so selection inspects the real file
        selection = select(plugins, config, model=model, draft=draft)
        strategy = selection.strategy
        if strategy.backends and chosen.name not in strategy.backends:
            raise StrategyNotFound(f"strategy {strategy.name!r} runs on backend(s) {sorted(strategy.backends)}, "
                                   f"but model {model!r} is served by {chosen.name!r}")
        speculative = strategy.kind != "target-only"
        if config.spec_draft_max is None and strategy.default_draft_max and speculative:
            config = attrs.evolve(config, spec_draft_max=strategy.default_draft_max)
        if speculative and strategy.proposer is None:
            raise StrategyNotFound(f"strategy {strategy.name!r} ({strategy.package} {strategy.version}) validates "
                                   "artifacts but has no execution path in this version; use spec_mode='off' or "
                                   "another strategy")
        # target-only decoding verifies one token per pass and never rolls back: size the context for that
        request = OpenRequest(model=model, config=config,
                              max_block=config.draft_max + 1 if speculative else 1,
                              snapshots=config.snapshots if speculative else 0,
                              features=strategy.features_for(selection.verified) if speculative else frozenset(),
                              verify_cost=speculative and strategy.cost_aware)
        opened = chosen.open(request)
        try:
            proposer = None
            if speculative:
                assert strategy.proposer is not None
                proposer = strategy.proposer(ProposerRequest(opened=opened, config=config,
                                                             draft=selection.draft or draft,
                                                             verified=selection.verified))
        except BaseException:
            opened.close()
            raise
        stops = opened.target.capabilities.eog_ids if stop_ids is None else frozenset(stop_ids)
        return cls(config=config, plugins=plugins, backend=chosen, selection=selection, opened=opened,
                   proposer=proposer, stop_ids=stops)

    def close(self) -> None:
        """Release the proposer (its optional ``close()``), then the target, even if the former fails."""
        close = getattr(self.proposer, "close", None)
        try:
            if close is not None:
                try:
                    close()
                except PowerError:
                    raise
                except Exception as exc:
                    name = type(self.proposer).__name__
                    raise AdapterFault(f"proposer {name}.close raised {type(exc).__name__}: {exc}; the target "
                                       "was closed anyway", proposer=name, method="close") from exc
        finally:
            self.opened.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: str | Sequence[int]) -> np.ndarray:
        if isinstance(prompt, str):
            if self.opened.tokenizer is None:
                raise ConfigError("prompt", prompt[:40], "token ids", "this model has no tokenizer; pass token ids")
            return np.asarray(self.opened.tokenizer.encode(prompt), dtype=np.int32)
        return np.asarray(list(prompt), dtype=np.int32)

    def start(self, prompt: str | Sequence[int], *, cancel: CancelToken | None = None,
              max_tokens: int | None = None) -> Generation:
        """Prepare a request (nothing runs until :meth:`Generation.run`)."""
        return Generation(self, self.encode(prompt), cancel or CancelToken(),
                          max_tokens or self.config.max_tokens)

    def generate(self, prompt: str | Sequence[int], *, cancel: CancelToken | None = None,
                 max_tokens: int | None = None) -> Result:
        """Run one request to completion and return its tokens, text and receipt."""
        return self.start(prompt, cancel=cancel, max_tokens=max_tokens).run()


@attrs.define(eq=False)
class Generation:
    """One request. ``run()`` drives rounds; after a cancel or failure it resumes from the last commit."""

    session: Session
    prompt: np.ndarray
    cancel: CancelToken
    max_tokens: int
    txn: Transaction | None = None
    receipt: Receipt | None = None
    _prefill_s: float = 0.0
    _prefilled: bool = False
    _decode_s: float = 0.0

    def _transaction(self) -> Transaction:
        s = self.session
        check_observers_only(s.plugins.pm)  # also when a host registered a plugin after loading
        hook = s.plugins.pm.hook.power_txn_phase
        phase_hook = hook if len(hook.get_hookimpls()) > 1 else None  # observers present
        interrupt, withdraw = (getattr(s.opened.target, name, None) for name in ("cancel", "clear_abort"))
        if callable(interrupt) and callable(withdraw):  # the runtime can stop a decode in flight
            self.cancel.subscribe(interrupt, withdraw)
        caps = s.opened.target.capabilities
        scheduler = Scheduler.for_request(s.config, caps.rollback_window, enabled=s.proposer is not None,
                                          costs=caps.verify_cost if s.selection.strategy.cost_aware else None)
        return Transaction(target=s.opened.target, proposer=s.proposer, sampler=TargetSampler.from_config(s.config),
                           scheduler=scheduler, max_tokens=self.max_tokens, stop_ids=s.stop_ids,
                           cancel=self.cancel, phase_hook=phase_hook, trace=s.config.trace)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self.txn.emitted) if self.txn else ()

    def run(self) -> Result:
        s = self.session
        status, error = "completed", None
        try:
            if self.txn is None:
                self.txn = self._transaction()
                s.plugins.pm.hook.power_request_start(request=RequestInfo(
                    config=s.config, strategy=s.selection.strategy.name, backend=s.backend.name,
                    prompt_tokens=int(self.prompt.shape[0]), selection=s.selection.reason))
            if not self._prefilled:  # (again, when a cancel or failure interrupted the prefill)
                t0 = time.perf_counter()
                self.txn.prefill(self.prompt)
                self._prefill_s = time.perf_counter() - t0
                self._prefilled = True
            t0 = time.perf_counter()
            try:
                self.txn.run()
            finally:
                self._decode_s += time.perf_counter() - t0
        except Cancelled as exc:
            status, error = "cancelled", str(exc)
            raise
        except PowerError as exc:
            status, error = "failed", f"{exc.code}: {exc}"
            raise
        except BaseException as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.receipt = self._receipt(status, error)
            s.plugins.pm.hook.power_request_end(receipt=self.receipt)
            log.info("request.end", status=status, strategy=s.selection.strategy.name,
                     tokens=len(self.tokens), **self.receipt.summary())
        text = s.opened.tokenizer.decode(np.asarray(self.tokens, dtype=np.int32)) if s.opened.tokenizer else None
        return Result(tokens=self.tokens, text=text, receipt=self.receipt)

    def _receipt(self, status: str, error: str | None) -> Receipt:
        s = self.session
        txn = self.txn
        st = s.selection.strategy
        n_out = len(self.tokens)
        return Receipt(
            status=status,
            finish_reason=txn.finished if txn else None,
            config=s.config.to_dict(),
            config_sha256=s.config.digest(),
            strategy={"name": st.name, "version": st.version, "package": st.package, "kind": st.kind},
            selection=s.selection.reason,
            backend=copy.deepcopy({"name": s.backend.name, "version": s.backend.version, **s.opened.backend_info}),
            artifacts={**s.opened.artifacts, **s.selection.artifacts},
            prompt_tokens=int(self.prompt.shape[0]),
            output_tokens=n_out,
            output_sha256=token_digest(self.tokens),
            rounds=[r.to_dict() for r in txn.rounds] if txn else [],
            scheduler=txn.scheduler.summary() if txn else {},
            timings={
                "prefill_s": self._prefill_s,
                "decode_s": self._decode_s,
                # the first token comes from the prefill pass (llama.cpp's "eval" rate excludes it too)
                "decode_tok_s": max(n_out - 1, 0) / self._decode_s if self._decode_s > 0 else 0.0,
                "target_passes": txn.target_passes if txn else 0,
            },
            error=error,
        )
