//! Whole-run float32 `exp` and `tanh` kernels for AVX-512 (x86_64 only, chosen at run time by
//! `unary` when the CPU has the features): 16 lanes per instruction, masked tails, and their
//! constant tables. Their bodies call only intrinsics and `#[inline]` helpers compiled with the
//! same features: a closure handed to a library function (`array::map`) is compiled without
//! them and turns every intrinsic in it into an out-of-line call (see `tanh_f32_avx512`).
#![allow(unsafe_code)]

use half::f16;

/// The whole-run kernels of one 16-lane float32 function, in float32 and in float16 (widened
/// with `vcvtph2ps`, computed in float32, rounded once with `vcvtps2ph`).
#[derive(Clone, Copy)]
pub(crate) struct WholeRun {
    /// # Safety
    /// `x` is readable and `out` writable for `len` elements, touched by nothing else during
    /// the call; `out` is `x` or disjoint from it; the CPU has AVX-512 F/VL/BW/DQ, FMA and
    /// F16C.
    pub f32: unsafe fn(*const f32, *mut f32, usize),
    /// # Safety
    /// As for `f32`.
    pub f16: unsafe fn(*const f16, *mut f16, usize),
}

/// Defines a function's whole-run kernels over float32 and float16 and their [`WholeRun`]:
/// `$lanes` is an expression of the vector `$v`, expanded inside each loop (not a closure: a
/// closure is not compiled with the loop's target features), after the `let` statements
/// before it. The tail of a run is one masked vector.
macro_rules! whole_run_kernels {
    ($(#[$doc:meta])* $f32:ident, $f16:ident, $table:ident, $(let $name:ident = $init:expr;)* |$v:ident| $lanes:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `x` is readable and `out` writable for `len` elements, touched by nothing else
        /// during the call; `out` is `x` or disjoint from it.
        #[inline]
        #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
        pub(crate) unsafe fn $f32(x: *const f32, out: *mut f32, len: usize) {
            use std::arch::x86_64::*;
            $(let $name = $init;)*
            let mut i = 0;
            while i + 16 <= len {
                // SAFETY: elements `i..i + 16` are inside the run (caller's contract); each
                // vector is loaded before it is stored, so `out == x` is fine.
                let $v = unsafe { _mm512_loadu_ps(x.add(i)) };
                // SAFETY: as above.
                unsafe { _mm512_storeu_ps(out.add(i), $lanes) };
                i += 16;
            }
            if i < len {
                let m = ((1u32 << (len - i)) - 1) as __mmask16;
                // SAFETY: the mask touches only elements `i..len`, inside the run.
                let $v = unsafe { _mm512_maskz_loadu_ps(m, x.add(i)) };
                // SAFETY: as above.
                unsafe { _mm512_mask_storeu_ps(out.add(i), m, $lanes) };
            }
        }

        /// The float16 form of
        #[doc = concat!("[`", stringify!($f32), "`]")]
        /// : each vector widened exactly, computed in float32, rounded once to nearest.
        ///
        /// # Safety
        /// As for the float32 form.
        #[inline]
        #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")]
        pub(crate) unsafe fn $f16(x: *const f16, out: *mut f16, len: usize) {
            use std::arch::x86_64::*;
            $(let $name = $init;)*
            let mut i = 0;
            // Two vectors per 64-byte store: `vcvtps2ph` straight to memory (what the compiler
            // makes of one vector per store) took a third of a float16 `log`'s time.
            while i + 32 <= len {
                // SAFETY: as in the float32 form (32 elements of 2 bytes each way).
                let (lo, hi) = unsafe {
                    (_mm256_loadu_si256(x.add(i).cast()), _mm256_loadu_si256(x.add(i + 16).cast()))
                };
                let $v = _mm512_cvtph_ps(lo);
                let lo = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>($lanes);
                let $v = _mm512_cvtph_ps(hi);
                let hi = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>($lanes);
                let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                // SAFETY: as above.
                unsafe { _mm512_storeu_si512(out.add(i).cast(), both) };
                i += 32;
            }
            while i + 16 <= len {
                // SAFETY: as in the float32 form (16 elements of 2 bytes each way).
                let $v = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(x.add(i).cast()) });
                let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>($lanes);
                // SAFETY: as above.
                unsafe { _mm256_storeu_si256(out.add(i).cast(), h) };
                i += 16;
            }
            if i < len {
                let m = ((1u32 << (len - i)) - 1) as __mmask16;
                // SAFETY: the mask touches only elements `i..len`, inside the run.
                let $v = _mm512_cvtph_ps(unsafe { _mm256_maskz_loadu_epi16(m, x.add(i).cast()) });
                let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>($lanes);
                // SAFETY: as above.
                unsafe { _mm256_mask_storeu_epi16(out.add(i).cast(), m, h) };
            }
        }

        pub(crate) const $table: WholeRun = WholeRun { f32: $f32, f16: $f16 };
    };
}

/// Where [`tanh_f32_avx512`] clamps `|x|`: past it tanh rounds to ±1 (`tanh 9.5 = 1 - 1.1e-8`).
pub(super) const TANH_F32_TOP: f32 = 9.5;
/// The lower edge of the quarter-octave below row 1 of `TANH_F32_ROWS`: `|x|` under it take
/// row 0.
pub(super) const TANH_F32_LOW: f32 = 0.039_062_5;

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
#[repr(C, align(64))]
struct TanhF32Lut([[f32; 32]; 7]);

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

whole_run_kernels!(
    /// `out[i] = tanh(x[i])` for `i < len` in float32 with AVX-512, about twice as fast as
    /// [`tanh_f32_with`](super::tanh_f32_with) and within 1 ulp: numpy's scheme (a polynomial
    /// per interval of `|x|`, its coefficients picked per lane with `vpermt2ps` from 32-entry
    /// tables) with our own intervals and fits (see `TANH_F32_ROWS`); 18 instructions per 16
    /// elements, no division. NaN stays NaN, ±inf gives ±1, -0 gives -0.
    tanh_f32_avx512, tanh_f16_avx512, TANH_AVX512,
    let lut = tanh_lut();
    |v| tanh_f32x16(v, &lut)
);

/// The tables of `TANH_F32_LUT` in registers.
// A plain loop, not `array::map`: a closure is not compiled with this function's target
// features, so each load became an out-of-line call (a third of a 16-element call's time).
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
fn tanh_lut() -> [[std::arch::x86_64::__m512; 2]; 7] {
    use std::arch::x86_64::*;
    let mut lut = [[_mm512_setzero_ps(); 2]; 7];
    for (regs, table) in lut.iter_mut().zip(&TANH_F32_LUT.0) {
        // SAFETY: each table is 32 floats, loaded as two halves of 16.
        *regs = unsafe { [_mm512_loadu_ps(table.as_ptr()), _mm512_loadu_ps(table.as_ptr().add(16))] };
    }
    lut
}

/// 16 lanes of [`tanh_f32_avx512`], with the tables of `TANH_F32_LUT` in registers.
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
pub(super) const EXP_F32_LOW: f32 = -104.0;
pub(super) const EXP_F32_HIGH: f32 = 89.0;

/// `e^r = 1 + c1 r + ... + c6 r^6` on `|r| <= ln 2 / 2` for [`exp_f32_avx512`], `c1` first:
/// a relative-error minimax fit (Lawson's iteration), each coefficient rounded to float32 in
/// turn with the rest refitted; within 0.06 ulp before rounding.
const EXP_F32_POLY: [f32; 6] = [1.0, 0.499_999_94, 0.166_665_21, 0.041_668_266, 0.008_368_675, 0.001_382_066_2];

whole_run_kernels!(
    /// `out[i] = e^x[i]` for `i < len` in float32 with AVX-512, about three times as fast as
    /// [`exp_f32_with`](super::exp_f32_with) and within 1 ulp: the Cody-Waite reduction
    /// `x = n ln 2 + r` (`n` rounded with `vrndscaleps`, `ln 2` in two parts with FMA), a
    /// degree-6 polynomial for `e^r` (see `EXP_F32_POLY`) and `vscalefps` for the `2^n`, which
    /// rounds subnormal results once and overflows to inf; 12 instructions per 16 elements. NaN
    /// stays NaN, `e^-inf = 0`, `e^inf = inf`.
    exp_f32_avx512, exp_f16_avx512, EXP_AVX512,
    |v| exp_f32x16(v)
);

/// 16 lanes of [`exp_f32_avx512`].
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
fn exp_f32x16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    let (p, n) = exp_parts_f32x16(x, EXP_F32_LOW);
    std::arch::x86_64::_mm512_scalef_ps(p, n)
}

/// `(p, n)` with `e^x = p 2^n` (`p` in about [0.7, 1.4], `n` a whole float32), `x` clamped to
/// [`low`, `EXP_F32_HIGH`] first: the scaling left to the caller, so a result headed for the
/// subnormal range can be multiplied or divided while still normal and rounded once at the end.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
fn exp_parts_f32x16(x: std::arch::x86_64::__m512, low: f32) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512) {
    use std::arch::x86_64::*;
    // ln 2 rounded to float32, and the rest: `n * LN2_HI` is exact in the FMA and
    // `x - n * LN2_HI` a float32 (|n| <= 173).
    const LN2_HI: f32 = std::f32::consts::LN_2;
    const LN2_LO: f32 = -1.904_654_2e-9;
    // `vminps`/`vmaxps` return their second operand when either is NaN: NaN goes through and
    // stays NaN; ±inf clamp to results of exactly inf and 0.
    let x = _mm512_max_ps(_mm512_set1_ps(low), _mm512_min_ps(_mm512_set1_ps(EXP_F32_HIGH), x));
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
    (_mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0)), n)
}

whole_run_kernels!(
    /// `out[i] = ln x[i]` for `i < len` in float32 with AVX-512: the very operations of
    /// [`log_f32_with`](super::log_f32_with) with FMA (Cephes' polynomial, subnormals scaled
    /// first, numpy's special values), so its results are bit-identical to that loop's and its
    /// accuracy is that loop's (within 1 ulp), written with intrinsics because the compiler's
    /// vectorization of the generic loop took twice the time.
    log_f32_avx512, log_f16_avx512, LOG_AVX512,
    |v| log_f32x16(v)
);

/// 16 lanes of [`log_f32_avx512`]; each step is the one of `log_f32_with` on the same line.
/// Vectors whose lanes are all normal, positive and finite (nearly all) skip the subnormal
/// scaling and the special values, whose masks were half the loop's time.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
fn log_f32x16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // x in [MIN_POSITIVE, MAX] exactly when its bits, less MIN_POSITIVE's, are below inf's
    // less MIN_POSITIVE's, as unsigned numbers (one compare for sign, zero, subnormal, inf, NaN).
    let normal = _mm512_cmp_epu32_mask::<_MM_CMPINT_LT>(
        _mm512_sub_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(f32::MIN_POSITIVE.to_bits() as i32)),
        _mm512_set1_epi32((f32::INFINITY.to_bits() - f32::MIN_POSITIVE.to_bits()) as i32),
    );
    if normal == 0xffff {
        return log_f32x16_core(x, 0);
    }
    let sub = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(f32::MIN_POSITIVE));
    let r = log_f32x16_core(_mm512_mask_mul_ps(x, sub, x, _mm512_set1_ps(33_554_432.0)), sub);
    let r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(x, _mm512_set1_ps(f32::INFINITY)), x);
    let zero = _mm512_setzero_ps();
    let r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(x, zero), _mm512_set1_ps(f32::NEG_INFINITY));
    let r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, zero), _mm512_set1_ps(f32::NAN));
    _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), x)
}

/// `ln xs` for normal positive `xs`, or for `2^25 x` in the lanes of `sub`, as `log_f32_with`.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
fn log_f32x16_core(xs: std::arch::x86_64::__m512, sub: std::arch::x86_64::__mmask16) -> std::arch::x86_64::__m512 {
    use super::log::{LOG_F32_LN2, LOG_F32_POLY, LOG_F32_SQRT_HALF};
    use std::arch::x86_64::*;
    let ix = _mm512_add_epi32(_mm512_castps_si512(xs), _mm512_set1_epi32(0x3f80_0000 - LOG_F32_SQRT_HALF));
    let k = _mm512_sub_epi32(_mm512_srai_epi32::<23>(ix), _mm512_set1_epi32(0x7f));
    let k = _mm512_mask_sub_epi32(k, sub, k, _mm512_set1_epi32(25));
    let m =
        _mm512_add_epi32(_mm512_and_si512(ix, _mm512_set1_epi32(0x007f_ffff)), _mm512_set1_epi32(LOG_F32_SQRT_HALF));
    let f = _mm512_sub_ps(_mm512_castsi512_ps(m), _mm512_set1_ps(1.0));
    let e = _mm512_cvtepi32_ps(k);
    let z = _mm512_mul_ps(f, f);
    let mut p = _mm512_set1_ps(LOG_F32_POLY[0] as f32);
    for &c in &LOG_F32_POLY[1..] {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c as f32));
    }
    let pzf = _mm512_mul_ps(_mm512_mul_ps(p, z), f);
    let y = _mm512_fmadd_ps(z, _mm512_set1_ps(-0.5), _mm512_fmadd_ps(e, _mm512_set1_ps(LOG_F32_LN2.1), pzf));
    _mm512_fmadd_ps(e, _mm512_set1_ps(LOG_F32_LN2.0), _mm512_add_ps(f, y))
}

/// Where sigmoid and silu clamp `-|x|` for `e^-|x|`: below it both round to zero (silu's
/// `x e^x` only from -108.7, past `EXP_F32_LOW`); their lanes below it are set to zero outright.
pub(super) const SIGMOID_F32_LOW: f32 = -120.0;

whole_run_kernels!(
    /// `out[i] = 1 / (1 + e^-x[i])` for `i < len` in float32 with AVX-512, within 2.5 ulp
    /// (`tools/sweep_f32_ulp.py`, every float32): the stable form of `unary`'s `sigmoid`, with
    /// `e = e^-|x|` from [`exp_f32_avx512`]'s lanes (never overflowing), `1 / (1 + e)` for
    /// `x >= 0` and `e / (1 + e)` below, computed as `(p / (1 + e)) 2^n` so a result in the
    /// subnormal range (x in (-104, -87.3), where `1 / (1 + np.exp(-x))` overflows to 0) is
    /// rounded once. NaN stays NaN.
    sigmoid_f32_avx512, sigmoid_f16_avx512, SIGMOID_AVX512,
    |v| sigmoid_f32x16::<false>(v)
);

whole_run_kernels!(
    /// `out[i] = x[i] sigmoid(x[i])` for `i < len` in float32 with AVX-512, as
    /// [`sigmoid_f32_avx512`]: `x / (1 + e)` for `x >= 0`, `(x p / (1 + e)) 2^n` below, so the
    /// subnormal results of large negative `x` are rounded once, not a rounded subnormal
    /// sigmoid multiplied by `x` (52 ulp). `silu(-0) = -0`, `silu(-inf)` is NaN (`-inf * 0`,
    /// as the scalar loop and `x / (1 + np.exp(-x))` give), large negative `x` give -0.
    silu_f32_avx512, silu_f16_avx512, SILU_AVX512,
    |v| sigmoid_f32x16::<true>(v)
);

/// 16 lanes of [`sigmoid_f32_avx512`], or of [`silu_f32_avx512`] (`SILU`).
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
fn sigmoid_f32x16<const SILU: bool>(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let (p, n) = exp_parts_f32x16(_mm512_or_ps(x, _mm512_set1_ps(-0.0)), SIGMOID_F32_LOW);
    let d = _mm512_add_ps(_mm512_set1_ps(1.0), _mm512_scalef_ps(p, n));
    // Not `x >= 0` (NaN included, as the scalar form takes its `else`): `p 2^n / (1 + e)`, the
    // `2^n` applied last. One division either way.
    let below = _mm512_cmp_ps_mask::<_CMP_NGE_UQ>(x, _mm512_setzero_ps());
    let num = if SILU { _mm512_mask_mul_ps(x, below, x, p) } else { _mm512_mask_mov_ps(_mm512_set1_ps(1.0), below, p) };
    let q = _mm512_div_ps(num, d);
    let r = _mm512_mask_scalef_ps(q, below, q, n);
    // Below the clamp the result is zero (of x's sign for silu; -inf * 0 is NaN).
    let gone = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(SIGMOID_F32_LOW));
    let zero = _mm512_setzero_ps();
    if SILU {
        _mm512_mask_mul_ps(r, gone, x, zero)
    } else {
        _mm512_mask_mov_ps(r, gone, zero)
    }
}
