//! The operator layer's error type: argument problems found before launch, kernel refusals and
//! runtime errors, each with the [`ErrorKind`] that front ends map once.

use std::sync::Arc;

use opbridge_runtime::DType;
pub use opbridge_runtime::ErrorKind;

use crate::cpu::KernelError;

/// An operator's name inside an error: shared, so a plugin's names need no `'static` copy.
pub type OpName = Arc<str>;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpError {
    /// Shapes that the operator cannot combine.
    #[error("{op}: expected {expected}, got {got}")]
    Shape { op: OpName, expected: String, got: String },
    /// A dtype the operator does not support, or a mismatch with `out=`.
    #[error("{op}: expected {expected}, got {got}")]
    DType { op: OpName, expected: String, got: String },
    /// Tensors on different devices, or a device the operator has no kernel for.
    #[error("{op}: {message}")]
    Device { op: OpName, message: String },
    /// An `out=` that is invalid for the call (read-only, partially overlapping an input...).
    #[error("{op}: {message}")]
    Argument { op: OpName, message: String },
    /// No operator of this name; lists the registered names.
    #[error("unknown operator {name:?}; available: {available}")]
    UnknownOperator { name: String, available: String },
    /// The operator exists but not at this version.
    #[error("operator {name:?} has no version {version}; available versions: {available}")]
    UnknownVersion { name: String, version: u32, available: String },
    #[error("operator {name:?} version {version} is already registered (from {existing})")]
    DuplicateOperator { name: String, version: u32, existing: String },
    #[error("invalid operator {name:?}: {message}")]
    InvalidOperator { name: String, message: String },
    /// `known` lists the attribute names (empty: the operator takes none).
    #[error(
        "{op}: unexpected argument {name:?}; {}",
        if known.is_empty() { "it takes no arguments besides its inputs (and out=)".to_string() } else { format!("it takes: {known}") }
    )]
    UnknownAttribute { op: String, name: String, known: String },
    #[error("{op}: missing required argument {name:?}")]
    MissingAttribute { op: String, name: String },
    /// An attribute of the wrong kind (a string where an int is expected...).
    #[error("{op}: {message}")]
    InvalidAttribute { op: String, message: String },
    /// An operator's own code failed: a plugin kernel's failure status, a panic, a workspace
    /// that cannot be allocated, a broken operator contract.
    #[error("{op}: {message}")]
    Kernel { op: OpName, message: String },
    /// A built-in CPU kernel refused its input (an index out of range, a negative integer
    /// power...); classified by [`KernelError::kind`].
    #[error("{op}: {error}")]
    CpuKernel { op: OpName, error: KernelError },
    /// A call's scratch memory that cannot be allocated (over a pool's limit, more than the
    /// address space or the system's memory); `reason` says which.
    #[error("{op}: out of memory: cannot allocate a workspace of {bytes} bytes ({reason})")]
    Workspace { op: OpName, bytes: usize, reason: String },
    #[error(transparent)]
    Runtime(#[from] opbridge_runtime::Error),
    /// An operator library that cannot be loaded (not a plugin, wrong ABI, malformed descriptor)
    /// or closed; nothing of it stays registered.
    #[error("operator library {path}: {message}")]
    Plugin { path: String, message: String },
    /// A call through an operator whose library has been unloaded since it was looked up.
    #[error("operator {name:?} version {version} was unloaded with its library {path}; look it up again")]
    Unloaded { name: String, version: u32, path: String },
}

impl OpError {
    /// `error` of a CPU kernel, reported for the operator `op`.
    pub fn cpu_kernel(op: &str, error: KernelError) -> OpError {
        OpError::CpuKernel { op: op.into(), error }
    }

    pub fn unsupported_dtype(op: &str, supported: &[DType], got: impl ToString) -> OpError {
        let names: Vec<&str> = supported.iter().map(|d| d.name()).collect();
        OpError::DType { op: op.into(), expected: format!("one of {}", names.join(", ")), got: got.to_string() }
    }

    /// The classification front ends map: Python to its exception classes, the server to HTTP
    /// and gRPC codes, the plugin SDK to its statuses.
    pub fn kind(&self) -> ErrorKind {
        match self {
            OpError::Shape { .. } => ErrorKind::Shape,
            OpError::DType { .. } => ErrorKind::DType,
            OpError::Device { .. } => ErrorKind::Device,
            OpError::CpuKernel { error, .. } => error.kind(),
            OpError::Workspace { .. } => ErrorKind::OutOfMemory,
            OpError::Argument { .. }
            | OpError::Kernel { .. }
            | OpError::UnknownAttribute { .. }
            | OpError::MissingAttribute { .. }
            | OpError::InvalidAttribute { .. }
            | OpError::DuplicateOperator { .. }
            | OpError::InvalidOperator { .. }
            | OpError::Plugin { .. } => ErrorKind::Argument,
            // An unloaded version is gone from the registry: the caller looks it up again.
            OpError::UnknownOperator { .. } | OpError::UnknownVersion { .. } | OpError::Unloaded { .. } => {
                ErrorKind::NotFound
            }
            OpError::Runtime(error) => error.kind(),
        }
    }

    /// The same error as the failure of stream work: it keeps its kind and stays reachable as
    /// the cause, so a front end reports it as the class it would have been before launch.
    pub fn into_async(self) -> opbridge_runtime::AsyncError {
        match self {
            // Already an async failure (a nested launch): keep it as it is.
            OpError::Runtime(opbridge_runtime::Error::Async { error, .. }) => error,
            other => opbridge_runtime::AsyncError::from_error(other.kind(), other),
        }
    }

    /// The operator error a stream failure stands for, when it was one.
    pub fn from_async(error: &opbridge_runtime::AsyncError) -> Option<&OpError> {
        error.cause().and_then(|cause| cause.downcast_ref::<OpError>())
    }
}

pub type Result<T, E = OpError> = std::result::Result<T, E>;
