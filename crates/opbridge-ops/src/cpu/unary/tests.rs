//! Tests of the unary operators over strided views: every op and dtype against float64
//! reference formulas, layouts, broadcasting, in place, around the parallel thresholds,
//! numpy's special values and result dtypes, and the argument errors.
#![allow(unsafe_code)] // the tests call the kernels on buffers they own.

use super::*;
use crate::cpu::broadcast::testing::*;
use crate::cpu::thresholds::TRANSCENDENTAL_PARALLEL_MIN_ELEMS;
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
        assert!(unary(UnaryOp::Exp, &x.view, &out64.view).unwrap_err().to_string().contains("float64"));
        assert!(unary(UnaryOp::Exp, &x.view, &out_wide.view).unwrap_err().to_string().contains("(2, 4)"));
        let repeated = broadcast::broadcast_view(&x.view, &[2, 3]);
        assert!(unary(UnaryOp::Exp, &x.view, &repeated).unwrap_err().to_string().contains("stride-0"));
    }
}

#[test]
fn f16_neg_and_abs_flip_and_clear_the_sign_bit_of_every_value() {
    // numpy's `npy_half_neg` / `npy_half_abs`: NaN payloads (signalling ones too) kept.
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let neg = eval(UnaryOp::Neg, &all);
    let abs = eval(UnaryOp::Abs, &all);
    for ((x, n), a) in all.iter().zip(neg).zip(abs) {
        assert_eq!(n.to_bits(), x.to_bits() ^ 0x8000, "neg({x})");
        assert_eq!(a.to_bits(), x.to_bits() & 0x7fff, "abs({x})");
    }
}

/// The float16 tables give the bits the computed path gives, for every input (NaN payloads
/// included) and every op that has one: the long run looks them up (in shuffled order, an odd
/// length for the gather's tail, and in place), the short runs compute them.
#[test]
fn f16_table_lookups_equal_the_computed_results_for_every_input() {
    // Every bit pattern twice, scrambled by a multiplier coprime to 2^16, plus a tail of 7.
    let inputs: Vec<u16> = (0..(1u32 << 17) + 7).map(|i| (i.wrapping_mul(40_503) & 0xffff) as u16).collect();
    for op in UnaryOp::ALL.into_iter().filter(|op| !matches!(op, UnaryOp::Neg | UnaryOp::Abs)) {
        let mut looked_up: Vec<f16> = inputs.iter().map(|&b| f16::from_bits(b)).collect();
        assert!(looked_up.len() >= F16_TABLE_MIN);
        let p = looked_up.as_mut_ptr();
        // SAFETY: one run of `looked_up.len()` elements, computed in place.
        unsafe { f16_contiguous(op, p, p, looked_up.len()) };
        for (chunk, got) in inputs.chunks(F16_TABLE_MIN - 1).zip(looked_up.chunks(F16_TABLE_MIN - 1)) {
            let x: Vec<f16> = chunk.iter().map(|&b| f16::from_bits(b)).collect();
            let mut want = vec![f16::ZERO; x.len()];
            // SAFETY: `x.len()` elements each way, disjoint; below the table's length.
            unsafe { f16_contiguous(op, x.as_ptr(), want.as_mut_ptr(), x.len()) };
            for ((x, got), want) in x.iter().zip(got).zip(&want) {
                assert_eq!(got.to_bits(), want.to_bits(), "{op}({x:?} = {:#06x})", x.to_bits());
            }
        }
    }
}
