//! Device memory: the caching pool and the owning buffer handles it hands out.

mod buffer;
pub(crate) mod host;
pub(crate) mod pool;

pub use buffer::{Buffer, SubBuffer};
pub use host::HostBytes;
pub(crate) use host::{host_read, host_write, host_zero_fill};
pub use pool::{BlockSnapshot, BlockState, ChildPool, MemoryPool, PoolStats, SegmentSnapshot};

use crate::device::DeviceId;
use crate::error::Result;
use crate::stream::StreamId;

/// Where a call's memory comes from: a device's caching pool, or a child pool whose byte quota
/// covers everything allocated through it (a server session's outputs and workspaces). Whoever
/// launches work takes one of these instead of reaching for the device pool itself.
pub trait Allocate: Send + Sync + std::fmt::Debug {
    /// The device the memory is on.
    fn device(&self) -> DeviceId;

    /// `bytes` for work on `stream` (`StreamId::HOST` for synchronous host use), 64-byte aligned.
    fn allocate(&self, bytes: usize, stream: StreamId) -> Result<Buffer>;
}

impl Allocate for std::sync::Arc<MemoryPool> {
    fn device(&self) -> DeviceId {
        self.device_id()
    }

    fn allocate(&self, bytes: usize, stream: StreamId) -> Result<Buffer> {
        MemoryPool::allocate(self, bytes, stream)
    }
}

impl Allocate for ChildPool {
    fn device(&self) -> DeviceId {
        self.parent().device_id()
    }

    fn allocate(&self, bytes: usize, stream: StreamId) -> Result<Buffer> {
        ChildPool::allocate(self, bytes, stream)
    }
}

/// Every block and sub-allocation starts on this boundary (what ACL's async copies require;
/// also a cache line, so kernels on two blocks never share a line).
pub const ALIGNMENT: usize = 64;

/// Rounds `bytes` up to a multiple of `to` (a power of two); `None` on overflow.
pub(crate) fn round_up(bytes: usize, to: usize) -> Option<usize> {
    Some(bytes.checked_add(to - 1)? & !(to - 1))
}
