//! Reductions with numpy's semantics: `sum`, `mean`, `max`, `min` and `argmax` over one axis
//! (negative axes allowed) or over all axes, `keepdims` output shapes, numpy's result dtypes,
//! NaN propagation and numpy's errors for empty reductions. Inputs may have any strides
//! (transposed, reversed, broadcast).
//!
//! Accuracy. Float sums use pairwise summation as numpy does (blocks of 128 elements summed in
//! 16 independent lanes, blocks combined in a binary tree), in a wider accumulator: float16 in
//! float32 (as numpy), float32 in float64 (numpy stays in float32, so ours is at least as
//! accurate), float64 in float64. Reducing an axis that is not the innermost in memory (axis 0
//! of a row-major matrix) walks whole rows and accumulates per output column, as numpy does:
//! blocks of up to 128 rows are summed in float32 (float16/float32 input) or float64, and the
//! block sums are added into the wide accumulator above, so the error grows with the block
//! length, not with the number of rows (numpy sums such columns naively in the input dtype).
//! Integer sums wrap in int64; integer means sum in float64, as numpy does. Parallel
//! reductions split the work into pieces of a fixed size, so results do not depend on the
//! number of threads.
#![allow(unsafe_code)]

use std::marker::PhantomData;

use half::f16;
use half::slice::HalfFloatSliceExt;
use opbridge_runtime::DType;
use rayon::prelude::*;
use smallvec::SmallVec;

use super::thresholds::REDUCE_PARALLEL_MIN_ELEMS;
use crate::view::TensorView;

/// Elements summed in lanes before the pairwise tree takes over (numpy's `PW_BLOCKSIZE`).
const BLOCK: usize = 128;
/// Independent accumulators per block: enough to fill AVX2 registers and hide add latency.
const LANES: usize = 16;
/// Strided lines are gathered into contiguous buffers of this many elements.
const GATHER: usize = 1024;
/// Output columns one task accumulates when reducing a non-innermost axis.
const COLS: usize = 256;
/// Elements per parallel task. Fixed (not derived from the thread count) so that float results
/// are the same on every machine.
const PIECE: usize = 1 << 15;

/// A reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    Min,
    ArgMax,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min, ReduceOp::ArgMax];

    /// numpy's name for the operation (`"sum"`, `"argmax"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
        }
    }
}

/// Defines a generic function whose body is compiled twice, for the x86_64 baseline and for
/// AVX2, and picks one at run time: wide vectors without `-C target-cpu=native`. The body must
/// be safe code; each generic parameter takes one bound.
macro_rules! avx2_multiversion {
    ($(#[$attr:meta])* $vis:vis fn $name:ident<$($g:ident: $bound:path),+>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$attr])*
        $vis fn $name<$($g: $bound),+>($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body<$($g: $bound),+>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn avx2<$($g: $bound),+>($($arg: $ty),*) $(-> $ret)? {
                    body::<$($g),+>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2 (checked just above).
                    return unsafe { avx2::<$($g),+>($($arg),*) };
                }
            }
            body::<$($g),+>($($arg),*)
        }
    };
}
pub(crate) use avx2_multiversion;

/// Element offsets of position `index` (row-major over `shape`) in each of `K` strided operands.
/// `index` must be below the product of `shape`.
#[inline]
pub(crate) fn offsets_at<const K: usize>(shape: &[usize], strides: [&[isize]; K], mut index: usize) -> [isize; K] {
    let mut offsets = [0isize; K];
    for d in (0..shape.len()).rev() {
        let size = shape[d];
        let i = index % size;
        index /= size;
        for k in 0..K {
            offsets[k] += i as isize * strides[k][d];
        }
    }
    offsets
}

/// Normalizes a possibly negative axis; the error is numpy's `AxisError` message.
pub fn normalize_axis(axis: isize, ndim: usize) -> Result<usize, String> {
    let n = ndim as isize;
    if axis < -n || axis >= n {
        return Err(format!("axis {axis} is out of bounds for array of dimension {ndim}"));
    }
    Ok(if axis < 0 { (axis + n) as usize } else { axis as usize })
}

/// The shape of a reduction's result. `axis = None` reduces all axes.
pub fn reduce_shape(shape: &[usize], axis: Option<isize>, keepdims: bool) -> Result<Vec<usize>, String> {
    match axis {
        None => Ok(if keepdims { vec![1; shape.len()] } else { Vec::new() }),
        Some(axis) => {
            let axis = normalize_axis(axis, shape.len())?;
            let mut out = shape.to_vec();
            if keepdims {
                out[axis] = 1;
            } else {
                out.remove(axis);
            }
            Ok(out)
        }
    }
}

/// numpy's result dtype (on 64-bit Linux): `sum` of int32 or int64 gives int64, `mean` of an
/// integer type gives float64, `argmax` gives int64; every other case keeps the input's dtype
/// (float16 `mean` accumulates in float32 inside and rounds once to float16).
pub fn reduce_result_dtype(op: ReduceOp, dtype: DType) -> DType {
    match (op, dtype) {
        (ReduceOp::Sum, DType::I32 | DType::I64) => DType::I64,
        (ReduceOp::Mean, DType::I32 | DType::I64) => DType::F64,
        (ReduceOp::ArgMax, _) => DType::I64,
        (_, dtype) => dtype,
    }
}

/// Reduces `x` over `axis` (`None`: all axes) into `out`.
///
/// `out` has dtype [`reduce_result_dtype`] and the shape [`reduce_shape`] gives with or without
/// `keepdims` (both are accepted); its strides are free. `argmax` over all axes returns the
/// index into the flattened (row-major) array, as numpy does. `max`, `min` and `argmax` of an
/// empty reduction are errors with numpy's messages; `sum` of nothing is 0, `mean` NaN.
///
/// # Safety
/// `x` and `out` describe valid, aligned memory for their shapes, strides and dtypes; `out` is
/// writable, does not overlap `x`, and no other thread touches it during the call.
pub unsafe fn reduce(op: ReduceOp, x: &TensorView, axis: Option<isize>, out: &TensorView) -> Result<(), String> {
    let name = op.name();
    check_view(name, "x", x)?;
    check_view(name, "out", out)?;
    let ndim = x.ndim();
    let axis = match axis {
        Some(a) => Some(normalize_axis(a, ndim)?),
        None => None,
    };
    let expected = reduce_result_dtype(op, x.dtype);
    if out.dtype != expected {
        return Err(format!("{name}: out must have dtype {expected} for {} input, got {}", x.dtype, out.dtype));
    }
    // Inline lists: a small reduction's setup must not cost more than its loop.
    let reduced: SmallVec<[bool; 8]> = (0..ndim).map(|d| axis.is_none_or(|a| a == d)).collect();
    // `out` has the kept dimensions, with (keepdims) or without the reduced ones as 1s.
    let kept_dims = (0..ndim).filter(|&d| !reduced[d]).map(|d| x.shape[d]);
    let with_ones = (0..ndim).map(|d| if reduced[d] { 1 } else { x.shape[d] });
    // The stride of `out` along each dimension of `x` (0 along reduced dimensions).
    let os: SmallVec<[isize; 8]> = if out.shape.iter().copied().eq(with_ones) {
        (0..ndim).map(|d| if reduced[d] { 0 } else { out.strides[d] }).collect()
    } else if out.shape.iter().copied().eq(kept_dims) {
        let mut kept = out.strides.iter();
        (0..ndim).map(|d| if reduced[d] { 0 } else { *kept.next().expect("one stride per kept dim") }).collect()
    } else {
        let keep = reduce_shape(&x.shape, axis.map(|a| a as isize), true)?;
        let drop = reduce_shape(&x.shape, axis.map(|a| a as isize), false)?;
        return Err(format!("{name}: out must have shape {drop:?} (or {keep:?} with keepdims), got {:?}", out.shape));
    };
    let plan = Plan { x: x.data, out: out.data, shape: &x.shape, xs: &x.strides, os: &os, reduced: &reduced };
    // SAFETY: (all arms) the caller's contract, with `R::In` matching `x.dtype` and `R::Out`
    // matching `out.dtype` (checked above).
    unsafe {
        match (op, x.dtype) {
            (ReduceOp::Sum, DType::F16) => run::<SumR<f16, f32, f16, false>>(&plan),
            (ReduceOp::Sum, DType::F32) => run::<SumR<f32, f64, f32, false>>(&plan),
            (ReduceOp::Sum, DType::F64) => run::<SumR<f64, f64, f64, false>>(&plan),
            (ReduceOp::Sum, DType::I32) => run::<SumR<i32, i64, i64, false>>(&plan),
            (ReduceOp::Sum, DType::I64) => run::<SumR<i64, i64, i64, false>>(&plan),
            (ReduceOp::Mean, DType::F16) => run::<SumR<f16, f32, f16, true>>(&plan),
            (ReduceOp::Mean, DType::F32) => run::<SumR<f32, f64, f32, true>>(&plan),
            (ReduceOp::Mean, DType::F64) => run::<SumR<f64, f64, f64, true>>(&plan),
            (ReduceOp::Mean, DType::I32) => run::<SumR<i32, f64, f64, true>>(&plan),
            (ReduceOp::Mean, DType::I64) => run::<SumR<i64, f64, f64, true>>(&plan),
            (ReduceOp::Max, dtype) => crate::with_dtype!(dtype, T => run::<ExtremeR<T, true>>(&plan)),
            (ReduceOp::Min, dtype) => crate::with_dtype!(dtype, T => run::<ExtremeR<T, false>>(&plan)),
            (ReduceOp::ArgMax, dtype) => crate::with_dtype!(dtype, T => run::<ArgMaxR<T>>(&plan)),
        }
    }
}

fn check_view(op: &str, what: &str, v: &TensorView) -> Result<(), String> {
    if v.shape.len() != v.strides.len() {
        return Err(format!("{op}: {what} has {} dims but {} strides", v.shape.len(), v.strides.len()));
    }
    Ok(())
}

/// A reduction, as the traversal below needs it: how to reduce a contiguous run (`leaf`), how
/// to combine results of consecutive runs (`combine`, left before right), and how to fold one
/// element at a time into per-column accumulators (`start`, `push`).
trait Reducer {
    type In: Copy + Send + Sync + 'static;
    type Part: Copy + Send + Sync;
    type Out: Copy;
    /// The order of elements does not change the result (beyond rounding), so dimensions may
    /// be visited in memory order.
    const ORDER_FREE: bool;
    /// numpy's error for reducing nothing, where there is no identity.
    const EMPTY_ERROR: &'static str;
    /// The result of reducing nothing, if there is one.
    fn empty() -> Option<Self::Part>;
    /// Reduces a non-empty contiguous run whose first element has index `first` on the
    /// reduced axes.
    fn leaf(src: &[Self::In], first: usize) -> Self::Part;
    fn combine(a: Self::Part, b: Self::Part) -> Self::Part;
    fn start(x: Self::In, index: usize) -> Self::Part;
    fn push(acc: &mut Self::Part, x: Self::In, index: usize);
    /// Folds rows `rows` into per-column accumulators `acc`.
    ///
    /// # Safety
    /// Each row `base + i * row_stride` for `i` in `rows` holds `acc.len()` valid consecutive
    /// elements.
    #[inline(always)]
    unsafe fn push_rows(
        acc: &mut [Self::Part],
        base: *const Self::In,
        rows: std::ops::Range<usize>,
        row_stride: isize,
    ) {
        for i in rows {
            // SAFETY: a valid row (caller's contract).
            let row = unsafe { std::slice::from_raw_parts(base.offset(i as isize * row_stride), acc.len()) };
            for (a, &x) in acc.iter_mut().zip(row) {
                Self::push(a, x, i);
            }
        }
    }
    fn finish(part: Self::Part, count: usize) -> Self::Out;
}

// ---------------------------------------------------------------------------------------------
// Sum and mean

/// A sum accumulator: float32, float64, or wrapping int64.
trait Accum: Copy + Send + Sync + 'static {
    const ZERO: Self;
    fn add(self, other: Self) -> Self;
    fn div_count(self, n: usize) -> Self;
}

impl Accum for f32 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        self + other
    }
    fn div_count(self, n: usize) -> Self {
        self / n as f32
    }
}

impl Accum for f64 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        self + other
    }
    fn div_count(self, n: usize) -> Self {
        self / n as f64
    }
}

impl Accum for i64 {
    const ZERO: Self = 0;
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        self.wrapping_add(other)
    }
    fn div_count(self, n: usize) -> Self {
        if n == 0 {
            0
        } else {
            self / n as i64
        }
    }
}

/// An element type summed in accumulator `A`.
trait SumIn<A: Accum>: Copy + Send + Sync + 'static {
    /// The accumulator for short runs down columns (at most [`BLOCK`] rows): the narrowest that
    /// keeps a block accurate (float32 for float32 input; exact types for integers), so that
    /// column sums vectorize as wide as the input.
    type Fast: Accum;
    fn widen(self) -> A;
    fn fast(self) -> Self::Fast;
    fn fast_to_acc(f: Self::Fast) -> A;

    /// Sums at most [`BLOCK`] elements in [`LANES`] independent lanes.
    #[inline(always)]
    fn block_sum(src: &[Self]) -> A {
        let mut lanes = [A::ZERO; LANES];
        let chunks = src.chunks_exact(LANES);
        let rest = chunks.remainder();
        for chunk in chunks {
            for (lane, &x) in lanes.iter_mut().zip(chunk) {
                *lane = lane.add(x.widen());
            }
        }
        for (lane, &x) in lanes.iter_mut().zip(rest) {
            *lane = lane.add(x.widen());
        }
        let mut width = LANES / 2;
        while width > 0 {
            for l in 0..width {
                lanes[l] = lanes[l].add(lanes[l + width]);
            }
            width /= 2;
        }
        lanes[0]
    }

    /// `acc[c] += row[c]` for every column, in the fast accumulator.
    #[inline(always)]
    fn add_row_fast(acc: &mut [Self::Fast], row: &[Self]) {
        for (a, &x) in acc.iter_mut().zip(row) {
            *a = a.add(x.fast());
        }
    }
}

macro_rules! sum_in {
    ($($t:ty => $a:ty, fast $f:ty);*) => {$(
        impl SumIn<$a> for $t {
            type Fast = $f;
            #[inline(always)]
            fn widen(self) -> $a {
                self as $a
            }
            #[inline(always)]
            fn fast(self) -> $f {
                self as $f
            }
            #[inline(always)]
            fn fast_to_acc(f: $f) -> $a {
                f as $a
            }
        }
    )*};
}
sum_in!(
    f32 => f32, fast f32;
    f32 => f64, fast f32;
    f64 => f64, fast f64;
    i32 => i64, fast i64;
    i64 => i64, fast i64;
    i32 => f64, fast f64;
    i64 => f64, fast f64
);

impl SumIn<f32> for f16 {
    type Fast = f32;
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn fast(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn fast_to_acc(f: f32) -> f32 {
        f
    }

    #[inline(always)]
    fn block_sum(src: &[Self]) -> f32 {
        // Vector conversion (F16C where the CPU has it) beats converting one at a time.
        let mut buf = [0f32; BLOCK];
        let buf = &mut buf[..src.len()];
        src.convert_to_f32_slice(buf);
        <f32 as SumIn<f32>>::block_sum(buf)
    }

    #[inline(always)]
    fn add_row_fast(acc: &mut [f32], row: &[Self]) {
        let mut buf = [0f32; BLOCK];
        for (acc, row) in acc.chunks_mut(BLOCK).zip(row.chunks(BLOCK)) {
            let buf = &mut buf[..row.len()];
            row.convert_to_f32_slice(buf);
            <f32 as SumIn<f32>>::add_row_fast(acc, buf);
        }
    }
}

/// Rounds a sum accumulator to the output dtype.
trait SumOut<A>: Copy + 'static {
    fn from_acc(a: A) -> Self;
}

impl SumOut<f32> for f16 {
    fn from_acc(a: f32) -> Self {
        f16::from_f32(a)
    }
}
impl SumOut<f64> for f32 {
    fn from_acc(a: f64) -> Self {
        a as f32
    }
}
impl SumOut<f64> for f64 {
    fn from_acc(a: f64) -> Self {
        a
    }
}
impl SumOut<i64> for i64 {
    fn from_acc(a: i64) -> Self {
        a
    }
}

avx2_multiversion!(
    /// Pairwise sum of a contiguous run: [`BLOCK`]-element blocks combined in a binary tree,
    /// built bottom-up with a stack (a binary counter) so the whole loop stays in one function.
    fn sum_contiguous<T: SumIn<A>, A: Accum>(src: &[T]) -> A {
        let mut stack = [A::ZERO; usize::BITS as usize];
        let mut depth = 0;
        for (k, block) in src.chunks(BLOCK).enumerate() {
            let mut sum = T::block_sum(block);
            // After block number k + 1, merge one level per trailing zero bit of k + 1.
            let mut done = k + 1;
            while done & 1 == 0 {
                depth -= 1;
                sum = stack[depth].add(sum);
                done >>= 1;
            }
            stack[depth] = sum;
            depth += 1;
        }
        let mut total = A::ZERO;
        for &partial in stack[..depth].iter().rev() {
            total = partial.add(total);
        }
        total
    }
);

/// Sum (`MEAN = false`) or mean of `T` in accumulator `A`, written as `O`.
struct SumR<T, A, O, const MEAN: bool>(PhantomData<(T, A, O)>);

impl<T: SumIn<A>, A: Accum, O: SumOut<A>, const MEAN: bool> Reducer for SumR<T, A, O, MEAN> {
    type In = T;
    type Part = A;
    type Out = O;
    const ORDER_FREE: bool = true;
    const EMPTY_ERROR: &'static str = "";
    fn empty() -> Option<A> {
        Some(A::ZERO)
    }
    fn leaf(src: &[T], _first: usize) -> A {
        sum_contiguous::<T, A>(src)
    }
    #[inline(always)]
    fn combine(a: A, b: A) -> A {
        a.add(b)
    }
    #[inline(always)]
    fn start(x: T, _index: usize) -> A {
        x.widen()
    }
    #[inline(always)]
    fn push(acc: &mut A, x: T, _index: usize) {
        *acc = acc.add(x.widen());
    }
    /// Blocks of up to [`BLOCK`] rows summed in the fast accumulator, then added to `acc`.
    #[inline(always)]
    unsafe fn push_rows(acc: &mut [A], base: *const T, rows: std::ops::Range<usize>, row_stride: isize) {
        let mut partial = [<T::Fast as Accum>::ZERO; COLS];
        let partial = &mut partial[..acc.len()];
        let mut start = rows.start;
        while start < rows.end {
            let end = rows.end.min(start + BLOCK);
            partial.fill(<T::Fast as Accum>::ZERO);
            for i in start..end {
                // SAFETY: a valid row (caller's contract).
                let row = unsafe { std::slice::from_raw_parts(base.offset(i as isize * row_stride), acc.len()) };
                T::add_row_fast(partial, row);
            }
            for (a, &p) in acc.iter_mut().zip(partial.iter()) {
                *a = a.add(T::fast_to_acc(p));
            }
            start = end;
        }
    }
    fn finish(part: A, count: usize) -> O {
        if MEAN {
            O::from_acc(part.div_count(count))
        } else {
            O::from_acc(part)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Max, min, argmax

/// Element types with an order; floats may be NaN.
trait Ordered: Copy + Send + Sync + PartialOrd + 'static {
    fn isnan(self) -> bool;
}

impl Ordered for f16 {
    #[inline(always)]
    fn isnan(self) -> bool {
        self.is_nan()
    }
}
impl Ordered for f32 {
    #[inline(always)]
    fn isnan(self) -> bool {
        self.is_nan()
    }
}
impl Ordered for f64 {
    #[inline(always)]
    fn isnan(self) -> bool {
        self.is_nan()
    }
}
impl Ordered for i32 {
    #[inline(always)]
    fn isnan(self) -> bool {
        false
    }
}
impl Ordered for i64 {
    #[inline(always)]
    fn isnan(self) -> bool {
        false
    }
}

/// numpy's `maximum`/`minimum` for a running extreme `m`: a NaN wins and then stays (no
/// comparison with NaN is true). Non-short-circuit `|` keeps it a branch-free select.
#[inline(always)]
fn pick<T: Ordered, const MAX: bool>(m: T, x: T) -> T {
    let better = if MAX { x > m } else { x < m };
    if better | x.isnan() {
        x
    } else {
        m
    }
}

/// Lanes for max/min: enough independent compare-select chains to hide their latency.
const EXTREME_LANES: usize = 32;

#[inline(always)]
fn extreme<T: Ordered, const MAX: bool>(src: &[T]) -> T {
    let mut lanes = [src[0]; EXTREME_LANES];
    let chunks = src.chunks_exact(EXTREME_LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = pick::<T, MAX>(*lane, x);
        }
    }
    for &x in rest {
        lanes[0] = pick::<T, MAX>(lanes[0], x);
    }
    lanes.into_iter().fold(src[0], pick::<T, MAX>)
}

avx2_multiversion!(
    fn max_contiguous<T: Ordered>(src: &[T]) -> T {
        extreme::<T, true>(src)
    }
);

avx2_multiversion!(
    fn min_contiguous<T: Ordered>(src: &[T]) -> T {
        extreme::<T, false>(src)
    }
);

/// `max` (`MAX = true`) or `min`.
struct ExtremeR<T, const MAX: bool>(PhantomData<T>);

impl<T: Ordered, const MAX: bool> Reducer for ExtremeR<T, MAX> {
    type In = T;
    type Part = T;
    type Out = T;
    const ORDER_FREE: bool = true;
    const EMPTY_ERROR: &'static str = if MAX {
        "zero-size array to reduction operation maximum which has no identity"
    } else {
        "zero-size array to reduction operation minimum which has no identity"
    };
    fn empty() -> Option<T> {
        None
    }
    fn leaf(src: &[T], _first: usize) -> T {
        if MAX {
            max_contiguous(src)
        } else {
            min_contiguous(src)
        }
    }
    #[inline(always)]
    fn combine(a: T, b: T) -> T {
        pick::<T, MAX>(a, b)
    }
    #[inline(always)]
    fn start(x: T, _index: usize) -> T {
        x
    }
    #[inline(always)]
    fn push(acc: &mut T, x: T, _index: usize) {
        *acc = pick::<T, MAX>(*acc, x);
    }
    fn finish(part: T, _count: usize) -> T {
        part
    }
}

/// `argmax`: the first index of the maximum, or of the first NaN.
struct ArgMaxR<T>(PhantomData<T>);

impl<T: Ordered> Reducer for ArgMaxR<T> {
    type In = T;
    type Part = (T, usize);
    type Out = i64;
    const ORDER_FREE: bool = false;
    const EMPTY_ERROR: &'static str = "attempt to get argmax of an empty sequence";
    fn empty() -> Option<(T, usize)> {
        None
    }
    fn leaf(src: &[T], first: usize) -> (T, usize) {
        // The vectorized maximum, then the first element equal to it (or the first NaN).
        let m = max_contiguous(src);
        let i = if m.isnan() { src.iter().position(|x| x.isnan()) } else { src.iter().position(|&x| x == m) };
        let i = i.expect("the maximum is one of the elements");
        (src[i], first + i)
    }
    #[inline(always)]
    fn combine(a: (T, usize), b: (T, usize)) -> (T, usize) {
        if b.0 > a.0 || (b.0.isnan() && !a.0.isnan()) {
            b
        } else {
            a
        }
    }
    #[inline(always)]
    fn start(x: T, index: usize) -> (T, usize) {
        (x, index)
    }
    #[inline(always)]
    fn push(acc: &mut (T, usize), x: T, index: usize) {
        if x > acc.0 || (x.isnan() && !acc.0.isnan()) {
            *acc = (x, index);
        }
    }
    fn finish(part: (T, usize), _count: usize) -> i64 {
        part.1 as i64
    }
}

// ---------------------------------------------------------------------------------------------
// Traversal

/// A validated reduction: addresses, the shape and strides of `x`, the strides of `out` along
/// each dimension of `x` (0 where reduced), and which dimensions are reduced.
struct Plan<'a> {
    x: usize,
    out: usize,
    shape: &'a [usize],
    xs: &'a [isize],
    os: &'a [isize],
    reduced: &'a [bool],
}

/// Combines consecutive parts in a balanced tree (pairwise for sums).
fn tree<R: Reducer>(parts: &[R::Part]) -> R::Part {
    if parts.len() == 1 {
        return parts[0];
    }
    let half = parts.len() / 2;
    R::combine(tree::<R>(&parts[..half]), tree::<R>(&parts[half..]))
}

/// Reduces the `n >= 1` elements `base[i * stride]`, the first of which has index `first`.
///
/// # Safety
/// Every `base + i * stride` for `i < n` is a valid element.
unsafe fn line<R: Reducer>(base: *const R::In, n: usize, stride: isize, first: usize) -> R::Part {
    if n == 1 {
        // SAFETY: one valid element (caller's contract).
        return R::start(unsafe { *base }, first);
    }
    if stride == 1 {
        // SAFETY: `n` consecutive valid elements (caller's contract).
        return R::leaf(unsafe { std::slice::from_raw_parts(base, n) }, first);
    }
    if n <= LANES {
        // Short strided lines (many outputs of a short axis): fold one element at a time.
        // SAFETY: `i < n`, inside the line (caller's contract).
        let mut acc = R::start(unsafe { *base }, first);
        for i in 1..n {
            // SAFETY: as above.
            R::push(&mut acc, unsafe { *base.offset(i as isize * stride) }, first + i);
        }
        return acc;
    }
    if n <= GATHER {
        // SAFETY: `i < n`, inside the line (caller's contract).
        let mut buf = [unsafe { *base }; GATHER];
        for (i, slot) in buf.iter_mut().enumerate().take(n).skip(1) {
            // SAFETY: as above.
            *slot = unsafe { *base.offset(i as isize * stride) };
        }
        return R::leaf(&buf[..n], first);
    }
    // Halves on GATHER boundaries: the pairwise tree continues above the gathered blocks.
    let half = (n / 2).next_multiple_of(GATHER);
    // SAFETY: both halves lie inside the line.
    unsafe {
        let left = line::<R>(base, half, stride, first);
        let right = line::<R>(base.offset(half as isize * stride), n - half, stride, first + half);
        R::combine(left, right)
    }
}

/// [`line`] split into pieces of [`PIECE`] elements reduced in parallel when it is long.
///
/// # Safety
/// As for [`line`].
unsafe fn line_parallel<R: Reducer>(base: *const R::In, n: usize, stride: isize, first: usize) -> R::Part {
    if n < REDUCE_PARALLEL_MIN_ELEMS {
        // SAFETY: forwarded.
        return unsafe { line::<R>(base, n, stride, first) };
    }
    let pieces = n.div_ceil(PIECE);
    let addr = base as usize;
    let parts: Vec<R::Part> = (0..pieces)
        .into_par_iter()
        .map(|p| {
            let start = p * PIECE;
            let len = PIECE.min(n - start);
            let base = addr as *const R::In;
            // SAFETY: the piece lies inside the line.
            unsafe { line::<R>(base.offset(start as isize * stride), len, stride, first + start) }
        })
        .collect();
    tree::<R>(&parts)
}

/// Reduces all of `dims` (size, stride) below `base`, visiting elements in row-major order of
/// `dims` (so indices are flat row-major indices), or in memory order when `R::ORDER_FREE`.
///
/// # Safety
/// Every element of the strided block is valid; the block is not empty.
unsafe fn reduce_block<R: Reducer>(base: *const R::In, dims: &[(usize, isize)]) -> R::Part {
    let mut base = base;
    let mut dims: Vec<(usize, isize)> = dims.iter().copied().filter(|&(size, _)| size != 1).collect();
    if R::ORDER_FREE {
        for (size, stride) in dims.iter_mut() {
            if *stride < 0 {
                // SAFETY: the last element along this dimension is inside the block.
                base = unsafe { base.offset((*size as isize - 1) * *stride) };
                *stride = -*stride;
            }
        }
        dims.sort_by_key(|&(_, stride)| std::cmp::Reverse(stride));
    }
    // Merge dimensions that walk memory like one.
    let mut merged: Vec<(usize, isize)> = Vec::with_capacity(dims.len());
    for (size, stride) in dims {
        match merged.last_mut() {
            Some(last) if last.1 == stride * size as isize => *last = (last.0 * size, stride),
            _ => merged.push((size, stride)),
        }
    }
    let n: usize = merged.iter().map(|d| d.0).product();
    // SAFETY: (all arms) every visited element is inside the block (caller's contract).
    unsafe {
        match merged.len() {
            0 => line::<R>(base, 1, 1, 0),
            1 => line_parallel::<R>(base, n, merged[0].1, 0),
            len => {
                let (outer, inner) = merged.split_at(len - 1);
                let (width, stride) = inner[0];
                let shape: Vec<usize> = outer.iter().map(|d| d.0).collect();
                let strides: Vec<isize> = outer.iter().map(|d| d.1).collect();
                let lines = n / width;
                let addr = base as usize;
                let line_at = |l: usize, parallel: bool| {
                    let [off] = offsets_at(&shape, [&strides], l);
                    let base = (addr as *const R::In).offset(off);
                    if parallel {
                        line_parallel::<R>(base, width, stride, l * width)
                    } else {
                        line::<R>(base, width, stride, l * width)
                    }
                };
                if n < REDUCE_PARALLEL_MIN_ELEMS {
                    let parts = (0..lines).map(|l| line_at(l, false));
                    parts.reduce(R::combine).expect("at least one line")
                } else if width >= PIECE {
                    let parts = (0..lines).map(|l| line_at(l, true));
                    parts.reduce(R::combine).expect("at least one line")
                } else {
                    let per_task = PIECE / width;
                    let tasks = lines.div_ceil(per_task);
                    let parts: Vec<R::Part> = (0..tasks)
                        .into_par_iter()
                        .map(|t| {
                            let lines = t * per_task..lines.min((t + 1) * per_task);
                            lines.map(|l| line_at(l, false)).reduce(R::combine).expect("non-empty task")
                        })
                        .collect();
                    tree::<R>(&parts)
                }
            }
        }
    }
}

/// Accumulates rows `rows` of a `row_stride`-strided stack of contiguous rows of `acc.len()`
/// columns into `acc` (the first row initializes it).
///
/// # Safety
/// Every row `base + i * row_stride` for `i` in `rows` holds `acc.len()` valid consecutive
/// elements; `rows` is not empty.
unsafe fn columns<R: Reducer>(
    base: *const R::In,
    rows: std::ops::Range<usize>,
    row_stride: isize,
    acc: &mut [R::Part],
) {
    #[inline(always)]
    unsafe fn body<R: Reducer>(
        base: *const R::In,
        rows: std::ops::Range<usize>,
        row_stride: isize,
        acc: &mut [R::Part],
    ) {
        let width = acc.len();
        debug_assert!(width <= COLS, "column tasks are at most COLS wide");
        // SAFETY: the first row is valid (caller's contract).
        let first = unsafe { std::slice::from_raw_parts(base.offset(rows.start as isize * row_stride), width) };
        for (a, &x) in acc.iter_mut().zip(first) {
            *a = R::start(x, rows.start);
        }
        // SAFETY: forwarded.
        unsafe { R::push_rows(acc, base, rows.start + 1..rows.end, row_stride) };
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<R: Reducer>(
            base: *const R::In,
            rows: std::ops::Range<usize>,
            row_stride: isize,
            acc: &mut [R::Part],
        ) {
            // SAFETY: forwarded.
            unsafe { body::<R>(base, rows, row_stride, acc) }
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2; the rest is forwarded.
            return unsafe { avx2::<R>(base, rows, row_stride, acc) };
        }
    }
    // SAFETY: forwarded.
    unsafe { body::<R>(base, rows, row_stride, acc) }
}

/// Runs a validated reduction.
///
/// # Safety
/// As for [`reduce`], with `R::In` and `R::Out` the element types of `x` and `out`.
unsafe fn run<R: Reducer>(p: &Plan) -> Result<(), String> {
    let ndim = p.shape.len();
    let n: usize = (0..ndim).filter(|&d| p.reduced[d]).map(|d| p.shape[d]).product();
    let count: usize = (0..ndim).filter(|&d| !p.reduced[d]).map(|d| p.shape[d]).product();
    // Kept dimensions that move: (size, x stride, out stride).
    let kept: Vec<(usize, isize, isize)> =
        (0..ndim).filter(|&d| !p.reduced[d] && p.shape[d] != 1).map(|d| (p.shape[d], p.xs[d], p.os[d])).collect();
    let (x, out) = (p.x, p.out);
    let write = |off: isize, v: R::Out| {
        // SAFETY: offsets computed from positions inside the shapes stay inside `out`
        // (caller's contract); each output element is written by exactly one task.
        unsafe { *(out as *mut R::Out).offset(off) = v }
    };

    if n == 0 {
        let Some(empty) = R::empty() else {
            return Err(R::EMPTY_ERROR.to_string());
        };
        let shape: Vec<usize> = kept.iter().map(|d| d.0).collect();
        let os: Vec<isize> = kept.iter().map(|d| d.2).collect();
        for i in 0..count {
            let [o] = offsets_at(&shape, [&os], i);
            write(o, R::finish(empty, 0));
        }
        return Ok(());
    }
    if count == 0 {
        return Ok(());
    }
    let reduced_dims: Vec<(usize, isize)> =
        (0..ndim).filter(|&d| p.reduced[d]).map(|d| (p.shape[d], p.xs[d])).collect();
    if kept.is_empty() {
        // SAFETY: the whole of `x` is the block.
        let part = unsafe { reduce_block::<R>(x as *const R::In, &reduced_dims) };
        write(0, R::finish(part, n));
        return Ok(());
    }

    // One axis reduced (all-axes reductions have no kept dimension), several outputs.
    let (len, stride) = reduced_dims[0];
    let total = n.saturating_mul(count);
    let parallel = total >= REDUCE_PARALLEL_MIN_ELEMS;
    let column = kept.iter().position(|d| d.1 == 1 && d.0 >= 16).filter(|_| stride != 1 && len > 1);

    if let Some(j) = column {
        // Reduce a non-innermost axis: accumulate whole rows, COLS columns per task.
        let (width, _, col_os) = kept[j];
        let panel_shape: Vec<usize> = kept.iter().enumerate().filter(|&(i, _)| i != j).map(|(_, d)| d.0).collect();
        let panel_xs: Vec<isize> = kept.iter().enumerate().filter(|&(i, _)| i != j).map(|(_, d)| d.1).collect();
        let panel_os: Vec<isize> = kept.iter().enumerate().filter(|&(i, _)| i != j).map(|(_, d)| d.2).collect();
        let blocks = width.div_ceil(COLS);
        let tasks = count / width * blocks;
        let locate = |t: usize| {
            let [xo, oo] = offsets_at(&panel_shape, [&panel_xs, &panel_os], t / blocks);
            let c0 = (t % blocks) * COLS;
            (xo + c0 as isize, oo + c0 as isize * col_os, COLS.min(width - c0))
        };
        let emit = |oo: isize, acc: &[R::Part]| {
            for (c, &a) in acc.iter().enumerate() {
                write(oo + c as isize * col_os, R::finish(a, n));
            }
        };
        let task = |t: usize| {
            let (xo, oo, w) = locate(t);
            let base = (x as *const R::In).wrapping_offset(xo);
            // SAFETY: the task's first element is inside `x`.
            let mut acc = [R::start(unsafe { *base }, 0); COLS];
            // SAFETY: the task's columns and all `len` rows lie inside `x`.
            unsafe { columns::<R>(base, 0..len, stride, &mut acc[..w]) };
            emit(oo, &acc[..w]);
        };
        if !parallel {
            (0..tasks).for_each(task);
        } else if tasks >= 2 * rayon::current_num_threads() {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            // Few, tall tasks: split the rows too and combine the column partials in order.
            for t in 0..tasks {
                let (xo, oo, w) = locate(t);
                let rows_per_piece = (PIECE / w).max(1);
                let pieces = len.div_ceil(rows_per_piece);
                let parts: Vec<Vec<R::Part>> = (0..pieces)
                    .into_par_iter()
                    .map(|piece| {
                        let rows = piece * rows_per_piece..len.min((piece + 1) * rows_per_piece);
                        let base = (x as *const R::In).wrapping_offset(xo);
                        // SAFETY: the first row of the piece is inside `x`.
                        let first = R::start(unsafe { *base.offset(rows.start as isize * stride) }, rows.start);
                        let mut acc = vec![first; w];
                        // SAFETY: the piece's rows and the task's columns lie inside `x`.
                        unsafe { columns::<R>(base, rows, stride, &mut acc) };
                        acc
                    })
                    .collect();
                let combined: Vec<R::Part> = (0..w)
                    .map(|c| {
                        let column: Vec<R::Part> = parts.iter().map(|part| part[c]).collect();
                        tree::<R>(&column)
                    })
                    .collect();
                emit(oo, &combined);
            }
        }
        return Ok(());
    }

    // Reduce each output's line on its own.
    let shape: Vec<usize> = kept.iter().map(|d| d.0).collect();
    let xs: Vec<isize> = kept.iter().map(|d| d.1).collect();
    let os: Vec<isize> = kept.iter().map(|d| d.2).collect();
    let one = |i: usize, parallel: bool| {
        let [xo, oo] = offsets_at(&shape, [&xs, &os], i);
        let base = (x as *const R::In).wrapping_offset(xo);
        // SAFETY: the line of output `i` lies inside `x`.
        let part = unsafe {
            if parallel {
                line_parallel::<R>(base, len, stride, 0)
            } else {
                line::<R>(base, len, stride, 0)
            }
        };
        write(oo, R::finish(part, n));
    };
    if !parallel {
        (0..count).for_each(|i| one(i, false));
    } else if count >= 2 * rayon::current_num_threads() {
        (0..count).into_par_iter().with_min_len((PIECE / len).max(1)).for_each(|i| one(i, false));
    } else {
        (0..count).for_each(|i| one(i, true));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Element;

    /// Deterministic test data: small integers (exact in every dtype), some negative.
    fn data<T: Element>(n: usize, seed: usize) -> Vec<T> {
        (0..n).map(|i| T::from_f64(((i * 7919 + seed * 104_729) % 23) as f64 - 11.0)).collect()
    }

    /// A view of `v` with element 0 at `v[offset]`.
    fn view<T: Element>(v: &[T], shape: &[usize], strides: &[isize], offset: isize) -> TensorView {
        TensorView {
            data: v.as_ptr().wrapping_offset(offset) as usize,
            dtype: T::DTYPE,
            shape: shape.into(),
            strides: strides.into(),
        }
    }

    fn input<T: Element>(v: &[T], shape: &[usize]) -> TensorView {
        TensorView::contiguous(v.as_ptr() as usize, T::DTYPE, shape)
    }

    fn output<T: Element>(v: &mut [T], shape: &[usize]) -> TensorView {
        TensorView::contiguous(v.as_mut_ptr() as usize, T::DTYPE, shape)
    }

    /// Reads element `i` of a buffer holding elements of `dtype` as f64.
    fn read(buf: &[u64], dtype: DType, i: usize) -> f64 {
        crate::with_dtype!(dtype, T => {
            assert!((i + 1) * std::mem::size_of::<T>() <= buf.len() * 8);
            // SAFETY: checked just above to be inside the buffer.
            unsafe { (*(buf.as_ptr() as *const T).add(i)).to_f64() }
        })
    }

    /// Reads the element at multi-index `idx` of a view as f64.
    fn read_view(v: &TensorView, idx: &[usize]) -> f64 {
        let off: isize = idx.iter().zip(&v.strides).map(|(&i, &s)| i as isize * s).sum();
        crate::with_dtype!(v.dtype, T => {
            // SAFETY: the index is inside a view the test built over live memory.
            unsafe { (*(v.data as *const T).offset(off)).to_f64() }
        })
    }

    fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
        let mut idx = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            idx[d] = i % shape[d];
            i /= shape[d];
        }
        idx
    }

    /// Scalar reference for `op` over the values of one output, in logical order.
    fn reference(op: ReduceOp, vals: &[f64]) -> f64 {
        let nan = vals.iter().position(|x| x.is_nan());
        match op {
            ReduceOp::Sum => vals.iter().sum(),
            ReduceOp::Mean => vals.iter().sum::<f64>() / vals.len() as f64,
            ReduceOp::Max if nan.is_some() => f64::NAN,
            ReduceOp::Min if nan.is_some() => f64::NAN,
            ReduceOp::Max => vals.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            ReduceOp::Min => vals.iter().copied().fold(f64::INFINITY, f64::min),
            ReduceOp::ArgMax => nan.unwrap_or_else(|| {
                let mut best = 0;
                for (i, &x) in vals.iter().enumerate() {
                    if x > vals[best] {
                        best = i;
                    }
                }
                best
            }) as f64,
        }
    }

    fn tolerance(op: ReduceOp, dtype: DType) -> f64 {
        match (op, dtype) {
            (ReduceOp::Sum | ReduceOp::Mean, DType::F16) => 2e-3,
            (ReduceOp::Sum | ReduceOp::Mean, DType::F32) => 1e-6,
            (ReduceOp::Sum | ReduceOp::Mean, _) => 1e-12,
            _ => 0.0,
        }
    }

    fn close(got: f64, want: f64, tol: f64) -> bool {
        (got.is_nan() && want.is_nan()) || got == want || (got - want).abs() <= tol * want.abs().max(1.0)
    }

    /// Runs `op` on `x` over `axis` and compares every output with the scalar reference.
    fn check_keepdims(op: ReduceOp, x: &TensorView, axis: Option<isize>, keepdims: bool) {
        let out_dtype = reduce_result_dtype(op, x.dtype);
        let out_shape = reduce_shape(&x.shape, axis, keepdims).unwrap();
        let count: usize = out_shape.iter().product();
        let mut buf = vec![0u64; count.max(1)];
        let out = TensorView::contiguous(buf.as_mut_ptr() as usize, out_dtype, &out_shape);
        // SAFETY: views over live test buffers; `out` is disjoint from `x`.
        unsafe { reduce(op, x, axis, &out) }.unwrap();
        let ndim = x.ndim();
        let axis = axis.map(|a| normalize_axis(a, ndim).unwrap());
        let kept: Vec<usize> = (0..ndim).filter(|&d| axis.is_some_and(|a| a != d)).collect();
        let kept_shape: Vec<usize> = kept.iter().map(|&d| x.shape[d]).collect();
        for o in 0..count {
            let oidx = unravel(o, &kept_shape);
            let vals: Vec<f64> = match axis {
                None => (0..x.numel()).map(|i| read_view(x, &unravel(i, &x.shape))).collect(),
                Some(a) => {
                    let mut idx = vec![0; ndim];
                    for (k, &d) in kept.iter().enumerate() {
                        idx[d] = oidx[k];
                    }
                    (0..x.shape[a])
                        .map(|r| {
                            idx[a] = r;
                            read_view(x, &idx)
                        })
                        .collect()
                }
            };
            let want = reference(op, &vals);
            let got = read(&buf, out_dtype, o);
            assert!(
                close(got, want, tolerance(op, x.dtype)),
                "{op:?} {} shape {:?} strides {:?} axis {axis:?} keepdims {keepdims} output {o}: got {got}, want {want}",
                x.dtype,
                x.shape,
                x.strides,
            );
        }
    }

    fn check(op: ReduceOp, x: &TensorView, axis: Option<isize>) {
        check_keepdims(op, x, axis, false);
        check_keepdims(op, x, axis, true);
    }

    fn check_all_axes(x: &TensorView) {
        let ndim = x.ndim() as isize;
        let mut axes: Vec<Option<isize>> = vec![None];
        axes.extend((-ndim..ndim).map(Some));
        for op in ReduceOp::ALL {
            for &axis in &axes {
                check(op, x, axis);
            }
        }
    }

    #[test]
    fn shapes_and_axis_errors() {
        assert_eq!(reduce_shape(&[2, 3, 4], Some(1), false).unwrap(), vec![2, 4]);
        assert_eq!(reduce_shape(&[2, 3, 4], Some(-1), true).unwrap(), vec![2, 3, 1]);
        assert_eq!(reduce_shape(&[2, 3, 4], None, true).unwrap(), vec![1, 1, 1]);
        assert_eq!(reduce_shape(&[2, 3, 4], None, false).unwrap(), Vec::<usize>::new());
        assert_eq!(reduce_shape(&[], None, false).unwrap(), Vec::<usize>::new());
        assert_eq!(reduce_shape(&[3], Some(1), false).unwrap_err(), "axis 1 is out of bounds for array of dimension 1");
        assert_eq!(
            reduce_shape(&[3], Some(-2), true).unwrap_err(),
            "axis -2 is out of bounds for array of dimension 1"
        );
        assert_eq!(reduce_shape(&[], Some(0), true).unwrap_err(), "axis 0 is out of bounds for array of dimension 0");
    }

    #[test]
    fn result_dtypes_follow_numpy() {
        use DType::*;
        use ReduceOp::*;
        let cases = [
            (Sum, I32, I64),
            (Sum, I64, I64),
            (Sum, F16, F16),
            (Sum, F32, F32),
            (Sum, F64, F64),
            (Mean, I32, F64),
            (Mean, I64, F64),
            (Mean, F16, F16),
            (Mean, F32, F32),
            (Max, I32, I32),
            (Min, F16, F16),
            (ArgMax, F32, I64),
            (ArgMax, I32, I64),
        ];
        for (op, input, want) in cases {
            assert_eq!(reduce_result_dtype(op, input), want, "{op:?} {input}");
        }
    }

    #[test]
    fn contiguous_every_dtype_axis_and_keepdims() {
        for dtype in DType::ALL {
            crate::with_dtype!(dtype, T => {
                let v = data::<T>(2 * 3 * 4, 1);
                check_all_axes(&input(&v, &[2, 3, 4]));
                let v = data::<T>(2000, 2);
                check_all_axes(&input(&v, &[2000]));
                check_all_axes(&input(&v[..37], &[37]));
                // Wide enough for the column path (axis 0 of 5 x 40).
                let v = data::<T>(5 * 40, 3);
                check_all_axes(&input(&v, &[5, 40]));
                check_all_axes(&input(&v, &[1, 200]));
                check_all_axes(&input(&v[..1], &[]));
                check_all_axes(&input(&v[..1], &[1, 1]));
            })
        }
    }

    #[test]
    fn strided_transposed_reversed_and_broadcast_inputs() {
        for dtype in DType::ALL {
            crate::with_dtype!(dtype, T => {
                let v = data::<T>(6 * 40, 4);
                // Transposed (40, 6) view of a (6, 40) array.
                check_all_axes(&view(&v, &[40, 6], &[1, 40], 0));
                // Rows 5, 3, 1 (reversed) and every other column.
                check_all_axes(&view(&v, &[3, 20], &[-80, 2], 5 * 40));
                // Reversed columns.
                check_all_axes(&view(&v, &[6, 40], &[40, -1], 39));
                // A broadcast dimension.
                check_all_axes(&view(&v, &[4, 3, 40], &[0, 80, 1], 0));
                // A 3-D permutation.
                check_all_axes(&view(&v, &[4, 6, 10], &[10, 40, 1], 0));
                // A long strided line (gathered in blocks).
                let v = data::<T>(3 * 1500, 5);
                check_all_axes(&view(&v, &[1500], &[3], 0));
            })
        }
    }

    #[test]
    fn large_inputs_use_every_parallel_path() {
        let v = data::<f32>(300_000, 5);
        let w = data::<i64>(300_000, 6);
        let h = data::<f16>(300_000, 7);
        let layouts: [(&[usize], &[isize]); 6] = [
            (&[300_000], &[1]),
            (&[4, 75_000], &[75_000, 1]), // few long lines
            (&[1000, 300], &[300, 1]),    // many lines
            (&[600, 500], &[500, 1]),     // axis 0: many column tasks
            (&[7500, 40], &[40, 1]),      // axis 0: one tall column task
            (&[500, 600], &[1, 500]),     // transposed
        ];
        for (shape, strides) in layouts {
            for op in ReduceOp::ALL {
                for axis in [None, Some(0), Some(-1)] {
                    check_keepdims(op, &view(&v, shape, strides, 0), axis, false);
                    check_keepdims(op, &view(&w, shape, strides, 0), axis, false);
                }
            }
            check_keepdims(ReduceOp::Sum, &view(&h, shape, strides, 0), Some(0), false);
        }
    }

    #[test]
    fn argmax_returns_the_first_maximum_and_the_first_nan() {
        let mut v = vec![1.0f32; 300_000];
        for i in [70_000, 140_000, 290_000] {
            v[i] = 5.0;
        }
        let mut out = [0i64];
        let o = output(&mut out, &[]);
        let argmax = |x: &TensorView| {
            // SAFETY: views over live buffers; `out` is disjoint from `v`.
            unsafe { reduce(ReduceOp::ArgMax, x, None, &o) }.unwrap();
            // SAFETY: `o` points to `out`, written above.
            unsafe { *(o.data as *const i64) }
        };
        assert_eq!(argmax(&input(&v, &[300_000])), 70_000);
        v[200_000] = f32::NAN;
        v[250_000] = f32::NAN;
        assert_eq!(argmax(&input(&v, &[300_000])), 200_000);
        // Transposed: the index is into the row-major flattening of the view.
        let flat = |i: usize| ((i % 1000) * 300 + i / 1000) as i64;
        assert_eq!(argmax(&view(&v, &[1000, 300], &[1, 1000], 0)), flat(200_000).min(flat(250_000)));
    }

    #[test]
    fn nan_and_inf_follow_numpy() {
        let nan = f64::NAN;
        let inf = f64::INFINITY;
        let rows: [&[f64]; 6] = [
            &[1.0, nan, 3.0, nan],
            &[1.0, inf, -inf],
            &[-inf, -inf],
            &[nan, 1.0, 2.0],
            &[inf, 1.0, inf],
            &[-0.0, 0.0, -1.0],
        ];
        for row in rows {
            for dtype in [DType::F16, DType::F32, DType::F64] {
                crate::with_dtype!(dtype, T => {
                    let v: Vec<T> = row.iter().map(|&x| T::from_f64(x)).collect();
                    for op in ReduceOp::ALL {
                        check(op, &input(&v, &[v.len()]), None);
                    }
                    // The same values down columns (the column path) and along long lines.
                    let wide: Vec<T> = row.iter().flat_map(|&x| std::iter::repeat_n(T::from_f64(x), 20)).collect();
                    for op in ReduceOp::ALL {
                        check(op, &input(&wide, &[row.len(), 20]), Some(0));
                        check(op, &input(&wide, &[row.len() * 20]), None);
                    }
                })
            }
        }
    }

    #[test]
    fn empty_reductions() {
        let v: Vec<f32> = Vec::new();
        let x = input(&v, &[0, 3]);
        let mut o32 = [7.0f32; 3];
        let mut o64 = [7i64; 3];
        for (op, want) in [(ReduceOp::Sum, 0.0), (ReduceOp::Mean, f64::NAN)] {
            let o = output(&mut o32, &[3]);
            // SAFETY: views over live buffers.
            unsafe { reduce(op, &x, Some(0), &o) }.unwrap();
            assert!(o32.iter().all(|&g| close(g as f64, want, 0.0)), "{op:?}: {o32:?}");
        }
        let o = output(&mut o32, &[3]);
        for (op, message) in [
            (ReduceOp::Max, "zero-size array to reduction operation maximum which has no identity"),
            (ReduceOp::Min, "zero-size array to reduction operation minimum which has no identity"),
        ] {
            // SAFETY: as above.
            assert_eq!(unsafe { reduce(op, &x, Some(0), &o) }.unwrap_err(), message);
        }
        let oi = output(&mut o64, &[3]);
        // SAFETY: as above.
        let err = unsafe { reduce(ReduceOp::ArgMax, &x, Some(0), &oi) }.unwrap_err();
        assert_eq!(err, "attempt to get argmax of an empty sequence");
        // SAFETY: as above.
        let err = unsafe { reduce(ReduceOp::ArgMax, &x, None, &output(&mut o64, &[])) }.unwrap_err();
        assert_eq!(err, "attempt to get argmax of an empty sequence");
        // Reducing an empty axis is numpy's error even into nothing; a non-empty axis into
        // nothing is fine.
        let o0 = output(&mut o32, &[0]);
        // SAFETY: as above.
        assert!(unsafe { reduce(ReduceOp::Max, &input(&v, &[0, 0]), Some(0), &o0) }.is_err());
        // SAFETY: as above.
        unsafe { reduce(ReduceOp::Max, &input(&v, &[3, 0]), Some(0), &o0) }.unwrap();
        // SAFETY: as above.
        unsafe { reduce(ReduceOp::Max, &x, Some(1), &o0) }.unwrap();
        // Sum over all of an empty array.
        o32[0] = 7.0;
        // SAFETY: as above.
        unsafe { reduce(ReduceOp::Sum, &x, None, &output(&mut o32, &[])) }.unwrap();
        assert_eq!(o32[0], 0.0);
    }

    #[test]
    fn argument_errors() {
        let v = data::<f32>(6, 0);
        let x = input(&v, &[2, 3]);
        let mut o64 = [0f64; 3];
        let mut o32 = [0f32; 2];
        // SAFETY: validation fails before anything is read or written.
        let err = unsafe { reduce(ReduceOp::Sum, &x, Some(0), &output(&mut o64, &[3])) }.unwrap_err();
        assert_eq!(err, "sum: out must have dtype float32 for float32 input, got float64");
        // SAFETY: as above.
        let err = unsafe { reduce(ReduceOp::Sum, &x, Some(0), &output(&mut o32, &[2])) }.unwrap_err();
        assert_eq!(err, "sum: out must have shape [3] (or [1, 3] with keepdims), got [2]");
        // SAFETY: as above.
        let err = unsafe { reduce(ReduceOp::Max, &x, Some(2), &output(&mut o32, &[2])) }.unwrap_err();
        assert_eq!(err, "axis 2 is out of bounds for array of dimension 2");
        let bad = TensorView { strides: smallvec::smallvec![1], ..x.clone() };
        // SAFETY: as above.
        assert!(unsafe { reduce(ReduceOp::Max, &bad, None, &output(&mut o32[..1], &[])) }.is_err());
    }

    #[test]
    fn strided_output() {
        let v = data::<f64>(12, 3);
        let mut out = [0f64; 8];
        // Every other element of `out`, reversed.
        let o = TensorView {
            data: out.as_mut_ptr().wrapping_add(6) as usize,
            dtype: DType::F64,
            shape: smallvec::smallvec![4],
            strides: smallvec::smallvec![-2],
        };
        // SAFETY: views over live buffers, disjoint.
        unsafe { reduce(ReduceOp::Sum, &input(&v, &[3, 4]), Some(0), &o) }.unwrap();
        for c in 0..4 {
            let want: f64 = (0..3).map(|r| v[r * 4 + c]).sum();
            assert_eq!(out[6 - 2 * c], want);
        }
    }

    #[test]
    fn int_sums_widen_and_wrap_in_int64() {
        let mut out = [0i64];
        let v = vec![i32::MAX; 3];
        // SAFETY: views over live buffers.
        unsafe { reduce(ReduceOp::Sum, &input(&v, &[3]), None, &output(&mut out, &[])) }.unwrap();
        assert_eq!(out[0], 3 * i32::MAX as i64);
        let v = vec![i64::MAX, 2];
        // SAFETY: as above.
        unsafe { reduce(ReduceOp::Sum, &input(&v, &[2]), None, &output(&mut out, &[])) }.unwrap();
        assert_eq!(out[0], i64::MIN + 1);
        let mut mean = [0f64];
        let v = vec![i64::MAX, i64::MAX];
        // SAFETY: as above.
        unsafe { reduce(ReduceOp::Mean, &input(&v, &[2]), None, &output(&mut mean, &[])) }.unwrap();
        assert_eq!(mean[0], i64::MAX as f64);
    }

    #[test]
    fn float_sums_are_accurate() {
        // 0.1 is inexact in binary: naive float32 summation of a million drifts by ~1e-3.
        let v = vec![0.1f32; 1_000_000];
        let mut out = [0f32];
        // SAFETY: views over live buffers.
        unsafe { reduce(ReduceOp::Sum, &input(&v, &[1_000_000]), None, &output(&mut out, &[])) }.unwrap();
        let want = 0.1f32 as f64 * 1e6;
        assert!((out[0] as f64 - want).abs() / want < 1e-7, "{}", out[0]);
        let v = vec![f16::from_f32(0.1); 10_000];
        let mut out16 = [f16::ZERO];
        // SAFETY: as above.
        unsafe { reduce(ReduceOp::Mean, &input(&v, &[10_000]), None, &output(&mut out16, &[])) }.unwrap();
        assert_eq!(out16[0], f16::from_f32(0.1));
        // Pairwise float64: 1 + many tiny values that a naive loop would lose in part.
        let mut v = vec![1e-16f64; 1 << 20];
        v[0] = 1.0;
        let mut out64 = [0f64];
        // SAFETY: as above.
        unsafe { reduce(ReduceOp::Sum, &input(&v, &[1 << 20]), None, &output(&mut out64, &[])) }.unwrap();
        let want = 1.0 + 1e-16 * ((1 << 20) - 1) as f64;
        assert!((out64[0] - want).abs() < 1e-15, "{} vs {want}", out64[0]);
    }
}
