//! Raw host memory for the CPU device: the one place the runtime calls the system allocator.
#![allow(unsafe_code)]

use std::alloc::{self, Layout};

use crate::error::{Error, Result};
use crate::ids::{DeviceId, DevicePtr};
use crate::memory::ALIGNMENT;

fn layout(bytes: usize) -> Option<Layout> {
    Layout::from_size_align(bytes.max(1), ALIGNMENT).ok()
}

pub(super) fn allocate(bytes: usize) -> Result<DevicePtr> {
    let oom = || Error::OutOfMemory {
        device: DeviceId::CPU,
        requested: bytes,
        limit: None,
        allocated: 0,
        cached: 0,
        quota: false,
    };
    let layout = layout(bytes).ok_or_else(oom)?;
    // SAFETY: `layout` has a non-zero size (`max(1)` above) and a power-of-two alignment.
    let ptr = unsafe { alloc::alloc(layout) };
    if ptr.is_null() {
        return Err(oom());
    }
    advise_huge_pages(ptr as usize, bytes);
    Ok(DevicePtr(ptr as usize))
}

/// Segments at least this large ask for transparent huge pages, as numpy does for its arrays:
/// a stream over tens of megabytes in 4 KiB pages spends a measurable share of its time in TLB
/// misses (the kernel's default THP mode is `madvise` on many distributions).
const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

/// `madvise(MADV_HUGEPAGE)` over the 2 MiB-aligned interior of `[start, start + bytes)`; a
/// hint, whose failure (no THP support) changes nothing.
fn advise_huge_pages(start: usize, bytes: usize) {
    #[cfg(target_os = "linux")]
    if bytes >= HUGE_PAGE_MIN_BYTES {
        const HUGE: usize = 2 << 20;
        let (begin, end) = (start.next_multiple_of(HUGE), (start + bytes) / HUGE * HUGE);
        if end > begin {
            // SAFETY: the range lies inside the allocation just made (owned by the caller); the
            // advice changes how pages are backed, never their contents.
            unsafe { libc::madvise(begin as *mut libc::c_void, end - begin, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, bytes);
}

pub(super) fn free(ptr: DevicePtr, bytes: usize) {
    let Some(layout) = layout(bytes) else { return };
    // SAFETY: the pool frees each segment exactly once, with the size it was allocated with,
    // after synchronizing every stream that could still touch it.
    unsafe { alloc::dealloc(ptr.0 as *mut u8, layout) }
}

/// Copies `bytes` between two ranges of host memory that the caller keeps alive.
pub(super) fn copy(dst: DevicePtr, src: DevicePtr, bytes: usize) {
    if bytes == 0 {
        return;
    }
    // SAFETY: stream semantics: the ranges belong to live pool blocks or caller-owned buffers
    // for as long as the copy is enqueued (the pool does not hand a block to other work until
    // the streams that used it have passed this point). `copy` (memmove) tolerates overlap.
    unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, bytes) }
}

/// Fills `bytes` bytes from `dst` with `value`, in stream order.
pub(super) fn fill(dst: DevicePtr, value: u8, bytes: usize) {
    if bytes == 0 {
        return;
    }
    // SAFETY: as for `copy`: the range belongs to a live pool block (or caller-owned memory)
    // until the stream has passed this point.
    unsafe { std::ptr::write_bytes(dst.0 as *mut u8, value, bytes) }
}
