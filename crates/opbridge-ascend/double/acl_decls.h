/* Private ACL declarations of the opbridge Ascend test double.
 *
 * Written from shared/notes/ascend-acl.md (§1.2-1.8, §2) only; deliberately not shared with
 * any other opbridge code (the Rust backend declares its own from the same notes, so a
 * disagreement between the two shows up as a test failure instead of being copied). */
#ifndef ACLDOUBLE_ACL_DECLS_H
#define ACLDOUBLE_ACL_DECLS_H

#include <stddef.h>
#include <stdint.h>

#define ACL_API __attribute__((visibility("default")))

typedef int aclError;
typedef void *aclrtStream;
typedef void *aclrtEvent;
typedef void (*aclrtCallback)(void *userData);
typedef void (*aclrtHostFunc)(void *args);

/* error codes (notes §2) */
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_INVALID_FILE 100003
#define ACL_ERROR_REPEAT_FINALIZE 100037
#define ACL_ERROR_RT_PARAM_INVALID 107000
#define ACL_ERROR_RT_INVALID_DEVICEID 107001
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_STREAM_CONTEXT 107003
#define ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID 107006
#define ACL_ERROR_RT_ADDR_UNALIGNED 107008
#define ACL_ERROR_RT_STREAM_SUBSCRIBE 107011
#define ACL_ERROR_RT_THREAD_SUBSCRIBE 107012
#define ACL_ERROR_RT_STREAM_NO_CB_REG 107015
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_NO_EVENT_RESOURCE 207007
#define ACL_ERROR_RT_NO_STREAM_RESOURCE 207008
#define ACL_ERROR_RT_INTERNAL_ERROR 507000
#define ACL_ERROR_RT_REPORT_TIMEOUT 507012
#define ACL_ERROR_RT_AICORE_EXCEPTION 507015
#define ACL_ERROR_RT_STREAM_SYNC_TIMEOUT 507046
#define ACL_ERROR_RT_EVENT_SYNC_TIMEOUT 507047

/* enums (notes §1.5-1.8) */
typedef enum { ACL_STREAM_STATUS_COMPLETE = 0, ACL_STREAM_STATUS_NOT_READY = 1, ACL_STREAM_STATUS_RESERVED = 0xFFFF } aclrtStreamStatus;
typedef enum { ACL_EVENT_STATUS_COMPLETE = 0, ACL_EVENT_STATUS_NOT_READY = 1, ACL_EVENT_STATUS_RESERVED = 2 } aclrtEventStatus;
typedef enum { ACL_EVENT_RECORDED_STATUS_NOT_READY = 0, ACL_EVENT_RECORDED_STATUS_COMPLETE = 1 } aclrtEventRecordedStatus;
typedef enum { ACL_CALLBACK_NO_BLOCK = 0, ACL_CALLBACK_BLOCK = 1 } aclrtCallbackBlockType;
typedef enum {
    ACL_MEMCPY_HOST_TO_HOST = 0,
    ACL_MEMCPY_HOST_TO_DEVICE = 1,
    ACL_MEMCPY_DEVICE_TO_HOST = 2,
    ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
    ACL_MEMCPY_DEFAULT = 4,
    ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE = 5,
    ACL_MEMCPY_INNER_DEVICE_TO_DEVICE = 6,
    ACL_MEMCPY_INTER_DEVICE_TO_DEVICE = 7
} aclrtMemcpyKind;
typedef int aclrtMemMallocPolicy; /* any value accepted (notes §1.7) */
typedef int aclrtMemAttr;         /* 0..17 */
typedef int aclrtLastErrLevel;    /* ACL_RT_THREAD_LEVEL = 0 */

#define ACL_EVENT_SYNC 0x1u
#define ACL_EVENT_CAPTURE_STREAM_PROGRESS 0x2u
#define ACL_EVENT_TIME_LINE 0x8u
#define ACL_EVENT_DEVICE_USE_ONLY 0x10u
#define ACL_EVENT_EXTERNAL 0x20u
#define ACL_EVENT_IPC 0x40u
#define ACL_EVENT_FLAG_MASK 0x7Bu

#define ACL_STREAM_FLAG_MASK 0x3Fu
#define ACL_CONTINUE_ON_FAILURE 0
#define ACL_STOP_ON_FAILURE 1

/* §1.3 init, errors, versions */
ACL_API aclError aclInit(const char *configPath);
ACL_API aclError aclFinalize(void);
ACL_API aclError aclFinalizeReference(uint64_t *refCount);
ACL_API const char *aclGetRecentErrMsg(void);
ACL_API aclError aclsysGetVersionStr(char *pkgName, char *versionStr);
ACL_API aclError aclrtGetVersion(int32_t *major, int32_t *minor, int32_t *patch);
ACL_API const char *aclrtGetSocName(void);
ACL_API aclError aclrtPeekAtLastError(aclrtLastErrLevel level);
ACL_API aclError aclrtGetLastError(aclrtLastErrLevel level);

/* §1.4 devices */
ACL_API aclError aclrtSetDevice(int32_t deviceId);
ACL_API aclError aclrtResetDevice(int32_t deviceId);
ACL_API aclError aclrtResetDeviceForce(int32_t deviceId);
ACL_API aclError aclrtGetDevice(int32_t *deviceId);
ACL_API aclError aclrtGetDeviceCount(uint32_t *count);
ACL_API aclError aclrtSynchronizeDevice(void);

/* §1.5 streams */
ACL_API aclError aclrtCreateStream(aclrtStream *stream);
ACL_API aclError aclrtCreateStreamWithConfig(aclrtStream *stream, uint32_t priority, uint32_t flag);
ACL_API aclError aclrtDestroyStream(aclrtStream stream);
ACL_API aclError aclrtDestroyStreamForce(aclrtStream stream);
ACL_API aclError aclrtSynchronizeStream(aclrtStream stream);
ACL_API aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout);
ACL_API aclError aclrtStreamQuery(aclrtStream stream, aclrtStreamStatus *status);
ACL_API aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event);
ACL_API aclError aclrtSetStreamFailureMode(aclrtStream stream, uint64_t mode);

/* §1.6 events */
ACL_API aclError aclrtCreateEvent(aclrtEvent *event);
ACL_API aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag);
ACL_API aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag);
ACL_API aclError aclrtDestroyEvent(aclrtEvent event);
ACL_API aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream);
ACL_API aclError aclrtResetEvent(aclrtEvent event, aclrtStream stream);
ACL_API aclError aclrtQueryEvent(aclrtEvent event, aclrtEventStatus *status);
ACL_API aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status);
ACL_API aclError aclrtSynchronizeEvent(aclrtEvent event);
ACL_API aclError aclrtSynchronizeEventWithTimeout(aclrtEvent event, int32_t timeout);
ACL_API aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent);

/* §1.7 memory */
ACL_API aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
ACL_API aclError aclrtMallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
ACL_API aclError aclrtFree(void *devPtr);
ACL_API aclError aclrtFreeWithDevSync(void *devPtr);
ACL_API aclError aclrtMallocHost(void **hostPtr, size_t size);
ACL_API aclError aclrtFreeHost(void *hostPtr);
ACL_API aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind);
ACL_API aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                                  aclrtStream stream);
ACL_API aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count);
ACL_API aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream);
ACL_API aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total);

/* §1.8 callbacks */
ACL_API aclError aclrtSubscribeReport(uint64_t threadId, aclrtStream stream);
ACL_API aclError aclrtLaunchCallback(aclrtCallback fn, void *userData, aclrtCallbackBlockType blockType,
                                     aclrtStream stream);
ACL_API aclError aclrtProcessReport(int32_t timeout);
ACL_API aclError aclrtUnSubscribeReport(uint64_t threadId, aclrtStream stream);
ACL_API aclError aclrtLaunchHostFunc(aclrtStream stream, aclrtHostFunc fn, void *args);

/* §1.11 kernel binaries (the double's dialect: acldouble_kernel.h) */
typedef void *aclrtBinHandle;
typedef void *aclrtFuncHandle;
typedef struct {
    int32_t type; /* LAZY_LOAD = 1, MAGIC = 2, CPU_KERNEL_MODE = 3 */
    uint32_t value;
} aclrtBinaryLoadOption;
typedef struct {
    aclrtBinaryLoadOption *options;
    size_t numOpt;
} aclrtBinaryLoadOptions;
typedef struct aclrtLaunchKernelCfg aclrtLaunchKernelCfg; /* attributes: ignored by the double */
typedef struct aclrtPlaceHolderInfo aclrtPlaceHolderInfo; /* placeholders: refused by the double */
ACL_API aclError aclrtBinaryLoadFromFile(const char *binPath, aclrtBinaryLoadOptions *options,
                                         aclrtBinHandle *binHandle);
ACL_API aclError aclrtBinaryLoadFromData(const void *data, size_t length, const aclrtBinaryLoadOptions *options,
                                         aclrtBinHandle *binHandle);
ACL_API aclError aclrtBinaryGetFunction(const aclrtBinHandle binHandle, const char *kernelName,
                                        aclrtFuncHandle *funcHandle);
ACL_API aclError aclrtBinaryUnLoad(aclrtBinHandle binHandle);
ACL_API aclError aclrtLaunchKernelWithHostArgs(aclrtFuncHandle funcHandle, uint32_t numBlocks, aclrtStream stream,
                                               aclrtLaunchKernelCfg *cfg, void *hostArgs, size_t argsSize,
                                               aclrtPlaceHolderInfo *placeHolderArray, size_t placeHolderNum);

#endif
