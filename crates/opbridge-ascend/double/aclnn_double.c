/* libnnopbase.so of the opbridge Ascend test double: aclTensor/aclScalar/aclIntArray, executors,
 * error text, ACLDOUBLE_FAIL injection for aclnn names, and the kernels the op libraries enqueue
 * on the runtime double's streams (acldouble_enqueue_kernel). See README.md "aclnn operators". */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "aclnn_decls.h"
#include "double_internal.h"

/* Optional setter of the runtime double's aclGetRecentErrMsg buffer (requested from the runtime
 * side; used when exported). */
extern void acldouble_set_error(int code, const char *func, const char *fmt, ...) __attribute__((weak));

#define TENSOR_MAGIC 0x54454e53u
#define SCALAR_MAGIC 0x5343414cu
#define INTARR_MAGIC 0x494e5441u
#define EXEC_MAGIC 0x45584543u
#define DEAD_MAGIC 0xdeadbeefu

struct aclTensor {
    uint32_t magic;
    acldoubleTensorDesc d;
    uint64_t storage_elems;
};
struct aclScalar {
    uint32_t magic;
    int dtype;
    double f;
    int64_t i;
};
struct aclIntArray {
    uint32_t magic;
    uint64_t size;
    int64_t *v;
};
struct aclOpExecutor {
    uint32_t magic;
    int repeatable;
    int executed;
    acldoubleOpDesc desc;
    struct aclOpExecutor *next; /* live list / retired ring */
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t g_tensors, g_scalars, g_executors;
static struct aclOpExecutor *g_live; /* singly linked list of live executors */
#define RETIRED_RING 1024
static struct aclOpExecutor *g_retired[RETIRED_RING]; /* executed ones, kept to tell "twice" */
static unsigned g_retired_pos;

/* ------------------------------------------------------------------ errors */
static __thread char t_msg[1024];
static __thread int t_has_msg;

void acldoubleNnSetError(int code, const char *func, const char *fmt, ...) {
    char reason[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    const char *ez = code == ACLNN_ERR_PARAM_NULLPTR   ? "EZ1001"
                     : code == ACLNN_ERR_PARAM_INVALID ? "EZ1001"
                                                       : "EZ9999";
    snprintf(t_msg, sizeof t_msg, "%s: [PID: %d] %s failed (aclnn %d). Reason: %s", ez, (int)getpid(), func, code,
             reason);
    t_has_msg = 1;
    if (acldouble_set_error) acldouble_set_error(code, func, "%s", t_msg);
}

const char *acldoubleAclnnLastErrMsg(void) {
    static __thread char out[1024];
    if (!t_has_msg) return NULL;
    memcpy(out, t_msg, sizeof out);
    t_has_msg = 0;
    return out;
}

/* ------------------------------------------------------------------ fault injection */
#define MAX_FAIL 32
static struct {
    char name[64];
    uint64_t nth;
    int code; /* phase 1 only; 0 = ACLNN_ERR_INNER */
} g_fail[MAX_FAIL];
static int g_nfail;
static struct {
    char name[64];
    uint64_t count;
} g_calls[64];
static int g_ncalls;
static pthread_once_t g_fail_once = PTHREAD_ONCE_INIT;

/* ACLDOUBLE_FAIL is shared with the runtime double (comma list of func:N[:CODE]); this library
 * takes the entries whose name starts with "aclnn" and leaves the others to the runtime. */
static void parse_fail_env(void) {
    const char *env = getenv("ACLDOUBLE_FAIL");
    if (!env) return;
    char *copy = strdup(env), *save = NULL;
    if (!copy) return;
    for (char *tok = strtok_r(copy, ", ;\t\n", &save); tok; tok = strtok_r(NULL, ", ;\t\n", &save)) {
        if (strncmp(tok, "aclnn", 5) != 0 && strncmp(tok, "aclSet", 6) != 0) continue; /* the runtime's are aclrt* */
        char *c1 = strchr(tok, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL, *end;
        if (!c1) continue;
        *c1 = 0;
        if (c2) *c2 = 0;
        unsigned long long n = strtoull(c1 + 1, &end, 10);
        long code = c2 ? strtol(c2 + 1, NULL, 10) : 0;
        if (*end || n == 0 || strlen(tok) >= 64 || g_nfail == MAX_FAIL) {
            fprintf(stderr, "acldouble aclnn: ignoring ACLDOUBLE_FAIL entry for '%s'\n", tok);
            continue;
        }
        strcpy(g_fail[g_nfail].name, tok);
        g_fail[g_nfail].nth = n;
        g_fail[g_nfail].code = (int)code;
        g_nfail++;
    }
    free(copy);
}

int acldoubleNnInjectFail(const char *func) {
    pthread_once(&g_fail_once, parse_fail_env);
    if (g_nfail == 0) return 0;
    int fail = 0;
    pthread_mutex_lock(&g_lock);
    int k;
    for (k = 0; k < g_ncalls; k++)
        if (!strcmp(g_calls[k].name, func)) break;
    if (k == g_ncalls && g_ncalls < 64) {
        snprintf(g_calls[k].name, sizeof g_calls[k].name, "%s", func);
        g_calls[k].count = 0;
        g_ncalls++;
    }
    if (k < g_ncalls) {
        uint64_t n = ++g_calls[k].count;
        for (int j = 0; j < g_nfail; j++)
            if (!strcmp(g_fail[j].name, func) && g_fail[j].nth == n) fail = g_fail[j].code ? g_fail[j].code : ACLNN_ERR_INNER;
    }
    pthread_mutex_unlock(&g_lock);
    return fail;
}

/* ------------------------------------------------------------------ meta API */
int acldoubleNnDtypeSize(int dt) {
    switch (dt) {
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: return 4;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
    case ACL_DOUBLE: case ACL_INT64: case ACL_UINT64: return 8;
    case ACL_INT8: case ACL_UINT8: case ACL_BOOL: return 1;
    default: return 0;
    }
}

aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t *stride,
                           int64_t offset, aclFormat format, const int64_t *storageDims, uint64_t storageDimsNum,
                           void *tensorData) {
    static const char *F = "aclCreateTensor";
    (void)format;
    int isz = acldoubleNnDtypeSize(dataType);
    if (!isz) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "dataType %d is not supported by the double", (int)dataType);
        return NULL;
    }
    if (viewDimsNum > ACLNN_DOUBLE_MAX_DIMS || storageDimsNum > ACLNN_DOUBLE_MAX_DIMS) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "more than %d dims", ACLNN_DOUBLE_MAX_DIMS);
        return NULL;
    }
    if ((viewDimsNum && (!viewDims || !stride)) || (storageDimsNum && !storageDims)) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_NULLPTR, F, "viewDims/stride/storageDims NULL with a nonzero count");
        return NULL;
    }
    if (offset < 0) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "negative offset %lld", (long long)offset);
        return NULL;
    }
    uint64_t view_elems = 1, last = (uint64_t)offset;
    for (uint64_t i = 0; i < viewDimsNum; i++) {
        if (viewDims[i] < 0 || stride[i] < 0) {
            acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                                "negative view dim or stride at axis %llu (dim %lld, stride %lld; the double refuses "
                                "negative strides)",
                                (unsigned long long)i, (long long)viewDims[i], (long long)stride[i]);
            return NULL;
        }
        view_elems *= (uint64_t)viewDims[i];
        if (viewDims[i] > 0) last += (uint64_t)(viewDims[i] - 1) * (uint64_t)stride[i];
    }
    uint64_t storage_elems = 1;
    for (uint64_t i = 0; i < storageDimsNum; i++) {
        if (storageDims[i] < 0) {
            acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "negative storage dim");
            return NULL;
        }
        storage_elems *= (uint64_t)storageDims[i];
    }
    if (view_elems > 0 && last >= storage_elems) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                            "view (offset %lld, last element %llu) exceeds the storage of %llu elements (double)",
                            (long long)offset, (unsigned long long)last, (unsigned long long)storage_elems);
        return NULL;
    }
    if (!tensorData) {
        if (storage_elems || view_elems) {
            acldoubleNnSetError(ACLNN_ERR_PARAM_NULLPTR, F, "tensorData is NULL");
            return NULL;
        }
    } else {
        if ((uintptr_t)tensorData % 32) {
            acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                                "tensorData %p is not 32-byte aligned (CANN: undefined error; refused by the double)",
                                tensorData);
            return NULL;
        }
        size_t bytes = (size_t)(storage_elems ? storage_elems : 1) * (size_t)isz;
        if (!acldouble_is_device_range(tensorData, storage_elems ? bytes : 1)) {
            acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                                "storage [%p, +%zu bytes) is not inside one live device allocation (host pointer, "
                                "freed memory or too large storageDims; refused by the double)",
                                tensorData, bytes);
            return NULL;
        }
    }
    aclTensor *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->magic = TENSOR_MAGIC;
    t->d.dtype = dataType;
    t->d.ndim = viewDimsNum;
    for (uint64_t i = 0; i < viewDimsNum; i++) {
        t->d.dims[i] = viewDims[i];
        t->d.strides[i] = stride[i];
    }
    t->d.offset = offset;
    t->d.data = tensorData;
    t->storage_elems = storage_elems;
    pthread_mutex_lock(&g_lock);
    g_tensors++;
    pthread_mutex_unlock(&g_lock);
    return t;
}

aclnnStatus aclDestroyTensor(const aclTensor *tensor) {
    if (!tensor) return ACLNN_SUCCESS; /* CANN tolerates NULL here */
    if (tensor->magic != TENSOR_MAGIC) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, "aclDestroyTensor", "not a live aclTensor (double free?)");
        return ACLNN_ERR_PARAM_INVALID;
    }
    ((aclTensor *)tensor)->magic = DEAD_MAGIC;
    free((void *)tensor);
    pthread_mutex_lock(&g_lock);
    g_tensors--;
    pthread_mutex_unlock(&g_lock);
    return ACLNN_SUCCESS;
}

int acldoubleNnTensorDesc(const aclTensor *t, acldoubleTensorDesc *out) {
    if (!t) return ACLNN_ERR_PARAM_NULLPTR;
    if (t->magic != TENSOR_MAGIC) return ACLNN_ERR_PARAM_INVALID;
    *out = t->d;
    return 0;
}

aclScalar *aclCreateScalar(void *value, aclDataType dataType) {
    if (!value) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_NULLPTR, "aclCreateScalar", "value is NULL");
        return NULL;
    }
    aclScalar *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->magic = SCALAR_MAGIC;
    s->dtype = dataType;
    switch ((int)dataType) {
    case ACL_FLOAT: { float v; memcpy(&v, value, 4); s->f = v; s->i = isfinite(v) ? (int64_t)v : 0; break; }
    case ACL_DOUBLE: { double v; memcpy(&v, value, 8); s->f = v; s->i = (isfinite(v) && fabs(v) < 9.2e18) ? (int64_t)v : 0; break; }
    case ACL_FLOAT16: case ACL_BF16: {
        uint16_t h; memcpy(&h, value, 2);
        uint32_t bits;
        if (dataType == ACL_BF16) bits = (uint32_t)h << 16;
        else {
            uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
            if (e == 0x1f) bits = sign | 0x7f800000 | (m << 13);
            else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
            else if (!m) bits = sign;
            else { float v = ldexpf((float)m, -24); memcpy(&bits, &v, 4); bits |= sign; }
        }
        float v; memcpy(&v, &bits, 4); s->f = v; s->i = isfinite(v) ? (int64_t)v : 0; break;
    }
    case ACL_INT32: { int32_t v; memcpy(&v, value, 4); s->i = v; s->f = v; break; }
    case ACL_INT64: { int64_t v; memcpy(&v, value, 8); s->i = v; s->f = (double)v; break; }
    case ACL_INT8: { int8_t v; memcpy(&v, value, 1); s->i = v; s->f = v; break; }
    case ACL_UINT8: case ACL_BOOL: { uint8_t v; memcpy(&v, value, 1); s->i = v; s->f = v; break; }
    case ACL_INT16: { int16_t v; memcpy(&v, value, 2); s->i = v; s->f = v; break; }
    default:
        free(s);
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, "aclCreateScalar", "dataType %d not supported by the double",
                            (int)dataType);
        return NULL;
    }
    pthread_mutex_lock(&g_lock);
    g_scalars++;
    pthread_mutex_unlock(&g_lock);
    return s;
}

aclnnStatus aclDestroyScalar(const aclScalar *scalar) {
    if (!scalar) return ACLNN_SUCCESS;
    if (scalar->magic != SCALAR_MAGIC) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, "aclDestroyScalar", "not a live aclScalar (double free?)");
        return ACLNN_ERR_PARAM_INVALID;
    }
    ((aclScalar *)scalar)->magic = DEAD_MAGIC;
    free((void *)scalar);
    pthread_mutex_lock(&g_lock);
    g_scalars--;
    pthread_mutex_unlock(&g_lock);
    return ACLNN_SUCCESS;
}

int acldoubleNnScalarValue(const aclScalar *s, double *f, int64_t *i) {
    if (!s) return ACLNN_ERR_PARAM_NULLPTR;
    if (s->magic != SCALAR_MAGIC) return ACLNN_ERR_PARAM_INVALID;
    *f = s->f;
    *i = s->i;
    return 0;
}

int acldoubleNnIntArrayValues(const aclIntArray *a, const int64_t **values, uint64_t *size) {
    if (!a) return ACLNN_ERR_PARAM_NULLPTR;
    if (a->magic != INTARR_MAGIC) return ACLNN_ERR_PARAM_INVALID;
    *values = a->v;
    *size = a->size;
    return 0;
}

aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size) {
    if (!value && size) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_NULLPTR, "aclCreateIntArray", "value NULL with size %llu",
                            (unsigned long long)size);
        return NULL;
    }
    aclIntArray *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->v = malloc((size ? size : 1) * sizeof(int64_t));
    if (!a->v) { free(a); return NULL; }
    if (size) memcpy(a->v, value, size * sizeof(int64_t));
    a->size = size;
    a->magic = INTARR_MAGIC;
    return a;
}

aclnnStatus aclDestroyIntArray(const aclIntArray *array) {
    if (!array) return ACLNN_SUCCESS;
    if (array->magic != INTARR_MAGIC) return ACLNN_ERR_PARAM_INVALID;
    ((aclIntArray *)array)->magic = DEAD_MAGIC;
    free(array->v);
    free((void *)array);
    return ACLNN_SUCCESS;
}

aclnnStatus aclnnInit(const char *configPath) { (void)configPath; return ACLNN_SUCCESS; }
aclnnStatus aclnnFinalize(void) { return ACLNN_SUCCESS; }

int acldoubleAclnnOutstanding(uint64_t *tensors, uint64_t *scalars, uint64_t *executors) {
    pthread_mutex_lock(&g_lock);
    if (tensors) *tensors = g_tensors;
    if (scalars) *scalars = g_scalars;
    if (executors) *executors = g_executors;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* ------------------------------------------------------------------ executors */
aclOpExecutor *acldoubleNnNewExecutor(const acldoubleOpDesc *desc) {
    aclOpExecutor *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->magic = EXEC_MAGIC;
    e->desc = *desc;
    pthread_mutex_lock(&g_lock);
    e->next = g_live;
    g_live = e;
    g_executors++;
    pthread_mutex_unlock(&g_lock);
    return e;
}

/* 1 live, 2 retired (executed, destroyed by phase 2), 0 unknown; caller holds g_lock */
static int exec_state(aclOpExecutor *e) {
    for (aclOpExecutor *p = g_live; p; p = p->next)
        if (p == e) return 1;
    for (unsigned i = 0; i < RETIRED_RING; i++)
        if (g_retired[i] == e) return 2;
    return 0;
}

static void unlink_live(aclOpExecutor *e) { /* caller holds g_lock */
    for (aclOpExecutor **pp = &g_live; *pp; pp = &(*pp)->next)
        if (*pp == e) { *pp = e->next; break; }
    g_executors--;
}

static void retire(aclOpExecutor *e) { /* caller holds g_lock; keeps the memory to tell "twice" */
    unlink_live(e);
    e->magic = DEAD_MAGIC;
    unsigned pos = g_retired_pos++ % RETIRED_RING;
    free(g_retired[pos]);
    g_retired[pos] = e;
}

aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor) {
    static const char *F = "aclSetAclOpExecutorRepeatable";
    if (!executor) {
        acldoubleNnSetError(ACLNN_ERR_INNER_NULLPTR, F, "executor is NULL");
        return ACLNN_ERR_INNER_NULLPTR;
    }
    pthread_mutex_lock(&g_lock);
    int st = exec_state(executor);
    int rc = 0, in_place = 0;
    if (st != 1) rc = ACLNN_ERR_PARAM_INVALID;
    else if (executor->executed) rc = ACLNN_ERR_PARAM_INVALID;
    else if (executor->desc.op == ACLDOUBLE_OP_COPY || executor->desc.absent_mask) rc = in_place = ACLNN_ERR_PARAM_INVALID;
    else executor->repeatable = 1;
    pthread_mutex_unlock(&g_lock);
    if (in_place)
        acldoubleNnSetError(rc, F,
                            "executor %p: double-only: in-place copies and calls with absent optional tensors are not "
                            "repeatable (their address setters' indices are not the parameter order)",
                            (void *)executor);
    else if (rc)
        acldoubleNnSetError(rc, F, "executor %p is not a live, not yet executed executor (double)", (void *)executor);
    return rc;
}

aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor) {
    static const char *F = "aclDestroyAclOpExecutor";
    if (!executor) {
        acldoubleNnSetError(ACLNN_ERR_INNER_NULLPTR, F, "executor is NULL");
        return ACLNN_ERR_INNER_NULLPTR;
    }
    pthread_mutex_lock(&g_lock);
    int st = exec_state(executor);
    int rc = 0;
    if (st != 1) rc = ACLNN_ERR_PARAM_INVALID;
    else if (!executor->repeatable) rc = ACLNN_ERR_PARAM_INVALID;
    else {
        unlink_live(executor);
        executor->magic = DEAD_MAGIC;
        free(executor);
    }
    pthread_mutex_unlock(&g_lock);
    if (rc == ACLNN_ERR_PARAM_INVALID)
        acldoubleNnSetError(rc, F,
                            st == 1 ? "executor %p is not repeatable: phase 2 owns and destroys it (double)"
                                    : "executor %p is not live (already destroyed or run by phase 2) (double)",
                            (void *)executor);
    return rc;
}

/* aclSetInputTensorAddr / aclSetOutputTensorAddr: a repeatable executor's tensor `index` (inputs
 * and outputs counted separately, tensors only, in the operator's parameter order) gets storage
 * `addr`; so does `tensor`. The next phase 2 runs on the new address (phase 2 snapshots). */
static aclnnStatus set_tensor_addr(const char *F, aclOpExecutor *executor, size_t index, aclTensor *tensor, void *addr,
                                   int output) {
    if (!executor || !tensor) {
        acldoubleNnSetError(ACLNN_ERR_INNER_NULLPTR, F, "executor or tensor is NULL");
        return ACLNN_ERR_INNER_NULLPTR;
    }
    if (tensor->magic != TENSOR_MAGIC) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "tensor %p is not a live aclTensor (double)", (void *)tensor);
        return ACLNN_ERR_PARAM_INVALID;
    }
    int injected = acldoubleNnInjectFail(F);
    if (injected) {
        acldoubleNnSetError(injected, F, "failure injected by ACLDOUBLE_FAIL");
        return injected;
    }
    if ((uintptr_t)addr % 32) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                            "addr %p is not 32-byte aligned (CANN: undefined error; refused by the double)", addr);
        return ACLNN_ERR_PARAM_INVALID;
    }
    int isz = acldoubleNnDtypeSize(tensor->d.dtype);
    size_t bytes = (size_t)(tensor->storage_elems ? tensor->storage_elems : 1) * (size_t)isz;
    if (!acldouble_is_device_range(addr, tensor->storage_elems ? bytes : 1)) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                            "storage [%p, +%zu bytes) is not inside one live device allocation (refused by the double)",
                            addr, bytes);
        return ACLNN_ERR_PARAM_INVALID;
    }
    pthread_mutex_lock(&g_lock);
    int st = exec_state(executor), rc = 0;
    const char *why = NULL;
    if (st != 1) {
        rc = ACLNN_ERR_PARAM_INVALID;
        why = "is not a live executor (already destroyed, or consumed by phase 2)";
    } else if (!executor->repeatable) {
        rc = ACLNN_ERR_PARAM_INVALID;
        why = "is not repeatable (aclSetAclOpExecutorRepeatable first; double-only check)";
    } else {
        size_t inputs = (size_t)executor->desc.ntensors - 1;
        size_t slot = output ? inputs + index : index;
        if ((output && index >= 1) || (!output && index >= inputs)) {
            rc = ACLNN_ERR_PARAM_INVALID;
            why = "has no tensor at that index";
        } else {
            executor->desc.t[slot].data = addr;
            tensor->d.data = addr;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (rc)
        acldoubleNnSetError(rc, F, "executor %p %s (%s index %zu)", (void *)executor, why, output ? "output" : "input",
                            index);
    return rc;
}

aclnnStatus aclSetInputTensorAddr(aclOpExecutor *executor, const size_t index, aclTensor *tensor, void *addr) {
    return set_tensor_addr("aclSetInputTensorAddr", executor, index, tensor, addr, 0);
}

aclnnStatus aclSetOutputTensorAddr(aclOpExecutor *executor, const size_t index, aclTensor *tensor, void *addr) {
    return set_tensor_addr("aclSetOutputTensorAddr", executor, index, tensor, addr, 1);
}

/* ------------------------------------------------------------------ number formats */
static float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0x1f) bits = sign | 0x7f800000 | (m << 13);
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else {
        float v = ldexpf((float)m, -24);
        return sign ? -v : v;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* double -> half, round to nearest even (as numpy's npy_double_to_half) */
static uint16_t d2h(double d) {
    uint64_t b;
    memcpy(&b, &d, 8);
    uint16_t sign = (uint16_t)((b >> 48) & 0x8000);
    uint64_t exp = (b >> 52) & 0x7ff, man = b & ((1ull << 52) - 1);
    if (exp == 0x7ff) return man ? (uint16_t)(sign | 0x7e00 | (man >> 42)) : (uint16_t)(sign | 0x7c00);
    int e = (int)exp - 1023 + 15;
    if (e >= 31) return sign | 0x7c00;
    uint64_t m, hm, lower, halfp;
    int s;
    if (e >= 1) {
        m = man;
        s = 42;
    } else {
        if (exp == 0) return sign;
        m = man | (1ull << 52);
        s = 1051 - (int)exp; /* shift to units of 2^-24 */
        if (s > 53) return sign;
    }
    hm = m >> s;
    lower = m & ((1ull << s) - 1);
    halfp = 1ull << (s - 1);
    if (lower > halfp || (lower == halfp && (hm & 1))) hm++;
    if (e >= 1) return (uint16_t)(sign | (((uint64_t)e << 10) + hm));
    return (uint16_t)(sign | hm);
}

static float bf2f(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static int is_float(int dt) { return dt == ACL_FLOAT || dt == ACL_FLOAT16 || dt == ACL_DOUBLE || dt == ACL_BF16; }

static double ld_f(const char *p, int dt) {
    switch (dt) {
    case ACL_FLOAT: { float v; memcpy(&v, p, 4); return v; }
    case ACL_DOUBLE: { double v; memcpy(&v, p, 8); return v; }
    case ACL_FLOAT16: { uint16_t v; memcpy(&v, p, 2); return h2f(v); }
    case ACL_BF16: { uint16_t v; memcpy(&v, p, 2); return bf2f(v); }
    default: return 0;
    }
}

static int64_t ld_i(const char *p, int dt) {
    switch (dt) {
    case ACL_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
    case ACL_INT64: { int64_t v; memcpy(&v, p, 8); return v; }
    case ACL_BOOL: case ACL_UINT8: return (uint8_t)*p;
    case ACL_INT8: return (int8_t)*p;
    case ACL_INT16: { int16_t v; memcpy(&v, p, 2); return v; }
    default: return 0;
    }
}

/* store a double into a float dtype with one rounding (float32/bf16 via float) */
static void st_f(char *p, int dt, double v) {
    switch (dt) {
    case ACL_FLOAT: { float f = (float)v; memcpy(p, &f, 4); break; }
    case ACL_DOUBLE: memcpy(p, &v, 8); break;
    case ACL_FLOAT16: { uint16_t h = d2h(v); memcpy(p, &h, 2); break; }
    case ACL_BF16: { uint16_t h = f2bf((float)v); memcpy(p, &h, 2); break; }
    default: break;
    }
}

static void st_i(char *p, int dt, int64_t v) {
    switch (dt) {
    case ACL_INT32: { int32_t w = (int32_t)(uint32_t)(uint64_t)v; memcpy(p, &w, 4); break; }
    case ACL_INT64: memcpy(p, &v, 8); break;
    case ACL_BOOL: *p = v != 0; break;
    case ACL_UINT8: case ACL_INT8: *p = (char)(uint8_t)(uint64_t)v; break;
    case ACL_INT16: { int16_t w = (int16_t)(uint16_t)(uint64_t)v; memcpy(p, &w, 2); break; }
    default: break;
    }
}

/* round a float32 result to the storage precision of dt (identity for float32) */
static float rnd(float v, int dt) {
    if (dt == ACL_FLOAT16) return h2f(d2h(v));
    if (dt == ACL_BF16) return bf2f(f2bf(v));
    return v;
}

/* element conversion for cast / copy, numpy rules; out-of-range float->int is defined here
 * (INT_MIN pattern, like x86) instead of C UB */
static void convert(char *dst, int ddt, const char *src, int sdt) {
    if (sdt == ddt) {
        memcpy(dst, src, (size_t)acldoubleNnDtypeSize(ddt));
        return;
    }
    if (is_float(sdt)) {
        double v = ld_f(src, sdt);
        if (is_float(ddt)) {
            if (ddt == ACL_BF16 && sdt == ACL_DOUBLE) v = (float)v; /* double -> float -> bf16 */
            st_f(dst, ddt, v);
        } else if (ddt == ACL_BOOL) {
            *dst = v != 0 || isnan(v);
        } else {
            int64_t i;
            if (ddt == ACL_INT32) i = (isnan(v) || v <= -2147483649.0 || v >= 2147483648.0) ? INT32_MIN : (int64_t)v;
            else i = (isnan(v) || v < -9223372036854775808.0 || v >= 9223372036854775808.0) ? INT64_MIN : (int64_t)v;
            st_i(dst, ddt, i);
        }
    } else {
        int64_t i = ld_i(src, sdt);
        if (is_float(ddt)) {
            if (ddt == ACL_FLOAT) st_f(dst, ddt, (double)(float)i);
            else st_f(dst, ddt, (double)i);
        } else {
            st_i(dst, ddt, i);
        }
    }
}

/* ------------------------------------------------------------------ kernels */
typedef struct {
    acldoubleOpDesc d;
    char *view[ACLDOUBLE_MAX_TENSORS]; /* worker view of each tensor's first element (offset applied) */
    char *ws;
    int inject_fail;
} task_t;

static void task_release(void *ctx) { free(ctx); }

static int64_t view_span(const acldoubleTensorDesc *t, int isz, int *empty) {
    int64_t last = 0;
    *empty = 0;
    for (uint64_t i = 0; i < t->ndim; i++) {
        if (t->dims[i] == 0) *empty = 1;
        else last += (t->dims[i] - 1) * t->strides[i];
    }
    return (last + 1) * isz;
}

static uint64_t numel(const acldoubleTensorDesc *t) {
    uint64_t n = 1;
    for (uint64_t i = 0; i < t->ndim; i++) n *= (uint64_t)t->dims[i];
    return n;
}

static double g_gbps = -1;
static pthread_once_t g_gbps_once = PTHREAD_ONCE_INIT;
static void parse_gbps(void) {
    const char *s = getenv("ACLDOUBLE_KERNEL_GBPS");
    g_gbps = s ? strtod(s, NULL) : 0;
}

/* broadcast strides of `t` against an output of `ondim` dims (right-aligned; size-1 dims get stride 0) */
static void bcast_strides(const acldoubleTensorDesc *t, uint64_t ondim, int64_t *st) {
    for (uint64_t i = 0; i < ondim; i++) st[i] = 0;
    for (uint64_t i = 0; i < t->ndim; i++) {
        uint64_t oi = ondim - t->ndim + i;
        st[oi] = t->dims[i] == 1 ? 0 : t->strides[i];
    }
}

static int64_t ipow_wrap(int64_t b, int64_t e) {
    if (e < 0) return b == 1 ? 1 : b == -1 ? ((e & 1) ? -1 : 1) : 0;
    uint64_t r = 1, x = (uint64_t)b;
    while (e) {
        if (e & 1) r *= x;
        x *= x;
        e >>= 1;
    }
    return (int64_t)r;
}

static void binary_elem(const acldoubleOpDesc *d, const char *a, const char *b, char *o) {
    int dt = d->t[0].dtype, odt = d->t[2].dtype;
    int op = d->op;
    if (is_float(dt)) {
        if (dt == ACL_DOUBLE) {
            double x = ld_f(a, dt), y = ld_f(b, dt), r;
            switch (op) {
            case ACLDOUBLE_OP_ADD: { double t = d->alpha_f * y; r = x + t; break; }
            case ACLDOUBLE_OP_SUB: { double t = d->alpha_f * y; r = x - t; break; }
            case ACLDOUBLE_OP_MUL: r = x * y; break;
            case ACLDOUBLE_OP_DIV: r = x / y; break;
            case ACLDOUBLE_OP_MAX: r = (x >= y || isnan(x)) ? x : y; break;
            case ACLDOUBLE_OP_MIN: r = (x <= y || isnan(x)) ? x : y; break;
            default: r = pow(x, y); break;
            }
            st_f(o, odt, r);
        } else {
            float x = (float)ld_f(a, dt), y = (float)ld_f(b, dt), r;
            float al = rnd((float)d->alpha_f, dt);
            switch (op) {
            case ACLDOUBLE_OP_ADD: { float t = rnd(al * y, dt); r = x + t; break; }
            case ACLDOUBLE_OP_SUB: { float t = rnd(al * y, dt); r = x - t; break; }
            case ACLDOUBLE_OP_MUL: r = x * y; break;
            case ACLDOUBLE_OP_DIV: r = x / y; break;
            case ACLDOUBLE_OP_MAX: r = (x >= y || isnan(x)) ? x : y; break;
            case ACLDOUBLE_OP_MIN: r = (x <= y || isnan(x)) ? x : y; break;
            default: r = powf(x, y); break;
            }
            st_f(o, odt, r);
        }
    } else {
        int64_t x = ld_i(a, dt), y = ld_i(b, dt);
        uint64_t ux = (uint64_t)x, uy = (uint64_t)y, ua = (uint64_t)d->alpha_i;
        switch (op) {
        case ACLDOUBLE_OP_ADD: st_i(o, odt, (int64_t)(ux + ua * uy)); break;
        case ACLDOUBLE_OP_SUB: st_i(o, odt, (int64_t)(ux - ua * uy)); break;
        case ACLDOUBLE_OP_MUL: st_i(o, odt, (int64_t)(ux * uy)); break;
        case ACLDOUBLE_OP_DIV: st_f(o, odt, (double)x / (double)y); break; /* CANN: int / int -> float */
        case ACLDOUBLE_OP_MAX: st_i(o, odt, x > y ? x : y); break;
        case ACLDOUBLE_OP_MIN: st_i(o, odt, x < y ? x : y); break;
        default: st_i(o, odt, ipow_wrap(x, y)); break;
        }
    }
}

/* Unary ops, computed in the input's precision (float16 and bfloat16 in float, rounded on store). */
static void unary_elem(const acldoubleOpDesc *d, const char *a, char *o) {
    int dt = d->t[0].dtype, odt = d->t[1].dtype;
    if (is_float(dt)) {
        double x = ld_f(a, dt), r;
        if (dt == ACL_DOUBLE) {
            switch (d->op) {
            case ACLDOUBLE_OP_NEG: r = -x; break;
            case ACLDOUBLE_OP_ABS: r = fabs(x); break;
            case ACLDOUBLE_OP_EXP: r = exp(x); break;
            case ACLDOUBLE_OP_LOG: r = log(x); break;
            case ACLDOUBLE_OP_SQRT: r = sqrt(x); break;
            case ACLDOUBLE_OP_RELU: r = x > 0 ? x : (isnan(x) ? x : 0.0); break;
            case ACLDOUBLE_OP_SIGMOID: r = 1.0 / (1.0 + exp(-x)); break;
            case ACLDOUBLE_OP_TANH: r = tanh(x); break;
            case ACLDOUBLE_OP_GELU:
                r = d->alpha_i ? 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
                               : 0.5 * x * (1.0 + erf(x * 0.7071067811865476));
                break;
            default: r = x / (1.0 + exp(-x)); break; /* silu */
            }
        } else {
            float f = (float)x;
            switch (d->op) {
            case ACLDOUBLE_OP_NEG: r = -f; break;
            case ACLDOUBLE_OP_ABS: r = fabsf(f); break;
            case ACLDOUBLE_OP_EXP: r = expf(f); break;
            case ACLDOUBLE_OP_LOG: r = logf(f); break;
            case ACLDOUBLE_OP_SQRT: r = sqrtf(f); break;
            case ACLDOUBLE_OP_RELU: r = f > 0 ? f : (isnan(f) ? f : 0.0f); break;
            case ACLDOUBLE_OP_SIGMOID: r = 1.0f / (1.0f + expf(-f)); break;
            case ACLDOUBLE_OP_TANH: r = tanhf(f); break;
            case ACLDOUBLE_OP_GELU:
                r = d->alpha_i ? 0.5f * f * (1.0f + tanhf(0.7978845608f * (f + 0.044715f * f * f * f)))
                               : 0.5f * f * (1.0f + erff(f * 0.70710678f));
                break;
            default: r = f / (1.0f + expf(-f)); break; /* silu */
            }
        }
        st_f(o, odt, r);
        return;
    }
    int64_t x = ld_i(a, dt); /* phase 1 lets only neg, abs and relu through for integers */
    switch (d->op) {
    case ACLDOUBLE_OP_NEG: st_i(o, odt, (int64_t)(0 - (uint64_t)x)); break;
    case ACLDOUBLE_OP_ABS: st_i(o, odt, x < 0 ? (int64_t)(0 - (uint64_t)x) : x); break;
    default: st_i(o, odt, x > 0 ? x : 0); break; /* relu */
    }
}

/* Elementwise ops (binary, unary, cast, copy): results go to a contiguous temporary first, then are
 * scattered to out, so outputs aliasing inputs (in-place, overlapping copies) are safe. */
static int run_elementwise(task_t *t) {
    const acldoubleOpDesc *d = &t->d;
    int nin = d->ntensors - 1;
    const acldoubleTensorDesc *o = &d->t[nin];
    uint64_t nd = o->ndim, n = numel(o);
    if (n == 0) return 0;
    int osz = acldoubleNnDtypeSize(o->dtype);
    char *tmp = malloc(n * (size_t)osz);
    if (!tmp) return 1;
    int64_t st[2][ACLNN_DOUBLE_MAX_DIMS];
    int isz[2];
    for (int k = 0; k < nin; k++) {
        bcast_strides(&d->t[k], nd, st[k]);
        isz[k] = acldoubleNnDtypeSize(d->t[k].dtype);
    }
    int64_t idx[ACLNN_DOUBLE_MAX_DIMS] = {0};
    int64_t off[2] = {0, 0};
    for (uint64_t e = 0; e < n; e++) {
        const char *a = t->view[0] + off[0] * isz[0];
        char *dst = tmp + e * (size_t)osz;
        if (d->op == ACLDOUBLE_OP_CAST || d->op == ACLDOUBLE_OP_COPY) convert(dst, o->dtype, a, d->t[0].dtype);
        else if ((d->op >= ACLDOUBLE_OP_NEG && d->op <= ACLDOUBLE_OP_SILU) || d->op == ACLDOUBLE_OP_GELU)
            unary_elem(d, a, dst);
        else binary_elem(d, a, t->view[1] + off[1] * isz[1], dst);
        for (int64_t ax = (int64_t)nd - 1; ax >= 0; ax--) {
            idx[ax]++;
            for (int k = 0; k < nin; k++) off[k] += st[k][ax];
            if (idx[ax] < o->dims[ax]) break;
            for (int k = 0; k < nin; k++) off[k] -= st[k][ax] * idx[ax];
            idx[ax] = 0;
        }
    }
    /* scatter */
    memset(idx, 0, sizeof idx);
    int64_t oo = 0;
    for (uint64_t e = 0; e < n; e++) {
        memcpy(t->view[nin] + oo * osz, tmp + e * (size_t)osz, (size_t)osz);
        for (int64_t ax = (int64_t)nd - 1; ax >= 0; ax--) {
            idx[ax]++;
            oo += o->strides[ax];
            if (idx[ax] < o->dims[ax]) break;
            oo -= o->strides[ax] * idx[ax];
            idx[ax] = 0;
        }
    }
    free(tmp);
    return 0;
}

/* numpy matmul; the workspace holds the accumulators of one row chunk (so it is really needed) */
static int run_matmul(task_t *t) {
    const acldoubleOpDesc *d = &t->d;
    const acldoubleTensorDesc *A = &d->t[0], *B = &d->t[1], *O = &d->t[2];
    int dt = O->dtype, isz = acldoubleNnDtypeSize(dt);
    /* promote 1-D operands: A (k) -> (1,k); B (k) -> (k,1) */
    int64_t an = A->ndim == 1 ? 1 : A->dims[A->ndim - 2], ak = A->dims[A->ndim - 1];
    int64_t asn = A->ndim == 1 ? 0 : A->strides[A->ndim - 2], ask = A->strides[A->ndim - 1];
    int64_t bk = B->ndim == 1 ? B->dims[0] : B->dims[B->ndim - 2];
    int64_t bm = B->ndim == 1 ? 1 : B->dims[B->ndim - 1];
    int64_t bsk = B->ndim == 1 ? B->strides[0] : B->strides[B->ndim - 2];
    int64_t bsm = B->ndim == 1 ? 0 : B->strides[B->ndim - 1];
    (void)bk;
    uint64_t abat = A->ndim > 2 ? A->ndim - 2 : 0, bbat = B->ndim > 2 ? B->ndim - 2 : 0;
    uint64_t nb = abat > bbat ? abat : bbat;
    int64_t bdims[ACLNN_DOUBLE_MAX_DIMS], sa[ACLNN_DOUBLE_MAX_DIMS], sb[ACLNN_DOUBLE_MAX_DIMS],
        so[ACLNN_DOUBLE_MAX_DIMS];
    for (uint64_t i = 0; i < nb; i++) {
        int64_t da = 1, db = 1;
        sa[i] = sb[i] = 0;
        if (i + abat >= nb) {
            uint64_t ai = i + abat - nb;
            da = A->dims[ai];
            sa[i] = da == 1 ? 0 : A->strides[ai];
        }
        if (i + bbat >= nb) {
            uint64_t bi = i + bbat - nb;
            db = B->dims[bi];
            sb[i] = db == 1 ? 0 : B->strides[bi];
        }
        bdims[i] = da > db ? da : db;
        so[i] = O->strides[i];
    }
    /* out's row/col strides (dims removed for 1-D operands) */
    int64_t osn = 0, osm = 0;
    uint64_t od = nb;
    if (A->ndim > 1) osn = O->strides[od++];
    if (B->ndim > 1) osm = O->strides[od++];
    uint64_t batches = 1;
    for (uint64_t i = 0; i < nb; i++) batches *= (uint64_t)bdims[i];
    int64_t chunk = (int64_t)(d->workspace_size / 8);
    int64_t idx[ACLNN_DOUBLE_MAX_DIMS] = {0};
    int64_t oa = 0, ob = 0, oo = 0;
    for (uint64_t bt = 0; bt < batches; bt++) {
        const char *pa = t->view[0] + oa * isz;
        const char *pb = t->view[1] + ob * isz;
        char *po = t->view[2] + oo * isz;
        for (int64_t i = 0; i < an; i++) {
            for (int64_t j0 = 0; j0 < bm; j0 += chunk) {
                int64_t cn = bm - j0 < chunk ? bm - j0 : chunk;
                if (dt == ACL_DOUBLE) {
                    double *acc = (double *)t->ws;
                    for (int64_t j = 0; j < cn; j++) acc[j] = 0;
                    for (int64_t p = 0; p < ak; p++) {
                        double x = ld_f(pa + (i * asn + p * ask) * isz, dt);
                        for (int64_t j = 0; j < cn; j++) acc[j] += x * ld_f(pb + (p * bsk + (j0 + j) * bsm) * isz, dt);
                    }
                    for (int64_t j = 0; j < cn; j++) st_f(po + (i * osn + (j0 + j) * osm) * isz, dt, acc[j]);
                } else if (is_float(dt)) {
                    float *acc = (float *)t->ws;
                    for (int64_t j = 0; j < cn; j++) acc[j] = 0;
                    for (int64_t p = 0; p < ak; p++) {
                        float x = (float)ld_f(pa + (i * asn + p * ask) * isz, dt);
                        for (int64_t j = 0; j < cn; j++)
                            acc[j] += x * (float)ld_f(pb + (p * bsk + (j0 + j) * bsm) * isz, dt);
                    }
                    for (int64_t j = 0; j < cn; j++) st_f(po + (i * osn + (j0 + j) * osm) * isz, dt, acc[j]);
                } else {
                    uint64_t *acc = (uint64_t *)t->ws;
                    for (int64_t j = 0; j < cn; j++) acc[j] = 0;
                    for (int64_t p = 0; p < ak; p++) {
                        uint64_t x = (uint64_t)ld_i(pa + (i * asn + p * ask) * isz, dt);
                        for (int64_t j = 0; j < cn; j++)
                            acc[j] += x * (uint64_t)ld_i(pb + (p * bsk + (j0 + j) * bsm) * isz, dt);
                    }
                    for (int64_t j = 0; j < cn; j++) st_i(po + (i * osn + (j0 + j) * osm) * isz, dt, (int64_t)acc[j]);
                }
            }
        }
        for (int64_t ax = (int64_t)nb - 1; ax >= 0; ax--) {
            idx[ax]++;
            oa += sa[ax];
            ob += sb[ax];
            oo += so[ax];
            if (idx[ax] < bdims[ax]) break;
            oa -= sa[ax] * idx[ax];
            ob -= sb[ax] * idx[ax];
            oo -= so[ax] * idx[ax];
            idx[ax] = 0;
        }
    }
    return 0;
}

/* softmax / log_softmax of self along dim (d->alpha_i, normalized by phase 1), in double. */
static int run_softmax(task_t *t) {
    const acldoubleOpDesc *d = &t->d;
    const acldoubleTensorDesc *x = &d->t[0], *o = &d->t[1];
    int64_t dim = d->alpha_i, len = x->dims[dim];
    uint64_t n = numel(x);
    if (n == 0) return 0;
    int isz = acldoubleNnDtypeSize(x->dtype), osz = acldoubleNnDtypeSize(o->dtype);
    double *row = malloc((size_t)len * sizeof *row);
    if (!row) return 1;
    int64_t idx[ACLNN_DOUBLE_MAX_DIMS] = {0};
    for (uint64_t r = 0; r < n / (uint64_t)len; r++) {
        int64_t xo = 0, oo = 0;
        for (uint64_t ax = 0; ax < x->ndim; ax++) {
            xo += idx[ax] * x->strides[ax];
            oo += idx[ax] * o->strides[ax];
        }
        double m = -INFINITY, sum = 0;
        for (int64_t i = 0; i < len; i++) {
            row[i] = ld_f(t->view[0] + (xo + i * x->strides[dim]) * isz, x->dtype);
            if (row[i] > m || isnan(row[i])) m = row[i];
        }
        for (int64_t i = 0; i < len; i++) sum += exp(row[i] - m);
        for (int64_t i = 0; i < len; i++) {
            double v = d->op == ACLDOUBLE_OP_SOFTMAX ? exp(row[i] - m) / sum : row[i] - m - log(sum);
            st_f(t->view[1] + (oo + i * o->strides[dim]) * osz, o->dtype, v);
        }
        /* next row: every axis but dim, last fastest */
        for (int64_t ax = (int64_t)x->ndim - 1; ax >= 0; ax--) {
            if (ax == dim) continue;
            if (++idx[ax] < x->dims[ax]) break;
            idx[ax] = 0;
        }
    }
    free(row);
    return 0;
}

/* Reductions of self over the dims in d->dims_mask into out (dims kept with size 1 or dropped):
 * accumulated densely per output element (sums in double or wrapping int64), then stored. */
static int run_reduce(task_t *t) {
    const acldoubleOpDesc *d = &t->d;
    const acldoubleTensorDesc *x = &d->t[0], *o = &d->t[1];
    uint64_t nin = numel(x), nout = numel(o);
    if (nout == 0) return 0;
    int isz = acldoubleNnDtypeSize(x->dtype), osz = acldoubleNnDtypeSize(o->dtype);
    int fin = is_float(x->dtype), op = d->op;
    double *acc = calloc(nout, sizeof *acc);
    int64_t *iacc = calloc(nout, sizeof *iacc), *arg = calloc(nout, sizeof *arg);
    char *seen = calloc(nout, 1);
    if (!acc || !iacc || !arg || !seen) {
        free(acc), free(iacc), free(arg), free(seen);
        return 1;
    }
    /* dense output strides over the input's axes: 0 on reduced axes */
    int64_t ost[ACLNN_DOUBLE_MAX_DIMS], stride = 1;
    for (int64_t ax = (int64_t)x->ndim - 1; ax >= 0; ax--) {
        if (d->dims_mask >> ax & 1) {
            ost[ax] = 0;
        } else {
            ost[ax] = stride;
            stride *= x->dims[ax];
        }
    }
    int argdim = 0;
    while (op == ACLDOUBLE_OP_ARGMAX && !(d->dims_mask >> argdim & 1)) argdim++;
    int64_t idx[ACLNN_DOUBLE_MAX_DIMS] = {0}, xo = 0, oi = 0;
    for (uint64_t e = 0; e < nin; e++) {
        const char *p = t->view[0] + xo * isz;
        double v = fin ? ld_f(p, x->dtype) : (double)ld_i(p, x->dtype);
        int64_t iv = fin ? 0 : ld_i(p, x->dtype);
        switch (op) {
        case ACLDOUBLE_OP_SUM:
        case ACLDOUBLE_OP_MEAN:
            acc[oi] += v;
            iacc[oi] = (int64_t)((uint64_t)iacc[oi] + (uint64_t)iv);
            break;
        case ACLDOUBLE_OP_AMAX:
        case ACLDOUBLE_OP_AMIN: {
            int more = op == ACLDOUBLE_OP_AMAX;
            if (!seen[oi]) {
                acc[oi] = v;
                iacc[oi] = iv;
            } else if (fin) { /* NaN propagates */
                if (!isnan(acc[oi]) && (isnan(v) || (more ? v > acc[oi] : v < acc[oi]))) acc[oi] = v;
            } else if (more ? iv > iacc[oi] : iv < iacc[oi]) {
                iacc[oi] = iv;
            }
            seen[oi] = 1;
            break;
        }
        default: /* argmax: the first maximum, or the first NaN */
            if (!seen[oi] || (!isnan(acc[oi]) && (isnan(v) || (fin ? v > acc[oi] : iv > iacc[oi])))) {
                acc[oi] = v;
                iacc[oi] = iv;
                arg[oi] = idx[argdim];
            }
            seen[oi] = 1;
            break;
        }
        for (int64_t ax = (int64_t)x->ndim - 1; ax >= 0; ax--) {
            idx[ax]++;
            xo += x->strides[ax];
            oi += ost[ax];
            if (idx[ax] < x->dims[ax]) break;
            xo -= x->strides[ax] * idx[ax];
            oi -= ost[ax] * idx[ax];
            idx[ax] = 0;
        }
    }
    /* store, in out's own layout (dense order = out's row-major order) */
    double count = nout ? (double)nin / (double)nout : 0;
    int64_t oidx[ACLNN_DOUBLE_MAX_DIMS] = {0}, oo = 0;
    for (uint64_t k = 0; k < nout; k++) {
        char *q = t->view[1] + oo * osz;
        if (op == ACLDOUBLE_OP_ARGMAX) st_i(q, o->dtype, arg[k]);
        else if (op == ACLDOUBLE_OP_MEAN) st_f(q, o->dtype, (fin ? acc[k] : (double)iacc[k]) / count);
        else if (is_float(o->dtype)) st_f(q, o->dtype, fin ? acc[k] : (double)iacc[k]);
        else st_i(q, o->dtype, fin ? (int64_t)acc[k] : iacc[k]);
        for (int64_t ax = (int64_t)o->ndim - 1; ax >= 0; ax--) {
            oidx[ax]++;
            oo += o->strides[ax];
            if (oidx[ax] < o->dims[ax]) break;
            oo -= o->strides[ax] * oidx[ax];
            oidx[ax] = 0;
        }
    }
    free(acc), free(iacc), free(arg), free(seen);
    return 0;
}

/* The element offset of flat (row-major) index `e` in `t`'s view. */
static int64_t offset_of(const acldoubleTensorDesc *t, uint64_t e) {
    int64_t off = 0;
    for (int64_t ax = (int64_t)t->ndim - 1; ax >= 0; ax--) {
        off += (int64_t)(e % (uint64_t)t->dims[ax]) * t->strides[ax];
        e /= (uint64_t)t->dims[ax];
    }
    return off;
}

/* layer norm over the trailing alpha_i dims: (x - mean) / sqrt(var + eps) * weight + bias, in double */
static int run_layer_norm(task_t *t) {
    const acldoubleOpDesc *d = &t->d;
    const acldoubleTensorDesc *x = &d->t[0], *w = &d->t[1], *b = &d->t[2], *o = &d->t[3];
    uint64_t n = numel(x), inner = 1;
    for (int64_t k = 0; k < d->alpha_i; k++) inner *= (uint64_t)x->dims[x->ndim - 1 - (uint64_t)k];
    if (n == 0 || inner == 0) return 0;
    int xs = acldoubleNnDtypeSize(x->dtype), os = acldoubleNnDtypeSize(o->dtype);
    int ws = acldoubleNnDtypeSize(w->dtype), bs = acldoubleNnDtypeSize(b->dtype);
    int has_w = !(d->absent_mask >> 1 & 1), has_b = !(d->absent_mask >> 2 & 1);
    for (uint64_t r = 0; r < n / inner; r++) {
        double mean = 0, var = 0;
        for (uint64_t j = 0; j < inner; j++) mean += ld_f(t->view[0] + offset_of(x, r * inner + j) * xs, x->dtype);
        mean /= (double)inner;
        for (uint64_t j = 0; j < inner; j++) {
            double v = ld_f(t->view[0] + offset_of(x, r * inner + j) * xs, x->dtype) - mean;
            var += v * v;
        }
        double rstd = 1.0 / sqrt(var / (double)inner + d->alpha_f);
        for (uint64_t j = 0; j < inner; j++) {
            double v = (ld_f(t->view[0] + offset_of(x, r * inner + j) * xs, x->dtype) - mean) * rstd;
            if (has_w) v *= ld_f(t->view[1] + offset_of(w, j) * ws, w->dtype);
            if (has_b) v += ld_f(t->view[2] + offset_of(b, j) * bs, b->dtype);
            st_f(t->view[3] + offset_of(o, r * inner + j) * os, o->dtype, v);
        }
    }
    return 0;
}

/* rms norm over gamma's alpha_i trailing dims: y = x / sqrt(mean(x^2) + eps) * gamma, in double;
 * rstd (float32) per row */
static int run_rms_norm(task_t *t) {
    const acldoubleOpDesc *d = &t->d;
    const acldoubleTensorDesc *x = &d->t[0], *g = &d->t[1], *y = &d->t[2], *r = &d->t[3];
    uint64_t n = numel(x), inner = numel(g);
    if (n == 0 || inner == 0) return 0;
    int xs = acldoubleNnDtypeSize(x->dtype), gs = acldoubleNnDtypeSize(g->dtype);
    int ys = acldoubleNnDtypeSize(y->dtype), rs = acldoubleNnDtypeSize(r->dtype);
    for (uint64_t row = 0; row < n / inner; row++) {
        double square = 0;
        for (uint64_t j = 0; j < inner; j++) {
            double v = ld_f(t->view[0] + offset_of(x, row * inner + j) * xs, x->dtype);
            square += v * v;
        }
        double rstd = 1.0 / sqrt(square / (double)inner + d->alpha_f);
        st_f(t->view[3] + offset_of(r, row) * rs, r->dtype, rstd);
        for (uint64_t j = 0; j < inner; j++) {
            double v = ld_f(t->view[0] + offset_of(x, row * inner + j) * xs, x->dtype) * rstd;
            v *= ld_f(t->view[1] + offset_of(g, j) * gs, g->dtype);
            st_f(t->view[2] + offset_of(y, row * inner + j) * ys, y->dtype, v);
        }
    }
    return 0;
}

/* embedding bag (include_last_offset false, no per-sample weights, padding_idx -1): bag b sums,
 * averages or maxes (NaN propagating) the weight rows indices[offsets[b] .. offsets[b+1]); empty
 * bags are zeros. Like CANN's kernel, a bad index or offset is a device fault (the launch fails,
 * reported by the stream), found before any output is written. */
static int run_embedding_bag(task_t *t) {
    const acldoubleOpDesc *d = &t->d;
    const acldoubleTensorDesc *w = &d->t[0], *ix = &d->t[1], *of = &d->t[2], *o = &d->t[3];
    const acldoubleTensorDesc *o2b = &d->t[4], *bs = &d->t[5], *mi = &d->t[6];
    int64_t rows = w->dims[0], dim = w->dims[1], nidx = ix->dims[0], nbags = of->dims[0];
    int wsz = acldoubleNnDtypeSize(w->dtype), isz = acldoubleNnDtypeSize(ix->dtype);
    int fsz = acldoubleNnDtypeSize(of->dtype), osz = acldoubleNnDtypeSize(o->dtype);
    int o2bsz = acldoubleNnDtypeSize(o2b->dtype), bssz = acldoubleNnDtypeSize(bs->dtype);
    int misz = acldoubleNnDtypeSize(mi->dtype);
    for (int64_t b = 0; b < nbags; b++) {
        int64_t start = ld_i(t->view[2] + offset_of(of, (uint64_t)b) * fsz, of->dtype);
        int64_t end = b + 1 < nbags ? ld_i(t->view[2] + offset_of(of, (uint64_t)b + 1) * fsz, of->dtype) : nidx;
        if (start < 0 || start > end || end > nidx || (b == 0 && start != 0)) {
            fprintf(stderr, "acldouble aclnn: aclnnEmbeddingBag kernel: offsets[%lld] = %lld is out of order or range\n",
                    (long long)b, (long long)start);
            return 1;
        }
    }
    for (int64_t i = 0; i < nidx; i++) {
        int64_t r = ld_i(t->view[1] + offset_of(ix, (uint64_t)i) * isz, ix->dtype);
        if (r < 0 || r >= rows) {
            fprintf(stderr, "acldouble aclnn: aclnnEmbeddingBag kernel: indices[%lld] = %lld is out of range [0, %lld)\n",
                    (long long)i, (long long)r, (long long)rows);
            return 1;
        }
    }
    for (int64_t b = 0; b < nbags; b++) {
        int64_t start = ld_i(t->view[2] + offset_of(of, (uint64_t)b) * fsz, of->dtype);
        int64_t end = b + 1 < nbags ? ld_i(t->view[2] + offset_of(of, (uint64_t)b + 1) * fsz, of->dtype) : nidx;
        if (t->view[5]) st_i(t->view[5] + offset_of(bs, (uint64_t)b) * bssz, bs->dtype, end - start);
        for (int64_t i = start; t->view[4] && i < end; i++)
            st_i(t->view[4] + offset_of(o2b, (uint64_t)i) * o2bsz, o2b->dtype, b);
        for (int64_t j = 0; j < dim; j++) {
            double acc = d->alpha_i == 2 ? -INFINITY : 0;
            int64_t arg = -1;
            for (int64_t i = start; i < end; i++) {
                int64_t r = ld_i(t->view[1] + offset_of(ix, (uint64_t)i) * isz, ix->dtype);
                double v = ld_f(t->view[0] + offset_of(w, (uint64_t)(r * dim + j)) * wsz, w->dtype);
                if (d->alpha_i != 2) {
                    acc += v;
                } else if (!isnan(acc) && (v > acc || isnan(v))) {
                    acc = v;
                    arg = r;
                }
            }
            if (end == start) acc = 0;
            else if (d->alpha_i == 1) acc /= (double)(end - start);
            st_f(t->view[3] + offset_of(o, (uint64_t)(b * dim + j)) * osz, o->dtype, acc);
            if (d->alpha_i == 2 && t->view[6]) st_i(t->view[6] + offset_of(mi, (uint64_t)(b * dim + j)) * misz, mi->dtype, arg);
        }
    }
    return 0;
}

static int task_run(void *ctx) {
    task_t *t = ctx;
    const acldoubleOpDesc *d = &t->d;
    if (t->inject_fail) {
        fprintf(stderr, "acldouble aclnn: %s kernel failed (injected by ACLDOUBLE_FAIL)\n", d->name);
        return 1;
    }
    uint64_t bytes = 0;
    for (int k = 0; k < d->ntensors; k++) {
        const acldoubleTensorDesc *td = &d->t[k];
        if (d->absent_mask >> k & 1) {
            t->view[k] = NULL;
            continue;
        }
        int isz = acldoubleNnDtypeSize(td->dtype), empty;
        int64_t span = view_span(td, isz, &empty);
        if (empty) { t->view[k] = NULL; continue; }
        char *first = td->data + td->offset * isz;
        t->view[k] = acldouble_device_view(first, (size_t)span);
        if (!t->view[k]) {
            fprintf(stderr,
                    "acldouble aclnn: %s kernel: tensor %d of %d range [%p, +%lld bytes) is not inside a live "
                    "device allocation (use after free or out-of-bounds descriptor)\n",
                    d->name, k, d->ntensors, (void *)first, (long long)span);
            return 1;
        }
        bytes += numel(td) * (uint64_t)isz;
    }
    if (d->workspace_size) {
        t->ws = acldouble_device_view(t->ws, d->workspace_size);
        if (!t->ws) {
            fprintf(stderr, "acldouble aclnn: %s kernel: workspace is no longer a live device allocation\n", d->name);
            return 1;
        }
    }
    struct timespec began, ended;
    clock_gettime(CLOCK_MONOTONIC, &began);
    int rc = d->op == ACLDOUBLE_OP_MATMUL ? (numel(&d->t[2]) ? run_matmul(t) : 0)
             : d->op == ACLDOUBLE_OP_GELU       ? run_elementwise(t)
             : d->op == ACLDOUBLE_OP_LAYER_NORM ? run_layer_norm(t)
             : d->op == ACLDOUBLE_OP_RMS_NORM   ? run_rms_norm(t)
             : d->op == ACLDOUBLE_OP_EMBEDDING_BAG ? run_embedding_bag(t)
             : d->op >= ACLDOUBLE_OP_SUM     ? run_reduce(t)
             : d->op >= ACLDOUBLE_OP_SOFTMAX ? run_softmax(t)
                                              : run_elementwise(t);
    /* The timing model is the modelled device's speed: the kernel takes at least bytes / rate,
     * however long the host's own computation took. */
    pthread_once(&g_gbps_once, parse_gbps);
    if (g_gbps > 0) {
        clock_gettime(CLOCK_MONOTONIC, &ended);
        double spent = (double)(ended.tv_sec - began.tv_sec) + (double)(ended.tv_nsec - began.tv_nsec) / 1e9;
        double secs = (double)bytes / (g_gbps * 1e9) - spent;
        if (secs > 0) {
            struct timespec ts = {(time_t)secs, (long)((secs - (double)(time_t)secs) * 1e9)};
            while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
            }
        }
    }
    return rc;
}

aclnnStatus acldoubleNnRun(const char *func, void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                           aclrtStream stream) {
    if (!executor) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_NULLPTR, func, "executor is NULL");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    int inject = acldoubleNnInjectFail(func);
    pthread_mutex_lock(&g_lock);
    int st = exec_state(executor);
    if (st != 1) {
        pthread_mutex_unlock(&g_lock);
        if (st == 2) {
            acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, func,
                                "executor %p was already run by phase 2 and is not repeatable (double-only check; "
                                "CANN: undefined)",
                                (void *)executor);
            return ACLNN_ERR_PARAM_INVALID;
        }
        acldoubleNnSetError(ACLNN_ERR_PARAM_NULLPTR, func, "executor %p is not a live aclOpExecutor (double)",
                            (void *)executor);
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    const acldoubleOpDesc *d = &executor->desc;
    if (strcmp(d->name, func) != 0) {
        pthread_mutex_unlock(&g_lock);
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, func, "executor %p was made by %sGetWorkspaceSize (double)",
                            (void *)executor, d->name);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (d->workspace_size > 0 &&
        (!workspace || workspaceSize < d->workspace_size || !acldouble_is_device_range(workspace, d->workspace_size))) {
        uint64_t need = d->workspace_size;
        pthread_mutex_unlock(&g_lock);
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, func,
                            "workspace %p of %llu bytes: phase 1 asked for %llu bytes of device memory (double-only "
                            "check; the executor stays live, retry phase 2)",
                            workspace, (unsigned long long)workspaceSize, (unsigned long long)need);
        return ACLNN_ERR_PARAM_INVALID;
    }
    task_t *t = calloc(1, sizeof *t);
    if (!t) {
        pthread_mutex_unlock(&g_lock);
        return ACLNN_ERR_INNER;
    }
    t->d = *d;
    t->ws = workspace;
    t->inject_fail = inject;
    if (!executor->repeatable) retire(executor);
    else executor->executed = 1;
    pthread_mutex_unlock(&g_lock);
    int rc = acldouble_enqueue_kernel(stream, t->d.name, task_run, t, task_release);
    if (rc) { /* the runtime did not take the task: release is ours to call */
        task_release(t);
        acldoubleNnSetError(ACLNN_ERR_RUNTIME_ERROR, func,
                            "launch on stream %p failed with ACL error %d (the executor is consumed)", stream, rc);
        return ACLNN_ERR_RUNTIME_ERROR;
    }
    return ACLNN_SUCCESS;
}
