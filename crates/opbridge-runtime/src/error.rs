//! The runtime's one error type. Variants carry structured fields so the bindings can build
//! precise messages and typed exceptions without parsing strings.

use crate::ids::DeviceKind;

/// Everything the runtime can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The pool could not satisfy a request even after releasing its cache.
    #[error(
        "out of memory on {device}: tried to allocate {requested} bytes \
         (limit {limit}, {allocated} bytes allocated, {cached} bytes cached){quota_note}",
        limit = fmt_limit(*limit),
        quota_note = if *quota { " [child pool quota]" } else { "" }
    )]
    OutOfMemory {
        device: String,
        requested: usize,
        /// `None` means "no limit set", i.e. bounded only by the system.
        limit: Option<usize>,
        allocated: usize,
        cached: usize,
        /// True when the failing limit is a child pool's quota, not the device limit.
        quota: bool,
    },
    /// A device operation failed (bad argument, lost device, vendor error code).
    #[error("{device}: {message}")]
    Device { device: String, message: String },
    /// Work enqueued on a stream failed; reported at the next synchronizing call.
    #[error("asynchronous error on {stream}: {message}")]
    Async { stream: String, message: String },
    /// An argument mixes devices, e.g. a tensor of cuda:0 with a stream of cpu:0.
    #[error("expected a tensor on {expected:?}, got one on {got:?}")]
    WrongDevice { expected: DeviceKind, got: DeviceKind },
    /// A tensor layout is invalid (size overflow, negative stride, out of its buffer).
    #[error("invalid layout: {0}")]
    Layout(String),
}

fn fmt_limit(limit: Option<usize>) -> String {
    limit.map_or_else(|| "none".to_string(), |b| b.to_string())
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
