//! `embedding_bag`: the recommender-system lookup. Each bag sums, averages or takes the
//! elementwise maximum of the weight rows its indices name, like
//! `torch.nn.functional.embedding_bag(indices, weight, offsets, mode=...)` with
//! `include_last_offset=False`.
//!
//! Every index and offset is checked before any weight row is read: a bad one is an error that
//! names the value and its position, never a read out of bounds. Sums and means accumulate in
//! float64 for every dtype and round once; `max` propagates NaN like numpy's `maximum` (torch's
//! CPU kernel skips NaN rows after the first); empty bags give zeros in every mode, as torch.
#![allow(unsafe_code)]

use half::f16;
use opbridge_runtime::DType;
use rayon::prelude::*;

use super::error::KernelError;
use super::reduce::avx2_multiversion;
use super::thresholds::EMBEDDING_PARALLEL_MIN_ELEMS;
use super::Element;
use crate::view::TensorView;

/// Gathered elements per parallel task (whole bags).
const TASK_ELEMS: usize = 1 << 14;

/// How a bag combines its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BagMode {
    Sum,
    Mean,
    Max,
}

impl BagMode {
    /// torch's name for the mode.
    pub const fn name(self) -> &'static str {
        match self {
            BagMode::Sum => "sum",
            BagMode::Mean => "mean",
            BagMode::Max => "max",
        }
    }
}

/// `out[b] = reduce(weight[indices[offsets[b]..offsets[b + 1]]])` for every bag `b` (the last
/// bag ends at `indices.len()`).
///
/// - `weight`: `(num_embeddings, dim)`, float16, float32 or float64, any strides.
/// - `indices`, `offsets`: 1-D int32 or int64 (each may be either), any stride. `offsets[0]`
///   is 0, offsets never decrease and never pass `indices.len()`; every index lies in
///   `0..num_embeddings`. Anything else is an `Err` naming the value and its position.
/// - `out`: `(offsets.len(), dim)` with weight's dtype, any strides.
///
/// # Safety
/// Each view describes valid, aligned memory for its shape, strides and dtype; `out` is
/// writable, overlaps none of the inputs, and no other thread touches it during the call.
pub unsafe fn embedding_bag(
    weight: &TensorView,
    indices: &TensorView,
    offsets: &TensorView,
    mode: BagMode,
    out: &TensorView,
) -> Result<(), KernelError> {
    for (what, v) in [("weight", weight), ("indices", indices), ("offsets", offsets), ("out", out)] {
        if v.shape.len() != v.strides.len() {
            return Err(KernelError::MalformedView { what, dims: v.shape.len(), strides: v.strides.len() });
        }
    }
    let &[num_embeddings, dim] = weight.shape.as_slice() else {
        return Err(KernelError::Rank {
            what: "weight",
            expected: "2-D (num_embeddings, dim)",
            got: weight.shape.to_vec(),
        });
    };
    if !weight.dtype.is_float() {
        return Err(KernelError::DTypeNotIn {
            what: "weight",
            expected: "float16, float32 or float64",
            got: weight.dtype,
        });
    }
    for (what, v) in [("indices", indices), ("offsets", offsets)] {
        if v.ndim() != 1 {
            return Err(KernelError::Rank { what, expected: "1-D", got: v.shape.to_vec() });
        }
        if v.dtype.is_float() {
            return Err(KernelError::DTypeNotIn { what, expected: "int32 or int64", got: v.dtype });
        }
    }
    let bags = offsets.shape[0];
    if out.dtype != weight.dtype {
        return Err(KernelError::DTypeMismatch { what: "out", expected: weight.dtype, like: "weight", got: out.dtype });
    }
    if out.shape.as_slice() != [bags, dim] {
        return Err(KernelError::Shape {
            what: "out",
            expected: format!("[{bags}, {dim}] (bags, dim)"),
            got: out.shape.to_vec(),
        });
    }

    // Validate everything before touching a weight row.
    // SAFETY: both are valid 1-D integer views (caller's contract, dtypes checked above).
    let (rows, starts) = unsafe { (read_ints(indices)?, read_ints(offsets)?) };
    let (rows_checked, bounds) = check_bags(num_embeddings, &rows, &starts)?;
    if bags == 0 || dim == 0 {
        return Ok(());
    }
    let plan = Plan {
        weight: weight.data,
        w_row: weight.strides[0],
        w_col: weight.strides[1],
        out: out.data,
        o_row: out.strides[0],
        o_col: out.strides[1],
        dim,
        rows: &rows_checked,
        bounds: &bounds,
        mode,
    };
    // SAFETY: the caller's contract; every row index is below `num_embeddings` and every bag
    // range lies inside `rows` (validated above); `T` matches both dtypes.
    unsafe {
        match weight.dtype {
            DType::F16 => run::<f16>(&plan),
            DType::F32 => run::<f32>(&plan),
            DType::F64 => run::<f64>(&plan),
            DType::I32 | DType::I64 => unreachable!("checked above: weight is a float dtype"),
        }
    }
    Ok(())
}

/// The elements of a 1-D int32/int64 view as i64.
///
/// # Safety
/// `v` is a valid 1-D view of its (integer) dtype.
/// The row of every index (each in `0..num_embeddings`) and the bounds of every bag (offsets
/// from 0, non-decreasing, within the indices; the last bag ends at the last index).
fn check_bags(num_embeddings: usize, rows: &[i64], starts: &[i64]) -> Result<(Vec<usize>, Vec<usize>), KernelError> {
    let mut rows_checked = Vec::with_capacity(rows.len());
    for (position, &row) in rows.iter().enumerate() {
        if row < 0 || row as u64 >= num_embeddings as u64 {
            return Err(KernelError::IndexOutOfRange { position, index: row, rows: num_embeddings });
        }
        rows_checked.push(row as usize);
    }
    let mut bounds = Vec::with_capacity(starts.len() + 1);
    for (position, &start) in starts.iter().enumerate() {
        if position == 0 && start != 0 {
            return Err(KernelError::OffsetsStart { got: start });
        }
        if position > 0 && start < starts[position - 1] {
            return Err(KernelError::OffsetsDecrease { position, offset: start, previous: starts[position - 1] });
        }
        if start as u64 > rows.len() as u64 {
            return Err(KernelError::OffsetBeyondEnd { position, offset: start, len: rows.len() });
        }
        bounds.push(start as usize);
    }
    bounds.push(rows.len());
    Ok((rows_checked, bounds))
}

/// The checks of [`embedding_bag`] that need the indices' and offsets' values, on their bytes
/// (little-endian int32 or int64, any alignment): for a device whose kernel cannot make them
/// before it runs, by a caller that has the bytes on the host (a server's request).
pub fn check_bag_values(
    num_embeddings: usize,
    indices: (&[u8], DType),
    offsets: (&[u8], DType),
) -> Result<(), KernelError> {
    let ints = |(bytes, dtype): (&[u8], DType), what: &'static str| -> Result<Vec<i64>, KernelError> {
        Ok(match dtype {
            DType::I32 => {
                bytes.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64).collect()
            }
            DType::I64 => bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect(),
            got => return Err(KernelError::DTypeNotIn { what, expected: "int32 or int64", got }),
        })
    };
    check_bags(num_embeddings, &ints(indices, "indices")?, &ints(offsets, "offsets")?).map(drop)
}

unsafe fn read_ints(v: &TensorView) -> Result<Vec<i64>, KernelError> {
    let (n, stride) = (v.shape[0], v.strides[0]);
    // A broadcast view may be far larger logically than in memory: a typed error, not an abort.
    super::error::check_scratch(n, 8)?;
    Ok(match v.dtype {
        DType::I32 => {
            let base = v.data as *const i32;
            // SAFETY: `i < n` is an element of the view (caller's contract).
            (0..n).map(|i| unsafe { *base.offset(i as isize * stride) } as i64).collect()
        }
        DType::I64 => {
            let base = v.data as *const i64;
            // SAFETY: as above.
            (0..n).map(|i| unsafe { *base.offset(i as isize * stride) }).collect()
        }
        _ => unreachable!("callers check for an integer dtype"),
    })
}

/// A validated call: addresses and strides (elements), row indices, bag bounds.
struct Plan<'a> {
    weight: usize,
    w_row: isize,
    w_col: isize,
    out: usize,
    o_row: isize,
    o_col: isize,
    dim: usize,
    rows: &'a [usize],
    /// `bags + 1` bounds into `rows`.
    bounds: &'a [usize],
    mode: BagMode,
}

avx2_multiversion!(
    fn add_row<T: Element>(acc: &mut [f64], row: &[T]) {
        for (a, &x) in acc.iter_mut().zip(row) {
            *a += x.to_f64();
        }
    }
);

/// # Safety
/// As for [`embedding_bag`] after validation: every row in `p.rows` exists in the weight, and
/// `p.bounds` is a non-decreasing sequence within `0..=p.rows.len()`.
unsafe fn run<T: Element + PartialOrd>(p: &Plan) {
    let bags = p.bounds.len() - 1;
    let do_bags = |bag_range: std::ops::Range<usize>| {
        let mut acc = vec![0f64; p.dim];
        let mut best: Vec<T> = Vec::with_capacity(p.dim);
        for bag in bag_range {
            let rows = &p.rows[p.bounds[bag]..p.bounds[bag + 1]];
            let out_row = (p.out as *mut T).wrapping_offset(bag as isize * p.o_row);
            let weight_row = |r: usize| (p.weight as *const T).wrapping_offset(r as isize * p.w_row);
            let write = |d: usize, v: T| {
                // SAFETY: `d < dim` and `bag < bags` are inside `out`, written by this task only.
                unsafe { *out_row.offset(d as isize * p.o_col) = v };
            };
            if rows.is_empty() {
                (0..p.dim).for_each(|d| write(d, T::from_f64(0.0)));
                continue;
            }
            match p.mode {
                BagMode::Sum | BagMode::Mean => {
                    acc.fill(0.0);
                    for &r in rows {
                        let w = weight_row(r);
                        if p.w_col == 1 {
                            // SAFETY: row `r` exists (validated) and holds `dim` consecutive
                            // elements.
                            let w = unsafe { std::slice::from_raw_parts(w, p.dim) };
                            add_row(&mut acc, w);
                        } else {
                            for (d, a) in acc.iter_mut().enumerate() {
                                // SAFETY: element `d < dim` of row `r`, which exists.
                                *a += unsafe { *w.offset(d as isize * p.w_col) }.to_f64();
                            }
                        }
                    }
                    let count = rows.len() as f64;
                    for (d, &a) in acc.iter().enumerate() {
                        write(d, T::from_f64(if p.mode == BagMode::Mean { a / count } else { a }));
                    }
                }
                BagMode::Max => {
                    best.clear();
                    let first = weight_row(rows[0]);
                    // SAFETY: element `d < dim` of a validated row.
                    best.extend((0..p.dim).map(|d| unsafe { *first.offset(d as isize * p.w_col) }));
                    for &r in &rows[1..] {
                        let w = weight_row(r);
                        for (d, m) in best.iter_mut().enumerate() {
                            // SAFETY: as above.
                            let x = unsafe { *w.offset(d as isize * p.w_col) };
                            // numpy's maximum: a NaN wins and then stays.
                            if x > *m || x.to_f64().is_nan() {
                                *m = x;
                            }
                        }
                    }
                    for (d, &m) in best.iter().enumerate() {
                        write(d, m);
                    }
                }
            }
        }
    };
    let work = p.rows.len().max(bags).saturating_mul(p.dim);
    if work >= EMBEDDING_PARALLEL_MIN_ELEMS && bags > 1 {
        // Tasks of whole bags with about TASK_ELEMS gathered elements each.
        let per_bag = work / bags;
        let per_task = (TASK_ELEMS / per_bag.max(1)).max(1);
        let tasks = bags.div_ceil(per_task);
        super::pool::install(|| {
            (0..tasks).into_par_iter().for_each(|t| do_bags(t * per_task..bags.min((t + 1) * per_task)))
        });
    } else {
        do_bags(0..bags);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view<T: Element>(v: &[T], shape: &[usize], strides: &[isize], offset: isize) -> TensorView {
        TensorView {
            data: v.as_ptr().wrapping_offset(offset) as usize,
            dtype: T::DTYPE,
            shape: shape.into(),
            strides: strides.into(),
        }
    }

    fn view_mut<T: Element>(v: &mut [T], shape: &[usize], strides: &[isize]) -> TensorView {
        TensorView { data: v.as_mut_ptr() as usize, dtype: T::DTYPE, shape: shape.into(), strides: strides.into() }
    }

    fn ints<I: Element>(v: &[i64]) -> Vec<I> {
        v.iter().map(|&x| I::from_i64(x)).collect()
    }

    /// Scalar reference over f64: weight rows `w[r]`.
    fn reference(w: &[Vec<f64>], rows: &[i64], offsets: &[i64], mode: BagMode, dim: usize) -> Vec<Vec<f64>> {
        (0..offsets.len())
            .map(|b| {
                let start = offsets[b] as usize;
                let end = offsets.get(b + 1).map_or(rows.len(), |&o| o as usize);
                let bag = &rows[start..end];
                if bag.is_empty() {
                    return vec![0.0; dim];
                }
                (0..dim)
                    .map(|d| {
                        let vals = bag.iter().map(|&r| w[r as usize][d]);
                        match mode {
                            BagMode::Sum => vals.sum(),
                            BagMode::Mean => vals.sum::<f64>() / bag.len() as f64,
                            BagMode::Max => vals.fold(f64::NEG_INFINITY, |m, x| {
                                if x > m || x.is_nan() || m.is_nan() {
                                    if m.is_nan() {
                                        m
                                    } else {
                                        x
                                    }
                                } else {
                                    m
                                }
                            }),
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Runs every mode with weight given as `(shape, strides, offset)` over `wbuf` and compares
    /// with the reference; `out` is written transposed when `transposed_out`.
    #[allow(clippy::too_many_arguments)]
    fn check<T: Element + PartialOrd, I: Element>(
        wbuf: &[T],
        wshape: [usize; 2],
        wstrides: [isize; 2],
        woffset: isize,
        rows: &[i64],
        offsets: &[i64],
        transposed_out: bool,
    ) {
        let weight = view(wbuf, &wshape, &wstrides, woffset);
        let w: Vec<Vec<f64>> = (0..wshape[0])
            .map(|r| {
                (0..wshape[1])
                    .map(|d| wbuf[(woffset + r as isize * wstrides[0] + d as isize * wstrides[1]) as usize].to_f64())
                    .collect()
            })
            .collect();
        let (bags, dim) = (offsets.len(), wshape[1]);
        let idx = ints::<I>(rows);
        let off = ints::<I>(offsets);
        for mode in [BagMode::Sum, BagMode::Mean, BagMode::Max] {
            let mut buf = vec![T::from_f64(-7.0); bags * dim];
            let strides: [isize; 2] = if transposed_out { [1, bags as isize] } else { [dim as isize, 1] };
            let out = view_mut(&mut buf, &[bags, dim], &strides);
            // SAFETY: views over live buffers; `out` overlaps none of the inputs.
            unsafe {
                embedding_bag(&weight, &view(&idx, &[rows.len()], &[1], 0), &view(&off, &[bags], &[1], 0), mode, &out)
            }
            .unwrap();
            let want = reference(&w, rows, offsets, mode, dim);
            let tol = if T::DTYPE == DType::F16 { 2e-3 } else { 1e-6 };
            for b in 0..bags {
                for d in 0..dim {
                    let got = buf[(b as isize * strides[0] + d as isize * strides[1]) as usize].to_f64();
                    let w = want[b][d];
                    assert!(
                        (got.is_nan() && w.is_nan()) || got == w || (got - w).abs() <= tol * w.abs().max(1.0),
                        "{mode:?} {} bag {b} dim {d}: got {got}, want {w}",
                        T::DTYPE
                    );
                }
            }
        }
    }

    fn weights<T: Element>(n: usize) -> Vec<T> {
        (0..n).map(|i| T::from_f64((((i * 7919) % 31) as f64 - 15.0) / 8.0)).collect()
    }

    #[test]
    fn every_mode_dtype_and_index_type() {
        let rows = [0, 2, 4, 2, 9, 1, 1, 3, 0];
        let offsets = [0, 2, 2, 5, 8]; // bag 1 is empty; bag 4 has one row
        for dtype in [DType::F16, DType::F32, DType::F64] {
            crate::with_dtype!(dtype, T => {
                let w = weights::<T>(10 * 6);
                check::<T, i64>(&w, [10, 6], [6, 1], 0, &rows, &offsets, false);
                check::<T, i32>(&w, [10, 6], [6, 1], 0, &rows, &offsets, true);
                // A transposed weight (strided rows) and a reversed one.
                check::<T, i32>(&w, [6, 10], [1, 6], 0, &[5, 0, 3], &[0, 1], false);
                check::<T, i64>(&w, [10, 6], [-6, -1], 59, &rows, &offsets, false);
                // No bags, no indices, zero-width rows.
                check::<T, i64>(&w, [10, 6], [6, 1], 0, &[], &[], false);
                check::<T, i64>(&w, [10, 6], [6, 1], 0, &[], &[0, 0], false);
                check::<T, i64>(&w, [10, 0], [0, 1], 0, &rows, &offsets, false);
            })
        }
    }

    #[test]
    fn max_propagates_nan_and_keeps_infinities() {
        let mut w = weights::<f32>(4 * 3);
        w[3] = f32::NAN; // row 1, dim 0
        w[7] = f32::INFINITY; // row 2, dim 1
        w[11] = f32::NEG_INFINITY; // row 3, dim 2
        check::<f32, i64>(&w, [4, 3], [3, 1], 0, &[0, 1, 2, 3, 3], &[0, 2, 4], false);
    }

    #[test]
    fn large_inputs_run_in_parallel() {
        let w = weights::<f32>(1000 * 64);
        let rows: Vec<i64> = (0..20_000).map(|i| (i * 7919) % 1000).collect();
        let offsets: Vec<i64> = (0..2000).map(|b| b * 10 - (b % 3)).map(|o: i64| o.max(0)).collect();
        check::<f32, i64>(&w, [1000, 64], [64, 1], 0, &rows, &offsets, false);
    }

    #[test]
    fn bad_indices_and_offsets_are_errors() {
        let w = weights::<f32>(5 * 2);
        let weight = view(&w, &[5, 2], &[2, 1], 0);
        let mut out = vec![0f32; 2 * 2];
        let o = view_mut(&mut out, &[2, 2], &[2, 1]);
        let call = |rows: &[i64], offsets: &[i64]| {
            let (rows, offsets) = (ints::<i64>(rows), ints::<i32>(offsets));
            let o = TensorView { shape: smallvec::smallvec![offsets.len(), 2], ..o.clone() };
            // SAFETY: views over live buffers; validation runs before any weight read.
            unsafe {
                embedding_bag(
                    &weight,
                    &view(&rows, &[rows.len()], &[1], 0),
                    &view(&offsets, &[offsets.len()], &[1], 0),
                    BagMode::Sum,
                    &o,
                )
            }
        };
        assert_eq!(
            call(&[0, 5], &[0, 1]).unwrap_err(),
            KernelError::IndexOutOfRange { position: 1, index: 5, rows: 5 }
        );
        assert_eq!(
            call(&[0, 5], &[0, 1]).unwrap_err().to_string(),
            "indices[1] = 5 is out of range for weight with 5 rows (valid: 0..5)"
        );
        assert_eq!(
            call(&[-1, 0], &[0, 1]).unwrap_err().to_string(),
            "indices[0] = -1 is out of range for weight with 5 rows (valid: 0..5)"
        );
        assert_eq!(call(&[0, 1], &[1, 1]).unwrap_err().to_string(), "offsets[0] must be 0, got 1");
        assert_eq!(
            call(&[0, 1, 2], &[0, 2, 1]).unwrap_err().to_string(),
            "offsets must not decrease, but offsets[2] = 1 < offsets[1] = 2"
        );
        assert_eq!(
            call(&[0, 1], &[0, 3]).unwrap_err().to_string(),
            "offsets[1] = 3 is beyond the end of indices (length 2)"
        );
        call(&[0, 1], &[0, 2]).unwrap();
        call(&[4, 0], &[0, 1]).unwrap();
        // Argument shapes and dtypes.
        let rows = ints::<i64>(&[0, 1]);
        let offsets = ints::<i64>(&[0, 1]);
        let (r, f) = (view(&rows, &[2], &[1], 0), view(&offsets, &[2], &[1], 0));
        let fw = view(&rows, &[1, 2], &[2, 1], 0);
        // SAFETY: (all calls) validation fails before anything is read or written.
        unsafe {
            assert_eq!(
                embedding_bag(&fw, &r, &f, BagMode::Max, &o).unwrap_err().to_string(),
                "weight must be float16, float32 or float64, got int64"
            );
            let fl = view(&w, &[2], &[1], 0);
            assert_eq!(
                embedding_bag(&weight, &fl, &f, BagMode::Max, &o).unwrap_err().to_string(),
                "indices must be int32 or int64, got float32"
            );
            let wrong = TensorView { shape: smallvec::smallvec![3, 2], ..o.clone() };
            assert_eq!(
                embedding_bag(&weight, &r, &f, BagMode::Max, &wrong).unwrap_err().to_string(),
                "out must have shape [2, 2] (bags, dim), got [3, 2]"
            );
        }
    }
}
