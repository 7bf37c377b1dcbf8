/* Internal API of the opbridge Ascend test double, for sibling doubles (the aclnn ops double
 * links against libacl_rt_impl.so and uses these to run "kernels" on the double's streams).
 * Not part of ACL: every name here is prefixed acldouble. */
#ifndef ACLDOUBLE_INTERNAL_H
#define ACLDOUBLE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Current counts of live device allocations, aclrtMallocHost allocations, user-created streams
 * and events. Any out-pointer may be NULL. Returns 0, or 100001 before aclInit. */
int acldoubleOutstanding(uint64_t *device_allocs, uint64_t *host_allocs, uint64_t *streams, uint64_t *events);

/* The code ACLDOUBLE_FAIL injects for this call of `func` (counting it), or 0: for the parts of
 * the double outside acl_rt_double.c (kernel binaries and launches). */
int acldouble_injected(const char *func);

/* Kernel binaries loaded (aclrtBinaryLoadFrom*) and not unloaded: what a leak check counts. */
uint64_t acldoubleLoadedBinaries(void);

/* Enqueue an opaque "kernel" task on `stream` (NULL = the calling thread's device's default
 * stream), with the same checks as any launch (init, current device, stream's device, not from
 * inside a callback, ACL_STOP_ON_FAILURE refusal). On the stream's worker thread, in stream
 * order, `run(ctx)` is called; a nonzero return fails the task: the stream's next synchronize
 * returns 507015 and the message names `name`. `release(ctx)` (if not NULL) is always called
 * exactly once after the task ran or was discarded (failed stream, destroy-force, finalize).
 * Returns an ACL error code (0 = enqueued). */
int acldouble_enqueue_kernel(void *stream, const char *name, int (*run)(void *ctx), void *ctx,
                             void (*release)(void *ctx));

/* The double's read-write address of the device range [devptr, devptr+bytes) when that range
 * lies inside one live device allocation (padding included); NULL otherwise, or when called
 * from a thread that is not a stream worker (host code must never touch device memory). */
void *acldouble_device_view(const void *devptr, size_t bytes);

/* 1 when [p, p+bytes) lies inside one live device allocation (padding included), else 0.
 * Callable from any thread. */
int acldouble_is_device_range(const void *p, size_t bytes);

#ifdef __cplusplus
}
#endif

#endif
