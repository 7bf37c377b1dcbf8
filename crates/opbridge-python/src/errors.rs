//! The one place errors become Python exceptions. The hierarchy (made at import):
//!
//! ```text
//! OpBridgeError(Exception)
//! ├── ShapeError(OpBridgeError, ValueError)
//! ├── DTypeError(OpBridgeError, TypeError)
//! ├── OutOfMemoryError(OpBridgeError, MemoryError)
//! ├── DeviceError(OpBridgeError, RuntimeError)
//! └── ArgumentError(OpBridgeError, ValueError)
//! ```
//! Each also derives from the builtin a user would catch for that kind of mistake.

use opbridge_ops::{ErrorKind, OpError};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

struct Exceptions {
    base: Py<PyType>,
    shape: Py<PyType>,
    dtype: Py<PyType>,
    oom: Py<PyType>,
    device: Py<PyType>,
    argument: Py<PyType>,
}

static EXCEPTIONS: PyOnceLock<Exceptions> = PyOnceLock::new();

fn make<'py>(py: Python<'py>, name: &str, bases: Vec<Bound<'py, PyAny>>, doc: &str) -> PyResult<Bound<'py, PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "opbridge")?;
    namespace.set_item("__doc__", doc)?;
    let bases = PyTuple::new(py, bases)?;
    Ok(py.get_type::<PyType>().call1((name, bases, namespace))?.cast_into()?)
}

/// Creates the exception classes and adds them to the native module.
pub fn register(module: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = module.py();
    let exceptions = EXCEPTIONS.get_or_try_init(py, || -> PyResult<Exceptions> {
        let base = make(
            py,
            "OpBridgeError",
            vec![py.get_type::<pyo3::exceptions::PyException>().into_any()],
            "Base class of every opbridge error.",
        )?;
        let sub = |name: &str, builtin: Bound<'_, PyType>, doc: &str| {
            make(py, name, vec![base.clone().into_any(), builtin.into_any()], doc).map(Bound::unbind)
        };
        Ok(Exceptions {
            shape: sub("ShapeError", py.get_type::<PyValueError>(), "Shapes that an operator cannot combine.")?,
            dtype: sub(
                "DTypeError",
                py.get_type::<PyTypeError>(),
                "A dtype an operator does not support, or a mismatched out=.",
            )?,
            oom: sub(
                "OutOfMemoryError",
                py.get_type::<PyMemoryError>(),
                "The device pool could not allocate; the message gives requested, limit, allocated and cached bytes.",
            )?,
            device: sub(
                "DeviceError",
                py.get_type::<PyRuntimeError>(),
                "A device, stream or event failed, or arguments mix devices.",
            )?,
            argument: sub(
                "ArgumentError",
                py.get_type::<PyValueError>(),
                "An invalid argument other than shape or dtype: a read-only or overlapping out=, a bad option.",
            )?,
            base: base.unbind(),
        })
    })?;
    for ty in [
        &exceptions.base,
        &exceptions.shape,
        &exceptions.dtype,
        &exceptions.oom,
        &exceptions.device,
        &exceptions.argument,
    ] {
        let ty = ty.bind(py);
        module.add(ty.name()?, ty)?;
    }
    Ok(())
}

fn raise(pick: fn(&Exceptions) -> &Py<PyType>, message: String) -> PyErr {
    Python::attach(|py| match EXCEPTIONS.get(py) {
        Some(exceptions) => PyErr::from_type(pick(exceptions).bind(py).clone(), message),
        None => PyRuntimeError::new_err(message),
    })
}

pub fn shape_error(message: String) -> PyErr {
    raise(|e| &e.shape, message)
}

pub fn dtype_error(message: String) -> PyErr {
    raise(|e| &e.dtype, message)
}

pub fn device_error(message: String) -> PyErr {
    raise(|e| &e.device, message)
}

pub fn argument_error(message: String) -> PyErr {
    raise(|e| &e.argument, message)
}

/// The one mapping from errors to exception classes: by kind, so an error raises the same
/// class whichever path found it (before launch, in a kernel, on a stream).
pub fn to_pyerr(error: impl Into<OpError>) -> PyErr {
    let error = error.into();
    let message = error.to_string();
    match error.kind() {
        ErrorKind::Shape => shape_error(message),
        ErrorKind::DType => dtype_error(message),
        ErrorKind::Argument => argument_error(message),
        ErrorKind::OutOfMemory => raise(|e| &e.oom, message),
        ErrorKind::Device | ErrorKind::Unavailable | ErrorKind::Internal => device_error(message),
        ErrorKind::NotFound => raise(|e| &e.base, message),
    }
}
