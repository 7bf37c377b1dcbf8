"""ctypes peer for benchmarks/bench_bindings.py.

ctypes cannot create numpy arrays: the wrapper allocates the output with
np.empty in Python and passes the three arrays to the C kernel (a plain shared
library built from ../c_kernel/vadd.c), which is exactly the overhead a ctypes
user pays per call. Arguments go through numpy's documented
np.ctypeslib.ndpointer, which checks dtype and contiguity like the other peers.
"""

import ctypes

import numpy as np


def make_vector_add(library_path):
    """Return vector_add(a, b) -> new float32 array, given the kernel library."""
    lib = ctypes.CDLL(str(library_path))
    f32_array = np.ctypeslib.ndpointer(dtype=np.float32, flags="C_CONTIGUOUS")
    lib.vadd_f32.argtypes = [f32_array, f32_array, f32_array, ctypes.c_size_t]
    lib.vadd_f32.restype = None

    def vector_add(a, b):
        if a.shape != b.shape:
            raise ValueError("vector_add: shape mismatch")
        out = np.empty_like(a)
        lib.vadd_f32(a, b, out, a.size)
        return out

    return vector_add
