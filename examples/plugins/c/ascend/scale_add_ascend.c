/*
 * An opbridge operator library with an Ascend kernel (plugin ABI 3): `scale_add_ascend`,
 * out = a * alpha + b over float32, with a CPU kernel and an Ascend kernel.
 *
 * The Ascend kernel launches device code through the documented ACL runtime API: the kernel
 * binary is embedded in this library (KERNEL_BINARY at build time), loaded once per device
 * with aclrtBinaryLoadFromData, its entry found with aclrtBinaryGetFunction, and each call
 * enqueued on the stream opbridge passes with aclrtLaunchKernelWithHostArgs. The library's
 * release callback unloads the binaries when opbridge unloads the library.
 *
 * Build (LIB = the ACL libraries: $ASCEND_HOME_PATH/lib64 with CANN, or the test double's
 * `python -m opbridge.testing.ascend_double --lib-dir`):
 *   python -m opbridge.testing.ascend_double --compile-kernel scale_add_kernel.c -o scale_add_kernel.bin
 *   cc -O2 -shared -fPIC -I "$(python -c 'import opbridge; print(opbridge.get_include())')" \
 *      -DKERNEL_BINARY='"scale_add_kernel.bin"' scale_add_ascend.c -L "$LIB" -lascendcl \
 *      -Wl,-rpath,"$LIB" -o libscale_add_ascend.so
 * Use:
 *   lib = opbridge.load_library("./libscale_add_ascend.so")
 *   opbridge.ops.scale_add_ascend(a, b, alpha=2.0)                       # numpy: the CPU kernel
 *   x, y = opbridge.asarray(a, device="ascend:0"), opbridge.asarray(b, device="ascend:0")
 *   opbridge.ops.scale_add_ascend(x, y, alpha=2.0).numpy()               # the Ascend kernel
 *
 * The ACL prototypes are those of CANN's acl/acl_rt.h, declared here so the example builds
 * without CANN's headers (with them, include <acl/acl.h> instead).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include <opbridge/plugin.h>

#ifndef KERNEL_BINARY
#error "build with -DKERNEL_BINARY='\"path/to/scale_add_kernel.bin\"' (see the comment at the top)"
#endif

/* --- ACL runtime (acl/acl_rt.h) ----------------------------------------------------------- */
typedef int aclError;
typedef void *aclrtStream;
typedef void *aclrtBinHandle;
typedef void *aclrtFuncHandle;
extern aclError aclrtBinaryLoadFromData(const void *data, size_t length, const void *options, aclrtBinHandle *bin);
extern aclError aclrtBinaryGetFunction(const aclrtBinHandle bin, const char *kernelName, aclrtFuncHandle *func);
extern aclError aclrtBinaryUnLoad(aclrtBinHandle bin);
extern aclError aclrtLaunchKernelWithHostArgs(aclrtFuncHandle func, uint32_t numBlocks, aclrtStream stream,
                                              void *cfg, void *hostArgs, size_t argsSize, void *placeHolders,
                                              size_t numPlaceHolders);
extern const char *aclGetRecentErrMsg(void);

/* --- the kernel binary, embedded --------------------------------------------------------- */
__asm__(".section .rodata\n"
        ".balign 64\n"
        ".hidden scale_add_kernel_bin\n"
        "scale_add_kernel_bin:\n"
        ".incbin \"" KERNEL_BINARY "\"\n"
        ".hidden scale_add_kernel_bin_end\n"
        "scale_add_kernel_bin_end:\n"
        ".previous\n");
extern const char scale_add_kernel_bin[], scale_add_kernel_bin_end[];

/* The kernel's function on each device, loaded on first use (a binary is per device). */
#define MAX_DEVICES 64
static pthread_mutex_t loading = PTHREAD_MUTEX_INITIALIZER;
static aclrtBinHandle binaries[MAX_DEVICES];
static aclrtFuncHandle functions[MAX_DEVICES];

static int acl_fail(char *err, size_t err_len, const char *call, aclError code) {
  const char *why = aclGetRecentErrMsg();
  snprintf(err, err_len, "scale_add_ascend: %s failed with ACL error %d%s%s", call, code, why && *why ? ": " : "",
           why ? why : "");
  return OPB_ERR_FAILED;
}

/* The function on device `id` (current on this thread: opbridge made it so), or NULL with the
 * error written. */
static aclrtFuncHandle function_on(int32_t id, char *err, size_t err_len) {
  if (id < 0 || id >= MAX_DEVICES) {
    opb_fail(err, err_len, OPB_ERR_FAILED, "scale_add_ascend: device index out of range");
    return NULL;
  }
  pthread_mutex_lock(&loading);
  aclrtFuncHandle f = functions[id];
  if (!f) {
    size_t size = (size_t)(scale_add_kernel_bin_end - scale_add_kernel_bin);
    aclrtBinHandle bin = NULL; /* kept only once the function is found */
    aclError rc = aclrtBinaryLoadFromData(scale_add_kernel_bin, size, NULL, &bin);
    if (rc) {
      acl_fail(err, err_len, "aclrtBinaryLoadFromData", rc);
    } else if ((rc = aclrtBinaryGetFunction(bin, "scale_add_kernel", &f))) {
      acl_fail(err, err_len, "aclrtBinaryGetFunction", rc);
      aclrtBinaryUnLoad(bin);
      f = NULL;
    } else {
      binaries[id] = bin;
      functions[id] = f;
    }
  }
  pthread_mutex_unlock(&loading);
  return f;
}

/* Called by opbridge when it unloads the library, after the last call's device work. */
static void release(void) {
  for (int id = 0; id < MAX_DEVICES; id++) {
    if (binaries[id]) aclrtBinaryUnLoad(binaries[id]);
    binaries[id] = NULL;
    functions[id] = NULL;
  }
}

/* --- the operator ----------------------------------------------------------------------- */
static int infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err,
                 size_t err_len) {
  (void)n_in, (void)n_out, (void)attrs;
  if (in[0].ndim != in[1].ndim || memcmp(in[0].shape, in[1].shape, sizeof(int64_t) * (size_t)in[0].ndim))
    return opb_fail(err, err_len, OPB_ERR_SHAPE, "scale_add_ascend: a and b must have the same shape");
  out[0] = in[0];
  return OPB_OK;
}

static int64_t numel(const DLTensor *t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
  return n;
}

static int contiguous(const DLTensor *t) {
  int64_t expect = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    if (t->shape[d] > 1 && t->strides[d] != expect) return 0;
    expect *= t->shape[d];
  }
  return 1;
}

static int check_alpha(const OpbAttrs *attrs, float *alpha, char *err, size_t err_len) {
  double value = opb_attr(attrs, "alpha")->f;
  if (!isfinite(value)) return opb_fail(err, err_len, OPB_ERR_INVALID_ARGUMENT, "scale_add_ascend: alpha must be finite");
  *alpha = (float)value;
  return OPB_OK;
}

/* CPU kernel: any strides, walked with an index counter. */
static int cpu_kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs, void *stream,
                      void *workspace, size_t workspace_size, char *err, size_t err_len) {
  (void)n_in, (void)n_out, (void)stream, (void)workspace, (void)workspace_size;
  float alpha;
  int rc = check_alpha(attrs, &alpha, err, err_len);
  if (rc) return rc;
  const float *a = (const float *)((const char *)in[0].data + in[0].byte_offset);
  const float *b = (const float *)((const char *)in[1].data + in[1].byte_offset);
  float *o = (float *)((char *)out->data + out->byte_offset);
  int64_t n = numel(out), index[OPB_MAX_NDIM] = {0}, oa = 0, ob = 0;
  for (int64_t i = 0; i < n; i++) {
    o[i] = a[oa] * alpha + b[ob];
    for (int d = out->ndim - 1; d >= 0; d--) {
      oa += in[0].strides[d], ob += in[1].strides[d];
      if (++index[d] < out->shape[d]) break;
      oa -= in[0].strides[d] * out->shape[d], ob -= in[1].strides[d] * out->shape[d];
      index[d] = 0;
    }
  }
  return OPB_OK;
}

/* Ascend kernel: enqueues one launch on opbridge's stream and returns (no synchronize). */
static int ascend_kernel(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs,
                         void *stream, void *workspace, size_t workspace_size, char *err, size_t err_len) {
  (void)n_in, (void)n_out, (void)workspace, (void)workspace_size;
  float alpha;
  int rc = check_alpha(attrs, &alpha, err, err_len);
  if (rc) return rc;
  if (!contiguous(&in[0]) || !contiguous(&in[1]))
    return opb_fail(err, err_len, OPB_ERR_INVALID_ARGUMENT,
                    "scale_add_ascend: the Ascend kernel takes contiguous inputs (use opbridge.ops.contiguous)");
  int64_t n = numel(out);
  if (n == 0) return OPB_OK;
  aclrtFuncHandle f = function_on(out->device.device_id, err, err_len);
  if (!f) return OPB_ERR_FAILED;
  uint32_t bits;
  memcpy(&bits, &alpha, sizeof bits);
  /* The kernel's parameters in C struct layout, copied by ACL at launch. */
  struct {
    void *a, *b, *out;
    uint64_t n, alpha_bits;
  } args = {(char *)in[0].data + in[0].byte_offset, (char *)in[1].data + in[1].byte_offset,
            (char *)out->data + out->byte_offset, (uint64_t)n, bits};
  uint32_t blocks = n < 8 * 4096 ? 1 + (uint32_t)((n - 1) / 4096) : 8;
  aclError code = aclrtLaunchKernelWithHostArgs(f, blocks, stream, NULL, &args, sizeof args, NULL, 0);
  return code ? acl_fail(err, err_len, "aclrtLaunchKernelWithHostArgs", code) : OPB_OK;
}

static const char *const inputs[] = {"a", "b"};
static const DLDataType dtypes[] = {OPB_FLOAT32};
static const OpbAttrDesc attrs[] = {{.name = "alpha", .kind = OPB_ATTR_FLOAT, .default_float = 1.0, .doc = "factor of a"}};
static const OpbDeviceKernel device_kernels[] = {{.device_type = OPB_DEVICE_ASCEND, .kernel = ascend_kernel}};

static const OpbOpDesc ops[] = {{
    .name = "scale_add_ascend",
    .version = 1,
    .doc = "out = a * alpha + b, float32, on the CPU and on Ascend (C example plugin, ABI 3).",
    .n_inputs = 2,
    .input_names = inputs,
    .n_outputs = 1,
    .n_attrs = 1,
    .attrs = attrs,
    .n_dtypes = 1,
    .dtypes = dtypes,
    .infer = infer,
    .cpu_kernel = cpu_kernel,
    .n_device_kernels = 1,
    .device_kernels = device_kernels,
}};

OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->name = "scale_add_ascend";
  info->n_ops = 1;
  info->ops = ops;
  info->release = release;
  return OPB_OK;
}
