/*
 * A deliberately leaking operator library for the server's memory-growth test: `leaky` (version 1)
 * copies `x` to `out` and, on every call, mallocs 16 KiB that it touches and never frees. The test
 * that watches the server's RSS must flag it; the same check passes on well-behaved models.
 */
#include <stdlib.h>
#include <string.h>

#include <opbridge/plugin.h>

#define LEAK_BYTES (16 * 1024)

/* The last block lost, kept where the compiler must assume it is read: without it, an optimizer
 * may delete the malloc and memset as dead stores and nothing would leak. */
void *volatile leaky_last_block;

static int leaky_infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err,
                       size_t err_len) {
  (void)n_in, (void)n_out, (void)attrs, (void)err, (void)err_len;
  out[0] = in[0];
  return OPB_OK;
}

static int leaky_kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs, void *stream,
                        void *workspace, size_t workspace_size, char *err, size_t err_len) {
  (void)n_in, (void)n_out, (void)attrs, (void)stream, (void)workspace, (void)workspace_size;
  char *lost = malloc(LEAK_BYTES);
  if (lost == NULL) return opb_fail(err, err_len, OPB_ERR_FAILED, "leaky: out of memory");
  memset(lost, 0x5a, LEAK_BYTES); /* touched, so it counts in RSS */
  leaky_last_block = lost;
  int64_t n = 1;
  for (int d = 0; d < in[0].ndim; d++) n *= in[0].shape[d];
  /* The server hands contiguous tensors; float32 only (declared below). */
  memcpy((char *)out[0].data + out[0].byte_offset, (const char *)in[0].data + in[0].byte_offset,
         (size_t)n * sizeof(float));
  return OPB_OK;
}

static const char *const inputs[] = {"x"};
static const DLDataType dtypes[] = {OPB_FLOAT32};

static const OpbOpDesc ops[] = {
    {
        .name = "leaky",
        .version = 1,
        .doc = "out = x, leaking 16 KiB per call (a test fixture).",
        .n_inputs = 1,
        .input_names = inputs,
        .n_outputs = 1,
        .n_dtypes = 1,
        .dtypes = dtypes,
        .infer = leaky_infer,
        .cpu_kernel = leaky_kernel,
    },
};

OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->name = "leaky";
  info->n_ops = 1;
  info->ops = ops;
  return OPB_OK;
}
