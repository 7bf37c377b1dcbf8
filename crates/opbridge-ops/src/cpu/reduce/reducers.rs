//! The reductions of each operator, as the traversal in `plan` drives them ([`Reducer`]): how
//! to reduce a contiguous run, combine partial results and fold elements into per-column
//! accumulators. `sum`/`mean` use pairwise summation in a wide accumulator; `max`/`min` keep
//! numpy's NaN propagation in branch-free lanes; `argmax` finds the first maximum (or NaN).
#![allow(unsafe_code)]

use std::marker::PhantomData;

use half::f16;

use super::accum::{Accum, SumIn, SumOut};
use super::{avx2_multiversion, BLOCK, COLS};

/// A reduction, as the traversal (`plan`) needs it: how to reduce a contiguous run (`leaf`), how
/// to combine results of consecutive runs (`combine`, left before right), and how to fold one
/// element at a time into per-column accumulators (`start`, `push`).
pub(super) trait Reducer {
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
pub(super) struct SumR<T, A, O, const MEAN: bool>(PhantomData<(T, A, O)>);

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

/// Element types with an order; floats may be NaN.
pub(super) trait Ordered: Copy + Send + Sync + PartialOrd + 'static {
    fn isnan(self) -> bool;
    /// The maximum (`MAX`) or minimum of a non-empty run by a hand-written kernel, where the
    /// type has one, the CPU runs it and the run holds no NaN.
    #[inline(always)]
    fn fast_extreme<const MAX: bool>(_src: &[Self]) -> Option<Self> {
        None
    }
    /// The index of the first maximum of a non-empty run by a hand-written one-pass kernel,
    /// where the type has one, the CPU runs it and the run holds no NaN.
    #[inline(always)]
    fn fast_argmax(_src: &[Self]) -> Option<usize> {
        None
    }
}

impl Ordered for f16 {
    #[inline(always)]
    fn isnan(self) -> bool {
        self.is_nan()
    }
}
macro_rules! ordered_float {
    ($t:ty) => {
        impl Ordered for $t {
            #[inline(always)]
            fn isnan(self) -> bool {
                self.is_nan()
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            fn fast_extreme<const MAX: bool>(src: &[Self]) -> Option<Self> {
                <$t as super::extreme_avx512::FastExtreme>::fast_extreme::<MAX>(src)
            }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            fn fast_argmax(src: &[Self]) -> Option<usize> {
                <$t as super::extreme_avx512::FastExtreme>::fast_argmax(src)
            }
        }
    };
}
ordered_float!(f32);
ordered_float!(f64);
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
pub(super) struct ExtremeR<T, const MAX: bool>(PhantomData<T>);

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
        if let Some(m) = T::fast_extreme::<MAX>(src) {
            return m;
        }
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

/// Elements [`position_of`] tests at once: a whole chunk is compared without a branch (the
/// compiler vectorizes it), and only the chunk holding a match is searched one by one.
const SEARCH_CHUNK: usize = 64;

avx2_multiversion!(
    /// The index of the first element equal to `m` (not NaN).
    fn position_of<T: Ordered>(src: &[T], m: T) -> Option<usize> {
        let mut start = 0;
        for chunk in src.chunks(SEARCH_CHUNK) {
            // Non-short-circuit `|`: a branch-free fold over the chunk.
            if chunk.iter().fold(false, |found, &x| found | (x == m)) {
                return chunk.iter().position(|&x| x == m).map(|i| start + i);
            }
            start += chunk.len();
        }
        None
    }
);

/// `argmax`: the first index of the maximum, or of the first NaN.
pub(super) struct ArgMaxR<T>(PhantomData<T>);

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
        if let Some(i) = T::fast_argmax(src) {
            return (src[i], first + i);
        }
        // The vectorized maximum, then the first element equal to it (or the first NaN).
        let m = T::fast_extreme::<true>(src).unwrap_or_else(|| max_contiguous(src));
        let i = if m.isnan() { src.iter().position(|x| x.isnan()) } else { position_of(src, m) };
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
