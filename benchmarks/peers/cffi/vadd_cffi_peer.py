"""cffi peer for benchmarks/bench_bindings.py (API mode, compiled out of line).

cffi cannot create numpy arrays: the wrapper allocates the output with
np.empty in Python and passes the three buffers to the C kernel, which is
exactly the overhead a cffi user pays per call.
"""

from pathlib import Path

import numpy as np

MODULE_NAME = "vadd_cffi"
CDEF = "void vadd_f32(const float *a, const float *b, float *out, size_t n);"


def build(build_dir: Path, kernel_dir: Path) -> None:
    """Compile the extension module `vadd_cffi` into build_dir."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        MODULE_NAME,
        '#include "vadd.h"',
        sources=[str(kernel_dir / "vadd.c")],
        include_dirs=[str(kernel_dir)],
        extra_compile_args=["-O3"],
    )
    ffi.compile(tmpdir=str(build_dir))


def make_vector_add(module):
    """Return vector_add(a, b) -> new float32 array, given the compiled module."""
    ffi, lib = module.ffi, module.lib

    def vector_add(a, b):
        # from_buffer does not check the element type: do it here.
        if a.dtype != np.float32 or b.dtype != np.float32 or a.shape != b.shape:
            raise TypeError("vector_add: expected two float32 arrays of the same shape")
        out = np.empty_like(a)
        lib.vadd_f32(
            ffi.from_buffer("float[]", a),
            ffi.from_buffer("float[]", b),
            ffi.from_buffer("float[]", out, require_writable=True),
            a.size,
        )
        return out

    return vector_add
