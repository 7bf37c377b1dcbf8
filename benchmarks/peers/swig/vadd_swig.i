/* SWIG peer for benchmarks/bench_bindings.py: vector_add(a, b) -> a + b.
 *
 * SWIG cannot create numpy arrays (numpy.i is not shipped with SWIG or numpy
 * wheels), so the stock buffer-protocol typemaps of <pybuffer.i> hand the C
 * side raw pointers, and the Python shim below allocates the output with
 * np.empty: exactly the overhead a SWIG user pays per call.
 */
%module vadd_swig

%{
#include "vadd.h"
%}

%include <pybuffer.i>
%pybuffer_binary(const float *a, size_t na);
%pybuffer_binary(const float *b, size_t nb);
%pybuffer_mutable_binary(float *out, size_t nout);

%inline %{
/* Returns 0 on success, -1 if the buffers' lengths (in floats) differ. */
int vadd_into(const float *a, size_t na, const float *b, size_t nb, float *out, size_t nout) {
    if (na != nb || na != nout) return -1;
    vadd_f32(a, b, out, na);
    return 0;
}
%}

%pythoncode %{
import numpy as _np


def vector_add(a, b):
    # The buffer typemaps do not check the element type: do it here.
    if a.dtype != _np.float32 or b.dtype != _np.float32 or a.shape != b.shape:
        raise TypeError("vector_add: expected two float32 arrays of the same shape")
    out = _np.empty_like(a)
    if vadd_into(a, b, out) != 0:
        raise ValueError("vector_add: buffer length mismatch")
    return out
%}
