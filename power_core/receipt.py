"""Receipts: the evidence every request yields (JSON, versioned schema ``power.receipt/1``).

A receipt carries what is needed to reproduce and audit a request: the config hash, artifact
digests, the adapter and backend with versions, every round's proposal/acceptance/replay, the
scheduler's decisions, and ``output_sha256`` — sha256 over the emitted token ids as int32
little-endian. ``receipt_sha256`` hashes everything except timings, so two runs that behaved the
same have the same receipt hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import orjson

__all__ = ["CANONICAL", "SCHEMA", "Receipt", "proposer_stats", "token_digest"]

SCHEMA = "power.receipt/1"

#: the canonical JSON :meth:`Receipt.digest` hashes: keys sorted at every level (a dict's integer keys as strings),
#: no whitespace, UTF-8, as orjson writes it. Where the receipt's text is ASCII, its non-zero floats are at least 1e-4
#: in magnitude and a dict's integer keys have one number of digits, these are the bytes of
#: ``json.dumps(body, sort_keys=True, separators=(",", ":"))``; orjson writes a 192-round receipt's in a seventh of
#: the time (docs/evidence/bench_drafts/lean-end-2026-12-07)
CANONICAL = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS


def token_digest(tokens: Sequence[int]) -> str:
    """sha256 over the token ids as int32 little-endian."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def proposer_stats(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The proposer's statistics over a request, in one shape for every proposer, from the rounds
    alone (llama.cpp keeps the same counts for each of its drafters): ``drafts`` (rounds in which
    the proposer offered tokens), ``drafted`` (tokens it offered: ``width.offered`` where a
    cost-aware width verified only a prefix, else ``proposed``), ``accepted`` (proposals the target
    accepted), ``accepted_per_position`` (``[i]``: drafts whose proposal ``i`` was accepted; one
    entry per position ever offered), ``sources`` (per ``Proposal.source`` a round named: the same
    ``drafts``, ``drafted`` and ``accepted`` of its proposals) and ``stats`` (each ``Proposal.stats``
    name, summed over the rounds that gave it)."""
    drafts = drafted = accepted = 0
    per_position: list[int] = []
    sources: dict[str, dict[str, int]] = {}
    stats: dict[str, float] = {}
    for r in rounds:
        for name, value in (r.get("stats") or {}).items():
            stats[name] = stats.get(name, 0.0) + float(value)
        width = r.get("width") or {}
        offered = int(width.get("offered", r["proposed"]))
        if offered <= 0:
            continue
        drafts += 1
        drafted += offered
        n = int(r["accepted"])
        accepted += n
        if len(per_position) < offered:
            per_position.extend([0] * (offered - len(per_position)))
        for i in range(n):
            per_position[i] += 1
        if (source := r.get("source")) is not None:
            counts = sources.setdefault(str(source), {"drafts": 0, "drafted": 0, "accepted": 0})
            counts["drafts"] += 1
            counts["drafted"] += offered
            counts["accepted"] += n
    return {"drafts": drafts, "drafted": drafted, "accepted": accepted, "accepted_per_position": per_position,
            "sources": dict(sorted(sources.items())), "stats": dict(sorted(stats.items()))}


def _plain(o: Any) -> Any:
    """A value JSON cannot encode, as :func:`attrs.asdict` gives it: an attrs instance is its dict, a set
    its list."""
    if attrs.has(type(o)):
        return attrs.asdict(o)
    if isinstance(o, (set, frozenset)):
        return list(o)
    raise TypeError(f"a receipt holds a {type(o).__name__}, which JSON cannot encode")


@attrs.frozen
class Receipt:
    """The frozen record of one request."""

    status: str  # completed | cancelled | failed
    finish_reason: str | None  # stop | max_tokens | context | None
    config: dict[str, Any]
    config_sha256: str
    strategy: dict[str, Any]  # name, version, package, kind
    selection: str  # why this strategy ran
    backend: dict[str, Any]  # name, version, plus backend facts (llama.cpp commit, flags)
    artifacts: dict[str, str]  # role -> sha256
    prompt_tokens: int
    output_tokens: int
    output_sha256: str
    rounds: list[dict[str, Any]]
    scheduler: dict[str, Any]
    timings: dict[str, float]
    error: str | None = None
    #: the session's batch-numerics self-test (:class:`power_core.numerics.SelftestReport` without
    #: its seconds, which are in ``timings``), when config ``selftest``/``require_identical`` ran it
    selftest: dict[str, Any] | None = None
    #: prompt tokens whose target state came from the previous request (config ``cache_prompt``)
    prompt_reused: int = 0
    #: observer hooks that raised during the request (logged; the request itself was unaffected)
    observer_faults: int = 0
    #: the request's constraint (:class:`power_core.constraint.ConstraintStats`): kind, digest, lazy,
    #: cuts, cut_tokens, cuts_per_round, masks; ``None`` when the output was unconstrained
    constraint: dict[str, Any] | None = None
    #: the request's prediction (OpenAI's Predicted Outputs, :mod:`power_core.prediction`): ``tokens``, and
    #: how many of them the output repeated (``accepted``) or not (``rejected``); ``None`` without one
    prediction: dict[str, int] | None = None
    schema: str = SCHEMA
    _summary: dict[str, Any] | None = attrs.field(default=None, init=False, eq=False, repr=False)
    _digest: str | None = attrs.field(default=None, init=False, eq=False, repr=False)
    _canonical_bytes: int = attrs.field(default=0, init=False, eq=False, repr=False)
    _json: str | None = attrs.field(default=None, init=False, eq=False, repr=False)

    @property
    def proposed(self) -> int:
        return int(self._summarized()["proposed"])

    @property
    def accepted(self) -> int:
        return int(self._summarized()["accepted"])

    @property
    def acceptance(self) -> float | None:
        """accepted / proposed over the request (``None`` when nothing was proposed)."""
        acceptance: float | None = self._summarized()["acceptance"]
        return acceptance

    @property
    def proposer(self) -> dict[str, Any]:
        """The proposer's statistics (:func:`proposer_stats`), computed from :attr:`rounds`."""
        return proposer_stats(self.rounds)

    @property
    def replays(self) -> int:
        return int(self._summarized()["replays"])

    def summary(self) -> dict[str, Any]:
        """``rounds``, ``proposed``, ``accepted``, ``acceptance``, ``verified_tokens_per_pass``, ``replays``,
        ``circuit_open`` (a copy)."""
        return dict(self._summarized())

    def _summarized(self) -> dict[str, Any]:
        """The summary, made once (a receipt is frozen) in one pass over the rounds."""
        if self._summary is None:
            proposed = accepted = emitted = replays = 0
            for r in self.rounds:
                proposed += r["proposed"]
                accepted += r["accepted"]
                emitted += r["emitted"]
                replays += bool(r["replayed"])
            n = len(self.rounds)
            object.__setattr__(self, "_summary", {
                "rounds": n, "proposed": proposed, "accepted": accepted,
                "acceptance": accepted / proposed if proposed else None,
                "verified_tokens_per_pass": emitted / n if n else None, "replays": replays,
                "circuit_open": bool(self.scheduler.get("circuit_open"))})
        assert self._summary is not None
        return self._summary

    def _body(self, with_timings: bool) -> dict[str, Any]:
        """The fields (not copied) with the derived ``proposer`` and ``summary``; without timings, the
        canonical form the digest hashes."""
        body = {a.name: getattr(self, a.name) for a in attrs.fields(Receipt) if not a.name.startswith("_")}
        body["proposer"] = self.proposer
        body["summary"] = self.summary()
        if not with_timings:
            del body["timings"]
            rounds = body["rounds"] = [r.copy() for r in self.rounds]
            for r in rounds:
                del r["seconds"]
        return body

    def digest(self) -> str:
        """sha256 of the canonical JSON (:data:`CANONICAL`) without timings (computed once: a receipt is frozen)."""
        if self._digest is None:
            blob = orjson.dumps(self._body(False), default=_plain, option=CANONICAL)
            object.__setattr__(self, "_digest", hashlib.sha256(blob).hexdigest())
            object.__setattr__(self, "_canonical_bytes", len(blob))
        assert self._digest is not None
        return self._digest

    @property
    def canonical_bytes(self) -> int:
        """Bytes of the canonical JSON :meth:`digest` hashes: the receipt's size without rendering it again
        (its :meth:`to_json` adds the timings and each round's seconds: 48.6 KB against 37.1 for 192 rounds)."""
        self.digest()
        return self._canonical_bytes

    def to_dict(self) -> dict[str, Any]:
        """The receipt as plain JSON values (a copy: changing it leaves the receipt as it is)."""
        body: dict[str, Any] = json.loads(self.to_json(indent=None))
        return body

    def to_json(self, indent: int | None = 2) -> str:
        """The receipt's JSON, ``receipt_sha256`` last; ``indent=None``: one line, made once (a receipt is
        frozen) and spelled as ``json.dumps`` spells the plain values."""
        if indent is not None:
            return json.dumps(self.to_dict(), indent=indent, sort_keys=False)
        if self._json is None:
            body = json.dumps(self._body(True), default=_plain)  # "{...}": the digest joins as its last key
            object.__setattr__(self, "_json", f'{body[:-1]}, "receipt_sha256": {json.dumps(self.digest())}}}')
        assert self._json is not None
        return self._json
