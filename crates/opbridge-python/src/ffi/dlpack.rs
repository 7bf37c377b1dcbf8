//! DLPack (<https://dmlc.github.io/dlpack/latest/>): export a tensor as a `dltensor` capsule and
//! import `dltensor` / `dltensor_versioned` capsules from numpy, PyTorch, CuPy...

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use opbridge_dtype::dlpack::{
    kDLCPU, kDLCUDAHost, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLTensor, DLPACK_FLAG_BITMASK_READ_ONLY,
};
use opbridge_runtime::{DType, DeviceId, DeviceKind, DevicePtr, Storage, Tensor};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

const LEGACY: &CStr = c"dltensor";
const LEGACY_USED: &CStr = c"used_dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const VERSIONED_USED: &CStr = c"used_dltensor_versioned";

/// What an exported capsule owns: the tensor (keeping its block alive) and the arrays the
/// `DLTensor` points into.
struct ExportContext {
    _tensor: Arc<Tensor>,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

unsafe extern "C" fn delete_exported(managed: *mut DLManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: `managed` and its context were made by `Box::into_raw` in `export`, and DLPack
    // calls the deleter exactly once.
    unsafe {
        let managed = Box::from_raw(managed);
        drop(Box::from_raw(managed.manager_ctx.cast::<ExportContext>()));
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with our capsule. If no consumer renamed it to "used_dltensor",
    // nobody took ownership, so we delete the tensor ourselves.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            delete_exported(managed);
        }
    }
}

/// A legacy `dltensor` capsule over `tensor` (which the caller has made ready on the host).
pub fn export(py: Python<'_>, tensor: Arc<Tensor>) -> PyResult<Bound<'_, PyAny>> {
    let device = tensor.device();
    let mut ctx = Box::new(ExportContext {
        shape: tensor.shape().iter().map(|&d| d as i64).collect(),
        strides: tensor.strides().iter().map(|&s| s as i64).collect(),
        _tensor: Arc::clone(&tensor),
    });
    let managed = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data: tensor.storage().ptr().0 as *mut c_void,
            device: DLDevice { device_type: device.kind.dlpack_code(), device_id: device.index as i32 },
            ndim: tensor.shape().len() as i32,
            dtype: tensor.dtype().to_dl(),
            shape: ctx.shape.as_mut_ptr(),
            strides: ctx.strides.as_mut_ptr(),
            byte_offset: tensor.byte_offset() as u64,
        },
        manager_ctx: Box::into_raw(ctx).cast(),
        deleter: Some(delete_exported),
    });
    let raw = Box::into_raw(managed);
    // SAFETY: a capsule over our heap object; the destructor frees it unless a consumer took
    // it (and then calls `deleter` itself).
    unsafe {
        let capsule = ffi::PyCapsule_New(raw.cast(), LEGACY.as_ptr(), Some(capsule_destructor));
        if capsule.is_null() {
            delete_exported(raw);
            return Err(PyErr::fetch(py));
        }
        Ok(Bound::from_owned_ptr(py, capsule))
    }
}

/// Owns an imported DLPack tensor; dropping it calls the producer's deleter.
enum Imported {
    Legacy(*mut DLManagedTensor),
    Versioned(*mut DLManagedTensorVersioned),
}

// SAFETY: DLPack requires deleters to be callable from any thread (producers such as numpy
// take the GIL inside theirs), and the pointer is only used to call the deleter once.
unsafe impl Send for Imported {}
// SAFETY: no method reads through the pointer; only `Drop` uses it, with `&mut self`.
unsafe impl Sync for Imported {}

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: the pointers came from consumed capsules and are released exactly once here.
        unsafe {
            match *self {
                Imported::Legacy(m) => {
                    if let Some(deleter) = (*m).deleter {
                        deleter(m)
                    }
                }
                Imported::Versioned(m) => {
                    if let Some(deleter) = (*m).deleter {
                        deleter(m)
                    }
                }
            }
        }
    }
}

/// A tensor sharing the memory of a DLPack capsule, and whether the producer marked it
/// read-only.
pub fn import(capsule: &Bound<'_, PyAny>) -> PyResult<(Tensor, bool)> {
    let ptr = capsule.as_ptr();
    // SAFETY: capsule API on a live object; names are checked before pointers are read, and a
    // consumed capsule is renamed so its destructor no longer frees the tensor.
    unsafe {
        let (dl, owner, read_only) = if ffi::PyCapsule_IsValid(ptr, VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(ptr, VERSIONED.as_ptr()).cast::<DLManagedTensorVersioned>();
            if (*m).version.major != 1 {
                return Err(PyBufferError::new_err(format!("unsupported DLPack major version {}", (*m).version.major)));
            }
            (
                &(*m).dl_tensor as *const DLTensor,
                Imported::Versioned(m),
                (*m).flags & DLPACK_FLAG_BITMASK_READ_ONLY != 0,
            )
        } else if ffi::PyCapsule_IsValid(ptr, LEGACY.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(ptr, LEGACY.as_ptr()).cast::<DLManagedTensor>();
            (&(*m).dl_tensor as *const DLTensor, Imported::Legacy(m), false)
        } else {
            return Err(PyBufferError::new_err("expected an unconsumed DLPack capsule"));
        };
        let used = if matches!(owner, Imported::Versioned(_)) { VERSIONED_USED } else { LEGACY_USED };
        if ffi::PyCapsule_SetName(ptr, used.as_ptr()) != 0 {
            std::mem::forget(owner);
            return Err(PyErr::fetch(capsule.py()));
        }
        // From here on `owner` releases the producer's tensor on every path.
        let dl = &*dl;
        if dl.device.device_type != kDLCPU && dl.device.device_type != kDLCUDAHost {
            return Err(crate::errors::device_error(format!(
                "from_dlpack: expected host memory (DLPack device type 1), got device type {}",
                dl.device.device_type
            )));
        }
        let dtype = DType::from_dl(dl.dtype).ok_or_else(|| {
            crate::errors::dtype_error(format!(
                "from_dlpack: expected float16/32/64 or int32/64, got DLPack dtype code {} bits {} lanes {}",
                dl.dtype.code, dl.dtype.bits, dl.dtype.lanes
            ))
        })?;
        let ndim = dl.ndim.max(0) as usize;
        let shape: Vec<usize> = (0..ndim).map(|i| *dl.shape.add(i) as usize).collect();
        let strides: Option<Vec<isize>> =
            (!dl.strides.is_null()).then(|| (0..ndim).map(|i| *dl.strides.add(i) as isize).collect());
        let n: usize = shape.iter().product();
        // Storage spans from `data` to the last element the view can reach.
        let reach: isize = match &strides {
            Some(s) if n > 0 => shape.iter().zip(s).map(|(&d, &st)| (d as isize - 1) * st.max(0)).sum::<isize>() + 1,
            _ => n as isize,
        };
        if strides.as_ref().is_some_and(|s| s.iter().any(|&st| st < 0)) {
            return Err(PyBufferError::new_err("from_dlpack: negative strides are not supported"));
        }
        // Kernels read typed elements: the first one must be aligned to its size.
        if !(dl.data as usize + dl.byte_offset as usize).is_multiple_of(dtype.size()) {
            return Err(PyBufferError::new_err(
                "from_dlpack: data not aligned to the element size; pass an aligned copy",
            ));
        }
        let len = dl.byte_offset as usize + reach as usize * dtype.size();
        let storage = Storage::External {
            ptr: DevicePtr(dl.data as usize),
            len,
            device: DeviceId { kind: DeviceKind::Cpu, index: 0 },
            owner: Box::new(owner),
        };
        let tensor =
            Tensor::from_storage(Arc::new(storage), DeviceId::CPU, dtype, shape, strides, dl.byte_offset as usize)
                .map_err(crate::errors::to_pyerr)?;
        Ok((tensor, read_only))
    }
}
