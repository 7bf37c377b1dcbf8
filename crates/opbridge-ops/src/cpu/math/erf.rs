//! `erfc x` for `gelu_erf`, generic over the compute type: Sun's piecewise rational
//! approximations evaluated branch-free (every piece computed, the right one selected), with
//! the far tail's `exp` taking the exact split of `-x^2` so the result keeps its relative
//! accuracy down to the last subnormal.

use super::{horner, Mla, Real};

/// `erfc x`, branch-free so loops vectorize (libm's is a call per element): the piecewise
/// rational approximations of Sun's `erfc` (FreeBSD, musl, the `libm` crate), every piece
/// evaluated, the right numerator and denominator selected, then one division. Float32 uses the
/// same coefficients rounded, as `erfcf` does. NaN stays NaN; past |x| = 28 the result is 0 or 2.
#[inline(always)]
pub(crate) fn erfc_with<R: Real, M: Mla>(x: R) -> R {
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
