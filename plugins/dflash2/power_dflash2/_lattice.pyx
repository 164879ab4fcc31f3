# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""DFlash2's selector-lattice walk, line for line the DFlash2 branch of ``common/speculative.cpp``
(``common_speculative_impl_draft_dflash::draft``): float arithmetic, ``expf``, the first maximum
(``std::max_element``), and the ``p_min`` cut ``1.0f / sum < p_min`` in float."""

from libc.math cimport expf
from libc.stdint cimport int32_t

import numpy as np


def walk(const float[:, :] lattice, int top_k, int m, float p_min):
    """Walk block positions ``1..m`` of ``lattice`` (one row per block token: ``top_k`` candidate ids
    stored as floats, then the ``top_k x top_k`` successor scores of each predecessor slot) from slot
    0. Returns the proposals (``int32``, at most ``m``); a candidate that is no token id reads -1."""
    if top_k < 1:
        raise ValueError(f"selector top_k={top_k}: expected at least 1")
    if m < 0 or m >= lattice.shape[0]:
        raise ValueError(f"a walk over {m} block positions needs {m + 1} lattice rows; got {lattice.shape[0]}")
    cdef Py_ssize_t width = <Py_ssize_t>top_k * (top_k + 1)  # no int overflow, whatever top_k says
    if lattice.shape[1] < width:
        raise ValueError(f"lattice rows of width {lattice.shape[1]} cannot hold top_k={top_k} candidates and "
                         f"{top_k}x{top_k} scores")
    out = np.empty(m, dtype=np.int32)
    cdef int32_t[::1] ids = out
    cdef Py_ssize_t at
    cdef int i, s, best, n = 0, pred = 0
    cdef float top, total, cand
    with nogil:
        for i in range(1, m + 1):
            at = top_k + <Py_ssize_t>pred * top_k  # the scores of pred's successors
            best = 0
            top = lattice[i, at]
            for s in range(1, top_k):  # the first maximum
                if lattice[i, at + s] > top:
                    top = lattice[i, at + s]
                    best = s
            if p_min > 0.0:  # the softmax of those scores at the chosen slot: 1 / sum(exp(s_k - s_best))
                total = 0.0
                for s in range(top_k):
                    total = total + expf(lattice[i, at + s] - top)
                if (<float>1.0) / total < p_min:
                    break
            pred = best
            cand = lattice[i, pred]
            ids[n] = <int32_t>cand if 0.0 <= cand < 2147483648.0 else -1
            n += 1
    return out[:n]
