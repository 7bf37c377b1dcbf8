/* The driver's share of one `ob.ops.add` launch on Ascend, measured without opbridge: a C
 * client that makes the ACL / aclnn calls an ideal binding must make per call of a repeated
 * layout (point a cached repeatable executor at the call's three tensors, run phase 2), and
 * the same plus the completion event opbridge records per launch (a kept event, queried and
 * recorded again). bench_device.py compiles it with the system compiler and runs it on the same
 * libraries (the test double, or CANN), so opbridge's own host cost is the difference.
 *
 *     cc -O2 -o floor ascend_launch_floor.c -ldl && ./floor LIB_DIR CALLS
 *
 * Prints two lines: `floor_ns <ns per call>` (executor reuse only) and `floor_event_ns <ns per
 * call>` (with an event queried and recorded per call). Prototypes are those of CANN's
 * acl/acl_rt.h and aclnn/acl_meta.h, declared here (no CANN headers needed). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int aclError;
typedef void *aclrtStream;
typedef void *aclrtEvent;
typedef void aclTensor;
typedef void aclScalar;
typedef void aclOpExecutor;

/* Events reused round robin, as opbridge keeps finished ones. */
#define RING 64

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        fprintf(stderr, "missing %s: %s\n", name, dlerror());
        exit(2);
    }
    return p;
}

static void *open_lib(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    void *lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        fprintf(stderr, "cannot open %s: %s\n", path, dlerror());
        exit(2);
    }
    return lib;
}

#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        int rc_ = (call);                                                                                              \
        if (rc_) {                                                                                                     \
            fprintf(stderr, "%s failed: %d\n", #call, rc_);                                                            \
            exit(3);                                                                                                   \
        }                                                                                                              \
    } while (0)

static double now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s LIB_DIR CALLS\n", argv[0]);
        return 1;
    }
    const char *dir = argv[1];
    long calls = atol(argv[2]);
    void *rt = open_lib(dir, "libacl_rt.so");
    void *base = open_lib(dir, "libnnopbase.so");
    void *math = open_lib(dir, "libopapi_math.so");

    aclError (*init)(const char *) = sym(rt, "aclInit");
    aclError (*finalize)(void) = sym(rt, "aclFinalize");
    aclError (*set_device)(int32_t) = sym(rt, "aclrtSetDevice");
    aclError (*reset_device)(int32_t) = sym(rt, "aclrtResetDevice");
    aclError (*create_stream)(aclrtStream *) = sym(rt, "aclrtCreateStream");
    aclError (*destroy_stream)(aclrtStream) = sym(rt, "aclrtDestroyStream");
    aclError (*sync_stream)(aclrtStream) = sym(rt, "aclrtSynchronizeStream");
    aclError (*dmalloc)(void **, size_t, int) = sym(rt, "aclrtMalloc");
    aclError (*dfree)(void *) = sym(rt, "aclrtFree");
    aclError (*create_event)(aclrtEvent *, uint32_t) = sym(rt, "aclrtCreateEventWithFlag");
    aclError (*record_event)(aclrtEvent, aclrtStream) = sym(rt, "aclrtRecordEvent");
    aclError (*destroy_event)(aclrtEvent) = sym(rt, "aclrtDestroyEvent");
    aclError (*query_event)(aclrtEvent, int *) = sym(rt, "aclrtQueryEventStatus");
    aclTensor *(*create_tensor)(const int64_t *, uint64_t, int, const int64_t *, int64_t, int, const int64_t *,
                                uint64_t, void *) = sym(base, "aclCreateTensor");
    int (*destroy_tensor)(const aclTensor *) = sym(base, "aclDestroyTensor");
    aclScalar *(*create_scalar)(void *, int) = sym(base, "aclCreateScalar");
    int (*destroy_scalar)(const aclScalar *) = sym(base, "aclDestroyScalar");
    int (*repeatable)(aclOpExecutor *) = sym(base, "aclSetAclOpExecutorRepeatable");
    int (*destroy_executor)(aclOpExecutor *) = sym(base, "aclDestroyAclOpExecutor");
    int (*set_input)(aclOpExecutor *, size_t, aclTensor *, void *) = sym(base, "aclSetInputTensorAddr");
    int (*set_output)(aclOpExecutor *, size_t, aclTensor *, void *) = sym(base, "aclSetOutputTensorAddr");
    int (*add_ws)(const aclTensor *, const aclTensor *, const aclScalar *, aclTensor *, uint64_t *,
                  aclOpExecutor **) = sym(math, "aclnnAddGetWorkspaceSize");
    int (*add)(void *, uint64_t, aclOpExecutor *, aclrtStream) = sym(math, "aclnnAdd");

    CHECK(init(NULL));
    CHECK(set_device(0));
    aclrtStream stream;
    CHECK(create_stream(&stream));
    void *buf[3];
    for (int i = 0; i < 3; i++) CHECK(dmalloc(&buf[i], 64, 0));
    int64_t dims[1] = {4}, strides[1] = {1}, storage[1] = {4};
    aclTensor *t[3];
    for (int i = 0; i < 3; i++) t[i] = create_tensor(dims, 1, 0 /* FLOAT */, strides, 0, 2 /* ND */, storage, 1, buf[i]);
    float one = 1.0f;
    aclScalar *alpha = create_scalar(&one, 0);
    uint64_t ws = 0;
    aclOpExecutor *exec = NULL;
    CHECK(add_ws(t[0], t[1], alpha, t[2], &ws, &exec));
    CHECK(repeatable(exec));
    aclrtEvent ring[RING];
    for (int i = 0; i < RING; i++) CHECK(create_event(&ring[i], 0x1u | 0x8u)); /* SYNC | TIME_LINE */

    for (int with_event = 0; with_event < 2; with_event++) {
        double best = 1e9, best_cpu = 1e9;
        for (int round = 0; round < 9; round++) {
            double began = now(CLOCK_MONOTONIC), began_cpu = now(CLOCK_THREAD_CPUTIME_ID);
            for (long k = 0; k < calls; k++) {
                CHECK(set_input(exec, 0, t[0], buf[0]));
                CHECK(set_input(exec, 1, t[1], buf[1]));
                CHECK(set_output(exec, 0, t[2], buf[2]));
                CHECK(add(NULL, 0, exec, stream));
                if (with_event) { /* as opbridge does: reuse a finished event, record it */
                    aclrtEvent event = ring[k % RING];
                    int status = 0;
                    CHECK(query_event(event, &status));
                    CHECK(record_event(event, stream));
                }
            }
            double spent = (now(CLOCK_MONOTONIC) - began) / (double)calls;
            double spent_cpu = (now(CLOCK_THREAD_CPUTIME_ID) - began_cpu) / (double)calls;
            CHECK(sync_stream(stream));
            if (spent < best) best = spent;
            if (spent_cpu < best_cpu) best_cpu = spent_cpu;
        }
        /* Wall time, and the calling thread's CPU time (what the launch costs the host, not
           counting time the thread was preempted on this shared machine). */
        printf("%s %.1f\n", with_event ? "floor_event_ns" : "floor_ns", best * 1e9);
        printf("%s %.1f\n", with_event ? "floor_event_cpu_ns" : "floor_cpu_ns", best_cpu * 1e9);
    }

    for (int i = 0; i < RING; i++) CHECK(destroy_event(ring[i]));
    CHECK(destroy_executor(exec));
    for (int i = 0; i < 3; i++) {
        destroy_tensor(t[i]);
        CHECK(dfree(buf[i]));
    }
    destroy_scalar(alpha);
    CHECK(destroy_stream(stream));
    CHECK(reset_device(0));
    CHECK(finalize());
    return 0;
}
