/*
 * opbridge plugin ABI, version 3.
 *
 * An operator library is a shared library (.so / .dylib / .dll) that exports one function,
 * `opbridge_plugin_init`, which fills an `OpbPluginInfo` with an array of operator descriptors.
 * `opbridge.load_library(path)` calls it, validates every descriptor, and registers the operators
 * beside the built-in ones; `Library.unload()` waits for calls in flight, unregisters them and
 * closes the library.
 *
 * Tensors are DLPack's `DLTensor` (the minimal definitions are below, under the official names).
 *
 * Build:  cc -O3 -shared -fPIC -I "$(python -c 'import opbridge; print(opbridge.get_include())')" \
 *            my_ops.c -o libmy_ops.so
 *
 * Rules every callback may rely on, and must follow:
 *  - Callbacks may run on several threads at once (one call per thread): keep them reentrant.
 *  - Inputs have one of the operator's `dtypes` (checked before `infer` is called), any strides
 *    (in elements, as DLPack says; possibly 0 or negative), and are read-only. An optional input
 *    the caller left out arrives with `ndim == OPB_ABSENT` (see opb_absent / opb_meta_absent).
 *  - Outputs have the dtypes and shapes that `infer` returned, are C-contiguous (strides are
 *    still given) and never overlap the inputs, except that an operator flagged
 *    OPB_OP_IN_PLACE_OK may get an output that is exactly an input of the same dtype and shape.
 *  - A callback returns OPB_OK (0) or an OpbStatus error, and on error writes a NUL-terminated
 *    message into `err_msg` (at most `err_len` bytes, `err_len` >= 1). opbridge turns the status
 *    into a typed Python exception (see OpbStatus) carrying the message.
 *  - Every pointer in the descriptors must stay valid until the library is closed.
 *  - Nothing may unwind out of a callback: C++ kernels catch every exception and return a status.
 *
 * A crash in a plugin takes the whole process down. Callbacks run inside the caller's process (on
 * its threads, stream workers and compute pool) with no isolation: a segfault, abort, stack
 * overflow, out-of-bounds write or call to exit() in `infer`, a kernel or `opbridge_plugin_init`
 * kills the Python interpreter (or the server) at once, with no exception and no cleanup, and a
 * stray write can corrupt opbridge's own state without crashing. opbridge cannot catch this.
 * To find the culprit:
 *  - run with `python -X faulthandler` (or `PYTHONFAULTHANDLER=1`, or `faulthandler.enable()`):
 *    on SIGSEGV/SIGBUS/SIGFPE/SIGABRT it prints every Python thread's stack, whose last frame is
 *    the `ob.ops.<name>(...)` call that entered the plugin; a core dump or `gdb -p` gives the C
 *    frame (build with `-g`);
 *  - try a new or untrusted library in a child process first (`subprocess` or
 *    `multiprocessing` with the 'spawn' start method): load it and call each operator on
 *    representative inputs there, and treat a negative exit status (-11 SIGSEGV, -7 SIGBUS,
 *    -6 SIGABRT) as a verdict;
 *  - test kernels under AddressSanitizer/UBSan (`-fsanitize=address,undefined`, run Python with
 *    the sanitizer runtime in LD_PRELOAD) or valgrind.
 * `opbridge doctor --plugin PATH` loads the library in a subprocess and names a crash in its init,
 * a missing symbol or dependency, a wrong ABI or a bad descriptor (it does not call the kernels).
 */
#ifndef OPBRIDGE_PLUGIN_H
#define OPBRIDGE_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

/* Version 3 added kernels per device (`OpbOpDesc.device_kernels`: an Ascend kernel today, the
 * slot is keyed by DLPack device type so CUDA adds its own the same way), an optional CPU kernel
 * for device-only operators, and the library's `release` callback. Version 2 libraries load
 * unchanged (CPU only): the loader offers version 3 first and, when the library answers that it
 * was built for version 2, initializes it again as a version 2 host (a version 2 descriptor is a
 * version 3 one without device kernels: the new fields sit where its NULL `reserved` were).
 * Version 2 added string, int-list and None-able attributes, optional inputs, the input-dtype
 * callback and the in-place flag. Libraries built for version 1 must be rebuilt. */
#define OPBRIDGE_PLUGIN_ABI_VERSION 3

/* Limits the loader checks (descriptors beyond them are rejected at load time). */
#define OPB_MAX_NDIM 16    /* dimensions of any tensor, in `OpbMeta.shape` */
#define OPB_MAX_INPUTS 16  /* tensor inputs of one operator */
#define OPB_MAX_OUTPUTS 16 /* tensor outputs of one operator */
#define OPB_MAX_ATTRS 32   /* attributes of one operator */
#define OPB_MAX_OPS 1024   /* operators of one library */
#define OPB_MAX_NAME 128   /* bytes of an operator, input, output or attribute name */
#define OPB_MAX_INTS 64    /* entries of an INTS attribute's default */
#define OPB_MAX_DEVICE_KERNELS 8 /* device kernels of one operator */

/* `DLDevice.device_type` of Huawei Ascend NPU memory: kDLAscend in DLPack after v1.3 (a macro
 * here, so that it exists with an older <dlpack/dlpack.h> too). */
#define OPB_DEVICE_ASCEND 21

/* ---------------------------------------------------------------------------------------------
 * DLPack (https://github.com/dmlc/dlpack): the subset this ABI uses, under the official names and
 * with the official layout. If you use DLPack yourself, include <dlpack/dlpack.h> *before* this
 * header and these definitions step aside.
 * ------------------------------------------------------------------------------------------- */
#if !defined(DLPACK_DLPACK_H_) && !defined(DLPACK_VERSION) && !defined(DLPACK_MAJOR_VERSION)
#define OPBRIDGE_DEFINES_DLPACK 1

typedef enum {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13,
  kDLOneAPI = 14,
  kDLWebGPU = 15,
  kDLHexagon = 16,
  kDLMAIA = 17,
} DLDeviceType;

typedef struct {
  DLDeviceType device_type;
  int32_t device_id;
} DLDevice;

typedef enum {
  kDLInt = 0U,
  kDLUInt = 1U,
  kDLFloat = 2U,
  kDLOpaqueHandle = 3U,
  kDLBfloat = 4U,
  kDLComplex = 5U,
  kDLBool = 6U,
} DLDataTypeCode;

typedef struct {
  uint8_t code;   /* a DLDataTypeCode */
  uint8_t bits;   /* 16, 32, 64 ... */
  uint16_t lanes; /* 1 for every tensor opbridge passes */
} DLDataType;

typedef struct {
  void *data;       /* for kDLCPU: a host address; the first element is at data + byte_offset */
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t *shape;   /* ndim entries */
  int64_t *strides; /* ndim entries, in elements (never NULL when opbridge calls a kernel) */
  uint64_t byte_offset;
} DLTensor;
#endif /* DLPack */

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Status codes. Each maps to a Python exception class.
 * ------------------------------------------------------------------------------------------- */
typedef enum {
  OPB_OK = 0,
  OPB_ERR_INVALID_ARGUMENT = 1, /* opbridge.ArgumentError (a ValueError): a bad attribute value... */
  OPB_ERR_SHAPE = 2,            /* opbridge.ShapeError (a ValueError): shapes that do not combine */
  OPB_ERR_DTYPE = 3,            /* opbridge.DTypeError (a TypeError): dtypes the op does not take */
  OPB_ERR_ABI_MISMATCH = 4,     /* from opbridge_plugin_init only: the host speaks another ABI */
  OPB_ERR_FAILED = 5            /* any other failure (unknown codes too): the kernel-error class of
                                   built-in operators, opbridge.ArgumentError today */
} OpbStatus;

/* dtype initializers for descriptor arrays (lanes = 1), e.g.
 *   static const DLDataType dtypes[] = {OPB_FLOAT32, OPB_FLOAT64};
 * opbridge supports exactly these five. */
#define OPB_FLOAT16 {kDLFloat, 16, 1}
#define OPB_FLOAT32 {kDLFloat, 32, 1}
#define OPB_FLOAT64 {kDLFloat, 64, 1}
#define OPB_INT32 {kDLInt, 32, 1}
#define OPB_INT64 {kDLInt, 64, 1}

static inline int opb_dtype_eq(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

/* Whether `t` has element type code/bits, e.g. opb_dtype_is(t.dtype, kDLFloat, 32). */
static inline int opb_dtype_is(DLDataType t, int code, int bits) {
  return t.code == code && t.bits == bits && t.lanes == 1;
}

/* ---------------------------------------------------------------------------------------------
 * Attributes: non-tensor arguments, passed by keyword from Python (`alpha=2.0`).
 * ------------------------------------------------------------------------------------------- */
typedef enum {
  OPB_ATTR_INT = 0,   /* Python int (bools accepted, as 0/1), C int64_t (`OpbAttrValue.i`) */
  OPB_ATTR_FLOAT = 1, /* Python float (ints accepted), C double (`OpbAttrValue.f`) */
  OPB_ATTR_BOOL = 2,  /* Python bool, C 0 or 1 in `OpbAttrValue.i` */
  OPB_ATTR_STR = 3,   /* Python str (or a numpy dtype, by name), C UTF-8 in `OpbAttrValue.s` */
  OPB_ATTR_INTS = 4   /* Python sequence of ints, C `OpbAttrValue.ints` (`n_ints` entries) */
} OpbAttrKind;

/* `OpbAttrDesc.flags` */
#define OPB_ATTR_REQUIRED 1u     /* no default: the caller must pass it */
#define OPB_ATTR_NULLABLE 2u     /* None is a value (`OpbAttrValue.is_none`), e.g. axis=None */
#define OPB_ATTR_DEFAULT_NONE 4u /* the default is None (implies OPB_ATTR_NULLABLE) */

typedef struct {
  const char *name;            /* a Python identifier, unique within the operator */
  int32_t kind;                /* an OpbAttrKind */
  uint32_t flags;              /* OPB_ATTR_* flags */
  /* The default fields are ignored (never read) for REQUIRED and DEFAULT_NONE attributes. */
  int64_t default_int;         /* default of INT and BOOL attributes */
  double default_float;        /* default of FLOAT attributes */
  const char *default_str;     /* default of STR attributes (NULL: "") */
  const int64_t *default_ints; /* default of INTS attributes: n_default_ints entries */
  int64_t n_default_ints;      /* 0..OPB_MAX_INTS */
  const char *doc;             /* one line, or NULL */
} OpbAttrDesc;

/* One attribute value of a call. Strings and lists stay valid until the callback returns. */
typedef struct {
  int32_t kind;        /* the OpbAttrKind of the descriptor */
  int32_t is_none;     /* 1: the value is None (only for NULLABLE attributes); the rest is 0 */
  int64_t i;           /* INT, BOOL */
  double f;            /* FLOAT */
  const char *s;       /* STR: NUL-terminated UTF-8 */
  const int64_t *ints; /* INTS: n_ints entries */
  int64_t n_ints;
} OpbAttrValue;

/* A call's attributes: every attribute of the descriptor (defaults filled in), in its order. */
typedef struct {
  size_t count;
  const OpbAttrValue *values;
  const char *const *names;
} OpbAttrs;

/* The attribute `name`, or NULL. Attributes are also at their descriptor index: values[i]. */
static inline const OpbAttrValue *opb_attr(const OpbAttrs *attrs, const char *name) {
  for (size_t i = 0; i < attrs->count; i++) {
    const char *a = attrs->names[i], *b = name;
    while (*a && *a == *b) a++, b++;
    if (*a == *b) return &attrs->values[i];
  }
  return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Callbacks.
 * ------------------------------------------------------------------------------------------- */

/* dtype and shape of a tensor without its data: what shape functions see and produce. */
typedef struct {
  DLDataType dtype;
  int32_t ndim; /* 0..OPB_MAX_NDIM, or OPB_ABSENT for an optional input left out */
  int64_t shape[OPB_MAX_NDIM];
} OpbMeta;

/* `ndim` of an optional input the caller did not pass (its DLTensor also has data == NULL). */
#define OPB_ABSENT (-1)

static inline int opb_meta_absent(const OpbMeta *m) { return m->ndim == OPB_ABSENT; }
static inline int opb_absent(const DLTensor *t) { return t->ndim == OPB_ABSENT; }

/* Shape function (required): checks the inputs' dtypes and shapes and fills one OpbMeta per
 * output (`outputs` arrive zeroed). Runs before any memory is allocated. It must be a pure
 * function of its arguments: opbridge may reuse an earlier result for the same input metas and
 * attribute values instead of calling it again. */
typedef int (*OpbInferFn)(const OpbMeta *inputs, int n_in, OpbMeta *outputs, int n_out,
                          const OpbAttrs *attrs, char *err_msg, size_t err_len);

/* Input dtypes (optional): the dtype each input is converted to before the kernel runs, for
 * operators that compute in a common type (numpy's promotion: int32 + float32 in float64).
 * `dtypes` arrives holding the inputs' own dtypes (zeroed entries for absent inputs, which are
 * ignored); change the entries to convert. Each must be one of the operator's `dtypes`. `infer`
 * still sees the inputs as the caller passed them; the kernel and `workspace_size` see the
 * converted ones. Pure, like the shape function: opbridge may reuse an earlier result. */
typedef int (*OpbInputDtypesFn)(const OpbMeta *inputs, int n_in, DLDataType *dtypes,
                                const OpbAttrs *attrs, char *err_msg, size_t err_len);

/* Workspace size (optional): bytes of scratch memory the kernel needs for these inputs. The
 * kernel then receives a 64-byte aligned `workspace` of that size, else NULL. Pure, like the
 * shape function. */
typedef size_t (*OpbWorkspaceFn)(const OpbMeta *inputs, int n_in, const OpbAttrs *attrs);

/* Kernel. `stream` is the native stream of the device the call runs on; for CPU kernels it is
 * NULL and the kernel runs synchronously, in order with the rest of the stream's work.
 * `workspace_size` is the size in bytes of `workspace`: what `workspace_size` returned for this
 * call, or 0 when `workspace` is NULL (no `workspace_size` callback, or it returned 0). A kernel
 * must not touch more than `workspace_size` bytes of it.
 *
 * A device kernel (see OpbDeviceKernel) receives tensors whose `device` is its device (for
 * Ascend: device_type OPB_DEVICE_ASCEND, device_id the NPU's index) and whose `data` are device
 * addresses the host must not dereference; `stream` is that device's native stream (for Ascend
 * an `aclrtStream`), and the device is current on the calling thread (aclrtSetDevice done). The
 * kernel enqueues its work on `stream` (aclrtLaunchKernelWithHostArgs, aclnn calls, async
 * copies) and returns at once, without synchronizing: opbridge orders the stream after earlier
 * work on the same tensors and keeps inputs, outputs and the workspace (device memory) alive
 * until the enqueued work has run. Never destroy the stream or enqueue on another one. A status
 * returned here fails the call at once, and then the kernel must have enqueued nothing (check
 * everything first, launch last); a failure of the enqueued work is the stream's, raised as
 * opbridge.DeviceError by its next synchronize. */
typedef int (*OpbKernelFn)(const DLTensor *inputs, int n_in, DLTensor *outputs, int n_out,
                           const OpbAttrs *attrs, void *stream, void *workspace,
                           size_t workspace_size, char *err_msg, size_t err_len);

/* ---------------------------------------------------------------------------------------------
 * Descriptors.
 * ------------------------------------------------------------------------------------------- */
/* `OpbOpDesc.flags` */
#define OPB_OP_IN_PLACE_OK 1u /* an output may be exactly an input (elementwise operators) */

/* An operator's kernel on one accelerator (ABI 3). Calls on tensors of that device come here;
 * calls on a device the operator has no kernel for raise opbridge.DeviceError naming the devices
 * it has. */
typedef struct {
  int32_t device_type; /* a DLPack device type: OPB_DEVICE_ASCEND (others are refused at load; CUDA's
                          kDLCUDA joins when opbridge has a CUDA device) */
  uint32_t flags;      /* must be 0 */
  OpbKernelFn kernel;  /* required: enqueues the work on the device's stream (see OpbKernelFn) */
  void *reserved[2];   /* must be NULL */
} OpbDeviceKernel;

typedef struct {
  const char *name;                 /* [A-Za-z0-9_]+, at most OPB_MAX_NAME bytes */
  uint32_t version;                 /* >= 1; versions of one name coexist */
  const char *doc;                  /* docstring shown by help(); may be NULL */
  int32_t n_inputs;                 /* 0..OPB_MAX_INPUTS */
  const char *const *input_names;   /* n_inputs identifiers, or NULL for "x0", "x1", ... */
  const int32_t *input_optional;    /* n_inputs flags (nonzero: may be None), or NULL: all required */
  int32_t n_outputs;                /* 1..OPB_MAX_OUTPUTS */
  const char *const *output_names;  /* n_outputs identifiers, or NULL for "out", "out1", ... */
  int32_t n_attrs;                  /* 0..OPB_MAX_ATTRS */
  const OpbAttrDesc *attrs;         /* n_attrs descriptors (NULL when n_attrs is 0) */
  int32_t n_dtypes;                 /* >= 1 */
  const DLDataType *dtypes;         /* dtypes the inputs may have ({OPB_FLOAT32, ...}) */
  uint32_t flags;                   /* OPB_OP_* flags */
  OpbInferFn infer;                 /* required */
  OpbInputDtypesFn input_dtypes;    /* optional (NULL: inputs keep their dtypes) */
  OpbKernelFn cpu_kernel;           /* required in ABI 2; in ABI 3 NULL for a device-only operator */
  OpbWorkspaceFn workspace_size;    /* optional (NULL: no workspace); sizes device workspaces too */
  /* ABI 3: kernels on accelerators, one per device type (0..OPB_MAX_DEVICE_KERNELS entries). */
  int32_t n_device_kernels;
  const OpbDeviceKernel *device_kernels; /* n_device_kernels entries, or NULL when 0 */
  void *reserved[2];                     /* must be NULL */
} OpbOpDesc;

/* What opbridge tells the library. */
typedef struct {
  uint32_t abi_version;        /* OPBRIDGE_PLUGIN_ABI_VERSION of the host */
  uint32_t reserved0;
  const char *runtime_version; /* opbridge's version, e.g. "0.1.0" */
  void *reserved[4];
} OpbPluginHost;

/* Release callback (optional, ABI 3): called once before the library is closed, after the last
 * call of its operators has finished (the device work they queued included): at unload, or when
 * a load fails after a successful opbridge_plugin_init. Free what the kernels set up lazily:
 * loaded kernel binaries (aclrtBinaryUnLoad), device buffers, handles. It runs on the thread
 * that unloads, with no particular device current. Not called for a library that stays loaded
 * until the process ends. */
typedef void (*OpbReleaseFn)(void);

/* What the library tells opbridge. It arrives zeroed. */
typedef struct {
  uint32_t abi_version; /* set to OPBRIDGE_PLUGIN_ABI_VERSION, always, even on error */
  uint32_t reserved0;
  const char *name;     /* the library's name, or NULL */
  int32_t n_ops;        /* 1..OPB_MAX_OPS */
  const OpbOpDesc *ops; /* n_ops descriptors; name + version unique */
  const char *error;    /* on a failed init: a static message, or NULL */
  OpbReleaseFn release; /* ABI 3, optional (see OpbReleaseFn) */
  void *reserved[7];
} OpbPluginInfo;

/* The entry point every library exports:
 *
 *   OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
 *     info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
 *     if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
 *     info->n_ops = sizeof(my_ops) / sizeof(my_ops[0]);
 *     info->ops = my_ops;
 *     return OPB_OK;
 *   }
 *
 * Set `info->abi_version` first and touch nothing else when the versions differ: the loader
 * reads the rest of the struct only from a library of an ABI version it speaks, and calls the
 * entry point again, as a host of the library's version, when that is an older one it still
 * loads (version 2). */
typedef int (*OpbPluginInitFn)(const OpbPluginHost *host, OpbPluginInfo *info);

#define OPB_PLUGIN_INIT_SYMBOL "opbridge_plugin_init"

#if defined(_WIN32)
#define OPB_EXPORT __declspec(dllexport)
#else
#define OPB_EXPORT __attribute__((visibility("default")))
#endif

/* Declared here (with C linkage) so that a C++ definition is exported unmangled. */
OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info);

/* Writes a message into a callback's error buffer and returns `status`, e.g.
 *   return opb_fail(err_msg, err_len, OPB_ERR_SHAPE, "a and b differ in shape");  */
static inline int opb_fail(char *err_msg, size_t err_len, int status, const char *message) {
  if (err_msg && err_len) {
    size_t i = 0;
    for (; message[i] && i + 1 < err_len; i++) err_msg[i] = message[i];
    err_msg[i] = '\0';
  }
  return status;
}

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* OPBRIDGE_PLUGIN_H */
