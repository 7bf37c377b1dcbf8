//! Owning handles to pool memory. Dropping one returns its block to the pool; nothing here can
//! be cloned infallibly (device memory is never `Clone`).

use std::fmt;
use std::sync::{Arc, Mutex};

use super::pool::{MemoryPool, Quota};
use crate::ids::DevicePtr;
use crate::stream::{Stream, StreamId, StreamUse};

/// A block of pool memory owned by one tensor (or one numpy array on the convenience path).
pub struct Buffer {
    pub(super) pool: Arc<MemoryPool>,
    pub(super) ptr: DevicePtr,
    /// Bytes the caller asked for.
    pub(super) len: usize,
    /// The stream the block was allocated for: work on it is ordered with any later reuse.
    pub(super) stream: StreamId,
    /// Other streams that used the block; its reuse waits for them (no manual record_stream).
    /// Weak: a long-lived block must not keep a dropped stream (and its worker) alive.
    pub(super) used_on: Mutex<Vec<StreamUse>>,
    /// The child pool whose quota this block counts against.
    pub(super) quota: Option<Arc<Quota>>,
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Buffer({:#x}, {} bytes, stream {})", self.ptr.0, self.len, self.stream.0)
    }
}

impl Buffer {
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Bytes requested (the block itself may be larger).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn stream(&self) -> StreamId {
        self.stream
    }

    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }

    /// Notes that work enqueued on `stream` uses this block. Called by every launch, so the
    /// pool can delay reuse until that work is done.
    pub fn record_use(&self, stream: &Stream) {
        if stream.id() == self.stream {
            return;
        }
        let mut used = self.used_on.lock().unwrap_or_else(|p| p.into_inner());
        if !used.iter().any(|u| u.id() == stream.id()) {
            // Streams that are gone with all their work done need no event any more.
            used.retain(StreamUse::may_be_busy);
            used.push(stream.usage());
        }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let used_on = std::mem::take(self.used_on.get_mut().unwrap_or_else(|p| p.into_inner()));
        self.pool.release(self.ptr, used_on);
        if let Some(quota) = &self.quota {
            quota.give_back(self.pool.block_size(self.len));
        }
    }
}

/// A 64-byte-aligned slice of a shared block, from `allocate_many`. The block returns to the
/// pool when the last sub-buffer is dropped.
#[derive(Debug, Clone)]
pub struct SubBuffer {
    pub(super) block: Arc<Buffer>,
    pub(super) offset: usize,
    pub(super) len: usize,
}

impl SubBuffer {
    pub fn ptr(&self) -> DevicePtr {
        self.block.ptr.offset(self.offset)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shared block, e.g. for `record_use`.
    pub fn block(&self) -> &Arc<Buffer> {
        &self.block
    }
}
