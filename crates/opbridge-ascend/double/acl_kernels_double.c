/* Kernel binaries on the opbridge ACL double: aclrtBinaryLoadFromFile / aclrtBinaryLoadFromData,
 * aclrtBinaryGetFunction, aclrtBinaryUnLoad and aclrtLaunchKernelWithHostArgs (notes §1.11),
 * over the test-only kernel dialect of acldouble_kernel.h. Part of libacl_rt_impl.so; it uses the
 * runtime double only through its exported API (stream checks, device views, error text). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "acl_decls.h"
#include "double_internal.h"

#define EXPORT __attribute__((visibility("default")))
#define BIN_MAGIC 0x4b42494eu
#define FUNC_MAGIC 0x4b46554eu
#define MAX_ARGS 8

extern void acldouble_set_error(int code, const char *func, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

typedef struct kfunc {
    uint32_t magic;
    struct kbinary *bin;
    void *fn;
    char name[96];
    char letters[MAX_ARGS + 1];
    struct kfunc *next;
} kfunc;

typedef struct kbinary {
    uint32_t magic;
    void *dl;
    int device;
    int refs;     /* launches queued and not yet released */
    int unloaded; /* aclrtBinaryUnLoad called: freed when refs reaches 0 */
    kfunc *funcs;
    struct kbinary *next;
} kbinary;

typedef struct {
    kfunc *func;
    uint32_t blocks;
    uint64_t values[MAX_ARGS];
} launch;

static pthread_mutex_t g_klock = PTHREAD_MUTEX_INITIALIZER;
static kbinary *g_binaries; /* loaded, not unloaded */
static __thread uint32_t t_block_idx, t_block_num;

static uint32_t block_idx(void) { return t_block_idx; }
static uint32_t block_num(void) { return t_block_num; }

static aclError fail(const char *func, aclError code, const char *fmt, const char *detail) {
    acldouble_set_error((int)code, func, fmt, detail);
    return code;
}

/* caller holds g_klock */
static int binary_live(const kbinary *b) {
    for (kbinary *x = g_binaries; x; x = x->next)
        if (x == b) return 1;
    return 0;
}

static void binary_free(kbinary *b) { /* unlinked, no refs; g_klock held */
    for (kfunc *f = b->funcs, *next; f; f = next) {
        next = f->next;
        f->magic = 0;
        free(f);
    }
    dlclose(b->dl);
    b->magic = 0;
    free(b);
}

static aclError check_options(const char *F, const aclrtBinaryLoadOptions *options) {
    if (!options) return ACL_SUCCESS;
    if (options->numOpt && !options->options) return fail(F, ACL_ERROR_INVALID_PARAM, "%s", "options->options is null");
    for (size_t i = 0; i < options->numOpt; i++) {
        int type = options->options[i].type;
        if (type < 1 || type > 3) return fail(F, ACL_ERROR_RT_PARAM_INVALID, "%s", "unknown binary load option type");
    }
    return ACL_SUCCESS;
}

static aclError load(const char *F, const char *path, aclrtBinHandle *out) {
    int32_t device = -1;
    aclError rc = aclrtGetDevice(&device); /* init and a current device, as every ACL call */
    if (rc) return rc;
    void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!dl) return fail(F, ACL_ERROR_INVALID_FILE, "cannot load the kernel binary: %s", dlerror());
    uint32_t (**idx)(void) = dlsym(dl, "acldouble_block_idx");
    uint32_t (**num)(void) = dlsym(dl, "acldouble_block_num");
    if (!dlsym(dl, "acldouble_kernel_dialect") || !idx || !num) {
        dlclose(dl);
        return fail(F, ACL_ERROR_INVALID_FILE,
                    "%s is not a kernel binary of the double (build it from acldouble_kernel.h; double-only)", path);
    }
    *idx = block_idx;
    *num = block_num;
    kbinary *b = calloc(1, sizeof *b);
    if (!b) {
        dlclose(dl);
        return fail(F, ACL_ERROR_RT_MEMORY_ALLOCATION, "%s", "out of host memory");
    }
    b->magic = BIN_MAGIC;
    b->dl = dl;
    b->device = device;
    pthread_mutex_lock(&g_klock);
    b->next = g_binaries;
    g_binaries = b;
    pthread_mutex_unlock(&g_klock);
    *out = b;
    return ACL_SUCCESS;
}

EXPORT aclError aclrtBinaryLoadFromFile(const char *binPath, aclrtBinaryLoadOptions *options, aclrtBinHandle *binHandle) {
    const char *F = "aclrtBinaryLoadFromFile";
    if (!binPath || !binHandle) return fail(F, ACL_ERROR_INVALID_PARAM, "%s", "binPath or binHandle is null");
    aclError rc = check_options(F, options);
    return rc ? rc : load(F, binPath, binHandle);
}

EXPORT aclError aclrtBinaryLoadFromData(const void *data, size_t length, const aclrtBinaryLoadOptions *options,
                                        aclrtBinHandle *binHandle) {
    const char *F = "aclrtBinaryLoadFromData";
    if (!data || !length || !binHandle) return fail(F, ACL_ERROR_INVALID_PARAM, "%s", "data, length or binHandle is 0");
    aclError rc = check_options(F, options);
    if (rc) return rc;
    /* dlopen needs a file: a private temporary one, gone once loaded */
    const char *dir = getenv("TMPDIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/acldouble-kernel-XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(path);
    if (fd < 0) return fail(F, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot make a temporary file in %s", path);
    const char *p = data;
    size_t left = length;
    while (left) {
        ssize_t n = write(fd, p, left);
        if (n <= 0) break;
        p += n;
        left -= (size_t)n;
    }
    close(fd);
    rc = left ? fail(F, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot write %s", path) : load(F, path, binHandle);
    unlink(path);
    return rc;
}

EXPORT aclError aclrtBinaryGetFunction(const aclrtBinHandle binHandle, const char *kernelName,
                                       aclrtFuncHandle *funcHandle) {
    const char *F = "aclrtBinaryGetFunction";
    if (!binHandle || !kernelName || !funcHandle)
        return fail(F, ACL_ERROR_INVALID_PARAM, "%s", "binHandle, kernelName or funcHandle is null");
    pthread_mutex_lock(&g_klock);
    kbinary *b = binHandle;
    aclError rc = ACL_SUCCESS;
    if (!binary_live(b)) {
        rc = fail(F, ACL_ERROR_RT_PARAM_INVALID, "%s", "unknown or unloaded binary handle (double-only check)");
    } else {
        kfunc *f = NULL;
        for (kfunc *x = b->funcs; x; x = x->next)
            if (!strcmp(x->name, kernelName)) f = x;
        if (!f) {
            char args_name[160];
            snprintf(args_name, sizeof args_name, "%s__acldouble_args", kernelName);
            void *fn = strlen(kernelName) < sizeof f->name ? dlsym(b->dl, kernelName) : NULL;
            const char *letters = dlsym(b->dl, args_name);
            size_t n = letters ? strlen(letters) : 0;
            int ok = fn && letters && n <= MAX_ARGS && strspn(letters, "pil") == n;
            if (!ok) {
                rc = fail(F, ACL_ERROR_RT_PARAM_INVALID,
                          fn ? "kernel %s has no valid ACLDOUBLE_KERNEL_ARGS declaration (double-only)"
                             : "no kernel named %s in this binary",
                          kernelName);
            } else if (!(f = calloc(1, sizeof *f))) {
                rc = fail(F, ACL_ERROR_RT_MEMORY_ALLOCATION, "%s", "out of host memory");
            } else {
                f->magic = FUNC_MAGIC;
                f->bin = b;
                f->fn = fn;
                snprintf(f->name, sizeof f->name, "%s", kernelName);
                memcpy(f->letters, letters, n + 1);
                f->next = b->funcs;
                b->funcs = f;
            }
        }
        if (!rc) *funcHandle = f;
    }
    pthread_mutex_unlock(&g_klock);
    return rc;
}

EXPORT aclError aclrtBinaryUnLoad(aclrtBinHandle binHandle) {
    const char *F = "aclrtBinaryUnLoad";
    pthread_mutex_lock(&g_klock);
    kbinary *b = binHandle;
    aclError rc = ACL_SUCCESS;
    if (!b || !binary_live(b)) {
        rc = fail(F, ACL_ERROR_RT_PARAM_INVALID, "%s", "unknown or already unloaded binary handle (double-only check)");
    } else {
        kbinary **pp = &g_binaries;
        while (*pp != b) pp = &(*pp)->next;
        *pp = b->next;
        b->unloaded = 1;
        if (b->refs == 0) binary_free(b); /* else the last queued launch frees it */
    }
    pthread_mutex_unlock(&g_klock);
    return rc;
}

EXPORT uint64_t acldoubleLoadedBinaries(void) {
    pthread_mutex_lock(&g_klock);
    uint64_t n = 0;
    for (kbinary *b = g_binaries; b; b = b->next) n++;
    pthread_mutex_unlock(&g_klock);
    return n;
}

/* On the stream's worker: every block of the launch, in order. */
static int run_launch(void *ctx) {
    launch *l = ctx;
    uint64_t v[MAX_ARGS] = {0};
    for (int k = 0; l->func->letters[k]; k++) {
        v[k] = l->values[k];
        if (l->func->letters[k] == 'p') {
            void *view = acldouble_device_view((const void *)(uintptr_t)v[k], 1);
            if (!view) {
                fprintf(stderr, "acldouble: kernel %s: pointer parameter %d (%p) is not live device memory\n",
                        l->func->name, k, (void *)(uintptr_t)v[k]);
                return 1;
            }
            v[k] = (uint64_t)(uintptr_t)view;
        }
    }
    /* Integer-class parameters only (the dialect's rule): passed as 64-bit register slots, as
     * the x86-64 and AArch64 calling conventions do for pointers and integers alike. */
    void (*fn)(uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t);
    memcpy(&fn, &l->func->fn, sizeof fn);
    t_block_num = l->blocks;
    for (uint32_t b = 0; b < l->blocks; b++) {
        t_block_idx = b;
        fn(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
    }
    return 0;
}

static void release_launch(void *ctx) {
    launch *l = ctx;
    pthread_mutex_lock(&g_klock);
    kbinary *b = l->func->bin;
    if (--b->refs == 0 && b->unloaded) binary_free(b);
    pthread_mutex_unlock(&g_klock);
    free(l);
}

EXPORT aclError aclrtLaunchKernelWithHostArgs(aclrtFuncHandle funcHandle, uint32_t numBlocks, aclrtStream stream,
                                              aclrtLaunchKernelCfg *cfg, void *hostArgs, size_t argsSize,
                                              aclrtPlaceHolderInfo *placeHolderArray, size_t placeHolderNum) {
    const char *F = "aclrtLaunchKernelWithHostArgs";
    (void)cfg;
    aclError injected = acldouble_injected(F);
    if (injected) return fail(F, injected, "%s", "injected failure (ACLDOUBLE_FAIL)");
    if (!funcHandle) return fail(F, ACL_ERROR_INVALID_PARAM, "%s", "funcHandle is null");
    if (numBlocks == 0) return fail(F, ACL_ERROR_INVALID_PARAM, "%s", "numBlocks is 0");
    if (placeHolderArray || placeHolderNum)
        return fail(F, ACL_ERROR_RT_FEATURE_NOT_SUPPORT, "%s", "placeholders are not supported by the double");
    int32_t device = -1;
    aclError rc = aclrtGetDevice(&device);
    if (rc) return rc;
    launch *l = calloc(1, sizeof *l);
    if (!l) return fail(F, ACL_ERROR_RT_MEMORY_ALLOCATION, "%s", "out of host memory");
    pthread_mutex_lock(&g_klock);
    kfunc *f = funcHandle;
    int live = 0;
    for (kbinary *b = g_binaries; b && !live; b = b->next)
        for (kfunc *x = b->funcs; x; x = x->next)
            if (x == f) live = 1;
    if (!live) {
        rc = fail(F, ACL_ERROR_RT_PARAM_INVALID, "%s", "unknown function handle, or its binary was unloaded");
    } else if (f->bin->device != device) {
        rc = fail(F, ACL_ERROR_RT_STREAM_CONTEXT, "the binary of %s was loaded on another device", f->name);
    } else {
        /* the parameters in C struct layout: each aligned to its size */
        size_t at = 0;
        for (int k = 0; !rc && f->letters[k]; k++) {
            size_t size = f->letters[k] == 'i' ? 4 : 8;
            at = (at + size - 1) / size * size;
            if (!hostArgs || at + size > argsSize) {
                rc = fail(F, ACL_ERROR_INVALID_PARAM, "argsSize is too small for the parameters of %s", f->name);
                break;
            }
            if (size == 4) {
                uint32_t v;
                memcpy(&v, (const char *)hostArgs + at, 4);
                l->values[k] = v;
            } else {
                memcpy(&l->values[k], (const char *)hostArgs + at, 8);
            }
            if (f->letters[k] == 'p' && !acldouble_is_device_range((const void *)(uintptr_t)l->values[k], 1)) {
                char what[160];
                snprintf(what, sizeof what, "parameter %d of %s (%p)", k, f->name, (void *)(uintptr_t)l->values[k]);
                rc = fail(F, ACL_ERROR_RT_PARAM_INVALID, "%s is not device memory (double-only check)", what);
            }
            at += size;
        }
        if (!rc && (argsSize != at && argsSize != (at + 7) / 8 * 8))
            rc = fail(F, ACL_ERROR_INVALID_PARAM, "argsSize does not match the parameters of %s", f->name);
        if (!rc) {
            l->func = f;
            l->blocks = numBlocks;
            f->bin->refs++;
        }
    }
    pthread_mutex_unlock(&g_klock);
    if (rc) {
        free(l);
        return rc;
    }
    rc = acldouble_enqueue_kernel(stream, l->func->name, run_launch, l, release_launch);
    if (rc) release_launch(l); /* not taken: the release is ours */
    return rc;
}
