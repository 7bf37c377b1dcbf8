//! Host reads and writes of pool blocks that live in host memory (pinned staging blocks, and
//! every block of a host-accessible device). The one place the pool's memory is touched from
//! Rust outside a kernel.
#![allow(unsafe_code)]

use super::Buffer;
use crate::error::Result;
use crate::stream::Stream;
use crate::tensor::Tensor;

/// Copies `bytes` into the start of `buffer`.
///
/// Callers pass only blocks of host memory (pinned pools, host-accessible devices), and order
/// the write after stream work on the block (the pipeline waits on the slot's event first).
pub(crate) fn host_write(buffer: &Buffer, bytes: &[u8]) {
    assert!(bytes.len() <= buffer.len(), "host_write past the end of a block");
    // SAFETY: the block is host memory of at least `bytes.len()` bytes (checked above), owned
    // by `buffer` for the duration of the call, and no stream work touches it now (caller's
    // ordering). Source and destination cannot overlap: `bytes` is caller memory.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buffer.ptr().0 as *mut u8, bytes.len()) }
}

/// Copies the start of `buffer` into `out`.
pub(crate) fn host_read(buffer: &Buffer, out: &mut [u8]) {
    assert!(out.len() <= buffer.len(), "host_read past the end of a block");
    // SAFETY: as for `host_write`, with the roles of the two ranges swapped.
    unsafe { std::ptr::copy_nonoverlapping(buffer.ptr().0 as *const u8, out.as_mut_ptr(), out.len()) }
}

/// Enqueues on `stream` a write of zero bytes over `tensor`'s `nbytes()` bytes from its first
/// element, ordered like any kernel writing it ([`Tensor::fill_zeros`] checks the tensor is
/// contiguous and in host-accessible memory first).
pub(crate) fn host_zero_fill(stream: &Stream, tensor: &Tensor) -> Result<()> {
    let (ptr, bytes) = (tensor.data_ptr().0, tensor.nbytes());
    Tensor::launch(
        stream,
        &[],
        &[tensor],
        Box::new(move || {
            // SAFETY: a contiguous tensor in host memory spans exactly `bytes` bytes from `ptr`
            // (its layout was checked against its storage when it was made). The memory stays
            // valid until this work has run: `launch` holds borrowed storage, and a pool block
            // is reused only in stream order.
            unsafe { std::ptr::write_bytes(ptr as *mut u8, 0, bytes) };
            Ok(())
        }),
    )
}
