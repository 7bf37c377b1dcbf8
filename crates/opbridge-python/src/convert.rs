//! Conversions of Python arguments shared by the binding modules: device strings, dtype
//! arguments, and the cached `numpy` module. Depends on no other binding module but `errors`
//! and `ffi`, so the modules that use it form no import circle.

use std::sync::Arc;

use numpy::PyArrayDescrMethods;
use opbridge_runtime::{CallSite, DType, DeviceId};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::errors::{argument_error, device_error, dtype_error};
use crate::ffi::frames;
use crate::ffi::numpy as np_ffi;

static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// The `numpy` module, imported once per process.
pub fn numpy(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    Ok(NUMPY.get_or_try_init(py, || py.import("numpy").map(Bound::unbind))?.bind(py))
}

/// A device argument (`None` is `cpu:0`), parsed by `DeviceId::parse`. An index too large for
/// any device is an argument error; a name that is no device, a `DeviceError`.
pub fn parse_device(device: Option<&str>) -> PyResult<DeviceId> {
    match device {
        None => Ok(DeviceId::CPU),
        Some(text) => DeviceId::parse(text).ok_or_else(|| match text.split_once(':') {
            Some((_, index)) if !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()) => {
                argument_error(format!("device {text:?}: index {index} is out of range (at most {})", usize::MAX))
            }
            _ => device_error(format!("unknown device {text:?}: expected 'cpu', 'cpu:0', 'cuda:N' or 'ascend:N'")),
        }),
    }
}

/// A Python int (or an object with `__index__`, such as a numpy integer) for the argument
/// `what`, in `min..=max`. Everything else is an `ArgumentError` naming the argument: a value
/// out of range (never Python's `OverflowError`), a bool, a float or another type.
pub fn int_arg(what: &str, value: &Bound<'_, PyAny>, min: i128, max: i128) -> PyResult<i128> {
    if value.is_instance_of::<pyo3::types::PyBool>()
        || value.is_instance_of::<pyo3::types::PyFloat>()
        || value.is_instance_of::<pyo3::types::PyType>()
    {
        return Err(argument_error(format!("{what} must be an int, got {}", type_name(value))));
    }
    let index = match value.call_method0("__index__") {
        Ok(index) => index,
        Err(_) => return Err(argument_error(format!("{what} must be an int, got {}", type_name(value)))),
    };
    match index.extract::<i128>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(argument_error(format!("{what} is out of range: got {}, expected {min} to {max}", short_int(&index)))),
    }
}

/// An int for a message: its digits, or its size when that would be a wall of digits (and
/// Python refuses to print ints of more than 4300 digits).
pub fn short_int(value: &Bound<'_, PyAny>) -> String {
    let bits: u64 = value.call_method0("bit_length").and_then(|b| b.extract()).unwrap_or(0);
    if bits <= 128 {
        return value.str().map(|s| s.to_string()).unwrap_or_else(|_| "?".into());
    }
    let sign = value.lt(0i32).unwrap_or(false);
    format!("{}an int of {bits} bits", if sign { "-" } else { "" })
}

/// `type(value).__name__`, for messages.
pub fn type_name(value: &Bound<'_, PyAny>) -> String {
    value.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
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

/// What [`python_call_site`] learned on this thread. Code objects are held (strong
/// references), so their addresses stay unique while the maps use them as keys.
#[derive(Default)]
struct CallSites {
    /// Each code object's file, or `None` for the package's own code.
    codes: std::collections::HashMap<usize, (Py<PyAny>, Option<Arc<str>>)>,
    /// The line of a code object at an instruction offset (`f_lasti`): finding it walks the
    /// code's line table, microseconds in a long function.
    lines: std::collections::HashMap<(usize, i64), u32>,
}

/// Entries kept per thread (programs that make code objects at run time, `exec` in a loop).
const MAX_CALL_SITES: usize = 4096;

thread_local! {
    static CALL_SITES: std::cell::RefCell<CallSites> = std::cell::RefCell::new(CallSites::default());
}

/// `file.py:line` of the innermost Python frame outside the opbridge package: the user's call
/// that launched device work (named by its asynchronous failure later). What is learned about
/// code objects and lines is kept per thread: a launch then costs a few lookups, no formatting.
pub fn python_call_site(py: Python<'_>) -> Option<CallSite> {
    static PACKAGE: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let package = PACKAGE.get_or_init(|| {
        let file: String = py.import("opbridge").ok()?.getattr("__file__").ok()?.extract().ok()?;
        std::path::Path::new(&file).parent().map(|p| p.to_string_lossy().into_owned())
    });
    let mut frame = frames::current(py)?;
    loop {
        let code = frames::code(&frame);
        let key = code.as_ptr() as usize;
        let known = CALL_SITES.with(|sites| sites.borrow().codes.get(&key).map(|(_, file)| file.clone()));
        let file = match known {
            Some(file) => file,
            None => {
                let name: String = code.getattr("co_filename").ok()?.extract().ok()?;
                let inside = package.as_deref().is_some_and(|p| name.starts_with(p));
                let file: Option<Arc<str>> = (!inside).then(|| name.into());
                let forgotten = CALL_SITES.with(|sites| {
                    let mut sites = sites.borrow_mut();
                    // Lines are keyed by these codes too. Dropped outside the borrow: freeing a
                    // code object may run Python code (a weakref callback) that launches again.
                    let forgotten = (sites.codes.len() >= MAX_CALL_SITES).then(|| std::mem::take(&mut *sites));
                    sites.codes.insert(key, (code.unbind(), file.clone()));
                    forgotten
                });
                drop(forgotten);
                file
            }
        };
        if let Some(file) = file {
            return Some(CallSite { file, line: line_of(&frame, key) });
        }
        frame = frame.getattr("f_back").ok().filter(|f| !f.is_none())?;
    }
}

/// The line `frame` (running code object `code`, known to [`CALL_SITES`]) is at.
fn line_of(frame: &Bound<'_, PyAny>, code: usize) -> u32 {
    let lasti = frame.getattr(pyo3::intern!(frame.py(), "f_lasti")).ok().and_then(|i| i.extract::<i64>().ok());
    let Some(lasti) = lasti else { return frames::line(frame).max(0) as u32 };
    if let Some(line) = CALL_SITES.with(|sites| sites.borrow().lines.get(&(code, lasti)).copied()) {
        return line;
    }
    let line = frames::line(frame).max(0) as u32;
    CALL_SITES.with(|sites| {
        let mut sites = sites.borrow_mut();
        if sites.lines.len() >= MAX_CALL_SITES * 4 {
            sites.lines.clear();
        }
        sites.lines.insert((code, lasti), line);
    });
    line
}
