//! Dispatch thresholds: the sizes from which a CPU kernel moves from the calling thread to all
//! cores. Every default lives here, beside the three thresholds `tuning::calibrate` measures
//! (kept in atomics that `set` overwrites with a calibration or the Python package's per-user
//! cache file) and the fixed ones that nothing measures yet. A leaf module: the kernels read
//! it, and it imports nothing from them, so the measurement in `crate::tuning` can sit above
//! the kernels it times.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Default for [`elementwise_parallel_min`] (calibrated: `calibrate()` times a float32 add):
/// below this many elements a memory-bound call stays on the calling thread, as waking the pool
/// costs more than the second core's share of the bandwidth gives back (measured with
/// `benchmarks/bench_vector_add.py --threshold`). Also exported as
/// `opbridge_ops::PARALLEL_MIN_ELEMS`.
pub const ELEMENTWISE_PARALLEL_MIN_ELEMS: usize = 1 << 17;

/// Default for [`matmul_parallel_min`] (calibrated: `calibrate()` times square float32
/// products): below this many multiply-adds one thread is faster than waking the pool.
pub const MATMUL_PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// Default for [`transcendental_parallel_min`] (calibrated: `calibrate()` times `tanh`).
/// Vectorized exp/tanh cost well under a nanosecond per element, so waking the pool (5–20 µs on
/// the project's loaded 2-core machine) pays off only from about this size (`calibrate`
/// measured 64K–128K there).
pub const TRANSCENDENTAL_PARALLEL_MIN_ELEMS: usize = 1 << 17;

/// Batched matmul (`batched::batched_matmul`): from this many multiply-adds in all, a call of many
/// small products runs whole batches in parallel, one thread each, grouped into tasks of about this
/// many multiply-adds; the int32/int64 kernel splits one product into parallel row blocks from this
/// size. Fixed, not calibrated: the kernel was written reading the 2-D matmul default,
/// [`MATMUL_PARALLEL_MIN_FLOPS`], as a constant, never the calibrated [`matmul_parallel_min`];
/// `calibrate()` times one float32 `gemm` call, which measures neither the batch grouping nor the
/// int kernel. Following the calibrated value would change how batched calls split after
/// `calibrate()` or `set`, so it stays equal to the 2-D default until it is measured on its own.
pub const BATCHED_MATMUL_PARALLEL_MIN_FLOPS: usize = MATMUL_PARALLEL_MIN_FLOPS;

/// Batched matmul: products of up to this many multiply-adds (256^3) run whole, one thread
/// each, batches in parallel, when there are at least two batches per thread. A product this
/// small split across threads pays a pool wake-up and a join per batch (the broadcast
/// `(4,1,128,128) @ (1,6,128,128)` of `bench_matmul.py` took 1.56x numpy's time that way);
/// larger ones share their packed panels better inside one parallel `gemm`.
pub const BATCHED_MATMUL_WHOLE_PRODUCT_MAX_FLOPS: usize = 1 << 24;

/// Reductions (`reduce`): below this many input elements a reduction stays on the calling thread.
/// Fixed, not calibrated: an initial value of the same order as the elementwise default (both are
/// memory-bound), chosen when the kernel was written ("to be recalibrated"). It does not follow the
/// calibrated [`elementwise_parallel_min`] because it also decides how a float sum is associated
/// (one pairwise tree over the whole line below it, fixed pieces combined in a balanced tree above
/// it), so it can change a result's rounding; tied to a per-machine measurement, float sums would
/// differ between machines, which the reductions' fixed piece size exists to avoid.
pub const REDUCE_PARALLEL_MIN_ELEMS: usize = 1 << 17;

/// `embedding_bag`: below this many gathered elements (indices x embedding dim) a call stays on
/// the calling thread. Fixed, not calibrated: an initial value chosen when the kernel was
/// written ("to be recalibrated"); no benchmark or `calibrate()` step measures it yet.
pub const EMBEDDING_PARALLEL_MIN_ELEMS: usize = 1 << 15;

/// Row kernels of `nn` (softmax, log_softmax, layer_norm, rms_norm): below this many elements a
/// call stays on the calling thread. Fixed, not calibrated: these kernels do several passes and an
/// `exp` per element, so they pay for a second thread sooner than memory-bound adds; an initial
/// value chosen when the kernel was written ("to be recalibrated"), which no benchmark or
/// `calibrate()` step measures yet.
pub const NN_PARALLEL_MIN_ELEMS: usize = 1 << 15;

/// Elementwise kernels with at least this many elements use all cores.
static ELEMENTWISE_PARALLEL_MIN: AtomicUsize = AtomicUsize::new(ELEMENTWISE_PARALLEL_MIN_ELEMS);
/// Matrix products with at least this many multiply-adds use all cores.
static MATMUL_PARALLEL_MIN: AtomicUsize = AtomicUsize::new(MATMUL_PARALLEL_MIN_FLOPS);
/// Compute-bound elementwise kernels (exp, tanh, pow...) with at least this many elements use
/// all cores.
static TRANSCENDENTAL_PARALLEL_MIN: AtomicUsize = AtomicUsize::new(TRANSCENDENTAL_PARALLEL_MIN_ELEMS);

/// The thresholds in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    pub elementwise_parallel_min_elems: usize,
    pub matmul_parallel_min_flops: usize,
    pub transcendental_parallel_min_elems: usize,
}

pub fn elementwise_parallel_min() -> usize {
    ELEMENTWISE_PARALLEL_MIN.load(Ordering::Relaxed)
}

pub fn matmul_parallel_min() -> usize {
    MATMUL_PARALLEL_MIN.load(Ordering::Relaxed)
}

pub fn transcendental_parallel_min() -> usize {
    TRANSCENDENTAL_PARALLEL_MIN.load(Ordering::Relaxed)
}

pub fn get() -> Thresholds {
    Thresholds {
        elementwise_parallel_min_elems: elementwise_parallel_min(),
        matmul_parallel_min_flops: matmul_parallel_min(),
        transcendental_parallel_min_elems: transcendental_parallel_min(),
    }
}

pub fn set(t: Thresholds) {
    ELEMENTWISE_PARALLEL_MIN.store(t.elementwise_parallel_min_elems.max(1), Ordering::Relaxed);
    MATMUL_PARALLEL_MIN.store(t.matmul_parallel_min_flops.max(1), Ordering::Relaxed);
    TRANSCENDENTAL_PARALLEL_MIN.store(t.transcendental_parallel_min_elems.max(1), Ordering::Relaxed);
}

pub fn defaults() -> Thresholds {
    Thresholds {
        elementwise_parallel_min_elems: ELEMENTWISE_PARALLEL_MIN_ELEMS,
        matmul_parallel_min_flops: MATMUL_PARALLEL_MIN_FLOPS,
        transcendental_parallel_min_elems: TRANSCENDENTAL_PARALLEL_MIN_ELEMS,
    }
}
