"""Batch-invariance self-test: are the target's verify rows the bits of one-token decodes?

Speculative output equals target-only output token for token only when a verify pass of n tokens
gives each row exactly the logits a one-token decode gives (``docs/numerics.md``: Gemma-3 on the
stock CPU kernels does not). :func:`selftest` measures that on the running build through the same
:class:`~power_core.runtime.TargetRuntime` calls the transaction makes: after a prefix of each
probe length, one ``decode`` of a block of each width, ``restore``, then the same tokens one
``decode`` at a time, comparing each row bit for bit.

The default probes cover short contexts and contexts past 256 tokens (llama.cpp pads the KV
length to 256; Gemma's n == 1 split-KV attention starts at 512 padded cells), including a block
that crosses the 256 boundary, at widths that take every kernel-choice threshold (2, 4, 8, 16, 64).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from power_core.errors import CapacityError
from power_core.runtime import BatchItem, BatchRuntime, TargetRuntime

__all__ = ["BatchProbeReport", "SelftestReport", "batch_probe", "selftest", "DEFAULT_CONTEXTS", "DEFAULT_WIDTHS"]

#: prefix lengths probed: short, a block crossing the 256-cell padding, and past it
DEFAULT_CONTEXTS = (20, 250, 300)
#: verify widths probed (kernel choices switch at 2, 4, 8 and 64 rows on the CPU build; 64 also
#: stands for prefill chunks, whose rows must not depend on the chunking for prompt reuse)
DEFAULT_WIDTHS = (2, 4, 8, 16, 64)


@attrs.frozen
class SelftestReport:
    """Whether every probed verify row equals its one-token decode, bit for bit."""

    identical: bool
    #: the largest |verify row - single-decode row| over every probed logit (0.0 when identical)
    max_abs_diff: float
    #: the first probe row whose argmax differs (``{"context", "width", "row"}``), or ``None``
    first_argmax_diff: dict[str, int] | None
    #: per probe: context, width, rows that differ, their max |diff|, argmax flips
    probes: tuple[dict[str, Any], ...]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"identical": self.identical, "max_abs_diff": self.max_abs_diff,
                "first_argmax_diff": self.first_argmax_diff, "probes": [dict(p) for p in self.probes],
                "seconds": round(self.seconds, 3)}

    def reason(self) -> str:
        """One line for receipts and logs."""
        if self.identical:
            return f"verify rows bit-identical to one-token decodes ({len(self.probes)} probes)"
        where = self.first_argmax_diff
        flip = (f"; argmax first differs at context {where['context']} + row {where['row']} of a "
                f"{where['width']}-token verify" if where else "; no argmax differs in the probes")
        return f"verify rows differ from one-token decodes by up to {self.max_abs_diff:.4g} logits{flip}"


def selftest(target: TargetRuntime, *, contexts: Sequence[int] = DEFAULT_CONTEXTS,
             widths: Sequence[int] = DEFAULT_WIDTHS, seed: int = 0) -> SelftestReport:
    """Probe ``target`` (which it resets before and after). Widths above the target's
    ``max_block`` and contexts that do not fit its ``n_ctx`` are left out; at least one probe must
    fit, else :class:`~power_core.errors.CapacityError`."""
    caps = target.capabilities
    ws = sorted({int(w) for w in widths if 2 <= int(w) <= caps.max_block})
    if not ws:
        raise CapacityError(f"the self-test needs verify blocks of >= 2 tokens; the target allows {caps.max_block}")
    cs = sorted({int(c) for c in contexts if 1 <= int(c) and int(c) + max(ws) < caps.n_ctx})
    if not cs:
        raise CapacityError(f"no self-test context fits n_ctx={caps.n_ctx}; raise n_ctx (the default probes "
                            f"need {min(contexts) + max(ws) + 1})")
    rng = np.random.default_rng(seed)
    # ids from the lower half of the vocabulary: ordinary text tokens in the usual tokenizers
    hi = max(2, caps.n_vocab // 2)
    prefix = rng.integers(1, hi, size=max(cs), dtype=np.int64).astype(np.int32)
    block = rng.integers(1, hi, size=max(ws), dtype=np.int64).astype(np.int32)
    t0 = time.perf_counter()
    probes: list[dict[str, Any]] = []
    first: dict[str, int] | None = None
    worst = 0.0
    try:
        for ctx_len in cs:
            target.reset()
            target.prefill(prefix[:ctx_len])
            for w in ws:
                cp = target.checkpoint()
                batch = np.array(target.decode(block[:w]).logits[:w], dtype=np.float32)
                target.restore(cp)
                single = np.empty_like(batch)
                for j in range(w):
                    single[j] = target.decode(block[j:j + 1]).logits[0]
                target.restore(cp)
                diff = np.abs(batch - single)
                row_max = diff.max(axis=1)
                flips = np.flatnonzero(batch.argmax(axis=1) != single.argmax(axis=1))
                if first is None and flips.size:
                    first = {"context": ctx_len, "width": w, "row": int(flips[0])}
                worst = max(worst, float(row_max.max()))
                probes.append({"context": ctx_len, "width": w,
                               "rows_differing": int(np.count_nonzero(row_max)),
                               "max_abs_diff": float(row_max.max()), "argmax_flips": int(flips.size)})
    finally:
        target.reset()
    identical = all(p["rows_differing"] == 0 for p in probes)
    return SelftestReport(identical=identical, max_abs_diff=worst, first_argmax_diff=first, probes=tuple(probes),
                          seconds=time.perf_counter() - t0)


@attrs.frozen
class BatchProbeReport:
    """Whether one sequence's rows in a shared multi-sequence pass equal its solo rows, bit for bit."""

    identical: bool
    sequences: int
    rows_compared: int
    rows_differing: int
    max_abs_diff: float
    argmax_flips: int
    #: where the first difference was: (pass index, row) or None
    first_difference: tuple[int, int] | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["first_difference"] = list(self.first_difference) if self.first_difference else None
        return out

    def reason(self) -> str:
        if self.identical:
            return (f"rows of a sequence in shared passes of {self.sequences} sequences are bit-identical to its "
                    f"solo rows ({self.rows_compared} rows)")
        return (f"{self.rows_differing} of {self.rows_compared} rows of a sequence in shared passes differ from its "
                f"solo rows (max |diff| {self.max_abs_diff:.4g}, {self.argmax_flips} argmax flips; first at pass "
                f"{self.first_difference})")


def batch_probe(runtime: BatchRuntime, *, prompts: Sequence[int] = (37, 300, 5),
                widths: Sequence[int] = (1, 4, 8, 3, 2), seed: int = 0) -> BatchProbeReport:
    """Decode sequence 0 in shared passes with the runtime's other sequences (their prompts and
    verify blocks of other widths beside it), then alone, and compare its rows bit for bit.

    Every sequence is reset before and after. ``prompts`` are prompt lengths (sequence ``i`` gets
    ``prompts[i % len]``; the 300-token one crosses llama.cpp's 256-cell KV padding), ``widths`` the
    verify block widths of sequence 0, round after round (the others use rotated widths)."""
    t0 = time.perf_counter()
    seqs = list(runtime.sequences)
    if not seqs:
        raise CapacityError("batch probe: the runtime has no sequences")
    caps = seqs[0].capabilities
    rng = np.random.default_rng(seed)
    n = len(seqs)
    lengths = [min(prompts[i % len(prompts)], caps.n_ctx - sum(widths) - 2) for i in range(n)]
    width = [min(w, caps.max_block) for w in widths]
    toks = [rng.integers(0, caps.n_vocab, lengths[i]).astype(np.int32) for i in range(n)]
    blocks = [[rng.integers(0, caps.n_vocab, width[(r + i) % len(width)]).astype(np.int32)
               for r in range(len(width))] for i in range(n)]

    def passes(members: list[int]) -> list[np.ndarray]:
        for i in members:
            seqs[i].reset()
        rows = []
        budget = runtime.token_budget
        pending = {i: toks[i] for i in members}
        while pending:  # prompts in chunks under the pass budget; sequence 0's last row is compared
            items, taken = [], 0
            for i, rest in list(pending.items()):
                k = min(len(rest), max(0, budget - taken))
                if k == 0:
                    continue
                items.append((i, BatchItem(seqs[i], rest[:k], "last" if k == len(rest) else "none")))
                taken += k
            for (i, _), res in zip(items, runtime.decode_batch([it for _, it in items]), strict=True):
                if i == 0 and res.logits.shape[0]:
                    rows.append(np.array(res.logits))
                pending[i] = pending[i][len(res.tokens):]
                if not len(pending[i]):
                    del pending[i]
        for r in range(len(width)):
            results = runtime.decode_batch([BatchItem(seqs[i], blocks[i][r], "all") for i in members])
            rows.append(np.array(results[0].logits))
        for i in members:
            seqs[i].reset()
        return rows

    shared = passes(list(range(n)))
    solo = passes([0])
    compared = differing = flips = 0
    worst = 0.0
    first: tuple[int, int] | None = None
    for p, (a, b) in enumerate(zip(shared, solo, strict=True)):
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64)).max(axis=1)
        compared += a.shape[0]
        bad = np.flatnonzero(diff != 0)
        differing += bad.size
        flips += int((a.argmax(axis=1) != b.argmax(axis=1)).sum())
        worst = max(worst, float(diff.max()))
        if bad.size and first is None:
            first = (p, int(bad[0]))
    return BatchProbeReport(identical=differing == 0, sequences=n, rows_compared=compared, rows_differing=differing,
                            max_abs_diff=worst, argmax_flips=flips, first_difference=first,
                            seconds=time.perf_counter() - t0)
