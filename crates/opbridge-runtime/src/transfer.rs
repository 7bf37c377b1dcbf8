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
        match self.upload_async(stream, bytes)? {
            Some(done) => done.synchronize(),
            None => Ok(()),
        }
    }

    /// [`Tensor::upload`] without the wait: `bytes` are staged (in a block of the device's
    /// pinned pool, which stays reserved until the stream has passed the copy) before this
    /// returns, so they may change at once; the copy itself is enqueued on `stream`, and later
    /// work on the tensor is ordered after it. The point after the copy, or `None` for no bytes.
    /// What a server's request takes: its inputs go up, its kernel runs and its outputs come
    /// back with one wait at the end.
    pub fn upload_async(&self, stream: &Stream, bytes: &[u8]) -> Result<Option<crate::stream::Mark>> {
        self.check_transfer("upload", bytes.len(), stream)?;
        if bytes.is_empty() {
            return Ok(None);
        }
        let (dst, len) = (self.data_ptr(), bytes.len());
        let ctx = DeviceContext::get(self.device())?;
        if ctx.device().host_accessible() {
            // Host memory on both sides: the copy reads `bytes`, so it is waited for here.
            let src = DevicePtr(bytes.as_ptr() as usize);
            let done = Tensor::enqueue_event(stream, &[], &[self], |s| s.copy(dst, src, len, CopyKind::HostToDevice))?;
            done.synchronize()?;
            return Ok(Some(done));
        }
        // Idle when handed out (allocated for the host), written here, then used by the copy.
        let staging = ctx.pinned_pool().allocate(len, StreamId::HOST)?;
        host_write(&staging, bytes);
        staging.record_use(stream);
        let src = staging.ptr();
        Tensor::enqueue_event(stream, &[], &[self], |s| s.copy(dst, src, len, CopyKind::HostToDevice)).map(Some)
    }

    /// Enqueues on `stream` a device-to-host copy of this contiguous tensor of an accelerator
    /// into a block of the device's pinned pool, after the work that writes it;
    /// [`PendingDownload::wait`] then gives the bytes as a host tensor that owns the block (read
    /// in place: a response body sends them without another copy).
    pub fn download_async(&self, stream: &Stream) -> Result<PendingDownload> {
        self.check_transfer("download", self.nbytes(), stream)?;
        let ctx = DeviceContext::get(self.device())?;
        let staging = ctx.pinned_pool().allocate(self.nbytes(), StreamId::HOST)?;
        staging.record_use(stream);
        let (src, dst, len) = (self.data_ptr(), staging.ptr(), self.nbytes());
        let done = match len {
            0 => None,
            _ => Some(Tensor::enqueue_event(stream, &[self], &[], |s| s.copy(dst, src, len, CopyKind::DeviceToHost))?),
        };
        Ok(PendingDownload { staging, done, stream: stream.clone(), dtype: self.dtype(), shape: self.shape().to_vec() })
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

/// A device-to-host copy in flight into a pinned block (see [`Tensor::download_async`]).
#[derive(Debug)]
pub struct PendingDownload {
    staging: crate::memory::Buffer,
    done: Option<crate::stream::Mark>,
    stream: Stream,
    dtype: crate::dtype::DType,
    shape: Vec<usize>,
}

impl PendingDownload {
    /// Waits for the copy and synchronizes its stream, so a failure of the work that wrote the
    /// tensor (a failed kernel) is reported instead of its leftovers; then the bytes, as a
    /// contiguous host tensor (`cpu:0`) owning the pinned block.
    pub fn wait(self) -> Result<Tensor> {
        if let Some(done) = &self.done {
            done.synchronize()?;
        }
        self.stream.synchronize()?;
        let PendingDownload { staging, dtype, shape, .. } = self;
        let (ptr, len) = (staging.ptr(), staging.len());
        let storage =
            crate::tensor::Storage::External { ptr, len, device: crate::ids::DeviceId::CPU, owner: Box::new(staging) };
        Tensor::from_storage(std::sync::Arc::new(storage), crate::ids::DeviceId::CPU, dtype, shape, None, 0)
    }
}
