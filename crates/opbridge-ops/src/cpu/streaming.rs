//! Elementwise add, sub, mul and div with non-temporal (streaming) stores, for outputs far larger
//! than the cache. A normal store first reads the destination line (read-for-ownership), so
//! `out = a + b` moves four bytes per three useful ones; streaming stores skip that read. Used
//! only for disjoint outputs above `STREAMING_MIN_BYTES`, where the output would be evicted
//! before reuse anyway. The arithmetic is the same IEEE operation as the regular kernels' (no
//! contraction), so results are bit-identical.
#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use opbridge_runtime::DType;

/// Outputs at least this large use streaming stores (above L3 on the project machine, with the
/// inputs counted, the lines would not survive until they are read again).
pub const STREAMING_MIN_BYTES: usize = 8 << 20;

/// The operations with streaming kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamOp {
    Add,
    Sub,
    Mul,
    Div,
}

/// Whether `add_streaming` has a kernel for `dtype` on this target.
pub fn supported(dtype: DType) -> bool {
    supports(StreamOp::Add, dtype)
}

/// Whether [`binary_streaming`] has a kernel for `op` on `dtype` on this target: floats for all
/// four, integers for add and sub (wrapping, as the regular kernels; integer mul and div have
/// other rules).
pub fn supports(op: StreamOp, dtype: DType) -> bool {
    cfg!(target_arch = "x86_64")
        && match dtype {
            DType::F32 | DType::F64 => true,
            DType::I32 | DType::I64 => matches!(op, StreamOp::Add | StreamOp::Sub),
            DType::F16 => false,
        }
}

/// `out[i] = a[i] op b[i]` with streaming stores (see [`add_streaming`]); false (doing nothing)
/// when [`supports`] says no.
///
/// # Safety
/// As for [`add_streaming`].
pub unsafe fn binary_streaming(op: StreamOp, dtype: DType, a: *const u8, b: *const u8, out: *mut u8, n: usize) -> bool {
    if !supports(op, dtype) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: forwarded from the caller; SSE2 is part of the x86_64 baseline.
        unsafe {
            match (op, dtype) {
                (StreamOp::Add, _) => return add_streaming(dtype, a, b, out, n),
                (StreamOp::Sub, DType::F32) => sub_f32(a.cast(), b.cast(), out.cast(), n),
                (StreamOp::Sub, DType::F64) => sub_f64(a.cast(), b.cast(), out.cast(), n),
                (StreamOp::Sub, DType::I32) => sub_i32(a.cast(), b.cast(), out.cast(), n),
                (StreamOp::Sub, DType::I64) => sub_i64(a.cast(), b.cast(), out.cast(), n),
                (StreamOp::Mul, DType::F32) => mul_f32(a.cast(), b.cast(), out.cast(), n),
                (StreamOp::Mul, DType::F64) => mul_f64(a.cast(), b.cast(), out.cast(), n),
                (StreamOp::Div, DType::F32) => div_f32(a.cast(), b.cast(), out.cast(), n),
                (StreamOp::Div, DType::F64) => div_f64(a.cast(), b.cast(), out.cast(), n),
                _ => return false,
            }
            _mm_sfence(); // make the streaming stores visible before the caller reads `out`
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (op, dtype, a, b, out, n);
        false
    }
}

/// `out[i] = a[i] + b[i]` with streaming stores; scalar head and tail around the 16-byte
/// aligned body. Returns false (doing nothing) when unsupported.
///
/// # Safety
/// `a`, `b`, `out` point to `n` valid, aligned elements of `dtype`; `out` is writable and
/// disjoint from both inputs; nothing else accesses `out` during the call.
pub unsafe fn add_streaming(dtype: DType, a: *const u8, b: *const u8, out: *mut u8, n: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: forwarded from the caller; SSE2 is part of the x86_64 baseline.
        unsafe {
            match dtype {
                DType::F32 => add_f32(a.cast(), b.cast(), out.cast(), n),
                DType::F64 => add_f64(a.cast(), b.cast(), out.cast(), n),
                DType::I32 => add_i32(a.cast(), b.cast(), out.cast(), n),
                DType::I64 => add_i64(a.cast(), b.cast(), out.cast(), n),
                DType::F16 => return false,
            }
            _mm_sfence(); // make the streaming stores visible before the caller reads `out`
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (dtype, a, b, out, n);
        false
    }
}

/// One streaming kernel per dtype: `$lanes` elements per 16-byte vector.
#[cfg(target_arch = "x86_64")]
macro_rules! streaming_kernel {
    ($name:ident, $t:ty, $lanes:expr, $scalar:expr, |$va:ident, $vb:ident, $o:ident| $vector:expr) => {
        /// # Safety
        /// As for [`add_streaming`].
        unsafe fn $name(a: *const $t, b: *const $t, out: *mut $t, n: usize) {
            let scalar: fn($t, $t) -> $t = $scalar;
            // SAFETY: every index stays below `n`; the vector body starts where `out` is
            // 16-byte aligned (stream stores need it) and loads inputs unaligned.
            unsafe {
                let head = (out.align_offset(16)).min(n);
                for i in 0..head {
                    *out.add(i) = scalar(*a.add(i), *b.add(i));
                }
                let body_end = head + (n - head) / $lanes * $lanes;
                let mut i = head;
                while i < body_end {
                    let $va = a.add(i);
                    let $vb = b.add(i);
                    let $o = out.add(i);
                    $vector;
                    i += $lanes;
                }
                for i in body_end..n {
                    *out.add(i) = scalar(*a.add(i), *b.add(i));
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
streaming_kernel!(add_f32, f32, 4, |x, y| x + y, |a, b, o| _mm_stream_ps(
    o,
    _mm_add_ps(_mm_loadu_ps(a), _mm_loadu_ps(b))
));
#[cfg(target_arch = "x86_64")]
streaming_kernel!(add_f64, f64, 2, |x, y| x + y, |a, b, o| _mm_stream_pd(
    o,
    _mm_add_pd(_mm_loadu_pd(a), _mm_loadu_pd(b))
));
#[cfg(target_arch = "x86_64")]
streaming_kernel!(add_i32, i32, 4, |x: i32, y| x.wrapping_add(y), |a, b, o| _mm_stream_si128(
    o.cast(),
    _mm_add_epi32(_mm_loadu_si128(a.cast()), _mm_loadu_si128(b.cast()))
));
#[cfg(target_arch = "x86_64")]
streaming_kernel!(add_i64, i64, 2, |x: i64, y| x.wrapping_add(y), |a, b, o| _mm_stream_si128(
    o.cast(),
    _mm_add_epi64(_mm_loadu_si128(a.cast()), _mm_loadu_si128(b.cast()))
));

#[cfg(target_arch = "x86_64")]
streaming_kernel!(sub_f32, f32, 4, |x, y| x - y, |a, b, o| _mm_stream_ps(
    o,
    _mm_sub_ps(_mm_loadu_ps(a), _mm_loadu_ps(b))
));
#[cfg(target_arch = "x86_64")]
streaming_kernel!(sub_f64, f64, 2, |x, y| x - y, |a, b, o| _mm_stream_pd(
    o,
    _mm_sub_pd(_mm_loadu_pd(a), _mm_loadu_pd(b))
));
#[cfg(target_arch = "x86_64")]
streaming_kernel!(sub_i32, i32, 4, |x: i32, y| x.wrapping_sub(y), |a, b, o| _mm_stream_si128(
    o.cast(),
    _mm_sub_epi32(_mm_loadu_si128(a.cast()), _mm_loadu_si128(b.cast()))
));
#[cfg(target_arch = "x86_64")]
streaming_kernel!(sub_i64, i64, 2, |x: i64, y| x.wrapping_sub(y), |a, b, o| _mm_stream_si128(
    o.cast(),
    _mm_sub_epi64(_mm_loadu_si128(a.cast()), _mm_loadu_si128(b.cast()))
));
#[cfg(target_arch = "x86_64")]
streaming_kernel!(mul_f32, f32, 4, |x, y| x * y, |a, b, o| _mm_stream_ps(
    o,
    _mm_mul_ps(_mm_loadu_ps(a), _mm_loadu_ps(b))
));
#[cfg(target_arch = "x86_64")]
streaming_kernel!(mul_f64, f64, 2, |x, y| x * y, |a, b, o| _mm_stream_pd(
    o,
    _mm_mul_pd(_mm_loadu_pd(a), _mm_loadu_pd(b))
));
#[cfg(target_arch = "x86_64")]
streaming_kernel!(div_f32, f32, 4, |x, y| x / y, |a, b, o| _mm_stream_ps(
    o,
    _mm_div_ps(_mm_loadu_ps(a), _mm_loadu_ps(b))
));
#[cfg(target_arch = "x86_64")]
streaming_kernel!(div_f64, f64, 2, |x, y| x / y, |a, b, o| _mm_stream_pd(
    o,
    _mm_div_pd(_mm_loadu_pd(a), _mm_loadu_pd(b))
));

#[cfg(test)]
mod tests {
    use super::*;

    fn check<T: Copy + PartialEq + std::fmt::Debug>(dtype: DType, make: fn(usize) -> T, add: fn(T, T) -> T) {
        // Odd lengths and a misaligned output exercise the scalar head and tail.
        for (n, skew) in [(0usize, 0usize), (3, 1), (1027, 1), (4096, 0), (100_003, 3)] {
            let a: Vec<T> = (0..n).map(make).collect();
            let b: Vec<T> = (0..n).map(|i| make(i * 7 + 1)).collect();
            let mut out: Vec<T> = vec![make(0); n + skew];
            // SAFETY: vectors of `n` elements (`out` has `skew` more), disjoint.
            let done = unsafe {
                add_streaming(dtype, a.as_ptr().cast(), b.as_ptr().cast(), out[skew..].as_mut_ptr().cast(), n)
            };
            if !done {
                return;
            }
            let want: Vec<T> = a.iter().zip(&b).map(|(&x, &y)| add(x, y)).collect();
            assert_eq!(&out[skew..], &want[..], "{dtype} n={n} skew={skew}");
        }
    }

    fn check_op<T: Copy + std::fmt::Debug>(op: StreamOp, dtype: DType, make: fn(usize) -> T, f: fn(T, T) -> T) {
        for (n, skew) in [(0usize, 0usize), (5, 1), (1029, 3), (4096, 0)] {
            let a: Vec<T> = (0..n).map(make).collect();
            let b: Vec<T> = (0..n).map(|i| make(i * 5 + 3)).collect();
            let mut out: Vec<T> = vec![make(0); n + skew];
            // SAFETY: vectors of `n` elements (`out` has `skew` more), disjoint.
            let done = unsafe {
                binary_streaming(op, dtype, a.as_ptr().cast(), b.as_ptr().cast(), out[skew..].as_mut_ptr().cast(), n)
            };
            assert_eq!(done, supports(op, dtype));
            if !done {
                continue;
            }
            let want: Vec<T> = a.iter().zip(&b).map(|(&x, &y)| f(x, y)).collect();
            // Bit for bit (NaN included): the same IEEE operation as the scalar one.
            let bits = |v: &[T]| v.iter().map(|x| format!("{x:?}")).collect::<Vec<_>>();
            assert_eq!(bits(&out[skew..]), bits(&want), "{op:?} {dtype} n={n} skew={skew}");
        }
    }

    #[test]
    fn streaming_sub_mul_div_match_scalar() {
        let f = |i: usize| (i as f32 - 700.0) * 0.37;
        let d = |i: usize| (i as f64 - 700.0) * 0.37;
        check_op(StreamOp::Sub, DType::F32, f, |x, y| x - y);
        check_op(StreamOp::Mul, DType::F32, f, |x, y| x * y);
        check_op(StreamOp::Div, DType::F32, f, |x, y| x / y);
        check_op(StreamOp::Sub, DType::F64, d, |x, y| x - y);
        check_op(StreamOp::Mul, DType::F64, d, |x, y| x * y);
        check_op(StreamOp::Div, DType::F64, d, |x, y| x / y);
        check_op(StreamOp::Sub, DType::I32, |i| (i as i32).wrapping_mul(-2_654_435), |x, y| x.wrapping_sub(y));
        check_op(StreamOp::Sub, DType::I64, |i| (i as i64) << 41, |x, y| x.wrapping_sub(y));
        check_op(StreamOp::Mul, DType::I32, |i| i as i32, |x, y| x.wrapping_mul(y));
        // unsupported: declined
    }

    #[test]
    fn streaming_add_matches_scalar() {
        check(DType::F32, |i| i as f32 * 0.5, |x, y| x + y);
        check(DType::F64, |i| i as f64 * 0.25, |x, y| x + y);
        check(DType::I32, |i| (i as i32).wrapping_mul(2_654_435), |x, y| x.wrapping_add(y));
        check(DType::I64, |i| (i as i64) << 40, |x, y| x.wrapping_add(y));
    }
}
