"""loop_cpu: the event loop's CPU time (the server's main thread, user + system, from
``/proc/PID/task/PID/stat``) and the wall time per streamed request of ``power serve`` variants, one server at a
time, the order alternating per round; paired ratios against the first variant.

A variant is a checkout (whose ``power_core`` a ``python -m`` there imports first) and, after ``:``, environment
settings separated by ``,`` (e.g. ``PYTHONPATH=/tmp/noaccel`` to block imports). The model is the tests' tiny
llama (``--mode off``: one commit, so one chunk, a token), so the loop's cost a chunk dominates; a chat request
goes through a one-line chat template. The per-thread clock ticks at 10 ms: take ``--requests`` x tokens large
enough (100 x 64 reads to ~2 %).

    python tests/bench/loop_cpu.py --variant /tmp/base --variant . [--requests 200 --tokens 64 --rounds 6 --chat]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "native")]
from openai import OpenAI  # noqa: E402

from tests.serve_helpers import listening, power_cmd  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def thread_cpu(pid: int) -> float:
    """Seconds of CPU (user + system) the process's main thread has run."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def variant(spec: str) -> tuple[str, Path, dict[str, str]]:
    checkout, _, env = spec.partition(":")
    settings = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    return spec, Path(checkout).resolve(), settings


def measure(checkout: Path, env: dict[str, str], args: argparse.Namespace, model: Path, template: Path) -> tuple[float, float]:
    """(loop CPU ms, wall ms) per request over ``args.requests`` streamed requests, after 5 unmeasured."""
    flags = ["--model", str(model), "--threads", "2", "--n-ctx", "512", "--mode", "off"]
    if args.chat:
        flags += ["--chat-template", str(template)]
    with listening(power_cmd("serve", "--port", "0", *flags), cwd=checkout, env={**os.environ, **env}) as s:
        client = OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        name = client.models.list().data[0].id

        def send(n: int) -> None:
            for i in range(n):
                if args.chat:
                    chunks = client.chat.completions.create(model=name, messages=[{"role": "user", "content": f"hello {i}"}],
                                                            max_tokens=args.tokens, temperature=0, stream=True)
                else:
                    chunks = client.completions.create(model=name, prompt=f"hello {i}", max_tokens=args.tokens,
                                                       temperature=0, stream=True)
                for _ in chunks:
                    pass

        send(5)
        c0, t0 = thread_cpu(s.proc.pid), time.perf_counter()
        send(args.requests)
        c1, t1 = thread_cpu(s.proc.pid), time.perf_counter()
    return (c1 - c0) / args.requests * 1e3, (t1 - t0) / args.requests * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, help="CHECKOUT[:NAME=VALUE,...]; two or more")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--chat", action="store_true", help="chat completions (else completions)")
    args = ap.parse_args()
    from native_helpers import make_tiny

    work = Path(tempfile.mkdtemp(prefix="loop-cpu-"))
    model = make_tiny(work, "llama")
    template = work / "template.jinja"
    template.write_text(TEMPLATE)
    variants = [variant(v) for v in args.variant]
    got: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in variants}
    for r in range(args.rounds):
        for name, checkout, env in variants if r % 2 == 0 else variants[::-1]:
            got[name].append(measure(checkout, env, args, model, template))
            print(f"{name}: loop cpu {got[name][-1][0]:.2f} ms/request, wall {got[name][-1][1]:.2f} ms", flush=True)
    first = variants[0][0]
    for name, xs in got.items():
        print(f"{name}: median loop cpu {statistics.median(x[0] for x in xs):.2f} ms/request, "
              f"wall {statistics.median(x[1] for x in xs):.2f} ms")
        if name != first:
            print(f"  paired loop cpu {first} / {name}:", [round(a[0] / b[0], 3) for a, b in zip(got[first], xs, strict=True)])


if __name__ == "__main__":
    main()
