//! The running Python frame, read through CPython's C API: every device launch names its call
//! site, so finding it must cost little (`sys._getframe` and attribute lookups cost
//! microseconds; these calls cost nanoseconds).

use pyo3::prelude::*;

/// The innermost Python frame of this thread (the caller of the running native function).
pub fn current(py: Python<'_>) -> Option<Bound<'_, PyAny>> {
    // SAFETY: with the GIL held, PyEval_GetFrame returns a borrowed reference or NULL;
    // `from_borrowed_ptr_or_opt` takes its own reference.
    unsafe { Bound::from_borrowed_ptr_or_opt(py, pyo3::ffi::PyEval_GetFrame().cast()) }
}

/// The code object `frame` runs.
pub fn code<'py>(frame: &Bound<'py, PyAny>) -> Bound<'py, PyAny> {
    // SAFETY: `frame` is a live frame object (from `current` or a frame's `f_back`);
    // PyFrame_GetCode returns a new, never NULL, reference.
    unsafe { Bound::from_owned_ptr(frame.py(), pyo3::ffi::PyFrame_GetCode(frame.as_ptr().cast()).cast()) }
}

/// The line `frame` is at.
pub fn line(frame: &Bound<'_, PyAny>) -> i32 {
    // SAFETY: `frame` is a live frame object and the GIL is held.
    unsafe { pyo3::ffi::PyFrame_GetLineNumber(frame.as_ptr().cast()) }
}
