"""memory_replay: ``bench_memory``'s workload in process, with every round of every request.

The server bench (``bench_memory.py``) gives aggregate tok/s; this runs the same conversations (chat and
agent, histories resent, 48 tokens, the same stops) on an in-process engine of ``--clients`` sequences
with the server's memories (a prompt cache and the cross-request suffix index) and reads the receipts:
rounds, proposed and accepted tokens, the rounds' reasons (``backoff``: a round that skipped proposing
after a cost-aware width of 0) and the widths the shared passes narrowed. With ``--oracle`` it also counts
the output tokens a longest-suffix match over the request's own prompt and output so far would predict
one token at a time (a ceiling for what a suffix drafter can be accepted on this text).

    python tests/bench/memory_replay.py --clients 4 [--model smollm2] [--oracle]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parent))
from bench_memory import conversation, render  # noqa: E402

from power_core.config import PowerConfig  # noqa: E402
from power_core.memory import PromptCache  # noqa: E402
from power_core.session import Session  # noqa: E402

STOP = ["\nUser:", "\nStep"]


def predictable(context: list[int], answer: list[int], min_match: int = 2, max_match: int = 32) -> int:
    """Tokens of ``answer`` (after its first, which the prefill emits) that the longest suffix (``min_match``
    to ``max_match`` tokens) of ``context + answer[:t]`` predicts from its latest earlier occurrence."""
    hits = 0
    for t in range(1, len(answer)):
        seq = context + answer[:t]
        n = len(seq)
        for m in range(min(max_match, n - 1), min_match - 1, -1):
            suffix = seq[n - m:]
            nxt = next((seq[j + m] for j in range(n - m - 1, -1, -1) if seq[j:j + m] == suffix), None)
            if nxt is not None:
                hits += nxt == answer[t]
                break
    return hits


def run(model: str, clients: int, conversations: int, turns: int, tokens: int,
        threads: int) -> tuple[dict[str, Any], list[tuple[list[int], list[int]]]]:
    """The report, and each request's (prompt ids, output ids)."""
    cfg = PowerConfig(spec_mode="suffix", n_threads=threads, n_ctx=4096, spec_suffix_memory_tokens=200_000,
                      trace=True)
    out: list[tuple[str, Any]] = []
    lock = threading.Lock()
    from power_native.models import resolve_model

    with Session.open_engine(clients, cfg, model=str(resolve_model(model)),
                             prompt_cache=PromptCache.of_mib(8192)) as engine:
        t0 = time.perf_counter()
        for kind in ("chat", "agent"):
            def client(k: int, kind: str = kind) -> None:
                for i in range(k, conversations, clients):
                    history: list[tuple[str, str]] = []
                    for turn in conversation(kind, i, turns):
                        prompt = render(kind, history, turn)
                        res = engine.run(engine.submit(prompt, max_tokens=tokens, stop=STOP))
                        with lock:
                            out.append((prompt, res))
                        history.append((turn, res.text.strip()))

            workers = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        wall = time.perf_counter() - t0
        encode = engine.sessions[0].encode
        reasons: collections.Counter[str] = collections.Counter()
        rounds = proposed = accepted = narrowed = 0
        for _, res in out:
            for r in res.receipt.rounds:
                if r["index"] == 0:
                    continue
                rounds += 1
                reasons[r["reason"]] += 1
                proposed += r["proposed"]
                accepted += r["accepted"]
                w = r.get("width") or {}
                narrowed += bool(w.get("shared_pass")) and w.get("chosen", 0) < w.get("offered", 0)
        timings = [res.receipt.timings for _, res in out]
        emitted = sum(len(res.tokens) for _, res in out)
        report: dict[str, Any] = {
            "model": model, "clients": clients, "requests": len(out), "tokens": emitted, "wall_s": round(wall, 2),
            "tok_s": round(emitted / wall, 1), "rounds": rounds, "reasons": dict(reasons), "proposed": proposed,
            "accepted": accepted, "draftable": sum(max(len(res.tokens) - 1, 0) for _, res in out),
            "shared_pass_narrowed": narrowed,
            "prefill_s": round(sum(t["prefill_s"] for t in timings), 2),
            "decode_s": round(sum(t["decode_s"] for t in timings), 2),
            "target_compute_s": round(sum(t.get("target_compute_s", 0.0) for t in timings), 2),
            "host_s": round(sum(t.get("host_s", 0.0) for t in timings), 2),
            "prompt_reused": sum(res.receipt.prompt_reused for _, res in out)}
        texts = [([int(x) for x in encode(prompt)], [int(x) for x in res.tokens]) for prompt, res in out]
    return report, texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--oracle", action="store_true", help="also count the longest-suffix oracle's predictable tokens")
    ap.add_argument("--out", type=Path, help="write the report as JSON here")
    args = ap.parse_args()
    report, texts = run(args.model, args.clients, args.conversations, args.turns, args.tokens, args.threads)
    report["oracle_predictable"] = sum(predictable(ids, answer) for ids, answer in texts) if args.oracle else None
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
