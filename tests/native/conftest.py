"""Fixtures for the native tests: tiny synthetic GGUFs (llama, and qwen35 with recurrent layers).

Metadata is written with the PyPI ``gguf`` package using raw keys; every tensor is then created by
the arch's own loader and filled with seeded N(0, 0.1) through ``llama_model_init_from_user``, and
saved as a real GGUF with ``llama_model_save_to_file`` (LLAMACPP_NOTES §7.1-7.2).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

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


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-gguf")


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir) -> Path:
    return make_tiny(tiny_dir, "llama")


@pytest.fixture(scope="session")
def tiny_qwen35(tiny_dir) -> Path:
    return make_tiny(tiny_dir, "qwen35")


@pytest.fixture(scope="session", params=["llama", "qwen35"])
def tiny_model(request, tiny_llama, tiny_qwen35) -> Path:
    return {"llama": tiny_llama, "qwen35": tiny_qwen35}[request.param]
