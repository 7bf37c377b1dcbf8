//! Tensors: a storage (a pool block or borrowed external memory), a dtype and a strided layout,
//! plus what's needed to order work on it across streams.

use std::fmt;
use std::sync::{Arc, Mutex};

use crate::device::HostFn;
use crate::dtype::DType;
use crate::error::{AsyncError, Error, Result};
use crate::ids::{DeviceId, DevicePtr};
use crate::memory::{Allocate, Buffer};
use crate::stream::{Mark, Stream, StreamId};
use crate::DeviceContext;

/// Where a tensor's bytes live.
pub enum Storage {
    /// A block of the device's caching pool, returned to it when the storage drops.
    Pool(Buffer),
    /// Memory owned by another library (a numpy array through DLPack). `owner` keeps it alive
    /// and releases it when dropped.
    External { ptr: DevicePtr, len: usize, device: DeviceId, owner: Box<dyn Send + Sync> },
}

impl fmt::Debug for Storage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Storage::Pool(buffer) => write!(f, "{buffer:?}"),
            Storage::External { ptr, len, device, .. } => write!(f, "External({device}, {:#x}, {len} bytes)", ptr.0),
        }
    }
}

impl Storage {
    pub fn ptr(&self) -> DevicePtr {
        match self {
            Storage::Pool(buffer) => buffer.ptr(),
            Storage::External { ptr, .. } => *ptr,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Storage::Pool(buffer) => buffer.len(),
            Storage::External { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The last accesses of a tensor by stream work, so later work on other streams waits for them.
#[derive(Debug, Default)]
struct Access {
    /// Where the last write and the unfinished reads end, per stream ([`Mark`]s: made into
    /// events only when another stream or the host has to wait for them).
    write: Option<(StreamId, Mark)>,
    reads: Vec<(StreamId, Mark)>,
    /// Set by the last writing kernel if it failed: host reads report it instead of returning
    /// whatever the failed kernel left in memory.
    failure: Option<Arc<Mutex<Option<AsyncError>>>>,
    /// The stream of the last writing device work (a vendor kernel or copy): the driver reports
    /// its failure only at that stream's synchronize, so readers synchronize it.
    writer: Option<Stream>,
}

/// An n-dimensional array on a device. Not `Clone`: device memory is never duplicated
/// implicitly; share it with `Arc<Tensor>`.
pub struct Tensor {
    storage: Arc<Storage>,
    dtype: DType,
    shape: Vec<usize>,
    /// Strides in elements.
    strides: Vec<isize>,
    /// Offset of element 0 from the storage start, in bytes.
    offset: usize,
    device: DeviceId,
    access: Mutex<Access>,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({:?}, {}, {}, {:?})", self.shape, self.dtype, self.device, self.storage)
    }
}

/// Number of elements of `shape`, `None` on overflow.
pub fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// Row-major (C-order) strides in elements.
pub fn contiguous_strides(shape: &[usize]) -> Vec<isize> {
    let mut strides = vec![1isize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1) as isize;
    }
    strides
}

impl Tensor {
    /// An uninitialized contiguous tensor from the device pool, for work on `stream`.
    pub fn empty(ctx: &DeviceContext, shape: &[usize], dtype: DType, stream: StreamId) -> Result<Tensor> {
        Tensor::empty_in(ctx.pool(), shape, dtype, stream)
    }

    /// An uninitialized contiguous tensor from `alloc` (a device pool, or a child pool whose
    /// quota the tensor then counts against), for work on `stream`.
    pub fn empty_in(alloc: &dyn Allocate, shape: &[usize], dtype: DType, stream: StreamId) -> Result<Tensor> {
        let bytes = numel(shape)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| Error::Layout(format!("shape {shape:?} of {dtype} overflows the address space")))?;
        let buffer = alloc.allocate(bytes, stream)?;
        Ok(Tensor::from_storage(Arc::new(Storage::Pool(buffer)), alloc.device(), dtype, shape.to_vec(), None, 0)
            .expect("a fresh contiguous layout fits its buffer"))
    }

    /// A tensor over existing storage; checks that every element lies inside it.
    pub fn from_storage(
        storage: Arc<Storage>,
        device: DeviceId,
        dtype: DType,
        shape: Vec<usize>,
        strides: Option<Vec<isize>>,
        offset: usize,
    ) -> Result<Tensor> {
        let strides = strides.unwrap_or_else(|| contiguous_strides(&shape));
        if strides.len() != shape.len() {
            return Err(Error::Layout(format!("{} strides for {} dimensions", strides.len(), shape.len())));
        }
        let n = numel(&shape).ok_or_else(|| Error::Layout(format!("shape {shape:?} overflows")))?;
        if n > 0 {
            let (mut low, mut high) = (0isize, 0isize);
            for (&d, &s) in shape.iter().zip(&strides) {
                let reach = (d as isize - 1).checked_mul(s).ok_or_else(|| Error::Layout("stride overflow".into()))?;
                if reach < 0 {
                    low += reach;
                } else {
                    high += reach;
                }
            }
            let size = dtype.size() as isize;
            let first = offset as isize + low * size;
            let end = offset as isize + (high + 1) * size;
            if first < 0 || end as usize > storage.len() {
                return Err(Error::Layout(format!(
                    "shape {shape:?} with strides {strides:?} at offset {offset} reaches outside its {} bytes",
                    storage.len()
                )));
            }
        }
        Ok(Tensor { storage, dtype, shape, strides, offset, device, access: Mutex::new(Access::default()) })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn strides(&self) -> &[isize] {
        &self.strides
    }

    pub fn device(&self) -> DeviceId {
        self.device
    }

    pub fn storage(&self) -> &Arc<Storage> {
        &self.storage
    }

    pub fn numel(&self) -> usize {
        numel(&self.shape).unwrap_or(0)
    }

    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// Address of element 0.
    pub fn data_ptr(&self) -> DevicePtr {
        self.storage.ptr().offset(self.offset)
    }

    pub fn byte_offset(&self) -> usize {
        self.offset
    }

    /// Row-major with no gaps (size-1 dimensions may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let expected = contiguous_strides(&self.shape);
        self.shape.iter().zip(self.strides.iter().zip(&expected)).all(|(&d, (&s, &e))| d <= 1 || s == e)
    }

    /// Enqueues `kernel` on `stream`, ordered after earlier work on these tensors on other
    /// streams (reads wait for writes; writes wait for reads and writes). The pool learns which
    /// blocks the stream uses, so freeing them is safe without `record_stream`.
    pub fn launch(stream: &Stream, reads: &[&Tensor], writes: &[&Tensor], kernel: HostFn) -> Result<()> {
        Tensor::launch_event(stream, reads, writes, kernel).map(drop)
    }

    /// [`Tensor::launch`], returning the point after `kernel` in stream order (what whoever
    /// must wait for that kernel, e.g. an unload, waits on).
    pub fn launch_event(stream: &Stream, reads: &[&Tensor], writes: &[&Tensor], kernel: HostFn) -> Result<Mark> {
        Tensor::order_after_access(stream, reads, writes)?;
        // Borrowed memory (a numpy array) must outlive the kernel even if every tensor over it
        // is dropped first: the kernel holds its storage until it has run. Pool blocks need no
        // such hold: the pool's stream-ordered reuse covers them.
        let borrowed = Tensor::borrowed_storage(reads, writes);
        let failure: Arc<Mutex<Option<AsyncError>>> = Arc::default();
        let failed = Arc::clone(&failure);
        stream.launch(Box::new(move || {
            let outcome = kernel();
            drop(borrowed);
            if let Err(error) = &outcome {
                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.clone());
            }
            outcome
        }))?;
        Tensor::record_access(stream, reads, writes, Some(failure))
    }

    /// Device work (a copy, a memset, a vendor kernel) that `enqueue` puts on `stream`, ordered
    /// like [`Tensor::launch`]: after earlier work on these tensors on other streams, and before
    /// later work on them. Its failures are the stream's (reported by the driver at the next
    /// synchronize), not a host closure's.
    pub fn enqueue_event(
        stream: &Stream,
        reads: &[&Tensor],
        writes: &[&Tensor],
        enqueue: impl FnOnce(&Stream) -> Result<()>,
    ) -> Result<Mark> {
        Tensor::order_after_access(stream, reads, writes)?;
        enqueue(stream)?;
        let borrowed = Tensor::borrowed_storage(reads, writes);
        if !borrowed.is_empty() {
            // Held until the device work before this point has run.
            stream.launch_host_func(Box::new(move || {
                drop(borrowed);
                Ok(())
            }))?;
        }
        Tensor::record_access(stream, reads, writes, None)
    }

    /// Makes `stream` wait for the unfinished accesses of other streams that the new work
    /// conflicts with (reads wait for writes; writes wait for reads and writes), and tells the
    /// pool which blocks the stream uses, so freeing them is safe without `record_stream`.
    fn order_after_access(stream: &Stream, reads: &[&Tensor], writes: &[&Tensor]) -> Result<()> {
        // Other streams' marks, turned into events outside the tensors' locks.
        let mut marks: Vec<Mark> = Vec::new();
        let mut wait_for = |owner: StreamId, mark: &Mark| {
            if owner != stream.id() && !mark.known_done() {
                marks.push(mark.clone());
            }
        };
        for tensor in reads {
            if let Some((owner, mark)) = &tensor.lock_access().write {
                wait_for(*owner, mark);
            }
        }
        for tensor in writes {
            let access = tensor.lock_access();
            for (owner, mark) in access.write.iter().chain(&access.reads) {
                wait_for(*owner, mark);
            }
        }
        for mark in &marks {
            if let Some(event) = mark.event()? {
                if !event.query() {
                    stream.wait_event(&event)?;
                }
            }
        }
        for tensor in reads.iter().chain(writes) {
            if let Storage::Pool(buffer) = tensor.storage.as_ref() {
                buffer.record_use(stream);
            }
        }
        Ok(())
    }

    /// The storages of `reads` and `writes` that are borrowed memory, not pool blocks.
    fn borrowed_storage(reads: &[&Tensor], writes: &[&Tensor]) -> Vec<Arc<Storage>> {
        reads
            .iter()
            .chain(writes)
            .filter(|t| matches!(t.storage.as_ref(), Storage::External { .. }))
            .map(|t| Arc::clone(&t.storage))
            .collect()
    }

    /// Records the point after the new work as the tensors' last read or write.
    fn record_access(
        stream: &Stream,
        reads: &[&Tensor],
        writes: &[&Tensor],
        failure: Option<Arc<Mutex<Option<AsyncError>>>>,
    ) -> Result<Mark> {
        let done = stream.mark()?;
        for tensor in reads {
            let mut access = tensor.lock_access();
            // One read per stream is enough: `done` comes after this stream's earlier reads.
            access.reads.retain(|(owner, e)| *owner != stream.id() && !e.known_done());
            access.reads.push((stream.id(), done.clone()));
        }
        for tensor in writes {
            let mut access = tensor.lock_access();
            // Unfinished reads stay: one recorded by another thread after this write looked
            // (`order_after_access`) was not waited for.
            access.reads.retain(|(_, e)| !e.known_done());
            access.write = Some((stream.id(), done.clone()));
            access.writer = failure.is_none().then(|| stream.clone());
            access.failure = failure.clone();
        }
        Ok(done)
    }

    /// Enqueues on `stream` a fill of this tensor with zero bytes (zero in every dtype), ordered
    /// like a kernel writing it. For contiguous tensors in host-accessible memory (the CPU
    /// device; a device memset elsewhere).
    pub fn fill_zeros(&self, stream: &Stream) -> Result<()> {
        if !self.is_contiguous() {
            return Err(Error::Layout(format!(
                "fill_zeros needs a contiguous tensor, got shape {:?} and strides {:?}",
                self.shape, self.strides
            )));
        }
        if !DeviceContext::get(self.device)?.device().host_accessible() {
            let (ptr, bytes) = (self.data_ptr(), self.nbytes());
            return Tensor::enqueue_event(stream, &[], &[self], |stream| stream.memset(ptr, 0, bytes)).map(drop);
        }
        crate::memory::host_zero_fill(stream, self)
    }

    /// Orders host access to a fresh tensor after the work already queued on `stream`, the
    /// stream its block was allocated for: the pool may hand out a block that earlier work on
    /// that stream still writes (stream-ordered reuse), which device work sees in order but the
    /// host would not.
    pub fn mark_allocated_on(&self, stream: &Stream) -> Result<()> {
        if !stream.query() {
            self.lock_access().write = Some((stream.id(), stream.mark()?));
        }
        Ok(())
    }

    /// True when no enqueued work still writes this tensor. On an accelerator, work queued on
    /// the writing stream after the write may have to finish too (see [`Mark`]); asking may
    /// record an event.
    pub fn is_ready(&self) -> bool {
        let write = self.lock_access().write.clone();
        write.is_none_or(|(_, e)| e.query())
    }

    /// Blocks until all enqueued work writing this tensor is done (before host reads).
    pub fn wait_ready(&self) -> Result<()> {
        let (pending, failure, writer) = {
            let access = self.lock_access();
            (access.write.clone(), access.failure.clone(), access.writer.clone())
        };
        match (&writer, &pending) {
            // Device work: a failed kernel is only known to its stream, whose synchronize also
            // covers the write.
            (Some(writer), _) => writer.synchronize()?,
            (None, Some((_, mark))) => mark.synchronize()?,
            (None, None) => {}
        }
        match failure.and_then(|f| f.lock().unwrap_or_else(|p| p.into_inner()).clone()) {
            // "asynchronous error on cpu:0 stream 3, in the work that wrote this tensor: ..."
            Some(error) => Err(Error::Async {
                stream: match pending {
                    Some((stream, _)) => {
                        format!("{} stream {}, in the work that wrote this tensor", self.device, stream.0)
                    }
                    None => format!("{}, in the work that wrote this tensor", self.device),
                },
                error,
            }),
            None => Ok(()),
        }
    }

    /// Blocks until all enqueued work reading or writing this tensor is done (before host writes).
    pub fn wait_idle(&self) -> Result<()> {
        let marks: Vec<Mark> = {
            let access = self.lock_access();
            access.write.iter().chain(&access.reads).map(|(_, e)| e.clone()).collect()
        };
        marks.iter().try_for_each(Mark::synchronize)
    }

    fn lock_access(&self) -> std::sync::MutexGuard<'_, Access> {
        self.access.lock().unwrap_or_else(|p| p.into_inner())
    }
}
