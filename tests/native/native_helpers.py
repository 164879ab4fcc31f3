"""Drivers shared by the native tests: plain greedy decoding and a speculative loop that commits
exactly as ``power_core.transaction`` does (checkpoint → verify → accept → rollback or replay)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

N_VOCAB = 128
MOE_ARCHS = frozenset({"qwen3next", "qwen35moe", "glm4moe"})


def write_metadata(path: Path, arch: str, *, n_embd: int = 256, n_head: int = 2, n_ff: int = 384,
                   n_layer: int = 2, n_ctx: int = 256, token_prefix: str = "tok_", n_nextn: int = 0) -> Path:
    """A tensor-less GGUF with the hyperparameters and a ``test`` tokenizer of ``N_VOCAB`` tokens;
    ``n_nextn`` MTP blocks are added after the ``n_layer`` trunk blocks."""
    w = gguf.GGUFWriter(str(path), arch)
    if n_nextn:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_nextn)
        n_layer += n_nextn
    w.add_uint32(f"{arch}.vocab_size", N_VOCAB)
    w.add_uint32(f"{arch}.context_length", n_ctx)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.block_count", n_layer)
    w.add_uint32(f"{arch}.feed_forward_length", n_ff)
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", n_head)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", 1e-5)
    if arch in ("qwen35", "qwen3next"):
        head = n_embd // n_head
        w.add_array(f"{arch}.rope.dimension_sections", [head // 4] * 4)
        w.add_uint32(f"{arch}.ssm.conv_kernel", 4)
        w.add_uint32(f"{arch}.ssm.inner_size", 256)
        w.add_uint32(f"{arch}.ssm.state_size", 128)
        w.add_uint32(f"{arch}.ssm.time_step_rank", n_head)
        w.add_uint32(f"{arch}.ssm.group_count", 2)
        w.add_uint32(f"{arch}.full_attention_interval", 2)
    if arch in MOE_ARCHS:  # as tests/test-llama-archs.cpp writes MoE hyperparameters
        w.add_uint32(f"{arch}.expert_feed_forward_length", n_ff)
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", n_ff // 2)
        w.add_uint32(f"{arch}.expert_count", 2)
        w.add_uint32(f"{arch}.expert_used_count", 2)
        w.add_uint32(f"{arch}.expert_shared_count", 1)
        w.add_uint32(f"{arch}.leading_dense_block_count", 1)
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



#: optional tensors llama_model_init_from_user materialises in an MTP block but a converter never
#: writes; with them the file only loads with load_mtp (DESIGN.md, "Synthetic MTP fixtures")
_OPTIONAL_SUFFIXES = (".bias", ".scale", ".input_scale")


def make_tiny_mtp(out_dir: Path, arch: str = "qwen35", *, seed: int = 42, name: str | None = None,
                  n_layer: int = 2, predictable: bool = False, **meta_kw) -> Path:
    """A tiny target with one MTP (nextn) block after ``n_layer`` trunk blocks, random weights.

    Written by the arch's own loader (``load_mtp``), then rewritten without the MTP block's optional
    tensors and with per-layer arrays covering every block (llama-model-saver writes ``n_layer()``
    entries), so the same file loads with and without its MTP head, like a converted one.

    ``predictable``: a target whose next token depends only on the current one (every block's
    output projection is zero, so the residual stream is the token embedding and the final norm
    is plain RMS) and an MTP head built to reproduce that map (``eh_proj = [I | 0]`` selects the
    normed embedding of its input token, the same RMS norm, the target's own output head): greedy
    MTP drafts are the target's own continuation, acceptance ~100 %.
    """
    from power_native import _llama

    name = name or f"{arch}-mtp"
    meta = write_metadata(out_dir / f"{name}-meta.gguf", arch, n_layer=n_layer, n_nextn=1, **meta_kw)
    model = _llama.Model.from_metadata(str(meta), seed=seed, stdev=0.1, load_mtp=True)
    raw = out_dir / f"{name}-raw.gguf"
    model.save(str(raw))
    del model
    path = out_dir / f"tiny-{name}.gguf"
    mtp = f"blk.{n_layer}."

    def edit(t: str, data: np.ndarray) -> np.ndarray | None:
        if t.startswith(mtp) and t.endswith(_OPTIONAL_SUFFIXES) and not t.endswith("exp_probs_b.bias"):
            return None  # exp_probs_b.bias is a required MoE bias
        if not predictable:
            return data
        if t.endswith(("ssm_out.weight", "attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight",
                       "ffn_down_shexp.weight")):
            return np.zeros_like(data)
        if t.endswith(("output_norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight")):
            return np.ones_like(data)
        if t.endswith(("nextn.shared_head_head.weight", "nextn.shared_head_norm.weight", "nextn.embed_tokens.weight")):
            return None  # the head falls back to the target's token_embd, output_norm and output
        if t.endswith("nextn.eh_proj.weight"):
            n = data.shape[0]
            out = np.zeros_like(data)
            out[:, :n] = np.eye(n, dtype=data.dtype)
            return out
        return data

    _rewrite(raw, path, n_all=n_layer + 1, edit=edit)
    raw.unlink()
    return path


def _rewrite(src: Path, dst: Path, *, n_all: int, edit: Callable[[str, np.ndarray], np.ndarray | None]) -> None:
    """Copy a GGUF through ``edit`` (``None`` drops a tensor), extending per-layer arrays to ``n_all``."""
    r = gguf.GGUFReader(str(src))
    arch = str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            if len(value) == 0:  # empty arrays (no merges, no labels) carry nothing
                continue
            sub = field.types[-1]
            if key.startswith(f"{arch}.") and sub != gguf.GGUFValueType.STRING and len(value) < n_all:
                # per-layer arrays with trunk entries only: the MTP blocks are attention blocks (0)
                value = list(value) + [0] * (n_all - len(value))
            w.add_key_value(key, value, vtype, sub_type=sub)
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        data = edit(t.name, np.array(t.data))
        if data is not None:
            w.add_tensor(t.name, data, raw_shape=tuple(int(x) for x in reversed(t.shape)), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
