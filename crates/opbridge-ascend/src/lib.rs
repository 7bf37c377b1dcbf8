//! The Ascend NPU device over ACL, for opbridge's runtime. The ACL libraries are loaded at run
//! time (no CANN needed to build, import or run on a CPU machine), in cudarc's layering:
//!
//! - [`sys`]: the ACL functions, resolved with libloading, and where they are looked for;
//! - [`result`]: `aclError` codes to the runtime's typed errors, with the driver's own text;
//! - [`device`], [`stream`], [`event`], [`report`]: the runtime's `Device` trait over ACL;
//! - [`aclnn`], [`kernels`]: the built-in operators through CANN's aclnn operators;
//! - [`executors`]: aclnn executors reused by calls of the same layout;
//! - [`kernel`]: user kernels loaded from a kernel binary and launched on a stream;
//! - [`rtc`]: the runtime compiler (aclrtc): Ascend C source to a kernel binary.
//!
//! [`register`] makes `ascend:N` devices reachable through `DeviceContext::get`. Without a
//! driver, `opbridge.devices()` reports the backend unavailable with every path tried. CI runs
//! all of it against a strict test double of the ACL libraries (`double/`), chosen explicitly
//! with `OPBRIDGE_ASCEND_LIB_DIR`.

pub mod aclnn;
pub mod device;
pub mod event;
pub mod executors;
pub mod kernel;
pub mod kernels;
pub mod report;
pub mod result;
pub mod rtc;
pub mod stream;
pub mod sys;

pub use device::{AscendBackend, AscendDevice};

use std::sync::OnceLock;

/// The process's Ascend backend.
pub fn backend() -> &'static AscendBackend {
    static BACKEND: OnceLock<AscendBackend> = OnceLock::new();
    BACKEND.get_or_init(AscendBackend::default)
}

/// Registers the Ascend backend with the runtime (once; later calls do nothing).
pub fn register() {
    opbridge_runtime::backend::register(backend());
    kernels::register();
}

/// Before the process ends: waits for the Ascend devices' work, returns cached memory to the
/// driver and finalizes ACL (`aclFinalize`), whose leak report then shows only what live
/// tensors still hold. Called by the Python package at exit; nothing calls ACL afterwards.
pub fn shutdown() -> opbridge_runtime::Result<()> {
    backend().shutdown()
}
