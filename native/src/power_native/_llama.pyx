# cython: language_level=3, boundscheck=False, cdivision=True
# distutils: language = c++
"""Owning wrappers over the pinned llama.cpp: :class:`Model`, :class:`Context` (with its reusable
batch), llama.cpp logging routed to structlog, and the one place where return codes become
typed exceptions (:func:`rc_translate`, GIL-free, and :func:`rc_raise`).

Every ``GGML_ASSERT`` reachable through these wrappers is pre-checked here: batch larger than
``n_batch``, outputs above ``n_outputs_max``, ``n_ubatch <= n_rs_seq+1`` on recurrent memory, token
ids outside the vocabulary, context overflow, reading an untapped layer input and tapping a layer
the architecture does not record.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy
from libcpp cimport bool as cpp_bool
from libcpp.map cimport map as cpp_map

cimport cython
cimport numpy as cnp

from power_native.llama cimport *
from power_native.llama_ext cimport *

import atexit
import os
from collections import deque

import numpy as np
from power_core.artifacts import archs as _archs
from power_core.logs import get_logger

from power_core.errors import (ArtifactError, Cancelled, CapacityError, ConfigError, RuntimeFault,
                               StateLost)

cnp.import_array()


cdef extern from "<dlfcn.h>" nogil:
    ctypedef struct Dl_info:
        const char * dli_fname
    int dladdr(const void * addr, Dl_info * info)


class NoMemorySlot(CapacityError):
    """llama_decode found no memory slot for the batch (rc=1): the context is full, or, in a cache
    shared by several sequences, fragmented (:meth:`power_native.batch.LlamaBatch.compact`)."""

cdef extern from *:
    """
    #include <cmath>
    #include <cstring>
    #include <functional>
    #include <random>
    #include <string>
    #include <vector>
    #include "ggml-backend.h"

    struct power_fill_params { size_t seed; float stdev; };

    /* Random N(0, stdev) tensor data for synthetic models (as tests/test-llama-archs.cpp does):
       seeded per tensor name, ssm_a forced negative (state decay). */
    static void power_fill_tensor(struct ggml_tensor * t, void * ud) {
        const power_fill_params & p = *(const power_fill_params *) ud;
        size_t seed = p.seed ^ std::hash<std::string>()(t->name);
        std::mt19937 gen(seed);
        std::normal_distribution<float> dis(0.0f, p.stdev);
        const bool neg = strstr(t->name, "ssm_a") != nullptr;
        const int64_t ne = ggml_nelements(t);
        if (t->type == GGML_TYPE_F32) {
            std::vector<float> tmp(ne);
            for (int64_t i = 0; i < ne; i++) { float v = dis(gen); tmp[i] = neg ? -fabsf(v) : v; }
            ggml_backend_tensor_set(t, tmp.data(), 0, ggml_nbytes(t));
        } else if (t->type == GGML_TYPE_F16) {
            std::vector<ggml_fp16_t> tmp(ne);
            for (int64_t i = 0; i < ne; i++) { float v = dis(gen); tmp[i] = ggml_fp32_to_fp16(neg ? -fabsf(v) : v); }
            ggml_backend_tensor_set(t, tmp.data(), 0, ggml_nbytes(t));
        }
    }

    // data: a context's two flags, [0] an abort asked for, [1] held (no abort while set)
    static bool power_abort_cb(void * data) { volatile int * f = (volatile int *) data; return f[0] != 0 && f[1] == 0; }
    """
    struct power_fill_params:
        size_t seed
        float stdev
    void power_fill_tensor(ggml_tensor * t, void * ud) noexcept nogil
    bint power_abort_cb(void * data) noexcept nogil


__all__ = ["Model", "Context", "BatchExt", "BlockDraft", "set_log_level", "system_info", "last_errors", "first_max", "top10_p",
           "backend_devices", "LAYER_INP_ARCHS", "LAYER_INP_FINAL_ARCHS"]

#: archs whose graph records ``t_layer_inp[il]`` (else the next decode aborts, llama-graph.cpp:1384), and
#: the only archs that also record ``lid == n_layer`` (the output of the last layer): the tables the
#: artifact validator checks, generated from the pinned llama.cpp source (power_core.artifacts.archs)
LAYER_INP_ARCHS = _archs.LAYER_INPUT_ARCHS
LAYER_INP_FINAL_ARCHS = _archs.FINAL_TAP_ARCHS
#: ``llama_state_seq_flags`` of Context.state_get/state_set: the partial (recurrent/SWA) state only, and
#: its tensors kept in backend buffers of the context (one copy per sequence; a newer one replaces it)
STATE_PARTIAL_ONLY = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
STATE_ON_DEVICE = LLAMA_STATE_SEQ_FLAGS_ON_DEVICE

# -- logging ---------------------------------------------------------------------------------------
_log = get_logger("power_native.llama")  # stdlib logging: the host decides
include "_log.pxi"

cdef rc_kind rc_translate(rc_op op, long rc) noexcept nogil:
    """Map a return code of ``op`` to its kind (``RC_OK`` = success); GIL-free, so a ``nogil`` loop
    can tell success from failure by the same table :func:`rc_raise` raises from."""
    if op == RC_OP_BATCH:
        if rc >= 0:
            return RC_OK
        if rc == -1:
            return RC_BATCH_FULL
        if rc == -4:
            return RC_BATCH_WIDTH
        if rc == -6:
            return RC_BATCH_OUTPUTS
        return RC_INVALID
    if op == RC_OP_STATE_GET:
        return RC_STATE_LOST
    if rc == 0:
        return RC_OK
    if op == RC_OP_DECODE:
        if rc == 1:
            return RC_NO_SLOT
        if rc == 2:
            return RC_CANCELLED
        if rc == -1:
            return RC_INVALID
        return RC_FATAL
    if op == RC_OP_OUTPUT:
        return RC_NO_OUTPUT
    if op == RC_OP_STATE_SET:
        return RC_STATE_LOST
    if op == RC_OP_MODEL_LOAD:
        return RC_LOAD_FAILED
    if op == RC_OP_CONTEXT:
        return RC_NO_CONTEXT
    return RC_FATAL


cdef int rc_raise(rc_op op, long rc, str what) except -1:
    """Raise the typed exception for a return code of ``op`` (nothing for success); ``what`` names the
    failing step (prefixed to the message) or is None. Every native path translates through here,
    the GIL-free ones after leaving ``nogil``."""
    cdef rc_kind kind = rc_translate(op, rc)
    if kind == RC_OK:
        return 0
    detail = "; llama.cpp said: " + " | ".join(list(_errors)[-2:]) if _errors else ""
    at = f"{what}: " if what else ""
    if kind == RC_NO_SLOT:
        raise NoMemorySlot(f"{at}llama_decode: no memory slot for the batch (rc=1); raise n_ctx or "
                            f"shorten the request{detail}")
    if kind == RC_CANCELLED:
        raise Cancelled(f"{at}llama_decode was aborted through the cancel callback (rc=2); processed "
                        "micro-batches remain in memory and the runtime restores its checkpoint")
    if kind == RC_INVALID and op == RC_OP_DECODE:
        raise RuntimeFault(f"{at}llama_decode rejected the batch as invalid (rc=-1){detail}")
    if kind == RC_FATAL and op == RC_OP_DECODE:
        raise RuntimeFault(f"{at}llama_decode failed fatally (rc={rc}); the context may hold a partial "
                           f"batch{detail}")
    if kind == RC_BATCH_FULL:
        raise CapacityError(f"{at}the batch is full")
    if kind == RC_BATCH_WIDTH:
        raise CapacityError(f"{at}llama.cpp rejected the embedding row's width for this context; an MTP "
                            "context takes n_embd_out, others n_embd_inp")
    if kind == RC_BATCH_OUTPUTS:
        raise CapacityError(f"{at}more output rows than the context's n_outputs_max (llama.cpp would abort)")
    if kind == RC_INVALID and op == RC_OP_BATCH:
        raise RuntimeFault(f"{at}llama_batch_ext refused the entry (code {rc})")
    if kind == RC_NO_OUTPUT:
        raise RuntimeFault(f"{at}llama.cpp returned no output row for the decode{detail}")
    if kind == RC_STATE_LOST and op == RC_OP_STATE_SET:
        raise StateLost(f"{at}llama_state_seq_set_data_ext could not load the saved sequence state{detail}")
    if kind == RC_STATE_LOST:
        raise StateLost(f"{at}llama_state_seq_get_data_ext wrote {rc} bytes; expected the full state{detail}")
    if kind == RC_LOAD_FAILED:
        raise ArtifactError(f"{at}llama_model_load_from_file returned NULL{detail}", reason="gguf_load_failed")
    if kind == RC_NO_CONTEXT:
        raise CapacityError(f"{at}llama_init_from_model returned NULL (out of memory or unsupported "
                            f"parameters){detail}")
    raise RuntimeFault(f"{at}failed (rc={rc}){detail}")


def first_max(const float[::1] row) -> int:
    """The index of the first maximum of ``row`` (float32, at least one element) by the rule the drafters
    read their logits rows with on the host (``draft_pick``: numpy's ``argmax``, a NaN never the largest
    unless it is the first element)."""
    if row.shape[0] == 0:
        raise ValueError("first_max of an empty row")
    return power_row_first_max(&row[0], <int>row.shape[0])


def top10_p(const float[::1] row) -> float:
    """The softmax probability of ``row``'s maximum among its ten largest values: the confidence the drafters
    cut a draft at (``draft_top_p``, llama.cpp's top-k(10) and ``--spec-draft-p-min``)."""
    if row.shape[0] == 0:
        raise ValueError("top10_p of an empty row")
    return draft_top_p(&row[0], <int>row.shape[0])


include "_model.pxi"
include "_sampling.pxi"
include "_context.pxi"
include "_batch.pxi"
include "_block.pxi"
