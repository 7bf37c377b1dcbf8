//! POSIX shared-memory regions (`/dev/shm/<key>`) mapped into the server, for Triton's system
//! shared-memory extension: the only unsafe code of the server, behind a safe API.
//!
//! - [`Mapping::open`] maps a client's file once (shared, read-write), after checking that the
//!   file holds the bytes asked for; [`Mapping::check`] re-checks before each use.
//! - A client may still truncate its file while a kernel reads or writes the mapping: touching
//!   a page past the new end raises SIGBUS. [`install_sigbus_guard`] installs a process-wide
//!   handler that, for a fault inside a live mapping, maps a private zero page over the faulting
//!   page (the instruction then retries harmlessly) and marks the mapping
//!   [`damaged`](Mapping::damaged); faults elsewhere go to the previous handler. The handler
//!   reads a fixed table of atomics: no lock, no allocation.

use std::fmt;

/// Mappings that may be live at once (the guard's table is fixed-size, for the signal handler).
pub const MAX_MAPPINGS: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShmError {
    /// A key that is not one plain name in `/dev/shm`.
    #[error("invalid shared memory key '{0}': expected '/name' with no further '/', not '.' or '..'")]
    BadKey(String),
    #[error("cannot open shared memory key '{key}': {message}")]
    Open { key: String, message: String },
    /// The file is shorter than the bytes the region covers (at registration, or truncated since).
    #[error("shared memory key '{key}' holds {file} bytes, fewer than the {need} bytes of the region")]
    TooSmall { key: String, file: u64, need: usize },
    /// A page of the mapping vanished under a read or write: the file was truncated meanwhile.
    #[error("shared memory key '{key}' was truncated while in use")]
    Damaged { key: String },
    #[error("cannot map shared memory key '{key}': {message}")]
    Map { key: String, message: String },
    #[error("too many shared memory regions are mapped (at most {MAX_MAPPINGS})")]
    Full,
    /// Bytes outside the mapping were asked for.
    #[error("bytes {offset}..+{len} are outside the {mapped} mapped bytes")]
    OutOfBounds { offset: usize, len: usize, mapped: usize },
    #[error("system shared memory is not supported on this operating system")]
    Unsupported,
}

/// The file name under `/dev/shm` of a POSIX shared-memory key (`shm_open`'s rules, stricter:
/// exactly one leading '/' allowed, none after, so no path escapes the folder).
pub fn file_name(key: &str) -> Result<&str, ShmError> {
    let name = key.strip_prefix('/').unwrap_or(key);
    if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
        return Err(ShmError::BadKey(key.escape_debug().to_string()));
    }
    Ok(name)
}

#[cfg(target_os = "linux")]
mod linux;
#[cfg(target_os = "linux")]
pub use linux::{install_sigbus_guard, Mapping};

#[cfg(not(target_os = "linux"))]
mod unsupported;
#[cfg(not(target_os = "linux"))]
pub use unsupported::{install_sigbus_guard, Mapping};

impl fmt::Debug for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mapping").field("addr", &self.addr()).field("len", &self.len()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_one_file_in_the_folder() {
        assert_eq!(file_name("/input0"), Ok("input0"));
        assert_eq!(file_name("input0"), Ok("input0"));
        for bad in ["", "/", "/.", "/..", "../etc/passwd", "/a/b", "//a", "/a\0b"] {
            assert!(matches!(file_name(bad), Err(ShmError::BadKey(_))), "{bad:?}");
        }
    }
}
