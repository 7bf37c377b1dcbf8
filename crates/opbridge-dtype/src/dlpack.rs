//! DLPack (<https://github.com/dmlc/dlpack>, `include/dlpack/dlpack.h`): the structs and codes
//! opbridge uses, under the official names and with the official layout. The plugin ABI
//! (`opbridge/plugin.h`, re-exported by the plugin SDK's `sys`) passes `DLTensor`s to kernels;
//! the Python bindings export and import `dltensor` / `dltensor_versioned` capsules.
//!
//! Declarations only: reading through the pointers is the `unsafe` business of the crates that
//! do it (the SDK's `sys`/`tensor`, the bindings' `ffi::dlpack`).
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::ffi::{c_int, c_void};

/// `DLDeviceType`, a C enum (`int`).
pub type DLDeviceType = c_int;

// Device types (`DLDeviceType`). The values are DLPack's; opbridge's device kinds map onto them
// in `opbridge_runtime::DeviceKind::dlpack_code`.
/// Host memory.
pub const kDLCPU: DLDeviceType = 1;
/// CUDA device memory.
pub const kDLCUDA: DLDeviceType = 2;
/// Page-locked host memory from `cudaMallocHost`: host-readable.
pub const kDLCUDAHost: DLDeviceType = 3;
/// "Reserved extension device type": what torch_npu exports Ascend NPU tensors as today.
pub const kDLExtDev: DLDeviceType = 12;
/// Huawei Ascend NPU device memory. Added to DLPack's `main` after v1.3 (dmlc/dlpack PR #189,
/// alongside `kDLTPU = 19`, `kDLTPUHost = 20`); not yet in a tagged release. Importers should
/// accept `kDLExtDev` from Ascend producers too (torch_npu).
pub const kDLAscend: DLDeviceType = 21;

// Type codes (`DLDataTypeCode`, `uint8_t`).
pub const kDLInt: u8 = 0;
pub const kDLUInt: u8 = 1;
pub const kDLFloat: u8 = 2;

/// `DLManagedTensorVersioned.flags` bit: the producer's memory must not be written.
pub const DLPACK_FLAG_BITMASK_READ_ONLY: u64 = 1;

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLDevice {
    /// A `DLDeviceType` (a C enum: `int`).
    pub device_type: DLDeviceType,
    pub device_id: i32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

/// The legacy (unversioned) managed tensor of a `dltensor` capsule.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLPackVersion`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DLPackVersion {
    pub major: u32,
    pub minor: u32,
}

/// The managed tensor of a `dltensor_versioned` capsule (DLPack 1.x).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    pub version: DLPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    pub flags: u64,
    pub dl_tensor: DLTensor,
}
