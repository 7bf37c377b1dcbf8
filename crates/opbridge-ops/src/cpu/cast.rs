//! dtype conversion between strided views with numpy's `astype` semantics. With equal dtypes it
//! is a strided copy: `contiguous()` of any view and materialized transposes (write into a
//! contiguous `dst`, read a permuted `src`).
//!
//! Conversions:
//! - float -> float: rounded to nearest even (float16 from float64 directly, no double rounding).
//! - int -> float: rounded to nearest even directly from the integer (int64 -> float32 does
//!   not round through float64), as C's `(float)v`, which numpy uses.
//! - int -> int: wraps (two's complement truncation), as numpy.
//! - float -> int: truncates toward zero. NaN, +-inf and values outside the target's range give
//!   the target's minimum (`i32::MIN`, `i64::MIN`): what numpy produces on x86-64 (the
//!   `cvttsd2si` "integer indefinite"), so results agree with numpy there; numpy also warns
//!   "invalid value encountered in cast", which we do not. (Rust's `as` would saturate and
//!   map NaN to 0 instead.)
#![allow(unsafe_code)]

use half::f16;
use opbridge_runtime::DType;

use super::broadcast::{self, StridedLoop};
use super::error::KernelError;
use super::thresholds;
use super::Element;
use crate::view::TensorView;

/// An element that a float value converts to (`from_f64`, except for ints: see the module
/// docs).
trait FromFloat: Element {
    fn from_float(v: f64) -> Self;
}

macro_rules! from_float_as {
    ($($t:ty),*) => {$(
        impl FromFloat for $t {
            #[inline(always)]
            fn from_float(v: f64) -> Self {
                <$t as Element>::from_f64(v)
            }
        }
    )*};
}
from_float_as!(f32, f64);

impl FromFloat for f16 {
    #[inline(always)]
    fn from_float(v: f64) -> f16 {
        f16_from_f64(v)
    }
}

/// float64 -> float16 rounded once to nearest even, as numpy's `npy_double_to_half`.
/// (`half::f16::from_f64` goes through float32 on F16C hardware: a double rounding that
/// differs from numpy for values just above a float16 tie.) Rounding to float32 *to odd*
/// first keeps the sticky bit, and float32 has more than 11 + 2 bits, so the final
/// float32 -> float16 rounding is then exact.
#[inline(always)]
pub(crate) fn f16_from_f64(v: f64) -> f16 {
    let r = v as f32;
    if r as f64 == v || v.is_nan() {
        return f16::from_f32(r);
    }
    // Inexact: truncate toward zero (one step back if rounding went outward), then set the
    // lowest bit. `r` and `v` share their sign; `r` may be infinite, whose predecessor is MAX.
    let truncated = if (r as f64).abs() > v.abs() { r.to_bits() - 1 } else { r.to_bits() };
    f16::from_f32(f32::from_bits(truncated | 1))
}

macro_rules! from_float_int {
    ($t:ty, $low:expr, $high:expr) => {
        impl FromFloat for $t {
            /// Truncation toward zero; NaN, infinities and out-of-range values give `MIN`.
            #[inline(always)]
            fn from_float(v: f64) -> Self {
                // `low < v < high` holds exactly for the values that truncate into range (and
                // is false for NaN).
                if v > $low && v < $high {
                    v as $t
                } else {
                    <$t>::MIN
                }
            }
        }
    };
}
from_float_int!(i32, -2_147_483_649.0, 2_147_483_648.0);
from_float_int!(i64, -9_223_372_036_854_777_856.0, 9_223_372_036_854_775_808.0);

/// One element from `S` to `D` (see the module docs).
#[inline(always)]
fn convert<S: Element, D: FromFloat>(s: S) -> D {
    if S::DTYPE.is_float() {
        // float -> f64 is exact; f64 -> D rounds once.
        D::from_float(s.to_f64())
    } else {
        // int -> i64 is exact; `from_i64` rounds once (f16 from f64: every i64 that f16 can
        // hold finitely is exact in f64) or wraps.
        D::from_i64(s.to_i64())
    }
}

/// `dst = src.astype(dst.dtype)`, elementwise over any strides; `src` broadcasts to
/// `dst.shape` (as `np.copyto`).
///
/// Errors: `src` does not broadcast to `dst.shape`, or `dst` names an element twice (a
/// stride-0 dimension).
///
/// # Safety
/// Every element of `src` (its shape and strides) is readable and every element of `dst`
/// writable, aligned for their dtypes; nothing else writes them during the call; `dst` does
/// not overlap `src` (an exactly identical view of the same dtype is allowed: nothing is
/// done), and no two indices of `dst` name the same element.
pub unsafe fn cast_view(src: &TensorView, dst: &TensorView) -> Result<(), KernelError> {
    if src == dst {
        return Ok(());
    }
    let src = broadcast::try_broadcast_view(src, &dst.shape)?;
    if broadcast::has_repeated_elements(dst) {
        return Err(KernelError::RepeatedOutput { what: "the destination" });
    }
    let lp = StridedLoop::new([dst, &src]);
    crate::with_dtype!(src.dtype, S => {
        match dst.dtype {
            DType::F16 => run::<S, f16>(&lp),
            DType::F32 => run::<S, f32>(&lp),
            DType::F64 => run::<S, f64>(&lp),
            DType::I32 => run::<S, i32>(&lp),
            DType::I64 => run::<S, i64>(&lp),
        }
    });
    Ok(())
}

fn run<S: Element, D: FromFloat>(lp: &StridedLoop<2>) {
    let min = thresholds::elementwise_parallel_min();
    if S::DTYPE == D::DTYPE {
        lp.run(min, |[out, x], [so, sx], len| {
            let size = S::DTYPE.size();
            if so == 1 && sx == 1 {
                // SAFETY: a run of `len` elements of each view (`cast_view`'s contract), disjoint.
                unsafe { std::ptr::copy_nonoverlapping(x as *const u8, out as *mut u8, len * size) };
            } else {
                // SAFETY: as above, `S` and `D` are the same type.
                unsafe { broadcast::map_run::<S, S>([out, x], [so, sx], len, |v| v) };
            }
        });
    } else {
        // SAFETY: runs stay inside `dst` and `src`, are disjoint in `dst`, and `dst` does not
        // overlap `src` (`cast_view`'s contract).
        lp.run(min, |p, s, len| unsafe { broadcast::map_run::<S, D>(p, s, len, convert::<S, D>) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::broadcast::testing::*;
    use crate::PARALLEL_MIN_ELEMS;

    /// Source data: fractional values of both signs, specials and out-of-range values for
    /// floats; extremes for ints.
    fn values<T: Element>(n: usize) -> Vec<T> {
        (0..n)
            .map(|i| {
                if T::DTYPE.is_float() {
                    let special = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 1e10, -1e10, 3e38, 65520.0];
                    if i % 19 < special.len() && i & 1 == 1 {
                        T::from_f64(special[i % 19])
                    } else {
                        T::from_f64(((i * 37) % 201) as f64 / 8.0 - 12.5)
                    }
                } else {
                    match i % 7 {
                        0 => T::from_i64(i64::MIN + i as i64),
                        1 => T::from_i64(i64::MAX - i as i64),
                        2 => T::from_i64(1 << 40 | i as i64),
                        _ => T::from_i64(i as i64 * 9973 - 50_000),
                    }
                }
            })
            .collect()
    }

    /// The expected bits of one conversion, from the definitions (f64 intermediates, explicit
    /// range checks), as an `f64` or `i64` for comparison.
    fn reference<S: Element, D: Element>(s: S) -> (f64, i64) {
        match (S::DTYPE.is_float(), D::DTYPE.is_float()) {
            // float16 targets: `half`'s from_f64 may round twice (through float32), so check
            // them against the definition: the nearest float16, ties to even.
            (true, true) if D::DTYPE == DType::F16 => (nearest_f16(s.to_f64()), 0),
            (true, true) => (D::from_f64(s.to_f64()).to_f64(), 0),
            (true, false) => {
                let t = s.to_f64().trunc();
                let (ok, min) = match D::DTYPE {
                    DType::I32 => ((-2_147_483_648.0..=2_147_483_647.0).contains(&t), i32::MIN as i64),
                    _ => ((-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&t), i64::MIN),
                };
                (0.0, if ok { t as i64 } else { min })
            }
            (false, true) => {
                let v = s.to_i64();
                let want = match D::DTYPE {
                    DType::F32 => v as f32 as f64,
                    DType::F64 => v as f64,
                    _ => f16::from_f32(v as f32).to_f64(),
                };
                (want, 0)
            }
            (false, false) => (0.0, D::from_i64(s.to_i64()).to_i64()),
        }
    }

    /// The float16 nearest to `v` (ties to even), by search over the finite float16 values.
    fn nearest_f16(v: f64) -> f64 {
        if v.is_nan() || v.is_infinite() {
            return v;
        }
        if v.abs() >= 65520.0 {
            return v.signum() * f64::INFINITY;
        }
        let mut best = (f64::INFINITY, 0u16);
        for bits in 0..0x7c00u16 {
            let bits = if v.is_sign_negative() { bits | 0x8000 } else { bits };
            let d = (f16::from_bits(bits).to_f64() - v).abs();
            if d < best.0 || (d == best.0 && bits & 1 == 0) {
                best = (d, bits);
            }
        }
        f16::from_bits(best.1).to_f64()
    }

    fn check_pair<S: Element, D: Element>(shape: &[usize], src_shape: &[usize], ls: Layout, ld: Layout) {
        let xs = values::<S>(src_shape.iter().product());
        let src = make(src_shape, ls, &xs);
        let dst = alloc(D::DTYPE, shape, ld);
        // SAFETY: test views, disjoint.
        unsafe { cast_view(&src.view, &dst.view) }.unwrap();
        let xs = read::<S>(&broadcast::broadcast_view(&src.view, shape));
        for (i, (&g, &x)) in read::<D>(&dst.view).iter().zip(&xs).enumerate() {
            let (wf, wi) = reference::<S, D>(x);
            let ctx = || format!("{} -> {} {shape:?} {ls:?}->{ld:?} at {i}: {}", S::DTYPE, D::DTYPE, x.to_f64());
            if D::DTYPE.is_float() {
                assert!(
                    g.to_f64() == wf || (wf.is_nan() && g.to_f64().is_nan()),
                    "{} got {} want {wf}",
                    ctx(),
                    g.to_f64()
                );
            } else {
                assert_eq!(g.to_i64(), wi, "{}", ctx());
            }
        }
    }

    fn check_from<S: Element>(shape: &[usize], src_shape: &[usize], ls: Layout, ld: Layout) {
        check_pair::<S, f16>(shape, src_shape, ls, ld);
        check_pair::<S, f32>(shape, src_shape, ls, ld);
        check_pair::<S, f64>(shape, src_shape, ls, ld);
        check_pair::<S, i32>(shape, src_shape, ls, ld);
        check_pair::<S, i64>(shape, src_shape, ls, ld);
    }

    fn check_all(shape: &[usize], src_shape: &[usize], ls: Layout, ld: Layout) {
        check_from::<f16>(shape, src_shape, ls, ld);
        check_from::<f32>(shape, src_shape, ls, ld);
        check_from::<f64>(shape, src_shape, ls, ld);
        check_from::<i32>(shape, src_shape, ls, ld);
        check_from::<i64>(shape, src_shape, ls, ld);
    }

    #[test]
    fn every_pair_every_layout() {
        let cases: [(&[usize], &[usize]); 6] = [
            (&[3, 5, 4], &[3, 5, 4]),
            (&[3, 5, 4], &[5, 1]),
            (&[], &[]),
            (&[2, 0, 3], &[3]),
            (&[4, 3], &[]),
            (&[41], &[41]),
        ];
        for (shape, src_shape) in cases {
            for (i, &ls) in LAYOUTS.iter().enumerate() {
                check_all(shape, src_shape, ls, LAYOUTS[(i + 1) % LAYOUTS.len()]);
                check_all(shape, src_shape, ls, Layout::Contiguous);
            }
        }
    }

    #[test]
    fn around_the_parallel_threshold() {
        // Transposed copies into contiguous memory, just below and above the threshold.
        for cols in [361, 362] {
            check_pair::<f32, f32>(&[363, cols], &[363, cols], Layout::Fortran, Layout::Contiguous);
            check_pair::<f64, i32>(&[363, cols], &[363, cols], Layout::Fortran, Layout::Contiguous);
            check_pair::<i64, f16>(&[363, cols], &[363, cols], Layout::Reversed, Layout::Padded);
        }
        let n = PARALLEL_MIN_ELEMS + 3;
        check_pair::<f32, f64>(&[n], &[n], Layout::Contiguous, Layout::Contiguous);
        check_pair::<i32, i32>(&[n], &[n], Layout::Stepped, Layout::Contiguous);
    }

    fn eval<S: Element, D: Element>(xs: &[S]) -> Vec<D> {
        let src = make(&[xs.len()], Layout::Contiguous, xs);
        let dst = alloc(D::DTYPE, &[xs.len()], Layout::Contiguous);
        // SAFETY: test views, disjoint.
        unsafe { cast_view(&src.view, &dst.view) }.unwrap();
        read(&dst.view)
    }

    #[test]
    fn numpy_astype_values() {
        let specials = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 3e9, -1.7, 1.7, -2147483648.9, 2147483647.9];
        assert_eq!(eval::<f64, i32>(&specials), [i32::MIN, i32::MIN, i32::MIN, i32::MIN, -1, 1, i32::MIN, i32::MAX]);
        assert_eq!(
            eval::<f32, i64>(&[f32::NAN, 9.3e18, -9.2e18, -0.9]),
            [i64::MIN, i64::MIN, -9_200_000_267_938_955_264, 0]
        );
        assert_eq!(eval::<f16, i32>(&[f16::from_f32(-2.5), f16::INFINITY]), [-2, i32::MIN]);
        assert_eq!(eval::<i64, i32>(&[1 << 32 | 5, -1]), [5, -1]);
        // Direct rounding: through float64 this would tie and round to 2^60.
        let v = (1i64 << 60) + (1 << 36) + 1;
        assert_eq!(eval::<i64, f32>(&[v]), [((1u64 << 60) + (1 << 37)) as f32]);
        assert_eq!(
            eval::<i32, f16>(&[65519, 65520, 2049]),
            [f16::from_f32(65504.0), f16::INFINITY, f16::from_f32(2048.0)]
        );
        // float64 -> float16 rounds once: 1 + 2^-11 + 2^-40 is just above the tie.
        assert_eq!(eval::<f64, f16>(&[1.0 + 2f64.powi(-11) + 2f64.powi(-40)]), [f16::from_f32(1.0 + 2f32.powi(-10))]);
        for v in [65519.99, -65520.0, 1e-8, -3e-8, 2.9802322387695312e-8, 5.960464477539063e-8 * 1.5, 0.1, -1e300] {
            assert_eq!(eval::<f64, f16>(&[v])[0].to_f64(), nearest_f16(v), "{v}");
        }
        assert!(eval::<f64, f16>(&[f64::NAN])[0].is_nan());
        assert!(eval::<f64, f32>(&[f64::NAN])[0].is_nan());
        assert_eq!(eval::<f64, f32>(&[1e300]), [f32::INFINITY]);
    }

    #[test]
    fn identical_view_is_a_no_op_and_errors_are_reported() {
        let a = make(&[3], Layout::Contiguous, &[1.0f32, 2.0, 3.0]);
        // SAFETY: identical views; the failing calls fail their checks before touching memory.
        unsafe {
            cast_view(&a.view, &a.view).unwrap();
            let wide = alloc(DType::F64, &[2, 4], Layout::Contiguous);
            assert!(cast_view(&a.view, &wide.view).unwrap_err().to_string().contains("(2, 4)"));
            let repeated = broadcast::broadcast_view(&wide.view, &[3, 2, 4]);
            assert!(cast_view(&a.view, &repeated).is_err());
        }
        assert_eq!(read::<f32>(&a.view), [1.0, 2.0, 3.0]);
    }
}
