//! numpy's sign for a `max`/`min` that is zero: `-0.0 == 0.0`, so which zero numpy returns
//! depends on the order in which its loops compare elements, not on their values. The fast
//! reduction computes the value with its own lanes; for each output that came out zero, this
//! pass walks that output's elements again in numpy's order, with numpy's comparisons, and
//! keeps the zero numpy would have kept. Outputs that are not zero (nearly all of them) cost one
//! read; the hot loops are untouched.
//!
//! The orders, measured against numpy 2 on x86-64 with AVX-512 (`tests.rs` checks them):
//! - float32/float64 compare with x86's `max`/`min` (`a > b ? a : b`): a tie gives the second
//!   operand. A reduction whose reduced axis is numpy's inner loop and contiguous runs
//!   `simd_reduce_c` (the first element broadcast to 64-byte vectors, blocks of 8 vectors,
//!   single vectors, the lanes folded as GCC expands `_mm512_reduce_max_ps`, then a scalar
//!   tail); a strided one runs its 8-way unrolled scalar loop. A reduced axis that is not the
//!   inner loop is folded element by element into the output (`out = max(out, x)`), and so is
//!   the fallback for whole-array reductions of arrays that are not one contiguous block.
//! - float16 compares one element at a time and keeps the running value on a tie: the first
//!   zero in iteration order wins.
//!
//! A reduced line is walked in index order, a negative stride too (numpy does not flip it).
#![allow(unsafe_code)]

use half::f16;
use smallvec::SmallVec;

use super::plan::Plan;
use super::reducers::Ordered;

/// A float element and how numpy's loops treat its ties.
pub(super) trait NumpyTies: Ordered + Default {
    /// Lanes of numpy's 64-byte vectors, or 0 when numpy reduces one element at a time.
    const LANES: usize;
}

impl NumpyTies for f16 {
    const LANES: usize = 0;
}
impl NumpyTies for f32 {
    const LANES: usize = 16;
}
impl NumpyTies for f64 {
    const LANES: usize = 8;
}

/// x86's `max`/`min` (`maxps`, `minps`): `a` only when strictly better, so a tie gives `b`.
#[inline(always)]
fn v<T: Ordered, const MAX: bool>(a: T, b: T) -> T {
    if (MAX && a > b) || (!MAX && a < b) {
        a
    } else {
        b
    }
}

/// `simd_reduce_c`: the running value `init` broadcast, then `e(0..len)` in blocks of 8
/// vectors, single vectors, the horizontal fold, the scalar tail.
fn simd_line<T: NumpyTies, const MAX: bool>(init: T, e: &dyn Fn(usize) -> T, len: usize) -> T {
    let lanes = T::LANES;
    let mut acc = [init; 16];
    let acc = &mut acc[..lanes];
    let mut i = 0;
    while len - i >= 8 * lanes {
        for (l, a) in acc.iter_mut().enumerate() {
            let r = |k: usize| e(i + k * lanes + l);
            let (r01, r23) = (v::<T, MAX>(r(0), r(1)), v::<T, MAX>(r(2), r(3)));
            let (r45, r67) = (v::<T, MAX>(r(4), r(5)), v::<T, MAX>(r(6), r(7)));
            *a = v::<T, MAX>(*a, v::<T, MAX>(v::<T, MAX>(r01, r23), v::<T, MAX>(r45, r67)));
        }
        i += 8 * lanes;
    }
    while len - i >= lanes {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = v::<T, MAX>(*a, e(i + l));
        }
        i += lanes;
    }
    let mut r = fold_lanes::<T, MAX>(acc);
    for j in i..len {
        r = v::<T, MAX>(r, e(j));
    }
    r
}

/// GCC's `_mm512_reduce_max_ps` / `_pd`: halves as `max(high, low)` down to 4 lanes (float32)
/// or 2 (float64); float32 then `max(lanes 0-1, lanes 2-3)`; last `max(lane 0, lane 1)`.
fn fold_lanes<T: Ordered, const MAX: bool>(acc: &mut [T]) -> T {
    let stop = if acc.len() == 16 { 4 } else { 2 };
    let mut len = acc.len();
    while len > stop {
        len /= 2;
        for i in 0..len {
            acc[i] = v::<T, MAX>(acc[i + len], acc[i]);
        }
    }
    if len == 4 {
        acc[0] = v::<T, MAX>(acc[0], acc[2]);
        acc[1] = v::<T, MAX>(acc[1], acc[3]);
    }
    v::<T, MAX>(acc[0], acc[1])
}

/// The strided reduction loop: `e(0..len)` go through 8 running extremes (when there are 8),
/// folded pairwise into the running value `init`, then the rest one at a time.
fn unrolled_line<T: Ordered, const MAX: bool>(init: T, e: &dyn Fn(usize) -> T, len: usize) -> T {
    let mut out = init;
    let mut i = 0;
    if len >= 8 {
        let mut m: [T; 8] = std::array::from_fn(e);
        i = 8;
        while i + 8 <= len {
            for (k, m) in m.iter_mut().enumerate() {
                *m = v::<T, MAX>(*m, e(i + k));
            }
            i += 8;
        }
        let (m0, m2) = (v::<T, MAX>(m[0], m[1]), v::<T, MAX>(m[2], m[3]));
        let (m4, m6) = (v::<T, MAX>(m[4], m[5]), v::<T, MAX>(m[6], m[7]));
        out = v::<T, MAX>(out, v::<T, MAX>(v::<T, MAX>(m0, m2), v::<T, MAX>(m4, m6)));
    }
    for j in i..len {
        out = v::<T, MAX>(out, e(j));
    }
    out
}

/// One element at a time into the running value: x86's select for float32/64 (a tie takes the
/// element), float16's loop keeps the running value on a tie.
fn sequential<T: NumpyTies, const MAX: bool>(init: T, x: &dyn Fn(usize) -> T, len: usize) -> T {
    let mut r = init;
    for i in 0..len {
        let e = x(i);
        // `v(a, b)` takes `b` on a tie: the element for float32/64, the running value for float16.
        r = if T::LANES == 0 { v::<T, MAX>(e, r) } else { v::<T, MAX>(r, e) };
    }
    r
}

/// Gives every zero output of a finished `max` (`MAX`) or `min` the sign numpy gives it.
///
/// # Safety
/// `plan` is the validated reduction that just ran (`x` readable, `out` written and writable).
pub(super) unsafe fn numpy_zero_signs<T: NumpyTies, const MAX: bool>(plan: &Plan<'_>) {
    let ndim = plan.shape.len();
    // The common whole-array case: one output, not a zero — nothing to settle.
    if plan.reduced.iter().take(ndim).all(|&r| r) && plan.shape.iter().all(|&d| d > 0) {
        // SAFETY: the one element of `out`, written by the reduction.
        if unsafe { *(plan.out as *const T) } != T::default() {
            return;
        }
    }
    let reduced: SmallVec<[usize; 8]> = (0..ndim).filter(|&d| plan.reduced[d] && plan.shape[d] > 1).collect();
    if reduced.is_empty() || plan.shape.contains(&0) {
        return; // every output is a copy of one element (or there is none)
    }
    let kept: SmallVec<[usize; 8]> = (0..ndim).filter(|&d| !plan.reduced[d] && plan.shape[d] > 1).collect();
    let (x, out) = (plan.x as *const T, plan.out as *mut T);
    // Most calls end here, at one read per output: no result is a zero, so no sign to settle
    // (and none of the line model below is built).
    {
        let count: usize = kept.iter().map(|&d| plan.shape[d]).product();
        let mut index: SmallVec<[usize; 8]> = SmallVec::from_elem(0, kept.len());
        let mut any_zero = false;
        for _ in 0..count {
            let oo: isize = kept.iter().zip(&index).map(|(&d, &i)| plan.os[d] * i as isize).sum();
            // SAFETY: an element of `out` (the plan's shape and strides), written by the reduction.
            if unsafe { *out.offset(oo) } == T::default() {
                any_zero = true;
                break;
            }
            for k in (0..kept.len()).rev() {
                index[k] += 1;
                if index[k] < plan.shape[kept[k]] {
                    break;
                }
                index[k] = 0;
            }
        }
        if !any_zero {
            return;
        }
    }
    // The reduced elements of one output as numpy walks them: lines along `inner` (`n`
    // elements, `stride` apart) starting at `lines` offsets, in index order (numpy does not
    // flip negative strides here). The first element starts the running value; each line is
    // then reduced into it by numpy's loop for that line.
    #[derive(Clone, Copy)]
    enum Model {
        Simd,
        Unrolled,
        Sequential,
    }
    let (n, stride, model, lines): (usize, isize, Model, Vec<isize>) = if let [a] = reduced[..] {
        let (n, s) = (plan.shape[a], plan.xs[a]);
        // numpy's inner loop is the axis with the smallest stride; the reduction runs there
        // as a reduce loop, elsewhere as `out = max(out, x)` over whole rows.
        let inner = kept.iter().all(|&d| s.unsigned_abs() <= plan.xs[d].unsigned_abs());
        let model = match (T::LANES, inner, s) {
            (0, ..) | (_, false, _) => Model::Sequential,
            (_, true, 1) => Model::Simd,
            _ => Model::Unrolled,
        };
        (n, s, model, vec![0])
    } else {
        // Every axis (the API reduces one axis or all): outer to inner by decreasing stride,
        // adjacent axes that make one run merged (numpy coalesces them).
        let mut dims: SmallVec<[(usize, isize); 8]> = reduced.iter().map(|&d| (plan.shape[d], plan.xs[d])).collect();
        dims.sort_by_key(|&(_, s)| std::cmp::Reverse(s.unsigned_abs()));
        let mut merged: SmallVec<[(usize, isize); 8]> = SmallVec::new();
        for &(n, s) in dims.iter().rev() {
            match merged.last_mut() {
                Some(last) if last.1 * last.0 as isize == s => last.0 *= n,
                _ => merged.push((n, s)),
            }
        }
        merged.reverse();
        let (n, s) = merged.pop().expect("at least one reduced axis");
        let model = match (T::LANES, s) {
            (0, _) => Model::Sequential,
            (_, 1) => Model::Simd,
            _ => Model::Unrolled,
        };
        let count: usize = merged.iter().map(|&(n, _)| n).product();
        let mut lines = Vec::with_capacity(count);
        let mut index: SmallVec<[usize; 8]> = SmallVec::from_elem(0, merged.len());
        for _ in 0..count {
            lines.push(merged.iter().zip(&index).map(|(&(_, s), &i)| s * i as isize).sum());
            for k in (0..merged.len()).rev() {
                index[k] += 1;
                if index[k] < merged[k].0 {
                    break;
                }
                index[k] = 0;
            }
        }
        (n, s, model, lines)
    };
    // Every output: its base offsets in `x` and `out`, by a counter over the kept dimensions.
    let count: usize = kept.iter().map(|&d| plan.shape[d]).product();
    let mut index: SmallVec<[usize; 8]> = SmallVec::from_elem(0, kept.len());
    for _ in 0..count {
        let xo: isize = kept.iter().zip(&index).map(|(&d, &i)| plan.xs[d] * i as isize).sum();
        let oo: isize = kept.iter().zip(&index).map(|(&d, &i)| plan.os[d] * i as isize).sum();
        // SAFETY: an element of `out` (the plan's shape and strides).
        let o = unsafe { out.offset(oo) };
        // SAFETY: as above.
        if unsafe { *o } == T::default() {
            let mut value: Option<T> = None;
            for (k, &line) in lines.iter().enumerate() {
                let at = xo + line;
                // SAFETY: elements of `x`: the line stays inside the reduced axes.
                let e = |i: usize| unsafe { *x.offset(at + stride * i as isize) };
                // The first line's first element starts the running value (numpy copies it
                // to the output and reduces the rest into it).
                let (init, skip) = match value {
                    Some(v) => (v, 0),
                    None => (e(0), 1),
                };
                let rest = |i: usize| e(i + skip);
                let len = n - skip;
                debug_assert!(k > 0 || skip == 1);
                value = Some(match model {
                    Model::Simd => simd_line::<T, MAX>(init, &rest, len),
                    Model::Unrolled => unrolled_line::<T, MAX>(init, &rest, len),
                    Model::Sequential => sequential::<T, MAX>(init, &rest, len),
                });
            }
            let value = value.expect("at least one line");
            // SAFETY: as above; nothing else writes `out` during the call.
            unsafe { *o = value };
        }
        for k in (0..kept.len()).rev() {
            index[k] += 1;
            if index[k] < plan.shape[kept[k]] {
                break;
            }
            index[k] = 0;
        }
    }
}
