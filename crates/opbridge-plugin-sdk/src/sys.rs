//! Raw declarations of the plugin ABI, one for one with `opbridge/plugin.h` (version 3), as
//! `opbridge.get_include()` ships it. Plugin authors use the safe API of the crate root; a test
//! compiles the header with the system C compiler and compares every size and offset with these.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals, missing_docs)]

use std::ffi::{c_char, c_int, c_void};

pub const OPBRIDGE_PLUGIN_ABI_VERSION: u32 = 3;
/// The oldest ABI the loader still loads (its libraries are CPU only).
pub const OPBRIDGE_PLUGIN_ABI_OLDEST: u32 = 2;

pub const OPB_MAX_NDIM: usize = 16;
pub const OPB_MAX_INPUTS: i32 = 16;
pub const OPB_MAX_OUTPUTS: i32 = 16;
pub const OPB_MAX_ATTRS: i32 = 32;
pub const OPB_MAX_OPS: i32 = 1024;
pub const OPB_MAX_NAME: usize = 128;
pub const OPB_MAX_INTS: i64 = 64;
pub const OPB_MAX_DEVICE_KERNELS: i32 = 8;

/// `DLDevice.device_type` of Ascend NPU memory (`kDLAscend`).
pub const OPB_DEVICE_ASCEND: i32 = opbridge_dtype::dlpack::kDLAscend;

/// `ndim` of an optional input the caller left out.
pub const OPB_ABSENT: i32 = -1;

pub const OPB_PLUGIN_INIT_SYMBOL: &[u8] = b"opbridge_plugin_init\0";

// DLPack: declared once, in `opbridge-dtype`, and re-exported here under the header's names.
pub use opbridge_dtype::dlpack::{kDLCPU, kDLFloat, kDLInt, kDLUInt, DLDataType, DLDevice, DLTensor};

// Status codes (`OpbStatus`).
pub const OPB_OK: c_int = 0;
pub const OPB_ERR_INVALID_ARGUMENT: c_int = 1;
pub const OPB_ERR_SHAPE: c_int = 2;
pub const OPB_ERR_DTYPE: c_int = 3;
pub const OPB_ERR_ABI_MISMATCH: c_int = 4;
pub const OPB_ERR_FAILED: c_int = 5;

// Attribute kinds (`OpbAttrKind`).
pub const OPB_ATTR_INT: i32 = 0;
pub const OPB_ATTR_FLOAT: i32 = 1;
pub const OPB_ATTR_BOOL: i32 = 2;
pub const OPB_ATTR_STR: i32 = 3;
pub const OPB_ATTR_INTS: i32 = 4;

// Attribute flags.
pub const OPB_ATTR_REQUIRED: u32 = 1;
pub const OPB_ATTR_NULLABLE: u32 = 2;
pub const OPB_ATTR_DEFAULT_NONE: u32 = 4;

// Operator flags.
pub const OPB_OP_IN_PLACE_OK: u32 = 1;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct OpbAttrDesc {
    pub name: *const c_char,
    pub kind: i32,
    pub flags: u32,
    pub default_int: i64,
    pub default_float: f64,
    pub default_str: *const c_char,
    pub default_ints: *const i64,
    pub n_default_ints: i64,
    pub doc: *const c_char,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpbAttrValue {
    pub kind: i32,
    pub is_none: i32,
    pub i: i64,
    pub f: f64,
    pub s: *const c_char,
    pub ints: *const i64,
    pub n_ints: i64,
}

impl Default for OpbAttrValue {
    fn default() -> OpbAttrValue {
        OpbAttrValue { kind: 0, is_none: 0, i: 0, f: 0.0, s: std::ptr::null(), ints: std::ptr::null(), n_ints: 0 }
    }
}

#[repr(C)]
#[derive(Debug)]
pub struct OpbAttrs {
    pub count: usize,
    pub values: *const OpbAttrValue,
    pub names: *const *const c_char,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpbMeta {
    pub dtype: DLDataType,
    pub ndim: i32,
    pub shape: [i64; OPB_MAX_NDIM],
}

pub type OpbInferFn = unsafe extern "C" fn(
    inputs: *const OpbMeta,
    n_in: c_int,
    outputs: *mut OpbMeta,
    n_out: c_int,
    attrs: *const OpbAttrs,
    err_msg: *mut c_char,
    err_len: usize,
) -> c_int;

pub type OpbInputDtypesFn = unsafe extern "C" fn(
    inputs: *const OpbMeta,
    n_in: c_int,
    dtypes: *mut DLDataType,
    attrs: *const OpbAttrs,
    err_msg: *mut c_char,
    err_len: usize,
) -> c_int;

pub type OpbWorkspaceFn = unsafe extern "C" fn(inputs: *const OpbMeta, n_in: c_int, attrs: *const OpbAttrs) -> usize;

pub type OpbKernelFn = unsafe extern "C" fn(
    inputs: *const DLTensor,
    n_in: c_int,
    outputs: *mut DLTensor,
    n_out: c_int,
    attrs: *const OpbAttrs,
    stream: *mut c_void,
    workspace: *mut c_void,
    workspace_size: usize,
    err_msg: *mut c_char,
    err_len: usize,
) -> c_int;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct OpbOpDesc {
    pub name: *const c_char,
    pub version: u32,
    pub doc: *const c_char,
    pub n_inputs: i32,
    pub input_names: *const *const c_char,
    pub input_optional: *const i32,
    pub n_outputs: i32,
    pub output_names: *const *const c_char,
    pub n_attrs: i32,
    pub attrs: *const OpbAttrDesc,
    pub n_dtypes: i32,
    pub dtypes: *const DLDataType,
    pub flags: u32,
    pub infer: Option<OpbInferFn>,
    pub input_dtypes: Option<OpbInputDtypesFn>,
    pub cpu_kernel: Option<OpbKernelFn>,
    pub workspace_size: Option<OpbWorkspaceFn>,
    pub n_device_kernels: i32,
    pub device_kernels: *const OpbDeviceKernel,
    pub reserved: [*mut c_void; 2],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct OpbDeviceKernel {
    pub device_type: i32,
    pub flags: u32,
    pub kernel: Option<OpbKernelFn>,
    pub reserved: [*mut c_void; 2],
}

pub type OpbReleaseFn = unsafe extern "C" fn();

#[repr(C)]
#[derive(Debug)]
pub struct OpbPluginHost {
    pub abi_version: u32,
    pub reserved0: u32,
    pub runtime_version: *const c_char,
    pub reserved: [*mut c_void; 4],
}

#[repr(C)]
#[derive(Debug)]
pub struct OpbPluginInfo {
    pub abi_version: u32,
    pub reserved0: u32,
    pub name: *const c_char,
    pub n_ops: i32,
    pub ops: *const OpbOpDesc,
    pub error: *const c_char,
    pub release: Option<OpbReleaseFn>,
    pub reserved: [*mut c_void; 7],
}

impl OpbPluginInfo {
    /// The all-zero struct the entry point receives.
    pub fn zeroed() -> OpbPluginInfo {
        OpbPluginInfo {
            abi_version: 0,
            reserved0: 0,
            name: std::ptr::null(),
            n_ops: 0,
            ops: std::ptr::null(),
            error: std::ptr::null(),
            release: None,
            reserved: [std::ptr::null_mut(); 7],
        }
    }
}

pub type OpbPluginInitFn = unsafe extern "C" fn(host: *const OpbPluginHost, info: *mut OpbPluginInfo) -> c_int;

/// `(struct, field, offset)` for every field, and `(struct, "sizeof", size)`: what the layout
/// test compares with the C compiler's `offsetof`/`sizeof` of the header.
pub fn layout() -> Vec<(&'static str, &'static str, usize)> {
    use std::mem::{offset_of, size_of};
    macro_rules! rows {
        ($($ty:ident { $($field:ident),* })*) => {
            vec![$(
                (stringify!($ty), "sizeof", size_of::<$ty>()),
                $((stringify!($ty), stringify!($field), offset_of!($ty, $field)),)*
            )*]
        };
    }
    rows! {
        DLDevice { device_type, device_id }
        DLDataType { code, bits, lanes }
        DLTensor { data, device, ndim, dtype, shape, strides, byte_offset }
        OpbAttrDesc { name, kind, flags, default_int, default_float, default_str, default_ints, n_default_ints, doc }
        OpbAttrValue { kind, is_none, i, f, s, ints, n_ints }
        OpbAttrs { count, values, names }
        OpbMeta { dtype, ndim, shape }
        OpbOpDesc {
            name, version, doc, n_inputs, input_names, input_optional, n_outputs, output_names, n_attrs, attrs,
            n_dtypes, dtypes, flags, infer, input_dtypes, cpu_kernel, workspace_size, n_device_kernels,
            device_kernels, reserved
        }
        OpbDeviceKernel { device_type, flags, kernel, reserved }
        OpbPluginHost { abi_version, reserved0, runtime_version, reserved }
        OpbPluginInfo { abi_version, reserved0, name, n_ops, ops, error, release, reserved }
    }
}
