//! The binding's foreign interfaces: numpy's C API and DLPack. All `unsafe` of the bindings
//! lives here, behind safe functions.
#![allow(unsafe_code)]

pub mod dlpack;
pub mod frames;
pub mod numpy;

/// Whether the interpreter is still running: host functions queued on a stream may come due
/// while Python is shutting down, when attaching to it is no longer allowed.
pub fn interpreter_alive() -> bool {
    // SAFETY: Py_IsInitialized may be called at any time, from any thread, without the GIL.
    unsafe { pyo3::ffi::Py_IsInitialized() != 0 }
}
