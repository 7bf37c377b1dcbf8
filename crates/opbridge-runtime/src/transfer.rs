//! Copies between host memory and tensors of any device, and between devices. Where the
//! device's memory is not host memory (an accelerator), the host side goes through a block of
//! the device's pinned pool: asynchronous copies need page-locked memory on every accelerator
//! (CANN turns a copy from pageable memory into a full stream synchronization; its strict test
//! double refuses it).

use crate::device::CopyKind;
use crate::error::{Error, Result};
use crate::ids::DevicePtr;
use crate::memory::host::{host_read, host_write};
use crate::stream::{Stream, StreamId};
use crate::tensor::Tensor;
use crate::DeviceContext;

impl Tensor {
    /// Fills this contiguous tensor with `bytes` (row-major, exactly `nbytes()` of them) by a
    /// host-to-device copy on `stream`, ordered after earlier work on the tensor, and waits for
    /// it: `bytes` may change as soon as this returns (`cudaMemcpy` semantics).
    pub fn upload(&self, stream: &Stream, bytes: &[u8]) -> Result<()> {
        self.check_transfer("upload", bytes.len(), stream)?;
        if bytes.is_empty() {
            return Ok(());
        }
        let (dst, len) = (self.data_ptr(), bytes.len());
        let ctx = DeviceContext::get(self.device())?;
        if ctx.device().host_accessible() {
            let src = DevicePtr(bytes.as_ptr() as usize);
            let done = Tensor::enqueue_event(stream, &[], &[self], |s| s.copy(dst, src, len, CopyKind::HostToDevice))?;
            return done.synchronize();
        }
        // Idle when handed out (allocated for the host), written here, then used by the copy.
        let staging = ctx.pinned_pool().allocate(len, StreamId::HOST)?;
        host_write(&staging, bytes);
        staging.record_use(stream);
        let src = staging.ptr();
        let done = Tensor::enqueue_event(stream, &[], &[self], |s| s.copy(dst, src, len, CopyKind::HostToDevice))?;
        done.synchronize()
    }

    /// Copies this contiguous tensor into `out` (exactly `nbytes()` bytes) by a device-to-host
    /// copy on `stream` after the work that writes it, and synchronizes `stream`: a failure of
    /// earlier work on it (a failed kernel) is reported here instead of stale bytes.
    pub fn download(&self, stream: &Stream, out: &mut [u8]) -> Result<()> {
        self.check_transfer("download", out.len(), stream)?;
        if out.is_empty() {
            return Ok(());
        }
        let (src, len) = (self.data_ptr(), out.len());
        let ctx = DeviceContext::get(self.device())?;
        if ctx.device().host_accessible() {
            let dst = DevicePtr(out.as_mut_ptr() as usize);
            Tensor::enqueue_event(stream, &[self], &[], |s| s.copy(dst, src, len, CopyKind::DeviceToHost))?;
            return stream.synchronize();
        }
        // A failure of the device work that wrote the tensor is reported, not its leftovers.
        self.wait_ready()?;
        let staging = ctx.pinned_pool().allocate(len, StreamId::HOST)?;
        staging.record_use(stream);
        let dst = staging.ptr();
        Tensor::enqueue_event(stream, &[self], &[], |s| s.copy(dst, src, len, CopyKind::DeviceToHost))?;
        stream.synchronize()?;
        host_read(&staging, out);
        Ok(())
    }

    /// A contiguous copy of this tensor on `target` (another device), made with the current
    /// streams of both devices; waits until the copy is done.
    pub fn to_device(&self, target: &DeviceContext) -> Result<Tensor> {
        let source = DeviceContext::get(self.device())?;
        if !self.is_contiguous() {
            return Err(Error::Layout(format!(
                "to({}): the tensor is not contiguous (shape {:?}, strides {:?}); make it contiguous first",
                target.id(),
                self.shape(),
                self.strides()
            )));
        }
        let mut bytes = vec![0u8; self.nbytes()];
        self.download(&source.current_stream()?, &mut bytes)?;
        let stream = target.current_stream()?;
        let copy = Tensor::empty(target, self.shape(), self.dtype(), stream.id())?;
        copy.upload(&stream, &bytes)?;
        Ok(copy)
    }

    fn check_transfer(&self, what: &str, len: usize, stream: &Stream) -> Result<()> {
        if stream.device() != self.device() {
            return Err(Error::Device {
                device: self.device(),
                message: format!("{what}: a stream of {} for a tensor on {}", stream.device(), self.device()),
            });
        }
        if !self.is_contiguous() {
            return Err(Error::Layout(format!("{what}: the tensor is not contiguous")));
        }
        if len != self.nbytes() {
            return Err(Error::Layout(format!("{what}: {len} bytes for a tensor of {} bytes", self.nbytes())));
        }
        Ok(())
    }
}
