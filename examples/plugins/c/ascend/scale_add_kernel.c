/*
 * The device code of scale_add_ascend.c: out[i] = a[i] * alpha + b[i] over float32, the
 * elements split evenly between the launch's blocks.
 *
 * Written in the ACL test double's kernel dialect (test-only; see acldouble_kernel.h), which
 * mirrors Ascend C's kernel entry: `__global__ __aicore__`, GM_ADDR global-memory pointers,
 * GetBlockIdx()/GetBlockNum(). On a real NPU the same kernel is an Ascend C source
 * (scale_add_kernel.cpp with AscendC::GlobalTensor / LocalTensor queues) compiled by CANN's
 * toolchain into the kernel binary the plugin embeds; the plugin's host code does not change.
 *
 * alpha travels as its float32 bits in a 64-bit parameter (the dialect has no floating-point
 * parameters; Ascend C kernels may take a float directly).
 *
 *   python -m opbridge.testing.ascend_double --compile-kernel scale_add_kernel.c -o scale_add_kernel.bin
 */
#include <string.h>

#include "acldouble_kernel.h"

ACLDOUBLE_KERNEL_ARGS(scale_add_kernel, "pppll")
__global__ __aicore__ void scale_add_kernel(GM_ADDR a, GM_ADDR b, GM_ADDR out, uint64_t n, uint64_t alpha_bits) {
    uint32_t bits = (uint32_t)alpha_bits;
    float alpha;
    memcpy(&alpha, &bits, sizeof alpha);
    uint64_t per = (n + GetBlockNum() - 1) / GetBlockNum(), begin = GetBlockIdx() * per;
    const float *x = (const float *)a, *y = (const float *)b;
    float *z = (float *)out;
    for (uint64_t i = begin; i < n && i < begin + per; i++) z[i] = x[i] * alpha + y[i];
}
