//! The scalar float math the elementwise kernels share: `exp`, `tanh`, `ln` and `erfc` as
//! branch-free polynomials (no libm call per element, so loops over them vectorize), generic
//! over the compute type ([`Real`]: `f32` or `f64`) and over how `a * b + c` is evaluated
//! ([`Mla`]: [`Fused`] where the loop is compiled with FMA, [`Plain`] elsewhere); the element
//! adapters the kernels loop with ([`FloatElement`], [`IntElement`]); and, on x86_64, whole-run
//! AVX-512 kernels for float32 `exp` and `tanh`. One file per function family; the kernels
//! (`unary`, `binary`, `nn`) pick what they need from here.

use std::ops::{Add, Div, Mul, Neg, Sub};

mod element;
mod erf;
mod exp;
mod log;
mod tanh;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;

use self::log::{log_f32_with, log_f64_with};
pub(crate) use element::{narrow_f16, widen_f16, FloatElement, IntElement, F16_CHUNK};
pub(crate) use erf::erfc_with;
pub(crate) use exp::exp_f32;
use exp::{exp_f32_with, exp_f64_with, exp_sum_f32_with, exp_sum_f64_with};
use tanh::{tanh_f32_with, tanh_f64_with};
#[cfg(target_arch = "x86_64")]
pub(crate) use x86_avx512::{WholeRun, EXP_AVX512, LOG_AVX512, SIGMOID_AVX512, SILU_AVX512, TANH_AVX512};

/// Float math in the type an element computes in: `f32` for float16 and float32, `f64` for
/// float64.
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
{
    const ZERO: Self;
    const ONE: Self;
    const HALF: Self;
    /// A constant, rounded to this type.
    fn c(v: f64) -> Self;
    fn is_nan(self) -> bool;
    fn abs(self) -> Self;
    fn sqrt(self) -> Self;
    /// `self` with the low bits of its significand cleared, so that its square is exact.
    fn high_bits(self) -> Self;
    fn powf(self, e: Self) -> Self;
    /// `self * a + b` rounded once (a libm call per element where FMA is not enabled).
    fn mul_add(self, a: Self, b: Self) -> Self;
    /// `e^x` with `a * b + c` evaluated as `M` says (vectorizable in both cases).
    fn exp_with<M: Mla>(self) -> Self;
    /// `e^(self + lo)` for `|lo| < 1`, without rounding `self + lo` first.
    fn exp_sum_with<M: Mla>(self, lo: Self) -> Self;
    fn tanh_with<M: Mla>(self) -> Self;
    fn log_with<M: Mla>(self) -> Self;
}

/// How a kernel evaluates `a * b + c`: [`Fused`] in loops compiled with FMA, [`Plain`]
/// everywhere else (without the target feature `mul_add` is a libm call per element).
pub(crate) trait Mla: Copy {
    fn mla<R: Real>(a: R, b: R, c: R) -> R;
}

/// `a * b + c` with two roundings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plain;

/// `a * b + c` with one rounding (FMA).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fused;

impl Mla for Plain {
    #[inline(always)]
    fn mla<R: Real>(a: R, b: R, c: R) -> R {
        a * b + c
    }
}

impl Mla for Fused {
    #[inline(always)]
    fn mla<R: Real>(a: R, b: R, c: R) -> R {
        a.mul_add(b, c)
    }
}

macro_rules! real {
    ($t:ty, $high_mask:expr, $exp:ident, $exp_sum:ident, $tanh:ident, $log:ident) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const HALF: Self = 0.5;
            #[inline(always)]
            fn c(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn high_bits(self) -> Self {
                <$t>::from_bits(self.to_bits() & $high_mask)
            }
            #[inline(always)]
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
            #[inline(always)]
            fn mul_add(self, a: Self, b: Self) -> Self {
                <$t>::mul_add(self, a, b)
            }
            #[inline(always)]
            fn exp_with<M: Mla>(self) -> Self {
                $exp::<M>(self)
            }
            #[inline(always)]
            fn exp_sum_with<M: Mla>(self, lo: Self) -> Self {
                $exp_sum::<M>(self, lo)
            }
            #[inline(always)]
            fn tanh_with<M: Mla>(self) -> Self {
                $tanh::<M>(self)
            }
            #[inline(always)]
            fn log_with<M: Mla>(self) -> Self {
                $log::<M>(self)
            }
        }
    };
}
// The masks keep 11 significant bits of a float32 and 21 of a float64 (as Sun's `erfc` does).
real!(f32, 0xffff_e000, exp_f32_with, exp_sum_f32_with, tanh_f32_with, log_f32_with);
real!(f64, 0xffff_ffff_0000_0000, exp_f64_with, exp_sum_f64_with, tanh_f64_with, log_f64_with);

/// Horner's rule, highest coefficient first, with `a * b + c` as `M` says.
#[inline(always)]
fn horner<R: Real, M: Mla, const N: usize>(x: R, c: [f64; N]) -> R {
    let mut p = R::c(c[0]);
    for &k in &c[1..] {
        p = M::mla(p, x, R::c(k));
    }
    p
}
