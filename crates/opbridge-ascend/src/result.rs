//! `aclError` codes to the runtime's typed errors: every failure keeps the device, the ACL
//! function, the code and the driver's own text (`aclGetRecentErrMsg()`).

use std::ffi::c_int;

use opbridge_runtime::{AsyncError, DeviceId, Error, ErrorKind, Result};

use crate::sys::{Acl, ACL_SUCCESS};

/// The name of a code from `acl_base_rt.h`, for messages (the common ones).
pub fn code_name(code: c_int) -> &'static str {
    match code {
        100000 => "ACL_ERROR_INVALID_PARAM",
        100001 => "ACL_ERROR_UNINITIALIZE",
        100002 => "ACL_ERROR_REPEAT_INITIALIZE",
        100003 => "ACL_ERROR_INVALID_FILE",
        100037 => "ACL_ERROR_REPEAT_FINALIZE",
        100039 => "ACL_ERROR_COMPILING_STUB_MODE",
        107000 => "ACL_ERROR_RT_PARAM_INVALID",
        107001 => "ACL_ERROR_RT_INVALID_DEVICEID",
        107002 => "ACL_ERROR_RT_CONTEXT_NULL",
        107003 => "ACL_ERROR_RT_STREAM_CONTEXT",
        107008 => "ACL_ERROR_RT_ADDR_UNALIGNED",
        107011 => "ACL_ERROR_RT_STREAM_SUBSCRIBE",
        107012 => "ACL_ERROR_RT_THREAD_SUBSCRIBE",
        107015 => "ACL_ERROR_RT_STREAM_NO_CB_REG",
        207000 => "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
        207001 => "ACL_ERROR_RT_MEMORY_ALLOCATION",
        207004 => "ACL_ERROR_RT_NO_DEVICE",
        207007 => "ACL_ERROR_RT_OVER_LIMIT (events)",
        207008 => "ACL_ERROR_RT_OVER_LIMIT (streams)",
        507000 => "ACL_ERROR_RT_INTERNAL_ERROR",
        161001 => "ACLNN_ERR_PARAM_NULLPTR",
        161002 => "ACLNN_ERR_PARAM_INVALID",
        361001 => "ACLNN_ERR_RUNTIME_ERROR",
        561000 => "ACLNN_ERR_INNER",
        507012 => "ACL_ERROR_RT_REPORT_TIMEOUT",
        507015 => "ACL_ERROR_RT_AICORE_EXCEPTION",
        _ => "ACL error",
    }
}

/// `Ok` for `ACL_SUCCESS`; otherwise the driver error of `api` on `device`.
pub fn check(acl: &Acl, device: DeviceId, api: &'static str, code: c_int) -> Result<()> {
    if code == ACL_SUCCESS {
        return Ok(());
    }
    Err(driver_error(acl, device, api, code))
}

/// The typed error of a failed ACL call, with the driver's text when it has one.
pub fn driver_error(acl: &Acl, device: DeviceId, api: &'static str, code: c_int) -> Error {
    let message = match acl.recent_message() {
        Some(text) if !text.is_empty() => format!("{}: {text}", code_name(code)),
        _ => code_name(code).to_string(),
    };
    Error::Driver { device, api, code, message }
}

/// A failure that work on a stream reported at a synchronize: the stream's asynchronous error.
pub fn async_error(error: Error) -> AsyncError {
    let kind = match &error {
        Error::Driver { code: 207001, .. } => ErrorKind::OutOfMemory,
        _ => ErrorKind::Device,
    };
    AsyncError::from_error(kind, error)
}
