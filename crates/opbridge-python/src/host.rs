//! The synchronous numpy path: validate numpy arrays, normalize the odd ones once, allocate
//! outputs, and run CPU kernels directly on numpy's buffers (GIL released for large inputs).

use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use opbridge_runtime::DType;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::numpy;
use crate::errors::{argument_error, dtype_error};
use crate::ffi::numpy as np_ffi;

/// Kernels touching at least this many bytes run with the GIL released: releasing costs about
/// 140 ns (DESIGN.md), which pays off from roughly 16K float32 elements.
pub const GIL_RELEASE_BYTES: usize = 64 * 1024;

/// Outputs at least this large come from the caching pool (no page faults on reuse, which is
/// what makes fresh large outputs faster than numpy's); smaller ones from numpy's allocator,
/// which is cheaper per call for small arrays.
pub const POOL_OUTPUT_MIN_BYTES: usize = 256 * 1024;

/// A numpy array argument with a dtype opbridge supports.
#[derive(Debug)]
pub struct HostArray<'py> {
    pub array: Bound<'py, PyUntypedArray>,
    pub dtype: DType,
    layout: np_ffi::Layout,
}

impl<'py> HostArray<'py> {
    /// Accepts an ndarray, or anything numpy can turn into one (buffer protocol, DLPack,
    /// sequences). Unsupported dtypes raise `DTypeError` naming the supported ones.
    pub fn extract(op: &str, name: &str, obj: &Bound<'py, PyAny>, supported: &[DType]) -> PyResult<HostArray<'py>> {
        let array = match np_ffi::as_ndarray(obj) {
            Some(array) => array.clone(),
            None => {
                let np = numpy(obj.py())?;
                let converted = if obj.hasattr("__dlpack__")? {
                    np.call_method1("from_dlpack", (obj,))
                } else {
                    np.call_method1("asarray", (obj,))
                };
                // numpy's own refusal (a ragged list: ValueError; an object it cannot read:
                // TypeError...) becomes the argument's error, with numpy's as its cause.
                let converted = converted.and_then(|a| Ok(a.cast_into::<PyUntypedArray>()?)).map_err(|e| {
                    let error = argument_error(format!("{op}: {name} cannot be converted to an array: {e}"));
                    error.set_cause(obj.py(), Some(e));
                    error
                })?;
                converted
            }
        };
        let layout = np_ffi::layout(&array);
        match np_ffi::dtype_of_num(layout.type_num).filter(|d| supported.contains(d)) {
            Some(dtype) => Ok(HostArray { array, dtype, layout }),
            None => {
                let names: Vec<&str> = supported.iter().map(|d| d.name()).collect();
                Err(dtype_error(format!("{op}: expected {name} of dtype {}, got {}", names.join(", "), array.dtype())))
            }
        }
    }

    fn from_array(array: Bound<'py, PyUntypedArray>, dtype: DType) -> HostArray<'py> {
        let layout = np_ffi::layout(&array);
        HostArray { array, dtype, layout }
    }

    pub fn shape(&self) -> &[usize] {
        self.array.shape()
    }

    pub fn layout(&self) -> np_ffi::Layout {
        self.layout
    }

    pub fn is_native(&self) -> bool {
        self.layout.is_native()
    }

    /// C-contiguous, aligned, native byte order and of `dtype`: `self` when it already is, else
    /// one copy made by numpy (strided, unaligned, byte-swapped and mixed-dtype inputs pay
    /// exactly that copy).
    pub fn normalized(self, dtype: DType) -> PyResult<HostArray<'py>> {
        if self.dtype == dtype && self.layout().is_c_contiguous() && self.layout().is_aligned() && self.is_native() {
            return Ok(self);
        }
        let py = self.array.py();
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", np_ffi::descr(py, dtype))?;
        kwargs.set_item("order", "C")?;
        // `numpy.array` always copies (`ascontiguousarray` would hand back an unaligned
        // contiguous array as is).
        let copy = numpy(py)?.call_method("array", (&self.array,), Some(&kwargs))?;
        Ok(HostArray::from_array(copy.cast_into()?, dtype))
    }

    /// A private copy (an input snapshotted at the call).
    pub fn copied(self) -> PyResult<HostArray<'py>> {
        let copy = self.array.call_method0("copy")?;
        Ok(HostArray::from_array(copy.cast_into()?, self.dtype))
    }
}

/// Validates an `out=` array: an ndarray, writeable, C-contiguous, native byte order.
/// Shape and dtype are the op's schema checks.
pub fn check_out<'py>(op: &str, out: &Bound<'py, PyAny>) -> PyResult<HostArray<'py>> {
    let Some(array) = np_ffi::as_ndarray(out) else {
        return Err(argument_error(format!(
            "{op}: expected out to be a numpy.ndarray, got {}",
            out.get_type().name()?
        )));
    };
    let out = HostArray::extract(op, "out", array.as_any(), &DType::ALL)?;
    let layout = out.layout();
    if !layout.is_writeable() {
        return Err(argument_error(format!("{op}: out is read-only")));
    }
    if !layout.is_c_contiguous() || !layout.is_aligned() || !out.is_native() {
        return Err(argument_error(format!(
            "{op}: expected a C-contiguous, aligned, native-byte-order out, got strides {:?} at address {:#x}",
            out.array.strides(),
            layout.data
        )));
    }
    Ok(out)
}

/// A new C-contiguous output array: pool memory for large ones, numpy's for small ones.
pub fn new_output<'py>(py: Python<'py>, dtype: DType, shape: &[usize]) -> PyResult<HostArray<'py>> {
    let bytes = shape
        .iter()
        .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            crate::errors::shape_error(format!("an output of shape {shape:?} and dtype {dtype} is too large"))
        })?;
    let array = if bytes >= POOL_OUTPUT_MIN_BYTES {
        np_ffi::pooled_array(py, dtype, shape)?
    } else {
        np_ffi::empty(py, dtype, shape)?
    };
    Ok(HostArray::from_array(array, dtype))
}

/// Runs `work`, without the GIL when it touches enough memory to be worth it.
pub fn run<T: Send>(py: Python<'_>, bytes: usize, work: impl FnOnce() -> T + Send) -> T {
    if bytes >= GIL_RELEASE_BYTES {
        py.detach(work)
    } else {
        work()
    }
}
