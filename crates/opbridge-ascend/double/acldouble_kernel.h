/* The test double's kernel dialect (test-only): what a "kernel binary" is on the opbridge ACL
 * double. It stands in for an Ascend C kernel built by the vendor toolchain, so that code which
 * loads a kernel binary (aclrtBinaryLoadFromFile / ...FromData), finds a kernel in it
 * (aclrtBinaryGetFunction) and launches it on a stream (aclrtLaunchKernelWithHostArgs) runs in CI.
 *
 * A kernel binary of the double is a shared object built from plain C by the system compiler:
 *
 *     #include "acldouble_kernel.h"
 *     ACLDOUBLE_KERNEL_ARGS(vector_add_kernel, "pppi")
 *     __global__ __aicore__ void vector_add_kernel(GM_ADDR x, GM_ADDR y, GM_ADDR z, uint32_t n) {
 *         uint32_t per = (n + GetBlockNum() - 1) / GetBlockNum(), begin = GetBlockIdx() * per;
 *         for (uint32_t i = begin; i < n && i < begin + per; i++)
 *             ((float *)z)[i] = ((const float *)x)[i] + ((const float *)y)[i];
 *     }
 *
 *     cc -std=c11 -O2 -fPIC -shared -I<double folder> -o vector_add.so vector_add.c
 *
 * Rules of the dialect:
 * - Each kernel declares its parameters with ACLDOUBLE_KERNEL_ARGS(name, "..."), one letter per
 *   parameter: 'p' a global-memory pointer (GM_ADDR: a device address), 'i' a 32-bit integer,
 *   'l' a 64-bit integer. At most 8 parameters; no floating-point parameters (pass them in
 *   device memory). The launch's packed host arguments follow C struct layout (each parameter
 *   aligned to its size).
 * - GetBlockIdx() / GetBlockNum() say which of the launch's blocks runs. The double runs the
 *   blocks one after another on the stream's worker thread, in stream order.
 * - Pointer parameters arrive translated to the double's private view of device memory (the
 *   host cannot touch device memory; the kernel, like device code, can). A pointer argument
 *   that is not inside a live device allocation fails the launch.
 */
#ifndef ACLDOUBLE_KERNEL_H
#define ACLDOUBLE_KERNEL_H

#include <stdint.h>

#define __global__
#define __aicore__
#define GM_ADDR uint8_t *

#define ACLDOUBLE_EXPORT __attribute__((visibility("default")))

/* Set by the double when it loads the binary. */
ACLDOUBLE_EXPORT __attribute__((weak)) uint32_t (*acldouble_block_idx)(void);
ACLDOUBLE_EXPORT __attribute__((weak)) uint32_t (*acldouble_block_num)(void);
/* Marks a shared object as a kernel binary of this dialect (its version). */
ACLDOUBLE_EXPORT __attribute__((weak)) const int acldouble_kernel_dialect = 1;

static inline uint32_t GetBlockIdx(void) { return acldouble_block_idx(); }
static inline uint32_t GetBlockNum(void) { return acldouble_block_num(); }

#define ACLDOUBLE_KERNEL_ARGS(name, letters) ACLDOUBLE_EXPORT const char name##__acldouble_args[] = letters;

#endif
