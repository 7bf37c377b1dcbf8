//! Kernels on accelerators (ABI 3): what an [`Op`](crate::Op)'s `run_device` receives. Device
//! memory is never dereferenced on the host: a kernel hands the addresses, the native stream and
//! the workspace to the vendor's API (a kernel launch, aclnn calls, async copies), which
//! enqueues the work; the kernel returns without waiting.
#![allow(unsafe_code)] // reads the host's DLTensor extents (never the device memory they describe)

use std::ffi::c_void;

use crate::{sys, DType, Error, Result};

/// An accelerator an operator may have a kernel for ([`Op::DEVICES`](crate::Op::DEVICES)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Device {
    /// A Huawei Ascend NPU: tensors in its memory, an `aclrtStream` to enqueue on.
    Ascend,
}

impl Device {
    /// The DLPack device type the ABI keys device kernels by (`kDLAscend` = 21).
    pub const fn dlpack_code(self) -> i32 {
        match self {
            Device::Ascend => sys::OPB_DEVICE_ASCEND,
        }
    }

    /// The device of a DLPack device type, if the ABI has kernels for it.
    pub const fn from_dlpack_code(code: i32) -> Option<Device> {
        match code {
            sys::OPB_DEVICE_ASCEND => Some(Device::Ascend),
            _ => None,
        }
    }

    /// `"ascend"`, as opbridge writes device names (`ascend:0`).
    pub const fn name(self) -> &'static str {
        match self {
            Device::Ascend => "ascend",
        }
    }
}

/// A tensor in device memory: its address (a device address: pass it to the vendor's API, never
/// read it on the host), dtype, shape and strides (in elements, as DLPack says).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceTensor {
    data: *mut c_void,
    device: Device,
    device_id: i32,
    dtype: DType,
    shape: Vec<usize>,
    strides: Vec<isize>,
}

impl DeviceTensor {
    /// # Safety
    /// `t` is a tensor the host passed to a device kernel (shape and strides valid for `ndim`).
    pub(crate) unsafe fn from_dl(t: &sys::DLTensor) -> Result<DeviceTensor> {
        let device = Device::from_dlpack_code(t.device.device_type)
            .ok_or_else(|| Error::failed(format!("a tensor on DLPack device type {}", t.device.device_type)))?;
        let dtype = DType::from_dl(t.dtype).ok_or_else(|| Error::dtype("unsupported element type"))?;
        let ndim = usize::try_from(t.ndim).ok().filter(|&n| n <= sys::OPB_MAX_NDIM);
        let ndim = ndim.ok_or_else(|| Error::shape(format!("ndim {} out of range", t.ndim)))?;
        let (shape, strides) = match ndim {
            0 => (Vec::new(), Vec::new()),
            // SAFETY: the host passes `ndim` extents and strides (the caller's obligation).
            n => unsafe {
                (
                    std::slice::from_raw_parts(t.shape, n).iter().map(|&d| d.max(0) as usize).collect(),
                    std::slice::from_raw_parts(t.strides, n).iter().map(|&s| s as isize).collect(),
                )
            },
        };
        // The byte offset folded into the address: device addresses are plain integers here.
        let data = (t.data as usize).wrapping_add(t.byte_offset as usize) as *mut c_void;
        Ok(DeviceTensor { data, device, device_id: t.device.device_id, dtype, shape, strides })
    }

    /// The device address of element 0.
    pub fn data_ptr(&self) -> *mut c_void {
        self.data
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// The device's index (`ascend:1` is 1).
    pub fn device_id(&self) -> i32 {
        self.device_id
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// In elements.
    pub fn strides(&self) -> &[isize] {
        &self.strides
    }

    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the elements (`len() * dtype().size()`).
    pub fn nbytes(&self) -> usize {
        self.len() * self.dtype.size()
    }

    /// Row-major without gaps (size-1 dimensions may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1isize;
        for (&extent, &stride) in self.shape.iter().zip(&self.strides).rev() {
            if extent > 1 && stride != expect {
                return false;
            }
            expect *= extent as isize;
        }
        true
    }
}

/// Where a device kernel enqueues its work: the device, its native stream and the call's
/// workspace (device memory, sized by [`Op::WORKSPACE`](crate::Op::WORKSPACE)).
#[derive(Debug)]
pub struct DeviceLaunch {
    pub(crate) device: Device,
    pub(crate) device_id: i32,
    pub(crate) stream: *mut c_void,
    pub(crate) workspace: *mut c_void,
    pub(crate) workspace_size: usize,
}

impl DeviceLaunch {
    pub fn device(&self) -> Device {
        self.device
    }

    pub fn device_id(&self) -> i32 {
        self.device_id
    }

    /// The device's native stream (`aclrtStream` on Ascend), current device already set on this
    /// thread. Borrowed: enqueue on it, never destroy or synchronize it.
    pub fn stream(&self) -> *mut c_void {
        self.stream
    }

    /// The call's scratch memory on the device (null when the workspace is empty), valid for
    /// the work this call enqueues.
    pub fn workspace(&self) -> *mut c_void {
        self.workspace
    }

    /// Bytes of [`DeviceLaunch::workspace`].
    pub fn workspace_size(&self) -> usize {
        self.workspace_size
    }
}
