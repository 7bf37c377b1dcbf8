//! Device memory: the caching pool and the owning buffer handles it hands out.

mod buffer;
mod host;
pub(crate) mod pool;

pub use buffer::{Buffer, SubBuffer};
pub(crate) use host::{host_read, host_write, host_zero_fill};
pub use pool::{ChildPool, MemoryPool, PoolStats};

/// Every block and sub-allocation starts on this boundary (what ACL's async copies require;
/// also a cache line, so kernels on two blocks never share a line).
pub const ALIGNMENT: usize = 64;

/// Rounds `bytes` up to a multiple of `to` (a power of two); `None` on overflow.
pub(crate) fn round_up(bytes: usize, to: usize) -> Option<usize> {
    Some(bytes.checked_add(to - 1)? & !(to - 1))
}
