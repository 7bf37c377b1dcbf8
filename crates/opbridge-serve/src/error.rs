//! The server's one error type and its mapping to HTTP statuses and gRPC codes (Triton's).

use opbridge_ops::{ErrorKind, OpError};

/// What went wrong, as the protocol classifies it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// A client mistake: 400 / INVALID_ARGUMENT.
    InvalidArgument,
    /// An unknown model, version or path: 404 / NOT_FOUND.
    NotFound,
    /// Known but not serving now (unloading, not loaded, queue full): 503 / UNAVAILABLE.
    Unavailable,
    /// A request over a size limit: 400 / RESOURCE_EXHAUSTED.
    TooLarge,
    /// The device or a pool is out of memory: 503 / RESOURCE_EXHAUSTED.
    OutOfMemory,
    /// A session's memory quota would be exceeded: 429 / RESOURCE_EXHAUSTED (the standard
    /// gRPC-to-HTTP mapping; Triton has no quota code). The session stays usable.
    QuotaExceeded,
    /// Not supported by this server: 501 / UNIMPLEMENTED.
    Unimplemented,
    /// A body in an encoding we cannot read (`Content-Encoding: br`): 415 / UNIMPLEMENTED
    /// (gRPC's code for an unsupported compression, from its compression spec).
    UnsupportedMediaType,
    /// A missing or wrong token: 401 / UNAUTHENTICATED.
    Unauthenticated,
    /// Something of that name exists already (a shared-memory region): 400 / ALREADY_EXISTS,
    /// as Triton maps it.
    AlreadyExists,
    /// Our own bug or a device failure: 500 / INTERNAL.
    Internal,
}

/// An error answered to a client: a code and a message (the `{"error": ...}` body).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ServeError {
    pub code: Code,
    pub message: String,
}

impl ServeError {
    pub fn new(code: Code, message: impl Into<String>) -> ServeError {
        ServeError { code, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> ServeError {
        ServeError::new(Code::InvalidArgument, message)
    }

    pub fn not_found(message: impl Into<String>) -> ServeError {
        ServeError::new(Code::NotFound, message)
    }

    pub fn unavailable(message: impl Into<String>) -> ServeError {
        ServeError::new(Code::Unavailable, message)
    }

    pub fn internal(message: impl Into<String>) -> ServeError {
        ServeError::new(Code::Internal, message)
    }

    pub fn http_status(&self) -> u16 {
        match self.code {
            Code::InvalidArgument | Code::TooLarge | Code::AlreadyExists => 400,
            Code::NotFound => 404,
            Code::Unavailable | Code::OutOfMemory => 503,
            Code::QuotaExceeded => 429,
            Code::Unimplemented => 501,
            Code::UnsupportedMediaType => 415,
            Code::Unauthenticated => 401,
            Code::Internal => 500,
        }
    }

    pub fn grpc_code(&self) -> tonic::Code {
        match self.code {
            Code::InvalidArgument => tonic::Code::InvalidArgument,
            Code::AlreadyExists => tonic::Code::AlreadyExists,
            Code::NotFound => tonic::Code::NotFound,
            Code::Unavailable => tonic::Code::Unavailable,
            Code::TooLarge | Code::OutOfMemory | Code::QuotaExceeded => tonic::Code::ResourceExhausted,
            Code::Unimplemented | Code::UnsupportedMediaType => tonic::Code::Unimplemented,
            Code::Unauthenticated => tonic::Code::Unauthenticated,
            Code::Internal => tonic::Code::Internal,
        }
    }

    /// The label of `opbridge_requests_rejected_total{code}`: the HTTP status, whatever the
    /// protocol (one vocabulary for dashboards).
    pub fn label(&self) -> &'static str {
        match self.http_status() {
            400 => "400",
            401 => "401",
            404 => "404",
            415 => "415",
            429 => "429",
            501 => "501",
            503 => "503",
            _ => "500",
        }
    }
}

/// The one mapping from the dispatch layer's error kinds: what the client caused is 4xx, only
/// our bugs and device failures are 500.
fn code_of(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::Shape | ErrorKind::DType | ErrorKind::Argument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::OutOfMemory => Code::OutOfMemory,
        ErrorKind::Device | ErrorKind::Internal => Code::Internal,
    }
}

impl From<OpError> for ServeError {
    fn from(error: OpError) -> ServeError {
        // A kernel's failure surfaces at the stream's synchronization wrapped in the stream's
        // name; the client gets the kernel's own message, classed by the kernel's kind.
        if let OpError::Runtime(opbridge_runtime::Error::Async { error, .. }) = &error {
            return ServeError::new(code_of(error.kind()), error.message());
        }
        ServeError::new(code_of(error.kind()), error.to_string())
    }
}

impl From<opbridge_runtime::Error> for ServeError {
    fn from(error: opbridge_runtime::Error) -> ServeError {
        ServeError::from(OpError::from(error))
    }
}

impl From<ServeError> for tonic::Status {
    fn from(error: ServeError) -> tonic::Status {
        tonic::Status::new(error.grpc_code(), error.message)
    }
}

pub type Result<T, E = ServeError> = std::result::Result<T, E>;
