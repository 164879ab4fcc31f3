"""Host time of a server or tool: its wall time minus the time inside llama.cpp.

``compute_clock.c`` is an ``LD_PRELOAD`` shim that times every ``llama_decode`` / ``llama_encode`` /
``llama_process`` call of a process (any context) and writes them at exit. Run a server under it
(:func:`traced_env`), note the measured window on ``time.perf_counter_ns()`` (``CLOCK_MONOTONIC``, the
shim's clock), and :func:`split` says how much of the window was llama.cpp compute and how much was
everything else (HTTP, JSON, templates, the transaction, hand-offs): the same split for Power and for
llama.cpp's own binaries, so the two host times are paired.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import attrs

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2] / "native" / "tools"))
import build_llama  # noqa: E402


def compute_clock(out_dir: Path) -> Path:
    """Compile ``compute_clock.c`` against the pinned llama.cpp headers (once per ``out_dir``)."""
    lib = out_dir / "libcompute_clock.so"
    if not lib.exists():
        inc = build_llama.source_dir()
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(HERE.parent / "compute_clock.c"),
                        f"-I{inc / 'include'}", f"-I{inc / 'ggml' / 'include'}", "-ldl", "-lpthread", "-o", str(lib)],
                       check=True)
    return lib


def traced_env(env: dict[str, str], shim: Path, trace: Path) -> dict[str, str]:
    """``env`` plus the shim, writing its calls to ``trace`` when the process exits."""
    return {**env, "LD_PRELOAD": str(shim), "POWER_COMPUTE_TRACE": str(trace)}


@attrs.frozen
class HostSplit:
    """One measured window of a traced process."""

    wall_s: float
    #: time inside llama.cpp's decode calls that started in the window
    compute_s: float
    #: decode calls in the window by context, most calls first (a drafter's context makes several per round)
    calls: tuple[int, ...]
    #: verify rounds: the calls of the context with the fewest calls (the target's, one pass per round)
    rounds: int

    @property
    def host_s(self) -> float:
        return max(0.0, self.wall_s - self.compute_s)

    def host_us_per(self, n: int) -> float | None:
        return self.host_s / n * 1e6 if n else None


def split(trace: Path, start_ns: int, end_ns: int) -> HostSplit:
    """The calls of ``trace`` that started in ``[start_ns, end_ns]`` against the window's length."""
    compute = 0
    per_ctx: Counter[str] = Counter()
    for line in trace.read_text().splitlines():
        ctx, start, dur, _ = line.split()
        if start_ns <= int(start) <= end_ns:
            compute += int(dur)
            per_ctx[ctx] += 1
    counts = tuple(sorted(per_ctx.values(), reverse=True))
    return HostSplit(wall_s=(end_ns - start_ns) * 1e-9, compute_s=compute * 1e-9, calls=counts,
                     rounds=counts[-1] if counts else 0)
