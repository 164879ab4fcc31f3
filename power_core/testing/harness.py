"""What the conformance checks run on: :class:`AdapterHarness` opens sessions of the adapter under test and of
the target alone, and computes once the runs several checks share (configured through the class attributes
that :class:`~power_core.testing.AdapterConformance` documents)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from power_core.config import PowerConfig
from power_core.generation import Result
from power_core.plugins import PowerPlugins, build_plugins
from power_core.runtime import Proposer
from power_core.session import Session
from power_core.spec import Strategy, hookimpl
from power_core.testing.faults import Recorder

__all__ = ["NO_STOP", "AdapterHarness", "first_diff"]

#: the checks that compare proposals run every request to max_tokens (no end-of-generation stop)
NO_STOP: tuple[int, ...] = ()


def _proposals(result: Result) -> list[list[int]]:
    """Per committed round, the proposal the target verified (from the ``trace``)."""
    return [list(r.get("proposal", [])) for r in result.receipt.rounds]


def first_diff(got: Sequence[int], want: Sequence[int]) -> str:
    """Where two token sequences first differ, for a check's message."""
    i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return f"first difference at index {i} ({len(got)} vs {len(want)} tokens)"


class AdapterHarness:
    """The configuration of the checks (class attributes), the hooks a subclass may override, and the
    sessions and runs the checks are built from."""

    strategy_name: ClassVar[str] = ""
    model: ClassVar[str | None] = "reference:seed=11,vocab=97,dim=16,recurrent=1"
    draft: ClassVar[str | None] = None
    k: ClassVar[int] = 5
    seeds: ClassVar[int] = 12
    max_tokens: ClassVar[int] = 48

    # -- hooks for subclasses -------------------------------------------------------------------------
    def strategy(self) -> Strategy | None:
        """Return a :class:`Strategy` to register for the checks (``None``: use an installed one)."""
        return None

    def plugins(self, *extra: object) -> PowerPlugins:
        strategy = self.strategy()
        objs: list[object] = list(extra)
        if strategy is not None:
            chosen: Strategy = strategy

            class _Register:
                __name__ = "power.testing.adapter"

                @hookimpl
                def power_register_strategies(self, register: Callable[[Strategy], None]) -> None:
                    register(chosen)

            objs.append(_Register())
        return build_plugins(extra=tuple(objs))

    def name(self) -> str:
        s = self.strategy()
        return s.name if s is not None else self.strategy_name

    def prompt(self, seed: int, n_vocab: int) -> list[int]:
        """The prompt of the parity checks for ``seed``: 1 to 11 random ids below ``n_vocab - 1``."""
        rng = np.random.default_rng(seed + 1000)
        return rng.integers(0, n_vocab - 1, size=int(rng.integers(1, 12))).tolist()

    def proposing_prompt(self, seed: int, n_vocab: int) -> list[int]:
        """A prompt on which the adapter proposes and gets tokens accepted (the checks that compare
        proposals use it). Default: :meth:`prompt` three times over, which gives a model-free
        adapter something to copy; a model-backed adapter proposes on any prompt."""
        return self.prompt(seed, n_vocab) * 3

    # -- machinery ---------------------------------------------------------------------------------------
    def open(self, mode: str, *extra: object, wrap: Callable[[Proposer], Proposer] | None = None,
             stop_ids: Sequence[int] | None = None, **cfg: Any) -> Session:
        base: dict[str, Any] = dict(spec_mode=mode, spec_draft_max=self.k, max_tokens=self.max_tokens, n_ctx=256)
        base.update(cfg)
        session = Session.open(PowerConfig(**base), model=self.model, draft=self.draft if mode != "off" else None,
                               plugins=self.plugins(*extra),
                               stop_ids=frozenset(stop_ids) if stop_ids is not None else None)
        if wrap is not None and session.proposer is not None:
            session.proposer = wrap(session.proposer)
        return session

    def _memo(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """Runs that several checks share, computed once per test class and configuration."""
        cls = type(self)
        cache: dict[tuple[Any, ...], Any] = cls.__dict__.get("_kit_memo") or {}
        if "_kit_memo" not in cls.__dict__:
            cls._kit_memo = cache  # type: ignore[attr-defined]
        full = (self.model, self.draft, self.k, self.max_tokens, self.name(), *key)
        if full not in cache:
            cache[full] = make()
        return cache[full]

    def reference(self, prompt: list[int], stop_ids: Sequence[int] | None = None, **cfg: Any) -> Result:
        cfg = {k: v for k, v in cfg.items() if k not in ("spec_recurrent_snapshots", "spec_adaptive")}

        def make() -> Result:
            with self.open("off", stop_ids=stop_ids, **cfg) as s:
                return s.generate(prompt)

        stops = None if stop_ids is None else tuple(stop_ids)
        return self._memo(("reference", tuple(prompt), stops, tuple(sorted(cfg.items()))), make)

    def speculative(self, prompt: list[int], *extra: object, **kw: Any) -> Result:
        with self.open(self.name(), *extra, **kw) as s:
            return s.generate(prompt)

    def uninterrupted(self, prompt: list[int]) -> tuple[Result, dict[int, tuple[int, list[int]]]]:
        """A traced run of the adapter (``receipt.rounds[i]["proposal"]``) to ``max_tokens`` (no stop
        ids), and what it offered per round."""

        def make() -> tuple[Result, dict[int, tuple[int, list[int]]]]:
            with self.open(self.name(), wrap=Recorder, trace=True, stop_ids=NO_STOP) as s:
                res = s.generate(prompt)
                return res, dict(getattr(s.proposer, "offered", {}))

        return self._memo(("uninterrupted", tuple(prompt)), make)

    def fresh_at(self, prompt: list[int]) -> tuple[Result, dict[int, tuple[int, list[int]]]]:
        """A fresh session's run of ``prompt`` to ``max_tokens`` and what it offered, keyed by the
        history length each round started from (:attr:`Recorder.at`)."""

        def make() -> tuple[Result, dict[int, tuple[int, list[int]]]]:
            with self.open(self.name(), wrap=Recorder, stop_ids=NO_STOP) as s:
                return s.generate(prompt), dict(getattr(s.proposer, "at", {}))

        return self._memo(("fresh-at", tuple(prompt)), make)

    def n_vocab(self) -> int:
        def make() -> int:
            with self.open("off") as s:
                return s.opened.target.capabilities.n_vocab

        return self._memo(("n_vocab",), make)

    def _fault_round(self, at: str, n_rounds: int) -> int:
        r = {"1": 1, "2": 2}.get(at) or max(3, n_rounds - 2)  # "late": near the end of the request
        return max(1, min(r, n_rounds - 1))

    def _assert_resumed(self, got: Result, want: Result, ref: tuple[int, ...], what: str, from_round: int) -> None:
        assert got.tokens == ref, (f"{what}, the resumed request emitted {list(got.tokens)} but target-only "
                                   f"emitted {list(ref)}; {first_diff(got.tokens, ref)}")
        mine, theirs = _proposals(got), _proposals(want)
        for r in range(from_round, min(len(mine), len(theirs))):
            assert mine[r] == theirs[r], (
                f"{what}, round {r} proposed {mine[r]} but an uninterrupted run proposed {theirs[r]}: "
                "restore(checkpoint) did not return the proposer to the state checkpoint() saw")
        assert len(mine) == len(theirs), (f"{what}, the request took {len(mine)} rounds but an uninterrupted run "
                                          f"took {len(theirs)}")

    def _assert_committed(self, s: Session, gen: Any, prompt: list[int], ref: tuple[int, ...], what: str) -> None:
        committed = gen.tokens
        assert committed == ref[: len(committed)], f"{what}, the committed tokens {list(committed)} are not a " \
                                                   f"prefix of target-only's {list(ref)}"
        want = len(prompt) - 1 + max(len(committed), 1)
        assert s.opened.target.n_past == want, (f"{what}, the target holds {s.opened.target.n_past} tokens but the "
                                                f"last commit left {want}: target memory not restored")
