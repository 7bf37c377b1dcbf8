//! Host reads and writes of pool blocks that live in host memory (pinned staging blocks, and
//! every block of a host-accessible device). The one place the pool's memory is touched from
//! Rust outside a kernel.
#![allow(unsafe_code)]

use super::Buffer;
use crate::error::{Error, Result};
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

/// Whether `tensor`'s memory is host memory the calling thread may touch, and the reason not.
fn check_host_bytes(tensor: &Tensor, what: &str) -> Result<()> {
    let host = match tensor.storage().as_ref() {
        crate::tensor::Storage::Pool(buffer) => buffer.pool().device.host_accessible(),
        crate::tensor::Storage::External { device, .. } => device.kind == crate::ids::DeviceKind::Cpu,
    };
    if !host {
        return Err(Error::Device {
            device: tensor.device(),
            message: format!("{what}: the tensor's memory is not host memory; copy it on a stream"),
        });
    }
    if !tensor.is_contiguous() {
        return Err(Error::Layout(format!("{what}: the tensor is not contiguous")));
    }
    // Unique storage: no other tensor (a view) can have work enqueued on these bytes.
    if std::sync::Arc::strong_count(tensor.storage()) != 1 {
        return Err(Error::Layout(format!("{what}: the tensor's memory is shared with another tensor")));
    }
    Ok(())
}

impl Tensor {
    /// Fills the whole tensor with `bytes` (row-major) from the host: a contiguous tensor in host
    /// memory (a host-accessible device's pool, or host memory borrowed from elsewhere), not
    /// sharing it with other tensors. `&mut` and unique memory mean no new work can be enqueued
    /// on it meanwhile; work enqueued before is waited for. A pool block must be allocated for
    /// `StreamId::HOST`, which the pool hands out idle (a block of a stream may still be in use
    /// by that stream's earlier work).
    pub fn write_from_host(&mut self, bytes: &[u8]) -> Result<()> {
        check_host_bytes(self, "write_from_host")?;
        if bytes.len() != self.nbytes() {
            return Err(Error::Layout(format!(
                "write_from_host: {} bytes given for a tensor of {} bytes",
                bytes.len(),
                self.nbytes()
            )));
        }
        if let crate::tensor::Storage::Pool(buffer) = self.storage().as_ref() {
            if buffer.stream() != crate::stream::StreamId::HOST {
                return Err(Error::Layout(
                    "write_from_host: the block was allocated for a stream, whose earlier work may still use it; \
                     allocate it for StreamId::HOST"
                        .into(),
                ));
            }
        }
        self.wait_idle()?;
        // SAFETY: host memory (checked) of exactly `nbytes` bytes from the first element (a
        // contiguous layout checked against its storage when the tensor was made), used by no
        // work now (waited for above) and by none later while `&mut self` is held (unique
        // storage). `bytes` is caller memory, so the ranges cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.data_ptr().0 as *mut u8, bytes.len()) };
        Ok(())
    }

    /// The tensor's bytes on the host, read in place once the work writing it is done: the
    /// returned owner keeps the tensor, so nothing can write it while the bytes are read
    /// (a response body can send them without a copy). The same conditions as
    /// [`Tensor::write_from_host`]; on failure the tensor comes back with the error.
    pub fn into_host_bytes(self) -> std::result::Result<HostBytes, Box<(Tensor, Error)>> {
        if let Err(error) = check_host_bytes(&self, "into_host_bytes").and_then(|_| self.wait_ready()) {
            return Err(Box::new((self, error)));
        }
        Ok(HostBytes { tensor: self })
    }
}

/// The bytes of a tensor in host memory, owning the tensor (see [`Tensor::into_host_bytes`]).
#[derive(Debug)]
pub struct HostBytes {
    tensor: Tensor,
}

impl HostBytes {
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }
}

impl AsRef<[u8]> for HostBytes {
    fn as_ref(&self) -> &[u8] {
        let len = self.tensor.nbytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: checked in `into_host_bytes`: host memory, contiguous (so `nbytes` bytes from
        // the first element lie in the storage), written by no pending work, and owned here
        // with unique storage, so no work can be enqueued on it while this borrow lives.
        unsafe { std::slice::from_raw_parts(self.tensor.data_ptr().0 as *const u8, len) }
    }
}
