//! Elementwise binary kernels with numpy semantics over broadcast, strided views.
//!
//! dtype rule ([`binary_result_dtype`]): numpy's promotion `a.promote(b)`, except that `div`
//! of two integer arrays is true division and gives float64 (numpy's `np.divide`). The kernel
//! runs on one dtype: the caller casts both inputs to the result dtype first (see
//! `cast::cast_view`); integer `div` is then never asked of it.
//!
//! Semantics: integers wrap on overflow (`add`, `sub`, `mul`, `pow`); float `div` follows IEEE
//! (`1/0 = inf`, `0/0 = nan`); `maximum`/`minimum` propagate NaN like numpy's; integer `pow`
//! with a negative exponent is an error, as numpy's "Integers to negative integer powers are
//! not allowed"; float16 computes in float32 and rounds once.
#![allow(unsafe_code)]

use half::f16;
use opbridge_runtime::DType;

use super::broadcast::{self, StridedLoop};
use super::error::KernelError;
use super::math::{FloatElement, IntElement, Real};
use super::thresholds;
use super::Element;
use crate::view::TensorView;

/// The message numpy raises for integer `pow` with a negative exponent.
pub use super::error::NEGATIVE_INT_POWER;

/// Elementwise binary operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    /// True division (`np.divide`); float dtypes only in the kernel.
    Div,
    /// `np.maximum`: NaN if either operand is NaN.
    Maximum,
    /// `np.minimum`: NaN if either operand is NaN.
    Minimum,
    /// `np.power`.
    Pow,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 7] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
        BinaryOp::Pow,
    ];

    /// The operator's name (`"add"`, `"maximum"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::Pow => "pow",
        }
    }

    pub fn from_name(name: &str) -> Option<BinaryOp> {
        BinaryOp::ALL.into_iter().find(|op| op.name() == name)
    }

    /// Where the op goes parallel: `pow` is compute-bound, the rest memory-bound (the
    /// calibrated elementwise threshold).
    fn parallel_min(self) -> usize {
        if self == BinaryOp::Pow {
            thresholds::transcendental_parallel_min()
        } else {
            thresholds::elementwise_parallel_min()
        }
    }
}

impl std::fmt::Display for BinaryOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The dtype numpy gives `op(a, b)`: `a.promote(b)`, except `div` of two integer dtypes, which
/// is float64. Cast both inputs to it before calling [`binary`].
pub fn binary_result_dtype(op: BinaryOp, a: DType, b: DType) -> DType {
    if op == BinaryOp::Div && !a.is_float() && !b.is_float() {
        DType::F64
    } else {
        a.promote(b)
    }
}

/// `out = op(a, b)` elementwise, with `a` and `b` broadcast to `out.shape` (numpy allows `out`
/// to be larger than the inputs' broadcast shape, so do we).
///
/// Errors (the caller attaches the op name): dtypes differ from `out.dtype`; integer
/// `div` (cast to [`binary_result_dtype`] first); an input does not broadcast to
/// `out.shape`; `out` names an element twice (a stride-0 dimension); integer `pow` with a
/// negative exponent ([`KernelError::NegativeIntPower`]; nothing is written then).
///
/// # Safety
/// Every element of `a` and `b` (their shapes and strides) is readable and every element of
/// `out` is writable, aligned for the dtype, and nothing else writes them during the call;
/// `out` is either disjoint from an input or exactly that input (same address, and same
/// strides once the input is broadcast to `out.shape`), and no two indices of `out` name the
/// same element.
pub unsafe fn binary(op: BinaryOp, a: &TensorView, b: &TensorView, out: &TensorView) -> Result<(), KernelError> {
    if a.dtype != out.dtype || b.dtype != out.dtype {
        return Err(KernelError::BinaryDTypes { a: a.dtype, b: b.dtype, out: out.dtype });
    }
    if op == BinaryOp::Div && !out.dtype.is_float() {
        return Err(KernelError::IntegerDivision { dtype: out.dtype });
    }
    let lp = broadcast_loop(a, b, out)?;
    if op == BinaryOp::Pow && !out.dtype.is_float() && has_negative(b) {
        return Err(KernelError::NegativeIntPower);
    }
    run_loop(op, out.dtype, &lp, op.parallel_min());
    Ok(())
}

/// The walk over `[out, a, b]` with `a` and `b` broadcast to `out.shape`.
fn broadcast_loop(a: &TensorView, b: &TensorView, out: &TensorView) -> Result<StridedLoop<3>, KernelError> {
    let a_full = broadcast::try_broadcast_view(a, &out.shape)?;
    let b_full = broadcast::try_broadcast_view(b, &out.shape)?;
    if broadcast::has_repeated_elements(out) {
        return Err(KernelError::RepeatedOutput { what: "out" });
    }
    Ok(StridedLoop::new([out, &a_full, &b_full]))
}

/// Runs `op` over `lp` (`[out, a, b]`, all of `dtype`; integer `div` already refused).
fn run_loop(op: BinaryOp, dtype: DType, lp: &StridedLoop<3>, min: usize) {
    match dtype {
        DType::F16 => run_float::<f16>(op, lp, min),
        DType::F32 => run_float::<f32>(op, lp, min),
        DType::F64 => run_float::<f64>(op, lp, min),
        DType::I32 => run_int::<i32>(op, lp, min),
        DType::I64 => run_int::<i64>(op, lp, min),
    }
}

/// `out = alpha * x + y` elementwise (BLAS's axpy), `x` and `y` broadcast to `out.shape`;
/// float dtypes only (float16 computes in float32 and rounds once).
///
/// # Safety
/// As for [`binary`].
pub unsafe fn axpy(alpha: f64, x: &TensorView, y: &TensorView, out: &TensorView) -> Result<(), KernelError> {
    if x.dtype != out.dtype || y.dtype != out.dtype || !out.dtype.is_float() {
        return Err(KernelError::AxpyDTypes { x: x.dtype, y: y.dtype, out: out.dtype });
    }
    let lp = broadcast_loop(x, y, out)?;
    let min = thresholds::elementwise_parallel_min();
    fn run<T: FloatElement>(alpha: f64, lp: &StridedLoop<3>, min: usize) {
        let alpha = <T::R as Real>::c(alpha);
        run_map(lp, min, move |x: T, y: T| T::down(alpha * x.up() + y.up()));
    }
    match out.dtype {
        DType::F16 => run::<f16>(alpha, &lp, min),
        DType::F32 => run::<f32>(alpha, &lp, min),
        _ => run::<f64>(alpha, &lp, min),
    }
    Ok(())
}

/// Whether [`binary_contiguous`] serves `op` on `dtype`: the result keeps the dtype and no
/// value check is left (integer `div` changes dtype, integer `pow` checks its exponents).
pub fn binary_lane_accepts(op: BinaryOp, dtype: DType) -> bool {
    dtype.is_float() || !matches!(op, BinaryOp::Div | BinaryOp::Pow)
}

/// `out = op(a, b)` over `len` C-contiguous elements of `dtype`: the elementwise fast lane,
/// with no views to analyze. Only for dtypes [`binary_lane_accepts`].
///
/// # Safety
/// `a` and `b` are readable and `out` writable for `len` aligned elements of `dtype`, nothing
/// else writes them during the call, and `out` is either disjoint from an input or equal to
/// its address.
pub unsafe fn binary_contiguous(op: BinaryOp, dtype: DType, a: usize, b: usize, out: usize, len: usize) {
    debug_assert!(binary_lane_accepts(op, dtype));
    // Outputs far larger than the cache, disjoint from the inputs: streaming stores (the
    // destination is not read first), bit-identical results. The size test comes first: a
    // small call pays one comparison.
    if len.saturating_mul(dtype.size()) >= super::streaming::STREAMING_MIN_BYTES && out != a && out != b {
        let streamed = match op {
            BinaryOp::Add => Some(super::streaming::StreamOp::Add),
            BinaryOp::Sub => Some(super::streaming::StreamOp::Sub),
            BinaryOp::Mul => Some(super::streaming::StreamOp::Mul),
            BinaryOp::Div => Some(super::streaming::StreamOp::Div),
            _ => None,
        };
        if let Some(sop) = streamed.filter(|&sop| super::streaming::supports(sop, dtype)) {
            // SAFETY: the lane's contract: `len` valid elements each, `out` disjoint from both
            // inputs (it is not exactly either, and the contract allows nothing in between).
            unsafe { super::elementwise::streaming_parallel(sop, dtype, a as _, b as _, out as _, len) };
            return;
        }
    }
    let lp = StridedLoop::flat([out, a, b], [dtype.size(); 3], len);
    run_loop(op, dtype, &lp, op.parallel_min());
}

/// Whether an integer view holds a negative element (read once each, before anything is
/// written, so `out` may alias it).
fn has_negative(view: &TensorView) -> bool {
    let lp = StridedLoop::new([view]);
    let mut found = false;
    lp.for_each_run(0, lp.numel(), |[p], [s], len| {
        crate::with_dtype!(view.dtype, T => {
            let ptr = p as *const T;
            // SAFETY: the run lies inside `view`, readable under `binary`'s contract.
            found |= (0..len as isize).any(|i| unsafe { *ptr.offset(i * s) }.to_i64() < 0);
        })
    });
    found
}

/// Runs `f` over every run of `lp` (`[out, a, b]`).
fn run_map<T: Element>(lp: &StridedLoop<3>, min: usize, f: impl Fn(T, T) -> T + Copy + Sync) {
    // SAFETY: `lp` was built over `[out, a, b]` under `binary`'s contract: runs stay inside the
    // views, are disjoint in `out`, and `out` is disjoint from or exactly each input.
    lp.run(min, |p, s, len| unsafe { broadcast::binary_run::<T>(p, s, len, f) });
}

fn run_float<T: FloatElement>(op: BinaryOp, lp: &StridedLoop<3>, min: usize) {
    match op {
        BinaryOp::Add => run_map(lp, min, |a: T, b: T| T::down(a.up() + b.up())),
        BinaryOp::Sub => run_map(lp, min, |a: T, b: T| T::down(a.up() - b.up())),
        BinaryOp::Mul => run_map(lp, min, |a: T, b: T| T::down(a.up() * b.up())),
        BinaryOp::Div => run_map(lp, min, |a: T, b: T| T::down(a.up() / b.up())),
        // Ties (-0.0 vs 0.0) as numpy breaks them: its float32/64 loops use x86's max/min,
        // which give `b`; its float16 loop keeps `a`. `tie_a` is a constant per `T`, and `|`
        // keeps each a branch-free select.
        BinaryOp::Maximum => run_map(lp, min, |a: T, b: T| {
            let (x, y) = (a.up(), b.up());
            let tie_a = std::mem::size_of::<T>() == 2;
            if (x > y) | (tie_a & (x == y)) | x.is_nan() {
                a
            } else {
                b
            }
        }),
        BinaryOp::Minimum => run_map(lp, min, |a: T, b: T| {
            let (x, y) = (a.up(), b.up());
            let tie_a = std::mem::size_of::<T>() == 2;
            if (x < y) | (tie_a & (x == y)) | x.is_nan() {
                a
            } else {
                b
            }
        }),
        BinaryOp::Pow => run_map(lp, min, |a: T, b: T| T::down(a.up().powf(b.up()))),
    }
}

fn run_int<T: IntElement>(op: BinaryOp, lp: &StridedLoop<3>, min: usize) {
    match op {
        BinaryOp::Add => run_map(lp, min, T::add),
        BinaryOp::Sub => run_map(lp, min, T::wrapping_sub),
        BinaryOp::Mul => run_map(lp, min, T::wrapping_mul),
        BinaryOp::Maximum => run_map(lp, min, |a: T, b: T| a.max(b)),
        BinaryOp::Minimum => run_map(lp, min, |a: T, b: T| a.min(b)),
        BinaryOp::Pow => run_map(lp, min, T::wrapping_pow),
        BinaryOp::Div => unreachable!("`binary` rejects integer div before dispatch"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::broadcast::testing::*;
    use crate::PARALLEL_MIN_ELEMS;

    fn reference_float(op: BinaryOp, a: f64, b: f64) -> f64 {
        match op {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Maximum | BinaryOp::Minimum if a.is_nan() || b.is_nan() => f64::NAN,
            BinaryOp::Maximum => a.max(b),
            BinaryOp::Minimum => a.min(b),
            BinaryOp::Pow => a.powf(b),
        }
    }

    /// In i64 with wrapping, then truncated to the element width (the same result modulo 2^32).
    fn reference_int(op: BinaryOp, a: i64, b: i64) -> i64 {
        match op {
            BinaryOp::Add => a.wrapping_add(b),
            BinaryOp::Sub => a.wrapping_sub(b),
            BinaryOp::Mul => a.wrapping_mul(b),
            BinaryOp::Maximum => a.max(b),
            BinaryOp::Minimum => a.min(b),
            BinaryOp::Pow => (0..b).fold(1i64, |acc, _| acc.wrapping_mul(a)),
            BinaryOp::Div => unreachable!(),
        }
    }

    fn tolerance(op: BinaryOp, dtype: DType) -> (f64, f64) {
        match (op, dtype) {
            // powf in float32 vs float64 rounded: one ulp either way.
            (BinaryOp::Pow, DType::F32) => (2e-7, 1e-44),
            (BinaryOp::Pow, DType::F16) => (1e-3, 6e-8),
            _ => (0.0, 0.0),
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

    /// `which` = 0 for `a`, 1 for `b`: floats with signed zeros, infinities and NaN sprinkled
    /// in; ints near the extremes (wrapping), with small non-negative exponents for `pow`.
    fn values<T: Element>(op: BinaryOp, which: usize, n: usize) -> Vec<T> {
        (0..n)
            .map(|i| {
                let j = i * 7 + which * 3;
                if T::DTYPE.is_float() {
                    let special = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0];
                    if j % 13 < special.len() && j & 1 == 0 {
                        T::from_f64(special[j % 13])
                    } else {
                        T::from_f64(((j * 37) % 97) as f64 / 8.0 - 6.0)
                    }
                } else if op == BinaryOp::Pow && which == 1 {
                    T::from_i64((j % 13) as i64)
                } else {
                    let big = if T::DTYPE == DType::I32 { i32::MAX as i64 } else { i64::MAX };
                    match j % 9 {
                        0 => T::from_i64(big),
                        1 => T::from_i64(-big - 1),
                        2 => T::from_i64(big - 3),
                        _ => T::from_i64(((j * 2_654_435_761) % 2001) as i64 - 1000),
                    }
                }
            })
            .collect()
    }

    fn expected<T: Element>(op: BinaryOp, xs: &[T], ys: &[T]) -> Vec<f64> {
        xs.iter()
            .zip(ys)
            .map(|(&x, &y)| {
                if T::DTYPE.is_float() {
                    T::from_f64(reference_float(op, x.to_f64(), y.to_f64())).to_f64()
                } else {
                    T::from_i64(reference_int(op, x.to_i64(), y.to_i64())).to_i64() as f64
                }
            })
            .collect()
    }

    fn assert_matches<T: Element>(op: BinaryOp, got: &[T], want: &[f64], ctx: &dyn Fn() -> String) {
        assert_eq!(got.len(), want.len());
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            if T::DTYPE.is_float() {
                assert!(close(g.to_f64(), w, tolerance(op, T::DTYPE)), "{} at {i}: got {} want {w}", ctx(), g.to_f64());
            } else {
                assert_eq!(g.to_i64() as f64, w, "{} at {i}", ctx());
            }
        }
    }

    fn check<T: Element>(op: BinaryOp, a_shape: &[usize], b_shape: &[usize], layouts: [Layout; 3]) {
        let shape = broadcast::broadcast_shapes(&[a_shape, b_shape]).unwrap();
        let a = make(a_shape, layouts[0], &values::<T>(op, 0, a_shape.iter().product()));
        let b = make(b_shape, layouts[1], &values::<T>(op, 1, b_shape.iter().product()));
        let out = alloc(T::DTYPE, &shape, layouts[2]);
        let ctx = || format!("{op} {} {a_shape:?} x {b_shape:?} {layouts:?}", T::DTYPE);
        // SAFETY: test views cover their elements; `out` is disjoint from the inputs.
        let result = unsafe { binary(op, &a.view, &b.view, &out.view) };
        if op == BinaryOp::Div && !T::DTYPE.is_float() {
            assert!(result.is_err(), "{}", ctx());
            return;
        }
        result.unwrap();
        let xs = read::<T>(&broadcast::broadcast_view(&a.view, &shape));
        let ys = read::<T>(&broadcast::broadcast_view(&b.view, &shape));
        assert_matches(op, &read::<T>(&out.view), &expected(op, &xs, &ys), &ctx);
    }

    fn check_all<T: Element>() {
        let cases: [(&[usize], &[usize]); 8] = [
            (&[3, 1, 4], &[1, 5, 1]),
            (&[3, 5, 4], &[3, 5, 4]),
            (&[2, 3, 4], &[4]),
            (&[4], &[2, 3, 4]),
            (&[], &[]),
            (&[], &[6, 2]),
            (&[2, 0, 3], &[3]),
            (&[0], &[1]),
        ];
        for op in BinaryOp::ALL {
            for (a_shape, b_shape) in cases {
                for (i, &la) in LAYOUTS.iter().enumerate() {
                    let lb = LAYOUTS[(i + 2) % LAYOUTS.len()];
                    let lo = LAYOUTS[(i + 4) % LAYOUTS.len()];
                    check::<T>(op, a_shape, b_shape, [la, lb, lo]);
                }
            }
        }
    }

    #[test]
    fn float16_matches_reference() {
        check_all::<f16>();
    }

    #[test]
    fn float32_matches_reference() {
        check_all::<f32>();
    }

    #[test]
    fn float64_matches_reference() {
        check_all::<f64>();
    }

    #[test]
    fn int32_matches_reference() {
        check_all::<i32>();
    }

    #[test]
    fn int64_matches_reference() {
        check_all::<i64>();
    }

    #[test]
    fn around_the_parallel_threshold() {
        for n in [PARALLEL_MIN_ELEMS - 1, PARALLEL_MIN_ELEMS, PARALLEL_MIN_ELEMS + 37] {
            let c = Layout::Contiguous;
            check::<f32>(BinaryOp::Add, &[n], &[n], [c, c, c]);
            check::<f64>(BinaryOp::Maximum, &[n], &[1], [Layout::Reversed, c, c]);
            check::<i32>(BinaryOp::Mul, &[n], &[n], [c, Layout::Stepped, c]);
            check::<f16>(BinaryOp::Sub, &[n], &[n], [c, c, Layout::Reversed]);
        }
        // Rows of 67 split mid-row between tasks; broadcast and permuted operands.
        let rows = PARALLEL_MIN_ELEMS / 67 + 3;
        check::<f32>(BinaryOp::Div, &[rows, 67], &[67], [Layout::Fortran, Layout::Contiguous, Layout::Padded]);
        check::<i64>(BinaryOp::Pow, &[rows, 1], &[1, 67], [Layout::Contiguous, Layout::Reversed, Layout::Contiguous]);
        check::<f64>(BinaryOp::Pow, &[rows, 67], &[rows, 67], [Layout::Padded, Layout::Stepped, Layout::Fortran]);
    }

    /// `out` exactly `a`, exactly `b`, or both, in every layout, small and parallel.
    #[test]
    fn in_place() {
        fn run<T: Element>(op: BinaryOp) {
            for layout in LAYOUTS {
                for (shape, other_shape) in [(&[5usize, 7][..], &[7usize][..]), (&[PARALLEL_MIN_ELEMS + 5], &[1])] {
                    let n = shape.iter().product();
                    let xs = values::<T>(op, 0, n);
                    let ys = values::<T>(op, 1, n);
                    let ctx = || format!("{op} {} {layout:?} {shape:?}", T::DTYPE);

                    // out is a, b broadcast.
                    let a = make(shape, layout, &xs);
                    let b = make(other_shape, Layout::Contiguous, &ys[..other_shape.iter().product()]);
                    let b_full = read::<T>(&broadcast::broadcast_view(&b.view, shape));
                    // SAFETY: `out` is exactly `a`, disjoint from `b`.
                    unsafe { binary(op, &a.view, &b.view, &a.view) }.unwrap();
                    assert_matches(op, &read::<T>(&a.view), &expected(op, &xs, &b_full), &ctx);

                    // out is b.
                    let a = make(shape, Layout::Contiguous, &xs);
                    let b = make(shape, layout, &ys);
                    // SAFETY: `out` is exactly `b`.
                    unsafe { binary(op, &a.view, &b.view, &b.view) }.unwrap();
                    assert_matches(op, &read::<T>(&b.view), &expected(op, &xs, &ys), &ctx);

                    // out is a and b.
                    let a = make(shape, layout, &ys);
                    // SAFETY: `out` is exactly both inputs.
                    unsafe { binary(op, &a.view, &a.view, &a.view) }.unwrap();
                    assert_matches(op, &read::<T>(&a.view), &expected(op, &ys, &ys), &ctx);
                }
            }
        }
        for op in [BinaryOp::Sub, BinaryOp::Pow, BinaryOp::Maximum] {
            run::<f32>(op);
            run::<i64>(op);
        }
        run::<f16>(BinaryOp::Div);
        run::<i32>(BinaryOp::Mul);
    }

    fn eval<T: Element>(op: BinaryOp, xs: &[T], ys: &[T]) -> Result<Vec<T>, KernelError> {
        let a = make(&[xs.len()], Layout::Contiguous, xs);
        let b = make(&[ys.len()], Layout::Contiguous, ys);
        let out = alloc(T::DTYPE, &[xs.len().max(ys.len())], Layout::Contiguous);
        // SAFETY: test views, disjoint.
        unsafe { binary(op, &a.view, &b.view, &out.view) }?;
        Ok(read(&out.view))
    }

    #[test]
    fn numpy_special_values() {
        let nan = f64::NAN;
        let max = eval(BinaryOp::Maximum, &[nan, 1.0, 2.0], &[1.0, nan, 1.0]).unwrap();
        assert!(max[0].is_nan() && max[1].is_nan());
        assert_eq!(max[2], 2.0);
        let min = eval(BinaryOp::Minimum, &[f32::NAN, 1.0, 2.0], &[1.0, f32::NAN, 1.0]).unwrap();
        assert!(min[0].is_nan() && min[1].is_nan());
        assert_eq!(min[2], 1.0);
        let div = eval(BinaryOp::Div, &[1.0, -1.0, 0.0], &[0.0, 0.0, 0.0]).unwrap();
        assert_eq!(div[..2], [f64::INFINITY, f64::NEG_INFINITY]);
        assert!(div[2].is_nan());
        assert_eq!(eval(BinaryOp::Add, &[i32::MAX], &[1]).unwrap(), [i32::MIN]);
        assert_eq!(eval(BinaryOp::Mul, &[i64::MAX], &[2]).unwrap(), [-2]);
        assert_eq!(
            eval(BinaryOp::Pow, &[2i32, 0, -3, 3], &[31, 0, 3, 40]).unwrap(),
            [i32::MIN, 1, -27, 3i32.wrapping_pow(40)]
        );
        // 3^(2^63 - 1) = prod of 3^(2^k), k < 63, modulo 2^64; and 3^(2^62) == 1 modulo 2^64.
        let want = (0..63).fold((1i64, 3i64), |(acc, base), _| (acc.wrapping_mul(base), base.wrapping_mul(base))).0;
        assert_eq!(eval(BinaryOp::Pow, &[3i64, 3], &[i64::MAX, 1 << 62]).unwrap(), [want, 1]);
        assert_eq!(eval(BinaryOp::Pow, &[1i32], &[-1]).unwrap_err().to_string(), NEGATIVE_INT_POWER);
        assert_eq!(eval(BinaryOp::Pow, &[2.0f32], &[-1.0]).unwrap(), [0.5]);
        let h = |v: f32| f16::from_f32(v);
        assert_eq!(eval(BinaryOp::Mul, &[h(300.0)], &[h(300.0)]).unwrap(), [f16::INFINITY]);
        assert_eq!(eval(BinaryOp::Pow, &[h(2.0)], &[h(-2.0)]).unwrap(), [h(0.25)]);
    }

    #[test]
    fn negative_exponent_is_checked_before_writing() {
        let a = make(&[4], Layout::Contiguous, &[1i64, 2, 3, 4]);
        let b = make(&[4], Layout::Contiguous, &[2i64, 2, -1, 2]);
        // SAFETY: `out` is exactly `b`.
        let err = unsafe { binary(BinaryOp::Pow, &a.view, &b.view, &b.view) }.unwrap_err();
        assert_eq!(err, KernelError::NegativeIntPower);
        assert_eq!(err.to_string(), NEGATIVE_INT_POWER);
        assert_eq!(read::<i64>(&b.view), [2, 2, -1, 2]);
    }

    #[test]
    fn result_dtypes() {
        use DType::*;
        assert_eq!(binary_result_dtype(BinaryOp::Div, I32, I32), F64);
        assert_eq!(binary_result_dtype(BinaryOp::Div, I32, I64), F64);
        assert_eq!(binary_result_dtype(BinaryOp::Div, F16, F16), F16);
        assert_eq!(binary_result_dtype(BinaryOp::Div, F32, I32), F64);
        assert_eq!(binary_result_dtype(BinaryOp::Pow, I32, I32), I32);
        assert_eq!(binary_result_dtype(BinaryOp::Add, F16, F32), F32);
        assert_eq!(binary_result_dtype(BinaryOp::Maximum, I32, I64), I64);
        for op in BinaryOp::ALL {
            assert_eq!(BinaryOp::from_name(op.name()), Some(op));
        }
    }

    #[test]
    fn argument_errors() {
        let a = make(&[3], Layout::Contiguous, &[1.0f32, 2.0, 3.0]);
        let b = make(&[4], Layout::Contiguous, &[1.0f32; 4]);
        let out = alloc(DType::F32, &[3], Layout::Contiguous);
        let out64 = alloc(DType::F64, &[3], Layout::Contiguous);
        let ints = make(&[3], Layout::Contiguous, &[1i32, 2, 3]);
        // SAFETY: every call fails its checks before touching memory.
        unsafe {
            assert!(binary(BinaryOp::Add, &a.view, &b.view, &out.view).unwrap_err().to_string().contains("(4,)"));
            assert!(binary(BinaryOp::Add, &a.view, &a.view, &out64.view).unwrap_err().to_string().contains("float64"));
            assert!(binary(BinaryOp::Div, &ints.view, &ints.view, &ints.view)
                .unwrap_err()
                .to_string()
                .contains("float64"));
            let repeated = broadcast::broadcast_view(&a.view, &[2, 3]);
            assert!(binary(BinaryOp::Add, &a.view, &a.view, &repeated).unwrap_err().to_string().contains("stride-0"));
        }
    }
}
