//! `tanh` in float32 and float64, branch-free so loops vectorize: Cephes' odd polynomial
//! (float32) or rational function (float64) near 0 and `1 - 2 / (e^2|x| + 1)` above, built on
//! the exponentials of [`super::exp`]. The AVX-512 float32 kernel is in `x86_avx512`.

use super::exp::{exp_f32_reduced, exp_f64_with};
use super::Mla;

/// `tanh` in float32, branch-free so it vectorizes: Cephes' `tanhf` (an odd polynomial below
/// |x| = 0.625, `1 - 2 / (e^2|x| + 1)` above), about 1 ulp. Past |x| = 9.1 tanh rounds to ±1,
/// so `e^2|x|` needs neither the overflow nor the subnormal handling of
/// [`exp_f32`](super::exp_f32).
#[inline(always)]
pub(super) fn tanh_f32_with<M: Mla>(x: f32) -> f32 {
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

/// `tanh` in float64, branch-free: Cephes' `tanh` (a rational function below |x| = 0.625,
/// `1 - 2 / (e^2|x| + 1)` above, where `e^2|x| = inf` gives exactly ±1), about 1 ulp.
#[inline(always)]
pub(super) fn tanh_f64_with<M: Mla>(x: f64) -> f64 {
    let a = x.abs();
    let z = x * x;
    let p = M::mla(M::mla(-9.643_991_794_250_523e-1, z, -9.928_772_310_019_185e1), z, -1.614_687_684_417_084_5e3);
    let q = M::mla(M::mla(z + 1.128_116_784_916_329_3e2, z, 2.235_488_390_601_004_5e3), z, 4.844_063_053_251_255e3);
    let small = M::mla(x * z, p / q, x);
    let big = 1.0 - 2.0 / (exp_f64_with::<M>(2.0 * a) + 1.0);
    // As in `tanh_f32_with`: the sign of x, -0 included.
    (if a > 0.625 { big } else { small }).copysign(x)
}
