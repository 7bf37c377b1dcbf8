//! Integration tests of the caching memory pool of the CPU device.
//!
//! The pool is a per-device global and cargo runs the tests of this file on parallel threads,
//! so every test takes `fresh_pool()`'s lock first: it serializes the tests and starts each
//! one from an empty cache with no limit. Tests then compare counters against that state.

use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};

use opbridge_runtime::{
    test_device, DeviceContext, DeviceId, Error, MemoryPool, PoolStats, Stream, StreamId, ALIGNMENT,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const SMALL_SEGMENT: usize = 2 * MIB;
const LARGE_SEGMENT: usize = 20 * MIB;

/// Serializes the tests of this file (they all read the one global pool's counters).
static SERIAL: Mutex<()> = Mutex::new(());

/// Takes the file's lock, removes any limit and returns the pool with an empty cache.
fn fresh_pool(ctx: &DeviceContext) -> (MutexGuard<'static, ()>, Arc<MemoryPool>) {
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let pool = Arc::clone(ctx.pool());
    pool.set_limit(None).expect("removing the limit");
    pool.empty_cache().expect("emptying the cache");
    pool.reset_peak_stats();
    let stats = pool.stats();
    assert_eq!(stats.allocated_blocks, 0, "an earlier test leaked a block: {stats:?}");
    assert_eq!(stats.reserved_bytes_current, 0, "empty_cache left memory reserved: {stats:?}");
    assert_eq!(stats.free_blocks, 0, "empty_cache left cached blocks: {stats:?}");
    (guard, pool)
}

fn new_stream(ctx: &DeviceContext) -> Stream {
    Stream::new(ctx).expect("creating a stream")
}

/// Invariants that hold after every pool operation.
fn check_invariants(stats: &PoolStats) {
    assert!(stats.reserved_bytes_current >= stats.allocated_bytes_current, "{stats:?}");
    assert!(stats.allocated_bytes_peak >= stats.allocated_bytes_current, "{stats:?}");
    assert!(stats.reserved_bytes_peak >= stats.reserved_bytes_current, "{stats:?}");
    assert_eq!(stats.total_memory, stats.reserved_bytes_current, "{stats:?}");
}

fn is_aligned(addr: usize) -> bool {
    addr & (ALIGNMENT - 1) == 0 // ALIGNMENT is a power of two
}

#[test]
fn alignment_constant_is_64_bytes() {
    assert_eq!(ALIGNMENT, 64);
}

fn block_sizes_round_up_to_512_bytes(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    assert_eq!(pool.block_size(0), 512);
    assert_eq!(pool.block_size(1), 512);
    assert_eq!(pool.block_size(512), 512);
    assert_eq!(pool.block_size(513), 1024);
    assert_eq!(pool.block_size(MIB), MIB);
    assert_eq!(pool.block_size(MIB + 1), MIB + 512);
}
test_device!(block_sizes_round_up_to_512_bytes);

fn small_requests_are_carved_from_one_2mib_segment(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let hits = pool.stats().num_cache_hits;
    let a = pool.allocate(1, StreamId::HOST).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.reserved_bytes_current, SMALL_SEGMENT);
    assert_eq!(stats.allocated_bytes_current, 512);
    assert_eq!(stats.allocated_blocks, 1);
    assert_eq!(stats.free_blocks, 1, "the rest of the segment is one cached block");
    assert_eq!(a.len(), 1);
    assert_eq!(a.stream(), StreamId::HOST);

    let b = pool.allocate(513, StreamId::HOST).unwrap();
    let c = pool.allocate(MIB, StreamId::HOST).unwrap();
    // Best fit from the segment's remainder: the blocks follow each other.
    assert_eq!(b.ptr().0, a.ptr().0 + 512);
    assert_eq!(c.ptr().0, b.ptr().0 + 1024);
    let stats = pool.stats();
    assert_eq!(stats.reserved_bytes_current, SMALL_SEGMENT, "1 MiB is still a small request");
    assert_eq!(stats.allocated_bytes_current, 512 + 1024 + MIB);
    assert_eq!(stats.allocated_blocks, 3);
    assert_eq!(stats.num_cache_hits, hits + 2, "b and c came from the cached rest of the segment");
    check_invariants(&stats);

    // The segment is full up to its last 1 MiB - 1.5 KiB; a request bigger than that needs a
    // second small segment.
    let d = pool.allocate(MIB - 1024, StreamId::HOST).unwrap();
    assert_eq!(pool.stats().reserved_bytes_current, 2 * SMALL_SEGMENT);
    drop((a, b, c, d));
    let stats = pool.stats();
    assert_eq!(stats.allocated_bytes_current, 0);
    assert_eq!(stats.free_blocks, 2, "each segment coalesces back into one free block");
}
test_device!(small_requests_are_carved_from_one_2mib_segment);

fn large_requests_use_large_segments(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    // 10 MiB and more: a segment of its own, rounded up to 2 MiB. The rest (1 MiB - 512) is
    // too small to split off a large block: the request gets the whole segment.
    let c = pool.allocate(11 * MIB + 1, StreamId::HOST).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.reserved_bytes_current, 12 * MIB);
    assert_eq!(stats.allocated_bytes_current, 12 * MIB);
    assert_eq!(stats.free_blocks, 0, "no sliver was split off");
    assert!(is_aligned(c.ptr().0));

    // Just over 1 MiB: a large request, from a shared 20 MiB segment.
    let a = pool.allocate(MIB + 1, StreamId::HOST).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.reserved_bytes_current, 12 * MIB + LARGE_SEGMENT);
    assert_eq!(stats.allocated_bytes_current, 12 * MIB + MIB + 512);
    // A second one comes from the same segment.
    let b = pool.allocate(3 * MIB, StreamId::HOST).unwrap();
    assert_eq!(b.ptr().0, a.ptr().0 + MIB + 512);
    assert_eq!(pool.stats().reserved_bytes_current, 12 * MIB + LARGE_SEGMENT);

    // Small and large blocks never mix: a small request does not split the large segment.
    let small = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.reserved_bytes_current, LARGE_SEGMENT + 12 * MIB + SMALL_SEGMENT);
    check_invariants(&stats);
    // ... and a large request does not take the small segment's 2 MiB - 4 KiB remainder.
    let d = pool.allocate(MIB + 512, StreamId::HOST).unwrap();
    assert!(d.ptr().0 >= a.ptr().0 && d.ptr().0 < a.ptr().0 + LARGE_SEGMENT, "from the large segment");
    assert_eq!(pool.stats().reserved_bytes_current, LARGE_SEGMENT + 12 * MIB + SMALL_SEGMENT);
    drop((a, b, c, d, small));
    assert_eq!(pool.stats().allocated_bytes_current, 0);
}
test_device!(large_requests_use_large_segments);

fn freed_neighbours_coalesce_and_serve_their_combined_size(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let a = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let b = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let c = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let d = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    for (x, y) in [(&a, &b), (&b, &c), (&c, &d)] {
        assert_eq!(y.ptr().0, x.ptr().0 + 4 * KIB, "consecutive blocks of one segment");
    }
    let (b_ptr, reserved) = (b.ptr(), pool.stats().reserved_bytes_current);
    assert_eq!(pool.stats().free_blocks, 1, "only the segment's tail is free");

    drop(b);
    assert_eq!(pool.stats().free_blocks, 2, "b and the tail");
    drop(c);
    let stats = pool.stats();
    assert_eq!(stats.free_blocks, 2, "c merged into b");
    assert_eq!(stats.allocated_blocks, 2);
    assert_eq!(stats.allocated_bytes_current, 8 * KIB);

    // b + c serve a request of their combined size, without a new segment: it is the best fit.
    let hits = stats.num_cache_hits;
    let bc = pool.allocate(8 * KIB, StreamId::HOST).unwrap();
    assert_eq!(bc.ptr(), b_ptr);
    let stats = pool.stats();
    assert_eq!(stats.reserved_bytes_current, reserved);
    assert_eq!(stats.num_cache_hits, hits + 1);
    assert_eq!(stats.free_blocks, 1, "the merged block was used whole");

    // Free the outer blocks first, then the middle one: all merges back into one block.
    drop(a);
    drop(d);
    assert_eq!(pool.stats().free_blocks, 2, "a alone, d merged with the tail");
    drop(bc);
    let stats = pool.stats();
    assert_eq!(stats.free_blocks, 1, "the whole segment is one free block again");
    assert_eq!(stats.allocated_bytes_current, 0);
    assert_eq!(stats.allocated_blocks, 0);
    // The largest small request is served from the start of the coalesced segment.
    let all_small = pool.allocate(MIB, StreamId::HOST).unwrap();
    assert_eq!(all_small.ptr().0, b_ptr.0 - 4 * KIB, "served from the start of the merged segment");
    assert_eq!(pool.stats().num_cache_hits, hits + 2);
}
test_device!(freed_neighbours_coalesce_and_serve_their_combined_size);

fn free_order_does_not_matter_for_coalescing(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    // Every permutation of freeing four neighbours ends in one free block per segment.
    let orders: [[usize; 4]; 6] = [[0, 1, 2, 3], [3, 2, 1, 0], [0, 2, 1, 3], [1, 3, 0, 2], [2, 0, 3, 1], [3, 0, 2, 1]];
    for order in orders {
        let mut blocks: Vec<Option<_>> =
            [512, 1536, 4096, 700].iter().map(|&n| Some(pool.allocate(n, StreamId::HOST).unwrap())).collect();
        let reserved = pool.stats().reserved_bytes_current;
        for (freed, &i) in order.iter().enumerate() {
            drop(blocks[i].take());
            let stats = pool.stats();
            assert_eq!(stats.allocated_blocks, 3 - freed, "order {order:?}");
            assert_eq!(stats.reserved_bytes_current, reserved);
            check_invariants(&stats);
        }
        let stats = pool.stats();
        assert_eq!(stats.free_blocks, 1, "order {order:?}: {stats:?}");
        assert_eq!(stats.allocated_bytes_current, 0);
    }
    pool.empty_cache().unwrap();
    assert_eq!(pool.stats().reserved_bytes_current, 0, "fully coalesced segments are released");
}
test_device!(free_order_does_not_matter_for_coalescing);

fn every_block_is_64_byte_aligned(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let sizes = [0, 1, 3, 63, 64, 65, 100, 511, 512, 513, 1000, 4095, 4097, 65_537, MIB - 1, MIB, MIB + 3, 5 * MIB + 7];
    let buffers: Vec<_> = sizes.iter().map(|&n| pool.allocate(n, StreamId::HOST).unwrap()).collect();
    for (buffer, &n) in buffers.iter().zip(&sizes) {
        assert!(is_aligned(buffer.ptr().0), "{n} bytes at {:#x}", buffer.ptr().0);
        assert_eq!(buffer.len(), n);
        assert_eq!(buffer.is_empty(), n == 0);
    }
    let subs = pool.allocate_many(&[1, 3, 63, 64, 65, 100, 7, 0, 129], StreamId::HOST).unwrap();
    for sub in &subs {
        assert!(is_aligned(sub.ptr().0), "sub-buffer of {} bytes at {:#x}", sub.len(), sub.ptr().0);
    }
}
test_device!(every_block_is_64_byte_aligned);

fn reuse_counts_as_a_cache_hit(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let before = pool.stats();
    let first = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let ptr = first.ptr();
    let after_first = pool.stats();
    assert_eq!(after_first.num_allocs, before.num_allocs + 1);
    assert_eq!(after_first.num_cache_hits, before.num_cache_hits, "the first block needed a new segment");
    drop(first);
    for round in 1..=3u64 {
        let again = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
        assert_eq!(again.ptr(), ptr, "the cached block is handed out again");
        let stats = pool.stats();
        assert_eq!(stats.num_cache_hits, before.num_cache_hits + round);
        assert_eq!(stats.num_allocs, before.num_allocs + 1 + round);
        assert_eq!(stats.reserved_bytes_current, after_first.reserved_bytes_current);
    }
}
test_device!(reuse_counts_as_a_cache_hit);

fn block_used_on_another_stream_is_held_until_that_stream_is_done(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let (a, b) = (new_stream(ctx), new_stream(ctx));
    let buffer = pool.allocate(4 * KIB, a.id()).unwrap();
    let ptr = buffer.ptr();

    // Stream B runs a slow kernel that "reads" the block until we let it finish.
    let (release, gate) = mpsc::channel::<()>();
    b.launch(Box::new(move || {
        let _ = gate.recv(); // Err when the test unwinds: the kernel ends either way.
        Ok(())
    }))
    .unwrap();
    buffer.record_use(&b);
    drop(buffer);

    let stats = pool.stats();
    assert_eq!(stats.pending_free_blocks, 1, "freed while B may still use it");
    assert_eq!(stats.allocated_blocks, 1, "a pending block is not free yet");
    let other = pool.allocate(4 * KIB, a.id()).unwrap();
    assert_ne!(other.ptr(), ptr, "the block must not be reused while B is busy");
    assert_eq!(pool.stats().pending_free_blocks, 1);
    assert!(!b.query(), "B is still blocked");

    release.send(()).unwrap();
    b.synchronize().unwrap();
    let stats = pool.stats();
    assert_eq!(stats.pending_free_blocks, 0, "B is done: the block is free");
    assert_eq!(stats.allocated_blocks, 1);
    // `other` stays live, so the only 4 KiB-sized candidate is the block B released.
    let reused = pool.allocate(4 * KIB, a.id()).unwrap();
    assert_eq!(reused.ptr(), ptr, "now the block is handed out again on A");
    drop(other);
}
test_device!(block_used_on_another_stream_is_held_until_that_stream_is_done);

fn use_on_the_owning_stream_needs_no_wait(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let a = new_stream(ctx);
    let (release, gate) = mpsc::channel::<()>();
    a.launch(Box::new(move || {
        let _ = gate.recv();
        Ok(())
    }))
    .unwrap();
    let buffer = pool.allocate(4 * KIB, a.id()).unwrap();
    let ptr = buffer.ptr();
    buffer.record_use(&a); // its own stream: stream order already covers reuse
    drop(buffer);
    assert_eq!(pool.stats().pending_free_blocks, 0);
    let again = pool.allocate(4 * KIB, a.id()).unwrap();
    assert_eq!(again.ptr(), ptr, "reuse on the same stream is ordered by the stream itself");
    release.send(()).unwrap();
    a.synchronize().unwrap();
}
test_device!(use_on_the_owning_stream_needs_no_wait);

fn use_on_several_streams_waits_for_all_of_them(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let (b, c) = (new_stream(ctx), new_stream(ctx));
    let buffer = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let ptr = buffer.ptr();
    let mut releases = Vec::new();
    for stream in [&b, &c] {
        let (release, gate) = mpsc::channel::<()>();
        stream
            .launch(Box::new(move || {
                let _ = gate.recv();
                Ok(())
            }))
            .unwrap();
        buffer.record_use(stream);
        buffer.record_use(stream); // recorded once
        releases.push(release);
    }
    drop(buffer);
    assert_eq!(pool.stats().pending_free_blocks, 1);
    releases[0].send(()).unwrap();
    b.synchronize().unwrap();
    assert_eq!(pool.stats().pending_free_blocks, 1, "C still uses the block");
    let held = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    assert_ne!(held.ptr(), ptr);
    releases[1].send(()).unwrap();
    c.synchronize().unwrap();
    assert_eq!(pool.stats().pending_free_blocks, 0);
    assert_eq!(pool.allocate(4 * KIB, StreamId::HOST).unwrap().ptr(), ptr);
    drop(held);
}
test_device!(use_on_several_streams_waits_for_all_of_them);

fn cached_blocks_belong_to_their_stream(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let (a, b) = (new_stream(ctx), new_stream(ctx));
    let on_a = pool.allocate(64 * KIB, a.id()).unwrap();
    let ptr = on_a.ptr();
    drop(on_a);
    let before = pool.stats();
    assert_eq!(before.reserved_bytes_current, SMALL_SEGMENT);

    // B does not get A's cached block: it gets a segment of its own.
    let on_b = pool.allocate(64 * KIB, b.id()).unwrap();
    assert_eq!(on_b.stream(), b.id());
    let stats = pool.stats();
    assert_ne!(on_b.ptr(), ptr);
    assert_eq!(stats.num_cache_hits, before.num_cache_hits);
    assert_eq!(stats.reserved_bytes_current, 2 * SMALL_SEGMENT);
    let b_ptr = on_b.ptr();
    drop(on_b);

    // Each stream then reuses its own block.
    let again_a = pool.allocate(64 * KIB, a.id()).unwrap();
    let again_b = pool.allocate(64 * KIB, b.id()).unwrap();
    assert_eq!(again_a.ptr(), ptr);
    assert_eq!(again_b.ptr(), b_ptr);
    // The host path has its own blocks too.
    let host = pool.allocate(64 * KIB, StreamId::HOST).unwrap();
    assert_ne!(host.ptr(), ptr);
    assert_ne!(host.ptr(), b_ptr);
    let stats = pool.stats();
    assert_eq!(stats.num_cache_hits, before.num_cache_hits + 2);
    assert_eq!(stats.reserved_bytes_current, 3 * SMALL_SEGMENT);
}
test_device!(cached_blocks_belong_to_their_stream);

fn limit_exceeded_reports_out_of_memory_with_fields(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    pool.set_limit(Some(4 * MIB)).unwrap();
    assert_eq!(pool.stats().limit, Some(4 * MIB));
    let held = pool.allocate(MIB, StreamId::HOST).unwrap(); // one 2 MiB small segment
    let before = pool.stats();

    let error = pool.allocate(3 * MIB, StreamId::HOST).unwrap_err();
    match &error {
        Error::OutOfMemory { device, requested, limit, allocated, cached, quota } => {
            assert_eq!(*device, DeviceId::CPU);
            assert_eq!(*requested, 3 * MIB);
            assert_eq!(*limit, Some(4 * MIB));
            assert_eq!(*allocated, MIB);
            assert_eq!(*cached, SMALL_SEGMENT - MIB, "the rest of the held block's segment");
            assert!(!quota);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let message = error.to_string();
    assert!(message.contains("out of memory") && message.contains(&(3 * MIB).to_string()), "{message}");
    let stats = pool.stats();
    assert_eq!(stats.num_ooms, before.num_ooms + 1);
    assert_eq!(stats.num_alloc_retries, before.num_alloc_retries + 1, "it released its cache and retried once");
    assert_eq!(stats.num_allocs, before.num_allocs);
    assert_eq!(stats.reserved_bytes_current, SMALL_SEGMENT, "the held segment survives the retry");
    // The pool still works under the limit.
    let fits = pool.allocate(512 * KIB, StreamId::HOST).unwrap();
    drop((held, fits));
    pool.set_limit(None).unwrap();
    assert_eq!(pool.stats().limit, None);
}
test_device!(limit_exceeded_reports_out_of_memory_with_fields);

fn an_unrepresentable_request_is_out_of_memory(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    match pool.allocate(usize::MAX, StreamId::HOST) {
        Err(Error::OutOfMemory { requested, quota: false, .. }) => assert_eq!(requested, usize::MAX),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert!(matches!(pool.allocate_many(&[usize::MAX, 64], StreamId::HOST), Err(Error::OutOfMemory { .. })));
    assert_eq!(pool.stats().allocated_blocks, 0);
}
test_device!(an_unrepresentable_request_is_out_of_memory);

fn out_of_memory_retries_after_releasing_the_cache(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let limit = 3 * MIB + MIB / 2;
    pool.set_limit(Some(limit)).unwrap();
    // Under the limit a large request gets a segment of exactly its size (20 MiB won't fit).
    let large = pool.allocate(3 * MIB, StreamId::HOST).unwrap();
    assert_eq!(pool.stats().reserved_bytes_current, 3 * MIB);
    drop(large);
    let before = pool.stats();
    assert_eq!(before.reserved_bytes_current, 3 * MIB, "the large block stays cached");

    // A small request can't use the cached large block, and neither a 2 MiB segment nor one of
    // exactly 1 MiB fits next to it: the pool releases the cached segment and retries.
    let small = pool.allocate(MIB, StreamId::HOST).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.num_alloc_retries, before.num_alloc_retries + 1);
    assert_eq!(stats.num_ooms, before.num_ooms, "the retry succeeded");
    assert_eq!(stats.reserved_bytes_current, SMALL_SEGMENT);
    assert_eq!(stats.allocated_bytes_current, MIB);
    assert!(is_aligned(small.ptr().0));
    drop(small);
    pool.set_limit(None).unwrap();
}
test_device!(out_of_memory_retries_after_releasing_the_cache);

fn lowering_the_limit_releases_cached_memory(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    drop(pool.allocate(12 * MIB, StreamId::HOST).unwrap());
    assert_eq!(pool.stats().reserved_bytes_current, 12 * MIB);
    pool.set_limit(Some(8 * MIB)).unwrap();
    assert_eq!(pool.stats().reserved_bytes_current, 0, "cache above the new limit is released");
    pool.set_limit(None).unwrap();
}
test_device!(lowering_the_limit_releases_cached_memory);

fn empty_cache_releases_only_unused_segments(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let small = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let large = pool.allocate(12 * MIB, StreamId::HOST).unwrap();
    assert_eq!(pool.stats().reserved_bytes_current, SMALL_SEGMENT + 12 * MIB);
    drop(large);
    pool.empty_cache().unwrap();
    let stats = pool.stats();
    assert_eq!(stats.reserved_bytes_current, SMALL_SEGMENT, "the segment holding `small` stays");
    assert_eq!(stats.free_blocks, 1, "the small segment's tail");
    assert_eq!(stats.allocated_bytes_current, 4 * KIB);
    check_invariants(&stats);
    drop(small);
    pool.empty_cache().unwrap();
    let stats = pool.stats();
    assert_eq!(stats.reserved_bytes_current, 0);
    assert_eq!(stats.total_memory, 0);
    assert_eq!(stats.free_blocks, 0);
    assert!(stats.reserved_bytes_peak >= SMALL_SEGMENT + 12 * MIB, "the peak survives empty_cache");
}
test_device!(empty_cache_releases_only_unused_segments);

fn empty_cache_waits_for_work_on_dropped_streams(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let buffer = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let finished = {
        let stream = new_stream(ctx);
        stream
            .launch(Box::new(|| {
                std::thread::sleep(std::time::Duration::from_millis(100));
                Ok(())
            }))
            .unwrap();
        buffer.record_use(&stream);
        stream.record_new_event().unwrap()
    }; // the last handle of the stream goes with the buffer: its work is still running
    drop(buffer);
    // empty_cache synchronizes the device, including work enqueued on streams since dropped.
    pool.empty_cache().unwrap();
    let stats = pool.stats();
    // (Should it not, leave a clean pool for the next test before failing.)
    finished.synchronize().unwrap();
    pool.empty_cache().unwrap();
    assert_eq!(stats.pending_free_blocks, 0, "{stats:?}");
    assert_eq!(stats.allocated_blocks, 0, "{stats:?}");
    assert_eq!(stats.reserved_bytes_current, 0, "{stats:?}");
}
test_device!(empty_cache_waits_for_work_on_dropped_streams);

fn reset_peak_stats_starts_peaks_from_current_usage(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let big = pool.allocate(8 * MIB, StreamId::HOST).unwrap();
    drop(big);
    let keep = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let stats = pool.stats();
    assert!(stats.allocated_bytes_peak >= 8 * MIB);
    assert!(stats.reserved_bytes_peak >= LARGE_SEGMENT);
    assert_eq!(stats.largest_recent_request, 8 * MIB);

    pool.reset_peak_stats();
    let stats = pool.stats();
    assert_eq!(stats.allocated_bytes_peak, stats.allocated_bytes_current);
    assert_eq!(stats.allocated_bytes_peak, 4 * KIB);
    assert_eq!(stats.reserved_bytes_peak, stats.reserved_bytes_current);
    assert_eq!(stats.largest_recent_request, 0);

    let more = pool.allocate(16 * KIB, StreamId::HOST).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.allocated_bytes_peak, 20 * KIB);
    assert_eq!(stats.largest_recent_request, 16 * KIB);
    drop((keep, more));
    assert_eq!(pool.stats().allocated_bytes_peak, 20 * KIB, "freeing does not lower the peak");
}
test_device!(reset_peak_stats_starts_peaks_from_current_usage);

fn fragmented_bytes_counts_free_blocks_too_small_for_the_largest_request(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    pool.reset_peak_stats();
    let a = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let b = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    let c = pool.allocate(4 * KIB, StreamId::HOST).unwrap();
    assert_eq!(pool.stats().fragmented_bytes, 0, "the only free block is the big tail");
    drop(b); // a 4 KiB hole between a and c
    assert_eq!(pool.stats().fragmented_bytes, 0, "the hole fits the largest request (4 KiB)");
    let d = pool.allocate(8 * KIB, StreamId::HOST).unwrap();
    assert_ne!(d.ptr().0, a.ptr().0 + 4 * KIB, "8 KiB does not fit in the hole");
    assert_eq!(pool.stats().fragmented_bytes, 4 * KIB, "now the hole is too small to serve 8 KiB");
    drop(c); // the hole grows to 8 KiB (b + c): big enough again
    assert_eq!(pool.stats().fragmented_bytes, 0);
    drop((a, d));
    pool.reset_peak_stats();
    assert_eq!(pool.stats().fragmented_bytes, 0, "no recent request: nothing counts as fragmented");
}
test_device!(fragmented_bytes_counts_free_blocks_too_small_for_the_largest_request);

fn child_pool_enforces_its_quota(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let child = pool.child(64 * KIB);
    assert_eq!(child.quota(), 64 * KIB);
    assert_eq!(child.usage(), (0, 0));
    let parent_before = pool.stats();

    let a = child.allocate(40_000, StreamId::HOST).unwrap();
    let block_a = pool.block_size(40_000);
    assert_eq!(block_a, 40_448);
    assert_eq!(child.usage(), (block_a, block_a));
    let parent = pool.stats();
    assert_eq!(parent.allocated_bytes_current, parent_before.allocated_bytes_current + block_a);
    assert_eq!(parent.allocated_blocks, parent_before.allocated_blocks + 1);
    assert_eq!(parent.num_allocs, parent_before.num_allocs + 1, "child allocations count in the parent");

    match child.allocate(30_000, StreamId::HOST) {
        Err(Error::OutOfMemory { requested, limit, allocated, quota, .. }) => {
            assert_eq!(requested, 30_000);
            assert_eq!(limit, Some(64 * KIB));
            assert_eq!(allocated, block_a, "what the child holds");
            assert!(quota, "a quota failure says so");
        }
        other => panic!("expected a quota OutOfMemory, got {other:?}"),
    }
    assert_eq!(child.usage().0, block_a, "a refused request takes nothing");
    assert!(child.allocate(30_000, StreamId::HOST).unwrap_err().to_string().contains("quota"));
    assert_eq!(child.refusals(), 2, "each refusal is counted");

    // The parent itself is not limited by the child's quota.
    let outside = pool.allocate(128 * KIB, StreamId::HOST).unwrap();
    drop(outside);

    drop(a);
    assert_eq!(child.usage(), (0, block_a), "usage drops, the peak stays");
    let b = child.allocate(30_000, StreamId::HOST).unwrap();
    let c = child.allocate(30_000, StreamId::HOST).unwrap();
    assert_eq!(child.usage().0, 2 * pool.block_size(30_000));
    // A clone shares the quota.
    let twin = child.clone();
    assert!(twin.allocate(8 * KIB, StreamId::HOST).is_err(), "64 KiB - 2 x 30208 leaves < 8 KiB");
    assert_eq!(child.refusals(), 3, "a clone's refusals are the pool's");
    drop((b, c));
    assert_eq!(child.usage().0, 0);
    assert_eq!(twin.usage().0, 0);
    assert_eq!(pool.stats().allocated_bytes_current, parent_before.allocated_bytes_current);
}
test_device!(child_pool_enforces_its_quota);

fn child_pool_allocate_many_counts_against_the_quota(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let child = pool.child(16 * KIB);
    let subs = child.allocate_many(&[1000, 3000, 64], StreamId::HOST).unwrap();
    assert_eq!(subs.len(), 3);
    let block = pool.block_size(subs[0].block().len());
    assert_eq!(child.usage().0, block);
    assert!(matches!(
        child.allocate_many(&[8 * KIB, 8 * KIB], StreamId::HOST),
        Err(Error::OutOfMemory { quota: true, .. })
    ));
    for sub in &subs {
        assert!(is_aligned(sub.ptr().0));
    }
    drop(subs);
    assert_eq!(child.usage().0, 0);
    assert_eq!(pool.stats().allocated_blocks, 0);
}
test_device!(child_pool_allocate_many_counts_against_the_quota);

fn child_pool_gives_its_quota_back_when_the_parent_fails(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    pool.set_limit(Some(SMALL_SEGMENT)).unwrap();
    let child = pool.child(64 * MIB);
    match child.allocate(4 * MIB, StreamId::HOST) {
        Err(Error::OutOfMemory { limit, quota, .. }) => {
            assert_eq!(limit, Some(SMALL_SEGMENT));
            assert!(!quota, "the device limit failed, not the quota");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(child.usage().0, 0, "the refused request's quota is given back");
    pool.set_limit(None).unwrap();
    let fits = child.allocate(4 * MIB, StreamId::HOST).unwrap();
    assert_eq!(child.usage().0, 4 * MIB);
    drop(fits);
    assert_eq!(child.usage().0, 0);
}
test_device!(child_pool_gives_its_quota_back_when_the_parent_fails);

/// Many child pools (a server's sessions) allocating and freeing at once from their own
/// threads: each stays within its quota after every call, and at every pause the children's use
/// adds up to exactly what the parent has allocated.
fn child_pools_under_concurrent_traffic_add_up_to_the_parent(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    const CHILDREN: usize = 8;
    const ROUNDS: usize = 5;
    const STEPS: usize = 400;
    let quota = 256 * KIB;
    let children: Vec<_> = (0..CHILDREN).map(|_| pool.child(quota)).collect();
    let barrier = std::sync::Barrier::new(CHILDREN + 1);
    std::thread::scope(|scope| {
        for (k, child) in children.iter().enumerate() {
            let barrier = &barrier;
            scope.spawn(move || {
                let mut held: Vec<opbridge_runtime::Buffer> = Vec::new();
                let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (k as u64 + 1);
                for _ in 0..ROUNDS {
                    for _ in 0..STEPS {
                        // xorshift: a different sequence of sizes and frees per child
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        if held.len() > 4 && state.is_multiple_of(3) {
                            held.swap_remove((state >> 8) as usize % held.len());
                        } else if let Ok(buffer) = child.allocate((state >> 20) as usize % (64 * KIB), StreamId::HOST) {
                            held.push(buffer);
                        }
                        assert!(child.usage().0 <= quota, "child {k} over its quota: {:?}", child.usage());
                    }
                    barrier.wait(); // pause: the main thread checks the sum
                    barrier.wait();
                }
                drop(held);
            });
        }
        for _ in 0..ROUNDS {
            barrier.wait();
            let children_use: usize = children.iter().map(|c| c.usage().0).sum();
            let stats = pool.stats();
            assert_eq!(children_use, stats.allocated_bytes_current, "{stats:?}");
            check_invariants(&stats);
            barrier.wait();
        }
    });
    assert!(children.iter().all(|c| c.usage().0 == 0));
    assert_eq!(pool.stats().allocated_bytes_current, 0, "every byte went back to the parent");
    assert!(children.iter().any(|c| c.refusals() > 0), "the traffic reached the quotas");
}
test_device!(child_pools_under_concurrent_traffic_add_up_to_the_parent);

fn allocate_many_carves_one_block_into_disjoint_aligned_pieces(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let sizes = [100, 1, 4096, 63, 65, 0, 1000];
    let before = pool.stats();
    let mut subs = pool.allocate_many(&sizes, StreamId::HOST).unwrap();
    let stats = pool.stats();
    assert_eq!(stats.allocated_blocks, before.allocated_blocks + 1, "one block for all");
    assert_eq!(stats.num_allocs, before.num_allocs + 1, "one pool operation");

    let block = Arc::clone(subs[0].block());
    let packed: usize = sizes.iter().map(|&n| n.div_ceil(ALIGNMENT) * ALIGNMENT).sum();
    assert_eq!(block.len(), packed, "sub-buffers are packed at 64-byte steps");
    let (start, end) = (block.ptr().0, block.ptr().0 + block.len());
    for (sub, &n) in subs.iter().zip(&sizes) {
        assert!(Arc::ptr_eq(sub.block(), &block), "all from the same block");
        assert_eq!(sub.len(), n);
        assert_eq!(sub.is_empty(), n == 0);
        assert!(is_aligned(sub.ptr().0));
        assert!(sub.ptr().0 >= start && sub.ptr().0 + n <= end, "inside the block");
    }
    for (i, x) in subs.iter().enumerate() {
        for y in &subs[i + 1..] {
            let disjoint = x.ptr().0 + x.len() <= y.ptr().0 || y.ptr().0 + y.len() <= x.ptr().0;
            assert!(x.is_empty() || y.is_empty() || disjoint, "{x:?} overlaps {y:?}");
        }
    }

    drop(block);
    // The block goes back only with the last sub-buffer.
    let last = subs.pop().unwrap();
    let clone_of_last = last.clone();
    drop(subs);
    assert_eq!(pool.stats().allocated_blocks, before.allocated_blocks + 1);
    drop(last);
    assert_eq!(pool.stats().allocated_blocks, before.allocated_blocks + 1, "a clone still holds it");
    drop(clone_of_last);
    let stats = pool.stats();
    assert_eq!(stats.allocated_blocks, before.allocated_blocks);
    assert_eq!(stats.allocated_bytes_current, before.allocated_bytes_current);

    let none = pool.allocate_many(&[], StreamId::HOST).unwrap();
    assert!(none.is_empty());
    assert_eq!(pool.stats().allocated_blocks, before.allocated_blocks);
}
test_device!(allocate_many_carves_one_block_into_disjoint_aligned_pieces);

/// A 64-bit linear congruential generator (Knuth's MMIX constants): deterministic, no crates.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

enum Held {
    One(opbridge_runtime::Buffer),
    Many(Vec<opbridge_runtime::SubBuffer>),
}

impl Held {
    /// (start, end) of the pool block behind it.
    fn range(&self) -> (usize, usize) {
        match self {
            Held::One(b) => (b.ptr().0, b.ptr().0 + b.len()),
            Held::Many(subs) => {
                let block = subs[0].block();
                (block.ptr().0, block.ptr().0 + block.len())
            }
        }
    }
}

fn randomized_alloc_and_free_keep_the_stats_consistent(ctx: &'static Arc<DeviceContext>) {
    let (_guard, pool) = fresh_pool(ctx);
    let streams = [new_stream(ctx), new_stream(ctx)];
    let ids = [StreamId::HOST, streams[0].id(), streams[1].id()];
    for seed in [1u64, 42, 0x5eed_cafe] {
        let mut rng = Lcg(seed);
        let mut held: Vec<Held> = Vec::new();
        for step in 0..1500 {
            if held.is_empty() || rng.below(100) < 55 {
                let bytes = match rng.below(100) {
                    0..=69 => 1 + rng.below(64 * KIB),
                    70..=89 => 1 + rng.below(MIB),
                    90..=97 => MIB + 1 + rng.below(8 * MIB),
                    _ => 10 * MIB + rng.below(4 * MIB),
                };
                let stream = ids[rng.below(ids.len())];
                let item = if rng.below(10) == 0 {
                    let sizes: Vec<usize> = (0..1 + rng.below(6)).map(|_| rng.below(3000)).collect();
                    let subs = pool.allocate_many(&sizes, stream).unwrap();
                    for (sub, &n) in subs.iter().zip(&sizes) {
                        assert!(is_aligned(sub.ptr().0));
                        assert_eq!(sub.len(), n);
                    }
                    Held::Many(subs)
                } else {
                    let buffer = pool.allocate(bytes, stream).unwrap();
                    assert!(is_aligned(buffer.ptr().0), "step {step}: {buffer:?}");
                    assert_eq!(buffer.stream(), stream);
                    Held::One(buffer)
                };
                let (start, end) = item.range();
                for other in &held {
                    let (s, e) = other.range();
                    assert!(end <= s || e <= start, "seed {seed} step {step}: live blocks overlap");
                }
                held.push(item);
            } else {
                let i = rng.below(held.len());
                held.swap_remove(i);
            }
            let stats = pool.stats();
            check_invariants(&stats);
            assert_eq!(stats.allocated_blocks, held.len(), "seed {seed} step {step}");
            let requested: usize = held.iter().map(|h| h.range().1 - h.range().0).sum();
            assert!(stats.allocated_bytes_current >= requested, "seed {seed} step {step}");
            assert_eq!(stats.pending_free_blocks, 0, "no stream work: frees are immediate");
        }
        drop(held);
        let stats = pool.stats();
        check_invariants(&stats);
        assert_eq!(stats.allocated_bytes_current, 0, "seed {seed}: {stats:?}");
        assert_eq!(stats.allocated_blocks, 0, "seed {seed}");
        assert!(stats.num_cache_hits > 0, "seed {seed}: some requests reused cached blocks");
        // Everything coalesced back into whole segments, so all of it can be released.
        pool.empty_cache().unwrap();
        let stats = pool.stats();
        assert_eq!(stats.reserved_bytes_current, 0, "seed {seed}: a segment did not coalesce: {stats:?}");
        assert_eq!(stats.free_blocks, 0, "seed {seed}");
    }
}
test_device!(randomized_alloc_and_free_keep_the_stats_consistent);
