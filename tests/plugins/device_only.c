/* A device-only operator (plugin ABI 3) for the tests: `ascend_probe` has an Ascend kernel and
 * no CPU kernel. Its kernel touches no device memory: it checks what opbridge hands a device
 * kernel (DLTensors on the device, the native stream, a device workspace of the size asked
 * for) and answers with a status the test can read: OPB_OK when everything is as the header
 * promises, or OPB_ERR_SHAPE with what it saw when `report` is set. */
#include <stdio.h>

#include <opbridge/plugin.h>

static int infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err,
                 size_t err_len) {
  (void)n_in, (void)n_out, (void)attrs, (void)err, (void)err_len;
  out[0] = in[0];
  return OPB_OK;
}

static size_t workspace(const OpbMeta *in, int n_in, const OpbAttrs *attrs) {
  (void)n_in, (void)attrs;
  return in[0].ndim ? (size_t)in[0].shape[0] * 100 : 0;
}

static int ascend(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs, void *stream,
                  void *ws, size_t ws_size, char *err, size_t err_len) {
  const DLTensor *x = &in[0];
  int same_device = x->device.device_type == out->device.device_type && x->device.device_id == out->device.device_id;
  if (!same_device || x->device.device_type != OPB_DEVICE_ASCEND || !stream || !x->data || !out->data ||
      (ws_size && !ws) || n_in != 1 || n_out != 1)
    return opb_fail(err, err_len, OPB_ERR_FAILED, "ascend_probe: the call broke the header's promises");
  if (opb_attr(attrs, "report")->i) {
    snprintf(err, err_len, "device %d:%d stream set, ndim %d, shape[0] %lld, workspace %zu", x->device.device_type,
             x->device.device_id, x->ndim, x->ndim ? (long long)x->shape[0] : -1LL, ws_size);
    return OPB_ERR_SHAPE;
  }
  return OPB_OK;
}

static const char *const inputs[] = {"x"};
static const DLDataType dtypes[] = {OPB_FLOAT32};
static const OpbAttrDesc attrs[] = {{.name = "report", .kind = OPB_ATTR_BOOL}};
static const OpbDeviceKernel kernels[] = {{.device_type = OPB_DEVICE_ASCEND, .kernel = ascend}};
static const OpbOpDesc ops[] = {{
    .name = "ascend_probe",
    .version = 1,
    .n_inputs = 1,
    .input_names = inputs,
    .n_outputs = 1,
    .n_attrs = 1,
    .attrs = attrs,
    .n_dtypes = 1,
    .dtypes = dtypes,
    .infer = infer,
    .workspace_size = workspace,
    .n_device_kernels = 1,
    .device_kernels = kernels,
}};

OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->n_ops = 1;
  info->ops = ops;
  return OPB_OK;
}
