//! Neural-network row kernels: `softmax` and `log_softmax` over an axis, `layer_norm` and
//! `rms_norm` over the last dimension (torch.nn.functional's semantics with
//! `normalized_shape = (x.shape[-1],)` and weight/bias of that shape).
//!
//! Numerics. softmax subtracts the row maximum before `exp`, so large inputs do not overflow;
//! a NaN anywhere in a row makes the whole row NaN, and a row of `-inf` gives NaN, as the numpy
//! expression `exp(x - max) / sum(exp(x - max))` and torch do. float16 rows are widened to
//! float32 and rounded once at the end. Sums (softmax's denominator, layer_norm's mean and
//! variance, rms_norm's mean square) accumulate in float64 for every dtype (16 lanes, plain
//! summation per lane): more than the float32 accumulation torch uses for float16, and at least
//! as accurate as compensated float32 for float32. Elementwise math runs in float32 for
//! float16 and float32 (`exp` is a vectorizable polynomial accurate to about 1 ulp), in float64
//! for float64; the normalizations apply mean and 1/std in float64. layer_norm uses the biased
//! variance (two passes: mean, then squared deviations), as torch does.
//!
//! Rows whose elements are contiguous in both `x` and `out` run in place on the memory;
//! other layouts gather each row into a scratch buffer and scatter the result.
#![allow(unsafe_code)]

use super::math::exp_f32;
use std::ops::{Add, Mul, Sub};

use half::f16;
use half::slice::HalfFloatSliceExt;
use opbridge_runtime::DType;
use rayon::prelude::*;

use super::error::KernelError;
use super::reduce::{avx2_multiversion, normalize_axis, offsets_at};
use super::thresholds::NN_PARALLEL_MIN_ELEMS;
use crate::view::TensorView;

/// Elements per parallel task (whole rows).
const TASK_ELEMS: usize = 1 << 14;
const LANES: usize = 16;

/// The element type rows are computed in: float32 or float64.
trait Compute:
    Copy + Send + Sync + 'static + PartialOrd + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self>
{
    fn exp(self) -> Self;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn isnan(self) -> bool;
}

impl Compute for f32 {
    #[inline(always)]
    fn exp(self) -> Self {
        exp_f32(self)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn isnan(self) -> bool {
        self.is_nan()
    }
}

impl Compute for f64 {
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn isnan(self) -> bool {
        self.is_nan()
    }
}

/// Storage dtypes (float16, float32, float64) and the type their rows are computed in.
trait Storage: Copy + Send + Sync + 'static {
    type C: Compute;
    fn to_c(self) -> Self::C;
    fn from_c(c: Self::C) -> Self;
    /// The same slice seen as the compute type, when the two are the same type.
    fn as_c(s: &[Self]) -> Option<&[Self::C]>;
    fn as_c_mut(s: &mut [Self]) -> Option<&mut [Self::C]>;
    fn load(src: &[Self], dst: &mut [Self::C]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s.to_c();
        }
    }
    fn store(src: &[Self::C], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::from_c(s);
        }
    }
}

macro_rules! same_storage {
    ($($t:ty),*) => {$(
        impl Storage for $t {
            type C = $t;
            #[inline(always)]
            fn to_c(self) -> $t {
                self
            }
            #[inline(always)]
            fn from_c(c: $t) -> $t {
                c
            }
            fn as_c(s: &[$t]) -> Option<&[$t]> {
                Some(s)
            }
            fn as_c_mut(s: &mut [$t]) -> Option<&mut [$t]> {
                Some(s)
            }
        }
    )*};
}
same_storage!(f32, f64);

impl Storage for f16 {
    type C = f32;
    #[inline(always)]
    fn to_c(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_c(c: f32) -> f16 {
        f16::from_f32(c)
    }
    fn as_c(_: &[f16]) -> Option<&[f32]> {
        None
    }
    fn as_c_mut(_: &mut [f16]) -> Option<&mut [f32]> {
        None
    }
    fn load(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn store(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
}

// ---------------------------------------------------------------------------------------------
// Row kernels (contiguous compute-type rows)

/// The row maximum, NaN if any element is NaN (numpy's `max`).
#[inline(always)]
fn row_max<F: Compute>(src: &[F]) -> F {
    #[inline(always)]
    fn pick<F: Compute>(m: F, x: F) -> F {
        if (x > m) | x.isnan() {
            x
        } else {
            m
        }
    }
    let mut lanes = [src[0]; LANES];
    let chunks = src.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = pick(*lane, x);
        }
    }
    for &x in rest {
        lanes[0] = pick(lanes[0], x);
    }
    lanes.into_iter().fold(src[0], pick)
}

/// `sum(f(x))` in float64, in independent lanes.
#[inline(always)]
fn row_sum<F: Compute>(src: &[F], f: impl Fn(f64) -> f64) -> f64 {
    let mut lanes = [0f64; LANES];
    let chunks = src.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += f(x.to_f64());
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(rest) {
        *lane += f(x.to_f64());
    }
    lanes.iter().sum()
}

avx2_multiversion!(
    fn softmax_row<F: Compute>(src: &[F], dst: &mut [F]) {
        let m = row_max(src);
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = (x - m).exp();
        }
        let inv = F::from_f64(1.0 / row_sum(dst, |e| e));
        for d in dst.iter_mut() {
            *d = *d * inv;
        }
    }
);

avx2_multiversion!(
    fn log_softmax_row<F: Compute>(src: &[F], dst: &mut [F]) {
        let m = row_max(src);
        // `dst` holds the exponentials until the last pass overwrites them.
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = (x - m).exp();
        }
        let log_sum = F::from_f64(row_sum(dst, |e| e).ln());
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = (x - m) - log_sum;
        }
    }
);

avx2_multiversion!(
    fn layer_norm_row<F: Compute>(src: &[F], dst: &mut [F], weight: Option<&[F]>, bias: Option<&[F]>, eps: f64) {
        let n = src.len() as f64;
        let mean = row_sum(src, |x| x) / n;
        let var = row_sum(src, |x| (x - mean) * (x - mean)) / n;
        let rstd = 1.0 / (var + eps).sqrt();
        let norm = |x: F| (x.to_f64() - mean) * rstd;
        match (weight, bias) {
            (Some(w), Some(b)) => {
                for ((d, &x), (&w, &b)) in dst.iter_mut().zip(src).zip(w.iter().zip(b)) {
                    *d = F::from_f64(norm(x) * w.to_f64() + b.to_f64());
                }
            }
            (Some(w), None) => {
                for ((d, &x), &w) in dst.iter_mut().zip(src).zip(w) {
                    *d = F::from_f64(norm(x) * w.to_f64());
                }
            }
            (None, Some(b)) => {
                for ((d, &x), &b) in dst.iter_mut().zip(src).zip(b) {
                    *d = F::from_f64(norm(x) + b.to_f64());
                }
            }
            (None, None) => {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = F::from_f64(norm(x));
                }
            }
        }
    }
);

avx2_multiversion!(
    fn rms_norm_row<F: Compute>(src: &[F], dst: &mut [F], weight: Option<&[F]>, eps: f64) {
        let mean_square = row_sum(src, |x| x * x) / src.len() as f64;
        let r = 1.0 / (mean_square + eps).sqrt();
        match weight {
            Some(w) => {
                for ((d, &x), &w) in dst.iter_mut().zip(src).zip(w) {
                    *d = F::from_f64(x.to_f64() * r * w.to_f64());
                }
            }
            None => {
                for (d, &x) in dst.iter_mut().zip(src) {
                    *d = F::from_f64(x.to_f64() * r);
                }
            }
        }
    }
);

// ---------------------------------------------------------------------------------------------
// Traversal

/// Runs `kernel` on every line of `x` along `axis`, writing the matching line of `out`.
///
/// # Safety
/// `x` and `out` are valid, aligned views of `T` with the same shape; `out` is writable and is
/// either disjoint from `x` or exactly the same view; nothing else touches `out` meanwhile.
unsafe fn run_rows<T: Storage, K>(x: &TensorView, axis: usize, out: &TensorView, kernel: K)
where
    K: Fn(&[T::C], &mut [T::C]) + Sync,
{
    let numel = x.numel();
    if numel == 0 {
        return;
    }
    // A 0-d array is one line of one element.
    let (shape, xs, os) = if x.ndim() == 0 {
        (vec![1], vec![1], vec![1])
    } else {
        (x.shape.to_vec(), x.strides.to_vec(), out.strides.to_vec())
    };
    let len = shape[axis];
    let (x_step, o_step) = (xs[axis], os[axis]);
    let rows = numel / len;
    let outer =
        |v: &[usize]| -> Vec<usize> { v.iter().enumerate().filter(|&(d, _)| d != axis).map(|(_, &s)| s).collect() };
    let outer_strides =
        |v: &[isize]| -> Vec<isize> { v.iter().enumerate().filter(|&(d, _)| d != axis).map(|(_, &s)| s).collect() };
    let (row_shape, row_xs, row_os) = (outer(&shape), outer_strides(&xs), outer_strides(&os));
    let disjoint = crate::overlap(x.byte_span(), out.byte_span()) == crate::Overlap::Disjoint;
    // Rows contiguous in both tensors, of the compute type, not aliased: run on the memory.
    let direct = disjoint && x_step == 1 && o_step == 1 && T::as_c(&[]).is_some();
    let (xa, oa) = (x.data, out.data);

    let do_rows = |rows: std::ops::Range<usize>| {
        let mut src_buf: Vec<T::C> = Vec::new();
        let mut dst_buf: Vec<T::C> = Vec::new();
        for r in rows {
            let [xo, oo] = offsets_at(&row_shape, [&row_xs, &row_os], r);
            let xp = (xa as *const T).wrapping_offset(xo);
            let op = (oa as *mut T).wrapping_offset(oo);
            if direct {
                // SAFETY: the row holds `len` consecutive elements in each tensor, which do not
                // overlap (checked above) and no other task touches.
                let (src, dst) =
                    unsafe { (std::slice::from_raw_parts(xp, len), std::slice::from_raw_parts_mut(op, len)) };
                kernel(T::as_c(src).expect("direct"), T::as_c_mut(dst).expect("direct"));
                continue;
            }
            src_buf.resize(len, T::C::from_f64(0.0));
            dst_buf.resize(len, T::C::from_f64(0.0));
            if x_step == 1 {
                // SAFETY: `len` consecutive elements of `x`; the shared slice ends here, before
                // `out` (possibly the same memory) is written.
                T::load(unsafe { std::slice::from_raw_parts(xp, len) }, &mut src_buf);
            } else {
                for (i, s) in src_buf.iter_mut().enumerate() {
                    // SAFETY: element `i < len` of the row is inside `x`.
                    *s = T::to_c(unsafe { *xp.offset(i as isize * x_step) });
                }
            }
            kernel(&src_buf, &mut dst_buf);
            if o_step == 1 {
                // SAFETY: `len` consecutive elements of `out`, written by this task only.
                T::store(&dst_buf, unsafe { std::slice::from_raw_parts_mut(op, len) });
            } else {
                for (i, &d) in dst_buf.iter().enumerate() {
                    // SAFETY: element `i < len` of the row is inside `out`.
                    unsafe { *op.offset(i as isize * o_step) = T::from_c(d) };
                }
            }
        }
    };
    if numel >= NN_PARALLEL_MIN_ELEMS && rows > 1 {
        let per_task = (TASK_ELEMS / len).max(1);
        let tasks = rows.div_ceil(per_task);
        super::pool::install(|| {
            (0..tasks).into_par_iter().for_each(|t| do_rows(t * per_task..rows.min((t + 1) * per_task)))
        });
    } else {
        do_rows(0..rows);
    }
}

/// Runs `$body` with `$t` bound to the storage type of a float dtype; other dtypes are an error.
macro_rules! with_float {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            DType::F16 => {
                type $t = f16;
                $body
            }
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            other => return Err(KernelError::FloatRequired { got: other }),
        }
    };
}

fn check_same(x: &TensorView, out: &TensorView) -> Result<(), KernelError> {
    for (what, v) in [("x", x), ("out", out)] {
        if v.shape.len() != v.strides.len() {
            return Err(KernelError::MalformedView { what, dims: v.shape.len(), strides: v.strides.len() });
        }
    }
    if out.dtype != x.dtype {
        return Err(KernelError::DTypeMismatch { what: "out", expected: x.dtype, like: "x", got: out.dtype });
    }
    if out.shape != x.shape {
        return Err(KernelError::Shape {
            what: "out",
            expected: format!("{:?} like x", x.shape),
            got: out.shape.to_vec(),
        });
    }
    Ok(())
}

/// Checks a weight or bias against the last dimension of `x`.
fn check_param(what: &'static str, p: &TensorView, x: &TensorView) -> Result<(), KernelError> {
    let last = *x.shape.last().expect("x has at least one dimension");
    if p.dtype != x.dtype {
        return Err(KernelError::DTypeMismatch { what, expected: x.dtype, like: "x", got: p.dtype });
    }
    if p.shape.as_slice() != [last] || p.strides.len() != 1 {
        return Err(KernelError::Shape {
            what,
            expected: format!("[{last}] (the last dimension of x)"),
            got: p.shape.to_vec(),
        });
    }
    Ok(())
}

/// A weight or bias vector in the compute type.
///
/// # Safety
/// `p` is a valid 1-D view of `T`.
unsafe fn load_param<T: Storage>(p: &TensorView) -> Vec<T::C> {
    let base = p.data as *const T;
    // SAFETY: each `i < len` is an element of the view (caller's contract).
    (0..p.shape[0]).map(|i| T::to_c(unsafe { *base.offset(i as isize * p.strides[0]) })).collect()
}

/// # Safety
/// As for [`softmax`].
unsafe fn softmax_like(x: &TensorView, axis: isize, out: &TensorView, log: bool) -> Result<(), KernelError> {
    check_same(x, out)?;
    // A 0-d input is one line (torch allows dim 0 and -1 there).
    let axis = normalize_axis(axis, x.ndim().max(1))?;
    with_float!(x.dtype, T => {
        // SAFETY: the public callers' contract; `T` matches both dtypes (checked above).
        unsafe {
            if log {
                run_rows::<T, _>(x, axis, out, log_softmax_row);
            } else {
                run_rows::<T, _>(x, axis, out, softmax_row);
            }
        }
    });
    Ok(())
}

/// `out = exp(x - max) / sum(exp(x - max))` along `axis` (negative counts from the end).
/// Float dtypes only; `out` has the dtype and shape of `x` (any strides).
///
/// # Safety
/// `x` and `out` describe valid, aligned memory for their shapes, strides and dtypes; `out` is
/// writable, is either disjoint from `x` or exactly the same view (in place), and no other
/// thread touches it during the call.
pub unsafe fn softmax(x: &TensorView, axis: isize, out: &TensorView) -> Result<(), KernelError> {
    // SAFETY: forwarded.
    unsafe { softmax_like(x, axis, out, false) }
}

/// `out = (x - max) - log(sum(exp(x - max)))` along `axis`. Float dtypes only; `out` has the
/// dtype and shape of `x`.
///
/// # Safety
/// As for [`softmax`].
pub unsafe fn log_softmax(x: &TensorView, axis: isize, out: &TensorView) -> Result<(), KernelError> {
    // SAFETY: forwarded.
    unsafe { softmax_like(x, axis, out, true) }
}

/// `torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)`: each row along the
/// last dimension becomes `(x - mean) / sqrt(var + eps) * weight + bias` with the biased
/// variance. `weight` and `bias` have shape `(x.shape[-1],)` and x's dtype (any stride).
///
/// # Safety
/// As for [`softmax`]; `weight` and `bias` are valid views too (they may overlap anything:
/// they are read before `out` is written).
pub unsafe fn layer_norm(
    x: &TensorView,
    weight: Option<&TensorView>,
    bias: Option<&TensorView>,
    eps: f64,
    out: &TensorView,
) -> Result<(), KernelError> {
    check_same(x, out)?;
    if x.ndim() == 0 {
        return Err(KernelError::NoDimensions { what: "x" });
    }
    for (what, p) in [("weight", weight), ("bias", bias)] {
        if let Some(p) = p {
            check_param(what, p, x)?;
        }
    }
    with_float!(x.dtype, T => {
        // SAFETY: the caller's contract; dtypes and shapes checked above.
        unsafe {
            let w = weight.map(|w| load_param::<T>(w));
            let b = bias.map(|b| load_param::<T>(b));
            run_rows::<T, _>(x, x.ndim() - 1, out, |s, d| layer_norm_row(s, d, w.as_deref(), b.as_deref(), eps));
        }
    });
    Ok(())
}

/// `torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)`: each row along the last
/// dimension becomes `x / sqrt(mean(x^2) + eps) * weight`.
///
/// # Safety
/// As for [`layer_norm`].
pub unsafe fn rms_norm(
    x: &TensorView,
    weight: Option<&TensorView>,
    eps: f64,
    out: &TensorView,
) -> Result<(), KernelError> {
    check_same(x, out)?;
    if x.ndim() == 0 {
        return Err(KernelError::NoDimensions { what: "x" });
    }
    if let Some(w) = weight {
        check_param("weight", w, x)?;
    }
    with_float!(x.dtype, T => {
        // SAFETY: the caller's contract; dtypes and shapes checked above.
        unsafe {
            let w = weight.map(|w| load_param::<T>(w));
            run_rows::<T, _>(x, x.ndim() - 1, out, |s, d| rms_norm_row(s, d, w.as_deref(), eps));
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Element;

    /// Deterministic values in [-2.75, 2.75].
    fn data<T: Element>(n: usize, seed: usize) -> Vec<T> {
        (0..n).map(|i| <T as Element>::from_f64((((i * 7919 + seed * 104_729) % 23) as f64 - 11.0) / 4.0)).collect()
    }

    fn view<T: Element>(v: &[T], shape: &[usize], strides: &[isize], offset: isize) -> TensorView {
        TensorView {
            data: v.as_ptr().wrapping_offset(offset) as usize,
            dtype: T::DTYPE,
            shape: shape.into(),
            strides: strides.into(),
        }
    }

    fn view_mut<T: Element>(v: &mut [T], shape: &[usize], strides: &[isize], offset: isize) -> TensorView {
        TensorView {
            data: v.as_mut_ptr().wrapping_offset(offset) as usize,
            dtype: T::DTYPE,
            shape: shape.into(),
            strides: strides.into(),
        }
    }

    fn contiguous_strides(shape: &[usize]) -> Vec<isize> {
        opbridge_runtime::tensor::contiguous_strides(shape)
    }

    fn get(v: &TensorView, idx: &[usize]) -> f64 {
        let off: isize = idx.iter().zip(&v.strides).map(|(&i, &s)| i as isize * s).sum();
        crate::with_dtype!(v.dtype, T => {
            // SAFETY: the index is inside a view the test built over live memory.
            unsafe { Element::to_f64(*(v.data as *const T).offset(off)) }
        })
    }

    /// The lines of `v` along `axis`: (multi-indices of each line's elements).
    fn lines(shape: &[usize], axis: usize) -> Vec<Vec<Vec<usize>>> {
        let numel: usize = shape.iter().product();
        if numel == 0 {
            return Vec::new();
        }
        let mut result = Vec::new();
        for i in 0..numel {
            let mut idx = vec![0; shape.len()];
            let mut rest = i;
            for d in (0..shape.len()).rev() {
                idx[d] = rest % shape[d];
                rest /= shape[d];
            }
            if idx[axis] != 0 {
                continue;
            }
            result.push(
                (0..shape[axis])
                    .map(|k| {
                        let mut j = idx.clone();
                        j[axis] = k;
                        j
                    })
                    .collect(),
            );
        }
        result
    }

    fn tolerance(dtype: DType) -> f64 {
        match dtype {
            DType::F16 => 4e-3,
            DType::F32 => 2e-6,
            _ => 1e-12,
        }
    }

    fn close(got: f64, want: f64, tol: f64) -> bool {
        (got.is_nan() && want.is_nan()) || got == want || (got - want).abs() <= tol * want.abs().max(1.0)
    }

    fn softmax_ref(row: &[f64], log: bool) -> Vec<f64> {
        let m = if row.iter().any(|x| x.is_nan()) {
            f64::NAN
        } else {
            row.iter().copied().fold(f64::NEG_INFINITY, f64::max)
        };
        let s: f64 = row.iter().map(|&x| (x - m).exp()).sum();
        row.iter().map(|&x| if log { (x - m) - s.ln() } else { (x - m).exp() / s }).collect()
    }

    fn layer_norm_ref(row: &[f64], w: Option<&[f64]>, b: Option<&[f64]>, eps: f64) -> Vec<f64> {
        let n = row.len() as f64;
        let mean = row.iter().sum::<f64>() / n;
        let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        let rstd = 1.0 / (var + eps).sqrt();
        (0..row.len()).map(|i| (row[i] - mean) * rstd * w.map_or(1.0, |w| w[i]) + b.map_or(0.0, |b| b[i])).collect()
    }

    fn rms_norm_ref(row: &[f64], w: Option<&[f64]>, eps: f64) -> Vec<f64> {
        let ms = row.iter().map(|x| x * x).sum::<f64>() / row.len() as f64;
        (0..row.len()).map(|i| row[i] / (ms + eps).sqrt() * w.map_or(1.0, |w| w[i])).collect()
    }

    /// Compares `out` with `reference` applied to every line of `x` along `axis`.
    fn compare(x: &TensorView, out: &TensorView, axis: usize, reference: impl Fn(&[f64]) -> Vec<f64>) {
        let shape = if x.ndim() == 0 { vec![1] } else { x.shape.to_vec() };
        let scalar = |v: &TensorView, idx: &[usize]| if v.ndim() == 0 { get(v, &[]) } else { get(v, idx) };
        for line in lines(&shape, axis) {
            let row: Vec<f64> = line.iter().map(|idx| scalar(x, idx)).collect();
            let want = reference(&row);
            for (idx, &w) in line.iter().zip(&want) {
                let got = scalar(out, idx);
                assert!(
                    close(got, w, tolerance(x.dtype)),
                    "{} shape {:?} strides {:?} axis {axis} at {idx:?}: got {got}, want {w} (row {row:?})",
                    x.dtype,
                    x.shape,
                    x.strides
                );
            }
        }
    }

    /// softmax and log_softmax of `x` along every axis into a fresh contiguous `out`.
    fn check_softmax<T: Element>(x: &TensorView) {
        let ndim = x.ndim() as isize;
        for axis in -ndim.max(1)..ndim.max(1) {
            for log in [false, true] {
                let mut buf = vec![<T as Element>::from_f64(0.0); x.numel()];
                let out = view_mut(&mut buf, &x.shape, &contiguous_strides(&x.shape), 0);
                // SAFETY: views over live buffers; `out` is disjoint from `x`.
                unsafe {
                    if log {
                        log_softmax(x, axis, &out).unwrap();
                    } else {
                        softmax(x, axis, &out).unwrap();
                    }
                }
                let a = normalize_axis(axis, x.ndim().max(1)).unwrap();
                compare(x, &out, a, |row| softmax_ref(row, log));
            }
        }
    }

    #[test]
    fn exp_f32_is_accurate() {
        let mut x = -87.3f32;
        while x <= 10.0 {
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            assert!(((got - want) / want).abs() < 2.5e-7, "exp({x}) = {got}, want {want}");
            x += 0.0137;
        }
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        let tiny = exp_f32(-100.0); // a subnormal, kept (3.7e-44)
        assert!(tiny > 0.0 && tiny < 1e-43, "{tiny}");
        assert_eq!(exp_f32(-110.0), 0.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn softmax_every_dtype_and_axis() {
        for dtype in [DType::F16, DType::F32, DType::F64] {
            crate::with_dtype!(dtype, T => {
                let v = data::<T>(3 * 4 * 5, 1);
                check_softmax::<T>(&view(&v, &[3, 4, 5], &[20, 5, 1], 0));
                check_softmax::<T>(&view(&v, &[7], &[1], 0));
                check_softmax::<T>(&view(&v, &[1], &[1], 0));
                check_softmax::<T>(&view(&v, &[], &[], 0));
                check_softmax::<T>(&view(&v, &[3, 0], &[0, 1], 0));
                // Transposed, reversed and strided inputs.
                check_softmax::<T>(&view(&v, &[5, 12], &[1, 5], 0));
                check_softmax::<T>(&view(&v, &[3, 10], &[-20, 2], 40));
                // Long rows (lane remainders, several chunks).
                let v = data::<T>(2 * 150, 2);
                check_softmax::<T>(&view(&v, &[2, 150], &[150, 1], 0));
            })
        }
    }

    #[test]
    fn softmax_strided_and_in_place_outputs() {
        let v = data::<f32>(4 * 6, 3);
        let mut buf = vec![0f32; 4 * 6];
        let x = view(&v, &[4, 6], &[6, 1], 0);
        // A transposed output.
        let out = view_mut(&mut buf, &[4, 6], &[1, 4], 0);
        // SAFETY: views over live, disjoint buffers.
        unsafe { softmax(&x, 1, &out) }.unwrap();
        compare(&x, &out, 1, |row| softmax_ref(row, false));
        // In place, contiguous rows and strided lines.
        for axis in [1, 0] {
            let mut w = v.clone();
            let x = view_mut(&mut w, &[4, 6], &[6, 1], 0);
            // SAFETY: `x` is both input and output: allowed (the very same view).
            unsafe { log_softmax(&x, axis, &x) }.unwrap();
            let original = view(&v, &[4, 6], &[6, 1], 0);
            compare(&original, &x, axis as usize, |row| softmax_ref(row, true));
        }
    }

    #[test]
    fn softmax_nan_inf_and_large_values() {
        let nan = f64::NAN;
        let inf = f64::INFINITY;
        let rows: [&[f64]; 6] = [
            &[1.0, nan, 2.0],
            &[-inf, 1.0, 2.0],
            &[-inf, -inf, -inf],
            &[1000.0, 1001.0, 1002.0],
            &[-1000.0, 0.0, 5.0],
            &[inf, 1.0, 0.0],
        ];
        for row in rows {
            for dtype in [DType::F16, DType::F32, DType::F64] {
                crate::with_dtype!(dtype, T => {
                    let v: Vec<T> = row.iter().map(|&x| <T as Element>::from_f64(x)).collect();
                    check_softmax::<T>(&view(&v, &[row.len()], &[1], 0));
                })
            }
        }
        // Large inputs do not overflow.
        let v = [1000.0f32, 1001.0, 1002.0];
        let mut out = [0f32; 3];
        // SAFETY: views over live buffers.
        unsafe { softmax(&view(&v, &[3], &[1], 0), 0, &view_mut(&mut out, &[3], &[1], 0)) }.unwrap();
        assert!(out.iter().all(|x| x.is_finite()) && (out.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn large_inputs_run_in_parallel() {
        for dtype in [DType::F16, DType::F32, DType::F64] {
            crate::with_dtype!(dtype, T => {
                let v = data::<T>(600 * 100, 4);
                let x = view(&v, &[600, 100], &[100, 1], 0);
                let mut buf = vec![<T as Element>::from_f64(0.0); 600 * 100];
                let out = view_mut(&mut buf, &[600, 100], &[100, 1], 0);
                for axis in [1, 0] {
                    // SAFETY: views over live, disjoint buffers.
                    unsafe { softmax(&x, axis, &out) }.unwrap();
                    compare(&x, &out, axis as usize, |row| softmax_ref(row, false));
                }
                // SAFETY: as above.
                unsafe { layer_norm(&x, None, None, 1e-5, &out) }.unwrap();
                compare(&x, &out, 1, |row| layer_norm_ref(row, None, None, 1e-5));
            })
        }
    }

    #[test]
    fn layer_norm_and_rms_norm_every_dtype_weight_and_layout() {
        for dtype in [DType::F16, DType::F32, DType::F64] {
            crate::with_dtype!(dtype, T => {
                let v = data::<T>(3 * 40, 5);
                let params = data::<T>(80, 6);
                let layouts: [(&[usize], &[isize], isize); 5] = [
                    (&[3, 40], &[40, 1], 0),
                    (&[2, 3, 20], &[60, 20, 1], 0),
                    (&[40, 3], &[1, 40], 0),       // transposed: strided rows
                    (&[3, 20], &[-40, -2], 119),   // reversed and strided
                    (&[5, 1], &[1, 1], 0),         // one element per row
                ];
                for (shape, strides, offset) in layouts {
                    let x = view(&v, shape, strides, offset);
                    let last = *shape.last().unwrap();
                    let w = view(&params, &[last], &[2], 0);
                    let b = view(&params, &[last], &[-1], 79);
                    let wv: Vec<f64> = (0..last).map(|i| get(&w, &[i])).collect();
                    let bv: Vec<f64> = (0..last).map(|i| get(&b, &[i])).collect();
                    let mut buf = vec![<T as Element>::from_f64(0.0); x.numel()];
                    let out = view_mut(&mut buf, shape, &contiguous_strides(shape), 0);
                    let axis = shape.len() - 1;
                    for eps in [1e-5, 0.5] {
                        for (wo, bo) in [(None, None), (Some(&w), None), (None, Some(&b)), (Some(&w), Some(&b))] {
                            // SAFETY: views over live buffers; `out` is disjoint from the inputs.
                            unsafe { layer_norm(&x, wo, bo, eps, &out) }.unwrap();
                            let (wr, br) = (wo.map(|_| wv.as_slice()), bo.map(|_| bv.as_slice()));
                            compare(&x, &out, axis, |row| layer_norm_ref(row, wr, br, eps));
                        }
                        for wo in [None, Some(&w)] {
                            // SAFETY: as above.
                            unsafe { rms_norm(&x, wo, eps, &out) }.unwrap();
                            let wr = wo.map(|_| wv.as_slice());
                            compare(&x, &out, axis, |row| rms_norm_ref(row, wr, eps));
                        }
                    }
                }
            })
        }
    }

    #[test]
    fn norms_of_special_rows() {
        let nan = f64::NAN;
        let inf = f64::INFINITY;
        let rows: [&[f64]; 4] = [&[1.0, nan, 2.0], &[inf, 1.0, 2.0], &[3.0, 3.0, 3.0], &[0.0, 0.0, 0.0]];
        for row in rows {
            let v: Vec<f64> = row.to_vec();
            let x = view(&v, &[3], &[1], 0);
            let mut out = [0f64; 3];
            let o = view_mut(&mut out, &[3], &[1], 0);
            // SAFETY: views over live, disjoint buffers.
            unsafe { layer_norm(&x, None, None, 1e-5, &o) }.unwrap();
            compare(&x, &o, 0, |row| layer_norm_ref(row, None, None, 1e-5));
            // SAFETY: as above.
            unsafe { rms_norm(&x, None, 1e-5, &o) }.unwrap();
            compare(&x, &o, 0, |row| rms_norm_ref(row, None, 1e-5));
        }
    }

    #[test]
    fn argument_errors() {
        let v = data::<f32>(12, 0);
        let x = view(&v, &[3, 4], &[4, 1], 0);
        let mut buf = vec![0f32; 12];
        let out = view_mut(&mut buf, &[3, 4], &[4, 1], 0);
        let ints = vec![0i32; 12];
        let xi = view(&ints, &[3, 4], &[4, 1], 0);
        // SAFETY: (all calls) validation fails before anything is read or written.
        unsafe {
            assert_eq!(
                softmax(&xi, 0, &xi).unwrap_err().to_string(),
                "float16, float32 or float64 input required, got int32"
            );
            assert_eq!(
                softmax(&x, 2, &out).unwrap_err().to_string(),
                "axis 2 is out of bounds for array of dimension 2"
            );
            assert_eq!(
                log_softmax(&x, -3, &out).unwrap_err().to_string(),
                "axis -3 is out of bounds for array of dimension 2"
            );
            let wrong = view(&v, &[4, 3], &[3, 1], 0);
            assert_eq!(
                softmax(&x, 0, &wrong).unwrap_err().to_string(),
                "out must have shape [3, 4] like x, got [4, 3]"
            );
            let w = view(&v, &[3], &[1], 0);
            assert_eq!(
                layer_norm(&x, Some(&w), None, 1e-5, &out).unwrap_err().to_string(),
                "weight must have shape [4] (the last dimension of x), got [3]"
            );
            let wi = view(&ints, &[4], &[1], 0);
            assert_eq!(
                rms_norm(&x, Some(&wi), 1e-5, &out).unwrap_err(),
                KernelError::DTypeMismatch { what: "weight", expected: DType::F32, like: "x", got: DType::I32 }
            );
            assert_eq!(
                rms_norm(&x, Some(&wi), 1e-5, &out).unwrap_err().to_string(),
                "weight must have dtype float32 like x, got int32"
            );
            let s = view(&v, &[], &[], 0);
            assert_eq!(
                layer_norm(&s, None, None, 1e-5, &s).unwrap_err().to_string(),
                "x must have at least one dimension"
            );
        }
    }
}
