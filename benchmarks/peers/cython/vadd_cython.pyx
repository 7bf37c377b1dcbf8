# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython peer for benchmarks/bench_bindings.py: vector_add(a, b) -> a + b."""
import numpy as np


def vector_add(const float[::1] a, const float[::1] b):
    cdef Py_ssize_t i, n = a.shape[0]
    if b.shape[0] != n:
        raise ValueError("vector_add: length mismatch")
    out = np.empty(n, dtype=np.float32)
    cdef float[::1] o = out
    for i in range(n):
        o[i] = a[i] + b[i]
    return out
