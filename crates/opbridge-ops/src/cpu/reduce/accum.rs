//! The sum accumulators of `sum` and `mean`: [`Accum`] (float32, float64 or wrapping int64),
//! how each input dtype widens into one ([`SumIn`], with the lane-wise block sum and the
//! narrower accumulator used down short columns) and how the result rounds to the output dtype
//! ([`SumOut`]).

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::{BLOCK, LANES};

/// A sum accumulator: float32, float64, or wrapping int64.
pub(super) trait Accum: Copy + Send + Sync + 'static {
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
    #[inline]
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
    #[inline]
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
    #[inline]
    fn div_count(self, n: usize) -> Self {
        if n == 0 {
            0
        } else {
            self / n as i64
        }
    }
}

/// An element type summed in accumulator `A`.
pub(super) trait SumIn<A: Accum>: Copy + Send + Sync + 'static {
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
pub(super) trait SumOut<A>: Copy + 'static {
    fn from_acc(a: A) -> Self;
}

impl SumOut<f32> for f16 {
    #[inline]
    fn from_acc(a: f32) -> Self {
        f16::from_f32(a)
    }
}
impl SumOut<f64> for f32 {
    #[inline]
    fn from_acc(a: f64) -> Self {
        a as f32
    }
}
impl SumOut<f64> for f64 {
    #[inline]
    fn from_acc(a: f64) -> Self {
        a
    }
}
impl SumOut<i64> for i64 {
    #[inline]
    fn from_acc(a: i64) -> Self {
        a
    }
}
