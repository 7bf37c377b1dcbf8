//! The runtime's one error type, and the one classification of errors every front end maps.
//! Variants carry structured fields so the bindings and the server can build precise messages
//! and typed answers without parsing strings.

use std::fmt;
use std::sync::Arc;

use crate::ids::{DeviceId, DeviceKind};

/// What kind of failure an error is: the classification every front end maps once (Python to
/// its exception classes, the server to HTTP and gRPC codes, the plugin SDK to its statuses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Shapes that cannot be combined, or an output of the wrong shape.
    Shape,
    /// A dtype that is not supported, or an output of the wrong dtype.
    DType,
    /// Any other invalid argument: a value out of range, a read-only or overlapping output, an
    /// unknown attribute, a malformed operator library.
    Argument,
    /// No such operator or version.
    NotFound,
    /// The thing exists but cannot serve now (an unloaded library, a device without a driver).
    Unavailable,
    /// A pool limit, a quota or the device's memory is exhausted.
    OutOfMemory,
    /// A device, stream or event failed, or the arguments mix devices.
    Device,
    /// A bug: a panic, a broken invariant.
    Internal,
}

impl ErrorKind {
    pub const fn name(self) -> &'static str {
        match self {
            ErrorKind::Shape => "shape",
            ErrorKind::DType => "dtype",
            ErrorKind::Argument => "argument",
            ErrorKind::NotFound => "not found",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::OutOfMemory => "out of memory",
            ErrorKind::Device => "device",
            ErrorKind::Internal => "internal",
        }
    }
}

/// The failure of work that ran on a stream, reported later (at the next synchronizing call, or
/// by a host read of what it wrote). It keeps its kind and its typed cause, so the same mistake
/// is the same class of error whether it was found before launch or while the work ran.
#[derive(Clone)]
pub struct AsyncError {
    kind: ErrorKind,
    message: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl AsyncError {
    /// A failure described by a message alone (a host function that failed, a panic).
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> AsyncError {
        AsyncError { kind, message: message.into(), source: None }
    }

    /// A typed failure: its text is the message, and the error itself stays reachable as the
    /// cause (`source`), for front ends that downcast it.
    pub fn from_error<E: std::error::Error + Send + Sync + 'static>(kind: ErrorKind, error: E) -> AsyncError {
        AsyncError { kind, message: error.to_string(), source: Some(Arc::new(error)) }
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    /// The typed error the work failed with, when it had one.
    pub fn cause(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.source.as_deref()
    }
}

impl fmt::Debug for AsyncError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncError")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .field("typed", &self.source.is_some())
            .finish()
    }
}

impl fmt::Display for AsyncError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for AsyncError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Two async errors are equal when they say the same (the cause is not comparable).
impl PartialEq for AsyncError {
    fn eq(&self, other: &AsyncError) -> bool {
        self.kind == other.kind && self.message == other.message
    }
}

impl Eq for AsyncError {}

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
        device: DeviceId,
        requested: usize,
        /// `None` means "no limit set", i.e. bounded only by the system.
        limit: Option<usize>,
        allocated: usize,
        cached: usize,
        /// True when the failing limit is a child pool's quota, not the device limit.
        quota: bool,
    },
    /// A device operation failed (bad argument, lost device, a worker that cannot start).
    #[error("{device}: {message}")]
    Device { device: DeviceId, message: String },
    /// A vendor API returned an error code (ACL, CUDA): which device, which call, which code,
    /// and the vendor's own text.
    #[error("{device}: {api} failed with error {code}: {message}")]
    Driver { device: DeviceId, api: &'static str, code: i32, message: String },
    /// A device that this build or this machine cannot serve (no driver, no such ordinal).
    #[error("{device}: device not available: {reason}")]
    Unavailable { device: DeviceId, reason: String },
    /// Work enqueued on a stream failed; reported at the next synchronizing call.
    #[error("asynchronous error on {stream}: {error}")]
    Async { stream: String, error: AsyncError },
    /// An argument mixes devices, e.g. a tensor of cuda:0 with a stream of cpu:0.
    #[error("expected a tensor on {expected:?}, got one on {got:?}")]
    WrongDevice { expected: DeviceKind, got: DeviceKind },
    /// A tensor layout is invalid (size overflow, negative stride, out of its buffer).
    #[error("invalid layout: {0}")]
    Layout(String),
}

impl Error {
    /// The classification front ends map (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::OutOfMemory { .. } => ErrorKind::OutOfMemory,
            Error::Device { .. } | Error::Driver { .. } | Error::WrongDevice { .. } => ErrorKind::Device,
            Error::Unavailable { .. } => ErrorKind::Unavailable,
            Error::Async { error, .. } => error.kind(),
            Error::Layout(_) => ErrorKind::Shape,
        }
    }
}

fn fmt_limit(limit: Option<usize>) -> String {
    limit.map_or_else(|| "none".to_string(), |b| b.to_string())
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
