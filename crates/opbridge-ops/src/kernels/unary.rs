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
use super::Element;
use crate::view::TensorView;

/// Transcendental ops cost tens of cycles per element, so a second core pays off far earlier
/// than for memory-bound ops. An estimate (exp/tanh ~10 ns per element against ~20 µs to wake
/// the pool), not yet measured: `calibrate` should own it.
pub const TRANSCENDENTAL_PARALLEL_MIN_ELEMS: usize = 1 << 14;

/// The parallel threshold of compute-bound kernels: never above the calibrated elementwise one.
pub(crate) fn transcendental_parallel_min() -> usize {
    TRANSCENDENTAL_PARALLEL_MIN_ELEMS.min(crate::tuning::elementwise_parallel_min())
}

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
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn erfc(self) -> Self;
    fn powf(self, e: Self) -> Self;
    /// `self * a + b` rounded once (a libm call per element where FMA is not enabled).
    fn mul_add(self, a: Self, b: Self) -> Self;
    /// `e^x` with `a * b + c` evaluated as `M` says (vectorizable in both cases).
    fn exp_with<M: Mla>(self) -> Self;
    fn tanh_with<M: Mla>(self) -> Self;
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
    ($t:ty, $erfc:path, $exp:ident, $tanh:ident) => {
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
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn erfc(self) -> Self {
                $erfc(self)
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
            fn tanh_with<M: Mla>(self) -> Self {
                $tanh::<M>(self)
            }
        }
    };
}
real!(f32, libm::erfcf, exp_f32_with, tanh_f32_with);
real!(f64, libm::erfc, exp_f64_with, tanh_f64_with);

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
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Below LO the result is 0 even as a subnormal; above HI it is inf.
    const LO: f32 = -104.0;
    const HI: f32 = 88.722_84;
    let xc = x.clamp(LO, HI);
    let (e, ni) = exp_f32_reduced::<M>(xc * LOG2E, xc);
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

/// `(e^r, n)` with `x = n ln 2 + r`, `n = round(x_log2e)` (`x_log2e` is `x log2 e`, finite).
#[inline(always)]
fn exp_f32_reduced<M: Mla>(x_log2e: f32, x: f32) -> (f32, i32) {
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let t = x_log2e + ROUND;
    let n = t - ROUND;
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = M::mla(n, -LN2_LO, M::mla(n, -LN2_HI, x));
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
    let (e, ni) = exp_f32_reduced::<M>(y * std::f32::consts::LOG2_E, y);
    let e = e * f32::from_bits(((ni + 127) as u32) << 23);
    let big = 1.0 - 2.0 / (e + 1.0);
    // tanh keeps the sign of x; copysign also keeps that of -0 (`x + x z p` would give +0).
    (if a > 0.625 { big } else { small }).copysign(x)
}

/// `e^x` in float64, branch-free so loops vectorize: SLEEF's degree-11 polynomial after the
/// Cody-Waite reduction, about 1 ulp; subnormal results, overflow, `-inf` and NaN as
/// [`exp_f32`].
#[inline(always)]
fn exp_f64_with<M: Mla>(x: f64) -> f64 {
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
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let ni = (t.to_bits() as i64).wrapping_sub(ROUND.to_bits() as i64);
    let r = M::mla(n, -LN2_LO, M::mla(n, -LN2_HI, xc));
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
    /// compute-bound ones at most at `TRANSCENDENTAL_PARALLEL_MIN_ELEMS`.
    fn parallel_min(self) -> usize {
        match self {
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Relu | UnaryOp::Sqrt => crate::tuning::elementwise_parallel_min(),
            _ => transcendental_parallel_min(),
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
fn gelu_erf<R: Real>(x: R) -> R {
    R::HALF * x * (-x * R::c(std::f64::consts::FRAC_1_SQRT_2)).erfc()
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
    let lp = StridedLoop::new([out, &x]);
    let min = op.parallel_min();
    // The loop's runs stay inside `out` and `x` (caller's contract), runs
    // are disjoint in `out`, and `out` is either disjoint from `x` or exactly `x`.
    match out.dtype {
        DType::F16 => run_float::<f16>(op, &lp, min),
        DType::F32 => run_float::<f32>(op, &lp, min),
        DType::F64 => run_float::<f64>(op, &lp, min),
        DType::I32 => run_int::<i32>(op, &lp, min)?,
        DType::I64 => run_int::<i64>(op, &lp, min)?,
    }
    Ok(())
}

/// Whether [`unary_contiguous`] serves `op` on `dtype` (the result keeps the dtype).
pub fn unary_lane_accepts(op: UnaryOp, dtype: DType) -> bool {
    dtype.is_float() || op.keeps_int_dtype()
}

/// `out = op(x)` over `len` C-contiguous elements of `dtype`: the elementwise fast lane, with
/// no views to analyze. Only for dtypes [`unary_lane_accepts`].
///
/// # Safety
/// `x` is readable and `out` writable for `len` aligned elements of `dtype`, nothing else
/// writes them during the call, and `out` is either disjoint from `x` or equal to it.
pub unsafe fn unary_contiguous(op: UnaryOp, dtype: DType, x: usize, out: usize, len: usize) {
    debug_assert!(unary_lane_accepts(op, dtype));
    let lp = StridedLoop::flat([out, x], [dtype.size(); 2], len);
    let min = op.parallel_min();
    // The loop is one contiguous run split into chunks: `unary`'s contract for `run_float`.
    match dtype {
        DType::F16 => run_float::<f16>(op, &lp, min),
        DType::F32 => run_float::<f32>(op, &lp, min),
        DType::F64 => run_float::<f64>(op, &lp, min),
        DType::I32 => run_int::<i32>(op, &lp, min).expect("the lane takes int dtypes only for int kernels"),
        DType::I64 => run_int::<i64>(op, &lp, min).expect("the lane takes int dtypes only for int kernels"),
    }
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
        UnaryOp::Log => sink.run(|x: R| x.ln()),
        UnaryOp::Sqrt => sink.run(|x: R| x.sqrt()),
        UnaryOp::Relu => sink.run(|x: R| if x.is_nan() || x >= R::ZERO { x } else { R::ZERO }),
        UnaryOp::Sigmoid => sink.run(sigmoid::<R, M>),
        UnaryOp::Tanh => sink.run(|x: R| x.tanh_with::<M>()),
        UnaryOp::GeluErf => sink.run(gelu_erf::<R>),
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

    use super::*;
    use crate::kernels::broadcast::testing::*;
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
