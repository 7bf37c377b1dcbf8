//! Reductions with numpy's semantics: `sum`, `mean`, `max`, `min` and `argmax` over one axis
//! (negative axes allowed) or over all axes, `keepdims` output shapes, numpy's result dtypes,
//! NaN propagation and numpy's errors for empty reductions. Inputs may have any strides
//! (transposed, reversed, broadcast).
//!
//! Accuracy. Float sums use pairwise summation as numpy does (blocks of 128 elements summed in
//! 16 independent lanes, blocks combined in a binary tree), in a wider accumulator: float16 in
//! float32 (as numpy), float32 in float64 (numpy stays in float32, so ours is at least as
//! accurate), float64 in float64. Reducing an axis that is not the innermost in memory (axis 0
//! of a row-major matrix) walks whole rows and accumulates per output column, as numpy does:
//! blocks of up to 128 rows are summed in float32 (float16/float32 input) or float64, and the
//! block sums are added into the wide accumulator above, so the error grows with the block
//! length, not with the number of rows (numpy sums such columns naively in the input dtype).
//! Integer sums wrap in int64; integer means sum in float64, as numpy does. Parallel
//! reductions split the work into pieces of a fixed size, so results do not depend on the
//! number of threads.
//!
//! Layout: this file holds the operators, the shape and dtype rules and the entry point
//! [`reduce`], which validates and picks a reducer; `accum` the sum accumulators, `reducers`
//! the per-operator reductions of a contiguous run, `plan` the traversal of strided inputs
//! (lines, blocks, columns, parallel pieces).
#![allow(unsafe_code)]

use half::f16;
use opbridge_runtime::DType;
use smallvec::SmallVec;

use super::error::KernelError;
use crate::view::TensorView;
use plan::{run, Plan};
use reducers::{ArgMaxR, ExtremeR, SumR};

mod accum;
#[cfg(target_arch = "x86_64")]
mod extreme_avx512;
mod plan;
mod reducers;
#[cfg(test)]
mod tests;
mod zeros;

/// Elements summed in lanes before the pairwise tree takes over (numpy's `PW_BLOCKSIZE`).
const BLOCK: usize = 128;
/// Independent accumulators per block: enough to fill AVX2 registers and hide add latency.
const LANES: usize = 16;
/// Strided lines are gathered into contiguous buffers of this many elements.
const GATHER: usize = 1024;
/// Output columns one task accumulates when reducing a non-innermost axis.
const COLS: usize = 256;
/// Elements per parallel task. Fixed (not derived from the thread count) so that float results
/// are the same on every machine.
const PIECE: usize = 1 << 15;

/// A reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    Min,
    ArgMax,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min, ReduceOp::ArgMax];

    /// numpy's name for the operation (`"sum"`, `"argmax"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
        }
    }
}

/// Defines a generic function whose body is compiled three times, for the x86_64 baseline, for
/// AVX2 and for AVX-512, and picks one at run time: wide vectors without `-C target-cpu=native`
/// (the arithmetic is the same in each: only the vector width changes). The body must be safe
/// code; each generic parameter takes one bound.
macro_rules! avx2_multiversion {
    ($(#[$attr:meta])* $vis:vis fn $name:ident<$($g:ident: $bound:path),+>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$attr])*
        $vis fn $name<$($g: $bound),+>($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body<$($g: $bound),+>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2")]
                fn avx512<$($g: $bound),+>($($arg: $ty),*) $(-> $ret)? {
                    body::<$($g),+>($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2<$($g: $bound),+>($($arg: $ty),*) $(-> $ret)? {
                    body::<$($g),+>($($arg),*)
                }
                use std::arch::is_x86_feature_detected as has;
                if has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") {
                    // SAFETY: the CPU supports these features (checked just above).
                    return unsafe { avx512::<$($g),+>($($arg),*) };
                }
                if has!("avx2") {
                    // SAFETY: the CPU supports AVX2 (checked just above).
                    return unsafe { avx2::<$($g),+>($($arg),*) };
                }
            }
            body::<$($g),+>($($arg),*)
        }
    };
}
pub(crate) use avx2_multiversion;

/// Element offsets of position `index` (row-major over `shape`) in each of `K` strided operands.
/// `index` must be below the product of `shape`.
#[inline]
pub(crate) fn offsets_at<const K: usize>(shape: &[usize], strides: [&[isize]; K], mut index: usize) -> [isize; K] {
    let mut offsets = [0isize; K];
    for d in (0..shape.len()).rev() {
        let size = shape[d];
        let i = index % size;
        index /= size;
        for k in 0..K {
            offsets[k] += i as isize * strides[k][d];
        }
    }
    offsets
}

/// Normalizes a possibly negative axis; the error is numpy's `AxisError` message.
pub fn normalize_axis(axis: isize, ndim: usize) -> Result<usize, KernelError> {
    let n = ndim as isize;
    if axis < -n || axis >= n {
        return Err(KernelError::Axis { axis, ndim });
    }
    Ok(if axis < 0 { (axis + n) as usize } else { axis as usize })
}

/// The shape of a reduction's result. `axis = None` reduces all axes.
pub fn reduce_shape(shape: &[usize], axis: Option<isize>, keepdims: bool) -> Result<Vec<usize>, KernelError> {
    match axis {
        None => Ok(if keepdims { vec![1; shape.len()] } else { Vec::new() }),
        Some(axis) => {
            let axis = normalize_axis(axis, shape.len())?;
            let mut out = shape.to_vec();
            if keepdims {
                out[axis] = 1;
            } else {
                out.remove(axis);
            }
            Ok(out)
        }
    }
}

/// numpy's result dtype (on 64-bit Linux): `sum` of int32 or int64 gives int64, `mean` of an
/// integer type gives float64, `argmax` gives int64; every other case keeps the input's dtype
/// (float16 `mean` accumulates in float32 inside and rounds once to float16).
pub fn reduce_result_dtype(op: ReduceOp, dtype: DType) -> DType {
    match (op, dtype) {
        (ReduceOp::Sum, DType::I32 | DType::I64) => DType::I64,
        (ReduceOp::Mean, DType::I32 | DType::I64) => DType::F64,
        (ReduceOp::ArgMax, _) => DType::I64,
        (_, dtype) => dtype,
    }
}

/// Reduces `x` over `axis` (`None`: all axes) into `out`.
///
/// `out` has dtype [`reduce_result_dtype`] and the shape [`reduce_shape`] gives with or without
/// `keepdims` (both are accepted); its strides are free. `argmax` over all axes returns the
/// index into the flattened (row-major) array, as numpy does. `max`, `min` and `argmax` of an
/// empty reduction are errors with numpy's messages; `sum` of nothing is 0, `mean` NaN.
///
/// # Safety
/// `x` and `out` describe valid, aligned memory for their shapes, strides and dtypes; `out` is
/// writable, does not overlap `x`, and no other thread touches it during the call.
pub unsafe fn reduce(op: ReduceOp, x: &TensorView, axis: Option<isize>, out: &TensorView) -> Result<(), KernelError> {
    check_view("x", x)?;
    check_view("out", out)?;
    let ndim = x.ndim();
    let axis = match axis {
        Some(a) => Some(normalize_axis(a, ndim)?),
        None => None,
    };
    let expected = reduce_result_dtype(op, x.dtype);
    if out.dtype != expected {
        return Err(KernelError::ResultDType { expected, input: x.dtype, got: out.dtype });
    }
    // Inline lists: a small reduction's setup must not cost more than its loop.
    let reduced: SmallVec<[bool; 8]> = (0..ndim).map(|d| axis.is_none_or(|a| a == d)).collect();
    // `out` has the kept dimensions, with (keepdims) or without the reduced ones as 1s.
    let kept_dims = (0..ndim).filter(|&d| !reduced[d]).map(|d| x.shape[d]);
    let with_ones = (0..ndim).map(|d| if reduced[d] { 1 } else { x.shape[d] });
    // The stride of `out` along each dimension of `x` (0 along reduced dimensions).
    let os: SmallVec<[isize; 8]> = if out.shape.iter().copied().eq(with_ones) {
        (0..ndim).map(|d| if reduced[d] { 0 } else { out.strides[d] }).collect()
    } else if out.shape.iter().copied().eq(kept_dims) {
        let mut kept = out.strides.iter();
        (0..ndim).map(|d| if reduced[d] { 0 } else { *kept.next().expect("one stride per kept dim") }).collect()
    } else {
        let keep = reduce_shape(&x.shape, axis.map(|a| a as isize), true)?;
        let drop = reduce_shape(&x.shape, axis.map(|a| a as isize), false)?;
        return Err(KernelError::Shape {
            what: "out",
            expected: format!("{drop:?} (or {keep:?} with keepdims)"),
            got: out.shape.to_vec(),
        });
    };
    let plan = Plan { x: x.data, out: out.data, shape: &x.shape, xs: &x.strides, os: &os, reduced: &reduced };
    // SAFETY: (all arms) the caller's contract, with `R::In` matching `x.dtype` and `R::Out`
    // matching `out.dtype` (checked above).
    unsafe {
        match (op, x.dtype) {
            (ReduceOp::Sum, DType::F16) => run::<SumR<f16, f32, f16, false>>(&plan),
            (ReduceOp::Sum, DType::F32) => run::<SumR<f32, f64, f32, false>>(&plan),
            (ReduceOp::Sum, DType::F64) => run::<SumR<f64, f64, f64, false>>(&plan),
            (ReduceOp::Sum, DType::I32) => run::<SumR<i32, i64, i64, false>>(&plan),
            (ReduceOp::Sum, DType::I64) => run::<SumR<i64, i64, i64, false>>(&plan),
            (ReduceOp::Mean, DType::F16) => run::<SumR<f16, f32, f16, true>>(&plan),
            (ReduceOp::Mean, DType::F32) => run::<SumR<f32, f64, f32, true>>(&plan),
            (ReduceOp::Mean, DType::F64) => run::<SumR<f64, f64, f64, true>>(&plan),
            (ReduceOp::Mean, DType::I32) => run::<SumR<i32, f64, f64, true>>(&plan),
            (ReduceOp::Mean, DType::I64) => run::<SumR<i64, f64, f64, true>>(&plan),
            // Floats: then the sign numpy gives a zero result (see `zeros`).
            (ReduceOp::Max, DType::F16) => run_extreme::<f16, true>(&plan),
            (ReduceOp::Max, DType::F32) => run_extreme::<f32, true>(&plan),
            (ReduceOp::Max, DType::F64) => run_extreme::<f64, true>(&plan),
            (ReduceOp::Min, DType::F16) => run_extreme::<f16, false>(&plan),
            (ReduceOp::Min, DType::F32) => run_extreme::<f32, false>(&plan),
            (ReduceOp::Min, DType::F64) => run_extreme::<f64, false>(&plan),
            (ReduceOp::Max, dtype) => crate::with_dtype!(dtype, T => run::<ExtremeR<T, true>>(&plan)),
            (ReduceOp::Min, dtype) => crate::with_dtype!(dtype, T => run::<ExtremeR<T, false>>(&plan)),
            (ReduceOp::ArgMax, dtype) => crate::with_dtype!(dtype, T => run::<ArgMaxR<T>>(&plan)),
        }
    }
}

/// A float `max` (`MAX`) or `min`, then numpy's sign for every zero result.
///
/// # Safety
/// As for [`run`], with `T` the dtype of `x` and `out`.
unsafe fn run_extreme<T: zeros::NumpyTies, const MAX: bool>(plan: &Plan<'_>) -> Result<(), KernelError> {
    // SAFETY: the caller's contract.
    unsafe {
        run::<ExtremeR<T, MAX>>(plan)?;
        zeros::numpy_zero_signs::<T, MAX>(plan);
    }
    Ok(())
}

fn check_view(what: &'static str, v: &TensorView) -> Result<(), KernelError> {
    if v.shape.len() != v.strides.len() {
        return Err(KernelError::MalformedView { what, dims: v.shape.len(), strides: v.strides.len() });
    }
    Ok(())
}
