"""The ``llama`` backend's open functions: an :class:`~power_core.spec.OpenRequest` becomes a target
(:func:`open_llama`) or a batch of sequences on one context (:func:`open_llama_batch`), with the
backend facts a receipt shows, and the verify cost curve the scheduler prices rounds with."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from power_core.artifacts import file_digest
from power_core.config import PowerConfig
from power_core.logs import get_logger
from power_core.spec import Grammars, OpenedBatch, OpenedModel, OpenRequest
from power_native import _llama, build_info
from power_native.batch import LlamaBatch
from power_native.loading import LlamaTokenizer, Offload, is_offloaded, load_model, numerics_guard, offload, warm_up
from power_native.models import resolve_model
from power_native.pool import DraftPool
from power_native.target import PREFILL_BATCH, LlamaTarget, context_shape, open_target, state_format

log = get_logger(__name__)


def _cost_cache(digest: str, n_threads: int, max_block: int, numerics: str, verify_capacity: int) -> Path:
    info = build_info()
    padded = [verify_capacity] if verify_capacity else []  # a padded target's curve is its own (flat)
    key = hashlib.sha256(json.dumps([digest, n_threads, max_block, numerics, info, _llama.cpu_backend(), *padded],
                                    sort_keys=True).encode()).hexdigest()[:20]
    root = Path(os.environ.get("POWER_NATIVE_CACHE", Path.home() / ".cache" / "power-native"))
    return root / "verify-cost" / f"{key}.json"


def verify_cost_curve(target: LlamaTarget, *, n_threads: int, reps: int = 3) -> tuple[float, ...]:
    """The cost of a verify pass of 1..max_block tokens relative to one token, on this model,
    build and thread count: measured once and cached under the model's digest
    (``POWER_VERIFY_COST_REFRESH=1`` measures again). Each of ``reps`` rounds times every width once,
    in turn, after a warm-up round (graph allocation per shape), at a context position of about 200 tokens,
    like a request in progress; a width's cost is its fastest round, since another process on the machine
    only ever adds time, and the widths share the rounds, so a burst of load meets them alike. A width is
    then held to ``[1, width]`` one-token passes, what a pass of that many tokens can cost: a curve taken
    on a busy machine otherwise tells the scheduler that drafting never pays, for as long as it is cached."""
    b_max = target.capabilities.max_block
    path = _cost_cache(target.capabilities.digest or "", n_threads, b_max, target.numerics,
                       target.capabilities.verify_capacity)
    try:
        if os.environ.get("POWER_VERIFY_COST_REFRESH", "") in ("1", "true", "yes"):
            raise OSError("refresh requested")
        cached = json.loads(path.read_text())
        if len(cached["relative"]) == b_max:
            return tuple(float(x) for x in cached["relative"])
    except (OSError, ValueError, KeyError):
        pass
    n_vocab = target.capabilities.n_vocab
    base = max(1, min(200, target.capabilities.n_ctx - b_max - 1))
    rng = np.random.default_rng(0)
    target.reset()
    target.prefill(rng.integers(0, n_vocab, base).astype(np.int32))
    blocks = [rng.integers(0, n_vocab, b).astype(np.int32) for b in range(1, b_max + 1)]
    seconds = [float("inf")] * b_max
    for r in range(reps + 1):  # round 0 warms up
        for i, block in enumerate(blocks):
            cp = target.checkpoint()
            t0 = time.perf_counter()
            target.decode(block)
            dt = time.perf_counter() - t0
            target.restore(cp)
            if r:
                seconds[i] = min(seconds[i], dt)
    target.reset()
    relative = tuple(min(max(t / seconds[0], 1.0), float(b)) for b, t in enumerate(seconds, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"digest": target.capabilities.digest, "n_threads": n_threads,
                                "one_token_s": seconds[0], "relative": relative}))
    return relative


def _backend_info(cfg: PowerConfig, placed: Offload, target: LlamaTarget, **extra: Any) -> dict[str, Any]:
    """The receipt's ``backend`` facts: the build, the kernels, where layers ran and the target context's
    shape (``extra``: what only a batch or only a target of its own has)."""
    caps = target.capabilities
    return {**build_info(), "backend": "llama", "cpu_backend": _llama.cpu_backend(), "numerics": cfg.numerics,
            "rpc_servers": list(cfg.rpc_servers),
            "devices": list(placed.used), "n_gpu_layers": placed.n_gpu_layers,
            "draft_gpu_layers": placed.draft_gpu_layers, "flash_attn": cfg.flash_attn, "arch": target.model.arch,
            "desc": target.model.desc, "n_ctx": caps.n_ctx, "n_batch": target.ctx.n_batch,
            "n_ubatch": target.ctx.n_ubatch, "n_rs_seq": target.ctx.n_rs_seq, "rollback_window": caps.rollback_window,
            "state_checkpoints": target.state_checkpoints, "n_threads": cfg.n_threads or os.cpu_count(),
            "verify_cost": list(caps.verify_cost) if caps.verify_cost else None, **extra}


def open_llama_batch(req: OpenRequest, n: int) -> OpenedBatch:
    """The ``llama`` backend's batch: ``n`` sequences of ``req.model`` on one context whose passes
    hold every active request's verify block (and prompt chunks)."""
    cfg = req.config
    placed = offload(cfg)
    path = resolve_model(req.model)
    digest = file_digest(path).sha256
    with contextlib.ExitStack() as undo:  # a failing step (the cost curve too) closes what was opened
        numerics_guard.acquire(cfg.numerics)
        undo.callback(numerics_guard.release, cfg.numerics)
        model = load_model(path, load_mtp="mtp_head" in req.features, rpc_servers=cfg.rpc_servers,
                           n_gpu_layers=placed.n_gpu_layers, devices=placed.devices)
        # recurrent state: one cell per sequence, each with its own n_rs_seq rollback snapshots
        # (llama.cpp keeps a sequence's trailing 1 + n_rs_seq tokens of a pass in one ubatch)
        recurrent = model.is_recurrent or model.is_hybrid
        shape = context_shape(req.max_block, req.snapshots, PREFILL_BATCH, recurrent)
        n_batch = max(shape["n_batch"], n * req.max_block)
        # n x n_ctx cells, so each request gets the configured context, as a session of its own would.
        # Attention-only targets with flash attention: one cache for every sequence (one ubatch per
        # pass; with one stream per sequence llama.cpp cuts a pass into ubatches holding as many
        # tokens of each sequence, one per distinct block length, and each reads all the weights
        # again). Batch-invariant kernels keep each sequence's cells in position order there
        # (native/patches/0003-kv-cache-ordered-cells.patch), so its rows stay its solo rows.
        # Recurrent state and attention without flash attention keep one stream per sequence.
        unified = not recurrent and cfg.flash_attn != "off"
        ctx = _llama.Context(model, n_ctx=cfg.n_ctx * n, n_threads=cfg.n_threads or os.cpu_count(), n_batch=n_batch,
                             n_ubatch=n_batch, n_outputs_max=n_batch, n_seq_max=n, kv_unified=unified,
                             n_rs_seq=shape["n_rs_seq"], flash_attn=cfg.flash_attn)
        undo.callback(ctx.close)
        if cfg.warmup:
            warm_up(ctx)
        per_seq = ctx.n_ctx // n
        formats = state_format(digest, numerics=cfg.numerics, flash_attn=cfg.flash_attn,
                               n_gpu_layers=placed.n_gpu_layers, devices=placed.devices, rpc_servers=cfg.rpc_servers)
        drafts = DraftPool(n)
        targets = tuple(LlamaTarget(model, ctx, max_block=req.max_block, digest=digest, features=req.features,
                                    numerics=cfg.numerics, seq_id=i, shared=True, n_ctx=per_seq, drafts=drafts,
                                    offloaded=is_offloaded(cfg.rpc_servers, placed.n_gpu_layers),
                                    state_format=formats) for i in range(n))
        batch = LlamaBatch(model, ctx, targets, unified=unified)
        if req.verify_cost:
            relative = verify_cost_curve(targets[0], n_threads=cfg.n_threads or os.cpu_count() or 1)
            for t in targets:
                t.set_verify_cost(relative)
        info = _backend_info(cfg, placed, targets[0], n_ctx_total=ctx.n_ctx, n_seq=n, kv_unified=unified)
        tokenizer = LlamaTokenizer(model)
        grammars = Grammars(tokenizer.vocabulary)
        models = tuple(OpenedModel(target=t, tokenizer=tokenizer, grammars=grammars, model_path=str(path),
                                   artifacts={"target": digest},
                                   backend_info={**info, "seq_id": t.seq_id}) for t in targets)
        undo.pop_all()  # opened: the batch owns its context and the numerics mode now
    # released once: by close(), or when a batch nobody closed is collected
    batch._release = weakref.finalize(batch, numerics_guard.release, cfg.numerics)
    return OpenedBatch(runtime=batch, models=models, close=batch.close)


def open_llama(req: OpenRequest) -> OpenedModel:
    """The ``llama`` backend: open ``req.model`` (``None``: embedded SmolLM2) as a :class:`LlamaTarget`."""
    cfg = req.config
    placed = offload(cfg)
    path = resolve_model(req.model)
    digest = file_digest(path).sha256
    target = open_target(path, n_ctx=cfg.n_ctx, max_block=req.max_block, snapshots=req.snapshots,
                         n_threads=cfg.n_threads, features=req.features, digest=digest, numerics=cfg.numerics,
                         rpc_servers=cfg.rpc_servers, n_gpu_layers=placed.n_gpu_layers, devices=placed.devices,
                         flash_attn=cfg.flash_attn, verify_capacity=cfg.verify_capacity, warmup=cfg.warmup)
    try:  # a failing step (the cost curve too) closes the target
        if req.verify_cost:
            target.set_verify_cost(verify_cost_curve(target, n_threads=cfg.n_threads or os.cpu_count() or 1))
        info = _backend_info(cfg, placed, target, snapshots_requested=req.snapshots)
        tokenizer = LlamaTokenizer(target.model)
    except BaseException:
        target.close()
        raise
    log.info("native.open", model=str(path), arch=target.model.arch, n_ctx=target.ctx.n_ctx,
             n_rs_seq=target.ctx.n_rs_seq)
    return OpenedModel(target=target, tokenizer=tokenizer, grammars=Grammars(tokenizer.vocabulary), model_path=str(path),
                       artifacts={"target": digest}, backend_info=info, close=target.close)
