//! Elementwise unary kernels with numpy semantics over strided views: the operators, their
//! result dtypes, and the dispatch of each run to the fastest loop the CPU allows (the scalar
//! math itself is in `math`; float16 computes in float32 and rounds once, as numpy does).
//!
//! dtype rule ([`unary_result_dtype`]): float inputs keep their dtype; on int32/int64, `neg`,
//! `abs` and `relu` keep the dtype (wrapping: `abs(i32::MIN) == i32::MIN`, as numpy), every
//! other op returns float64 (numpy's `np.exp(int_array)` is float64). The kernel itself runs
//! only on `x.dtype == out.dtype == unary_result_dtype(op, x.dtype)`: the caller casts int
//! inputs to float64 first (see `cast::cast_view`).
#![allow(unsafe_code)]

use half::f16;
use opbridge_runtime::DType;

use super::broadcast::{self, StridedLoop};
use super::error::KernelError;
use super::math::{erfc_with, narrow_f16, widen_f16, FloatElement, Fused, IntElement, Mla, Plain, Real, F16_CHUNK};
#[cfg(target_arch = "x86_64")]
use super::math::{WholeRun, EXP_AVX512, LOG_AVX512, SIGMOID_AVX512, SILU_AVX512, TANH_AVX512};
use super::thresholds;
use super::Element;
use crate::view::TensorView;

/// Elementwise unary operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x` (ints wrap).
    Neg,
    /// `|x|` (ints wrap: `abs(MIN) == MIN`).
    Abs,
    Exp,
    /// Natural log: `log(0) = -inf`, `log(x < 0) = nan`.
    Log,
    /// `sqrt(x < 0) = nan`.
    Sqrt,
    /// `np.maximum(x, 0)`: NaN propagates.
    Relu,
    /// `1 / (1 + exp(-x))`, evaluated without overflow for any `x`.
    Sigmoid,
    Tanh,
    /// `0.5 x (1 + erf(x / sqrt 2))`, evaluated as `0.5 x erfc(-x / sqrt 2)` (no cancellation
    /// for negative `x`).
    GeluErf,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, evaluated as `x sigmoid(2 z)`.
    GeluTanh,
    /// `x sigmoid(x)`.
    Silu,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 11] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Relu,
        UnaryOp::Sigmoid,
        UnaryOp::Tanh,
        UnaryOp::GeluErf,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
    ];

    /// The operator's name (`"gelu_erf"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Relu => "relu",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Tanh => "tanh",
            UnaryOp::GeluErf => "gelu_erf",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Silu => "silu",
        }
    }

    pub fn from_name(name: &str) -> Option<UnaryOp> {
        UnaryOp::ALL.into_iter().find(|op| op.name() == name)
    }

    /// Whether the op is defined on integers in their own dtype (numpy keeps int dtype for
    /// `negative`, `absolute` and `maximum(x, 0)`).
    pub const fn keeps_int_dtype(self) -> bool {
        matches!(self, UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu)
    }

    /// Where the op goes parallel: memory-bound ops at the calibrated elementwise threshold,
    /// compute-bound ones at the calibrated transcendental threshold.
    fn parallel_min(self) -> usize {
        match self {
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu | UnaryOp::Sqrt => thresholds::elementwise_parallel_min(),
            _ => thresholds::transcendental_parallel_min(),
        }
    }
}

impl std::fmt::Display for UnaryOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The dtype numpy gives `op(x)` for `x` of `dtype`: floats keep theirs; ints keep theirs for
/// neg/abs/relu and become float64 for everything else.
pub fn unary_result_dtype(op: UnaryOp, dtype: DType) -> DType {
    if dtype.is_float() || op.keeps_int_dtype() {
        dtype
    } else {
        DType::F64
    }
}

/// Stable logistic function: `exp` only ever sees `-|x|`, so it never overflows.
#[inline(always)]
fn sigmoid<R: Real, M: Mla>(x: R) -> R {
    let e = (-x.abs()).exp_with::<M>();
    let r = R::ONE / (R::ONE + e);
    if x >= R::ZERO {
        r
    } else {
        e * r
    }
}

#[inline(always)]
fn gelu_erf<R: Real, M: Mla>(x: R) -> R {
    R::HALF * x * erfc_with::<R, M>(-x * R::c(std::f64::consts::FRAC_1_SQRT_2))
}

#[inline(always)]
fn gelu_tanh<R: Real, M: Mla>(x: R) -> R {
    // 0.5 (1 + tanh z) == sigmoid(2 z); 2 sqrt(2/pi) folded into one constant.
    let k = R::c(2.0 * (2.0 / std::f64::consts::PI).sqrt());
    x * sigmoid::<R, M>(k * (x + R::c(0.044715) * x * x * x))
}

/// `out = op(x)`, elementwise over any strides.
///
/// Errors (the caller attaches the op name): dtypes differ, `op` has no kernel for an int
/// dtype (cast to `unary_result_dtype(op, x.dtype)` first), `x` does not broadcast to
/// `out.shape`, or `out` names an element twice (a stride-0 dimension).
///
/// # Safety
/// Every element of `x` (its shape and strides) is readable and every element of `out` is
/// writable, aligned for the dtype, and nothing else writes them during the call; `out`
/// either does not overlap `x` or is exactly `x` (same address, shape and strides), and no
/// two indices of `out` name the same element.
pub unsafe fn unary(op: UnaryOp, x: &TensorView, out: &TensorView) -> Result<(), KernelError> {
    if x.dtype != out.dtype {
        return Err(KernelError::UnaryDTypes { x: x.dtype, out: out.dtype });
    }
    let x = broadcast::try_broadcast_view(x, &out.shape)?;
    if broadcast::has_repeated_elements(out) {
        return Err(KernelError::RepeatedOutput { what: "out" });
    }
    // The loop's runs stay inside `out` and `x` (caller's contract), runs
    // are disjoint in `out`, and `out` is either disjoint from `x` or exactly `x`.
    run_loop(op, out.dtype, &StridedLoop::new([out, &x]), op.parallel_min())
}

/// Runs `op` over `lp` (`[out, x]`, both of `dtype`); int dtypes only for the ops that keep
/// them (an error names the dtype to cast to).
fn run_loop(op: UnaryOp, dtype: DType, lp: &StridedLoop<2>, min: usize) -> Result<(), KernelError> {
    match dtype {
        DType::F16 => run_float::<f16>(op, lp, min),
        DType::F32 => run_float::<f32>(op, lp, min),
        DType::F64 => run_float::<f64>(op, lp, min),
        DType::I32 => run_int::<i32>(op, lp, min)?,
        DType::I64 => run_int::<i64>(op, lp, min)?,
    }
    Ok(())
}

/// Whether [`unary_contiguous`] serves `op` on `dtype` (the result keeps the dtype).
pub fn unary_lane_accepts(op: UnaryOp, dtype: DType) -> bool {
    dtype.is_float() || op.keeps_int_dtype()
}

/// `out = op(x)` over `len` C-contiguous elements of `dtype`: the elementwise fast lane, with
/// no views to analyze. Errors as [`unary`] for dtypes that [`unary_lane_accepts`] refuses.
///
/// # Safety
/// `x` is readable and `out` writable for `len` aligned elements of `dtype`, nothing else
/// writes them during the call, and `out` is either disjoint from `x` or equal to it.
pub unsafe fn unary_contiguous(op: UnaryOp, dtype: DType, x: usize, out: usize, len: usize) -> Result<(), KernelError> {
    // SAFETY: forwarded.
    unsafe { unary_contiguous_with_min(op, dtype, x, out, len, op.parallel_min()) }
}

/// [`unary_contiguous`] going parallel from `min` elements (what `tuning::calibrate` times).
///
/// # Safety
/// As for [`unary_contiguous`].
pub(crate) unsafe fn unary_contiguous_with_min(
    op: UnaryOp,
    dtype: DType,
    x: usize,
    out: usize,
    len: usize,
    min: usize,
) -> Result<(), KernelError> {
    // The loop is one contiguous run split into chunks: `unary`'s contract for `run_loop`.
    run_loop(op, dtype, &StridedLoop::flat([out, x], [dtype.size(); 2], len), min)
}

/// Runs `f` over every run of `lp` (`[out, x]`).
fn run_map<T: Element>(lp: &StridedLoop<2>, min: usize, f: impl Fn(T) -> T + Copy + Sync) {
    // SAFETY: `lp` was built over `[out, x]` under `unary`'s contract (see there).
    lp.run(min, |p, s, len| unsafe { broadcast::unary_run::<T>(p, s, len, f) });
}

/// Views whose runs are shorter than this are gathered whole into a contiguous buffer (up to
/// [`GATHER_MAX`] elements) rather than computed run by run: a hand-written kernel called for
/// two elements pays its whole latency each time.
const SHORT_RUN: usize = 16;
/// The most elements [`float_gathered`] copies at once.
const GATHER_MAX: usize = 1 << 20;

fn run_float<T: FloatElement>(op: UnaryOp, lp: &StridedLoop<2>, min: usize) {
    let n = lp.numel();
    if lp.inner_len() < SHORT_RUN && n > lp.inner_len() && n <= GATHER_MAX {
        return float_gathered::<T>(op, lp, min);
    }
    // SAFETY: `lp` was built over `[out, x]` under `unary`'s contract: runs stay inside the
    // views and are disjoint in `out`, and `out` is disjoint from `x` or exactly `x` (so a run
    // with both strides 1 is one or the other).
    lp.run(min, |p, s, len| unsafe {
        if s == [1, 1] {
            float_contiguous::<T>(op, p[1] as *const T, p[0] as *mut T, len);
        } else {
            float_strided::<T>(op, p, s, len);
        }
    });
}

/// Takes an op as a closure over its compute type (see [`with_float_op`]).
trait FloatOpSink<R> {
    fn run(self, f: impl Fn(R) -> R + Copy);
}

/// Hands `sink` the closure of `op`, with `a * b + c` evaluated as `M` says.
#[inline(always)]
fn with_float_op<R: Real, M: Mla>(op: UnaryOp, sink: impl FloatOpSink<R>) {
    match op {
        UnaryOp::Neg => sink.run(|x: R| -x),
        UnaryOp::Abs => sink.run(|x: R| x.abs()),
        UnaryOp::Exp => sink.run(|x: R| x.exp_with::<M>()),
        UnaryOp::Log => sink.run(|x: R| x.log_with::<M>()),
        UnaryOp::Sqrt => sink.run(|x: R| x.sqrt()),
        UnaryOp::Relu => sink.run(|x: R| if x.is_nan() || x >= R::ZERO { x } else { R::ZERO }),
        UnaryOp::Sigmoid => sink.run(sigmoid::<R, M>),
        UnaryOp::Tanh => sink.run(|x: R| x.tanh_with::<M>()),
        // Too large for LLVM to inline of its own accord, and the loops need it inlined (for
        // the target features, FMA included, and to vectorize).
        UnaryOp::GeluErf => sink.run(
            #[inline(always)]
            |x: R| gelu_erf::<R, M>(x),
        ),
        UnaryOp::GeluTanh => sink.run(gelu_tanh::<R, M>),
        UnaryOp::Silu => sink.run(|x: R| x * sigmoid::<R, M>(x)),
    }
}

/// One contiguous run; built only by [`float_contiguous`], under its contract.
struct Contiguous<T> {
    x: *const T,
    out: *mut T,
    len: usize,
}

impl<T: FloatElement> FloatOpSink<T::R> for Contiguous<T> {
    #[inline(always)]
    fn run(self, f: impl Fn(T::R) -> T::R + Copy) {
        // SAFETY: `float_contiguous`'s contract, which its caller upholds.
        unsafe { T::map_contiguous(self.x, self.out, self.len, f) }
    }
}

/// `out = op(x)` over a walk of short runs: `x` gathered into a contiguous buffer in the walk's
/// order, computed there as one contiguous run (the same bits as any other layout gives), and
/// scattered back in the same order.
fn float_gathered<T: FloatElement>(op: UnaryOp, lp: &StridedLoop<2>, min: usize) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let n = lp.numel();
    let mut tmp: Vec<T> = Vec::with_capacity(n);
    let at = tmp.as_mut_ptr() as usize;
    // The walk runs on this thread (`usize::MAX`: never parallel), in one order both times;
    // the position is an atomic only because the walk's closure must be `Sync` (a load and a
    // store, not a read-modify-write: nothing else touches it).
    let pos = AtomicUsize::new(0);
    lp.run(usize::MAX, |p, s, len| {
        let start = pos.load(Ordering::Relaxed);
        pos.store(start + len, Ordering::Relaxed);
        for i in 0..len {
            // SAFETY: element `i` of a run of `unary`'s loop over `x`, into element
            // `start + i < n` of `tmp`'s capacity (the runs hold `n` elements in all).
            unsafe { (at as *mut T).add(start + i).write(*(p[1] as *const T).offset(i as isize * s[1])) };
        }
    });
    // SAFETY: all `n` elements were written just above.
    unsafe { tmp.set_len(n) };
    let base = tmp.as_mut_ptr() as usize;
    run_float::<T>(op, &StridedLoop::flat([base, base], [T::DTYPE.size(); 2], n), min);
    pos.store(0, Ordering::Relaxed);
    lp.run(usize::MAX, |p, s, len| {
        let start = pos.load(Ordering::Relaxed);
        pos.store(start + len, Ordering::Relaxed);
        for i in 0..len {
            // SAFETY: as above, from `tmp` into the run of `out` (disjoint from `tmp`).
            unsafe { *(p[0] as *mut T).offset(i as isize * s[0]) = *(base as *const T).add(start + i) };
        }
    });
}

/// Elements of a strided run computed at a time by [`float_strided`].
const STRIDED_CHUNK: usize = 256;

/// `out = op(x)` over one strided run (or a run of one element): gathered into a buffer on the
/// stack, computed by [`float_contiguous`] in place and scattered back, so a view gives the
/// very bits a contiguous array gives (the AVX-512 kernels' included) and is vectorized too.
///
/// # Safety
/// A run of `unary`'s loop: `p` = `[out, x]` addresses, `s` their strides in elements; the
/// run stays inside both views; `out` is disjoint from `x` or exactly `x` (same address and
/// stride: each chunk is read before it is written).
unsafe fn float_strided<T: FloatElement>(op: UnaryOp, p: [usize; 2], s: [isize; 2], len: usize) {
    let (out, x) = (p[0] as *mut T, p[1] as *const T);
    // Uninitialized: a run of one element (many of them in a view with short rows) should
    // not pay for filling 256.
    let mut buf = [const { std::mem::MaybeUninit::<T>::uninit() }; STRIDED_CHUNK];
    let b = buf.as_mut_ptr().cast::<T>();
    let mut start = 0;
    while start < len {
        let n = STRIDED_CHUNK.min(len - start);
        for i in 0..n {
            // SAFETY: element `start + i < len` of the run (caller's contract), into the
            // buffer's element `i < n <= STRIDED_CHUNK`.
            unsafe { b.add(i).write(*x.offset((start + i) as isize * s[1])) };
        }
        // SAFETY: the buffer's first `n` elements, just written, computed in place.
        unsafe { float_contiguous::<T>(op, b, b, n) };
        for i in 0..n {
            // SAFETY: as above, for `out`.
            unsafe { *out.offset((start + i) as isize * s[0]) = b.add(i).read() };
        }
        start += n;
    }
}

/// `out = op(x)` over one contiguous run, compiled for the best the CPU has: AVX-512 or AVX2
/// with FMA (fused polynomials), AVX2, or the x86-64 baseline.
///
/// # Safety
/// As for [`FloatElement::map_contiguous`].
unsafe fn float_contiguous<T: FloatElement>(op: UnaryOp, x: *const T, out: *mut T, len: usize) {
    if T::DTYPE == DType::F16 {
        // SAFETY: `T` is f16 (its dtype says so); the run is as the caller promises.
        return unsafe { f16_contiguous(op, x.cast(), out.cast(), len) };
    }
    #[inline(always)]
    fn body<T: FloatElement, M: Mla>(op: UnaryOp, x: *const T, out: *mut T, len: usize) {
        with_float_op::<T::R, M>(op, Contiguous { x, out, len });
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
        fn avx512<T: FloatElement>(op: UnaryOp, x: *const T, out: *mut T, len: usize) {
            if T::DTYPE == DType::F32 {
                if let Some(kernel) = whole_run_avx512(op) {
                    // SAFETY: `T` is f32 (its dtype says so); the run is as `float_contiguous`'s
                    // caller promises, and this function runs only on CPUs with the kernels'
                    // features.
                    return unsafe { (kernel.f32)(x.cast(), out.cast(), len) };
                }
            }
            body::<T, Fused>(op, x, out, len)
        }
        #[target_feature(enable = "avx2,fma")]
        fn avx2_fma<T: FloatElement>(op: UnaryOp, x: *const T, out: *mut T, len: usize) {
            body::<T, Fused>(op, x, out, len)
        }
        #[target_feature(enable = "avx2")]
        fn avx2<T: FloatElement>(op: UnaryOp, x: *const T, out: *mut T, len: usize) {
            body::<T, Plain>(op, x, out, len)
        }
        if has_avx512() {
            // SAFETY: the CPU has these features (checked just above).
            return unsafe { avx512(op, x, out, len) };
        }
        use std::arch::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") {
            // SAFETY: as above.
            return unsafe { avx2_fma(op, x, out, len) };
        }
        if has!("avx2") {
            // SAFETY: as above.
            return unsafe { avx2(op, x, out, len) };
        }
    }
    body::<T, Plain>(op, x, out, len)
}

/// Whether the CPU runs the AVX-512 kernels (the features `float_contiguous`'s `avx512` and
/// the [`WholeRun`] kernels are compiled for, F16C included).
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") && has!("fma") && has!("f16c")
}

/// The hand-written AVX-512 kernels over whole runs, for the ops that have one.
#[cfg(target_arch = "x86_64")]
fn whole_run_avx512(op: UnaryOp) -> Option<WholeRun> {
    match op {
        UnaryOp::Exp => Some(EXP_AVX512),
        UnaryOp::Log => Some(LOG_AVX512),
        UnaryOp::Tanh => Some(TANH_AVX512),
        UnaryOp::Sigmoid => Some(SIGMOID_AVX512),
        UnaryOp::Silu => Some(SILU_AVX512),
        _ => None,
    }
}

/// `out = op(x)` over one contiguous float16 run. `neg` and `abs` flip or clear the sign bit,
/// as numpy's `npy_half_neg` and `npy_half_abs` do (exact for every value, NaN payloads
/// included). Every other op computes in float32 and rounds once ([`f16_computed`]); a run of
/// [`F16_TABLE_MIN`] elements or more looks its results up in the op's table of all 65,536
/// float16 results, which that very function filled (so the bits are the same).
///
/// # Safety
/// As for [`float_contiguous`].
unsafe fn f16_contiguous(op: UnaryOp, x: *const f16, out: *mut f16, len: usize) {
    // (bits flipped, bits kept) of the sign operations.
    let sign_op = match op {
        UnaryOp::Neg => Some((0x8000u16, 0xffffu16)),
        UnaryOp::Abs => Some((0, 0x7fff)),
        _ => None,
    };
    if let Some((flip, keep)) = sign_op {
        let (x, out) = (x.cast::<u16>(), out.cast::<u16>());
        for i in 0..len {
            // SAFETY: element `i < len` of both runs (caller's contract); read before it is
            // written, so `out == x` is fine.
            unsafe { *out.add(i) = (*x.add(i) ^ flip) & keep };
        }
        return;
    }
    if len >= F16_TABLE_MIN {
        // SAFETY: forwarded.
        return unsafe { f16_table::lookup(f16_table::get(op), x.cast(), out.cast(), len) };
    }
    // SAFETY: forwarded.
    unsafe { f16_computed(op, x, out, len) }
}

/// Float16 runs at least this long take [`f16_table`]'s lookup: a gather of 16 results from a
/// table in L2 (128 KiB) costs less than computing them, once the table is warm (float16
/// `log` at 64K: 9.6 µs against 18 µs computed, numpy 12.7 µs). Shorter runs compute, so a
/// small call never pays for a cold table.
const F16_TABLE_MIN: usize = 4096;

/// Float16 results as tables: every op but the sign operations has 65,536 possible inputs, so
/// its results are computed once, for every input bit pattern, by [`f16_computed`] on first
/// use (18 µs for `log`, 0.1 ms for `gelu` erf), and looked up afterwards: bit-identical to
/// computing them by construction, NaN payloads included.
mod f16_table {
    use std::sync::OnceLock;

    use super::{f16, f16_computed, UnaryOp};

    /// Entries: one per input, and one of padding, since the gather reads 4 bytes at entry
    /// `x` (the last input's result and the pad).
    const ENTRIES: usize = (1 << 16) + 1;

    /// The op's table, filled on first use.
    pub(super) fn get(op: UnaryOp) -> &'static [u16; ENTRIES] {
        static TABLES: [OnceLock<Box<[u16; ENTRIES]>>; UnaryOp::ALL.len()] =
            [const { OnceLock::new() }; UnaryOp::ALL.len()];
        let at = UnaryOp::ALL.iter().position(|&o| o == op).expect("every op is in ALL");
        TABLES[at].get_or_init(|| {
            let inputs: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
            let mut table = Box::new([0u16; ENTRIES]);
            // SAFETY: 65,536 elements each way, disjoint.
            unsafe { f16_computed(op, inputs.as_ptr(), table.as_mut_ptr().cast(), inputs.len()) };
            table
        })
    }

    /// `out[i] = table[x[i]]` for `i < len`: 16 at a time with an AVX-512 gather where the CPU
    /// has it.
    ///
    /// # Safety
    /// `x` is readable and `out` writable for `len` elements, touched by nothing else during
    /// the call; `out` is `x` or disjoint from it.
    pub(super) unsafe fn lookup(table: &[u16; ENTRIES], x: *const u16, out: *mut u16, len: usize) {
        let mut i = 0;
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") {
                // SAFETY: the CPU has the features; the run as the caller promises.
                i = unsafe { lookup_avx512(table, x, out, len) };
            }
        }
        for i in i..len {
            // SAFETY: element `i < len` of both runs; read before it is written.
            unsafe { *out.add(i) = table[*x.add(i) as usize] };
        }
    }

    /// The whole vectors of [`lookup`]; returns how many elements it did.
    ///
    /// # Safety
    /// As for [`lookup`]; the CPU has AVX-512 F and BW.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn lookup_avx512(table: &[u16; ENTRIES], x: *const u16, out: *mut u16, len: usize) -> usize {
        use std::arch::x86_64::*;
        let mut i = 0;
        while i + 16 <= len {
            // SAFETY: elements `i..i + 16` of both runs, each read before it is written.
            let idx = _mm512_cvtepu16_epi32(unsafe { _mm256_loadu_si256(x.add(i).cast()) });
            // SAFETY: each lane reads the 4 bytes at entry `idx <= 65535` of a table of 65,537
            // entries: inside it.
            let got = unsafe { _mm512_i32gather_epi32::<2>(idx, table.as_ptr().cast()) };
            // SAFETY: as above; the low 16 bits of each lane are the entry.
            unsafe { _mm256_storeu_si256(out.add(i).cast(), _mm512_cvtepi32_epi16(got)) };
            i += 16;
        }
        i
    }
}

/// `out = op(x)` over one contiguous float16 run, computed: each chunk widened to float32, run
/// through the float32 kernel (the AVX-512 ones included, which convert in registers) and
/// rounded back once.
///
/// # Safety
/// As for [`float_contiguous`].
unsafe fn f16_computed(op: UnaryOp, x: *const f16, out: *mut f16, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = whole_run_avx512(op).filter(|_| has_avx512()) {
        // SAFETY: the run is as the caller promises; the CPU has the kernel's features.
        return unsafe { (kernel.f16)(x, out, len) };
    }
    let mut buf = [0f32; F16_CHUNK];
    let mut start = 0;
    while start < len {
        let buf = &mut buf[..F16_CHUNK.min(len - start)];
        // SAFETY: inside the run (caller's contract); when `out` is `x`, the shared slice is
        // gone before the mutable one over the same elements is made.
        widen_f16(unsafe { std::slice::from_raw_parts(x.add(start), buf.len()) }, buf);
        let b = buf.as_mut_ptr();
        // SAFETY: the buffer is `buf.len()` float32 elements, computed in place (one pointer
        // for both, so the kernel's writes do not invalidate its reads).
        unsafe { float_contiguous::<f32>(op, b, b, buf.len()) };
        // SAFETY: as above.
        narrow_f16(buf, unsafe { std::slice::from_raw_parts_mut(out.add(start), buf.len()) });
        start += buf.len();
    }
}

fn run_int<T: IntElement>(op: UnaryOp, lp: &StridedLoop<2>, min: usize) -> Result<(), KernelError> {
    match op {
        UnaryOp::Neg => run_map(lp, min, T::wrapping_neg),
        UnaryOp::Abs => run_map(lp, min, T::wrapping_abs),
        UnaryOp::Relu => run_map(lp, min, |x: T| x.max(T::ZERO)),
        _ => {
            return Err(KernelError::NoKernel {
                op: op.name(),
                dtype: T::DTYPE,
                cast_to: unary_result_dtype(op, T::DTYPE),
            })
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
