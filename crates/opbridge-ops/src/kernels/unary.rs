//! Elementwise unary kernels with numpy semantics over strided views, and the scalar math the
//! elementwise families share (float16 computes in float32 and rounds once, as numpy does).
//!
//! dtype rule ([`unary_result_dtype`]): float inputs keep their dtype; on int32/int64, `neg`,
//! `abs` and `relu` keep the dtype (wrapping: `abs(i32::MIN) == i32::MIN`, as numpy), every
//! other op returns float64 (numpy's `np.exp(int_array)` is float64). The kernel itself runs
//! only on `x.dtype == out.dtype == unary_result_dtype(op, x.dtype)`: the caller casts int
//! inputs to float64 first (see `cast::cast_view`).
#![allow(unsafe_code)]

use std::ops::{Add, Div, Mul, Neg, Sub};

use half::f16;
use opbridge_runtime::DType;

use super::broadcast::{self, StridedLoop};
use super::thresholds;
use super::Element;
use crate::view::TensorView;

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

/// `e^x` in float32 without branches or libm calls, so loops over it vectorize (libm's `expf`
/// is a call per element): Cephes' polynomial after the Cody-Waite reduction `x = n ln 2 + r`,
/// about 1 ulp. The scale `2^n` is applied in two halves so results down in the subnormal range
/// are right too; overflow gives inf, NaN stays NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    exp_f32_with::<Plain>(x)
}

#[inline(always)]
fn exp_f32_with<M: Mla>(x: f32) -> f32 {
    // Adding -0.0 changes no value, so it compiles to nothing.
    exp_sum_f32_with::<M>(x, -0.0)
}

/// `e^(x + lo)` as [`exp_f32_with`], `lo` (|lo| < 1) entering the reduced argument; the
/// thresholds look at `x` alone.
#[inline(always)]
fn exp_sum_f32_with<M: Mla>(x: f32, lo: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Below LO the result is 0 even as a subnormal; above HI it is inf.
    const LO: f32 = -104.0;
    const HI: f32 = 88.722_84;
    let xc = x.clamp(LO, HI);
    let (e, ni) = exp_f32_reduced::<M>((xc + lo) * LOG2E, xc, lo);
    // 2^n as two normal factors (n in [-150, 128]).
    let half = ni >> 1;
    let s1 = f32::from_bits(((half + 127) as u32) << 23);
    let s2 = f32::from_bits(((ni - half + 127) as u32) << 23);
    let y = e * s1 * s2;
    let y = if x > HI { f32::INFINITY } else { y };
    let y = if x < LO { 0.0 } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `(e^r, n)` with `x + lo = n ln 2 + r`, `n = round(x_log2e)` (`x_log2e` is `(x + lo) log2 e`,
/// finite).
#[inline(always)]
fn exp_f32_reduced<M: Mla>(x_log2e: f32, x: f32, lo: f32) -> (f32, i32) {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let t = x_log2e + ROUND;
    let n = t - ROUND;
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = M::mla(n, -LN2_LO, M::mla(n, -LN2_HI, x) + lo);
    let mut p = 1.987_569_2e-4f32;
    p = M::mla(p, r, 1.398_2e-3);
    p = M::mla(p, r, 8.333_452e-3);
    p = M::mla(p, r, 4.166_579_6e-2);
    p = M::mla(p, r, 0.166_666_65);
    p = M::mla(p, r, 0.5);
    (M::mla(p, r * r, r) + 1.0, ni)
}

/// `tanh` in float32, branch-free so it vectorizes: Cephes' `tanhf` (an odd polynomial below
/// |x| = 0.625, `1 - 2 / (e^2|x| + 1)` above), about 1 ulp. Past |x| = 9.1 tanh rounds to ±1,
/// so `e^2|x|` needs neither the overflow nor the subnormal handling of [`exp_f32`].
#[inline(always)]
fn tanh_f32_with<M: Mla>(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let mut p = -5.704_988_7e-3f32;
    p = M::mla(p, z, 2.063_909e-2);
    p = M::mla(p, z, -5.373_971_6e-2);
    p = M::mla(p, z, 1.333_144_2e-1);
    p = M::mla(p, z, -3.333_328e-1);
    let small = M::mla(p * z, x, x);
    // NaN passes the clamp (the comparison is false) and comes out of `small`.
    let y = 2.0 * if a > 9.1 { 9.1 } else { a };
    let (e, ni) = exp_f32_reduced::<M>(y * std::f32::consts::LOG2_E, y, -0.0);
    let e = e * f32::from_bits(((ni + 127) as u32) << 23);
    let big = 1.0 - 2.0 / (e + 1.0);
    // tanh keeps the sign of x; copysign also keeps that of -0 (`x + x z p` would give +0).
    (if a > 0.625 { big } else { small }).copysign(x)
}

/// Where [`tanh_f32_avx512`] clamps `|x|`: past it tanh rounds to ±1 (`tanh 9.5 = 1 - 1.1e-8`).
#[cfg(target_arch = "x86_64")]
const TANH_F32_TOP: f32 = 9.5;
/// The lower edge of the quarter-octave below row 1 of `TANH_F32_ROWS`: `|x|` under it take
/// row 0.
#[cfg(target_arch = "x86_64")]
const TANH_F32_LOW: f32 = 0.039_062_5;

/// `tanh |x|` piecewise for [`tanh_f32_avx512`]: one row `[b, c0, ..., c5]` per interval of
/// `|x|`, `tanh |x| = c0 + c1 y + ... + c5 y^5` with `y = |x| - b`. Rows 1 to 31 are the
/// quarter-octaves from 0.046875 to 9.5 (the interval index is `|x|`'s exponent and top two
/// significand bits); row 0 takes all of [0, 0.046875) with `b = 0`, an odd polynomial and
/// `c1 = 1`, so tiny and subnormal `x` come out exact, and the last row expands around 9.5
/// with `c0 = 1`, so the clamp there gives exactly 1. Coefficients: relative-error minimax fits
/// (Lawson's iteration), each rounded to float32 in turn with the rest refitted; `b` near the
/// middle where `tanh b` is closest to a float32; the lowest degree within 0.1 ulp, 5 at
/// most. Measured over every float32: within 1 ulp of tanh in float64. `tools/fit_tanh_f32.py`
/// prints this table.
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
const TANH_F32_ROWS: [[f32; 7]; 32] = [
    [0.0, 0.0, 1.0, 0.0, -0.33333322, 0.0, 0.13316984], // [0, 0.046875)
    [0.05078377, 0.050740156, 0.99742544, -0.050609086, -0.32993624, 0.0, 0.0], // [0.046875, 0.0546875)
    [0.058593407, 0.058526445, 0.99657464, -0.058325917, -0.32761475, 0.0, 0.0], // [0.0546875, 0.0625)
    [0.07032413, 0.07020843, 0.99507076, -0.069860846, -0.32645643, 0.0, 0.0], // [0.0625, 0.078125)
    [0.085925296, 0.08571445, 0.992653, -0.085082665, -0.32326284, 0.0, 0.0], // [0.078125, 0.09375)
    [0.101560496, 0.10121275, 0.989756, -0.10017283, -0.31991795, 0.0, 0.0], // [0.09375, 0.109375)
    [0.11719151, 0.11665794, 0.98639095, -0.115067326, -0.31577086, 0.0, 0.0], // [0.109375, 0.125)
    [0.1405984, 0.13967922, 0.98048973, -0.13695394, -0.3077641, 0.08802456, 0.0], // [0.125, 0.15625)
    [0.17188764, 0.17021458, 0.971027, -0.16528283, -0.29562518, 0.10471445, 0.0], // [0.15625, 0.1875)
    [0.20314354, 0.20039451, 0.959842, -0.19234717, -0.28130704, 0.1209317, 0.0], // [0.1875, 0.21875)
    [0.23434588, 0.23014814, 0.94703186, -0.21795754, -0.2656084, 0.13335611, 0.0], // [0.21875, 0.25)
    [0.28121307, 0.27402744, 0.92490894, -0.2534505, -0.23876022, 0.1500054, 0.0], // [0.25, 0.3125)
    [0.34375155, 0.3308225, 0.89055645, -0.29461613, -0.1993295, 0.16413261, 0.0], // [0.3125, 0.375)
    [0.4062664, 0.38529792, 0.8515455, -0.32809868, -0.15743193, 0.1699182, 0.0], // [0.375, 0.4375)
    [0.46870717, 0.43715414, 0.80889624, -0.35361236, -0.11504932, 0.1681326, 0.0], // [0.4375, 0.5)
    [0.56240565, 0.50976014, 0.7401448, -0.37729615, -0.05459192, 0.15333652, 0.0], // [0.5, 0.625)
    [0.6874732, 0.5963563, 0.6443592, -0.38426766, 0.014396873, 0.11949016, -0.06594322], // [0.625, 0.75)
    [0.81253767, 0.6709878, 0.5497754, -0.3688926, 0.06423513, 0.07987232, -0.057011228], // [0.75, 0.875)
    [0.9374493, 0.7340481, 0.4611736, -0.33852375, 0.094510265, 0.04342754, 0.0], // [0.875, 1)
    [1.1251353, 0.80934775, 0.34495622, -0.27919146, 0.11097751, 0.0036462257, -0.03208661], // [1, 1.25)
    [1.3750954, 0.87984824, 0.22586706, -0.19872986, 0.09956452, -0.021121036, -0.009574206], // [1.25, 1.5)
    [1.6249857, 0.92534417, 0.14373808, -0.13300788, 0.07519147, -0.02511474, 0.0], // [1.5, 1.75)
    [1.875007, 0.9540459, 0.08979644, -0.08566997, 0.051800705, -0.02085114, 0.0046170563], // [1.75, 2)
    [2.2495773, 0.97800773, 0.04350087, -0.04254298, 0.027108662, -0.0123938, 0.0039773914], // [2, 2.5)
    [2.7503352, 0.99186516, 0.016203513, -0.01607078, 0.010539231, -0.0051442278, 0.0019166019], // [2.5, 3)
    [3.2504308, 0.9970002, 0.005990569, -0.005972185, 0.0039575207, -0.0019762286, 7.7126734e-4], // [3, 3.5)
    [3.7502475, 0.998895, 0.002208801, -0.0022061986, 0.0014675354, -7.388688e-4, 2.929516e-4], // [3.5, 4)
    [4.500294, 0.99975336, 4.932418e-4, -4.925037e-4, 3.281411e-4, -1.7184949e-4, 6.859165e-5], // [4, 5)
    [5.500363, 0.9999666, 6.6758126e-5, -6.6672066e-5, 4.4439847e-5, -2.3298917e-5, 9.319016e-6], // [5, 6)
    [6.4990463, 0.99999547, 9.035278e-6, -9.035731e-6, 6.4205688e-6, -3.2002154e-6, 0.0], // [6, 7)
    [7.5009537, 0.9999994, 1.2212769e-6, -1.6813864e-6, 8.1013553e-7, 1.4154325e-6, 1.9704372e-7], // [7, 8)
    [9.5, 1.0, 3.9240268e-7, 1.9496983e-6, 3.700425e-6, 2.8081304e-6, 7.587193e-7], // [8, 9.5)
];

/// `TANH_F32_ROWS` transposed into seven 32-lane tables (`b`, `c0`, ..., `c5`), each row at the
/// lane its interval index selects: an index is `|x|`'s bits shifted right by 21 and
/// `vpermt2ps` reads its low five bits, so row `i` sits at lane `(i + 9) % 32` (9 for the
/// quarter-octave starting at `TANH_F32_LOW`, which row 0 takes).
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TanhF32Lut([[f32; 32]; 7]);

#[cfg(target_arch = "x86_64")]
static TANH_F32_LUT: TanhF32Lut = {
    let first = ((TANH_F32_LOW.to_bits() >> 21) & 31) as usize;
    let mut lut = [[0.0f32; 32]; 7];
    let mut i = 0;
    while i < 32 {
        let mut k = 0;
        while k < 7 {
            lut[k][(i + first) % 32] = TANH_F32_ROWS[i][k];
            k += 1;
        }
        i += 1;
    }
    TanhF32Lut(lut)
};

/// `out[i] = tanh(x[i])` for `i < len` in float32 with AVX-512, about twice as fast as
/// [`tanh_f32_with`] and within 1 ulp: numpy's scheme (a polynomial per interval of `|x|`, its
/// coefficients picked per lane with `vpermt2ps` from 32-entry tables) with our own intervals
/// and fits (see `TANH_F32_ROWS`); 18 instructions per 16 elements, no division. NaN stays NaN,
/// ±inf gives ±1, -0 gives -0. The tail is one masked vector.
///
/// # Safety
/// `x` is readable and `out` writable for `len` elements, touched by nothing else during the
/// call; `out` is `x` or disjoint from it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
unsafe fn tanh_f32_avx512(x: *const f32, out: *mut f32, len: usize) {
    use std::arch::x86_64::*;
    // A plain loop, not `array::map`: a closure is not compiled with this function's target
    // features, so each load became an out-of-line call (a third of a 16-element call's time).
    let mut lut = [[_mm512_setzero_ps(); 2]; 7];
    for (regs, table) in lut.iter_mut().zip(&TANH_F32_LUT.0) {
        // SAFETY: each table is 32 floats, loaded as two halves of 16.
        *regs = unsafe { [_mm512_loadu_ps(table.as_ptr()), _mm512_loadu_ps(table.as_ptr().add(16))] };
    }
    let mut i = 0;
    while i + 16 <= len {
        // SAFETY: elements `i..i + 16` are inside the run (caller's contract); each vector is
        // loaded before it is stored, so `out == x` is fine.
        unsafe { _mm512_storeu_ps(out.add(i), tanh_f32x16(_mm512_loadu_ps(x.add(i)), &lut)) };
        i += 16;
    }
    if i < len {
        let m = ((1u32 << (len - i)) - 1) as __mmask16;
        // SAFETY: the mask touches only elements `i..len`, inside the run.
        unsafe { _mm512_mask_storeu_ps(out.add(i), m, tanh_f32x16(_mm512_maskz_loadu_ps(m, x.add(i)), &lut)) };
    }
}

/// 16 lanes of [`tanh_f32_avx512`], with the tables of `TANH_F32_LUT` in registers.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
fn tanh_f32x16(x: std::arch::x86_64::__m512, lut: &[[std::arch::x86_64::__m512; 2]; 7]) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let xi = _mm512_castps_si512(x);
    let abs = _mm512_castsi512_ps(_mm512_and_si512(xi, _mm512_set1_epi32(i32::MAX)));
    // `vminps` returns its second operand when either is NaN: NaN goes through the polynomial
    // and stays NaN.
    let a = _mm512_min_ps(_mm512_set1_ps(TANH_F32_TOP), abs);
    // The interval index (its low five bits); everything below `TANH_F32_LOW` takes row 0.
    let low = _mm512_set1_epi32(TANH_F32_LOW.to_bits() as i32);
    let idx = _mm512_srli_epi32::<21>(_mm512_max_epi32(_mm512_castps_si512(a), low));
    let pick = |k: usize| _mm512_permutex2var_ps(lut[k][0], idx, lut[k][1]);
    let y = _mm512_sub_ps(a, pick(0));
    let mut r = pick(6);
    for k in (1..6).rev() {
        r = _mm512_fmadd_ps(r, y, pick(k));
    }
    // tanh |x| is +0 or more, so or-ing in the sign of x gives tanh x, -0 included.
    _mm512_castsi512_ps(_mm512_ternarylogic_epi32::<0xf8>(_mm512_castps_si512(r), xi, _mm512_set1_epi32(i32::MIN)))
}

/// Where [`exp_f32_avx512`] clamps `x`: `e^x` rounds to 0 below `EXP_F32_LOW` (`e^-104` is under
/// half the smallest subnormal, 2^-150) and overflows above `EXP_F32_HIGH`.
#[cfg(target_arch = "x86_64")]
const EXP_F32_LOW: f32 = -104.0;
#[cfg(target_arch = "x86_64")]
const EXP_F32_HIGH: f32 = 89.0;

/// `e^r = 1 + c1 r + ... + c6 r^6` on `|r| <= ln 2 / 2` for [`exp_f32_avx512`], `c1` first:
/// a relative-error minimax fit (Lawson's iteration), each coefficient rounded to float32 in
/// turn with the rest refitted; within 0.06 ulp before rounding.
#[cfg(target_arch = "x86_64")]
const EXP_F32_POLY: [f32; 6] = [1.0, 0.499_999_94, 0.166_665_21, 0.041_668_266, 0.008_368_675, 0.001_382_066_2];

/// `out[i] = e^x[i]` for `i < len` in float32 with AVX-512, about three times as fast as
/// [`exp_f32_with`] and within 1 ulp: the Cody-Waite reduction `x = n ln 2 + r` (`n` rounded
/// with `vrndscaleps`, `ln 2` in two parts with FMA), a degree-6 polynomial for `e^r` (see
/// `EXP_F32_POLY`) and `vscalefps` for the `2^n`, which rounds subnormal results once and
/// overflows to inf; 12 instructions per 16 elements. NaN stays NaN, `e^-inf = 0`,
/// `e^inf = inf`. The tail is one masked vector.
///
/// # Safety
/// `x` is readable and `out` writable for `len` elements, touched by nothing else during the
/// call; `out` is `x` or disjoint from it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
unsafe fn exp_f32_avx512(x: *const f32, out: *mut f32, len: usize) {
    use std::arch::x86_64::*;
    let mut i = 0;
    while i + 16 <= len {
        // SAFETY: elements `i..i + 16` are inside the run (caller's contract); each vector is
        // loaded before it is stored, so `out == x` is fine.
        unsafe { _mm512_storeu_ps(out.add(i), exp_f32x16(_mm512_loadu_ps(x.add(i)))) };
        i += 16;
    }
    if i < len {
        let m = ((1u32 << (len - i)) - 1) as __mmask16;
        // SAFETY: the mask touches only elements `i..len`, inside the run.
        unsafe { _mm512_mask_storeu_ps(out.add(i), m, exp_f32x16(_mm512_maskz_loadu_ps(m, x.add(i)))) };
    }
}

/// 16 lanes of [`exp_f32_avx512`].
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
fn exp_f32x16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // ln 2 rounded to float32, and the rest: `n * LN2_HI` is exact in the FMA and
    // `x - n * LN2_HI` a float32 (|n| <= 150).
    const LN2_HI: f32 = std::f32::consts::LN_2;
    const LN2_LO: f32 = -1.904_654_2e-9;
    // `vminps`/`vmaxps` return their second operand when either is NaN: NaN goes through and
    // stays NaN; ±inf clamp to results of exactly inf and 0.
    let x = _mm512_max_ps(_mm512_set1_ps(EXP_F32_LOW), _mm512_min_ps(_mm512_set1_ps(EXP_F32_HIGH), x));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_F32_POLY[5]);
    for k in (0..5).rev() {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_F32_POLY[k]));
    }
    let p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0));
    _mm512_scalef_ps(p, n)
}

/// `e^x` in float64, branch-free so loops vectorize: SLEEF's degree-11 polynomial after the
/// Cody-Waite reduction, about 1 ulp; subnormal results, overflow, `-inf` and NaN as
/// [`exp_f32`].
#[inline(always)]
fn exp_f64_with<M: Mla>(x: f64) -> f64 {
    // As in `exp_f32_with`: adding -0.0 compiles to nothing.
    exp_sum_f64_with::<M>(x, -0.0)
}

/// `e^(x + lo)` as [`exp_f64_with`], `lo` (|lo| < 1) entering the reduced argument; the
/// thresholds look at `x` alone.
#[inline(always)]
fn exp_sum_f64_with<M: Mla>(x: f64, lo: f64) -> f64 {
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    // ln 2 split so that `n * LN2_HI` is exact for |n| < 2^11.
    const LN2_HI: f64 = 0.693_147_180_559_662_956_511_601_805_686_950_683_593_75;
    const LN2_LO: f64 = 0.282_352_905_630_315_771_225_884_481_750_134_360_255_254_120_68e-12;
    // 1.5 * 2^52: adding and subtracting it rounds to the nearest integer.
    const ROUND: f64 = 6_755_399_441_055_744.0;
    // Below LO the result is 0 even as a subnormal (e^-745.2 < 2^-1075); above HI it is inf.
    const LO: f64 = -746.0;
    const HI: f64 = 709.782_712_893_384;
    let xc = x.clamp(LO, HI);
    let t = (xc + lo) * LOG2E + ROUND;
    let n = t - ROUND;
    let ni = (t.to_bits() as i64).wrapping_sub(ROUND.to_bits() as i64);
    let r = M::mla(n, -LN2_LO, M::mla(n, -LN2_HI, xc) + lo);
    let mut u = 2.088_606_211_072_837e-9;
    u = M::mla(u, r, 2.511_129_308_928_765_2e-8);
    u = M::mla(u, r, 2.755_739_112_349_004_7e-7);
    u = M::mla(u, r, 2.755_723_629_119_288_3e-6);
    u = M::mla(u, r, 2.480_158_715_923_547_3e-5);
    u = M::mla(u, r, 1.984_126_989_605_092e-4);
    u = M::mla(u, r, 1.388_888_888_897_745e-3);
    u = M::mla(u, r, 8.333_333_333_316_527e-3);
    u = M::mla(u, r, 4.166_666_666_666_650_5e-2);
    u = M::mla(u, r, 0.166_666_666_666_666_85);
    u = M::mla(u, r, 0.5);
    let e = M::mla(r * r, u, r) + 1.0;
    // 2^n (n in [-1077, 1024]) as two normal factors; n is halved with the rounding trick
    // because AVX2 has no 64-bit arithmetic shift.
    let half = ((n * 0.5 + ROUND).to_bits() as i64).wrapping_sub(ROUND.to_bits() as i64);
    let s1 = f64::from_bits(((half + 1023) as u64) << 52);
    let s2 = f64::from_bits(((ni - half + 1023) as u64) << 52);
    let y = e * s1 * s2;
    let y = if x > HI { f64::INFINITY } else { y };
    let y = if x < LO { 0.0 } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `tanh` in float64, branch-free: Cephes' `tanh` (a rational function below |x| = 0.625,
/// `1 - 2 / (e^2|x| + 1)` above, where `e^2|x| = inf` gives exactly ±1), about 1 ulp.
#[inline(always)]
fn tanh_f64_with<M: Mla>(x: f64) -> f64 {
    let a = x.abs();
    let z = x * x;
    let p = M::mla(M::mla(-9.643_991_794_250_523e-1, z, -9.928_772_310_019_185e1), z, -1.614_687_684_417_084_5e3);
    let q = M::mla(M::mla(z + 1.128_116_784_916_329_3e2, z, 2.235_488_390_601_004_5e3), z, 4.844_063_053_251_255e3);
    let small = M::mla(x * z, p / q, x);
    let big = 1.0 - 2.0 / (exp_f64_with::<M>(2.0 * a) + 1.0);
    // As in `tanh_f32_with`: the sign of x, -0 included.
    (if a > 0.625 { big } else { small }).copysign(x)
}

/// Horner's rule, highest coefficient first, with `a * b + c` as `M` says.
#[inline(always)]
fn horner<R: Real, M: Mla, const N: usize>(x: R, c: [f64; N]) -> R {
    let mut p = R::c(c[0]);
    for &k in &c[1..] {
        p = M::mla(p, x, R::c(k));
    }
    p
}

/// `ln x` in float32, branch-free so loops vectorize (libm's `logf` is a call per element):
/// Cephes' `logf` polynomial in `m - 1`, where `x = m 2^k` with `m` in [sqrt(1/2), sqrt(2)),
/// within 1 ulp. Subnormals are scaled into the normal range first; `ln 0 = -inf`,
/// `ln(x < 0) = NaN`, `ln inf = inf`, NaN stays NaN.
#[inline(always)]
fn log_f32_with<M: Mla>(x: f32) -> f32 {
    let sub = x < f32::MIN_POSITIVE;
    // Subnormals scaled by 2^25 into the normal range.
    let xs = if sub { x * 33_554_432.0 } else { x };
    // Adding 1 - sqrt(1/2) to the significand carries into the exponent exactly when it is at
    // least sqrt(2), so the exponent field gives k and the significand bits, re-based on
    // sqrt(1/2), give m.
    let ix = (xs.to_bits() as i32).wrapping_add(0x3f80_0000 - 0x3f35_04f3);
    let k = (ix >> 23) - 0x7f - if sub { 25 } else { 0 };
    let m = f32::from_bits(((ix & 0x007f_ffff) + 0x3f35_04f3) as u32);
    let (f, e) = (m - 1.0, k as f32);
    let z = f * f;
    let p = horner::<f32, M, 9>(
        f,
        [
            7.037_683_6e-2,
            -1.151_461e-1,
            1.167_699_9e-1,
            -1.242_014_1e-1,
            1.424_932_3e-1,
            -1.666_805_8e-1,
            2.000_071_4e-1,
            -2.499_999_4e-1,
            3.333_333_1e-1,
        ],
    );
    // ln 2 = 0.693359375 - 2.12194440e-4, the first part exact in e * it.
    let y = M::mla(z, -0.5, M::mla(e, -2.121_944_4e-4, p * z * f));
    let r = M::mla(e, 0.693_359_4, f + y);
    let r = if x == f32::INFINITY { x } else { r };
    let r = if x == 0.0 { f32::NEG_INFINITY } else { r };
    let r = if x < 0.0 { f32::NAN } else { r };
    if x.is_nan() {
        x
    } else {
        r
    }
}

/// `ln x` in float64, branch-free: Sun's `log` (FreeBSD, musl, the `libm` crate), the series of
/// `ln((1 + s) / (1 - s))` in `s = f / (2 + f)`, `f = m - 1` with `m` as in [`log_f32_with`],
/// within 1 ulp; special values as there.
#[inline(always)]
fn log_f64_with<M: Mla>(x: f64) -> f64 {
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    const TWO_52: f64 = 4_503_599_627_370_496.0;
    let sub = x < f64::MIN_POSITIVE;
    // Subnormals scaled by 2^54 into the normal range.
    let xs = if sub { x * 18_014_398_509_481_984.0 } else { x };
    // As in `log_f32_with`; k is read as the float 2^52 + field, exactly, because AVX2 has no
    // 64-bit int-to-float conversion.
    let u = xs.to_bits().wrapping_add((0x3ff0_0000u64 - 0x3fe6_a09e) << 32);
    let k = f64::from_bits(TWO_52.to_bits() | (u >> 52)) - (TWO_52 + 1023.0) - if sub { 54.0 } else { 0.0 };
    let m = f64::from_bits((u & 0x000f_ffff_ffff_ffff) + (0x3fe6_a09e << 32));
    let f = m - 1.0;
    let hfsq = 0.5 * f * f;
    let s = f / (2.0 + f);
    let z = s * s;
    let w = z * z;
    let t1 =
        w * horner::<f64, M, 3>(w, [1.531_383_769_920_937_3e-1, 2.222_219_843_214_978_4e-1, 3.999_999_999_940_942e-1]);
    let t2 = z * horner::<f64, M, 4>(
        w,
        [1.479_819_860_511_658_6e-1, 1.818_357_216_161_805e-1, 2.857_142_874_366_239e-1, 6.666_666_666_666_735e-1],
    );
    // k ln2_hi is exact (ln2_hi ends in zero bits), so fusing its addition changes nothing.
    let r = M::mla(k, LN2_HI, M::mla(s, hfsq + (t2 + t1), k * LN2_LO) - hfsq + f);
    let r = if x == f64::INFINITY { x } else { r };
    let r = if x == 0.0 { f64::NEG_INFINITY } else { r };
    let r = if x < 0.0 { f64::NAN } else { r };
    if x.is_nan() {
        x
    } else {
        r
    }
}

/// `erfc x`, branch-free so loops vectorize (libm's is a call per element): the piecewise
/// rational approximations of Sun's `erfc` (FreeBSD, musl, the `libm` crate), every piece
/// evaluated, the right numerator and denominator selected, then one division. Float32 uses the
/// same coefficients rounded, as `erfcf` does. NaN stays NaN; past |x| = 28 the result is 0 or 2.
#[inline(always)]
fn erfc_with<R: Real, M: Mla>(x: R) -> R {
    const ERX: f64 = 8.450_629_115_104_675e-1;
    let c = R::c;
    let ax = x.abs();
    let neg = x < R::ZERO;
    // |x| < 0.84375: erf x = x + x P(x^2) / Q(x^2).
    let z = x * x;
    let p0 = horner::<R, M, 5>(
        z,
        [
            -2.376_301_665_665_016_3e-5,
            -5.770_270_296_489_442e-3,
            -2.848_174_957_559_851e-2,
            -3.250_421_072_470_015e-1,
            1.283_791_670_955_125_6e-1,
        ],
    );
    let q0 = horner::<R, M, 6>(
        z,
        [
            -3.960_228_278_775_368e-6,
            1.324_947_380_043_216_4e-4,
            5.081_306_281_875_766e-3,
            6.502_224_998_876_73e-2,
            3.979_172_239_591_553_5e-1,
            1.0,
        ],
    );
    // |x| < 1.25: erf |x| = ERX + P(s) / Q(s), s = |x| - 1.
    let s = ax - R::ONE;
    let p1 = horner::<R, M, 7>(
        s,
        [
            -2.166_375_594_868_791e-3,
            3.547_830_432_561_823_6e-2,
            -1.108_946_942_823_966_8e-1,
            3.183_466_199_011_617_5e-1,
            -3.722_078_760_357_013e-1,
            4.148_561_186_837_483_3e-1,
            -2.362_118_560_752_659_4e-3,
        ],
    );
    let q1 = horner::<R, M, 7>(
        s,
        [
            1.198_449_984_679_910_7e-2,
            1.363_708_391_202_905e-2,
            1.261_712_198_087_616_4e-1,
            7.182_865_441_419_627e-2,
            5.403_979_177_021_71e-1,
            1.064_208_804_008_442_3e-1,
            1.0,
        ],
    );
    // |x| < 28: erfc |x| = exp(-x^2 - 0.5625 + P(t) / Q(t)) / |x|, t = 1 / x^2, with one pair of
    // polynomials below |x| = 1 / 0.35 and another above.
    let inv = R::ONE / ax;
    let t = inv * inv;
    let near = ax < c(1.0 / 0.35);
    let p2 = if near {
        horner::<R, M, 8>(
            t,
            [
                -9.814_329_344_169_145,
                -8.128_743_550_630_66e1,
                -1.846_050_929_067_110_4e2,
                -1.623_966_694_625_734_7e2,
                -6.237_533_245_032_600_6e1,
                -1.055_862_622_532_329_1e1,
                -6.938_585_727_071_818e-1,
                -9.864_944_034_847_148e-3,
            ],
        )
    } else {
        horner::<R, M, 7>(
            t,
            [
                -4.835_191_916_086_514e2,
                -1.025_095_131_611_077_2e3,
                -6.375_664_433_683_896e2,
                -1.606_363_848_558_219_2e2,
                -1.775_795_491_775_475_2e1,
                -7.992_832_376_805_23e-1,
                -9.864_942_924_700_1e-3,
            ],
        )
    };
    let q2 = if near {
        horner::<R, M, 9>(
            t,
            [
                -6.042_441_521_485_81e-2,
                6.570_249_770_319_282,
                1.086_350_055_417_794_4e2,
                4.290_081_400_275_678_3e2,
                6.453_872_717_332_679e2,
                4.345_658_774_752_292_3e2,
                1.376_577_541_435_190_4e2,
                1.965_127_166_743_925_7e1,
                1.0,
            ],
        )
    } else {
        horner::<R, M, 8>(
            t,
            [
                -2.244_095_244_658_582e1,
                4.745_285_412_069_553_7e2,
                2.553_050_406_433_164_4e3,
                3.199_858_219_508_595_5e3,
                1.536_729_586_084_437e3,
                3.257_925_129_965_739e2,
                3.033_806_074_348_246e1,
                1.0,
            ],
        )
    };
    let (small, mid) = (ax < c(0.84375), ax < c(1.25));
    let (p, q) = if small {
        (p0, q0)
    } else if mid {
        (p1, q1)
    } else {
        (p2, q2)
    };
    let y = p / q;
    // 1 - erf x, written so that it does not cancel for x in [0.25, 0.84375).
    let r_small = if x < c(0.25) { R::ONE - M::mla(x, y, x) } else { R::HALF - M::mla(x, y, x - R::HALF) };
    let r_mid = if neg { R::ONE + (c(ERX) + y) } else { c(1.0 - ERX) - y };
    // -x^2 = -h^2 + (h - |x|)(h + |x|) with h^2 exact: the large part of exp's argument is
    // exact and the small part is added after exp's reduction.
    let h = ax.high_bits();
    let far = (-h * h - c(0.5625)).exp_sum_with::<M>((h - ax) * (h + ax) + y) * inv;
    let r_far = if neg { c(2.0) - far } else { far };
    let r = if small {
        r_small
    } else if mid {
        r_mid
    } else {
        r_far
    };
    // Past 28 (inf included, where the formula gives NaN) erfc is 0 or 2 in both precisions.
    if ax >= c(28.0) {
        if neg {
            c(2.0)
        } else {
            R::ZERO
        }
    } else {
        r
    }
}

/// A float element: widened to its compute type, rounded back once.
pub(crate) trait FloatElement: Element {
    type R: Real;
    fn up(self) -> Self::R;
    fn down(r: Self::R) -> Self;
    /// `out[i] = down(f(up(x[i])))` for `i < len`, in loops the compiler vectorizes.
    ///
    /// # Safety
    /// `x` and `out` are aligned addresses of `len` elements, readable and writable
    /// respectively, touched by nothing else during the call; `out` is `x` or disjoint from it.
    unsafe fn map_contiguous(x: *const Self, out: *mut Self, len: usize, f: impl Fn(Self::R) -> Self::R);
}

impl FloatElement for f16 {
    type R = f32;
    #[inline(always)]
    fn up(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn down(r: f32) -> f16 {
        f16::from_f32(r)
    }
    /// Through a float32 buffer on the stack, converted with F16C where the CPU has it: computed
    /// in float32 and rounded once, as one element at a time.
    #[inline(always)]
    unsafe fn map_contiguous(x: *const f16, out: *mut f16, len: usize, f: impl Fn(f32) -> f32) {
        use half::slice::HalfFloatSliceExt;
        const CHUNK: usize = 256;
        let mut buf = [0f32; CHUNK];
        let mut start = 0;
        while start < len {
            let buf = &mut buf[..CHUNK.min(len - start)];
            // SAFETY: inside the run (caller's contract); when `out` is `x`, the shared slice
            // is gone before the mutable one over the same elements is made.
            unsafe { std::slice::from_raw_parts(x.add(start), buf.len()) }.convert_to_f32_slice(buf);
            for v in buf.iter_mut() {
                *v = f(*v);
            }
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts_mut(out.add(start), buf.len()) }.convert_from_f32_slice(buf);
            start += buf.len();
        }
    }
}

macro_rules! float_element {
    ($t:ty) => {
        impl FloatElement for $t {
            type R = $t;
            #[inline(always)]
            fn up(self) -> $t {
                self
            }
            #[inline(always)]
            fn down(r: $t) -> $t {
                r
            }
            #[inline(always)]
            unsafe fn map_contiguous(x: *const $t, out: *mut $t, len: usize, f: impl Fn($t) -> $t) {
                if std::ptr::eq(x, out) {
                    // SAFETY: the caller's contract; one slice over the aliased run.
                    for v in unsafe { std::slice::from_raw_parts_mut(out, len) } {
                        *v = f(*v);
                    }
                } else {
                    // SAFETY: the caller's contract; disjoint runs.
                    let xs = unsafe { std::slice::from_raw_parts(x, len) };
                    // SAFETY: as above.
                    let os = unsafe { std::slice::from_raw_parts_mut(out, len) };
                    for (o, &v) in os.iter_mut().zip(xs) {
                        *o = f(v);
                    }
                }
            }
        }
    };
}
float_element!(f32);
float_element!(f64);

/// An integer element: every operation wraps on overflow, as numpy's do.
pub(crate) trait IntElement: Element + Ord {
    const ZERO: Self;
    fn wrapping_sub(self, b: Self) -> Self;
    fn wrapping_mul(self, b: Self) -> Self;
    fn wrapping_neg(self) -> Self;
    fn wrapping_abs(self) -> Self;
    /// `self ** e` by squaring, wrapping; `e` is the exponent's bits read as unsigned (callers
    /// reject negative exponents first).
    #[inline(always)]
    fn wrapping_pow(self, e: Self) -> Self {
        let mut e = e.to_i64() as u64;
        let (mut base, mut acc) = (self, Self::from_i64(1));
        while e > 0 {
            if e & 1 == 1 {
                acc = acc.wrapping_mul(base);
            }
            base = base.wrapping_mul(base);
            e >>= 1;
        }
        acc
    }
}

macro_rules! int_element {
    ($t:ty) => {
        impl IntElement for $t {
            const ZERO: Self = 0;
            #[inline(always)]
            fn wrapping_sub(self, b: Self) -> Self {
                <$t>::wrapping_sub(self, b)
            }
            #[inline(always)]
            fn wrapping_mul(self, b: Self) -> Self {
                <$t>::wrapping_mul(self, b)
            }
            #[inline(always)]
            fn wrapping_neg(self) -> Self {
                <$t>::wrapping_neg(self)
            }
            #[inline(always)]
            fn wrapping_abs(self) -> Self {
                <$t>::wrapping_abs(self)
            }
        }
    };
}
int_element!(i32);
int_element!(i64);

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
/// Errors (the caller maps them to typed errors): dtypes differ, `op` has no kernel for an int
/// dtype (cast to `unary_result_dtype(op, x.dtype)` first), `x` does not broadcast to
/// `out.shape`, or `out` names an element twice (a stride-0 dimension).
///
/// # Safety
/// Every element of `x` (its shape and strides) is readable and every element of `out` is
/// writable, aligned for the dtype, and nothing else writes them during the call; `out`
/// either does not overlap `x` or is exactly `x` (same address, shape and strides), and no
/// two indices of `out` name the same element.
pub unsafe fn unary(op: UnaryOp, x: &TensorView, out: &TensorView) -> Result<(), String> {
    if x.dtype != out.dtype {
        return Err(format!("{op}: input is {} but out is {}", x.dtype, out.dtype));
    }
    let x = broadcast::try_broadcast_view(x, &out.shape).map_err(|e| format!("{op}: {e}"))?;
    if broadcast::has_repeated_elements(out) {
        return Err(format!("{op}: out has a stride-0 dimension (it names one element several times)"));
    }
    // The loop's runs stay inside `out` and `x` (caller's contract), runs
    // are disjoint in `out`, and `out` is either disjoint from `x` or exactly `x`.
    run_loop(op, out.dtype, &StridedLoop::new([out, &x]), op.parallel_min())
}

/// Runs `op` over `lp` (`[out, x]`, both of `dtype`); int dtypes only for the ops that keep
/// them (an error names the dtype to cast to).
fn run_loop(op: UnaryOp, dtype: DType, lp: &StridedLoop<2>, min: usize) -> Result<(), String> {
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
pub unsafe fn unary_contiguous(op: UnaryOp, dtype: DType, x: usize, out: usize, len: usize) -> Result<(), String> {
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
) -> Result<(), String> {
    // The loop is one contiguous run split into chunks: `unary`'s contract for `run_loop`.
    run_loop(op, dtype, &StridedLoop::flat([out, x], [dtype.size(); 2], len), min)
}

/// Runs `f` over every run of `lp` (`[out, x]`).
fn run_map<T: Element>(lp: &StridedLoop<2>, min: usize, f: impl Fn(T) -> T + Copy + Sync) {
    // SAFETY: `lp` was built over `[out, x]` under `unary`'s contract (see there).
    lp.run(min, |p, s, len| unsafe { broadcast::unary_run::<T>(p, s, len, f) });
}

fn run_float<T: FloatElement>(op: UnaryOp, lp: &StridedLoop<2>, min: usize) {
    // SAFETY: `lp` was built over `[out, x]` under `unary`'s contract: runs stay inside the
    // views and are disjoint in `out`, and `out` is disjoint from `x` or exactly `x` (so a run
    // with both strides 1 is one or the other).
    lp.run(min, |p, s, len| unsafe {
        if s == [1, 1] {
            float_contiguous::<T>(op, p[1] as *const T, p[0] as *mut T, len);
        } else {
            with_float_op::<T::R, Plain>(op, Strided::<T> { p, s, len, _t: std::marker::PhantomData });
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

/// One strided run of `lp`; built only by `run_float`, under `unary`'s contract.
struct Strided<T> {
    p: [usize; 2],
    s: [isize; 2],
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: FloatElement> FloatOpSink<T::R> for Strided<T> {
    fn run(self, f: impl Fn(T::R) -> T::R + Copy) {
        // SAFETY: a run of `unary`'s loop (see `run_float`).
        unsafe { broadcast::unary_run::<T>(self.p, self.s, self.len, |x: T| T::down(f(x.up()))) }
    }
}

/// `out = op(x)` over one contiguous run, compiled for the best the CPU has: AVX-512 or AVX2
/// with FMA (fused polynomials), AVX2, or the x86-64 baseline.
///
/// # Safety
/// As for [`FloatElement::map_contiguous`].
unsafe fn float_contiguous<T: FloatElement>(op: UnaryOp, x: *const T, out: *mut T, len: usize) {
    #[inline(always)]
    fn body<T: FloatElement, M: Mla>(op: UnaryOp, x: *const T, out: *mut T, len: usize) {
        with_float_op::<T::R, M>(op, Contiguous { x, out, len });
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
        fn avx512<T: FloatElement>(op: UnaryOp, x: *const T, out: *mut T, len: usize) {
            if T::DTYPE == DType::F32 {
                let kernel: Option<unsafe fn(*const f32, *mut f32, usize)> = match op {
                    UnaryOp::Tanh => Some(tanh_f32_avx512),
                    UnaryOp::Exp => Some(exp_f32_avx512),
                    _ => None,
                };
                if let Some(kernel) = kernel {
                    // SAFETY: `T` is f32 (its dtype says so); the run is as `float_contiguous`'s
                    // caller promises, and this function runs only on CPUs with the kernels'
                    // features.
                    return unsafe { kernel(x.cast(), out.cast(), len) };
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
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") && has!("fma") {
            // SAFETY: the CPU has these features (checked just above).
            return unsafe { avx512(op, x, out, len) };
        }
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

fn run_int<T: IntElement>(op: UnaryOp, lp: &StridedLoop<2>, min: usize) -> Result<(), String> {
    match op {
        UnaryOp::Neg => run_map(lp, min, T::wrapping_neg),
        UnaryOp::Abs => run_map(lp, min, T::wrapping_abs),
        UnaryOp::Relu => run_map(lp, min, |x: T| x.max(T::ZERO)),
        _ => {
            return Err(format!(
                "{op} has no {} kernel: cast the input to {} first (numpy's result dtype)",
                T::DTYPE,
                unary_result_dtype(op, T::DTYPE)
            ))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn vectorizable_exp_and_tanh_f32_stay_within_a_few_ulp() {
        exp_and_tanh_f32_within_a_few_ulp::<super::Plain>();
        exp_and_tanh_f32_within_a_few_ulp::<super::Fused>();
    }

    fn exp_and_tanh_f32_within_a_few_ulp<M: super::Mla>() {
        let (exp, tanh) = (super::exp_f32_with::<M>, super::tanh_f32_with::<M>);
        let ulps = |got: f32, want: f64| {
            let want32 = want as f32;
            if want32 == got || (want32.is_nan() && got.is_nan()) {
                return 0.0;
            }
            ((got as f64 - want).abs() / (want32.abs().max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64)) as f32
        };
        let mut x = -110.0f32;
        while x < 95.0 {
            let e = exp(x);
            let want = (x as f64).exp();
            if want >= f32::MIN_POSITIVE as f64 && want <= f32::MAX as f64 {
                assert!(ulps(e, want) <= 2.0, "exp({x}) = {e}, want {want}");
            } else if want > f32::MAX as f64 {
                assert_eq!(e, f32::INFINITY);
            } else {
                assert!((e as f64 - want).abs() <= 2.0 * 1.4e-45, "exp({x}) = {e}, want {want} (subnormal)");
            }
            let t = tanh(x);
            assert!(ulps(t, (x as f64).tanh()) <= 2.0, "tanh({x}) = {t}, want {}", (x as f64).tanh());
            x += 0.001_37;
        }
        for tiny in [1e-30f32, -1e-8, 3e-4, f32::MIN_POSITIVE, 1e-45] {
            assert!(ulps(tanh(tiny), (tiny as f64).tanh()) <= 1.0);
        }
        // Both sides of the switch between the polynomial and exp, and of the clamp at 9.1.
        for v in [0.625f32, 9.1] {
            for x in [v.next_down(), v, v.next_up()] {
                assert!(ulps(tanh(x), (x as f64).tanh()) <= 2.0, "tanh({x})");
            }
        }
        assert!(exp(f32::NAN).is_nan() && tanh(f32::NAN).is_nan());
        assert_eq!((tanh(f32::INFINITY), tanh(f32::NEG_INFINITY)), (1.0, -1.0));
        assert_eq!((tanh(1e30), tanh(-1e30)), (1.0, -1.0));
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!((exp(f32::NEG_INFINITY), exp(f32::INFINITY), exp(0.0)), (0.0, f32::INFINITY, 1.0));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_tanh_f32_stays_within_an_ulp() {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") && has!("fma")) {
            return;
        }
        let tanh = |xs: &[f32]| {
            let mut out = vec![f32::NAN; xs.len()];
            // SAFETY: the CPU has the features (checked above); `xs` and `out` are disjoint, of
            // the length passed.
            unsafe { super::tanh_f32_avx512(xs.as_ptr(), out.as_mut_ptr(), xs.len()) };
            out
        };
        // Relative to |tanh|, in float32 epsilons, as the scalar sweep above.
        let ulps = |got: f32, want: f64| {
            let want32 = want as f32;
            if want32 == got || (want32.is_nan() && got.is_nan()) {
                return 0.0;
            }
            (got as f64 - want).abs() / (want32.abs().max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64)
        };
        let check = |xs: &[f32], bound: f64| {
            for (&x, t) in xs.iter().zip(tanh(xs)) {
                assert!(ulps(t, (x as f64).tanh()) <= bound, "tanh({x}) = {t}, want {}", (x as f64).tanh());
            }
        };
        // Every 97th float32 from 0 to past the clamp at 9.5, both signs, then a uniform sweep.
        let pos: Vec<f32> = (0..=11.0f32.to_bits()).step_by(97).map(f32::from_bits).collect();
        check(&pos, 1.0);
        check(&pos.iter().map(|x| -x).collect::<Vec<_>>(), 1.0);
        check(&(0..150_000).map(|i| -110.0 + i as f32 * 0.001_37).collect::<Vec<_>>(), 1.0);
        // Both sides of every interval edge (the quarter-octaves from 0.0390625 up, and the
        // clamp).
        let mut edges = vec![super::TANH_F32_TOP];
        let mut e = super::TANH_F32_LOW.to_bits();
        while e <= 10.0f32.to_bits() {
            edges.push(f32::from_bits(e));
            e += 1 << 21;
        }
        let near: Vec<f32> = edges.iter().flat_map(|&v| [v.next_down(), v, v.next_up()]).collect();
        check(&near, 1.0);
        // Row 0 is x (1 + x^2 (c3 + c5 x^2)): exact where x^3 / 3 is below half an ulp of x.
        for tiny in [1e-30f32, -1e-8, f32::MIN_POSITIVE, 1e-45, -1e-45] {
            assert_eq!(tanh(&[tiny])[0], tiny);
        }
        let special = tanh(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, 9.6, -0.0, 0.0]);
        assert!(special[0].is_nan());
        assert_eq!(special[1..6], [1.0, -1.0, 1.0, -1.0, 1.0]);
        assert_eq!((special[6].to_bits(), special[7].to_bits()), ((-0.0f32).to_bits(), 0));
        // Every tail length (masked), and in place.
        let xs: Vec<f32> = (0..40).map(|i| i as f32 * 0.3 - 6.0).collect();
        let whole = tanh(&xs);
        for n in 0..=xs.len() {
            assert_eq!(tanh(&xs[..n]), whole[..n]);
        }
        let mut inplace = xs.clone();
        // SAFETY: as above, with `out == x`.
        unsafe { super::tanh_f32_avx512(inplace.as_ptr(), inplace.as_mut_ptr(), inplace.len()) };
        assert_eq!(inplace, whole);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_exp_f32_stays_within_an_ulp() {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") && has!("fma")) {
            return;
        }
        let exp = |xs: &[f32]| {
            let mut out = vec![f32::NAN; xs.len()];
            // SAFETY: the CPU has the features (checked above); `xs` and `out` are disjoint, of
            // the length passed.
            unsafe { super::exp_f32_avx512(xs.as_ptr(), out.as_mut_ptr(), xs.len()) };
            out
        };
        // In units of the float32 spacing at `want` (of the smallest subnormal below the normal
        // range), so subnormal results are held to the same bound.
        let ulps = |got: f32, want: f64| {
            let want32 = want as f32;
            if want32 == got {
                return 0.0;
            }
            let a = want32.abs();
            let spacing = if a < f32::MIN_POSITIVE { f32::from_bits(1) } else { f32::from_bits(a.to_bits() + 1) - a };
            (got as f64 - want).abs() / spacing as f64
        };
        let check = |xs: &[f32]| {
            for (&x, e) in xs.iter().zip(exp(xs)) {
                let want = (x as f64).exp();
                assert!(ulps(e, want) <= 1.0, "exp({x}) = {e:e}, want {want:e}");
            }
        };
        // Every 97th float32 of both signs out to past the clamps (overflow at 88.72, 0 below
        // -103.97, subnormal results from -87.34), then a uniform sweep.
        let pos: Vec<f32> = (0..=110.0f32.to_bits()).step_by(97).map(f32::from_bits).collect();
        check(&pos);
        check(&pos.iter().map(|x| -x).collect::<Vec<_>>());
        check(&(0..150_000).map(|i| -110.0 + i as f32 * 0.001_37).collect::<Vec<_>>());
        // Both sides of the overflow threshold, the clamps, the start of the subnormal range,
        // and where results round to 0.
        let edges = [88.722_84f32, super::EXP_F32_HIGH, super::EXP_F32_LOW, -87.336_55, -103.278_93, -103.972_08];
        let near: Vec<f32> = edges.iter().flat_map(|&v| [v.next_down(), v, v.next_up()]).collect();
        check(&near);
        let special = exp(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, 0.0, -0.0, 1e-45, -1e-30]);
        assert!(special[0].is_nan());
        assert_eq!(special[1..], [f32::INFINITY, 0.0, f32::INFINITY, 0.0, 1.0, 1.0, 1.0, 1.0]);
        // Every tail length (masked), and in place.
        let xs: Vec<f32> = (0..40).map(|i| i as f32 * 4.7 - 95.0).collect();
        let whole = exp(&xs);
        for n in 0..=xs.len() {
            assert_eq!(exp(&xs[..n]), whole[..n]);
        }
        let mut inplace = xs.clone();
        // SAFETY: as above, with `out == x`.
        unsafe { super::exp_f32_avx512(inplace.as_ptr(), inplace.as_mut_ptr(), inplace.len()) };
        assert_eq!(inplace, whole);
    }

    /// Distance from `want` (exact enough: libm in float64) in units of the float64 spacing at
    /// `want`; subnormal results count in units of the smallest subnormal.
    fn ulps_f64(got: f64, want: f64) -> f64 {
        if got == want || (got.is_nan() && want.is_nan()) {
            return 0.0;
        }
        let spacing = |v: f64| {
            let v = v.abs();
            if v < f64::MIN_POSITIVE {
                f64::from_bits(1)
            } else {
                f64::from_bits(v.to_bits() + 1) - v
            }
        };
        (got - want).abs() / spacing(want)
    }

    #[test]
    fn vectorizable_exp_and_tanh_f64_stay_within_a_few_ulp() {
        exp_and_tanh_f64_within_a_few_ulp::<super::Plain>();
        exp_and_tanh_f64_within_a_few_ulp::<super::Fused>();
    }

    fn exp_and_tanh_f64_within_a_few_ulp<M: super::Mla>() {
        let (exp, tanh) = (super::exp_f64_with::<M>, super::tanh_f64_with::<M>);
        // A sweep over the whole finite range of exp (subnormal results included) with an
        // irrational step, then around every switch point and threshold.
        let mut xs: Vec<f64> = (0..400_000).map(|i| -750.0 + i as f64 * 0.003_7 * std::f64::consts::SQRT_2).collect();
        xs.extend((0..200_000).map(|i| -20.0 + i as f64 * 2e-4));
        for v in [0.625, 1e-300, 5e-324, 2.2e-308, 0.5 * 709.78, 354.9, 709.782_712_893_384, 709.79, -708.39, -745.13] {
            let mut x = v;
            for _ in 0..4 {
                xs.extend([x, -x]);
                x = x.next_up();
            }
            x = v;
            for _ in 0..4 {
                x = x.next_down();
                xs.extend([x, -x]);
            }
        }
        for &x in &xs {
            let (e, want) = (exp(x), x.exp());
            assert!(ulps_f64(e, want) <= 1.5, "exp({x}) = {e:e}, want {want:e}");
            let (t, want) = (tanh(x), x.tanh());
            assert!(ulps_f64(t, want) <= 2.0, "tanh({x}) = {t:e}, want {want:e}");
        }
        for x in [0.0, -0.0] {
            assert_eq!(exp(x), 1.0);
            assert_eq!(tanh(x).to_bits(), x.to_bits());
        }
        assert!(exp(f64::NAN).is_nan() && tanh(f64::NAN).is_nan());
        assert_eq!(
            (exp(f64::INFINITY), exp(f64::NEG_INFINITY), exp(1e300), exp(-1e300)),
            (f64::INFINITY, 0.0, f64::INFINITY, 0.0)
        );
        assert_eq!((tanh(f64::INFINITY), tanh(f64::NEG_INFINITY), tanh(1e300), tanh(-1e300)), (1.0, -1.0, 1.0, -1.0));
        assert_eq!(exp(-745.2), 0.0);
        assert_eq!(exp(-745.0), f64::from_bits(1)); // the smallest subnormal
    }

    /// `|got - want|` in units of the float32 spacing at `want` rounded to float32 (a correctly
    /// rounded result is within 0.5); subnormal results in units of the smallest subnormal.
    fn ulps_f32(got: f32, want: f64) -> f64 {
        let w = want as f32;
        if got == w || (got.is_nan() && want.is_nan()) {
            return 0.0;
        }
        let a = w.abs();
        (got as f64 - want).abs() / (a.next_up() - a) as f64
    }

    /// Float32 inputs over the whole positive range (every 61st bit pattern), both sides of
    /// 1 bit by bit, and the special values.
    fn log_inputs_f32() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..0x7f80_0000u32).step_by(61).map(f32::from_bits).collect();
        xs.extend((0..100_000).flat_map(|i| [f32::from_bits(1f32.to_bits() + i), f32::from_bits(1f32.to_bits() - i)]));
        xs.extend([f32::MIN_POSITIVE, f32::MIN_POSITIVE.next_down(), 1e-45, f32::MAX, std::f32::consts::SQRT_2]);
        xs
    }

    #[test]
    fn vectorizable_log_and_erfc_f32_stay_within_a_few_ulp() {
        log_and_erfc_f32_within_a_few_ulp::<super::Plain>();
        log_and_erfc_f32_within_a_few_ulp::<super::Fused>();
    }

    fn log_and_erfc_f32_within_a_few_ulp<M: super::Mla>() {
        let (log, erfc) = (super::log_f32_with::<M>, super::erfc_with::<f32, M>);
        let mut worst = 0.0f64;
        for x in log_inputs_f32() {
            let (got, want) = (log(x), (x as f64).ln());
            let u = ulps_f32(got, want);
            worst = worst.max(u);
            assert!(u <= 1.0, "log({x:e}) = {got:e}, want {want:e} ({u} ulp)");
        }
        assert!(worst > 0.5, "the sweep should reach a rounding error: {worst}");
        assert_eq!(log(1.0).to_bits(), 0);
        assert_eq!((log(0.0), log(-0.0), log(f32::INFINITY)), (f32::NEG_INFINITY, f32::NEG_INFINITY, f32::INFINITY));
        for x in [-1e-45, -1.0, -3e38, f32::NEG_INFINITY, f32::NAN] {
            assert!(log(x).is_nan(), "log({x})");
        }
        // erfc over [-6, 10.1], where float32 results go from 2 down to the last subnormal, and
        // around each switch between pieces.
        let mut xs: Vec<f32> = (0..400_000).map(|i| -6.0 + i as f32 * 4.03e-5 * std::f32::consts::PI).collect();
        for v in [0.25f32, 0.84375, 1.25, 1.0 / 0.35, 9.0, 10.0, 28.0] {
            let (mut up, mut down) = (v, v);
            for _ in 0..4 {
                xs.extend([up, -up, down, -down]);
                (up, down) = (up.next_up(), down.next_down());
            }
        }
        xs.extend([0.0, -0.0, 1e-45, -1e-45, 1e-30, -1e-30, 30.0, -30.0, 1e30, -1e30]);
        for x in xs {
            let (got, want) = (erfc(x), libm::erfc(x as f64));
            assert!(ulps_f32(got, want) <= 2.5, "erfc({x:e}) = {got:e}, want {want:e}");
        }
        assert_eq!((erfc(f32::INFINITY), erfc(f32::NEG_INFINITY)), (0.0, 2.0));
        assert!(erfc(f32::NAN).is_nan());
    }

    #[test]
    fn vectorizable_log_and_erfc_f64_stay_within_a_few_ulp() {
        log_and_erfc_f64_within_a_few_ulp::<super::Plain>();
        log_and_erfc_f64_within_a_few_ulp::<super::Fused>();
    }

    fn log_and_erfc_f64_within_a_few_ulp<M: super::Mla>() {
        let (log, erfc) = (super::log_f64_with::<M>, super::erfc_with::<f64, M>);
        // Bit patterns over the whole positive range (subnormals included), both sides of 1 bit
        // by bit, and [0.5, 2] densely.
        let step = 0x7ff0_0000_0000_0000u64 / 2_000_003;
        let mut xs: Vec<f64> = (0..2_000_003u64).map(|i| f64::from_bits(i * step + i % 7)).collect();
        xs.extend((0..100_000).flat_map(|i| [f64::from_bits(1f64.to_bits() + i), f64::from_bits(1f64.to_bits() - i)]));
        xs.extend((0..500_000).map(|i| 0.5 + i as f64 * 3e-6 * std::f64::consts::SQRT_2));
        xs.extend([5e-324, f64::MIN_POSITIVE, f64::MIN_POSITIVE.next_down(), f64::MAX, std::f64::consts::SQRT_2]);
        for x in xs {
            let (got, want) = (log(x), x.ln());
            assert!(ulps_f64(got, want) <= 1.0, "log({x:e}) = {got:e}, want {want:e}");
        }
        assert_eq!(log(1.0).to_bits(), 0);
        assert_eq!((log(0.0), log(-0.0), log(f64::INFINITY)), (f64::NEG_INFINITY, f64::NEG_INFINITY, f64::INFINITY));
        for x in [-5e-324, -1.0, -1e308, f64::NEG_INFINITY, f64::NAN] {
            assert!(log(x).is_nan(), "log({x})");
        }
        // erfc over [-6, 27.3], from 2 down to the last subnormal, and around each switch. The
        // reference itself is off by up to 2.5 ulp for |x| >= 1.25 (its two exps); sampled
        // against mpmath there, this one is within 1.9 ulp (Plain) and 2.4 (Fused).
        let mut xs: Vec<f64> = (0..600_000).map(|i| -6.0 + i as f64 * 1.7e-5 * std::f64::consts::PI).collect();
        for v in [0.25, 0.84375, 1.25, 1.0 / 0.35, 26.0, 27.0, 28.0] {
            let (mut up, mut down) = (v, v);
            for _ in 0..4 {
                xs.extend([up, -up, down, -down]);
                (up, down) = (up.next_up(), down.next_down());
            }
        }
        xs.extend([0.0, -0.0, 5e-324, -5e-324, 1e-300, -1e-300, 30.0, -30.0, 1e300, -1e300]);
        for x in xs {
            let (got, want) = (erfc(x), libm::erfc(x));
            assert!(ulps_f64(got, want) <= 4.0, "erfc({x:e}) = {got:e}, want {want:e}");
        }
        assert_eq!((erfc(f64::INFINITY), erfc(f64::NEG_INFINITY)), (0.0, 2.0));
        assert!(erfc(f64::NAN).is_nan());
    }

    use super::*;
    use crate::kernels::broadcast::testing::*;
    use crate::kernels::thresholds::TRANSCENDENTAL_PARALLEL_MIN_ELEMS;
    use crate::PARALLEL_MIN_ELEMS;

    /// Reference formulas, straight from the definitions, in float64.
    fn reference(op: UnaryOp, x: f64) -> f64 {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        match op {
            UnaryOp::Neg => -x,
            UnaryOp::Abs => x.abs(),
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Relu => {
                if x.is_nan() {
                    x
                } else {
                    x.max(0.0)
                }
            }
            UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            UnaryOp::Tanh => x.tanh(),
            // 1 + erf(t) == erfc(-t) and 0.5 (1 + tanh z) == 1 / (1 + exp(-2 z)), written so the
            // reference itself does not cancel for negative x.
            UnaryOp::GeluErf => 0.5 * x * libm::erfc(-x / std::f64::consts::SQRT_2),
            UnaryOp::GeluTanh => x / (1.0 + (-2.0 * k * (x + 0.044715 * x * x * x)).exp()),
            UnaryOp::Silu => x / (1.0 + (-x).exp()),
        }
    }

    fn reference_int(op: UnaryOp, x: i64, bits: u32) -> i64 {
        let wrap = |v: i64| if bits == 32 { v as i32 as i64 } else { v };
        match op {
            UnaryOp::Neg => wrap(x.wrapping_neg()),
            UnaryOp::Abs => wrap(x.wrapping_abs()),
            UnaryOp::Relu => x.max(0),
            _ => unreachable!(),
        }
    }

    /// (rtol, atol) of a float dtype against the float64 reference.
    fn tolerance(dtype: DType) -> (f64, f64) {
        match dtype {
            DType::F16 => (2e-3, 1e-7),
            DType::F32 => (2e-6, 1e-44),
            _ => (1e-9, 1e-300),
        }
    }

    fn close(got: f64, want: f64, (rtol, atol): (f64, f64)) -> bool {
        if want.is_nan() {
            got.is_nan()
        } else if want.is_infinite() || got.is_infinite() {
            got == want
        } else {
            (got - want).abs() <= rtol * want.abs() + atol
        }
    }

    /// Test data: moderate values, both signed zeros, infinities and NaN for floats; the
    /// extremes for ints.
    fn values<T: Element>(n: usize) -> Vec<T> {
        (0..n)
            .map(|i| {
                if T::DTYPE.is_float() {
                    let special = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1e-3, -30.0, 30.0];
                    if i % 17 < special.len() && i % 3 == 0 {
                        T::from_f64(special[i % 17])
                    } else {
                        T::from_f64(((i * 37) % 101) as f64 / 10.0 - 5.0)
                    }
                } else {
                    match i % 11 {
                        0 => T::from_i64(if T::DTYPE == DType::I32 { i32::MIN as i64 } else { i64::MIN }),
                        1 => T::from_i64(if T::DTYPE == DType::I32 { i32::MAX as i64 } else { i64::MAX }),
                        _ => T::from_i64(((i * 2_654_435_761) % 2001) as i64 - 1000),
                    }
                }
            })
            .collect()
    }

    fn check<T: Element>(op: UnaryOp, shape: &[usize], x_shape: &[usize], x_layout: Layout, out_layout: Layout) {
        let xv = values::<T>(x_shape.iter().product());
        let x = make(x_shape, x_layout, &xv);
        let out = alloc(T::DTYPE, shape, out_layout);
        // SAFETY: test views from `alloc` cover their elements; `out` is disjoint from `x`.
        let result = unsafe { unary(op, &x.view, &out.view) };
        if !T::DTYPE.is_float() && !op.keeps_int_dtype() {
            assert!(result.is_err(), "{op} on {}", T::DTYPE);
            return;
        }
        result.unwrap();
        let xs = read::<T>(&broadcast::broadcast_view(&x.view, shape));
        let got = read::<T>(&out.view);
        for (i, (&g, &x)) in got.iter().zip(&xs).enumerate() {
            let ctx = || format!("{op} {} {shape:?} {x_layout:?}->{out_layout:?} at {i}: x={}", T::DTYPE, x.to_f64());
            if T::DTYPE.is_float() {
                let want = T::from_f64(reference(op, x.to_f64())).to_f64();
                assert!(close(g.to_f64(), want, tolerance(T::DTYPE)), "{} got {} want {want}", ctx(), g.to_f64());
            } else {
                let bits = T::DTYPE.size() as u32 * 8;
                assert_eq!(g.to_i64(), reference_int(op, x.to_i64(), bits), "{}", ctx());
            }
        }
    }

    fn check_all<T: Element>() {
        let cases: [(&[usize], &[usize]); 6] = [
            (&[3, 5, 4], &[3, 5, 4]),
            (&[3, 5, 4], &[5, 1]),
            (&[], &[]),
            (&[2, 0, 3], &[3]),
            (&[4, 3], &[]),
            (&[37], &[37]),
        ];
        for op in UnaryOp::ALL {
            for (shape, x_shape) in cases {
                for (xl, ol) in LAYOUTS.iter().zip(LAYOUTS.iter().rev()) {
                    check::<T>(op, shape, x_shape, *xl, *ol);
                }
            }
        }
    }

    #[test]
    fn float_ops_match_reference() {
        check_all::<f16>();
        check_all::<f32>();
        check_all::<f64>();
    }

    #[test]
    fn int_ops_match_reference_and_reject_float_ops() {
        check_all::<i32>();
        check_all::<i64>();
    }

    #[test]
    fn around_the_parallel_thresholds() {
        for n in [TRANSCENDENTAL_PARALLEL_MIN_ELEMS - 1, PARALLEL_MIN_ELEMS, PARALLEL_MIN_ELEMS + 37] {
            check::<f32>(UnaryOp::Exp, &[n], &[n], Layout::Contiguous, Layout::Contiguous);
            check::<f64>(UnaryOp::Relu, &[n], &[n], Layout::Reversed, Layout::Contiguous);
            check::<i32>(UnaryOp::Abs, &[n], &[n], Layout::Contiguous, Layout::Stepped);
        }
        // Rows of 67 split mid-row between tasks; a broadcast input.
        let rows = PARALLEL_MIN_ELEMS / 67 + 3;
        check::<f32>(UnaryOp::Sigmoid, &[rows, 67], &[rows, 67], Layout::Fortran, Layout::Padded);
        check::<f16>(UnaryOp::Silu, &[rows, 67], &[67], Layout::Contiguous, Layout::Contiguous);
    }

    #[test]
    fn in_place() {
        for op in UnaryOp::ALL {
            for layout in LAYOUTS {
                for shape in [&[5usize, 7][..], &[PARALLEL_MIN_ELEMS + 5]] {
                    let xs = values::<f64>(shape.iter().product());
                    let x = make(shape, layout, &xs);
                    // SAFETY: `out` is exactly `x`.
                    unsafe { unary(op, &x.view, &x.view) }.unwrap();
                    for (&g, &v) in read::<f64>(&x.view).iter().zip(&xs) {
                        assert!(close(g, reference(op, v), tolerance(DType::F64)), "{op} {layout:?} x={v}");
                    }
                    let xs = values::<i64>(shape.iter().product());
                    let x = make(shape, layout, &xs);
                    // SAFETY: as above.
                    if unsafe { unary(op, &x.view, &x.view) }.is_ok() {
                        for (&g, &v) in read::<i64>(&x.view).iter().zip(&xs) {
                            assert_eq!(g, reference_int(op, v, 64));
                        }
                    }
                }
            }
        }
    }

    fn eval<T: Element>(op: UnaryOp, xs: &[T]) -> Vec<T> {
        let x = make(&[xs.len()], Layout::Contiguous, xs);
        let out = alloc(T::DTYPE, &[xs.len()], Layout::Contiguous);
        // SAFETY: test views, disjoint.
        unsafe { unary(op, &x.view, &out.view) }.unwrap();
        read(&out.view)
    }

    #[test]
    fn numpy_special_values() {
        let f = |op, xs: &[f64]| eval(op, xs);
        let log = f(UnaryOp::Log, &[0.0, -1.0, f64::INFINITY, 1.0]);
        assert_eq!(log[0], f64::NEG_INFINITY);
        assert!(log[1].is_nan());
        assert_eq!((log[2], log[3]), (f64::INFINITY, 0.0));
        assert!(f(UnaryOp::Sqrt, &[-1.0])[0].is_nan());
        assert_eq!(f(UnaryOp::Exp, &[1000.0, f64::NEG_INFINITY]), [f64::INFINITY, 0.0]);
        let relu = f(UnaryOp::Relu, &[f64::NAN, f64::NEG_INFINITY, -2.0, 3.0]);
        assert!(relu[0].is_nan());
        assert_eq!(&relu[1..], [0.0, 0.0, 3.0]);
        assert_eq!(eval(UnaryOp::Abs, &[i32::MIN, -3])[..], [i32::MIN, 3]);
        assert_eq!(eval(UnaryOp::Neg, &[i64::MIN, 5])[..], [i64::MIN, -5]);
        assert_eq!(eval(UnaryOp::Relu, &[i32::MIN, 0, 9])[..], [0, 0, 9]);
        for op in [UnaryOp::Sigmoid, UnaryOp::Tanh, UnaryOp::GeluErf, UnaryOp::GeluTanh, UnaryOp::Silu] {
            assert!(f(op, &[f64::NAN])[0].is_nan(), "{op}(nan)");
        }
    }

    #[test]
    fn sigmoid_never_overflows() {
        let xs = [-1e308, -1000.0, -100.0, 0.0, 100.0, 1000.0, 1e308, f64::INFINITY, f64::NEG_INFINITY];
        let got = eval(UnaryOp::Sigmoid, &xs);
        let want = [0.0, 0.0, 3.720_075_976_020_836e-44, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0];
        for (g, w) in got.iter().zip(want) {
            assert!(close(*g, w, (1e-15, 0.0)), "{got:?}");
        }
        let got = eval(UnaryOp::Sigmoid, &[-100f32, -90.0, 90.0]);
        assert!(got[0] > 0.0 && got[0] < 1e-40 && got[1] > 0.0, "{got:?}");
        assert_eq!(got[2], 1.0);
        let got = eval(UnaryOp::Silu, &[-1e4f32, 1e4]);
        assert_eq!(got, [-0.0, 1e4]);
        let got = eval(UnaryOp::Sigmoid, &[f16::from_f32(-20.0), f16::from_f32(20.0), f16::NEG_INFINITY]);
        assert!(got[0].to_f32() >= 0.0 && got[0].to_f32() < 1e-7 && got[1].to_f32() == 1.0, "{got:?}");
        assert_eq!(got[2].to_f32(), 0.0);
    }

    #[test]
    fn gelu_erf_is_accurate_in_float64() {
        // x * Phi(x), Phi from high-precision tables.
        let table = [
            (1.0, 0.841_344_746_068_542_9),
            (-1.0, -0.158_655_253_931_457_05),
            (0.5, 0.345_731_230_637_006_55),
            (2.0, 1.954_499_736_103_642),
            (-3.0, -0.004_049_694_094_890_284),
            (-6.0, -5.919_525_870_226_189e-9),
        ];
        let xs: Vec<f64> = table.iter().map(|&(x, _)| x).collect();
        for ((x, want), got) in table.iter().zip(eval(UnaryOp::GeluErf, &xs)) {
            // In the tail the rounding of x / sqrt 2 alone is amplified ~2 x^2 times.
            let rtol = if x.abs() > 2.5 { 1e-14 } else { 2e-15 };
            assert!(((got - want) / want).abs() < rtol, "gelu({x}) = {got}, want {want}");
        }
        // Far left tail: erfc keeps relative accuracy where 1 + erf would round to 0.
        let got = eval(UnaryOp::GeluErf, &[-10.0f64])[0];
        assert!((got / -7.619_853_024_160_526e-23 - 1.0).abs() < 1e-13, "{got}");
        let got = eval(UnaryOp::GeluTanh, &[1.0f64, -10.0])[..].to_vec();
        assert!((got[0] - 0.841_191_990_608_276_7).abs() < 1e-15, "{got:?}");
        assert!(got[1] < 0.0 && got[1] > -1e-6);
    }

    #[test]
    fn result_dtypes() {
        for op in UnaryOp::ALL {
            for dt in [DType::F16, DType::F32, DType::F64] {
                assert_eq!(unary_result_dtype(op, dt), dt);
            }
            let want = if op.keeps_int_dtype() { DType::I32 } else { DType::F64 };
            assert_eq!(unary_result_dtype(op, DType::I32), want, "{op}");
            assert_eq!(UnaryOp::from_name(op.name()), Some(op));
        }
    }

    #[test]
    fn argument_errors() {
        let x = make(&[3], Layout::Contiguous, &[1.0f32, 2.0, 3.0]);
        let out64 = alloc(DType::F64, &[3], Layout::Contiguous);
        let out_wide = alloc(DType::F32, &[2, 4], Layout::Contiguous);
        // SAFETY: the calls fail their checks before touching memory.
        unsafe {
            assert!(unary(UnaryOp::Exp, &x.view, &out64.view).unwrap_err().contains("float64"));
            assert!(unary(UnaryOp::Exp, &x.view, &out_wide.view).unwrap_err().contains("(2, 4)"));
            let repeated = broadcast::broadcast_view(&x.view, &[2, 3]);
            assert!(unary(UnaryOp::Exp, &x.view, &repeated).unwrap_err().contains("stride-0"));
        }
    }
}
