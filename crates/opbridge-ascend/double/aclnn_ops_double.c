/* Operator front ends of the opbridge Ascend test double: phase 1 (validation, snapshot executor,
 * workspace size) and phase 2 (handed to libnnopbase's acldoubleNnRun). Compiled into
 * libopapi_math.so with -DACLDOUBLE_OPAPI_MATH and into libopapi_nn.so with -DACLDOUBLE_OPAPI_NN. */
#include <stdio.h>
#include <string.h>

#include "aclnn_decls.h"

#define MATMUL_WORKSPACE (64u * 1024u)

static const char *dtname(int dt) {
    switch (dt) {
    case ACL_FLOAT: return "FLOAT";
    case ACL_FLOAT16: return "FLOAT16";
    case ACL_DOUBLE: return "DOUBLE";
    case ACL_INT32: return "INT32";
    case ACL_INT64: return "INT64";
    case ACL_BF16: return "BF16";
    case ACL_BOOL: return "BOOL";
    default: return "unsupported";
    }
}

static void shape_str(const acldoubleTensorDesc *t, char *buf, size_t n) {
    size_t p = 0;
    p += (size_t)snprintf(buf + p, n - p, "[");
    for (uint64_t i = 0; i < t->ndim && p < n; i++)
        p += (size_t)snprintf(buf + p, n - p, i ? ",%lld" : "%lld", (long long)t->dims[i]);
    if (p < n) snprintf(buf + p, n - p, "]");
}

/* common entry checks: out-pointers, injection; returns 0 to go on */
static int enter(const char *f, uint64_t *ws, aclOpExecutor **ex) {
    if (!ws || !ex) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_NULLPTR, f, "workspaceSize or executor out-pointer is NULL");
        return ACLNN_ERR_PARAM_NULLPTR;
    }
    int inj = acldoubleNnInjectFail(f);
    if (inj) {
        acldoubleNnSetError(inj, f, "failure injected by ACLDOUBLE_FAIL");
        return inj;
    }
    return 0;
}

static int get(const char *f, const char *what, const aclTensor *t, acldoubleTensorDesc *d) {
    int rc = acldoubleNnTensorDesc(t, d);
    if (rc) acldoubleNnSetError(rc, f, "%s is %s", what, rc == ACLNN_ERR_PARAM_NULLPTR ? "NULL" : "not a live aclTensor");
    return rc;
}

static int finish(const char *f, acldoubleOpDesc *d, uint64_t *ws, aclOpExecutor **ex) {
    aclOpExecutor *e = acldoubleNnNewExecutor(d);
    if (!e) {
        acldoubleNnSetError(ACLNN_ERR_INNER, f, "out of host memory");
        return ACLNN_ERR_INNER;
    }
    *ws = d->workspace_size;
    *ex = e;
    return 0;
}

/* numpy broadcast of a and b must give exactly out's shape */
__attribute__((unused)) static int check_bcast(const char *f, const acldoubleTensorDesc *a, const acldoubleTensorDesc *b,
                       const acldoubleTensorDesc *o, const char *bname) {
    char sa[128], sb[128], so[128];
    uint64_t nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    int ok = o->ndim == nd;
    for (uint64_t i = 0; ok && i < nd; i++) {
        int64_t da = i + a->ndim >= nd ? a->dims[i + a->ndim - nd] : 1;
        int64_t db = i + b->ndim >= nd ? b->dims[i + b->ndim - nd] : 1;
        if (da != db && da != 1 && db != 1) {
            shape_str(a, sa, sizeof sa);
            shape_str(b, sb, sizeof sb);
            acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f, "self shape %s and %s shape %s are not broadcastable", sa,
                                bname, sb);
            return ACLNN_ERR_PARAM_INVALID;
        }
        int64_t r = da == 1 ? db : da;
        if (o->dims[i] != r) ok = 0;
    }
    if (!ok) {
        shape_str(a, sa, sizeof sa);
        shape_str(b, sb, sizeof sb);
        shape_str(o, so, sizeof so);
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f, "out shape %s is not the broadcast of %s and %s", so, sa, sb);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return 0;
}

__attribute__((unused)) static int unary_desc(const char *f, const char *name, int op, int floats_only,
                                              const aclTensor *self, aclTensor *out, acldoubleOpDesc *d) {
    int rc;
    memset(d, 0, sizeof *d);
    d->op = op;
    d->name = name;
    d->ntensors = 2;
    if ((rc = get(f, "self", self, &d->t[0])) || (rc = get(f, "out", out, &d->t[1]))) return rc;
    int dt = d->t[0].dtype;
    int fl = dt == ACL_FLOAT || dt == ACL_FLOAT16 || dt == ACL_DOUBLE || dt == ACL_BF16;
    int ok = fl || (!floats_only && (dt == ACL_INT32 || dt == ACL_INT64));
    if (!ok || d->t[1].dtype != dt) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f,
                            "self dtype %s (%d), out dtype %s (%d): must be equal, one of FLOAT, FLOAT16, DOUBLE, "
                            "BF16%s (double)",
                            dtname(dt), dt, dtname(d->t[1].dtype), d->t[1].dtype, floats_only ? "" : ", INT32, INT64");
        return ACLNN_ERR_PARAM_INVALID;
    }
    int same = d->t[0].ndim == d->t[1].ndim;
    for (uint64_t i = 0; same && i < d->t[0].ndim; i++) same = d->t[0].dims[i] == d->t[1].dims[i];
    if (!same) {
        char a[128], b[128];
        shape_str(&d->t[0], a, sizeof a);
        shape_str(&d->t[1], b, sizeof b);
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f, "out shape %s differs from self shape %s", b, a);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return 0;
}

/* A unary operator's phase 1: self and out of one shape (no broadcasting) and one dtype; the
 * transcendental ones take floating dtypes only (CANN casts integers itself; the double asks
 * the caller to, as opbridge does). */
__attribute__((unused)) static aclnnStatus unary(const char *f, const char *name, int op, int floats_only,
                                                 const aclTensor *self, aclTensor *out, uint64_t *ws,
                                                 aclOpExecutor **ex) {
    acldoubleOpDesc d;
    int rc = enter(f, ws, ex);
    if (rc || (rc = unary_desc(f, name, op, floats_only, self, out, &d))) return rc;
    return finish(f, &d, ws, ex);
}

#define UNARY(Name, OP, FLOATS_ONLY)                                                                              \
    aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, aclTensor *out, uint64_t *workspaceSize,      \
                                              aclOpExecutor **executor) {                                         \
        return unary("aclnn" #Name "GetWorkspaceSize", "aclnn" #Name, OP, FLOATS_ONLY, self, out, workspaceSize,   \
                     executor);                                                                                   \
    }                                                                                                             \
    aclnnStatus aclnn##Name(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) { \
        return acldoubleNnRun("aclnn" #Name, workspace, workspaceSize, executor, stream);                         \
    }

#ifdef ACLDOUBLE_OPAPI_MATH
UNARY(Neg, ACLDOUBLE_OP_NEG, 0)
UNARY(Abs, ACLDOUBLE_OP_ABS, 0)
UNARY(Exp, ACLDOUBLE_OP_EXP, 1)
UNARY(Log, ACLDOUBLE_OP_LOG, 1)
UNARY(Sqrt, ACLDOUBLE_OP_SQRT, 1)
UNARY(Tanh, ACLDOUBLE_OP_TANH, 1)

/* A reduction's phase 1: dims (each in [-ndim, ndim), no repeats; empty = all) and keepdim give
 * out's shape; `odt` is out's required dtype (-1: any integer, for argmax). */
static aclnnStatus reduce(const char *f, const char *name, int op, const aclTensor *self, const int64_t *dims,
                          uint64_t ndims, bool keepdim, int odt, aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
    int rc = enter(f, ws, ex);
    if (rc) return rc;
    acldoubleOpDesc d;
    memset(&d, 0, sizeof d);
    d.op = op;
    d.name = name;
    d.ntensors = 2;
    d.keepdim = keepdim;
    if ((rc = get(f, "self", self, &d.t[0])) || (rc = get(f, "out", out, &d.t[1]))) return rc;
    const acldoubleTensorDesc *x = &d.t[0], *o = &d.t[1];
    int64_t nd = (int64_t)x->ndim;
    int idt = x->dtype;
    int ok_in = idt == ACL_FLOAT || idt == ACL_FLOAT16 || idt == ACL_DOUBLE || idt == ACL_BF16 || idt == ACL_INT32 ||
                idt == ACL_INT64;
    int ok_out = odt >= 0 ? o->dtype == odt : (o->dtype == ACL_INT32 || o->dtype == ACL_INT64);
    if (!ok_in || !ok_out) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f, "self dtype %s (%d) / out dtype %s (%d) not supported here",
                            dtname(idt), idt, dtname(o->dtype), o->dtype);
        return ACLNN_ERR_PARAM_INVALID;
    }
    for (uint64_t i = 0; i < ndims; i++) {
        int64_t a = dims[i] < 0 ? dims[i] + nd : dims[i];
        if (a < 0 || a >= nd || (d.dims_mask >> a & 1)) {
            acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f, "dim %lld out of range or repeated for a %lld-d self",
                                (long long)dims[i], (long long)nd);
            return ACLNN_ERR_PARAM_INVALID;
        }
        d.dims_mask |= 1u << a;
    }
    if (ndims == 0) d.dims_mask = nd ? (uint32_t)((1ull << nd) - 1) : 0;
    int64_t want[ACLNN_DOUBLE_MAX_DIMS];
    uint64_t nw = 0;
    int empty_reduced = 0;
    for (int64_t a = 0; a < nd; a++) {
        if (d.dims_mask >> a & 1) {
            if (x->dims[a] == 0) empty_reduced = 1;
            if (keepdim) want[nw++] = 1;
        } else {
            want[nw++] = x->dims[a];
        }
    }
    int same = o->ndim == nw;
    for (uint64_t i = 0; same && i < nw; i++) same = o->dims[i] == want[i];
    if (!same) {
        char a[128], b[128];
        shape_str(x, a, sizeof a);
        shape_str(o, b, sizeof b);
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f, "out shape %s is not the reduction of self %s", b, a);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if (empty_reduced && op != ACLDOUBLE_OP_SUM && op != ACLDOUBLE_OP_MEAN) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f, "reducing an empty dim has no %s", name);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return finish(f, &d, ws, ex);
}

static int int_array(const char *f, const aclIntArray *a, const int64_t **v, uint64_t *n) {
    int rc = acldoubleNnIntArrayValues(a, v, n);
    if (rc) acldoubleNnSetError(rc, f, "dim is %s", rc == ACLNN_ERR_PARAM_NULLPTR ? "NULL" : "not a live aclIntArray");
    return rc;
}

aclnnStatus aclnnReduceSumGetWorkspaceSize(const aclTensor *self, const aclIntArray *dims, bool keepDims,
                                           aclDataType dtype, aclTensor *out, uint64_t *workspaceSize,
                                           aclOpExecutor **executor) {
    static const char *F = "aclnnReduceSumGetWorkspaceSize";
    const int64_t *v;
    uint64_t n;
    int rc = int_array(F, dims, &v, &n);
    return rc ? rc : reduce(F, "aclnnReduceSum", ACLDOUBLE_OP_SUM, self, v, n, keepDims, dtype, out, workspaceSize,
                            executor);
}
aclnnStatus aclnnReduceSum(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnReduceSum", workspace, workspaceSize, executor, stream);
}
aclnnStatus aclnnMeanGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim, aclDataType dtype,
                                      aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) {
    static const char *F = "aclnnMeanGetWorkspaceSize";
    const int64_t *v;
    uint64_t n;
    int rc = int_array(F, dim, &v, &n);
    if (rc) return rc;
    if (dtype != ACL_FLOAT && dtype != ACL_FLOAT16 && dtype != ACL_DOUBLE && dtype != ACL_BF16) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "dtype %s (%d): a mean is floating", dtname(dtype), dtype);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return reduce(F, "aclnnMean", ACLDOUBLE_OP_MEAN, self, v, n, keepDim, dtype, out, workspaceSize, executor);
}
aclnnStatus aclnnMean(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnMean", workspace, workspaceSize, executor, stream);
}
#define AMAXMIN(Name, OP)                                                                                         \
    aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim,         \
                                              aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) { \
        static const char *F = "aclnn" #Name "GetWorkspaceSize";                                                  \
        const int64_t *v;                                                                                         \
        uint64_t n;                                                                                               \
        acldoubleTensorDesc x;                                                                                    \
        int rc = int_array(F, dim, &v, &n);                                                                       \
        if (rc || (rc = get(F, "self", self, &x))) return rc;                                                     \
        return reduce(F, "aclnn" #Name, OP, self, v, n, keepDim, x.dtype, out, workspaceSize, executor);          \
    }                                                                                                             \
    aclnnStatus aclnn##Name(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) { \
        return acldoubleNnRun("aclnn" #Name, workspace, workspaceSize, executor, stream);                         \
    }
AMAXMIN(Amax, ACLDOUBLE_OP_AMAX)
AMAXMIN(Amin, ACLDOUBLE_OP_AMIN)

aclnnStatus aclnnArgMaxGetWorkspaceSize(const aclTensor *self, int64_t dim, bool keepdim, aclTensor *out,
                                        uint64_t *workspaceSize, aclOpExecutor **executor) {
    return reduce("aclnnArgMaxGetWorkspaceSize", "aclnnArgMax", ACLDOUBLE_OP_ARGMAX, self, &dim, 1, keepdim, -1, out,
                  workspaceSize, executor);
}
aclnnStatus aclnnArgMax(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnArgMax", workspace, workspaceSize, executor, stream);
}

static int arith_dtype(int dt) {
    return dt == ACL_FLOAT || dt == ACL_FLOAT16 || dt == ACL_DOUBLE || dt == ACL_BF16 || dt == ACL_INT32 ||
           dt == ACL_INT64;
}

static int is_float(int dt) { return dt == ACL_FLOAT || dt == ACL_FLOAT16 || dt == ACL_DOUBLE || dt == ACL_BF16; }

static aclnnStatus binary(const char *f, const char *name, int op, const aclTensor *self, const aclTensor *other,
                          const aclScalar *alpha, int need_alpha, aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
    int rc = enter(f, ws, ex);
    if (rc) return rc;
    acldoubleOpDesc d;
    memset(&d, 0, sizeof d);
    d.op = op;
    d.name = name;
    d.ntensors = 3;
    const char *oname = op == ACLDOUBLE_OP_POW ? "exponent" : "other";
    if ((rc = get(f, "self", self, &d.t[0])) || (rc = get(f, oname, other, &d.t[1])) ||
        (rc = get(f, "out", out, &d.t[2])))
        return rc;
    d.alpha_f = 1;
    d.alpha_i = 1;
    if (need_alpha) {
        rc = acldoubleNnScalarValue(alpha, &d.alpha_f, &d.alpha_i);
        if (rc) {
            acldoubleNnSetError(rc, f, "alpha is %s", rc == ACLNN_ERR_PARAM_NULLPTR ? "NULL" : "not a live aclScalar");
            return rc;
        }
    }
    int dt = d.t[0].dtype;
    if (!arith_dtype(dt) || d.t[1].dtype != dt) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f,
                            "self dtype %s (%d) / %s dtype %s (%d): the double supports FLOAT, FLOAT16, DOUBLE, BF16, "
                            "INT32, INT64 with equal dtypes (no type promotion)",
                            dtname(dt), dt, oname, dtname(d.t[1].dtype), d.t[1].dtype);
        return ACLNN_ERR_PARAM_INVALID;
    }
    int odt = d.t[2].dtype;
    if (op == ACLDOUBLE_OP_DIV && !is_float(dt)) {
        if (!is_float(odt)) {
            acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f,
                                "integer division gives a floating out (true division); out dtype %s (%d) refused",
                                dtname(odt), odt);
            return ACLNN_ERR_PARAM_INVALID;
        }
    } else if (odt != dt) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f, "out dtype %s (%d) differs from the inputs' %s (%d)",
                            dtname(odt), odt, dtname(dt), dt);
        return ACLNN_ERR_PARAM_INVALID;
    }
    if ((rc = check_bcast(f, &d.t[0], &d.t[1], &d.t[2], oname))) return rc;
    return finish(f, &d, ws, ex);
}

#define BINARY_ALPHA(Name, OP)                                                                                    \
    aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclTensor *other, const aclScalar *alpha, \
                                              aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor) { \
        return binary("aclnn" #Name "GetWorkspaceSize", "aclnn" #Name, OP, self, other, alpha, 1, out,           \
                      workspaceSize, executor);                                                                   \
    }                                                                                                             \
    aclnnStatus aclnn##Name(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) { \
        return acldoubleNnRun("aclnn" #Name, workspace, workspaceSize, executor, stream);                         \
    }
#define BINARY(Name, OP)                                                                                          \
    aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,       \
                                              uint64_t *workspaceSize, aclOpExecutor **executor) {                \
        return binary("aclnn" #Name "GetWorkspaceSize", "aclnn" #Name, OP, self, other, NULL, 0, out,            \
                      workspaceSize, executor);                                                                   \
    }                                                                                                             \
    aclnnStatus aclnn##Name(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) { \
        return acldoubleNnRun("aclnn" #Name, workspace, workspaceSize, executor, stream);                         \
    }

BINARY_ALPHA(Add, ACLDOUBLE_OP_ADD)
BINARY_ALPHA(Sub, ACLDOUBLE_OP_SUB)
BINARY(Mul, ACLDOUBLE_OP_MUL)
BINARY(Div, ACLDOUBLE_OP_DIV)
BINARY(Maximum, ACLDOUBLE_OP_MAX)
BINARY(Minimum, ACLDOUBLE_OP_MIN)
BINARY(PowTensorTensor, ACLDOUBLE_OP_POW)

static int cast_dtype(int dt) { return arith_dtype(dt) || dt == ACL_BOOL; }

aclnnStatus aclnnCastGetWorkspaceSize(const aclTensor *self, const aclDataType dtype, aclTensor *out,
                                      uint64_t *workspaceSize, aclOpExecutor **executor) {
    static const char *F = "aclnnCastGetWorkspaceSize";
    int rc = enter(F, workspaceSize, executor);
    if (rc) return rc;
    acldoubleOpDesc d;
    memset(&d, 0, sizeof d);
    d.op = ACLDOUBLE_OP_CAST;
    d.name = "aclnnCast";
    d.ntensors = 2;
    if ((rc = get(F, "self", self, &d.t[0])) || (rc = get(F, "out", out, &d.t[1]))) return rc;
    if (!cast_dtype(d.t[0].dtype) || !cast_dtype(dtype) || d.t[1].dtype != (int)dtype) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                            "self dtype %s (%d), dtype %s (%d), out dtype %s (%d): out must have the requested dtype; "
                            "the double casts among FLOAT, FLOAT16, DOUBLE, BF16, INT32, INT64, BOOL",
                            dtname(d.t[0].dtype), d.t[0].dtype, dtname(dtype), (int)dtype, dtname(d.t[1].dtype),
                            d.t[1].dtype);
        return ACLNN_ERR_PARAM_INVALID;
    }
    int same = d.t[0].ndim == d.t[1].ndim;
    for (uint64_t i = 0; same && i < d.t[0].ndim; i++) same = d.t[0].dims[i] == d.t[1].dims[i];
    if (!same) {
        char a[128], b[128];
        shape_str(&d.t[0], a, sizeof a);
        shape_str(&d.t[1], b, sizeof b);
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "out shape %s differs from self shape %s", b, a);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return finish(F, &d, workspaceSize, executor);
}

aclnnStatus aclnnCast(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnCast", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnInplaceCopyGetWorkspaceSize(aclTensor *selfRef, const aclTensor *src, uint64_t *workspaceSize,
                                             aclOpExecutor **executor) {
    static const char *F = "aclnnInplaceCopyGetWorkspaceSize";
    int rc = enter(F, workspaceSize, executor);
    if (rc) return rc;
    acldoubleOpDesc d;
    memset(&d, 0, sizeof d);
    d.op = ACLDOUBLE_OP_COPY;
    d.name = "aclnnInplaceCopy";
    d.ntensors = 2;
    if ((rc = get(F, "selfRef", selfRef, &d.t[1])) || (rc = get(F, "src", src, &d.t[0]))) return rc;
    if (!cast_dtype(d.t[0].dtype) || !cast_dtype(d.t[1].dtype)) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "selfRef dtype %s (%d) / src dtype %s (%d) not supported",
                            dtname(d.t[1].dtype), d.t[1].dtype, dtname(d.t[0].dtype), d.t[0].dtype);
        return ACLNN_ERR_PARAM_INVALID;
    }
    /* src must broadcast to selfRef's shape */
    if ((rc = check_bcast(F, &d.t[1], &d.t[0], &d.t[1], "src"))) return rc;
    return finish(F, &d, workspaceSize, executor);
}

aclnnStatus aclnnInplaceCopy(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnInplaceCopy", workspace, workspaceSize, executor, stream);
}
#endif /* ACLDOUBLE_OPAPI_MATH */

#ifdef ACLDOUBLE_OPAPI_NN
/* softmax-like phase 1: floating self and out of one shape and dtype, dim in [-ndim, ndim) */
static aclnnStatus along_dim(const char *f, const char *name, int op, const aclTensor *self, int64_t dim,
                             aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
    acldoubleOpDesc d;
    int rc = enter(f, ws, ex);
    if (rc || (rc = unary_desc(f, name, op, 1, self, out, &d))) return rc;
    int64_t nd = (int64_t)d.t[0].ndim;
    if (nd == 0 || dim < -nd || dim >= nd) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, f, "dim %lld out of range for a %lld-d self", (long long)dim,
                            (long long)nd);
        return ACLNN_ERR_PARAM_INVALID;
    }
    d.alpha_i = dim < 0 ? dim + nd : dim;
    return finish(f, &d, ws, ex);
}

aclnnStatus aclnnSoftmaxGetWorkspaceSize(const aclTensor *self, int64_t dim, aclTensor *out, uint64_t *workspaceSize,
                                         aclOpExecutor **executor) {
    return along_dim("aclnnSoftmaxGetWorkspaceSize", "aclnnSoftmax", ACLDOUBLE_OP_SOFTMAX, self, dim, out,
                     workspaceSize, executor);
}
aclnnStatus aclnnSoftmax(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnSoftmax", workspace, workspaceSize, executor, stream);
}
aclnnStatus aclnnLogSoftmaxGetWorkspaceSize(const aclTensor *self, int64_t dim, aclTensor *out,
                                            uint64_t *workspaceSize, aclOpExecutor **executor) {
    return along_dim("aclnnLogSoftmaxGetWorkspaceSize", "aclnnLogSoftmax", ACLDOUBLE_OP_LOG_SOFTMAX, self, dim, out,
                     workspaceSize, executor);
}
aclnnStatus aclnnLogSoftmax(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnLogSoftmax", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnGeluV2GetWorkspaceSize(const aclTensor *x, int64_t approximate, aclTensor *y, uint64_t *workspaceSize,
                                        aclOpExecutor **executor) {
    static const char *F = "aclnnGeluV2GetWorkspaceSize";
    acldoubleOpDesc d;
    int rc = enter(F, workspaceSize, executor);
    if (rc || (rc = unary_desc(F, "aclnnGeluV2", ACLDOUBLE_OP_GELU, 1, x, y, &d))) return rc;
    if (d.t[0].dtype == ACL_DOUBLE || (approximate != 0 && approximate != 1)) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                            "x dtype %s, approximate %lld: FLOAT, FLOAT16 or BF16, and 0 (none) or 1 (tanh)",
                            dtname(d.t[0].dtype), (long long)approximate);
        return ACLNN_ERR_PARAM_INVALID;
    }
    d.alpha_i = approximate;
    return finish(F, &d, workspaceSize, executor);
}
aclnnStatus aclnnGeluV2(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnGeluV2", workspace, workspaceSize, executor, stream);
}

UNARY(Relu, ACLDOUBLE_OP_RELU, 0)
UNARY(Sigmoid, ACLDOUBLE_OP_SIGMOID, 1)
UNARY(Silu, ACLDOUBLE_OP_SILU, 1)

aclnnStatus aclnnLayerNormGetWorkspaceSize(const aclTensor *input, const aclIntArray *normalizedShape,
                                           const aclTensor *weightOptional, const aclTensor *biasOptional, double eps,
                                           aclTensor *out, aclTensor *meanOutOptional, aclTensor *rstdOutOptional,
                                           uint64_t *workspaceSize, aclOpExecutor **executor) {
    static const char *F = "aclnnLayerNormGetWorkspaceSize";
    int rc = enter(F, workspaceSize, executor);
    if (rc) return rc;
    if (meanOutOptional || rstdOutOptional) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "meanOut / rstdOut are not supported by the double");
        return ACLNN_ERR_PARAM_INVALID;
    }
    acldoubleOpDesc d;
    memset(&d, 0, sizeof d);
    d.op = ACLDOUBLE_OP_LAYER_NORM;
    d.name = "aclnnLayerNorm";
    d.ntensors = 4;
    d.alpha_f = eps;
    if ((rc = get(F, "input", input, &d.t[0])) || (rc = get(F, "out", out, &d.t[3]))) return rc;
    if (!weightOptional) d.absent_mask |= 1u << 1;
    else if ((rc = get(F, "weightOptional", weightOptional, &d.t[1]))) return rc;
    if (!biasOptional) d.absent_mask |= 1u << 2;
    else if ((rc = get(F, "biasOptional", biasOptional, &d.t[2]))) return rc;
    const int64_t *shape;
    uint64_t k;
    if ((rc = acldoubleNnIntArrayValues(normalizedShape, &shape, &k))) {
        acldoubleNnSetError(rc, F, "normalizedShape is not a live aclIntArray");
        return rc;
    }
    const acldoubleTensorDesc *x = &d.t[0];
    int dt = x->dtype;
    int ok = (dt == ACL_FLOAT || dt == ACL_FLOAT16 || dt == ACL_DOUBLE || dt == ACL_BF16) && d.t[3].dtype == dt;
    ok = ok && k >= 1 && k <= x->ndim && d.t[3].ndim == x->ndim;
    for (uint64_t i = 0; ok && i < x->ndim; i++) ok = d.t[3].dims[i] == x->dims[i];
    for (uint64_t i = 0; ok && i < k; i++) ok = shape[i] == x->dims[x->ndim - k + i];
    for (int p = 1; ok && p <= 2; p++) {
        if (d.absent_mask >> p & 1) continue;
        const acldoubleTensorDesc *q = &d.t[p];
        ok = q->dtype == dt && q->ndim == k;
        for (uint64_t i = 0; ok && i < k; i++) ok = q->dims[i] == shape[i];
    }
    if (!ok) {
        char a[128], b[128];
        shape_str(x, a, sizeof a);
        shape_str(&d.t[3], b, sizeof b);
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                            "input %s (%s), out %s (%s), weight / bias and normalizedShape (%llu dims) do not agree "
                            "(floating, one dtype, the trailing dims)",
                            a, dtname(dt), b, dtname(d.t[3].dtype), (unsigned long long)k);
        return ACLNN_ERR_PARAM_INVALID;
    }
    d.alpha_i = (int64_t)k;
    return finish(F, &d, workspaceSize, executor);
}

aclnnStatus aclnnLayerNorm(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnLayerNorm", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnMatmulGetWorkspaceSize(const aclTensor *self, const aclTensor *mat2, aclTensor *out,
                                        int8_t cubeMathType, uint64_t *workspaceSize, aclOpExecutor **executor) {
    static const char *F = "aclnnMatmulGetWorkspaceSize";
    int rc = enter(F, workspaceSize, executor);
    if (rc) return rc;
    acldoubleOpDesc d;
    memset(&d, 0, sizeof d);
    d.op = ACLDOUBLE_OP_MATMUL;
    d.name = "aclnnMatmul";
    d.ntensors = 3;
    d.workspace_size = MATMUL_WORKSPACE;
    if ((rc = get(F, "self", self, &d.t[0])) || (rc = get(F, "mat2", mat2, &d.t[1])) ||
        (rc = get(F, "out", out, &d.t[2])))
        return rc;
    if (cubeMathType < -1 || cubeMathType > 3) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "cubeMathType %d not in -1..3", (int)cubeMathType);
        return ACLNN_ERR_PARAM_INVALID;
    }
    int dt = d.t[0].dtype;
    int okdt = dt == ACL_FLOAT || dt == ACL_FLOAT16 || dt == ACL_DOUBLE || dt == ACL_BF16 || dt == ACL_INT32 ||
               dt == ACL_INT64;
    if (!okdt || d.t[1].dtype != dt || d.t[2].dtype != dt) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                            "dtypes self %s (%d), mat2 %s (%d), out %s (%d): must be equal, one of FLOAT, FLOAT16, "
                            "DOUBLE, BF16, INT32, INT64 (double)",
                            dtname(dt), dt, dtname(d.t[1].dtype), d.t[1].dtype, dtname(d.t[2].dtype), d.t[2].dtype);
        return ACLNN_ERR_PARAM_INVALID;
    }
    const acldoubleTensorDesc *A = &d.t[0], *B = &d.t[1], *O = &d.t[2];
    char sa[128], sb[128], so[128];
    shape_str(A, sa, sizeof sa);
    shape_str(B, sb, sizeof sb);
    shape_str(O, so, sizeof so);
    if (A->ndim == 0 || B->ndim == 0) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "0-d operands (self %s, mat2 %s)", sa, sb);
        return ACLNN_ERR_PARAM_INVALID;
    }
    int64_t ak = A->dims[A->ndim - 1], bk = B->ndim == 1 ? B->dims[0] : B->dims[B->ndim - 2];
    if (ak != bk) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "contracted dims differ: self %s, mat2 %s", sa, sb);
        return ACLNN_ERR_PARAM_INVALID;
    }
    int64_t exp[ACLNN_DOUBLE_MAX_DIMS + 2];
    uint64_t abat = A->ndim > 2 ? A->ndim - 2 : 0, bbat = B->ndim > 2 ? B->ndim - 2 : 0;
    uint64_t nb = abat > bbat ? abat : bbat, ne = 0;
    for (uint64_t i = 0; i < nb; i++) {
        int64_t da = i + abat >= nb ? A->dims[i + abat - nb] : 1;
        int64_t db = i + bbat >= nb ? B->dims[i + bbat - nb] : 1;
        if (da != db && da != 1 && db != 1) {
            acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "batch dims of self %s and mat2 %s do not broadcast", sa,
                                sb);
            return ACLNN_ERR_PARAM_INVALID;
        }
        exp[ne++] = da == 1 ? db : da;
    }
    if (A->ndim > 1) exp[ne++] = A->dims[A->ndim - 2];
    if (B->ndim > 1) exp[ne++] = B->dims[B->ndim - 1];
    int ok = O->ndim == ne;
    for (uint64_t i = 0; ok && i < ne; i++) ok = O->dims[i] == exp[i];
    if (!ok) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F, "out shape %s is not matmul(self %s, mat2 %s)'s shape", so,
                            sa, sb);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return finish(F, &d, workspaceSize, executor);
}

aclnnStatus aclnnMatmul(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnMatmul", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnRmsNormGetWorkspaceSize(const aclTensor *x, const aclTensor *gamma, double epsilon,
                                         const aclTensor *yOut, const aclTensor *rstdOut, uint64_t *workspaceSize,
                                         aclOpExecutor **executor) {
    static const char *F = "aclnnRmsNormGetWorkspaceSize";
    int rc = enter(F, workspaceSize, executor);
    if (rc) return rc;
    acldoubleOpDesc d;
    memset(&d, 0, sizeof d);
    d.op = ACLDOUBLE_OP_RMS_NORM;
    d.name = "aclnnRmsNorm";
    d.ntensors = 4;
    d.alpha_f = epsilon;
    if ((rc = get(F, "x", x, &d.t[0])) || (rc = get(F, "gamma", gamma, &d.t[1])) || (rc = get(F, "yOut", yOut, &d.t[2])) ||
        (rc = get(F, "rstdOut", rstdOut, &d.t[3])))
        return rc;
    const acldoubleTensorDesc *xd = &d.t[0], *g = &d.t[1], *y = &d.t[2], *r = &d.t[3];
    int dt = xd->dtype;
    uint64_t k = g->ndim;
    /* Floating x, gamma and y of one dtype; gamma the trailing dims of x; y x's shape; rstd
     * float32 with x's leading dims and 1 for each normalized one. */
    int ok = (dt == ACL_FLOAT || dt == ACL_FLOAT16 || dt == ACL_BF16) && g->dtype == dt && y->dtype == dt;
    ok = ok && r->dtype == ACL_FLOAT && k >= 1 && k <= xd->ndim && y->ndim == xd->ndim && r->ndim == xd->ndim;
    for (uint64_t i = 0; ok && i < xd->ndim; i++) {
        ok = y->dims[i] == xd->dims[i];
        ok = ok && r->dims[i] == (i < xd->ndim - k ? xd->dims[i] : 1);
    }
    for (uint64_t i = 0; ok && i < k; i++) ok = g->dims[i] == xd->dims[xd->ndim - k + i];
    if (!ok) {
        char a[128], b[128];
        shape_str(xd, a, sizeof a);
        shape_str(g, b, sizeof b);
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                            "x %s (%s), gamma %s (%s), yOut and rstdOut do not agree (float16/bfloat16/float32 of one "
                            "dtype, gamma the trailing dims of x, rstdOut float32 with those dims 1)",
                            a, dtname(dt), b, dtname(g->dtype));
        return ACLNN_ERR_PARAM_INVALID;
    }
    d.alpha_i = (int64_t)k;
    return finish(F, &d, workspaceSize, executor);
}

aclnnStatus aclnnEmbeddingBagGetWorkspaceSize(const aclTensor *weight, const aclTensor *indices,
                                              const aclTensor *offsets, bool scaleGradByFreq, int64_t mode,
                                              bool sparse, const aclTensor *perSampleWeights, bool includeLastOffset,
                                              int64_t paddingIdx, aclTensor *output, aclTensor *offset2bag,
                                              aclTensor *bagSize, aclTensor *maxIndices, uint64_t *workspaceSize,
                                              aclOpExecutor **executor) {
    static const char *F = "aclnnEmbeddingBagGetWorkspaceSize";
    int rc = enter(F, workspaceSize, executor);
    if (rc) return rc;
    if (scaleGradByFreq || sparse || perSampleWeights || includeLastOffset || paddingIdx != -1 || mode < 0 ||
        mode > 2) {
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                            "the double supports mode 0..2 without scaleGradByFreq, sparse, perSampleWeights, "
                            "includeLastOffset or a paddingIdx (got mode %lld, paddingIdx %lld)",
                            (long long)mode, (long long)paddingIdx);
        return ACLNN_ERR_PARAM_INVALID;
    }
    acldoubleOpDesc d;
    memset(&d, 0, sizeof d);
    d.op = ACLDOUBLE_OP_EMBEDDING_BAG;
    d.name = "aclnnEmbeddingBag";
    d.ntensors = 7;
    d.alpha_i = mode;
    const aclTensor *all[7] = {weight, indices, offsets, output, offset2bag, bagSize, maxIndices};
    static const char *names[7] = {"weight", "indices", "offsets", "output", "offset2bag", "bagSize", "maxIndices"};
    for (int k = 0; k < 7; k++)
        if ((rc = get(F, names[k], all[k], &d.t[k]))) return rc;
    const acldoubleTensorDesc *w = &d.t[0], *ix = &d.t[1], *of = &d.t[2], *o = &d.t[3];
    int wdt = w->dtype, idt = ix->dtype;
    /* CANN's kernel: FLOAT, FLOAT16, BF16 weights (no DOUBLE) */
    int ok = (wdt == ACL_FLOAT || wdt == ACL_FLOAT16 || wdt == ACL_BF16) && o->dtype == wdt;
    ok = ok && (idt == ACL_INT32 || idt == ACL_INT64) && (of->dtype == ACL_INT32 || of->dtype == ACL_INT64);
    ok = ok && w->ndim == 2 && ix->ndim == 1 && of->ndim == 1 && o->ndim == 2;
    ok = ok && o->dims[0] == of->dims[0] && o->dims[1] == w->dims[1];
    ok = ok && d.t[4].ndim == 1 && d.t[4].dims[0] == ix->dims[0] && d.t[5].ndim == 1 && d.t[5].dims[0] == of->dims[0];
    ok = ok && (mode == 2 ? d.t[6].ndim == 2 && d.t[6].dims[0] == of->dims[0] && d.t[6].dims[1] == w->dims[1]
                          : d.t[6].ndim == 1 && d.t[6].dims[0] == of->dims[0]);
    for (int k = 4; ok && k < 7; k++) ok = d.t[k].dtype == ACL_INT32 || d.t[k].dtype == ACL_INT64;
    if (!ok) {
        char a[128], b[128], c[128];
        shape_str(w, a, sizeof a);
        shape_str(ix, b, sizeof b);
        shape_str(of, c, sizeof c);
        acldoubleNnSetError(ACLNN_ERR_PARAM_INVALID, F,
                            "weight %s (%s), indices %s (%s), offsets %s and the outputs do not agree (2-D floating "
                            "weight, 1-D int32/int64 indices and offsets, output (bags, dim) of weight's dtype, "
                            "offset2bag (indices), bagSize (bags), maxIndices (bags) or (bags, dim) for max)",
                            a, dtname(wdt), b, dtname(idt), c);
        return ACLNN_ERR_PARAM_INVALID;
    }
    return finish(F, &d, workspaceSize, executor);
}

aclnnStatus aclnnEmbeddingBag(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnEmbeddingBag", workspace, workspaceSize, executor, stream);
}

aclnnStatus aclnnRmsNorm(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) {
    return acldoubleNnRun("aclnnRmsNorm", workspace, workspaceSize, executor, stream);
}
#endif /* ACLDOUBLE_OPAPI_NN */
