//! The staged path for devices whose memory the host cannot touch: host arrays are copied in
//! chunks through pinned staging buffers, and the copy-in of chunk i+1, the kernel on chunk i
//! and the copy-out of chunk i-1 run at once on three streams (H2D / compute / D2H).

use crate::device::{CopyKind, HostFn};
use crate::error::Result;
use crate::ids::DevicePtr;
use crate::stream::{Event, Stream, StreamId};
use crate::DeviceContext;

/// The kernel for one chunk: device pointers of the inputs, of the output, and the element
/// count. It returns the work to enqueue on the compute stream.
pub type ChunkKernel<'a> = dyn Fn(&[DevicePtr], DevicePtr, usize) -> HostFn + 'a;

/// Device work for one chunk: enqueues on the compute stream (given first) the operator over
/// the chunk's device buffers (inputs, output) of `n` elements (an accelerator's kernel, which
/// the vendor API enqueues itself).
pub type ChunkWork<'a> = dyn Fn(&Stream, &[DevicePtr], DevicePtr, usize) -> Result<()> + 'a;

/// Counts of what a staged run did, for tests and profiling.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipelineReport {
    pub chunks: usize,
    pub bytes_in: usize,
    pub bytes_out: usize,
}

/// Elementwise map from same-length host inputs to a host output through the device.
/// `elem_in`/`elem_out` are element sizes; `chunk_elems` bounds the staging buffers.
#[allow(clippy::too_many_arguments)]
pub fn staged_map(
    ctx: &DeviceContext,
    inputs: &[&[u8]],
    elem_in: &[usize],
    output: &mut [u8],
    elem_out: usize,
    len: usize,
    chunk_elems: usize,
    kernel: &ChunkKernel<'_>,
) -> Result<PipelineReport> {
    let work = |stream: &Stream, ins: &[DevicePtr], out: DevicePtr, n: usize| stream.launch(kernel(ins, out, n));
    staged_work(ctx, inputs, elem_in, output, elem_out, len, chunk_elems, &work)
}

/// [`staged_map`] with the chunk's work enqueued by `work` (device kernels).
#[allow(clippy::too_many_arguments)]
pub fn staged_work(
    ctx: &DeviceContext,
    inputs: &[&[u8]],
    elem_in: &[usize],
    output: &mut [u8],
    elem_out: usize,
    len: usize,
    chunk_elems: usize,
    work: &ChunkWork<'_>,
) -> Result<PipelineReport> {
    // One staged call at a time per device (see `pipeline_turn`); one that fails leaves the
    // streams clean for the next: its pending work is waited for and its errors taken.
    let _turn = ctx.pipeline_turn.lock().unwrap_or_else(|p| p.into_inner());
    let streams = ctx.pipeline_streams()?;
    let outcome = staged_on(ctx, &streams, inputs, elem_in, output, elem_out, len, chunk_elems, work);
    if outcome.is_err() {
        for stream in &streams {
            let _ = stream.synchronize();
        }
    }
    outcome
}

/// [`staged_work`] on the device's three pipeline streams, its turn taken.
#[allow(clippy::too_many_arguments)]
fn staged_on(
    ctx: &DeviceContext,
    [h2d, compute, d2h]: &[Stream; 3],
    inputs: &[&[u8]],
    elem_in: &[usize],
    output: &mut [u8],
    elem_out: usize,
    len: usize,
    chunk_elems: usize,
    work: &ChunkWork<'_>,
) -> Result<PipelineReport> {
    // Buffers no larger than the call needs: a small call does not take a whole chunk's memory.
    let chunk_elems = chunk_elems.min(len).max(1);
    const SLOTS: usize = 2; // double buffering: one chunk moves while its neighbour computes
    let mut slots = Vec::with_capacity(SLOTS);
    for _ in 0..SLOTS.min(len.div_ceil(chunk_elems)).max(1) {
        slots.push(Slot::new(ctx, elem_in, elem_out, chunk_elems, [h2d, compute, d2h])?);
    }
    let mut report = PipelineReport::default();
    let mut in_flight: Vec<Option<(usize, usize, Event)>> = vec![None; slots.len()];
    let chunks = len.div_ceil(chunk_elems);
    for chunk in 0..chunks {
        let slot_index = chunk % slots.len();
        let slot = &slots[slot_index];
        // Reusing a slot: first drain its previous chunk to the host output.
        if let Some((start, n, done)) = in_flight[slot_index].take() {
            done.synchronize()?;
            slot.drain(output, start, n, elem_out);
        }
        let start = chunk * chunk_elems;
        let n = chunk_elems.min(len - start);
        // Host -> pinned (host memcpy), then pinned -> device on the copy stream.
        for (k, input) in inputs.iter().enumerate() {
            let bytes = &input[start * elem_in[k]..(start + n) * elem_in[k]];
            slot.fill_pinned(k, bytes);
            h2d.copy(slot.device_in[k].ptr(), slot.pinned_in[k].ptr(), bytes.len(), CopyKind::HostToDevice)?;
            report.bytes_in += bytes.len();
        }
        let copied_in = h2d.record_new_event()?;
        compute.wait_event(&copied_in)?;
        let device_ptrs: Vec<DevicePtr> = slot.device_in.iter().map(|b| b.ptr()).collect();
        work(compute, &device_ptrs, slot.device_out.ptr(), n)?;
        let computed = compute.record_new_event()?;
        d2h.wait_event(&computed)?;
        d2h.copy(slot.pinned_out.ptr(), slot.device_out.ptr(), n * elem_out, CopyKind::DeviceToHost)?;
        report.bytes_out += n * elem_out;
        in_flight[slot_index] = Some((start, n, d2h.record_new_event()?));
        report.chunks += 1;
    }
    for (slot, pending) in slots.iter().zip(in_flight) {
        if let Some((start, n, done)) = pending {
            done.synchronize()?;
            slot.drain(output, start, n, elem_out);
        }
    }
    // Surface any asynchronous error from the three streams.
    h2d.synchronize()?;
    compute.synchronize()?;
    d2h.synchronize()?;
    Ok(report)
}

/// One set of staging and device buffers for a chunk in flight.
struct Slot {
    pinned_in: Vec<crate::Buffer>,
    device_in: Vec<crate::Buffer>,
    device_out: crate::Buffer,
    pinned_out: crate::Buffer,
}

impl Slot {
    /// Staging blocks belong to the host and are marked used by the three streams, so the pool
    /// hands them out again only once those streams are past this call's work.
    fn new(
        ctx: &DeviceContext,
        elem_in: &[usize],
        elem_out: usize,
        chunk: usize,
        streams: [&Stream; 3],
    ) -> Result<Slot> {
        let host = StreamId::HOST;
        let mut pinned_in = Vec::new();
        let mut device_in = Vec::new();
        for &size in elem_in {
            pinned_in.push(ctx.pinned_pool().allocate(size * chunk, host)?);
            device_in.push(ctx.pool().allocate(size * chunk, host)?);
        }
        let slot = Slot {
            pinned_in,
            device_in,
            device_out: ctx.pool().allocate(elem_out * chunk, host)?,
            pinned_out: ctx.pinned_pool().allocate(elem_out * chunk, host)?,
        };
        for buffer in slot.pinned_in.iter().chain(&slot.device_in).chain([&slot.device_out, &slot.pinned_out]) {
            streams.iter().for_each(|s| buffer.record_use(s));
        }
        Ok(slot)
    }

    fn fill_pinned(&self, k: usize, bytes: &[u8]) {
        crate::memory::host_write(&self.pinned_in[k], bytes);
    }

    fn drain(&self, output: &mut [u8], start: usize, n: usize, elem_out: usize) {
        crate::memory::host_read(&self.pinned_out, &mut output[start * elem_out..(start + n) * elem_out]);
    }
}

/// The chunk size of the staged path on `ctx`'s device, in bytes, from a model measured once
/// per device: a chunk should take long enough to copy that the fixed cost of a copy and a
/// launch (the latency) is a small part of it, and be no bigger than that, so the three stages
/// overlap from the second chunk on. Measured with two copies (64 KiB and 4 MiB) on the
/// pipeline's H2D stream: latency `l` and bandwidth `b`; the chunk is `16 * l * b`, kept within
/// 256 KiB .. 16 MiB.
pub fn chunk_bytes(ctx: &DeviceContext) -> Result<usize> {
    if let Some(bytes) = ctx.staged_chunk_bytes.get() {
        return Ok(*bytes);
    }
    let [h2d, _, _] = ctx.pipeline_streams()?;
    let time = |bytes: usize| -> Result<f64> {
        let host = ctx.pinned_pool().allocate(bytes, StreamId::HOST)?;
        let device = ctx.pool().allocate(bytes, StreamId::HOST)?;
        host.record_use(&h2d);
        device.record_use(&h2d);
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let started = std::time::Instant::now();
            h2d.copy(device.ptr(), host.ptr(), bytes, CopyKind::HostToDevice)?;
            h2d.record_new_event()?.synchronize()?;
            best = best.min(started.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let (small, large) = (64usize << 10, 4usize << 20);
    let (t_small, t_large) = (time(small)?, time(large)?);
    let bandwidth = (large - small) as f64 / (t_large - t_small).max(1e-9);
    let latency = (t_small - small as f64 / bandwidth).max(0.0);
    let bytes = ((16.0 * latency * bandwidth) as usize).clamp(256 << 10, 16 << 20);
    Ok(*ctx.staged_chunk_bytes.get_or_init(|| bytes))
}
