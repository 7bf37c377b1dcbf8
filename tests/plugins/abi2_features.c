/*
 * Every feature of plugin ABI 2 in one library, built and loaded by tests/test_plugins.py and
 * crates/opbridge-ops/tests/plugin.rs.
 *
 *   combine(a, b=None, *, mode="sum", offsets=[1, 2], scale=None), versions 1 and 2:
 *     r[i] = a[i] + b[i] (mode "sum") or max(a[i], b[i]) (mode "max"), a left-out b counting as 0;
 *     r[i] += offsets[i % len(offsets)] (nothing for an empty list); r[i] *= scale unless None.
 *     a and b are float64 or int32, 1-D; int32 inputs are converted to float64 before the kernel
 *     (the input_dtypes callback), whose output is float64. Version 2 is OPB_OP_IN_PLACE_OK.
 *   combine_stats() -> float64[2]: [calls of combine's callbacks so far, whether the last kernel
 *     call wrote its output over `a` (1) or not (0)].
 *
 * The callbacks also check what the host promises for ABI 2 (absent inputs, prefilled dtypes, a
 * kernel that sees float64 only) and fail with a message when it does not hold.
 */
#include <string.h>

#include <opbridge/plugin.h>

static long calls = 0;
static long last_in_place = -1;

static void bump(void) { __atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED); }

static int combine_infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err,
                         size_t len) {
  (void)n_out;
  bump();
  if (n_in != 2 || opb_meta_absent(&in[0]))
    return opb_fail(err, len, OPB_ERR_FAILED, "combine: a must always be there");
  if (in[0].ndim != 1) return opb_fail(err, len, OPB_ERR_SHAPE, "combine: a must be 1-D");
  if (!opb_meta_absent(&in[1]) && (in[1].ndim != 1 || in[1].shape[0] != in[0].shape[0]))
    return opb_fail(err, len, OPB_ERR_SHAPE, "combine: b must have the shape of a");
  const char *mode = opb_attr(attrs, "mode")->s;
  if (strcmp(mode, "sum") != 0 && strcmp(mode, "max") != 0)
    return opb_fail(err, len, OPB_ERR_INVALID_ARGUMENT, "combine: mode must be \"sum\" or \"max\"");
  out[0].dtype = (DLDataType)OPB_FLOAT64;
  out[0].ndim = 1;
  out[0].shape[0] = in[0].shape[0];
  return OPB_OK;
}

static int combine_input_dtypes(const OpbMeta *in, int n_in, DLDataType *dtypes, const OpbAttrs *attrs, char *err,
                                size_t len) {
  (void)attrs;
  bump();
  for (int i = 0; i < n_in; i++) {
    const DLDataType zero = {0, 0, 0};
    DLDataType own = opb_meta_absent(&in[i]) ? zero : in[i].dtype;
    if (!opb_dtype_eq(dtypes[i], own))
      return opb_fail(err, len, OPB_ERR_FAILED, "combine: dtypes did not arrive holding the inputs' own");
    if (!opb_meta_absent(&in[i]) && opb_dtype_is(in[i].dtype, kDLInt, 32)) dtypes[i] = (DLDataType)OPB_FLOAT64;
  }
  return OPB_OK;
}

static int combine_kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs,
                          void *stream, void *ws, size_t ws_size, char *err, size_t len) {
  (void)n_in, (void)n_out, (void)stream, (void)ws, (void)ws_size;
  bump();
  const DLTensor *a = &in[0], *b = opb_absent(&in[1]) ? NULL : &in[1];
  if (!b && (in[1].data || in[1].shape || in[1].strides))
    return opb_fail(err, len, OPB_ERR_FAILED, "combine: an absent input must have NULL data, shape and strides");
  if (!opb_dtype_is(a->dtype, kDLFloat, 64) || (b && !opb_dtype_is(b->dtype, kDLFloat, 64)))
    return opb_fail(err, len, OPB_ERR_DTYPE, "combine: the kernel got an input that is not float64");
  const OpbAttrValue *offsets = opb_attr(attrs, "offsets"), *scale = opb_attr(attrs, "scale");
  int max = strcmp(opb_attr(attrs, "mode")->s, "max") == 0;
  __atomic_store_n(&last_in_place, out[0].data == a->data, __ATOMIC_RELAXED);
  const double *pa = (const double *)a->data, *pb = b ? (const double *)b->data : NULL;
  double *po = (double *)out[0].data;
  for (int64_t i = 0; i < out[0].shape[0]; i++) {
    double x = pa[i * a->strides[0]], y = pb ? pb[i * b->strides[0]] : 0.0;
    double r = max ? (x > y ? x : y) : x + y;
    if (offsets->n_ints > 0) r += (double)offsets->ints[i % offsets->n_ints];
    if (!scale->is_none) r *= (double)scale->i;
    po[i] = r; /* in place: element i of `a` was read just before */
  }
  return OPB_OK;
}

static int stats_infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err,
                       size_t len) {
  (void)in, (void)n_in, (void)n_out, (void)attrs, (void)err, (void)len;
  out[0].dtype = (DLDataType)OPB_FLOAT64;
  out[0].ndim = 1;
  out[0].shape[0] = 2;
  return OPB_OK;
}

static int stats_kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs, void *stream,
                        void *ws, size_t ws_size, char *err, size_t len) {
  (void)in, (void)n_in, (void)n_out, (void)attrs, (void)stream, (void)ws, (void)ws_size, (void)err, (void)len;
  double *po = (double *)out[0].data;
  po[0] = (double)__atomic_load_n(&calls, __ATOMIC_RELAXED);
  po[1] = (double)__atomic_load_n(&last_in_place, __ATOMIC_RELAXED);
  return OPB_OK;
}

static const char *const inputs[] = {"a", "b"};
static const int32_t optional[] = {0, 1};
static const DLDataType dtypes[] = {OPB_FLOAT64, OPB_INT32};
static const DLDataType stats_dtypes[] = {OPB_FLOAT64};
static const int64_t default_offsets[] = {1, 2};
static const OpbAttrDesc attrs[] = {
    {.name = "mode", .kind = OPB_ATTR_STR, .default_str = "sum", .doc = "\"sum\" or \"max\" of a and b"},
    {.name = "offsets",
     .kind = OPB_ATTR_INTS,
     .default_ints = default_offsets,
     .n_default_ints = 2,
     .doc = "added in turn to the elements"},
    {.name = "scale", .kind = OPB_ATTR_INT, .flags = OPB_ATTR_DEFAULT_NONE, .doc = "factor of the result, or None"},
};

#define COMBINE(VERSION, FLAGS)                                                                                   \
  {                                                                                                               \
    .name = "combine", .version = VERSION, .doc = "a (+ or max) b, plus offsets, times scale", .n_inputs = 2,     \
    .input_names = inputs, .input_optional = optional, .n_outputs = 1, .n_attrs = 3, .attrs = attrs,              \
    .n_dtypes = 2, .dtypes = dtypes, .flags = FLAGS, .infer = combine_infer,                                      \
    .input_dtypes = combine_input_dtypes, .cpu_kernel = combine_kernel,                                           \
  }

static const OpbOpDesc ops[] = {
    COMBINE(1, 0),
    COMBINE(2, OPB_OP_IN_PLACE_OK),
    {.name = "combine_stats", .version = 1, .n_outputs = 1, .n_dtypes = 1, .dtypes = stats_dtypes,
     .infer = stats_infer, .cpu_kernel = stats_kernel},
};

OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->name = "abi2_features";
  info->n_ops = (int32_t)(sizeof(ops) / sizeof(ops[0]));
  info->ops = ops;
  return OPB_OK;
}
