//! The operator layer's error type: argument problems found before launch, or runtime errors.

use opbridge_runtime::DType;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OpError {
    /// Shapes that the operator cannot combine.
    #[error("{op}: expected {expected}, got {got}")]
    Shape { op: &'static str, expected: String, got: String },
    /// A dtype the operator does not support, or a mismatch with `out=`.
    #[error("{op}: expected {expected}, got {got}")]
    DType { op: &'static str, expected: String, got: String },
    /// Tensors on different devices, or a device the operator has no kernel for.
    #[error("{op}: {message}")]
    Device { op: &'static str, message: String },
    /// An `out=` that is invalid for the call (read-only, partially overlapping an input...).
    #[error("{op}: {message}")]
    Argument { op: &'static str, message: String },
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
    #[error("{op}: unexpected argument {name:?}; it takes: {known}")]
    UnknownAttribute { op: String, name: String, known: String },
    #[error("{op}: missing required argument {name:?}")]
    MissingAttribute { op: String, name: String },
    /// An attribute of the wrong kind (a string where an int is expected...).
    #[error("{op}: {message}")]
    InvalidAttribute { op: String, message: String },
    /// A kernel refused its input (an index out of range, a negative integer power...).
    #[error("{op}: {message}")]
    Kernel { op: String, message: String },
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
    pub fn unsupported_dtype(op: &'static str, supported: &[DType], got: impl ToString) -> OpError {
        let names: Vec<&str> = supported.iter().map(|d| d.name()).collect();
        OpError::DType { op, expected: format!("one of {}", names.join(", ")), got: got.to_string() }
    }
}

pub type Result<T, E = OpError> = std::result::Result<T, E>;
