/* Declarations of the aclnn part of the opbridge Ascend test double (libnnopbase.so,
 * libopapi_math.so, libopapi_nn.so, libopapi.so). Prototypes written from
 * shared/notes/ascend-acl.md §1.9/§1.10; nothing here is shared with the Rust backend.
 * Names prefixed acldouble are the double's own (not part of CANN). */
#ifndef ACLNN_DOUBLE_DECLS_H
#define ACLNN_DOUBLE_DECLS_H

#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ACLNN_API __attribute__((visibility("default")))

typedef int aclnnStatus;
typedef void *aclrtStream;

/* aclDataType (notes §1.10) */
typedef enum {
    ACL_DT_UNDEFINED = -1,
    ACL_FLOAT = 0,
    ACL_FLOAT16 = 1,
    ACL_INT8 = 2,
    ACL_INT32 = 3,
    ACL_UINT8 = 4,
    ACL_INT16 = 6,
    ACL_UINT16 = 7,
    ACL_UINT32 = 8,
    ACL_INT64 = 9,
    ACL_UINT64 = 10,
    ACL_DOUBLE = 11,
    ACL_BOOL = 12,
    ACL_BF16 = 27
} aclDataType;

typedef int aclFormat; /* ND = 2; any value accepted by the double */

/* aclnn status codes (notes §2) */
#define ACLNN_SUCCESS 0
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002
#define ACLNN_ERR_RUNTIME_ERROR 361001
#define ACLNN_ERR_INNER 561000
#define ACLNN_ERR_INNER_NULLPTR 561103

typedef struct aclTensor aclTensor;
typedef struct aclScalar aclScalar;
typedef struct aclIntArray aclIntArray;
typedef struct aclOpExecutor aclOpExecutor;

/* libnnopbase.so — meta API (notes §1.9) */
ACLNN_API aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType,
                                     const int64_t *stride, int64_t offset, aclFormat format,
                                     const int64_t *storageDims, uint64_t storageDimsNum, void *tensorData);
ACLNN_API aclnnStatus aclDestroyTensor(const aclTensor *tensor);
ACLNN_API aclScalar *aclCreateScalar(void *value, aclDataType dataType);
ACLNN_API aclnnStatus aclDestroyScalar(const aclScalar *scalar);
ACLNN_API aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size);
ACLNN_API aclnnStatus aclDestroyIntArray(const aclIntArray *array);
ACLNN_API aclnnStatus aclnnInit(const char *configPath);
ACLNN_API aclnnStatus aclnnFinalize(void);
ACLNN_API aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor);
ACLNN_API aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor);
ACLNN_API aclnnStatus aclSetInputTensorAddr(aclOpExecutor *executor, const size_t index, aclTensor *tensor,
                                           void *addr);
ACLNN_API aclnnStatus aclSetOutputTensorAddr(aclOpExecutor *executor, const size_t index, aclTensor *tensor,
                                            void *addr);

/* test-only (double) */
ACLNN_API int acldoubleAclnnOutstanding(uint64_t *tensors, uint64_t *scalars, uint64_t *executors);
/* fetch-and-clear of the calling thread's aclnn message (NULL when none); the same text is also
 * handed to the runtime double's aclGetRecentErrMsg buffer when it exports acldouble_set_error */
ACLNN_API const char *acldoubleAclnnLastErrMsg(void);

/* libopapi_math.so (notes §1.10; the double supports no type promotion) */
#define ACLNN_PHASE1_OUT uint64_t *workspaceSize, aclOpExecutor **executor
#define ACLNN_PHASE2(name) \
    ACLNN_API aclnnStatus name(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)
ACLNN_API aclnnStatus aclnnAddGetWorkspaceSize(const aclTensor *self, const aclTensor *other, const aclScalar *alpha,
                                               aclTensor *out, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnAdd);
ACLNN_API aclnnStatus aclnnSubGetWorkspaceSize(const aclTensor *self, const aclTensor *other, const aclScalar *alpha,
                                               aclTensor *out, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnSub);
ACLNN_API aclnnStatus aclnnMulGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                               ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnMul);
ACLNN_API aclnnStatus aclnnDivGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                               ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnDiv);
ACLNN_API aclnnStatus aclnnMaximumGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                                   ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnMaximum);
ACLNN_API aclnnStatus aclnnMinimumGetWorkspaceSize(const aclTensor *self, const aclTensor *other, aclTensor *out,
                                                   ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnMinimum);
ACLNN_API aclnnStatus aclnnPowTensorTensorGetWorkspaceSize(const aclTensor *self, const aclTensor *exponent,
                                                           aclTensor *out, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnPowTensorTensor);
ACLNN_API aclnnStatus aclnnCastGetWorkspaceSize(const aclTensor *self, const aclDataType dtype, aclTensor *out,
                                                ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnCast);
ACLNN_API aclnnStatus aclnnInplaceCopyGetWorkspaceSize(aclTensor *selfRef, const aclTensor *src, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnInplaceCopy);
ACLNN_API aclnnStatus aclnnReduceSumGetWorkspaceSize(const aclTensor *self, const aclIntArray *dims, bool keepDims,
                                                     aclDataType dtype, aclTensor *out, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnReduceSum);
ACLNN_API aclnnStatus aclnnMeanGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim,
                                                aclDataType dtype, aclTensor *out, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnMean);
ACLNN_API aclnnStatus aclnnAmaxGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim,
                                                aclTensor *out, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnAmax);
ACLNN_API aclnnStatus aclnnAminGetWorkspaceSize(const aclTensor *self, const aclIntArray *dim, bool keepDim,
                                                aclTensor *out, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnAmin);
ACLNN_API aclnnStatus aclnnArgMaxGetWorkspaceSize(const aclTensor *self, int64_t dim, bool keepdim, aclTensor *out,
                                                  ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnArgMax);
ACLNN_API aclnnStatus aclnnLayerNormGetWorkspaceSize(const aclTensor *input, const aclIntArray *normalizedShape,
                                                     const aclTensor *weightOptional, const aclTensor *biasOptional,
                                                     double eps, aclTensor *out, aclTensor *meanOutOptional,
                                                     aclTensor *rstdOutOptional, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnLayerNorm);
/* aclnn_rms_norm.h: y = x * rstd * gamma over gamma's trailing dims; rstdOut float32, x's shape with
 * those dims 1 */
ACLNN_API aclnnStatus aclnnRmsNormGetWorkspaceSize(const aclTensor *x, const aclTensor *gamma, double epsilon,
                                                   const aclTensor *yOut, const aclTensor *rstdOut, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnRmsNorm);
/* aclnn_embedding_bag.h (mode 0 sum, 1 mean, 2 max) */
ACLNN_API aclnnStatus aclnnEmbeddingBagGetWorkspaceSize(const aclTensor *weight, const aclTensor *indices,
                                                        const aclTensor *offsets, bool scaleGradByFreq, int64_t mode,
                                                        bool sparse, const aclTensor *perSampleWeights,
                                                        bool includeLastOffset, int64_t paddingIdx, aclTensor *output,
                                                        aclTensor *offset2bag, aclTensor *bagSize,
                                                        aclTensor *maxIndices, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnEmbeddingBag);
/* unary: aclnnXxxGetWorkspaceSize(const aclTensor *self, aclTensor *out, ...) */
#define ACLNN_UNARY(Name)                                                                                        \
    ACLNN_API aclnnStatus aclnn##Name##GetWorkspaceSize(const aclTensor *self, aclTensor *out, ACLNN_PHASE1_OUT); \
    ACLNN_PHASE2(aclnn##Name)
ACLNN_UNARY(Neg);
ACLNN_UNARY(Abs);
ACLNN_UNARY(Exp);
ACLNN_UNARY(Log);
ACLNN_UNARY(Sqrt);
ACLNN_UNARY(Tanh);

/* libopapi_nn.so */
ACLNN_API aclnnStatus aclnnMatmulGetWorkspaceSize(const aclTensor *self, const aclTensor *mat2, aclTensor *out,
                                                  int8_t cubeMathType, ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnMatmul);
ACLNN_API aclnnStatus aclnnSoftmaxGetWorkspaceSize(const aclTensor *self, int64_t dim, aclTensor *out,
                                                   ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnSoftmax);
ACLNN_API aclnnStatus aclnnLogSoftmaxGetWorkspaceSize(const aclTensor *self, int64_t dim, aclTensor *out,
                                                      ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnLogSoftmax);
ACLNN_API aclnnStatus aclnnGeluV2GetWorkspaceSize(const aclTensor *x, int64_t approximate, aclTensor *y,
                                                  ACLNN_PHASE1_OUT);
ACLNN_PHASE2(aclnnGeluV2);
ACLNN_UNARY(Relu);
ACLNN_UNARY(Sigmoid);
ACLNN_UNARY(Silu);

/* ---- internal interface between libnnopbase.so and the op libraries (double only) ---- */
#define ACLNN_DOUBLE_MAX_DIMS 8
#define ACLDOUBLE_MAX_TENSORS 8

typedef struct {
    int dtype;
    uint64_t ndim;
    int64_t dims[ACLNN_DOUBLE_MAX_DIMS];
    int64_t strides[ACLNN_DOUBLE_MAX_DIMS]; /* elements */
    int64_t offset;                         /* elements */
    char *data;                             /* storage base (device address) */
} acldoubleTensorDesc;

enum { ACLDOUBLE_OP_ADD = 1, ACLDOUBLE_OP_SUB, ACLDOUBLE_OP_MUL, ACLDOUBLE_OP_DIV, ACLDOUBLE_OP_MAX,
       ACLDOUBLE_OP_MIN, ACLDOUBLE_OP_POW, ACLDOUBLE_OP_CAST, ACLDOUBLE_OP_COPY, ACLDOUBLE_OP_MATMUL,
       /* unary (self, out) */
       ACLDOUBLE_OP_NEG, ACLDOUBLE_OP_ABS, ACLDOUBLE_OP_EXP, ACLDOUBLE_OP_LOG, ACLDOUBLE_OP_SQRT, ACLDOUBLE_OP_RELU,
       ACLDOUBLE_OP_SIGMOID, ACLDOUBLE_OP_TANH, ACLDOUBLE_OP_SILU,
       /* along one dim (alpha_i): (self, dim, out) */
       ACLDOUBLE_OP_SOFTMAX, ACLDOUBLE_OP_LOG_SOFTMAX,
       /* reductions over dims_mask (keepdim): (self, out) */
       ACLDOUBLE_OP_SUM, ACLDOUBLE_OP_MEAN, ACLDOUBLE_OP_AMAX, ACLDOUBLE_OP_AMIN, ACLDOUBLE_OP_ARGMAX,
       /* (input, weight?, bias?, out) over the trailing alpha_i dims, eps in alpha_f */
       ACLDOUBLE_OP_LAYER_NORM,
       /* unary with approximate (alpha_i: 0 erf, 1 tanh): (self, out) */
       ACLDOUBLE_OP_GELU,
       /* (x, gamma, y, rstd) over gamma's alpha_i trailing dims, eps in alpha_f */
       ACLDOUBLE_OP_RMS_NORM,
       /* (weight, indices, offsets, output, offset2bag, bagSize, maxIndices), mode in alpha_i */
       ACLDOUBLE_OP_EMBEDDING_BAG };

typedef struct {
    int op;
    const char *name; /* phase-2 name, e.g. "aclnnAdd" (static storage) */
    int ntensors;     /* inputs first, output last (embedding_bag: its four outputs last) */
    acldoubleTensorDesc t[ACLDOUBLE_MAX_TENSORS];
    double alpha_f;
    int64_t alpha_i;
    uint64_t workspace_size;
    uint32_t dims_mask;   /* reductions: the reduced dims of t[0] */
    uint32_t absent_mask; /* optional tensors not given (no descriptor, no memory) */
    int keepdim;
} acldoubleOpDesc;

ACLNN_API int acldoubleNnTensorDesc(const aclTensor *t, acldoubleTensorDesc *out);
ACLNN_API int acldoubleNnScalarValue(const aclScalar *s, double *f, int64_t *i);
ACLNN_API int acldoubleNnIntArrayValues(const aclIntArray *a, const int64_t **values, uint64_t *size);
ACLNN_API int acldoubleNnDtypeSize(int dtype);
ACLNN_API void acldoubleNnSetError(int code, const char *func, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* nonzero (the code to return; 561000 unless func:N:CODE) when the named call is due to fail per
 * ACLDOUBLE_FAIL (counts the call) */
ACLNN_API int acldoubleNnInjectFail(const char *func);
ACLNN_API aclOpExecutor *acldoubleNnNewExecutor(const acldoubleOpDesc *desc);
/* phase 2 shared by all ops */
ACLNN_API aclnnStatus acldoubleNnRun(const char *func, void *workspace, uint64_t workspaceSize,
                                     aclOpExecutor *executor, aclrtStream stream);

#ifdef __cplusplus
}
#endif

#endif
