//! Conversions of Python arguments shared by the binding modules: device strings, dtype
//! arguments, and the cached `numpy` module. Depends on no other binding module but `errors`
//! and `ffi`, so the modules that use it form no import circle.

use numpy::PyArrayDescrMethods;
use opbridge_runtime::{DType, DeviceId};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::errors::{device_error, dtype_error};
use crate::ffi::numpy as np_ffi;

static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// The `numpy` module, imported once per process.
pub fn numpy(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    Ok(NUMPY.get_or_try_init(py, || py.import("numpy").map(Bound::unbind))?.bind(py))
}

/// A device argument (`None` is `cpu:0`), parsed by `DeviceId::parse`.
pub fn parse_device(device: Option<&str>) -> PyResult<DeviceId> {
    match device {
        None => Ok(DeviceId::CPU),
        Some(text) => DeviceId::parse(text).ok_or_else(|| {
            device_error(format!("unknown device {text:?}: expected 'cpu', 'cpu:0', 'cuda:N' or 'ascend:N'"))
        }),
    }
}

/// A dtype argument (anything `numpy.dtype` accepts; `None` is float32).
pub fn parse_dtype(py: Python<'_>, dtype: Option<&Bound<'_, PyAny>>) -> PyResult<DType> {
    let Some(dtype) = dtype else { return Ok(DType::F32) };
    let descr = numpy(py)?.call_method1("dtype", (dtype,)).map_err(|e| {
        dtype_error(format!("expected a dtype of float16, float32, float64, int32, int64, got {dtype}: {e}"))
    })?;
    let descr = descr.cast::<numpy::PyArrayDescr>()?;
    np_ffi::dtype_of_num(descr.num())
        .ok_or_else(|| dtype_error(format!("expected a dtype of float16, float32, float64, int32, int64, got {descr}")))
}
