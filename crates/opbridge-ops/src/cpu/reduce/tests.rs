//! Tests of the reductions against float64 references computed from the definitions: every
//! operator, dtype, axis and `keepdims`, strided/transposed/reversed/broadcast inputs, every
//! parallel path, NaN and inf, empty reductions, numpy's errors and accuracy of the sums.
#![allow(unsafe_code)] // the tests call the kernels on buffers they own.

use super::*;
use crate::cpu::Element;

/// Deterministic test data: small integers (exact in every dtype), some negative.
fn data<T: Element>(n: usize, seed: usize) -> Vec<T> {
    (0..n).map(|i| T::from_f64(((i * 7919 + seed * 104_729) % 23) as f64 - 11.0)).collect()
}

/// A view of `v` with element 0 at `v[offset]`.
fn view<T: Element>(v: &[T], shape: &[usize], strides: &[isize], offset: isize) -> TensorView {
    TensorView {
        data: v.as_ptr().wrapping_offset(offset) as usize,
        dtype: T::DTYPE,
        shape: shape.into(),
        strides: strides.into(),
    }
}

fn input<T: Element>(v: &[T], shape: &[usize]) -> TensorView {
    TensorView::contiguous(v.as_ptr() as usize, T::DTYPE, shape)
}

fn output<T: Element>(v: &mut [T], shape: &[usize]) -> TensorView {
    TensorView::contiguous(v.as_mut_ptr() as usize, T::DTYPE, shape)
}

/// Reads element `i` of a buffer holding elements of `dtype` as f64.
fn read(buf: &[u64], dtype: DType, i: usize) -> f64 {
    crate::with_dtype!(dtype, T => {
        assert!((i + 1) * std::mem::size_of::<T>() <= buf.len() * 8);
        // SAFETY: checked just above to be inside the buffer.
        unsafe { (*(buf.as_ptr() as *const T).add(i)).to_f64() }
    })
}

/// Reads the element at multi-index `idx` of a view as f64.
fn read_view(v: &TensorView, idx: &[usize]) -> f64 {
    let off: isize = idx.iter().zip(&v.strides).map(|(&i, &s)| i as isize * s).sum();
    crate::with_dtype!(v.dtype, T => {
        // SAFETY: the index is inside a view the test built over live memory.
        unsafe { (*(v.data as *const T).offset(off)).to_f64() }
    })
}

fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}

/// Scalar reference for `op` over the values of one output, in logical order.
fn reference(op: ReduceOp, vals: &[f64]) -> f64 {
    let nan = vals.iter().position(|x| x.is_nan());
    match op {
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Mean => vals.iter().sum::<f64>() / vals.len() as f64,
        ReduceOp::Max if nan.is_some() => f64::NAN,
        ReduceOp::Min if nan.is_some() => f64::NAN,
        ReduceOp::Max => vals.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Min => vals.iter().copied().fold(f64::INFINITY, f64::min),
        ReduceOp::ArgMax => nan.unwrap_or_else(|| {
            let mut best = 0;
            for (i, &x) in vals.iter().enumerate() {
                if x > vals[best] {
                    best = i;
                }
            }
            best
        }) as f64,
    }
}

fn tolerance(op: ReduceOp, dtype: DType) -> f64 {
    match (op, dtype) {
        (ReduceOp::Sum | ReduceOp::Mean, DType::F16) => 2e-3,
        (ReduceOp::Sum | ReduceOp::Mean, DType::F32) => 1e-6,
        (ReduceOp::Sum | ReduceOp::Mean, _) => 1e-12,
        _ => 0.0,
    }
}

fn close(got: f64, want: f64, tol: f64) -> bool {
    (got.is_nan() && want.is_nan()) || got == want || (got - want).abs() <= tol * want.abs().max(1.0)
}

/// Runs `op` on `x` over `axis` and compares every output with the scalar reference.
fn check_keepdims(op: ReduceOp, x: &TensorView, axis: Option<isize>, keepdims: bool) {
    let out_dtype = reduce_result_dtype(op, x.dtype);
    let out_shape = reduce_shape(&x.shape, axis, keepdims).unwrap();
    let count: usize = out_shape.iter().product();
    let mut buf = vec![0u64; count.max(1)];
    let out = TensorView::contiguous(buf.as_mut_ptr() as usize, out_dtype, &out_shape);
    // SAFETY: views over live test buffers; `out` is disjoint from `x`.
    unsafe { reduce(op, x, axis, &out) }.unwrap();
    let ndim = x.ndim();
    let axis = axis.map(|a| normalize_axis(a, ndim).unwrap());
    let kept: Vec<usize> = (0..ndim).filter(|&d| axis.is_some_and(|a| a != d)).collect();
    let kept_shape: Vec<usize> = kept.iter().map(|&d| x.shape[d]).collect();
    for o in 0..count {
        let oidx = unravel(o, &kept_shape);
        let vals: Vec<f64> = match axis {
            None => (0..x.numel()).map(|i| read_view(x, &unravel(i, &x.shape))).collect(),
            Some(a) => {
                let mut idx = vec![0; ndim];
                for (k, &d) in kept.iter().enumerate() {
                    idx[d] = oidx[k];
                }
                (0..x.shape[a])
                    .map(|r| {
                        idx[a] = r;
                        read_view(x, &idx)
                    })
                    .collect()
            }
        };
        let want = reference(op, &vals);
        let got = read(&buf, out_dtype, o);
        assert!(
            close(got, want, tolerance(op, x.dtype)),
            "{op:?} {} shape {:?} strides {:?} axis {axis:?} keepdims {keepdims} output {o}: got {got}, want {want}",
            x.dtype,
            x.shape,
            x.strides,
        );
    }
}

fn check(op: ReduceOp, x: &TensorView, axis: Option<isize>) {
    check_keepdims(op, x, axis, false);
    check_keepdims(op, x, axis, true);
}

fn check_all_axes(x: &TensorView) {
    let ndim = x.ndim() as isize;
    let mut axes: Vec<Option<isize>> = vec![None];
    axes.extend((-ndim..ndim).map(Some));
    for op in ReduceOp::ALL {
        for &axis in &axes {
            check(op, x, axis);
        }
    }
}

#[test]
fn shapes_and_axis_errors() {
    assert_eq!(reduce_shape(&[2, 3, 4], Some(1), false).unwrap(), vec![2, 4]);
    assert_eq!(reduce_shape(&[2, 3, 4], Some(-1), true).unwrap(), vec![2, 3, 1]);
    assert_eq!(reduce_shape(&[2, 3, 4], None, true).unwrap(), vec![1, 1, 1]);
    assert_eq!(reduce_shape(&[2, 3, 4], None, false).unwrap(), Vec::<usize>::new());
    assert_eq!(reduce_shape(&[], None, false).unwrap(), Vec::<usize>::new());
    assert_eq!(
        reduce_shape(&[3], Some(1), false).unwrap_err().to_string(),
        "axis 1 is out of bounds for array of dimension 1"
    );
    assert_eq!(
        reduce_shape(&[3], Some(-2), true).unwrap_err().to_string(),
        "axis -2 is out of bounds for array of dimension 1"
    );
    assert_eq!(
        reduce_shape(&[], Some(0), true).unwrap_err().to_string(),
        "axis 0 is out of bounds for array of dimension 0"
    );
}

#[test]
fn result_dtypes_follow_numpy() {
    use DType::*;
    use ReduceOp::*;
    let cases = [
        (Sum, I32, I64),
        (Sum, I64, I64),
        (Sum, F16, F16),
        (Sum, F32, F32),
        (Sum, F64, F64),
        (Mean, I32, F64),
        (Mean, I64, F64),
        (Mean, F16, F16),
        (Mean, F32, F32),
        (Max, I32, I32),
        (Min, F16, F16),
        (ArgMax, F32, I64),
        (ArgMax, I32, I64),
    ];
    for (op, input, want) in cases {
        assert_eq!(reduce_result_dtype(op, input), want, "{op:?} {input}");
    }
}

#[test]
fn contiguous_every_dtype_axis_and_keepdims() {
    for dtype in DType::ALL {
        crate::with_dtype!(dtype, T => {
            let v = data::<T>(2 * 3 * 4, 1);
            check_all_axes(&input(&v, &[2, 3, 4]));
            let v = data::<T>(2000, 2);
            check_all_axes(&input(&v, &[2000]));
            check_all_axes(&input(&v[..37], &[37]));
            // Wide enough for the column path (axis 0 of 5 x 40).
            let v = data::<T>(5 * 40, 3);
            check_all_axes(&input(&v, &[5, 40]));
            check_all_axes(&input(&v, &[1, 200]));
            check_all_axes(&input(&v[..1], &[]));
            check_all_axes(&input(&v[..1], &[1, 1]));
        })
    }
}

#[test]
fn strided_transposed_reversed_and_broadcast_inputs() {
    for dtype in DType::ALL {
        crate::with_dtype!(dtype, T => {
            let v = data::<T>(6 * 40, 4);
            // Transposed (40, 6) view of a (6, 40) array.
            check_all_axes(&view(&v, &[40, 6], &[1, 40], 0));
            // Rows 5, 3, 1 (reversed) and every other column.
            check_all_axes(&view(&v, &[3, 20], &[-80, 2], 5 * 40));
            // Reversed columns.
            check_all_axes(&view(&v, &[6, 40], &[40, -1], 39));
            // A broadcast dimension.
            check_all_axes(&view(&v, &[4, 3, 40], &[0, 80, 1], 0));
            // A 3-D permutation.
            check_all_axes(&view(&v, &[4, 6, 10], &[10, 40, 1], 0));
            // A long strided line (gathered in blocks).
            let v = data::<T>(3 * 1500, 5);
            check_all_axes(&view(&v, &[1500], &[3], 0));
        })
    }
}

#[test]
fn large_inputs_use_every_parallel_path() {
    let v = data::<f32>(300_000, 5);
    let w = data::<i64>(300_000, 6);
    let h = data::<f16>(300_000, 7);
    let layouts: [(&[usize], &[isize]); 6] = [
        (&[300_000], &[1]),
        (&[4, 75_000], &[75_000, 1]), // few long lines
        (&[1000, 300], &[300, 1]),    // many lines
        (&[600, 500], &[500, 1]),     // axis 0: many column tasks
        (&[7500, 40], &[40, 1]),      // axis 0: one tall column task
        (&[500, 600], &[1, 500]),     // transposed
    ];
    for (shape, strides) in layouts {
        for op in ReduceOp::ALL {
            for axis in [None, Some(0), Some(-1)] {
                check_keepdims(op, &view(&v, shape, strides, 0), axis, false);
                check_keepdims(op, &view(&w, shape, strides, 0), axis, false);
            }
        }
        check_keepdims(ReduceOp::Sum, &view(&h, shape, strides, 0), Some(0), false);
    }
}

#[test]
fn argmax_returns_the_first_maximum_and_the_first_nan() {
    let mut v = vec![1.0f32; 300_000];
    for i in [70_000, 140_000, 290_000] {
        v[i] = 5.0;
    }
    let mut out = [0i64];
    let o = output(&mut out, &[]);
    let argmax = |x: &TensorView| {
        // SAFETY: views over live buffers; `out` is disjoint from `v`.
        unsafe { reduce(ReduceOp::ArgMax, x, None, &o) }.unwrap();
        // SAFETY: `o` points to `out`, written above.
        unsafe { *(o.data as *const i64) }
    };
    assert_eq!(argmax(&input(&v, &[300_000])), 70_000);
    v[200_000] = f32::NAN;
    v[250_000] = f32::NAN;
    assert_eq!(argmax(&input(&v, &[300_000])), 200_000);
    // Transposed: the index is into the row-major flattening of the view.
    let flat = |i: usize| ((i % 1000) * 300 + i / 1000) as i64;
    assert_eq!(argmax(&view(&v, &[1000, 300], &[1, 1000], 0)), flat(200_000).min(flat(250_000)));
}

#[test]
fn nan_and_inf_follow_numpy() {
    let nan = f64::NAN;
    let inf = f64::INFINITY;
    let rows: [&[f64]; 6] = [
        &[1.0, nan, 3.0, nan],
        &[1.0, inf, -inf],
        &[-inf, -inf],
        &[nan, 1.0, 2.0],
        &[inf, 1.0, inf],
        &[-0.0, 0.0, -1.0],
    ];
    for row in rows {
        for dtype in [DType::F16, DType::F32, DType::F64] {
            crate::with_dtype!(dtype, T => {
                let v: Vec<T> = row.iter().map(|&x| T::from_f64(x)).collect();
                for op in ReduceOp::ALL {
                    check(op, &input(&v, &[v.len()]), None);
                }
                // The same values down columns (the column path) and along long lines.
                let wide: Vec<T> = row.iter().flat_map(|&x| std::iter::repeat_n(T::from_f64(x), 20)).collect();
                for op in ReduceOp::ALL {
                    check(op, &input(&wide, &[row.len(), 20]), Some(0));
                    check(op, &input(&wide, &[row.len() * 20]), None);
                }
            })
        }
    }
}

#[test]
fn empty_reductions() {
    let v: Vec<f32> = Vec::new();
    let x = input(&v, &[0, 3]);
    let mut o32 = [7.0f32; 3];
    let mut o64 = [7i64; 3];
    for (op, want) in [(ReduceOp::Sum, 0.0), (ReduceOp::Mean, f64::NAN)] {
        let o = output(&mut o32, &[3]);
        // SAFETY: views over live buffers.
        unsafe { reduce(op, &x, Some(0), &o) }.unwrap();
        assert!(o32.iter().all(|&g| close(g as f64, want, 0.0)), "{op:?}: {o32:?}");
    }
    let o = output(&mut o32, &[3]);
    for (op, message) in [
        (ReduceOp::Max, "zero-size array to reduction operation maximum which has no identity"),
        (ReduceOp::Min, "zero-size array to reduction operation minimum which has no identity"),
    ] {
        // SAFETY: as above.
        assert_eq!(unsafe { reduce(op, &x, Some(0), &o) }.unwrap_err(), KernelError::EmptyReduction(message));
    }
    let oi = output(&mut o64, &[3]);
    // SAFETY: as above.
    let err = unsafe { reduce(ReduceOp::ArgMax, &x, Some(0), &oi) }.unwrap_err();
    assert_eq!(err.to_string(), "attempt to get argmax of an empty sequence");
    // SAFETY: as above.
    let err = unsafe { reduce(ReduceOp::ArgMax, &x, None, &output(&mut o64, &[])) }.unwrap_err();
    assert_eq!(err.to_string(), "attempt to get argmax of an empty sequence");
    // Reducing an empty axis is numpy's error even into nothing; a non-empty axis into
    // nothing is fine.
    let o0 = output(&mut o32, &[0]);
    // SAFETY: as above.
    assert!(unsafe { reduce(ReduceOp::Max, &input(&v, &[0, 0]), Some(0), &o0) }.is_err());
    // SAFETY: as above.
    unsafe { reduce(ReduceOp::Max, &input(&v, &[3, 0]), Some(0), &o0) }.unwrap();
    // SAFETY: as above.
    unsafe { reduce(ReduceOp::Max, &x, Some(1), &o0) }.unwrap();
    // Sum over all of an empty array.
    o32[0] = 7.0;
    // SAFETY: as above.
    unsafe { reduce(ReduceOp::Sum, &x, None, &output(&mut o32, &[])) }.unwrap();
    assert_eq!(o32[0], 0.0);
}

#[test]
fn argument_errors() {
    let v = data::<f32>(6, 0);
    let x = input(&v, &[2, 3]);
    let mut o64 = [0f64; 3];
    let mut o32 = [0f32; 2];
    // SAFETY: validation fails before anything is read or written.
    let err = unsafe { reduce(ReduceOp::Sum, &x, Some(0), &output(&mut o64, &[3])) }.unwrap_err();
    assert_eq!(err, KernelError::ResultDType { expected: DType::F32, input: DType::F32, got: DType::F64 });
    assert_eq!(err.to_string(), "out must have dtype float32 for float32 input, got float64");
    // SAFETY: as above.
    let err = unsafe { reduce(ReduceOp::Sum, &x, Some(0), &output(&mut o32, &[2])) }.unwrap_err();
    assert_eq!(err.kind(), crate::error::ErrorKind::Shape);
    assert_eq!(err.to_string(), "out must have shape [3] (or [1, 3] with keepdims), got [2]");
    // SAFETY: as above.
    let err = unsafe { reduce(ReduceOp::Max, &x, Some(2), &output(&mut o32, &[2])) }.unwrap_err();
    assert_eq!(err, KernelError::Axis { axis: 2, ndim: 2 });
    assert_eq!(err.to_string(), "axis 2 is out of bounds for array of dimension 2");
    let bad = TensorView { strides: smallvec::smallvec![1], ..x.clone() };
    // SAFETY: as above.
    assert!(unsafe { reduce(ReduceOp::Max, &bad, None, &output(&mut o32[..1], &[])) }.is_err());
}

#[test]
fn strided_output() {
    let v = data::<f64>(12, 3);
    let mut out = [0f64; 8];
    // Every other element of `out`, reversed.
    let o = TensorView {
        data: out.as_mut_ptr().wrapping_add(6) as usize,
        dtype: DType::F64,
        shape: smallvec::smallvec![4],
        strides: smallvec::smallvec![-2],
    };
    // SAFETY: views over live buffers, disjoint.
    unsafe { reduce(ReduceOp::Sum, &input(&v, &[3, 4]), Some(0), &o) }.unwrap();
    for c in 0..4 {
        let want: f64 = (0..3).map(|r| v[r * 4 + c]).sum();
        assert_eq!(out[6 - 2 * c], want);
    }
}

#[test]
fn int_sums_widen_and_wrap_in_int64() {
    let mut out = [0i64];
    let v = vec![i32::MAX; 3];
    // SAFETY: views over live buffers.
    unsafe { reduce(ReduceOp::Sum, &input(&v, &[3]), None, &output(&mut out, &[])) }.unwrap();
    assert_eq!(out[0], 3 * i32::MAX as i64);
    let v = vec![i64::MAX, 2];
    // SAFETY: as above.
    unsafe { reduce(ReduceOp::Sum, &input(&v, &[2]), None, &output(&mut out, &[])) }.unwrap();
    assert_eq!(out[0], i64::MIN + 1);
    let mut mean = [0f64];
    let v = vec![i64::MAX, i64::MAX];
    // SAFETY: as above.
    unsafe { reduce(ReduceOp::Mean, &input(&v, &[2]), None, &output(&mut mean, &[])) }.unwrap();
    assert_eq!(mean[0], i64::MAX as f64);
}

#[test]
fn float_sums_are_accurate() {
    // 0.1 is inexact in binary: naive float32 summation of a million drifts by ~1e-3.
    let v = vec![0.1f32; 1_000_000];
    let mut out = [0f32];
    // SAFETY: views over live buffers.
    unsafe { reduce(ReduceOp::Sum, &input(&v, &[1_000_000]), None, &output(&mut out, &[])) }.unwrap();
    let want = 0.1f32 as f64 * 1e6;
    assert!((out[0] as f64 - want).abs() / want < 1e-7, "{}", out[0]);
    let v = vec![f16::from_f32(0.1); 10_000];
    let mut out16 = [f16::ZERO];
    // SAFETY: as above.
    unsafe { reduce(ReduceOp::Mean, &input(&v, &[10_000]), None, &output(&mut out16, &[])) }.unwrap();
    assert_eq!(out16[0], f16::from_f32(0.1));
    // Pairwise float64: 1 + many tiny values that a naive loop would lose in part.
    let mut v = vec![1e-16f64; 1 << 20];
    v[0] = 1.0;
    let mut out64 = [0f64];
    // SAFETY: as above.
    unsafe { reduce(ReduceOp::Sum, &input(&v, &[1 << 20]), None, &output(&mut out64, &[])) }.unwrap();
    let want = 1.0 + 1e-16 * ((1 << 20) - 1) as f64;
    assert!((out64[0] - want).abs() < 1e-15, "{} vs {want}", out64[0]);
}

/// The sign of `max`/`min` over `x` (1-D, contiguous), as the kernel gives it.
fn extreme_sign<T: Element>(op: ReduceOp, x: &[T]) -> bool {
    let mut out = [T::from_f64(1.0)];
    // SAFETY: a contiguous input and a one-element output, both owned here.
    unsafe { reduce(op, &input(x, &[x.len()]), None, &output(&mut out, &[])) }.unwrap();
    out[0].to_f64().is_sign_negative()
}

/// One zero of the other sign among `n`: the position whose sign numpy returns, measured with
/// numpy 2 (AVX-512): its 64-byte lanes decide float32/64, the first zero decides float16.
#[test]
fn zero_results_take_the_sign_numpy_gives_them() {
    fn winner<T: Element>(op: ReduceOp, n: usize) -> Option<usize> {
        let (base, odd) = if op == ReduceOp::Max { (-0.0, 0.0) } else { (0.0, -0.0) };
        let decides = (0..n).filter(|&k| {
            let mut x = vec![T::from_f64(base); n];
            x[k] = T::from_f64(odd);
            extreme_sign(op, &x) == f64::is_sign_negative(odd)
        });
        let found: Vec<usize> = decides.collect();
        assert!(found.len() <= 1, "{found:?}");
        found.first().copied()
    }
    for op in [ReduceOp::Max, ReduceOp::Min] {
        // float32: x[0] broadcast, x[1..17] one vector folded as `_mm512_reduce_max_ps`: lane 3.
        assert_eq!(winner::<f32>(op, 17), Some(4));
        assert_eq!(winner::<f32>(op, 18), Some(17), "the scalar tail takes a tie");
        assert_eq!(winner::<f32>(op, 5), Some(4), "short: the last element");
        assert_eq!(winner::<f32>(op, 33), Some(20));
        // float64: 8 lanes, lane 1.
        assert_eq!(winner::<f64>(op, 9), Some(2));
        assert_eq!(winner::<f64>(op, 10), Some(9));
        // float16: the first zero wins, so a single odd one decides only in front.
        assert_eq!(winner::<f16>(op, 40), Some(0));
    }
    // A result that is not zero is untouched, and NaN still wins.
    assert!(!extreme_sign(ReduceOp::Max, &[-0.0f32, 1.0, 0.0]));
    let mut out = [0f32];
    // SAFETY: as in `extreme_sign`.
    unsafe { reduce(ReduceOp::Max, &input(&[-0.0f32, f32::NAN, 0.0], &[3]), None, &output(&mut out, &[])) }.unwrap();
    assert!(out[0].is_nan());
}

/// The AVX-512 max/min kernel gives the value the portable loop gives on every length (its
/// 8-vector blocks, single vectors and masked tail), and leaves every run with a NaN, wherever
/// the NaN is, to that loop.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_extreme_matches_the_portable_loop_and_declines_nan() {
    use super::extreme_avx512::FastExtreme;
    use std::arch::is_x86_feature_detected as has;
    if !(has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq")) {
        return;
    }
    fn check<T: FastExtreme + Element + PartialEq + std::fmt::Debug>(len: usize) {
        let xs: Vec<T> = (0..len).map(|i| T::from_f64(((i * 7919) % 1009) as f64 - 504.5)).collect();
        let max = xs.iter().map(|x| x.to_f64()).fold(f64::NEG_INFINITY, f64::max);
        let min = xs.iter().map(|x| x.to_f64()).fold(f64::INFINITY, f64::min);
        assert_eq!(T::fast_extreme::<true>(&xs).map(|v| v.to_f64()), Some(max), "max of {len}");
        assert_eq!(T::fast_extreme::<false>(&xs).map(|v| v.to_f64()), Some(min), "min of {len}");
        for at in [0, len / 2, len - 1] {
            let mut with_nan = xs.clone();
            with_nan[at] = T::from_f64(f64::NAN);
            assert_eq!(T::fast_extreme::<true>(&with_nan), None, "NaN at {at} of {len}");
            assert_eq!(T::fast_extreme::<false>(&with_nan), None, "NaN at {at} of {len}");
        }
    }
    for len in (1..300).chain([1023, 1024, 1025, 4099]) {
        check::<f32>(len);
        check::<f64>(len);
    }
    assert_eq!(<f32 as FastExtreme>::fast_extreme::<true>(&[]), None);
    let inf = [1.0f32, f32::INFINITY, f32::NEG_INFINITY];
    assert_eq!(
        (f32::fast_extreme::<true>(&inf), f32::fast_extreme::<false>(&inf)),
        (Some(f32::INFINITY), Some(f32::NEG_INFINITY))
    );
}

/// The one-pass AVX-512 argmax gives numpy's answer (the first index of the maximum, `-0.0`
/// and `0.0` equal) on every length and layout of ties, and leaves runs with a NaN to the
/// portable path.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_argmax_finds_the_first_maximum_and_declines_nan() {
    use super::extreme_avx512::FastExtreme;
    use std::arch::is_x86_feature_detected as has;
    if !(has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq")) {
        return;
    }
    fn first_max(xs: &[f64]) -> usize {
        let mut at = 0;
        for (i, &x) in xs.iter().enumerate() {
            if x > xs[at] {
                at = i;
            }
        }
        at
    }
    fn check<T: FastExtreme + Element + std::fmt::Debug>(xs: &[f64], what: &str) {
        let ts: Vec<T> = xs.iter().map(|&x| T::from_f64(x)).collect();
        assert_eq!(T::fast_argmax(&ts), Some(first_max(xs)), "{what}, {} elements", xs.len());
    }
    for len in (1..300).chain([1023, 1024, 1025, 4099]) {
        // Few distinct values: the maximum repeats in many lanes and accumulators.
        let xs: Vec<f64> = (0..len).map(|i| ((i * 7919) % 13) as f64 - 6.0).collect();
        check::<f32>(&xs, "repeated maxima");
        check::<f64>(&xs, "repeated maxima");
        // One maximum at each end and in the middle, in the blocks and in the tail.
        for at in [0, len / 2, len - 1] {
            let mut one = xs.clone();
            one[at] = 100.0;
            check::<f32>(&one, "single maximum");
            check::<f64>(&one, "single maximum");
        }
        // Signed zeros are one value: the first of them wins.
        let zeros: Vec<f64> = (0..len)
            .map(|i| {
                if (i * 31) % 7 == 3 {
                    0.0
                } else if i % 2 == 0 {
                    -0.0
                } else {
                    -1.0
                }
            })
            .collect();
        check::<f32>(&zeros, "signed zeros");
        check::<f64>(&zeros, "signed zeros");
        let all_neg_inf = vec![f64::NEG_INFINITY; len];
        check::<f32>(&all_neg_inf, "all -inf");
        check::<f64>(&all_neg_inf, "all -inf");
        for at in [0, len / 2, len - 1] {
            let mut with_nan = xs.clone();
            with_nan[at] = f64::NAN;
            let ts: Vec<f32> = with_nan.iter().map(|&x| x as f32).collect();
            assert_eq!(f32::fast_argmax(&ts), None, "NaN at {at} of {len}");
            assert_eq!(f64::fast_argmax(&with_nan), None, "NaN at {at} of {len}");
        }
    }
    assert_eq!(<f32 as FastExtreme>::fast_argmax(&[]), None);
}
