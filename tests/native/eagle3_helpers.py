"""Tiny EAGLE3 drafts for the native tests and the bench: ``synthetic.eagle3_spec`` shaped for a
target, carrying the target's tokenizer as llama.cpp's converter writes it, with decisive weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def make_tiny_eagle3(out_dir: Path, target: Path, *, name: str = "eagle3", layers: tuple[int, int, int] | None = None,
                     borrow: bool = False, d2t: int | None = None, n_embd: int | None = None,
                     norm_before_residual: bool | None = None, norm_before_fc: bool | None = None,
                     seed: int = 11, successor: dict[int, int] | None = None) -> Path:
    """An EAGLE3 draft for ``target``: ``layers`` (default ``(0, n/2, n-1)``), ``borrow``: no
    ``token_embd``/``output`` (inherited through ``ctx_other``), ``d2t``: that many output rows
    scattered onto a random permutation of target ids, ``n_embd``: the draft's width (default the
    target's), the two norm flags as the converter writes them.

    ``successor``: a draft that follows the target's own next-token map (a dict ``token -> next``, e.g.
    read off a ``--mode off`` run), so proposals are accepted, in part or in full (random tiny drafts are
    never accepted, and the kept-rows path needs acceptances). It taps the target's final hidden state
    (``layers[2]`` = its layer count; qwen35 publishes it after its output norm, so the target's output
    rows read the target's own logits from it) and inherits the target's output (``borrow``): ``fc``
    passes that tap through as ``g``, attention is off, and the FFN turns the logits into the output row
    of each token's successor (``up`` = the output rows, ``gate`` the same scaled, so the top logit
    dominates; ``down`` = the successors' output rows, scaled): the pre-norm state points at the
    successor's row, and feeding it back walks the map on.
    """
    from power_core.artifacts import synthetic

    r = gguf.GGUFReader(str(target))
    arch = str(r.fields["general.architecture"].contents())
    n_embd_t = int(r.fields[f"{arch}.embedding_length"].contents())
    n_layer = int(r.fields[f"{arch}.block_count"].contents())
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    if layers is None:
        layers = (0, n_layer // 2, n_layer - 1)
    spec = synthetic.eagle3_spec(target_layers=layers, n_vocab=n_vocab, n_embd=n_embd or n_embd_t,
                                 target_n_embd=n_embd_t, own_embeddings=not borrow, d2t=d2t,
                                 norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc)
    spec.kv = {k: v for k, v in spec.kv.items() if not k.startswith("tokenizer.")}
    kinds = {gguf.GGUFValueType.STRING: "str", gguf.GGUFValueType.INT32: "i32", gguf.GGUFValueType.UINT32: "u32",
             gguf.GGUFValueType.FLOAT32: "f32", gguf.GGUFValueType.BOOL: "bool"}
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            if len(value) and field.types[-1] in kinds:
                spec.kv[key] = (f"arr:{kinds[field.types[-1]]}", list(value))
        elif field.types[0] in kinds:
            spec.kv[key] = (kinds[field.types[0]], value)
    if d2t is not None:
        spec.data["d2t"] = np.random.default_rng(7).permutation(n_vocab)[:d2t].astype(np.int64)
    # decisive weights: unit norms and fan-in scaled matrices, so the draft's logits have clear margins
    rng = np.random.default_rng(seed)
    for tname, (shape, ttype) in spec.tensors.items():
        if ttype == "F32" and tname not in spec.data:
            np_shape = tuple(reversed(shape))
            spec.data[tname] = (np.ones(np_shape) if "norm" in tname
                                else rng.standard_normal(np_shape) / np.sqrt(shape[0])).astype(np.float32)
    if successor is not None:
        n = n_embd or n_embd_t
        t = {tt.name: tt for tt in r.tensors}
        w_out = np.array(t["output.weight" if "output.weight" in t else "token_embd.weight"].data,
                         dtype=np.float32).reshape(n_vocab, n_embd_t)
        fc = np.zeros((n, 3 * n_embd_t), dtype=np.float32)
        fc[:, 2 * n_embd_t:] = np.eye(n, n_embd_t, dtype=np.float32)
        spec.data["fc.weight"] = fc
        spec.data["blk.0.attn_output.weight"] = np.zeros_like(spec.data["blk.0.attn_output.weight"])
        n_ff = spec.tensors["blk.0.ffn_up.weight"][0][1]
        assert n_ff >= n_vocab, "the successor FFN needs a unit per token"
        up = np.zeros((n_ff, n_embd_t), dtype=np.float32)
        up[:n_vocab] = w_out
        down = np.zeros((n_embd_t, n_ff), dtype=np.float32)
        for tok in range(n_vocab):
            down[:, tok] = 10.0 * w_out[successor.get(tok, tok)]
        spec.data["blk.0.ffn_up.weight"] = up
        spec.data["blk.0.ffn_gate.weight"] = 4.0 * up
        spec.data["blk.0.ffn_down.weight"] = down
    path = out_dir / f"{name}.gguf"
    spec.write(path)
    return path
