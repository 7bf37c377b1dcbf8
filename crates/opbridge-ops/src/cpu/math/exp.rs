//! `e^x` in float32 and float64 as branch-free polynomials after the Cody-Waite reduction
//! `x = n ln 2 + r`, generic over [`Mla`] so the same code serves FMA and plain loops; also
//! `e^(x + lo)` (for `erfc`, which keeps the low part of its argument) and the reduced float32
//! step `tanh` builds on.

use super::{Mla, Plain};

/// `e^x` in float32 without branches or libm calls, so loops over it vectorize (libm's `expf`
/// is a call per element): Cephes' polynomial after the Cody-Waite reduction `x = n ln 2 + r`,
/// about 1 ulp. The scale `2^n` is applied in two halves so results down in the subnormal range
/// are right too; overflow gives inf, NaN stays NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    exp_f32_with::<Plain>(x)
}

#[inline(always)]
pub(super) fn exp_f32_with<M: Mla>(x: f32) -> f32 {
    // Adding -0.0 changes no value, so it compiles to nothing.
    exp_sum_f32_with::<M>(x, -0.0)
}

/// `e^(x + lo)` as [`exp_f32_with`], `lo` (|lo| < 1) entering the reduced argument; the
/// thresholds look at `x` alone.
#[inline(always)]
pub(super) fn exp_sum_f32_with<M: Mla>(x: f32, lo: f32) -> f32 {
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
pub(super) fn exp_f32_reduced<M: Mla>(x_log2e: f32, x: f32, lo: f32) -> (f32, i32) {
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

/// `e^x` in float64, branch-free so loops vectorize: SLEEF's degree-11 polynomial after the
/// Cody-Waite reduction, about 1 ulp; subnormal results, overflow, `-inf` and NaN as
/// [`exp_f32`].
#[inline(always)]
pub(super) fn exp_f64_with<M: Mla>(x: f64) -> f64 {
    // As in `exp_f32_with`: adding -0.0 compiles to nothing.
    exp_sum_f64_with::<M>(x, -0.0)
}

/// `e^(x + lo)` as [`exp_f64_with`], `lo` (|lo| < 1) entering the reduced argument; the
/// thresholds look at `x` alone.
#[inline(always)]
pub(super) fn exp_sum_f64_with<M: Mla>(x: f64, lo: f64) -> f64 {
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
