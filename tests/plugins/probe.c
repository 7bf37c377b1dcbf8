/* A library for tests of the boundary between opbridge and a plugin: `probe` copies its float64
 * input; its workspace is `bytes` bytes (an attribute, so tests can ask for sizes no host can
 * allocate); it has an input-dtype rule, and every callback counts its calls (`probe_calls`). */
#include <string.h>

#include "opbridge/plugin.h"

static long calls;

static int probe_infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err,
                       size_t len) {
  (void)n_in, (void)n_out, (void)attrs, (void)err, (void)len;
  __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
  out[0] = in[0];
  return OPB_OK;
}

static int probe_input_dtypes(const OpbMeta *in, int n_in, DLDataType *dtypes, const OpbAttrs *attrs, char *err,
                              size_t len) {
  (void)in, (void)n_in, (void)dtypes, (void)attrs, (void)err, (void)len;
  __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
  return OPB_OK;
}

static size_t probe_workspace(const OpbMeta *in, int n_in, const OpbAttrs *attrs) {
  (void)in, (void)n_in;
  __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
  return (size_t)opb_attr(attrs, "bytes")->i;
}

static int probe_kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs, void *stream,
                        void *workspace, size_t workspace_size, char *err, size_t len) {
  (void)n_in, (void)n_out, (void)attrs, (void)stream, (void)workspace, (void)workspace_size, (void)err, (void)len;
  __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
  size_t n = 1;
  for (int d = 0; d < in[0].ndim; d++) n *= (size_t)in[0].shape[d];
  const double *x = (const double *)in[0].data;
  double *y = (double *)out[0].data;
  memcpy(y, x, n * sizeof(double)); /* tests pass contiguous inputs */
  return OPB_OK;
}

static int calls_infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err,
                       size_t len) {
  (void)in, (void)n_in, (void)n_out, (void)attrs, (void)err, (void)len;
  out[0] = (OpbMeta){.dtype = OPB_FLOAT64, .ndim = 0};
  return OPB_OK;
}

static int calls_kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs, void *stream,
                        void *workspace, size_t workspace_size, char *err, size_t len) {
  (void)in, (void)n_in, (void)n_out, (void)attrs, (void)stream, (void)workspace, (void)workspace_size, (void)err,
      (void)len;
  *(double *)out[0].data = (double)__atomic_load_n(&calls, __ATOMIC_RELAXED);
  return OPB_OK;
}

static const char *const inputs[] = {"x"};
static const DLDataType dtypes[] = {OPB_FLOAT64};
static const OpbAttrDesc attrs[] = {{.name = "bytes", .kind = OPB_ATTR_INT, .default_int = 0, .doc = "workspace"}};

static const OpbOpDesc ops[] = {
    {.name = "probe", .version = 1, .n_inputs = 1, .input_names = inputs, .n_outputs = 1, .n_attrs = 1,
     .attrs = attrs, .n_dtypes = 1, .dtypes = dtypes, .infer = probe_infer, .input_dtypes = probe_input_dtypes,
     .cpu_kernel = probe_kernel, .workspace_size = probe_workspace},
    {.name = "probe_calls", .version = 1, .n_outputs = 1, .n_dtypes = 1, .dtypes = dtypes, .infer = calls_infer,
     .cpu_kernel = calls_kernel},
};

OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->name = "probe";
  info->n_ops = 2;
  info->ops = ops;
  return OPB_OK;
}
