//! Cost of one allocate + free pair on the caching pool once its cache is warm (target: at
//! most 100 ns a pair), next to the system allocator for the same sizes as the peer.
//!
//! `cargo bench -p opbridge-runtime --bench pool`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use opbridge_runtime::{DeviceContext, StreamId};

/// A 64-byte-aligned unit, so a `Vec` of them is an aligned allocation without `unsafe`.
#[repr(C, align(64))]
struct CacheLine(#[allow(dead_code)] [u8; 64]);

fn allocate_free(c: &mut Criterion) {
    let pool = DeviceContext::cpu().pool();
    let mut group = c.benchmark_group("allocate_free");
    for (name, bytes) in [("4KiB", 4usize << 10), ("1MiB", 1 << 20)] {
        // Warm the cache: the measured pairs reuse this block and never reserve a segment.
        drop(pool.allocate(bytes, StreamId::HOST).expect("warming the pool"));
        group.bench_function(format!("pool/{name}"), |b| {
            b.iter(|| {
                let buffer = pool.allocate(black_box(bytes), StreamId::HOST).expect("cached allocation");
                black_box(buffer.ptr());
            })
        });
        // Peer: the system allocator, 64-byte aligned like the pool's blocks.
        group.bench_function(format!("system/{name}"), |b| {
            b.iter(|| {
                let block: Vec<CacheLine> = Vec::with_capacity(black_box(bytes / 64));
                black_box(block.as_ptr());
            })
        });
    }
    group.finish();
    let stats = pool.stats();
    assert_eq!(stats.allocated_blocks, 0, "every benchmarked block went back to the pool");
}

criterion_group!(benches, allocate_free);
criterion_main!(benches);
