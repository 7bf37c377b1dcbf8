//! `ln x` in float32 (Cephes' `logf`) and float64 (Sun's `log`), branch-free so loops
//! vectorize: the argument split into `m 2^k` with integer operations on its bits, a polynomial
//! in `m - 1`, subnormals scaled into the normal range first, and numpy's special values.

use super::{horner, Mla};

/// The bits of sqrt(1/2) in float32: [`log_f32_with`]'s significand is re-based on it.
pub(super) const LOG_F32_SQRT_HALF: i32 = 0x3f35_04f3;
/// Cephes' `logf` polynomial in `f = m - 1`, highest coefficient first.
pub(super) const LOG_F32_POLY: [f64; 9] = [
    7.037_683_6e-2,
    -1.151_461e-1,
    1.167_699_9e-1,
    -1.242_014_1e-1,
    1.424_932_3e-1,
    -1.666_805_8e-1,
    2.000_071_4e-1,
    -2.499_999_4e-1,
    3.333_333_1e-1,
];
/// ln 2 = 0.693359375 - 2.12194440e-4, the first part exact in `k * it`.
pub(super) const LOG_F32_LN2: (f32, f32) = (0.693_359_4, -2.121_944_4e-4);

/// `ln x` in float32, branch-free so loops vectorize (libm's `logf` is a call per element):
/// Cephes' `logf` polynomial in `m - 1`, where `x = m 2^k` with `m` in [sqrt(1/2), sqrt(2)),
/// within 1 ulp. Subnormals are scaled into the normal range first; `ln 0 = -inf`,
/// `ln(x < 0) = NaN`, `ln inf = inf`, NaN stays NaN.
#[inline(always)]
pub(super) fn log_f32_with<M: Mla>(x: f32) -> f32 {
    let sub = x < f32::MIN_POSITIVE;
    // Subnormals scaled by 2^25 into the normal range.
    let xs = if sub { x * 33_554_432.0 } else { x };
    // Adding 1 - sqrt(1/2) to the significand carries into the exponent exactly when it is at
    // least sqrt(2), so the exponent field gives k and the significand bits, re-based on
    // sqrt(1/2), give m.
    let ix = (xs.to_bits() as i32).wrapping_add(0x3f80_0000 - LOG_F32_SQRT_HALF);
    let k = (ix >> 23) - 0x7f - if sub { 25 } else { 0 };
    let m = f32::from_bits(((ix & 0x007f_ffff) + LOG_F32_SQRT_HALF) as u32);
    let (f, e) = (m - 1.0, k as f32);
    let z = f * f;
    let p = horner::<f32, M, 9>(f, LOG_F32_POLY);
    let y = M::mla(z, -0.5, M::mla(e, LOG_F32_LN2.1, p * z * f));
    let r = M::mla(e, LOG_F32_LN2.0, f + y);
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
pub(super) fn log_f64_with<M: Mla>(x: f64) -> f64 {
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
