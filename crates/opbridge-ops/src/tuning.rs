//! Calibration of the dispatch thresholds: where work moves from one thread to all cores.
//! The thresholds, their defaults and `get`/`set` live in `cpu::thresholds`, a leaf the
//! kernels read (re-exported here, the public API); this module sits above the kernels because
//! `calibrate` times them, re-measuring on the user's machine the thresholds whose defaults
//! were measured on the project's 2-core machine. The Python package saves the result in a
//! per-user cache file that later runs load with `set`.
#![allow(unsafe_code)] // the calibration runs the real kernels on scratch buffers

use std::time::{Duration, Instant};

use opbridge_runtime::DType;

use crate::cpu::unary::{self, UnaryOp};
use crate::cpu::{elementwise, matmul as mm};

pub use crate::cpu::thresholds::{defaults, get, set, Thresholds};

/// Best time of `f` over a few runs lasting at least `budget` in all.
fn best_of(budget: Duration, mut f: impl FnMut()) -> Duration {
    let mut best = Duration::MAX;
    let start = Instant::now();
    let mut runs = 0;
    while runs < 5 || (start.elapsed() < budget && runs < 10_000) {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        runs += 1;
    }
    best
}

/// The smallest size at which `parallel` beats `serial` by 10%, scanning `sizes` upwards;
/// the largest size (doubled) when it never does (one core is enough up to there).
fn crossover(sizes: &[usize], time: impl Fn(usize, bool) -> Duration) -> usize {
    for &n in sizes {
        if time(n, true).as_secs_f64() < time(n, false).as_secs_f64() * 0.9 {
            return n;
        }
    }
    sizes.last().map_or(usize::MAX, |&n| n * 2)
}

/// Measures the thresholds on this machine (about a second), applies and returns them.
pub fn calibrate() -> Thresholds {
    let budget = Duration::from_millis(40);
    let sizes: Vec<usize> = (13..=21).map(|s| 1usize << s).collect();
    let max = *sizes.last().expect("sizes");
    let (a, b, mut out) = (vec![1.0f32; max], vec![2.0f32; max], vec![0.0f32; max]);
    let (pa, pb, po) = (a.as_ptr() as usize, b.as_ptr() as usize, out.as_mut_ptr() as usize);
    let elementwise_min = crossover(&sizes, |n, parallel| {
        best_of(budget, || {
            // SAFETY: three distinct vectors of at least `n` f32s, alive for the call.
            unsafe {
                elementwise::add_with_threads(DType::F32, pa as *const u8, pb as *const u8, po as *mut u8, n, parallel)
            }
        })
    });

    let dims: Vec<usize> = vec![16, 24, 32, 48, 64, 96, 128];
    let side = *dims.last().expect("dims");
    let (ma, mb, mut mo) = (vec![1.0f32; side * side], vec![1.0f32; side * side], vec![0.0f32; side * side]);
    let (qa, qb, qo) = (ma.as_ptr() as usize, mb.as_ptr() as usize, mo.as_mut_ptr() as usize);
    let matmul_side = crossover(&dims, |d, parallel| {
        let mat = |p: usize| mm::MatRef { ptr: p as *const u8, row_stride: d as isize, col_stride: 1 };
        best_of(budget, || {
            // SAFETY: distinct buffers of at least d*d f32s; the output is disjoint.
            unsafe { mm::matmul_with(DType::F32, d, d, d, mat(qa), mat(qb), mat(qo), parallel) }
        })
    });
    // tanh: the slowest vectorized transcendental stands for the family.
    let transcendental_sizes: Vec<usize> = (12..=20).map(|s| 1usize << s).collect();
    let transcendental_min = crossover(&transcendental_sizes, |n, parallel| {
        let min = if parallel { 0 } else { usize::MAX };
        best_of(budget, || {
            // SAFETY: `a` and `out` are distinct vectors of at least `n` f32s, alive for the call.
            let timed = unsafe { unary::unary_contiguous_with_min(UnaryOp::Tanh, DType::F32, pa, po, n, min) };
            debug_assert!(timed.is_ok(), "tanh has a float32 kernel");
        })
    });
    drop((a, b, out, ma, mb, mo));
    let thresholds = Thresholds {
        elementwise_parallel_min_elems: elementwise_min,
        matmul_parallel_min_flops: matmul_side.saturating_pow(3),
        transcendental_parallel_min_elems: transcendental_min,
    };
    set(thresholds);
    thresholds
}
