//! Elementwise binary kernels. Memory-bound: one thread saturates most of a core's bandwidth,
//! so both cores are used only above `thresholds::elementwise_parallel_min()` (calibrated; the
//! default was measured, see benchmarks/).
#![allow(unsafe_code)]

use rayon::prelude::*;

use super::{streaming, thresholds, Element};
use opbridge_runtime::DType;

/// Elements per parallel task: a few tasks per core balance the load; more only add
/// scheduling (memory-bound work gains nothing from finer splits).
fn parallel_chunk(n: usize) -> usize {
    n.div_ceil(rayon::current_num_threads() * 4).max(1 << 14)
}

/// How the output relates to the inputs. Exact aliasing is legal (in-place add); partial
/// overlap is rejected or copied away by the dispatch layer before it gets here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alias {
    None,
    OutIsA,
    OutIsB,
    OutIsBoth,
}

/// Defines `$name` over an `#[inline(always)]` loop body compiled for AVX-512, AVX2 and the
/// x86_64 baseline (SSE2), picked at run time: wide vectors without building for
/// `-C target-cpu=native` (AVX-512 halves the instructions of a cache-resident 1K add).
macro_rules! multiversion {
    (fn $name:ident<T>($($arg:ident: $ty:ty),*) $body:block) => {
        super::reduce::avx2_multiversion!(fn $name<T: Element>($($arg: $ty),*) $body);
    };
}

multiversion!(
    fn add_disjoint_serial<T>(a: &[T], b: &[T], out: &mut [T]) {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = T::add(x, y);
        }
    }
);

multiversion!(
    fn add_in_place_serial<T>(inout: &mut [T], b: &[T]) {
        for (o, &y) in inout.iter_mut().zip(b) {
            *o = T::add(*o, y);
        }
    }
);

multiversion!(
    fn double_in_place_serial<T>(inout: &mut [T]) {
        for o in inout.iter_mut() {
            *o = T::add(*o, *o);
        }
    }
);

fn add_disjoint<T: Element>(a: &[T], b: &[T], out: &mut [T], parallel: bool) {
    if parallel {
        super::pool::install(|| {
            let chunk = parallel_chunk(out.len());
            out.par_chunks_mut(chunk)
                .zip(a.par_chunks(chunk).zip(b.par_chunks(chunk)))
                .for_each(|(o, (a, b))| add_disjoint_serial(a, b, o));
        });
    } else {
        add_disjoint_serial(a, b, out);
    }
}

fn add_in_place<T: Element>(inout: &mut [T], b: &[T], parallel: bool) {
    if parallel {
        super::pool::install(|| {
            let chunk = parallel_chunk(inout.len());
            inout.par_chunks_mut(chunk).zip(b.par_chunks(chunk)).for_each(|(o, b)| add_in_place_serial(o, b));
        });
    } else {
        add_in_place_serial(inout, b);
    }
}

fn double_in_place<T: Element>(inout: &mut [T], parallel: bool) {
    if parallel {
        super::pool::install(|| inout.par_chunks_mut(parallel_chunk(inout.len())).for_each(double_in_place_serial));
    } else {
        double_in_place_serial(inout);
    }
}

/// `out[i] = a[i] + b[i]` for `n` contiguous elements of `dtype`.
///
/// # Safety
/// `a`, `b` and `out` point to `n` valid, aligned elements of `dtype`; `out` is writable and no
/// other thread accesses it during the call; `out` is either disjoint from an input or equal
/// to it, as `alias` says.
pub unsafe fn add(dtype: DType, a: *const u8, b: *const u8, out: *mut u8, n: usize, alias: Alias) {
    if alias == Alias::None && n * dtype.size() >= streaming::STREAMING_MIN_BYTES && streaming::supported(dtype) {
        // SAFETY: forwarded; `alias == None` means `out` is disjoint from the inputs.
        unsafe { streaming_parallel(streaming::StreamOp::Add, dtype, a, b, out, n) };
        return;
    }
    let parallel = n >= thresholds::elementwise_parallel_min();
    crate::with_dtype!(dtype, T => {
        // SAFETY: forwarded from the caller's contract.
        unsafe { add_typed::<T>(a.cast(), b.cast(), out.cast(), n, alias, parallel) }
    })
}

/// `add` for disjoint operands on one thread or all cores, as told (for calibration).
///
/// # Safety
/// As for [`add`] with a disjoint `out`.
pub unsafe fn add_with_threads(dtype: DType, a: *const u8, b: *const u8, out: *mut u8, n: usize, parallel: bool) {
    crate::with_dtype!(dtype, T => {
        // SAFETY: forwarded from the caller's contract.
        unsafe { add_typed::<T>(a.cast(), b.cast(), out.cast(), n, Alias::None, parallel) }
    })
}

/// # Safety
/// As for [`add`], with typed pointers.
unsafe fn add_typed<T: Element>(a: *const T, b: *const T, out: *mut T, n: usize, alias: Alias, parallel: bool) {
    // SAFETY: the caller guarantees validity for `n` elements; each arm builds exactly one
    // mutable slice, and only over memory no shared slice in the same arm covers.
    unsafe {
        let out_slice = std::slice::from_raw_parts_mut(out, n);
        match alias {
            Alias::None => {
                add_disjoint(std::slice::from_raw_parts(a, n), std::slice::from_raw_parts(b, n), out_slice, parallel)
            }
            Alias::OutIsA => add_in_place(out_slice, std::slice::from_raw_parts(b, n), parallel),
            Alias::OutIsB => add_in_place(out_slice, std::slice::from_raw_parts(a, n), parallel),
            Alias::OutIsBoth => double_in_place(out_slice, parallel),
        }
    }
}

/// A streaming-store binary op (see [`streaming::binary_streaming`]) split across the compute
/// pool in contiguous parts. The caller checked [`streaming::supports`].
///
/// # Safety
/// As for [`add`] with disjoint `out`.
pub(crate) unsafe fn streaming_parallel(
    op: streaming::StreamOp,
    dtype: DType,
    a: *const u8,
    b: *const u8,
    out: *mut u8,
    n: usize,
) {
    let size = dtype.size();
    let (a, b, out) = (a as usize, b as usize, out as usize);
    super::pool::install(|| {
        let parts = rayon::current_num_threads().max(1);
        let per_part = n.div_ceil(parts);
        (0..parts).into_par_iter().for_each(|part| {
            let start = (part * per_part).min(n);
            let len = per_part.min(n - start);
            let at = |base: usize| base + start * size;
            // SAFETY: parts cover disjoint ranges of `out` inside the caller's `n` elements.
            unsafe {
                streaming::binary_streaming(op, dtype, at(a) as *const u8, at(b) as *const u8, at(out) as *mut u8, len)
            };
        });
    });
}
