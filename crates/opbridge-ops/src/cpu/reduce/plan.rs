//! The traversal of a validated reduction over strided memory: contiguous runs go to the
//! reducer whole, strided lines are folded or gathered into blocks, reduced non-innermost axes
//! accumulate whole rows per output column, and large reductions split into pieces of a fixed
//! size ([`PIECE`]) so float results do not depend on the number of threads.
#![allow(unsafe_code)]

use rayon::prelude::*;

use super::reducers::Reducer;
use super::{offsets_at, COLS, GATHER, LANES, PIECE};
use crate::cpu::error::KernelError;
use crate::cpu::thresholds::REDUCE_PARALLEL_MIN_ELEMS;

/// A validated reduction: addresses, the shape and strides of `x`, the strides of `out` along
/// each dimension of `x` (0 where reduced), and which dimensions are reduced.
pub(super) struct Plan<'a> {
    pub(super) x: usize,
    pub(super) out: usize,
    pub(super) shape: &'a [usize],
    pub(super) xs: &'a [isize],
    pub(super) os: &'a [isize],
    pub(super) reduced: &'a [bool],
}

/// Combines consecutive parts in a balanced tree (pairwise for sums).
fn tree<R: Reducer>(parts: &[R::Part]) -> R::Part {
    if parts.len() == 1 {
        return parts[0];
    }
    let half = parts.len() / 2;
    R::combine(tree::<R>(&parts[..half]), tree::<R>(&parts[half..]))
}

/// Reduces the `n >= 1` elements `base[i * stride]`, the first of which has index `first`.
///
/// # Safety
/// Every `base + i * stride` for `i < n` is a valid element.
unsafe fn line<R: Reducer>(base: *const R::In, n: usize, stride: isize, first: usize) -> R::Part {
    if n == 1 {
        // SAFETY: one valid element (caller's contract).
        return R::start(unsafe { *base }, first);
    }
    if stride == 1 {
        // SAFETY: `n` consecutive valid elements (caller's contract).
        return R::leaf(unsafe { std::slice::from_raw_parts(base, n) }, first);
    }
    if n <= LANES {
        // Short strided lines (many outputs of a short axis): fold one element at a time.
        // SAFETY: `i < n`, inside the line (caller's contract).
        let mut acc = R::start(unsafe { *base }, first);
        for i in 1..n {
            // SAFETY: as above.
            R::push(&mut acc, unsafe { *base.offset(i as isize * stride) }, first + i);
        }
        return acc;
    }
    if n <= GATHER {
        // SAFETY: `i < n`, inside the line (caller's contract).
        let mut buf = [unsafe { *base }; GATHER];
        for (i, slot) in buf.iter_mut().enumerate().take(n).skip(1) {
            // SAFETY: as above.
            *slot = unsafe { *base.offset(i as isize * stride) };
        }
        return R::leaf(&buf[..n], first);
    }
    // Halves on GATHER boundaries: the pairwise tree continues above the gathered blocks.
    let half = (n / 2).next_multiple_of(GATHER);
    // SAFETY: both halves lie inside the line.
    unsafe {
        let left = line::<R>(base, half, stride, first);
        let right = line::<R>(base.offset(half as isize * stride), n - half, stride, first + half);
        R::combine(left, right)
    }
}

/// [`line()`] split into pieces of [`PIECE`] elements reduced in parallel when it is long.
///
/// # Safety
/// As for [`line()`].
unsafe fn line_parallel<R: Reducer>(base: *const R::In, n: usize, stride: isize, first: usize) -> R::Part {
    if n < REDUCE_PARALLEL_MIN_ELEMS {
        // SAFETY: forwarded.
        return unsafe { line::<R>(base, n, stride, first) };
    }
    let pieces = n.div_ceil(PIECE);
    let addr = base as usize;
    let parts: Vec<R::Part> = crate::cpu::pool::install(|| {
        (0..pieces)
            .into_par_iter()
            .map(|p| {
                let start = p * PIECE;
                let len = PIECE.min(n - start);
                let base = addr as *const R::In;
                // SAFETY: the piece lies inside the line.
                unsafe { line::<R>(base.offset(start as isize * stride), len, stride, first + start) }
            })
            .collect()
    });
    tree::<R>(&parts)
}

/// Reduces all of `dims` (size, stride) below `base`, visiting elements in row-major order of
/// `dims` (so indices are flat row-major indices), or in memory order when `R::ORDER_FREE`.
///
/// # Safety
/// Every element of the strided block is valid; the block is not empty.
unsafe fn reduce_block<R: Reducer>(base: *const R::In, dims: &[(usize, isize)]) -> R::Part {
    let mut base = base;
    let mut dims: Vec<(usize, isize)> = dims.iter().copied().filter(|&(size, _)| size != 1).collect();
    if R::ORDER_FREE {
        for (size, stride) in dims.iter_mut() {
            if *stride < 0 {
                // SAFETY: the last element along this dimension is inside the block.
                base = unsafe { base.offset((*size as isize - 1) * *stride) };
                *stride = -*stride;
            }
        }
        dims.sort_by_key(|&(_, stride)| std::cmp::Reverse(stride));
    }
    // Merge dimensions that walk memory like one.
    let mut merged: Vec<(usize, isize)> = Vec::with_capacity(dims.len());
    for (size, stride) in dims {
        match merged.last_mut() {
            Some(last) if last.1 == stride * size as isize => *last = (last.0 * size, stride),
            _ => merged.push((size, stride)),
        }
    }
    let n: usize = merged.iter().map(|d| d.0).product();
    // SAFETY: (all arms) every visited element is inside the block (caller's contract).
    unsafe {
        match merged.len() {
            0 => line::<R>(base, 1, 1, 0),
            1 => line_parallel::<R>(base, n, merged[0].1, 0),
            len => {
                let (outer, inner) = merged.split_at(len - 1);
                let (width, stride) = inner[0];
                let shape: Vec<usize> = outer.iter().map(|d| d.0).collect();
                let strides: Vec<isize> = outer.iter().map(|d| d.1).collect();
                let lines = n / width;
                let addr = base as usize;
                let line_at = |l: usize, parallel: bool| {
                    let [off] = offsets_at(&shape, [&strides], l);
                    let base = (addr as *const R::In).offset(off);
                    if parallel {
                        line_parallel::<R>(base, width, stride, l * width)
                    } else {
                        line::<R>(base, width, stride, l * width)
                    }
                };
                if n < REDUCE_PARALLEL_MIN_ELEMS {
                    let parts = (0..lines).map(|l| line_at(l, false));
                    parts.reduce(R::combine).expect("at least one line")
                } else if width >= PIECE {
                    let parts = (0..lines).map(|l| line_at(l, true));
                    parts.reduce(R::combine).expect("at least one line")
                } else {
                    let per_task = PIECE / width;
                    let tasks = lines.div_ceil(per_task);
                    let parts: Vec<R::Part> = crate::cpu::pool::install(|| {
                        (0..tasks)
                            .into_par_iter()
                            .map(|t| {
                                let lines = t * per_task..lines.min((t + 1) * per_task);
                                lines.map(|l| line_at(l, false)).reduce(R::combine).expect("non-empty task")
                            })
                            .collect()
                    });
                    tree::<R>(&parts)
                }
            }
        }
    }
}

/// Accumulates rows `rows` of a `row_stride`-strided stack of contiguous rows of `acc.len()`
/// columns into `acc` (the first row initializes it).
///
/// # Safety
/// Every row `base + i * row_stride` for `i` in `rows` holds `acc.len()` valid consecutive
/// elements; `rows` is not empty.
unsafe fn columns<R: Reducer>(
    base: *const R::In,
    rows: std::ops::Range<usize>,
    row_stride: isize,
    acc: &mut [R::Part],
) {
    #[inline(always)]
    unsafe fn body<R: Reducer>(
        base: *const R::In,
        rows: std::ops::Range<usize>,
        row_stride: isize,
        acc: &mut [R::Part],
    ) {
        let width = acc.len();
        debug_assert!(width <= COLS, "column tasks are at most COLS wide");
        // SAFETY: the first row is valid (caller's contract).
        let first = unsafe { std::slice::from_raw_parts(base.offset(rows.start as isize * row_stride), width) };
        for (a, &x) in acc.iter_mut().zip(first) {
            *a = R::start(x, rows.start);
        }
        // SAFETY: forwarded.
        unsafe { R::push_rows(acc, base, rows.start + 1..rows.end, row_stride) };
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<R: Reducer>(
            base: *const R::In,
            rows: std::ops::Range<usize>,
            row_stride: isize,
            acc: &mut [R::Part],
        ) {
            // SAFETY: forwarded.
            unsafe { body::<R>(base, rows, row_stride, acc) }
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2; the rest is forwarded.
            return unsafe { avx2::<R>(base, rows, row_stride, acc) };
        }
    }
    // SAFETY: forwarded.
    unsafe { body::<R>(base, rows, row_stride, acc) }
}

/// Runs a validated reduction.
///
/// # Safety
/// As for [`reduce`](super::reduce), with `R::In` and `R::Out` the element types of `x` and
/// `out`.
pub(super) unsafe fn run<R: Reducer>(p: &Plan) -> Result<(), KernelError> {
    let ndim = p.shape.len();
    let n: usize = (0..ndim).filter(|&d| p.reduced[d]).map(|d| p.shape[d]).product();
    let count: usize = (0..ndim).filter(|&d| !p.reduced[d]).map(|d| p.shape[d]).product();
    // Kept dimensions that move: (size, x stride, out stride).
    let kept: Vec<(usize, isize, isize)> =
        (0..ndim).filter(|&d| !p.reduced[d] && p.shape[d] != 1).map(|d| (p.shape[d], p.xs[d], p.os[d])).collect();
    let (x, out) = (p.x, p.out);
    let write = |off: isize, v: R::Out| {
        // SAFETY: offsets computed from positions inside the shapes stay inside `out`
        // (caller's contract); each output element is written by exactly one task.
        unsafe { *(out as *mut R::Out).offset(off) = v }
    };

    if n == 0 {
        let Some(empty) = R::empty() else {
            return Err(KernelError::EmptyReduction(R::EMPTY_ERROR));
        };
        let shape: Vec<usize> = kept.iter().map(|d| d.0).collect();
        let os: Vec<isize> = kept.iter().map(|d| d.2).collect();
        for i in 0..count {
            let [o] = offsets_at(&shape, [&os], i);
            write(o, R::finish(empty, 0));
        }
        return Ok(());
    }
    if count == 0 {
        return Ok(());
    }
    let reduced_dims: Vec<(usize, isize)> =
        (0..ndim).filter(|&d| p.reduced[d]).map(|d| (p.shape[d], p.xs[d])).collect();
    if kept.is_empty() {
        // SAFETY: the whole of `x` is the block.
        let part = unsafe { reduce_block::<R>(x as *const R::In, &reduced_dims) };
        write(0, R::finish(part, n));
        return Ok(());
    }

    // One axis reduced (all-axes reductions have no kept dimension), several outputs.
    let (len, stride) = reduced_dims[0];
    let total = n.saturating_mul(count);
    let parallel = total >= REDUCE_PARALLEL_MIN_ELEMS;
    let column = kept.iter().position(|d| d.1 == 1 && d.0 >= 16).filter(|_| stride != 1 && len > 1);

    if let Some(j) = column {
        // Reduce a non-innermost axis: accumulate whole rows, COLS columns per task.
        let (width, _, col_os) = kept[j];
        let panel_shape: Vec<usize> = kept.iter().enumerate().filter(|&(i, _)| i != j).map(|(_, d)| d.0).collect();
        let panel_xs: Vec<isize> = kept.iter().enumerate().filter(|&(i, _)| i != j).map(|(_, d)| d.1).collect();
        let panel_os: Vec<isize> = kept.iter().enumerate().filter(|&(i, _)| i != j).map(|(_, d)| d.2).collect();
        let blocks = width.div_ceil(COLS);
        let tasks = count / width * blocks;
        let locate = |t: usize| {
            let [xo, oo] = offsets_at(&panel_shape, [&panel_xs, &panel_os], t / blocks);
            let c0 = (t % blocks) * COLS;
            (xo + c0 as isize, oo + c0 as isize * col_os, COLS.min(width - c0))
        };
        let emit = |oo: isize, acc: &[R::Part]| {
            for (c, &a) in acc.iter().enumerate() {
                write(oo + c as isize * col_os, R::finish(a, n));
            }
        };
        let task = |t: usize| {
            let (xo, oo, w) = locate(t);
            let base = (x as *const R::In).wrapping_offset(xo);
            // SAFETY: the task's first element is inside `x`.
            let mut acc = [R::start(unsafe { *base }, 0); COLS];
            // SAFETY: the task's columns and all `len` rows lie inside `x`.
            unsafe { columns::<R>(base, 0..len, stride, &mut acc[..w]) };
            emit(oo, &acc[..w]);
        };
        if !parallel {
            (0..tasks).for_each(task);
        } else {
            crate::cpu::pool::install(|| {
                if tasks >= 2 * rayon::current_num_threads() {
                    (0..tasks).into_par_iter().for_each(task);
                } else {
                    // Few, tall tasks: split the rows too and combine the column partials in order.
                    for t in 0..tasks {
                        let (xo, oo, w) = locate(t);
                        let rows_per_piece = (PIECE / w).max(1);
                        let pieces = len.div_ceil(rows_per_piece);
                        let parts: Vec<Vec<R::Part>> = (0..pieces)
                            .into_par_iter()
                            .map(|piece| {
                                let rows = piece * rows_per_piece..len.min((piece + 1) * rows_per_piece);
                                let base = (x as *const R::In).wrapping_offset(xo);
                                // SAFETY: the first row of the piece is inside `x`.
                                let first = R::start(unsafe { *base.offset(rows.start as isize * stride) }, rows.start);
                                let mut acc = vec![first; w];
                                // SAFETY: the piece's rows and the task's columns lie inside `x`.
                                unsafe { columns::<R>(base, rows, stride, &mut acc) };
                                acc
                            })
                            .collect();
                        let combined: Vec<R::Part> = (0..w)
                            .map(|c| {
                                let column: Vec<R::Part> = parts.iter().map(|part| part[c]).collect();
                                tree::<R>(&column)
                            })
                            .collect();
                        emit(oo, &combined);
                    }
                }
            });
        }
        return Ok(());
    }

    // Reduce each output's line on its own.
    let shape: Vec<usize> = kept.iter().map(|d| d.0).collect();
    let xs: Vec<isize> = kept.iter().map(|d| d.1).collect();
    let os: Vec<isize> = kept.iter().map(|d| d.2).collect();
    let one = |i: usize, parallel: bool| {
        let [xo, oo] = offsets_at(&shape, [&xs, &os], i);
        let base = (x as *const R::In).wrapping_offset(xo);
        // SAFETY: the line of output `i` lies inside `x`.
        let part = unsafe {
            if parallel {
                line_parallel::<R>(base, len, stride, 0)
            } else {
                line::<R>(base, len, stride, 0)
            }
        };
        write(oo, R::finish(part, n));
    };
    if !parallel {
        (0..count).for_each(|i| one(i, false));
    } else {
        crate::cpu::pool::install(|| {
            if count >= 2 * rayon::current_num_threads() {
                (0..count).into_par_iter().with_min_len((PIECE / len).max(1)).for_each(|i| one(i, false));
            } else {
                (0..count).for_each(|i| one(i, true));
            }
        });
    }
    Ok(())
}
