/* Plain C kernel shared by the SWIG, cffi and ctypes peers of bench_bindings.py. */
#ifndef VADD_H
#define VADD_H
#include <stddef.h>

/* out[i] = a[i] + b[i] for i < n. */
void vadd_f32(const float *a, const float *b, float *out, size_t n);

#endif
