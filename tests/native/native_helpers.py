"""Drivers shared by the native tests: plain greedy decoding and a speculative loop that commits
exactly as ``power_core.transaction`` does (checkpoint → verify → accept → rollback or replay)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

N_VOCAB = 128


def write_metadata(path: Path, arch: str, *, n_embd: int = 256, n_head: int = 2, n_ff: int = 384,
                   n_layer: int = 2, n_ctx: int = 256, token_prefix: str = "tok_") -> Path:
    """A tensor-less GGUF with the hyperparameters and a ``test`` tokenizer of ``N_VOCAB`` tokens."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.vocab_size", N_VOCAB)
    w.add_uint32(f"{arch}.context_length", n_ctx)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.feed_forward_length", n_ff)
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", n_head)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", 1e-5)
    if arch == "qwen35":
        head = n_embd // n_head
        w.add_array(f"{arch}.rope.dimension_sections", [head // 4] * 4)
        w.add_uint32(f"{arch}.ssm.conv_kernel", 4)
        w.add_uint32(f"{arch}.ssm.inner_size", 256)
        w.add_uint32(f"{arch}.ssm.state_size", 128)
        w.add_uint32(f"{arch}.ssm.time_step_rank", n_head)
        w.add_uint32(f"{arch}.ssm.group_count", 2)
        w.add_uint32(f"{arch}.full_attention_interval", 2)
    w.add_string("tokenizer.ggml.model", "test")
    w.add_array("tokenizer.ggml.tokens", [f"{token_prefix}{i}" for i in range(N_VOCAB)])
    w.add_array("tokenizer.ggml.scores", [0.0] * N_VOCAB)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_tiny(out_dir: Path, arch: str, *, seed: int = 42, name: str | None = None, **meta_kw) -> Path:
    from power_native import _llama

    name = name or arch
    meta = write_metadata(out_dir / f"{name}-meta.gguf", arch, **meta_kw)
    model = _llama.Model.from_metadata(str(meta), seed=seed, stdev=0.1)
    path = out_dir / f"tiny-{name}.gguf"
    model.save(str(path))
    del model
    return path



def greedy_reference(target, prompt, n: int) -> list[int]:
    """Autoregressive greedy decoding, one token per pass."""
    prompt = np.asarray(prompt, dtype=np.int32)
    target.reset()
    if prompt.shape[0] > 1:
        target.prefill(prompt[:-1])
    anchor, out = int(prompt[-1]), []
    while len(out) < n:
        res = target.decode(np.array([anchor], dtype=np.int32))
        anchor = int(np.argmax(res.logits[0]))
        out.append(anchor)
    return out


def speculative(target, prompt, n: int, k: int, propose: Callable[[list[int], int, int], list[int]]) -> dict:
    """Greedy speculative decoding with ``propose(history, k, round)``; returns tokens and counters."""
    prompt = np.asarray(prompt, dtype=np.int32)
    target.reset()
    if prompt.shape[0] > 1:
        target.prefill(prompt[:-1])
    history = [int(t) for t in prompt]
    out: list[int] = []
    proposed = accepted = replays = rounds = 0
    while len(out) < n:
        kk = max(0, min(k, n - len(out) - 1))
        props = [int(t) for t in propose(history, kk, rounds)][:kk]
        cp = target.checkpoint()
        block = np.array([history[-1], *props], dtype=np.int32)
        res = target.decode(block)
        emitted = []
        for j in range(len(props) + 1):
            tok = int(np.argmax(res.logits[j]))
            emitted.append(tok)
            if j == len(props) or tok != props[j]:
                break
        keep = len(emitted)
        if keep < block.shape[0] and not target.rollback(cp, keep):
            target.decode(block[:keep])
            replays += 1
        assert target.n_past == len(history) - 1 + keep
        proposed += len(props)
        accepted += keep - 1 if keep <= len(props) else len(props)
        history.extend(emitted)
        out.extend(emitted)
        rounds += 1
    return {"tokens": out[:n], "proposed": proposed, "accepted": accepted, "replays": replays, "rounds": rounds}


def oracle(reference: list[int], prompt_len: int, n_vocab: int):
    """Proposals from the known continuation, corrupted at index ``round % (k+1)`` so every
    acceptance depth 0..k occurs."""

    def propose(history: list[int], k: int, rnd: int) -> list[int]:
        done = len(history) - prompt_len
        props = list(reference[done:done + k])
        bad = rnd % (k + 1)
        if bad < len(props):
            props[bad] = (props[bad] + 1) % n_vocab
        return props

    return propose
