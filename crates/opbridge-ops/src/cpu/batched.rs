//! `a @ b` with numpy's `matmul` rules: 1-D operands are promoted to a row (a) or a column (b)
//! and the added dimension is removed from the result; leading (batch) dimensions broadcast.
//!
//! float32/float64 call the packed `gemm` kernels once per batch with the operands' own strides
//! (0 for broadcast batch dimensions: nothing is copied). When `b` is shared by every batch and
//! the batches of `a` and `out` are evenly spaced rows, the whole call is one taller `gemm`.
//!
//! float16: `gemm`'s own float16 kernel accumulates in float32 within a block of the inner
//! dimension but rounds the running result to float16 between blocks (so large `k` lose
//! precision). We widen each batch's operands to float32, multiply with the float32 `gemm` and
//! round once, which is float32 accumulation end to end (numpy's float16 matmul is less
//! accurate). Memory: `(m*k + k*n + m*n) * 4` bytes of scratch per batch in flight.
//!
//! int32/int64 (numpy supports them; BLAS does not): a cache-blocked kernel with wrapping
//! arithmetic, as numpy's integer matmul overflows: `b` is packed row-major, and the loops run
//! i-k-j over tiles so the innermost loop is a contiguous multiply-add over a row of `b`.
#![allow(unsafe_code)]

use half::f16;
use half::slice::HalfFloatSliceExt;
use opbridge_runtime::DType;
use rayon::prelude::*;

use super::error::KernelError;
use super::matmul::{self, MatRef};
use super::reduce::{avx2_multiversion, offsets_at};
use super::thresholds::{BATCHED_MATMUL_PARALLEL_MIN_FLOPS, BATCHED_MATMUL_WHOLE_PRODUCT_MAX_FLOPS};
use super::Element;
use crate::view::TensorView;

/// dtypes `batched_matmul` has kernels for.
pub const BATCHED_MATMUL_DTYPES: [DType; 5] = DType::ALL;

/// The result shape of `a @ b` under numpy's rules, or numpy's error.
pub fn matmul_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>, KernelError> {
    for (operand, shape) in [(0, a), (1, b)] {
        if shape.is_empty() {
            return Err(KernelError::MatmulOperandDims { operand });
        }
    }
    let (a_batch, m, ka) = match a {
        [k] => (&[][..], None, *k),
        [batch @ .., m, k] => (batch, Some(*m), *k),
        [] => unreachable!("checked above"),
    };
    let (b_batch, kb, n) = match b {
        [k] => (&[][..], *k, None),
        [batch @ .., k, n] => (batch, *k, Some(*n)),
        [] => unreachable!("checked above"),
    };
    if ka != kb {
        return Err(KernelError::MatmulCoreDims { a: ka, b: kb });
    }
    let nd = a_batch.len().max(b_batch.len());
    let mut shape = Vec::with_capacity(nd + 2);
    for i in 0..nd {
        let dim = |batch: &[usize]| (i + batch.len()).checked_sub(nd).map_or(1, |j| batch[j]);
        let (x, y) = (dim(a_batch), dim(b_batch));
        if x != y && x != 1 && y != 1 {
            return Err(KernelError::MatmulBatch { a: a.to_vec(), b: b.to_vec() });
        }
        shape.push(if x == 1 { y } else { x });
    }
    shape.extend(m);
    shape.extend(n);
    Ok(shape)
}

/// `out = a @ b` (numpy's `matmul`): every dtype in [`BATCHED_MATMUL_DTYPES`]; `a`, `b` and
/// `out` share one dtype (the dispatch layer casts mixed inputs first); `out` has the shape
/// [`matmul_shapes`] gives. Any strides, including 0 and negative, on every operand.
///
/// # Safety
/// Each view describes valid, aligned memory for its shape, strides and dtype; `out` is
/// writable, overlaps neither input, no two of its elements share an address, and no other
/// thread touches it during the call.
pub unsafe fn batched_matmul(a: &TensorView, b: &TensorView, out: &TensorView) -> Result<(), KernelError> {
    for (what, v) in [("a", a), ("b", b), ("out", out)] {
        if v.shape.len() != v.strides.len() {
            return Err(KernelError::MalformedView { what, dims: v.shape.len(), strides: v.strides.len() });
        }
    }
    if a.dtype != b.dtype || out.dtype != a.dtype {
        return Err(KernelError::MatmulDTypes { a: a.dtype, b: b.dtype, out: out.dtype });
    }
    let shape = matmul_shapes(&a.shape, &b.shape)?;
    if out.shape.as_slice() != shape.as_slice() {
        return Err(KernelError::Shape { what: "out", expected: format!("{shape:?}"), got: out.shape.to_vec() });
    }

    // Promote 1-D operands to matrices; give `out` the removed dimensions back (size 1).
    let (a_vec, b_vec) = (a.ndim() == 1, b.ndim() == 1);
    let (a_shape, a_strides) =
        if a_vec { (vec![1, a.shape[0]], vec![0, a.strides[0]]) } else { (a.shape.to_vec(), a.strides.to_vec()) };
    let (b_shape, b_strides) =
        if b_vec { (vec![b.shape[0], 1], vec![b.strides[0], 0]) } else { (b.shape.to_vec(), b.strides.to_vec()) };
    let batch_nd = shape.len() - usize::from(!a_vec) - usize::from(!b_vec);
    let batch = &shape[..batch_nd];
    let m = a_shape[a_shape.len() - 2];
    let k = a_shape[a_shape.len() - 1];
    let n = b_shape[b_shape.len() - 1];
    let o_row = if a_vec { 0 } else { out.strides[batch_nd] };
    let o_col = if b_vec { 0 } else { out.strides[out.ndim() - 1] };
    // Batch strides aligned to `batch`, 0 where an operand broadcasts.
    let batch_strides = |shape: &[usize], strides: &[isize]| -> Vec<isize> {
        let own = shape.len() - 2;
        (0..batch_nd)
            .map(|i| match (i + own).checked_sub(batch_nd) {
                Some(j) if shape[j] != 1 => strides[j],
                _ => 0,
            })
            .collect()
    };
    let a_bs = batch_strides(&a_shape, &a_strides);
    let b_bs = batch_strides(&b_shape, &b_strides);
    let o_bs = out.strides[..batch_nd].to_vec();
    let (a_row, a_col) = (a_strides[a_strides.len() - 2], a_strides[a_strides.len() - 1]);
    let (b_row, b_col) = (b_strides[b_strides.len() - 2], b_strides[b_strides.len() - 1]);

    let batches: usize = batch.iter().product();
    if batches == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    let dtype = a.dtype;
    let size = dtype.size() as isize;
    let at = |base: usize, offset: isize| (base as isize + offset * size) as usize;

    // Integer products pack `b`, float16 ones widen `a`, `b` and the product to float32: a
    // broadcast operand's whole logical size. Refused with a typed error when that cannot be
    // allocated (instead of the allocator aborting the process).
    let scratch = match dtype {
        DType::I32 | DType::I64 => k.checked_mul(n).map(|e| (e, dtype.size())),
        DType::F16 => batches
            .checked_mul(m)
            .and_then(|bm| bm.checked_mul(k)?.checked_add(k.checked_mul(n)?)?.checked_add(bm.checked_mul(n)?))
            .map(|e| (e, 4)),
        DType::F32 | DType::F64 => Some((0, 1)),
    };
    match scratch {
        Some((elements, size)) => super::error::check_scratch(elements, size)?,
        None => return Err(KernelError::Scratch { bytes: u128::MAX }),
    }

    if k == 0 {
        // An empty sum: zeros.
        crate::with_dtype!(dtype, T => {
            for t in 0..batches {
                let [o] = offsets_at(batch, [&o_bs], t);
                for i in 0..m {
                    for j in 0..n {
                        let offset = o + i as isize * o_row + j as isize * o_col;
                        // SAFETY: inside `out` (caller's contract).
                        unsafe { *(out.data as *mut T).offset(offset) = T::from_i64(0) };
                    }
                }
            }
        });
        return Ok(());
    }

    let flops = m.saturating_mul(n).saturating_mul(k);
    // `b` shared by every batch, and the batches of `a` and `out` evenly spaced rows: one gemm.
    if b_bs.iter().all(|&s| s == 0) && batches > 1 {
        if let (Some(a_rows), Some(o_rows)) = (rows_stride(batch, &a_bs, m, a_row), rows_stride(batch, &o_bs, m, o_row))
        {
            let mat = |base, row, col| MatRef { ptr: base as *const u8, row_stride: row, col_stride: col };
            // SAFETY: the same elements as the batched loop would touch (caller's contract).
            unsafe {
                multiply(
                    dtype,
                    batches * m,
                    n,
                    k,
                    mat(a.data, a_rows, a_col),
                    mat(b.data, b_row, b_col),
                    mat(out.data, o_rows, o_col),
                    true,
                    &mut Scratch::default(),
                );
            }
            return Ok(());
        }
    }

    let run_batches = |range: std::ops::Range<usize>, parallel: bool| {
        let mut scratch = Scratch::default();
        for t in range {
            let [ao, bo, oo] = offsets_at(batch, [&a_bs, &b_bs, &o_bs], t);
            let mat = |base, offset, row, col| MatRef {
                ptr: at(base, offset) as *const u8,
                row_stride: row,
                col_stride: col,
            };
            // SAFETY: batch `t` of each operand lies inside it (caller's contract); batches
            // write disjoint parts of `out`.
            unsafe {
                multiply(
                    dtype,
                    m,
                    n,
                    k,
                    mat(a.data, ao, a_row, a_col),
                    mat(b.data, bo, b_row, b_col),
                    mat(out.data, oo, o_row, o_col),
                    parallel,
                    &mut scratch,
                );
            }
        }
    };
    // Read inside `install`: in a forked child the global pool is the parent's (see `pool`).
    let threads = super::pool::install(rayon::current_num_threads);
    let many_small = flops < BATCHED_MATMUL_PARALLEL_MIN_FLOPS;
    let many_whole = flops <= BATCHED_MATMUL_WHOLE_PRODUCT_MAX_FLOPS && batches >= 2 * threads;
    if batches > 1 && (many_small || many_whole) && flops.saturating_mul(batches) >= BATCHED_MATMUL_PARALLEL_MIN_FLOPS {
        // Many small (or mid-sized) products: one thread each, batches in parallel.
        super::pool::install(|| {
            let per_task = (BATCHED_MATMUL_PARALLEL_MIN_FLOPS / flops.max(1))
                .clamp(1, batches.div_ceil(rayon::current_num_threads()));
            let tasks = batches.div_ceil(per_task);
            (0..tasks).into_par_iter().for_each(|t| run_batches(t * per_task..batches.min((t + 1) * per_task), false));
        });
    } else {
        run_batches(0..batches, true);
    }
    Ok(())
}

/// The row stride of the `batches * m` rows of an operand if they are evenly spaced (the
/// batch dimensions and the row dimension merge into one), else `None`.
fn rows_stride(batch: &[usize], batch_strides: &[isize], m: usize, row_stride: isize) -> Option<isize> {
    let dims = batch.iter().zip(batch_strides).map(|(&s, &t)| (s, t)).chain([(m, row_stride)]);
    let mut merged: Option<(usize, isize)> = None;
    for (size, stride) in dims.filter(|&(size, _)| size != 1) {
        merged = match merged {
            None => Some((size, stride)),
            Some((outer, outer_stride)) if outer_stride == stride * size as isize => Some((outer * size, stride)),
            Some(_) => return None,
        };
    }
    Some(merged.map_or(row_stride, |(_, stride)| stride))
}

/// Per-task float16 buffers: widened operands (kept while consecutive batches share an
/// operand, as broadcast ones do) and the float32 product.
#[derive(Default)]
struct Scratch {
    a: Vec<f32>,
    a_key: Option<(usize, isize, isize)>,
    b: Vec<f32>,
    b_key: Option<(usize, isize, isize)>,
    c: Vec<f32>,
}

/// One product `out (m x n) = a (m x k) @ b (k x n)` of `dtype`, `k > 0`.
///
/// # Safety
/// As for [`matmul::matmul`].
#[allow(clippy::too_many_arguments)]
unsafe fn multiply(
    dtype: DType,
    m: usize,
    n: usize,
    k: usize,
    a: MatRef,
    b: MatRef,
    out: MatRef,
    parallel: bool,
    scratch: &mut Scratch,
) {
    // SAFETY: (all arms) forwarded from the caller's contract.
    unsafe {
        match dtype {
            DType::F32 | DType::F64 => matmul::matmul(dtype, m, n, k, a, b, out),
            DType::F16 => multiply_f16(m, n, k, a, b, out, scratch),
            DType::I32 => int_matmul::<i32>(m, n, k, a, b, out, parallel),
            DType::I64 => int_matmul::<i64>(m, n, k, a, b, out, parallel),
        }
    }
}

/// Widens a strided `rows x cols` float16 matrix into row-major float32.
///
/// # Safety
/// `src` is valid for its shape and strides.
unsafe fn widen(src: MatRef, rows: usize, cols: usize, dst: &mut Vec<f32>) {
    dst.resize(rows * cols, 0.0);
    let base = src.ptr as *const f16;
    for (i, row) in dst.chunks_exact_mut(cols).enumerate() {
        // SAFETY: row `i < rows` is inside the matrix (caller's contract).
        let start = unsafe { base.offset(i as isize * src.row_stride) };
        if src.col_stride == 1 {
            // SAFETY: the row's `cols` elements are consecutive.
            unsafe { std::slice::from_raw_parts(start, cols) }.convert_to_f32_slice(row);
        } else {
            for (j, d) in row.iter_mut().enumerate() {
                // SAFETY: element `j < cols` of the row.
                *d = unsafe { *start.offset(j as isize * src.col_stride) }.to_f32();
            }
        }
    }
}

/// float16 through float32: widen, multiply with the float32 gemm, round once.
///
/// # Safety
/// As for [`matmul::matmul`].
unsafe fn multiply_f16(m: usize, n: usize, k: usize, a: MatRef, b: MatRef, out: MatRef, s: &mut Scratch) {
    let key = |x: MatRef| Some((x.ptr as usize, x.row_stride, x.col_stride));
    if s.a_key != key(a) {
        // SAFETY: `a` is valid (caller's contract).
        unsafe { widen(a, m, k, &mut s.a) };
        s.a_key = key(a);
    }
    if s.b_key != key(b) {
        // SAFETY: `b` is valid (caller's contract).
        unsafe { widen(b, k, n, &mut s.b) };
        s.b_key = key(b);
    }
    s.c.resize(m * n, 0.0);
    let mat =
        |v: &[f32], cols: usize| MatRef { ptr: v.as_ptr() as *const u8, row_stride: cols as isize, col_stride: 1 };
    let c = MatRef { ptr: s.c.as_mut_ptr() as *const u8, row_stride: n as isize, col_stride: 1 };
    // SAFETY: row-major scratch matrices of the right sizes; `c` is only written.
    unsafe { matmul::matmul(DType::F32, m, n, k, mat(&s.a, k), mat(&s.b, n), c) };
    let base = out.ptr as *mut f16;
    for (i, row) in s.c.chunks_exact(n).enumerate() {
        // SAFETY: row `i < m` of `out` (caller's contract).
        let start = unsafe { base.offset(i as isize * out.row_stride) };
        if out.col_stride == 1 {
            // SAFETY: the row's `n` elements are consecutive and only this call writes them.
            unsafe { std::slice::from_raw_parts_mut(start, n) }.convert_from_f32_slice(row);
        } else {
            for (j, &v) in row.iter().enumerate() {
                // SAFETY: element `j < n` of the row.
                unsafe { *start.offset(j as isize * out.col_stride) = f16::from_f32(v) };
            }
        }
    }
}

/// Integers with numpy's wrapping `+` and `*`.
trait IntElement: Element + Default {
    fn wrapping_mul_add(acc: Self, a: Self, b: Self) -> Self;
}

impl IntElement for i32 {
    #[inline(always)]
    fn wrapping_mul_add(acc: Self, a: Self, b: Self) -> Self {
        acc.wrapping_add(a.wrapping_mul(b))
    }
}

impl IntElement for i64 {
    #[inline(always)]
    fn wrapping_mul_add(acc: Self, a: Self, b: Self) -> Self {
        acc.wrapping_add(a.wrapping_mul(b))
    }
}

/// Rows of `a` per tile (and per parallel task).
const TILE_M: usize = 16;
/// Columns of `b` per tile: a tile row of the accumulator stays in L1.
const TILE_N: usize = 256;
/// Depth per tile: `TILE_K x TILE_N` of packed `b` stays in L2.
const TILE_K: usize = 128;

avx2_multiversion!(
    /// `acc[j] += sum_p a_row[p] * b[p * ldb + j]`, the i-k-j inner loops of one tile row.
    fn tile_row<T: IntElement>(acc: &mut [T], a_row: &[T], b: &[T], ldb: usize) {
        let width = acc.len();
        for (p, &x) in a_row.iter().enumerate() {
            let b_row = &b[p * ldb..p * ldb + width];
            for (c, &y) in acc.iter_mut().zip(b_row) {
                *c = T::wrapping_mul_add(*c, x, y);
            }
        }
    }
);

/// Integer `out = a @ b` with wrapping arithmetic, tiled over rows, columns and depth.
///
/// # Safety
/// As for [`matmul::matmul`], with elements of `T`.
#[allow(clippy::too_many_arguments)]
unsafe fn int_matmul<T: IntElement>(m: usize, n: usize, k: usize, a: MatRef, b: MatRef, out: MatRef, parallel: bool) {
    // Pack `b` row-major so every inner loop reads consecutive memory.
    let b_base = b.ptr as *const T;
    let packed: Vec<T> = (0..k * n)
        .map(|idx| {
            let (p, j) = (idx / n, idx % n);
            // SAFETY: element (p, j) of `b` (caller's contract).
            unsafe { *b_base.offset(p as isize * b.row_stride + j as isize * b.col_stride) }
        })
        .collect();
    let (a_addr, a_rs, a_cs) = (a.ptr as usize, a.row_stride, a.col_stride);
    let (o_addr, o_rs, o_cs) = (out.ptr as usize, out.row_stride, out.col_stride);
    let row_block = |block: usize| {
        let i0 = block * TILE_M;
        let rows = TILE_M.min(m - i0);
        let mut acc = vec![T::default(); rows * TILE_N];
        let mut a_tile = [T::default(); TILE_K];
        for j0 in (0..n).step_by(TILE_N) {
            let width = TILE_N.min(n - j0);
            acc.iter_mut().for_each(|c| *c = T::default());
            for p0 in (0..k).step_by(TILE_K) {
                let depth = TILE_K.min(k - p0);
                for i in 0..rows {
                    let a_row = (a_addr as *const T).wrapping_offset((i0 + i) as isize * a_rs);
                    for (p, slot) in a_tile[..depth].iter_mut().enumerate() {
                        // SAFETY: element (i0 + i, p0 + p) of `a`.
                        *slot = unsafe { *a_row.offset((p0 + p) as isize * a_cs) };
                    }
                    tile_row(&mut acc[i * TILE_N..i * TILE_N + width], &a_tile[..depth], &packed[p0 * n + j0..], n);
                }
            }
            for i in 0..rows {
                let o_row = (o_addr as *mut T).wrapping_offset((i0 + i) as isize * o_rs);
                for (j, &v) in acc[i * TILE_N..i * TILE_N + width].iter().enumerate() {
                    // SAFETY: element (i0 + i, j0 + j) of `out`, written by this block only.
                    unsafe { *o_row.offset((j0 + j) as isize * o_cs) = v };
                }
            }
        }
    };
    let blocks = m.div_ceil(TILE_M);
    if parallel && blocks > 1 && m.saturating_mul(n).saturating_mul(k) >= BATCHED_MATMUL_PARALLEL_MIN_FLOPS {
        super::pool::install(|| (0..blocks).into_par_iter().for_each(row_block));
    } else {
        (0..blocks).for_each(row_block);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A strided operand over a buffer: shape, strides, offset of element 0.
    #[derive(Clone)]
    struct Layout {
        shape: Vec<usize>,
        strides: Vec<isize>,
        offset: isize,
    }

    fn c_order(shape: &[usize]) -> Layout {
        Layout { shape: shape.into(), strides: opbridge_runtime::tensor::contiguous_strides(shape), offset: 0 }
    }

    /// The last two dimensions stored transposed.
    fn transposed(shape: &[usize]) -> Layout {
        let nd = shape.len();
        let mut stored = shape.to_vec();
        stored.swap(nd - 2, nd - 1);
        let mut strides = opbridge_runtime::tensor::contiguous_strides(&stored);
        strides.swap(nd - 2, nd - 1);
        Layout { shape: shape.into(), strides, offset: 0 }
    }

    /// Every dimension reversed (negative strides).
    fn reversed(shape: &[usize]) -> Layout {
        let strides: Vec<isize> = opbridge_runtime::tensor::contiguous_strides(shape).iter().map(|s| -s).collect();
        let offset = shape.iter().zip(&strides).map(|(&d, &s)| (d as isize - 1) * -s).sum();
        Layout { shape: shape.into(), strides, offset }
    }

    fn span(l: &Layout) -> usize {
        if l.shape.iter().product::<usize>() == 0 {
            return 0;
        }
        l.shape.iter().zip(&l.strides).map(|(&d, &s)| (d as isize - 1) * s.abs()).sum::<isize>() as usize + 1
    }

    fn make<T: Element>(l: &Layout, seed: usize) -> Vec<T> {
        let n = span(l).max(1);
        let int = matches!(T::DTYPE, DType::I32 | DType::I64);
        (0..n)
            .map(|i| {
                let v = ((i * 7919 + seed * 104_729) % 19) as f64 - 9.0;
                T::from_f64(if int { v } else { v / 8.0 })
            })
            .collect()
    }

    fn view_of<T: Element>(buf: &[T], l: &Layout) -> TensorView {
        TensorView {
            data: buf.as_ptr().wrapping_offset(l.offset) as usize,
            dtype: T::DTYPE,
            shape: l.shape.clone().into(),
            strides: l.strides.clone().into(),
        }
    }

    fn at<T: Element>(buf: &[T], l: &Layout, idx: &[usize]) -> T {
        let off: isize = l.offset + idx.iter().zip(&l.strides).map(|(&i, &s)| i as isize * s).sum::<isize>();
        buf[off as usize]
    }

    fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
        let mut idx = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            idx[d] = i % shape[d];
            i /= shape[d];
        }
        idx
    }

    /// Multiplies and compares with a scalar reference that follows numpy's rules literally.
    fn check<T: Element>(la: &Layout, lb: &Layout, transposed_out: bool) {
        let a = make::<T>(la, 1);
        let b = make::<T>(lb, 2);
        let shape = matmul_shapes(&la.shape, &lb.shape).unwrap();
        let lo = if transposed_out && shape.len() >= 2 { transposed(&shape) } else { c_order(&shape) };
        let mut out = vec![T::from_f64(-99.0); span(&lo).max(1)];
        let out_view = TensorView { data: out.as_mut_ptr() as usize, ..view_of(&out, &lo) };
        // SAFETY: views over live buffers; `out` is disjoint from the inputs.
        unsafe { batched_matmul(&view_of(&a, la), &view_of(&b, lb), &out_view) }.unwrap();

        let (a_vec, b_vec) = (la.shape.len() == 1, lb.shape.len() == 1);
        let k = *la.shape.last().unwrap();
        let batch_nd = shape.len() - usize::from(!a_vec) - usize::from(!b_vec);
        let int = matches!(T::DTYPE, DType::I32 | DType::I64);
        for o in 0..shape.iter().product() {
            let oi = unravel(o, &shape);
            let (bi, rest) = oi.split_at(batch_nd);
            let i = if a_vec { None } else { Some(rest[0]) };
            let j = if b_vec { None } else { Some(*rest.last().unwrap()) };
            // Index of an operand: broadcast batch dims (right-aligned, size 1 -> 0), then core.
            let index = |l: &Layout, core: &[usize]| -> Vec<usize> {
                let own = l.shape.len() - core.len();
                let mut idx: Vec<usize> =
                    (0..own).map(|d| if l.shape[d] == 1 { 0 } else { bi[batch_nd - own + d] }).collect();
                idx.extend_from_slice(core);
                idx
            };
            let (mut exact, mut bound, mut wrapped) = (0f64, 0f64, 0i64);
            for p in 0..k {
                let x = at(&a, la, &index(la, &[i.into_iter().collect::<Vec<_>>(), vec![p]].concat()));
                let y = at(&b, lb, &index(lb, &[vec![p], j.into_iter().collect::<Vec<_>>()].concat()));
                exact += x.to_f64() * y.to_f64();
                bound += (x.to_f64() * y.to_f64()).abs();
                wrapped = wrapped.wrapping_add(x.to_i64().wrapping_mul(y.to_i64()));
            }
            let got = at(&out, &lo, &oi);
            if int {
                assert_eq!(
                    got.to_i64(),
                    T::from_i64(wrapped).to_i64(),
                    "{} a {:?} b {:?} at {oi:?}",
                    T::DTYPE,
                    la.shape,
                    lb.shape
                );
            } else {
                let tol = match T::DTYPE {
                    DType::F16 => 1e-3 * bound.max(exact.abs()) + 1e-7,
                    DType::F32 => 1e-6 * bound + 1e-30,
                    _ => 1e-13 * bound + 1e-300,
                };
                assert!(
                    (got.to_f64() - exact).abs() <= tol,
                    "{} a {:?} {:?} b {:?} {:?} at {oi:?}: got {}, want {exact}",
                    T::DTYPE,
                    la.shape,
                    la.strides,
                    lb.shape,
                    lb.strides,
                    got.to_f64()
                );
            }
        }
    }

    fn check_layouts<T: Element>(a: &[usize], b: &[usize]) {
        let layouts = |s: &[usize]| -> Vec<Layout> {
            if s.len() >= 2 {
                vec![c_order(s), transposed(s), reversed(s)]
            } else {
                vec![c_order(s), reversed(s)]
            }
        };
        for la in layouts(a) {
            for lb in layouts(b) {
                check::<T>(&la, &lb, false);
            }
        }
        check::<T>(&c_order(a), &c_order(b), true);
    }

    #[test]
    fn shapes_follow_numpy() {
        let ok: [(&[usize], &[usize], &[usize]); 9] = [
            (&[3], &[3], &[]),
            (&[2, 3], &[3], &[2]),
            (&[3], &[3, 4], &[4]),
            (&[2, 3], &[3, 4], &[2, 4]),
            (&[5, 2, 3], &[3, 4], &[5, 2, 4]),
            (&[5, 1, 2, 3], &[4, 3, 6], &[5, 4, 2, 6]),
            (&[3], &[7, 3, 4], &[7, 4]),
            (&[7, 2, 3], &[3], &[7, 2]),
            (&[0, 2, 0], &[0, 5], &[0, 2, 5]),
        ];
        for (a, b, want) in ok {
            assert_eq!(matmul_shapes(a, b).unwrap(), want, "{a:?} @ {b:?}");
        }
        assert_eq!(
            matmul_shapes(&[2, 3], &[4, 5]).unwrap_err().to_string(),
            "Input operand 1 has a mismatch in its core dimension 0, with gufunc signature \
             (n?,k),(k,m?)->(n?,m?) (size 4 is different from 3)"
        );
        assert_eq!(
            matmul_shapes(&[], &[3]).unwrap_err().to_string(),
            "Input operand 0 does not have enough dimensions (has 0, gufunc core with signature \
             (n?,k),(k,m?)->(n?,m?) requires 1)"
        );
        assert!(matmul_shapes(&[3], &[])
            .unwrap_err()
            .to_string()
            .contains("Input operand 1 does not have enough dimensions"));
        assert_eq!(
            matmul_shapes(&[2, 2, 3], &[3, 3, 4]).unwrap_err().to_string(),
            "batch dimensions [2] of a (shape [2, 2, 3]) and [3] of b (shape [3, 3, 4]) cannot be broadcast together"
        );
    }

    #[test]
    fn every_dtype_shape_rule_and_layout() {
        let cases: [(&[usize], &[usize]); 11] = [
            (&[3], &[3]),
            (&[2, 3], &[3]),
            (&[3], &[3, 4]),
            (&[2, 3], &[3, 4]),
            (&[5, 2, 3], &[3, 4]), // b shared: one tall gemm
            (&[5, 2, 3], &[5, 3, 4]),
            (&[2, 1, 2, 3], &[3, 3, 4]), // batch broadcast on both sides
            (&[1, 2, 3], &[4, 3, 2]),
            (&[3], &[2, 3, 4]),
            (&[2, 3, 4], &[4]),
            (&[1, 1], &[1, 1]),
        ];
        for dtype in DType::ALL {
            crate::with_dtype!(dtype, T => {
                for (a, b) in cases {
                    check_layouts::<T>(a, b);
                }
            })
        }
    }

    #[test]
    fn broadcast_strides_empty_and_zero_depth() {
        for dtype in DType::ALL {
            crate::with_dtype!(dtype, T => {
                // A batch dimension with stride 0 (an expanded array).
                let expanded = Layout { shape: vec![3, 2, 3], strides: vec![0, 3, 1], offset: 0 };
                check::<T>(&expanded, &c_order(&[3, 3, 4]), false);
                let expanded_b = Layout { shape: vec![3, 3, 2], strides: vec![0, 2, 1], offset: 0 };
                check::<T>(&c_order(&[3, 4, 3]), &expanded_b, false);
                // k == 0: zeros. m == 0 or no batches: nothing to write.
                check::<T>(&c_order(&[2, 0]), &c_order(&[0, 3]), false);
                check::<T>(&c_order(&[4, 2, 0]), &c_order(&[0, 3]), false);
                check::<T>(&c_order(&[0, 3]), &c_order(&[3, 2]), false);
                check::<T>(&c_order(&[0, 2, 3]), &c_order(&[3, 2]), false);
            })
        }
    }

    #[test]
    fn large_and_many_small_products() {
        for dtype in DType::ALL {
            crate::with_dtype!(dtype, T => {
                // Many small batches: batches in parallel.
                check::<T>(&c_order(&[512, 8, 8]), &c_order(&[512, 8, 8]), false);
                // One product large enough for parallel tiles (integer) or gemm threads.
                check::<T>(&c_order(&[70, 300]), &transposed(&[300, 70]), false);
            })
        }
    }

    #[test]
    fn integers_wrap_like_numpy() {
        let a = [i32::MAX, 2];
        let b = [2, i32::MAX];
        let mut out = [0i32];
        let va = TensorView::contiguous(a.as_ptr() as usize, DType::I32, &[1, 2]);
        let vb = TensorView::contiguous(b.as_ptr() as usize, DType::I32, &[2, 1]);
        let vo = TensorView::contiguous(out.as_mut_ptr() as usize, DType::I32, &[1, 1]);
        // SAFETY: views over live, disjoint buffers.
        unsafe { batched_matmul(&va, &vb, &vo) }.unwrap();
        assert_eq!(out[0], i32::MAX.wrapping_mul(2).wrapping_mul(2));
    }

    #[test]
    fn float16_accumulates_in_float32() {
        // 4096 products of 0.1 * 0.1: float16 running sums would stall far below the answer.
        let k = 4096;
        let a = vec![f16::from_f32(0.1); k];
        let b = vec![f16::from_f32(0.1); k];
        let mut out = [f16::ZERO];
        let va = TensorView::contiguous(a.as_ptr() as usize, DType::F16, &[k]);
        let vb = TensorView::contiguous(b.as_ptr() as usize, DType::F16, &[k]);
        let vo = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F16, &[]);
        // SAFETY: views over live, disjoint buffers.
        unsafe { batched_matmul(&va, &vb, &vo) }.unwrap();
        let exact = f16::from_f32(0.1).to_f64().powi(2) * k as f64;
        assert_eq!(out[0], f16::from_f64(exact));
    }

    #[test]
    fn argument_errors() {
        let a = [0f32; 6];
        let b = [0f64; 6];
        let mut out = [0f32; 4];
        let va = TensorView::contiguous(a.as_ptr() as usize, DType::F32, &[2, 3]);
        let vb = TensorView::contiguous(b.as_ptr() as usize, DType::F64, &[3, 2]);
        let vo = TensorView::contiguous(out.as_mut_ptr() as usize, DType::F32, &[2, 2]);
        // SAFETY: (all calls) validation fails before anything is read or written.
        unsafe {
            assert_eq!(
                batched_matmul(&va, &vb, &vo).unwrap_err().to_string(),
                "a, b and out must share one dtype, got float32, float64 and float32"
            );
            let vb = TensorView { dtype: DType::F32, ..vb };
            let wrong = TensorView { shape: smallvec::smallvec![4], strides: smallvec::smallvec![1], ..vo.clone() };
            assert_eq!(
                batched_matmul(&va, &vb, &wrong).unwrap_err().to_string(),
                "out must have shape [2, 2], got [4]"
            );
            assert!(batched_matmul(&va, &va, &vo).unwrap_err().to_string().contains("mismatch in its core dimension"));
        }
    }
}
