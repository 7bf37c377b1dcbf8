//! The `Device` trait: what a backend (CPU today, CUDA and Ascend next) must provide. It is
//! shaped after the CUDA driver / ACL runtime so real accelerators fit without changes: raw
//! memory, streams that execute enqueued work in order, events, host callbacks and copies.

use std::fmt;
use std::sync::Arc;

use crate::error::{AsyncError, Result};
// The identifiers live in `ids`; re-exported so `device::{DeviceId, DeviceKind, DevicePtr}` keep
// working.
pub use crate::ids::{DeviceId, DeviceKind, DevicePtr};

/// Host work a stream runs in order: a CPU kernel, a host callback, a marker. An `Err` is the
/// stream's asynchronous error (typed: it keeps its kind and cause), reported by the next
/// synchronizing call.
pub type HostFn = Box<dyn FnOnce() -> std::result::Result<(), AsyncError> + Send + 'static>;

/// Direction of an asynchronous copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    HostToDevice,
    DeviceToHost,
    DeviceToDevice,
}

/// What a backend implements. Everything else (pool, stream manager, tensors, operators) is
/// written once against this trait.
pub trait Device: Send + Sync + fmt::Debug + 'static {
    fn id(&self) -> DeviceId;

    /// Whether host code may read and write this device's memory directly (true for the CPU
    /// device). When false, the numpy path stages through pinned host memory.
    fn host_accessible(&self) -> bool;

    /// The bytes a block for `bytes` must span on this device (`None` on overflow): the caching
    /// pool carves blocks of at least this much. The CPU needs no more than asked; ACL pads
    /// `aclrtMalloc` to `ALIGN_UP(bytes, 32) + 32` (its kernels may read the 32 bytes past the
    /// end), so the Ascend pool keeps that layout for its sub-allocations too.
    fn padded_size(&self, bytes: usize) -> Option<usize> {
        Some(bytes)
    }

    /// Allocates `bytes` of device memory, 64-byte aligned. Called by the caching pool only.
    fn allocate_raw(&self, bytes: usize) -> Result<DevicePtr>;

    /// Returns memory to the system. The pool synchronizes the device before calling it, so no
    /// enqueued work still uses the range. A failure (a vendor error code) cannot be returned
    /// to whoever dropped the memory: the pool records it and reports it at its next allocation.
    fn free_raw(&self, ptr: DevicePtr, bytes: usize) -> Result<()>;

    /// Allocates page-locked host memory for staging copies (plain host memory on the CPU).
    fn allocate_pinned(&self, bytes: usize) -> Result<DevicePtr>;

    /// Frees memory from `allocate_pinned` (failures are recorded like `free_raw`'s).
    fn free_pinned(&self, ptr: DevicePtr, bytes: usize) -> Result<()>;

    /// Creates a new stream: an ordered queue of work.
    fn create_stream(&self) -> Result<Arc<dyn StreamBackend>>;

    /// Creates an event that can be recorded on this device's streams.
    fn create_event(&self) -> Result<Arc<dyn EventBackend>>;
}

/// One stream of a device. All methods enqueue and return at once, except `synchronize`.
pub trait StreamBackend: Send + Sync + fmt::Debug {
    /// Enqueues a host kernel (a closure over host addresses). The CPU device runs it on the
    /// stream's worker; a device whose memory the host cannot touch refuses it (its kernels
    /// enqueue on [`StreamBackend::native_handle`] from the submitting thread instead).
    fn launch(&self, kernel: HostFn) -> Result<()>;

    /// Enqueues a host callback, run once all earlier work on the stream is done.
    fn launch_host_func(&self, func: HostFn) -> Result<()>;

    /// Enqueues a copy of `bytes` from `src` to `dst`.
    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize, kind: CopyKind) -> Result<()>;

    /// Enqueues a fill of `bytes` bytes from `dst` with `value`.
    fn memset(&self, dst: DevicePtr, value: u8, bytes: usize) -> Result<()>;

    /// The vendor's handle of this stream (`aclrtStream`, `CUstream`), for kernels that enqueue
    /// on it themselves; null on the CPU. Borrowed: the stream owns it, never destroy it.
    fn native_handle(&self) -> *mut std::ffi::c_void {
        std::ptr::null_mut()
    }

    /// Makes this stream's device the calling thread's current one in the vendor's API (for
    /// code that calls that API itself on [`StreamBackend::native_handle`]: a plugin's device
    /// kernel). Nothing to do on the CPU.
    fn bind_current(&self) -> Result<()> {
        Ok(())
    }

    /// Enqueues the completion of `event`.
    fn record(&self, event: &Arc<dyn EventBackend>) -> Result<()>;

    /// Makes later work on this stream wait until `event` (as last recorded) completes.
    fn wait(&self, event: &Arc<dyn EventBackend>) -> Result<()>;

    /// Blocks until all work enqueued so far is done; returns (and clears) the first
    /// asynchronous error.
    fn synchronize(&self) -> Result<()>;

    /// Blocks until all work enqueued so far is done, leaving any asynchronous error for the
    /// user's next `synchronize` (what the pool uses before releasing memory). Fails only when
    /// waiting is impossible, e.g. from work running on this very stream.
    fn drain(&self) -> Result<()>;

    /// True when all work enqueued so far is done.
    fn query(&self) -> bool;

    /// True for a stream made before a `fork()` that this process did not make: its worker is
    /// not here, so nothing queued on it will run in this process (see `crate::fork`).
    /// Device-wide waits skip such streams; using one directly raises a device error.
    fn orphaned(&self) -> bool {
        false
    }

    /// The stream's last handle is gone: nothing but the pool's event records will come (a
    /// block it used, freed later, records where the stream ends). The backend may release what
    /// serves the queue once the queued work is done (the CPU stream's worker thread exits);
    /// queries, drains and records keep working.
    fn close(&self) {}
}

/// A device event: a point in a stream's work, for ordering, waiting and timing.
pub trait EventBackend: Send + Sync + fmt::Debug {
    /// Blocks until the last recorded point is reached (at once when never recorded).
    fn synchronize(&self) -> Result<()>;
    /// True when the last recorded point is reached (or the event was never recorded).
    fn query(&self) -> bool;
    /// Milliseconds from this event to `end`; both must be recorded and complete.
    fn elapsed_ms(&self, end: &dyn EventBackend) -> Result<f64>;
    /// For backends to find their own type in `elapsed_ms`.
    fn as_any(&self) -> &dyn std::any::Any;
}
