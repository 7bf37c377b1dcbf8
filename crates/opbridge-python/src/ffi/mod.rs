//! The binding's foreign interfaces: numpy's C API, DLPack and CPython's vectorcall. All
//! `unsafe` of the bindings lives here, behind safe functions.
#![allow(unsafe_code)]

pub mod dlpack;
pub mod frames;
pub mod numpy;
pub mod vectorcall;

/// Whether the interpreter is still running: host functions queued on a stream may come due
/// while Python is shutting down, when attaching to it is no longer allowed.
pub fn interpreter_alive() -> bool {
    // SAFETY: Py_IsInitialized may be called at any time, from any thread, without the GIL.
    unsafe { pyo3::ffi::Py_IsInitialized() != 0 }
}
