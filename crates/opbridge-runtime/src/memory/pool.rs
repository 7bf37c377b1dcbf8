//! The caching memory pool, after PyTorch's CUDA caching allocator.
//!
//! - Requests up to 1 MiB are rounded to 512 bytes and carved from 2 MiB segments; larger ones
//!   are rounded to 512 bytes and served from 20 MiB segments (under 10 MiB) or from segments
//!   of their own size rounded to 2 MiB.
//! - Freed blocks are cached, split on reuse (best fit) and coalesced with free neighbours.
//! - Blocks belong to the stream they were allocated for and are reused only for that stream,
//!   where stream order makes reuse safe. A block that other streams used is held back until
//!   events recorded on those streams at free time complete.
//! - On exhaustion (limit or system) the pool synchronizes the device, releases its cache and
//!   retries once before failing with `Error::OutOfMemory`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use super::buffer::{Buffer, SubBuffer};
use super::{round_up, ALIGNMENT};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::ids::DevicePtr;
use crate::profiler;
use crate::stream::{Event, StreamId, StreamRegistry, StreamUse};

const MIN_BLOCK: usize = 512;
const SMALL_REQUEST: usize = 1 << 20;
const SMALL_SEGMENT: usize = 2 << 20;
const LARGE_SEGMENT: usize = 20 << 20;
const SHARED_LARGE_LIMIT: usize = 10 << 20;
const LARGE_ROUND: usize = 2 << 20;
/// Bound on `State::unmerged`: enough for a working set of shapes, small enough to scan.
const MAX_UNMERGED: usize = 16;

/// Where a pool gets its memory from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// Device memory (`Device::allocate_raw`).
    Device,
    /// Pinned host memory for staging (`Device::allocate_pinned`).
    Pinned,
}

/// A snapshot of the pool's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks handed out and not yet freed.
    pub allocated_blocks: usize,
    /// Cached blocks ready for reuse.
    pub free_blocks: usize,
    /// Bytes reserved from the device (segments), cached or in use.
    pub total_memory: usize,
    pub allocated_bytes_current: usize,
    pub allocated_bytes_peak: usize,
    pub reserved_bytes_current: usize,
    pub reserved_bytes_peak: usize,
    /// Successful allocations.
    pub num_allocs: u64,
    /// Allocations served from the cache, without a new segment.
    pub num_cache_hits: u64,
    /// Times the pool released its cache and retried.
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    /// Cached bytes in free blocks too small for the largest recent request.
    pub fragmented_bytes: usize,
    /// The largest request since the last `reset_peak_memory_stats`.
    pub largest_recent_request: usize,
    /// Blocks freed but waiting for other streams to finish with them.
    pub pending_free_blocks: usize,
    pub limit: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct FreeKey {
    small: bool,
    stream: StreamId,
    size: usize,
    addr: usize,
}

#[derive(Debug, Clone, Copy)]
struct BlockInfo {
    size: usize,
    segment: usize,
    stream: StreamId,
    small: bool,
    allocated: bool,
}

#[derive(Debug, Clone, Copy)]
struct Segment {
    size: usize,
    stream: StreamId,
}

#[derive(Debug)]
struct PendingFree {
    addr: usize,
    events: Vec<Event>,
}

#[derive(Debug, Default)]
struct State {
    /// Every block, by address (neighbours for coalescing are the map's neighbours).
    blocks: BTreeMap<usize, BlockInfo>,
    segments: BTreeMap<usize, Segment>,
    free: BTreeSet<FreeKey>,
    pending: Vec<PendingFree>,
    limit: Option<usize>,
    stats: PoolStats,
    /// An error met where it could not be returned (in `Drop`); surfaced by the next allocation.
    deferred: Option<Error>,
    /// Recently freed blocks `(stream, size, addr)`, free but not yet merged with their
    /// neighbours: a request of the same size and stream takes one back without the split and
    /// coalesce churn (the common case of a loop allocating the same shapes). Merged into the
    /// free set on any other request, when full, and before releasing or reporting.
    unmerged: Vec<(StreamId, usize, usize)>,
    /// Streams that are gone with all their work done: their blocks are never reused, so their
    /// segments go back to the device as soon as they are entirely free.
    dead: std::collections::HashSet<StreamId>,
    /// The operator that allocated each live block, recorded while memory is profiled.
    origins: std::collections::HashMap<usize, Arc<str>>,
}

/// What a block is doing now (see [`MemoryPool::snapshot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out and in use.
    Allocated,
    /// Freed, but waiting for other streams to finish with it.
    Pending,
    /// Free, cached for reuse.
    Cached,
}

impl BlockState {
    pub fn name(self) -> &'static str {
        match self {
            BlockState::Allocated => "allocated",
            BlockState::Pending => "pending",
            BlockState::Cached => "cached",
        }
    }
}

/// One block of a segment, as [`MemoryPool::snapshot`] sees it.
#[derive(Debug, Clone)]
pub struct BlockSnapshot {
    pub address: usize,
    pub size: usize,
    pub state: BlockState,
    /// The stream the block belongs to (0: host use).
    pub stream: u64,
    /// The operator that allocated it, when memory was profiled at the time.
    pub op: Option<Arc<str>>,
}

/// One segment reserved from the device, and its blocks in address order.
#[derive(Debug, Clone)]
pub struct SegmentSnapshot {
    pub address: usize,
    pub size: usize,
    pub stream: u64,
    pub blocks: Vec<BlockSnapshot>,
}

/// A caching pool over one device's memory. Shared (`Arc`) by every buffer it hands out.
pub struct MemoryPool {
    pub(crate) device: Arc<dyn Device>,
    source: Source,
    streams: Arc<StreamRegistry>,
    state: Mutex<State>,
}

impl fmt::Debug for MemoryPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MemoryPool({}, {:?})", self.device.id(), self.source)
    }
}

fn is_small(size: usize) -> bool {
    size <= SMALL_REQUEST
}

impl MemoryPool {
    pub(crate) fn new(device: Arc<dyn Device>, source: Source, streams: Arc<StreamRegistry>) -> MemoryPool {
        MemoryPool { device, source, streams, state: Mutex::new(State::default()) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The device whose memory this pool caches.
    pub fn device_id(&self) -> crate::device::DeviceId {
        self.device.id()
    }

    /// The size of the block a request of `bytes` gets.
    pub fn block_size(&self, bytes: usize) -> usize {
        self.checked_block_size(bytes).unwrap_or(usize::MAX)
    }

    /// The block size for a request of `bytes`: the device's padded size (device memory only;
    /// pinned staging blocks are host memory), rounded to the pool's granularity.
    fn checked_block_size(&self, bytes: usize) -> Option<usize> {
        let needed = match self.source {
            Source::Device => self.device.padded_size(bytes.max(1))?,
            Source::Pinned => bytes.max(1),
        };
        round_up(needed, MIN_BLOCK)
    }

    fn segment_size(size: usize) -> usize {
        if is_small(size) {
            SMALL_SEGMENT
        } else if size < SHARED_LARGE_LIMIT {
            LARGE_SEGMENT
        } else {
            round_up(size, LARGE_ROUND).unwrap_or(size)
        }
    }

    /// Allocates `bytes` for work on `stream` (`StreamId::HOST` for synchronous host use).
    pub fn allocate(self: &Arc<Self>, bytes: usize, stream: StreamId) -> Result<Buffer> {
        let size = self
            .checked_block_size(bytes)
            .filter(|&s| s <= isize::MAX as usize)
            .ok_or_else(|| self.oom_error(&self.lock(), bytes, false))?;
        let mut retried = false;
        loop {
            let mut state = self.lock();
            if let Some(error) = state.deferred.take() {
                return Err(error);
            }
            state.stats.largest_recent_request = state.stats.largest_recent_request.max(bytes);
            Self::process_pending(&mut state);
            // The limit caps live bytes too: cached segments reserved before a lower limit was
            // set must not let allocations exceed it. Blocks still pending for other streams
            // count as live until the retry below has waited for them.
            let over_limit = state.limit.is_some_and(|l| state.stats.allocated_bytes_current + size > l);
            if over_limit && (retried || state.pending.is_empty()) {
                state.stats.num_ooms += 1;
                profiler::memory_event("out of memory", || self.event_args(&state, bytes, stream));
                return Err(self.oom_error(&state, bytes, false));
            }
            let hit = if over_limit { None } else { Self::take_unmerged(&mut state, size, stream) };
            if let Some(addr) = hit {
                state.stats.num_cache_hits += 1;
                let buffer = self.hand_out(&mut state, addr, bytes, stream);
                profiler::memory_event("allocate (cache hit)", || self.event_args(&state, bytes, stream));
                return Ok(buffer);
            }
            if !over_limit {
                Self::merge_unmerged(&mut state);
                if let Some(addr) = Self::take_free(&mut state, size, stream) {
                    state.stats.num_cache_hits += 1;
                    let buffer = self.hand_out(&mut state, addr, bytes, stream);
                    profiler::memory_event("allocate (cache hit)", || self.event_args(&state, bytes, stream));
                    return Ok(buffer);
                }
                if let Some(addr) = self.grow(&mut state, size, stream) {
                    let buffer = self.hand_out(&mut state, addr, bytes, stream);
                    profiler::memory_event("allocate (new segment)", || self.event_args(&state, bytes, stream));
                    return Ok(buffer);
                }
            }
            if retried {
                state.stats.num_ooms += 1;
                profiler::memory_event("out of memory", || self.event_args(&state, bytes, stream));
                return Err(self.oom_error(&state, bytes, false));
            }
            // Free the cache and try once more. Synchronize without the lock: host callbacks
            // on the streams may free buffers themselves.
            state.stats.num_alloc_retries += 1;
            profiler::memory_event("allocate retry (freeing the cache)", || self.event_args(&state, bytes, stream));
            drop(state);
            retried = true;
            let drained = self.streams.drain_all();
            let mut state = self.lock();
            Self::process_pending(&mut state);
            // Memory may still be in use by work we could not wait for (called from a host
            // function): then nothing cached is released and the request fails below.
            if drained.is_ok() {
                self.release_cached(&mut state);
            }
        }
    }

    /// A pool event's arguments: the request, and the pool's bytes after it.
    fn event_args(&self, state: &State, bytes: usize, stream: StreamId) -> Vec<(&'static str, profiler::Arg)> {
        vec![
            ("device", self.device_id().into()),
            ("bytes", bytes.into()),
            ("stream", stream.0.into()),
            ("allocated_bytes", state.stats.allocated_bytes_current.into()),
            ("reserved_bytes", state.stats.reserved_bytes_current.into()),
        ]
    }

    /// One block carved into 64-byte-aligned sub-buffers of `sizes` (the seed's 4.1.1): one
    /// pool operation for many small tensors.
    pub fn allocate_many(self: &Arc<Self>, sizes: &[usize], stream: StreamId) -> Result<Vec<SubBuffer>> {
        let (total, offsets) = carve(sizes).ok_or_else(|| self.oom_error(&self.lock(), usize::MAX, false))?;
        let block = Arc::new(self.allocate(total, stream)?);
        Ok(offsets
            .into_iter()
            .zip(sizes)
            .map(|(offset, &len)| SubBuffer { block: Arc::clone(&block), offset, len })
            .collect())
    }

    /// A child pool drawing from this one, limited to `quota` bytes (rounded block sizes).
    pub fn child(self: &Arc<Self>, quota: usize) -> ChildPool {
        ChildPool { parent: Arc::clone(self), quota: Arc::new(Quota::new(quota)) }
    }

    fn hand_out(self: &Arc<Self>, state: &mut State, addr: usize, bytes: usize, stream: StreamId) -> Buffer {
        let info = state.blocks.get_mut(&addr).expect("handed-out block is tracked");
        info.allocated = true;
        let size = info.size;
        // The device's layout rules hold for every block: 64-byte aligned starts, and at least
        // the padded size (ACL: ALIGN_UP(len, 32) + 32).
        debug_assert_eq!(addr % ALIGNMENT, 0, "pool block start {addr:#x} is not {ALIGNMENT}-byte aligned");
        debug_assert!(
            self.checked_block_size(bytes).is_some_and(|needed| size >= needed),
            "pool block of {size} bytes for a request of {bytes}: below the device's padded size"
        );
        if let Some(op) = profiler::profile_memory().then(profiler::current_op).flatten() {
            state.origins.insert(addr, op);
        }
        let stats = &mut state.stats;
        stats.num_allocs += 1;
        stats.allocated_blocks += 1;
        stats.allocated_bytes_current += size;
        stats.allocated_bytes_peak = stats.allocated_bytes_peak.max(stats.allocated_bytes_current);
        Buffer {
            pool: Arc::clone(self),
            ptr: DevicePtr(addr),
            len: bytes,
            stream,
            used_on: Mutex::new(Vec::new()),
            quota: None,
        }
    }

    /// Best fit among this stream's cached blocks of the same class; splits off the rest.
    fn take_free(state: &mut State, size: usize, stream: StreamId) -> Option<usize> {
        let small = is_small(size);
        let probe = FreeKey { small, stream, size, addr: 0 };
        let key = *state.free.range(probe..).next().filter(|k| k.small == small && k.stream == stream)?;
        state.free.remove(&key);
        state.stats.free_blocks -= 1;
        let remainder = key.size - size;
        // Small blocks split down to MIN_BLOCK; large ones only when the rest is itself large,
        // so big segments don't fill up with slivers.
        let split = if small { remainder >= MIN_BLOCK } else { remainder > SMALL_REQUEST };
        if split {
            let info = state.blocks.get_mut(&key.addr).expect("free block is tracked");
            info.size = size;
            let rest = BlockInfo { size: remainder, ..*info };
            let rest_addr = key.addr + size;
            state.blocks.insert(rest_addr, rest);
            state.free.insert(FreeKey { small, stream, size: remainder, addr: rest_addr });
            state.stats.free_blocks += 1;
        }
        Some(key.addr)
    }

    /// Reserves a new segment for `size` and returns its first block, or `None` when the limit
    /// or the device says no.
    fn grow(&self, state: &mut State, size: usize, stream: StreamId) -> Option<usize> {
        let small = is_small(size);
        let preferred = Self::segment_size(size);
        let fits = |bytes: usize| state.limit.is_none_or(|l| state.stats.reserved_bytes_current + bytes <= l);
        // Under a tight limit, or when the device cannot give a whole segment, a segment of
        // exactly the request beats failing.
        let sizes: &[usize] = if preferred == size { &[size] } else { &[preferred, size] };
        let (seg_size, base) = sizes.iter().copied().filter(|&s| fits(s)).find_map(|seg_size| {
            let base = match self.source {
                Source::Device => self.device.allocate_raw(seg_size),
                Source::Pinned => self.device.allocate_pinned(seg_size),
            };
            base.ok().map(|base| (seg_size, base))
        })?;
        let addr = base.0;
        state.segments.insert(addr, Segment { size: seg_size, stream });
        state.blocks.insert(addr, BlockInfo { size: seg_size, segment: addr, stream, small, allocated: false });
        let stats = &mut state.stats;
        stats.reserved_bytes_current += seg_size;
        stats.reserved_bytes_peak = stats.reserved_bytes_peak.max(stats.reserved_bytes_current);
        stats.total_memory = stats.reserved_bytes_current;
        // Carve the request out of the new segment the same way a cached block is carved.
        state.free.insert(FreeKey { small, stream, size: seg_size, addr });
        state.stats.free_blocks += 1;
        Self::take_free(state, size, stream)
    }

    /// Returns a block. Called from `Buffer::drop`: never fails, never panics.
    pub(super) fn release(&self, ptr: DevicePtr, used_on: Vec<StreamUse>) {
        let mut events = Vec::new();
        for stream in &used_on {
            // `None`: the stream is gone and all its work is done.
            match stream.record_new_event(self.device.as_ref()) {
                Ok(None) => {}
                Ok(Some(event)) => events.push(event),
                // Without an event we cannot know when the other stream is done with the block,
                // and waiting here could deadlock (this runs in Drop, maybe holding the GIL):
                // the block is never reused, and the error surfaces at the next allocation.
                Err(error) => {
                    self.lock().deferred.get_or_insert(error);
                    return;
                }
            }
        }
        let mut state = self.lock();
        let pending = !events.is_empty();
        // Read before the block is freed (and maybe merged or its segment released); only when
        // the event will be recorded: frees are a hot path.
        let size = if profiler::profile_memory() { state.blocks.get(&ptr.0).map_or(0, |b| b.size) } else { 0 };
        if events.is_empty() {
            Self::free_block(&mut state, ptr.0);
            if !state.dead.is_empty() {
                self.release_free_segments(&mut state, true);
            }
        } else {
            state.stats.pending_free_blocks += 1;
            state.pending.push(PendingFree { addr: ptr.0, events });
        }
        profiler::memory_event(if pending { "free (pending on a stream)" } else { "free" }, || {
            self.event_args(&state, size, StreamId::HOST)
        });
    }

    fn process_pending(state: &mut State) {
        if state.pending.is_empty() {
            return;
        }
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut state.pending).into_iter().partition(|p| p.events.iter().all(Event::query));
        state.pending = waiting;
        for p in ready {
            state.stats.pending_free_blocks -= 1;
            Self::free_block(state, p.addr);
        }
    }

    /// Marks a block free; it waits in `unmerged` for a request of its size.
    fn free_block(state: &mut State, addr: usize) {
        let Some(info) = state.blocks.get_mut(&addr).filter(|b| b.allocated) else { return };
        info.allocated = false;
        if !state.origins.is_empty() {
            state.origins.remove(&addr);
        }
        let (size, stream) = (info.size, info.stream);
        state.stats.allocated_blocks -= 1;
        state.stats.allocated_bytes_current -= size;
        state.stats.free_blocks += 1;
        if state.unmerged.len() == MAX_UNMERGED {
            Self::merge_unmerged(state);
        }
        state.unmerged.push((stream, size, addr));
    }

    /// The most recently freed unmerged block of exactly this size and stream.
    fn take_unmerged(state: &mut State, size: usize, stream: StreamId) -> Option<usize> {
        let index = state.unmerged.iter().rposition(|&(s, z, _)| s == stream && z == size)?;
        let (_, _, addr) = state.unmerged.swap_remove(index);
        state.stats.free_blocks -= 1;
        Some(addr)
    }

    /// Moves every unmerged block into the free set, coalescing with its neighbours.
    fn merge_unmerged(state: &mut State) {
        while let Some((_, _, addr)) = state.unmerged.pop() {
            Self::merge_free(state, addr);
        }
    }

    /// Merges a free block (counted in `free_blocks`, not yet in the free set) with free
    /// neighbours of the same segment and files the result in the free set.
    fn merge_free(state: &mut State, addr: usize) {
        let Some(info) = state.blocks.get(&addr).copied() else { return };
        let (mut start, mut size) = (addr, info.size);
        let mergeable = |n: &BlockInfo| !n.allocated && n.segment == info.segment;
        if let Some((&prev_addr, &prev)) = state.blocks.range(..addr).next_back() {
            if mergeable(&prev) && prev_addr + prev.size == addr && state.free.remove(&key_of(prev_addr, &prev)) {
                state.blocks.remove(&addr);
                state.stats.free_blocks -= 1;
                start = prev_addr;
                size += prev.size;
            }
        }
        let next_addr = addr + info.size;
        if let Some(&next) = state.blocks.get(&next_addr) {
            if mergeable(&next) && state.free.remove(&key_of(next_addr, &next)) {
                state.blocks.remove(&next_addr);
                state.stats.free_blocks -= 1;
                size += next.size;
            }
        }
        let merged = BlockInfo { size, allocated: false, ..info };
        state.blocks.insert(start, merged);
        state.free.insert(key_of(start, &merged));
    }

    /// Returns every fully free segment to the device. Callers synchronize first.
    fn release_cached(&self, state: &mut State) {
        self.release_free_segments(state, false);
    }

    /// Returns fully free segments to the device: all of them, or (`only_dead`) those of
    /// streams that are gone, which no stream work can still touch.
    fn release_free_segments(&self, state: &mut State, only_dead: bool) {
        Self::merge_unmerged(state);
        let whole: Vec<(usize, usize)> = state
            .segments
            .iter()
            .filter(|(_, seg)| !only_dead || state.dead.contains(&seg.stream))
            .filter(|(addr, seg)| state.blocks.get(addr).is_some_and(|b| !b.allocated && b.size == seg.size))
            .map(|(&addr, seg)| (addr, seg.size))
            .collect();
        for (addr, size) in whole {
            let info = state.blocks.remove(&addr).expect("segment head is tracked");
            state.free.remove(&key_of(addr, &info));
            state.segments.remove(&addr);
            state.stats.free_blocks -= 1;
            state.stats.reserved_bytes_current -= size;
            state.stats.total_memory = state.stats.reserved_bytes_current;
            let freed = match self.source {
                Source::Device => self.device.free_raw(DevicePtr(addr), size),
                Source::Pinned => self.device.free_pinned(DevicePtr(addr), size),
            };
            // The pool may be releasing from `Drop`: a failed free is kept and surfaced by the
            // next allocation (the first one wins; the rest say the same about the device).
            if let Err(error) = freed {
                state.deferred.get_or_insert(error);
            }
        }
        // Forget dead streams that own nothing any more.
        if only_dead || !state.dead.is_empty() {
            let owners: std::collections::HashSet<StreamId> = state.segments.values().map(|s| s.stream).collect();
            state.dead.retain(|s| owners.contains(s));
        }
    }

    /// A stream is gone and its work done: its cached memory goes back to the device, and its
    /// blocks still in use follow when they are freed.
    pub(crate) fn forget_stream(&self, stream: StreamId) {
        let mut state = self.lock();
        if state.segments.values().any(|s| s.stream == stream) {
            state.dead.insert(stream);
            self.release_free_segments(&mut state, true);
        }
    }

    /// Every segment and its blocks: size, state (allocated, pending on a stream, cached), stream,
    /// and the operator that allocated it (when memory was being profiled). Blocks' sizes add up
    /// to their segment's; allocated and pending blocks add up to `allocated_bytes_current`.
    /// Frees whose streams have finished are completed first (as any allocation would).
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let mut state = self.lock();
        Self::process_pending(&mut state);
        let pending: std::collections::HashSet<usize> = state.pending.iter().map(|p| p.addr).collect();
        let mut segments: BTreeMap<usize, SegmentSnapshot> = state
            .segments
            .iter()
            .map(|(&address, s)| {
                (address, SegmentSnapshot { address, size: s.size, stream: s.stream.0, blocks: Vec::new() })
            })
            .collect();
        for (&address, info) in &state.blocks {
            let block_state = if pending.contains(&address) {
                BlockState::Pending
            } else if info.allocated {
                BlockState::Allocated
            } else {
                BlockState::Cached
            };
            if let Some(segment) = segments.get_mut(&info.segment) {
                segment.blocks.push(BlockSnapshot {
                    address,
                    size: info.size,
                    state: block_state,
                    stream: info.stream.0,
                    op: state.origins.get(&address).cloned(),
                });
            }
        }
        segments.into_values().collect()
    }

    /// Waits for the device and returns all cached (unused) memory to it. Asynchronous errors
    /// stay for the user's next synchronize.
    pub fn empty_cache(&self) -> Result<()> {
        let _span = profiler::span("memory", "empty_cache", || vec![("device", self.device_id().into())]);
        self.streams.drain_all()?;
        let mut state = self.lock();
        Self::process_pending(&mut state);
        self.release_cached(&mut state);
        Ok(())
    }

    /// Caps reserved bytes; `None` removes the cap. Cached memory above a new cap is released.
    pub fn set_limit(&self, limit: Option<usize>) -> Result<()> {
        let over = {
            let mut state = self.lock();
            state.limit = limit;
            state.stats.limit = limit;
            limit.is_some_and(|l| state.stats.reserved_bytes_current > l)
        };
        if over {
            self.empty_cache()?;
        }
        Ok(())
    }

    pub fn reset_peak_stats(&self) {
        let mut state = self.lock();
        let stats = &mut state.stats;
        stats.allocated_bytes_peak = stats.allocated_bytes_current;
        stats.reserved_bytes_peak = stats.reserved_bytes_current;
        stats.largest_recent_request = 0;
    }

    pub fn stats(&self) -> PoolStats {
        let mut state = self.lock();
        Self::process_pending(&mut state);
        Self::merge_unmerged(&mut state);
        let largest = state.stats.largest_recent_request;
        let fragmented = state.free.iter().filter(|k| k.size < largest).map(|k| k.size).sum();
        PoolStats { fragmented_bytes: fragmented, ..state.stats.clone() }
    }

    fn oom_error(&self, state: &State, requested: usize, quota: bool) -> Error {
        Error::OutOfMemory {
            device: self.device.id(),
            requested,
            limit: state.limit,
            allocated: state.stats.allocated_bytes_current,
            cached: state.stats.reserved_bytes_current - state.stats.allocated_bytes_current,
            quota,
        }
    }
}

fn key_of(addr: usize, info: &BlockInfo) -> FreeKey {
    FreeKey { small: info.small, stream: info.stream, size: info.size, addr }
}

/// Offsets of 64-byte-aligned sub-blocks for `sizes`, and the total bytes they span.
fn carve(sizes: &[usize]) -> Option<(usize, Vec<usize>)> {
    let mut offsets = Vec::with_capacity(sizes.len());
    let mut total = 0usize;
    for &size in sizes {
        offsets.push(total);
        total = round_up(total.checked_add(size)?, ALIGNMENT)?;
    }
    Some((total, offsets))
}

/// A child pool's byte quota: what it has in use now and at its peak, and how many
/// allocations it refused.
#[derive(Debug)]
pub(crate) struct Quota {
    limit: usize,
    used: Mutex<(usize, usize)>,
    refused: std::sync::atomic::AtomicU64,
}

impl Quota {
    fn new(limit: usize) -> Quota {
        Quota { limit, used: Mutex::new((0, 0)), refused: std::sync::atomic::AtomicU64::new(0) }
    }

    fn take(&self, bytes: usize) -> std::result::Result<(), usize> {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        if used.0.checked_add(bytes).is_none_or(|total| total > self.limit) {
            self.refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(used.0);
        }
        used.0 += bytes;
        used.1 = used.1.max(used.0);
        Ok(())
    }

    pub(super) fn give_back(&self, bytes: usize) {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        used.0 = used.0.saturating_sub(bytes);
    }
}

/// A pool with its own byte quota that draws its blocks from a parent pool (the server's
/// per-session pools). Its memory is cached by the parent, so sessions share warm blocks but
/// can never hold more than their quota.
#[derive(Debug, Clone)]
pub struct ChildPool {
    parent: Arc<MemoryPool>,
    quota: Arc<Quota>,
}

impl ChildPool {
    pub fn allocate(&self, bytes: usize, stream: StreamId) -> Result<Buffer> {
        let size = self.parent.block_size(bytes);
        if let Err(in_use) = self.quota.take(size) {
            let state = self.parent.lock();
            return Err(Error::OutOfMemory {
                device: self.parent.device.id(),
                requested: bytes,
                limit: Some(self.quota.limit),
                allocated: in_use,
                cached: state.stats.reserved_bytes_current - state.stats.allocated_bytes_current,
                quota: true,
            });
        }
        match self.parent.allocate(bytes, stream) {
            Ok(mut buffer) => {
                buffer.quota = Some(Arc::clone(&self.quota));
                Ok(buffer)
            }
            Err(error) => {
                self.quota.give_back(size);
                Err(error)
            }
        }
    }

    pub fn allocate_many(&self, sizes: &[usize], stream: StreamId) -> Result<Vec<SubBuffer>> {
        let (total, offsets) =
            carve(sizes).ok_or_else(|| self.parent.oom_error(&self.parent.lock(), usize::MAX, true))?;
        let block = Arc::new(self.allocate(total, stream)?);
        Ok(offsets
            .into_iter()
            .zip(sizes)
            .map(|(offset, &len)| SubBuffer { block: Arc::clone(&block), offset, len })
            .collect())
    }

    /// The pool this one draws its blocks from.
    pub fn parent(&self) -> &Arc<MemoryPool> {
        &self.parent
    }

    pub fn quota(&self) -> usize {
        self.quota.limit
    }

    /// (bytes in use, peak bytes in use), counted in block sizes.
    pub fn usage(&self) -> (usize, usize) {
        *self.quota.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many allocations the quota has refused so far: a caller that sees this grow across
    /// its call knows an out-of-memory error came from the quota, not from the device.
    pub fn refusals(&self) -> u64 {
        self.quota.refused.load(std::sync::atomic::Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::cpu::CpuDevice;
    use crate::device::{EventBackend, StreamBackend};
    use crate::ids::DeviceId;

    /// The CPU device, except that returning memory reports a vendor error (the memory is
    /// still freed, so the test leaks nothing): what a failing `aclrtFree` looks like.
    #[derive(Debug, Default)]
    struct FailingFree {
        frees: AtomicUsize,
    }

    impl Device for FailingFree {
        fn id(&self) -> DeviceId {
            DeviceId::CPU
        }
        fn host_accessible(&self) -> bool {
            true
        }
        fn allocate_raw(&self, bytes: usize) -> Result<DevicePtr> {
            CpuDevice.allocate_raw(bytes)
        }
        fn free_raw(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
            CpuDevice.free_raw(ptr, bytes)?;
            self.frees.fetch_add(1, Ordering::SeqCst);
            Err(Error::Driver { device: DeviceId::CPU, api: "test_free", code: 507_899, message: "device lost".into() })
        }
        fn allocate_pinned(&self, bytes: usize) -> Result<DevicePtr> {
            CpuDevice.allocate_pinned(bytes)
        }
        fn free_pinned(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
            CpuDevice.free_pinned(ptr, bytes)
        }
        fn create_stream(&self) -> Result<Arc<dyn StreamBackend>> {
            CpuDevice.create_stream()
        }
        fn create_event(&self) -> Result<Arc<dyn EventBackend>> {
            CpuDevice.create_event()
        }
    }

    #[test]
    fn a_failed_device_free_is_recorded_and_surfaced_by_the_next_allocation() {
        let device = Arc::new(FailingFree::default());
        let pool = Arc::new(MemoryPool::new(device.clone(), Source::Device, Arc::new(StreamRegistry::default())));
        drop(pool.allocate(1 << 20, StreamId::HOST).unwrap()); // cached, not yet returned
        pool.empty_cache().unwrap(); // returns the segment: the free fails (nowhere to report)
        assert_eq!(device.frees.load(Ordering::SeqCst), 1);
        match pool.allocate(64, StreamId::HOST) {
            Err(Error::Driver { api, code, .. }) => assert_eq!((api, code), ("test_free", 507_899)),
            other => panic!("the failed free was lost: {other:?}"),
        }
        assert_eq!(
            Error::Driver { device: DeviceId::CPU, api: "x", code: 1, message: String::new() }.kind(),
            crate::ErrorKind::Device
        );
        // Reported once; the pool keeps working.
        let again = pool.allocate(64, StreamId::HOST).expect("the error is reported once");
        assert_eq!(again.len(), 64);
    }
}
