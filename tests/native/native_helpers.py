"""Drivers shared by the native tests: plain greedy decoding and a speculative loop that commits
exactly as ``power_core.transaction`` does (checkpoint → verify → accept → rollback or replay)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from power_core.bench import peer_env
from power_core.errors import RuntimeFault

N_VOCAB = 128
MOE_ARCHS = frozenset({"qwen3next", "qwen35moe", "glm4moe"})


def write_metadata(path: Path, arch: str, *, n_embd: int = 256, n_head: int = 2, n_ff: int = 384,
                   n_layer: int = 2, n_ctx: int = 256, token_prefix: str = "tok_", n_nextn: int = 0,
                   n_vocab: int = N_VOCAB, ssm_heads: int | None = None, attention_interval: int = 2) -> Path:
    """A tensor-less GGUF with the hyperparameters and a ``test`` tokenizer of ``N_VOCAB`` tokens;
    ``n_nextn`` MTP blocks are added after the ``n_layer`` trunk blocks. A hybrid (qwen35, qwen3next) has a full
    attention layer every ``attention_interval`` and gated-delta-net layers of ``ssm_heads`` value heads of 128
    (its recurrent state: ``ssm_heads`` x 128 x 128 floats a layer; ``None``: an inner size of 256 in
    ``n_head`` time-step heads and 2 groups)."""
    w = gguf.GGUFWriter(str(path), arch)
    if n_nextn:
        w.add_uint32(f"{arch}.nextn_predict_layers", n_nextn)
        n_layer += n_nextn
    w.add_uint32(f"{arch}.vocab_size", n_vocab)
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
        w.add_uint32(f"{arch}.ssm.inner_size", 256 if ssm_heads is None else ssm_heads * 128)
        w.add_uint32(f"{arch}.ssm.state_size", 128)
        w.add_uint32(f"{arch}.ssm.time_step_rank", n_head if ssm_heads is None else ssm_heads)
        w.add_uint32(f"{arch}.ssm.group_count", 2 if ssm_heads is None else ssm_heads)
        w.add_uint32(f"{arch}.full_attention_interval", attention_interval)
    if arch in MOE_ARCHS:  # as tests/test-llama-archs.cpp writes MoE hyperparameters
        w.add_uint32(f"{arch}.expert_feed_forward_length", n_ff)
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", n_ff // 2)
        w.add_uint32(f"{arch}.expert_count", 2)
        w.add_uint32(f"{arch}.expert_used_count", 2)
        w.add_uint32(f"{arch}.expert_shared_count", 1)
        w.add_uint32(f"{arch}.leading_dense_block_count", 1)
    w.add_string("tokenizer.ggml.model", "test")
    w.add_array("tokenizer.ggml.tokens", [f"{token_prefix}{i}" for i in range(n_vocab)])
    w.add_array("tokenizer.ggml.scores", [0.0] * n_vocab)
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



#: the quant types a CPU user downloads, as ``llama-quantize`` names them (docs/numerics.md "Cost by quant type")
WIDE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16",
              "Q2_K", "Q3_K_M")


def make_wide(out_dir: Path, qtype: str, quantize: Path, *, n_embd: int = 512, n_ff: int = 1536, n_layer: int = 2,
              n_ctx: int = 1024, seed: int = 7) -> Path:
    """A llama of rows wide enough for every quant type (256-multiples: K-quant and IQ4_XS blocks; 8-multiples:
    the repacked layouts), written once as F16 (random N(0, 0.02) weights from the arch's own loader, then
    ``llama-quantize`` F32 -> F16) and quantized to ``qtype`` by the pinned build's ``llama-quantize``."""
    from power_native import _llama

    tag = f"wide{n_embd}x{n_layer}"
    f16 = out_dir / f"{tag}-F16.gguf"
    if not f16.exists():
        meta = write_metadata(out_dir / f"{tag}-meta.gguf", "llama", n_embd=n_embd, n_head=n_embd // 128, n_ff=n_ff,
                              n_layer=n_layer, n_ctx=n_ctx)
        model = _llama.Model.from_metadata(str(meta), seed=seed, stdev=0.02)
        f32 = out_dir / f"{tag}-F32.gguf"
        model.save(str(f32))
        del model
        subprocess.run([str(quantize), str(f32), str(f16), "F16"], check=True, capture_output=True)
        f32.unlink()
    if qtype == "F16":
        return f16
    out = out_dir / f"{tag}-{qtype}.gguf"
    if not out.exists():
        subprocess.run([str(quantize), str(f16), str(out), qtype], check=True, capture_output=True)
    return out


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
            per_layer = key.startswith(f"{arch}.") and not key.endswith(".rope.dimension_sections")
            if per_layer and sub != gguf.GGUFValueType.STRING and len(value) < n_all:
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


def make_tiny_draft(out_dir: Path, target: Path, kind: str = "dflash", *, name: str | None = None,
                    borrow: bool = False, d2t: int | None = None, target_layers: tuple[int, ...] = (0, 1),
                    block_size: int = 8, confidence: bool = False, predictable: bool = False) -> Path:
    """A tiny DFlash v1 / DFlash2 / DSpark draft for ``target`` (random weights, the core's synthetic
    specs), carrying the target's tokenizer plus a mask token as a converter writes it.

    ``borrow``: no ``token_embd``/``output`` (llama.cpp borrows the target's through ``ctx_other``).
    The draft's width is the target's (llama.cpp feeds it target layer inputs as its own width). ``d2t``: that many output rows scattered onto
    target ids through a ``d2t`` tensor (llama.cpp's reduced-vocab export).
    """
    from power_core.artifacts import synthetic

    r = gguf.GGUFReader(str(target))
    arch = str(r.fields["general.architecture"].contents())
    n_embd_t = int(r.fields[f"{arch}.embedding_length"].contents())
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].contents())
    make = {"dflash": synthetic.dflash_spec, "dflash2": synthetic.dflash2_spec, "dspark": synthetic.dspark_spec}[kind]
    extra = {"confidence": confidence} if kind == "dspark" else {}
    spec = make(target_layers=target_layers, block_size=block_size, n_vocab=n_vocab,
                n_embd=n_embd_t, own_embeddings=not borrow, target_n_embd=n_embd_t, **extra)
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
    spec.kv["tokenizer.ggml.mask_token_id"] = ("u32", n_vocab - 1)
    if d2t is not None:
        n_embd = spec.kv["dflash.embedding_length"][1]
        spec.tensors["output.weight"] = ((n_embd, d2t), "F32")
        spec.tensors["d2t"] = ((d2t,), "I64")
        spec.data["d2t"] = np.random.default_rng(7).permutation(n_vocab)[:d2t].astype(np.int64)
        if kind == "dspark":
            spec.tensors["markov_w2.weight"] = ((spec.tensors["markov_w2.weight"][0][0], d2t), "F32")
    # decisive weights: unit norms and fan-in scaled matrices, so the draft's logits have clear margins
    # (near-flat logits would make its argmax depend on last-ulp differences between batch shapes)
    rng = np.random.default_rng(11)
    for tname, (shape, ttype) in spec.tensors.items():
        if ttype == "F32" and tname not in spec.data:
            np_shape = tuple(reversed(shape))
            spec.data[tname] = (np.ones(np_shape) if "norm" in tname
                                else rng.standard_normal(np_shape) / np.sqrt(shape[0])).astype(np.float32)
    path = out_dir / f"{name or kind}.gguf"
    spec.write(path)
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


class FailingDecode:
    """A llama context whose decode, while ``armed``, runs its graph (memory and recurrent state move on)
    and then raises: a pass that failed after writing. Everything else is the context's."""

    def __init__(self, ctx: Any) -> None:
        self.inner = ctx
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner.decode(*args, **kwargs)
        if self.armed:
            self.armed = False
            raise RuntimeFault("the pass failed after its graph ran (test)")
        return out


def speculative(target, prompt, n: int, k: int, propose: Callable[[list[int], int, int], list[int]], *,
                faults: dict[int, str] | None = None) -> dict:
    """Greedy speculative decoding with ``propose(history, k, round)``; returns tokens and counters.
    ``faults`` fails the round of that number once and runs it again after ``target.restore``:
    ``"after"`` once its rows were read, ``"during"`` in the verify pass itself (``target.ctx``
    a :class:`FailingDecode`)."""
    prompt = np.asarray(prompt, dtype=np.int32)
    faults = dict(faults or {})
    target.reset()
    if prompt.shape[0] > 1:
        target.prefill(prompt[:-1])
    history = [int(t) for t in prompt]
    out: list[int] = []
    proposed = accepted = replays = rounds = restores = 0
    while len(out) < n:
        kk = max(0, min(k, n - len(out) - 1))
        props = [int(t) for t in propose(history, kk, rounds)][:kk]
        cp = target.checkpoint()
        block = np.array([history[-1], *props], dtype=np.int32)
        fault = faults.pop(rounds, None)
        if fault == "during":
            target.ctx.armed = True
            try:
                target.decode(block)
            except RuntimeFault:
                target.restore(cp)
                restores += 1
                continue
            raise AssertionError("the armed decode did not fail")
        res = target.decode(block)
        emitted = []
        for j in range(len(props) + 1):
            tok = int(np.argmax(res.logits[j]))
            emitted.append(tok)
            if j == len(props) or tok != props[j]:
                break
        if fault == "after":
            target.restore(cp)
            restores += 1
            continue
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
    assert not faults, f"rounds {sorted(faults)} never ran"
    return {"tokens": out[:n], "proposed": proposed, "accepted": accepted, "replays": replays, "rounds": rounds,
            "restores": restores}


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


# -- llama.cpp's own drafter as the reference for proposals -------------------------------------------------
_DRAFT = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(\d+)")
_ACCEPT = re.compile(r"accepted (\d+)/(\d+) draft tokens")


def peer_rounds(peer_bin: Path, model: Path, prompt: str, k: int, n: int, *, spec_type: str,
                draft: Path | None = None, n_ctx: int = 256, p_min: float = 0.0) -> list[tuple[list[int], int, int]]:
    """Per round of ``llama-speculative-simple --spec-type T --spec-draft-n-max K -lv 5``:
    (draft ids as logged, drafted count, accepted count). DFlash2 logs no ids, only the counts.

    The peer runs with Power's default (``exact``) numerics, as Power's side of every comparison does:
    with stock kernels the two sides' tokens may part on another CPU (a near-tie of the tiny random
    models' logits resolved differently), which says nothing about the proposals."""
    env = peer_env("exact")
    cmd = [str(peer_bin / "llama-speculative-simple"), "-m", str(model), "--spec-type", spec_type,
           "--spec-draft-n-max", str(k), "-p", prompt, "-n", str(n), "--temp", "0", "--top-k", "1", "-c", str(n_ctx),
           "-t", "2", "-lv", "5", "--spec-draft-p-min", str(p_min)]
    if draft is not None:
        cmd[3:3] = ["-md", str(draft)]
    # a real tokenizer's pieces in the -lv 5 log may split a UTF-8 character
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rounds, ids = [], []
    for line in proc.stderr.splitlines():
        if m := _DRAFT.search(line):
            ids.append(int(m.group(2)))
        elif m := _ACCEPT.search(line):
            gen = int(m.group(2))  # the draft as used: llama.cpp truncates it to its remaining budget
            assert not ids or gen <= len(ids)
            rounds.append((ids[:gen], gen, int(m.group(1))))
            ids = []
    return rounds


def rounds_by_position(ours: list[dict], theirs: list[tuple[list[int], int, int]],
                       n_prompt: int) -> tuple[dict[int, tuple], dict[int, tuple]]:
    """Power's traced rounds and llama.cpp's, each keyed by its anchor's position: ``(ids, drafted,
    accepted)``.

    llama.cpp's first round drafts from the last prompt token (it prefills ``prompt[:-1]``); Power's
    round 0 emits from the prefill of the whole prompt (DESIGN.md: round 0 is the prefill round),
    so round ``i`` of one side pairs with the round of the other that drafts at the same position."""
    ours_at, pos = {}, n_prompt - 1
    for r in ours:
        if r["index"] > 0:
            ours_at[pos] = (r["proposal"], r["proposed"], r["accepted"])
        pos += r["emitted"]
    theirs_at, pos = {}, n_prompt - 1
    for draft, gen, acc in theirs:
        theirs_at[pos] = (draft, gen, acc)
        pos += acc + 1
    return ours_at, theirs_at


def assert_same_rounds(ours: list[dict], theirs: list[tuple[list[int], int, int]], n_prompt: int, k: int, *,
                       ids: bool = True) -> int:
    """Power's traced rounds against llama.cpp's, matched by the anchor's position
    (:func:`rounds_by_position`). Proposals (when llama.cpp logs them), drafted and accepted counts
    must be equal wherever both drafted the full width; returns the number of rounds compared."""
    ours_at, theirs_at = rounds_by_position(ours, theirs, n_prompt)
    common = sorted(set(ours_at) & set(theirs_at))
    # within the span llama.cpp's log covers: once (a CI run under load, EAGLE3 "succ", k = 4) its logged
    # rounds ended several tokens short of its -n, each one up to there at Power's positions and none after
    # (cause not found: its run or its log); the rounds both sides logged are still compared, at least five
    span = [p for p in ours_at if p <= max(theirs_at, default=-1)]
    assert len(common) >= 0.8 * len(span) and len(common) >= 5, (sorted(ours_at), sorted(theirs_at))
    compared = 0
    for p in common:
        (o_ids, o_gen, o_acc), (t_ids, t_gen, t_acc) = ours_at[p], theirs_at[p]
        n = min(o_gen, t_gen)  # the last rounds are cut by each side's token budget
        if ids:
            assert o_ids[:n] == t_ids[:n], (p, ours_at[p], theirs_at[p])
        if o_gen == t_gen == k:
            assert o_acc == t_acc, (p, ours_at[p], theirs_at[p])
            compared += 1
    return compared


def rollback_rows_differ(ctx: Any, solo: Any) -> list[int | None]:
    """Three sequences of ``ctx`` (a context with ``n_seq_max`` >= 3) decode greedily, one token each per
    pass, while sequence 1 rolls back its last 3 tokens at steps 10, 20 and 30 and decodes them again
    after the others' tokens (so a cache shared by the sequences gets cells freed among theirs). Per
    sequence: the first of its 41 rows that differs from its decode alone on ``solo`` (None: none)."""
    n = 3
    rng = np.random.default_rng(1)
    hi = min(1000, ctx.n_vocab)
    prompts = [rng.integers(0, hi, length).astype(np.int32) for length in (37, 61, 20)]
    outputs = np.zeros(sum(len(p) for p in prompts), dtype=np.uint8)
    outputs[np.cumsum([len(p) for p in prompts]) - 1] = 1
    rows = ctx.decode_multi(np.concatenate(prompts), np.concatenate([np.arange(len(p)) for p in prompts]).astype(np.int32),
                            np.concatenate([np.full(len(p), i) for i, p in enumerate(prompts)]).astype(np.int32), outputs)
    got = [[np.array(rows[i])] for i in range(n)]
    gen = [[int(np.argmax(rows[i]))] for i in range(n)]
    past = [len(p) for p in prompts]
    for step in range(40):
        cur = [g[-1] for g in gen]
        if step in (10, 20, 30):  # sequence 1 rolls back 3 tokens; they go again after the others' tokens
            ctx.seq_rm(1, past[1] - 3, -1)
            toks = [cur[0], cur[2], *gen[1][-4:-1], cur[1]]
            pos = [past[0], past[2], *range(past[1] - 3, past[1]), past[1]]
            r = ctx.decode_multi(np.array(toks, dtype=np.int32), np.array(pos, dtype=np.int32),
                                 np.array([0, 2, 1, 1, 1, 1], dtype=np.int32), np.array([1, 1, 0, 0, 0, 1], dtype=np.uint8))
            rows = [r[0], r[2], r[1]]
        else:
            rows = ctx.decode_multi(np.array(cur, dtype=np.int32), np.array(past, dtype=np.int32),
                                    np.arange(n, dtype=np.int32), np.ones(n, dtype=np.uint8))
        for i in range(n):
            got[i].append(np.array(rows[i]))
            gen[i].append(int(np.argmax(rows[i])))
            past[i] += 1
    first: list[int | None] = []
    for i in range(n):
        solo.clear(False)
        solo.decode(prompts[i], 0, all_outputs=False)
        want = [np.array(solo.logits()[-1])]
        p = len(prompts[i])
        for t in gen[i][:-2]:
            solo.decode(np.array([t], dtype=np.int32), p)
            p += 1
            want.append(np.array(solo.logits()[-1]))
        first.append(next((k for k, (a, b) in enumerate(zip(want, got[i], strict=False)) if not np.array_equal(a, b)),
                          None))
    return first
