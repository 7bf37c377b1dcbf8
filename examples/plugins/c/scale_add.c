/*
 * An opbridge operator library in C: `scale_add`, in two versions.
 *
 *   v1: out = a * alpha + b
 *   v2: out = a * alpha + b * beta
 *
 * float32 and float64; `a` and `b` have the same shape and dtype, with any strides.
 *
 * Build:
 *   cc -O3 -shared -fPIC -I "$(python -c 'import opbridge; print(opbridge.get_include())')" \
 *      scale_add.c -o libscale_add.so
 * With -DSCALE_ADD_VERSION=N the library exports version N only: what a model repository's
 * version folder holds (examples/repository/scale_add/N/, built by `make repository`).
 * Use:
 *   lib = opbridge.load_library("./libscale_add.so")
 *   opbridge.ops.scale_add(a, b, alpha=2.0, beta=0.5)          # latest version (2)
 *   opbridge.ops.get("scale_add", version=1)(a, b, alpha=2.0)
 */
#include <math.h>
#include <stdio.h>

#include <opbridge/plugin.h>

/* Shape function shared by both versions: a and b of one dtype and shape; out is the same. */
static int scale_add_infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs,
                           char *err, size_t err_len) {
  (void)n_in, (void)n_out, (void)attrs;
  if (!opb_dtype_eq(in[0].dtype, in[1].dtype))
    return opb_fail(err, err_len, OPB_ERR_DTYPE, "scale_add: a and b must have the same dtype");
  if (in[0].ndim != in[1].ndim)
    return opb_fail(err, err_len, OPB_ERR_SHAPE, "scale_add: a and b must have the same shape");
  for (int d = 0; d < in[0].ndim; d++) {
    if (in[0].shape[d] != in[1].shape[d]) {
      snprintf(err, err_len, "scale_add: a and b must have the same shape (dimension %d: %lld vs %lld)", d,
               (long long)in[0].shape[d], (long long)in[1].shape[d]);
      return OPB_ERR_SHAPE;
    }
  }
  out[0] = in[0];
  return OPB_OK;
}

/* Element offsets of the i-th element (C order) are walked with an index counter, so any strides
 * work; contiguous inputs take the fast path. */
#define DEFINE_KERNEL(NAME, T)                                                                     \
  static void NAME(const DLTensor *a, const DLTensor *b, DLTensor *out, double alpha, double beta) {  \
    const T *restrict pa = (const T *)((const char *)a->data + a->byte_offset);                     \
    const T *restrict pb = (const T *)((const char *)b->data + b->byte_offset);                     \
    T *restrict po = (T *)((char *)out->data + out->byte_offset); /* outputs never alias inputs */ \
    const T al = (T)alpha, be = (T)beta;                                                           \
    int64_t n = 1, contiguous = 1, expect = 1;                                                     \
    for (int d = out->ndim - 1; d >= 0; d--) {                                                     \
      int64_t extent = out->shape[d];                                                              \
      if (extent > 1 && (a->strides[d] != expect || b->strides[d] != expect)) contiguous = 0;      \
      expect *= extent;                                                                            \
      n *= extent;                                                                                 \
    }                                                                                              \
    if (contiguous) {                                                                              \
      for (int64_t i = 0; i < n; i++) po[i] = pa[i] * al + pb[i] * be;                             \
      return;                                                                                      \
    }                                                                                              \
    int64_t index[OPB_MAX_NDIM] = {0}, oa = 0, ob = 0;                                             \
    for (int64_t i = 0; i < n; i++) {                                                              \
      po[i] = pa[oa] * al + pb[ob] * be;                                                           \
      for (int d = out->ndim - 1; d >= 0; d--) {                                                   \
        oa += a->strides[d], ob += b->strides[d];                                                  \
        if (++index[d] < out->shape[d]) break;                                                     \
        oa -= a->strides[d] * out->shape[d], ob -= b->strides[d] * out->shape[d];                  \
        index[d] = 0;                                                                              \
      }                                                                                            \
    }                                                                                              \
  }

DEFINE_KERNEL(scale_add_f32, float)
DEFINE_KERNEL(scale_add_f64, double)

static int run(const DLTensor *in, DLTensor *out, double alpha, double beta, char *err, size_t err_len) {
  /* A kernel-side check, to show how kernels report errors: a status and a message. */
  if (!isfinite(alpha) || !isfinite(beta))
    return opb_fail(err, err_len, OPB_ERR_INVALID_ARGUMENT, "scale_add: alpha and beta must be finite");
  if (opb_dtype_is(out->dtype, kDLFloat, 32))
    scale_add_f32(&in[0], &in[1], out, alpha, beta);
  else if (opb_dtype_is(out->dtype, kDLFloat, 64))
    scale_add_f64(&in[0], &in[1], out, alpha, beta);
  else
    return opb_fail(err, err_len, OPB_ERR_DTYPE, "scale_add: float32 or float64 only");
  return OPB_OK;
}

static int scale_add_v1(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs,
                        void *stream, void *workspace, size_t workspace_size, char *err, size_t err_len) {
  (void)n_in, (void)n_out, (void)stream, (void)workspace, (void)workspace_size;
  return run(in, out, opb_attr(attrs, "alpha")->f, 1.0, err, err_len);
}

static int scale_add_v2(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs,
                        void *stream, void *workspace, size_t workspace_size, char *err, size_t err_len) {
  (void)n_in, (void)n_out, (void)stream, (void)workspace, (void)workspace_size;
  return run(in, out, opb_attr(attrs, "alpha")->f, opb_attr(attrs, "beta")->f, err, err_len);
}

static const char *const inputs[] = {"a", "b"};
static const DLDataType dtypes[] = {OPB_FLOAT32, OPB_FLOAT64};
/* Designated initializers: fields left out are zero (no flags, no other defaults), and the
 * descriptors stay correct when the ABI adds fields. */
static const OpbAttrDesc attrs_v1[] = {
    {.name = "alpha", .kind = OPB_ATTR_FLOAT, .default_float = 1.0, .doc = "factor of a"},
};
static const OpbAttrDesc attrs_v2[] = {
    {.name = "alpha", .kind = OPB_ATTR_FLOAT, .default_float = 1.0, .doc = "factor of a"},
    {.name = "beta", .kind = OPB_ATTR_FLOAT, .default_float = 1.0, .doc = "factor of b"},
};

static const OpbOpDesc ops[] = {
    {
        .name = "scale_add",
        .version = 1,
        .doc = "out = a * alpha + b (C example plugin).",
        .n_inputs = 2,
        .input_names = inputs,
        .n_outputs = 1,
        .n_attrs = 1,
        .attrs = attrs_v1,
        .n_dtypes = 2,
        .dtypes = dtypes,
        .infer = scale_add_infer,
        .cpu_kernel = scale_add_v1,
    },
    {
        .name = "scale_add",
        .version = 2,
        .doc = "out = a * alpha + b * beta (C example plugin).",
        .n_inputs = 2,
        .input_names = inputs,
        .n_outputs = 1,
        .n_attrs = 2,
        .attrs = attrs_v2,
        .n_dtypes = 2,
        .dtypes = dtypes,
        .infer = scale_add_infer,
        .cpu_kernel = scale_add_v2,
    },
};

OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->name = "scale_add_c";
#ifdef SCALE_ADD_VERSION
  _Static_assert(SCALE_ADD_VERSION >= 1 && SCALE_ADD_VERSION <= 2, "scale_add has versions 1 and 2");
  info->n_ops = 1;
  info->ops = &ops[SCALE_ADD_VERSION - 1];
#else
  info->n_ops = (int32_t)(sizeof(ops) / sizeof(ops[0]));
  info->ops = ops;
#endif
  return OPB_OK;
}
