//! Element adapters for the elementwise kernels: [`FloatElement`] widens float16 to float32
//! (float32 and float64 compute in their own type), maps a contiguous run in loops the compiler
//! vectorizes and rounds back once; [`IntElement`] gives integers numpy's wrapping operations.
#![allow(unsafe_code)]

use half::f16;

use super::Real;
use crate::cpu::Element;

/// A float element: widened to its compute type, rounded back once.
pub(crate) trait FloatElement: Element {
    type R: Real;
    fn up(self) -> Self::R;
    fn down(r: Self::R) -> Self;
    /// `out[i] = down(f(up(x[i])))` for `i < len`, in loops the compiler vectorizes.
    ///
    /// # Safety
    /// `x` and `out` are aligned addresses of `len` elements, readable and writable
    /// respectively, touched by nothing else during the call; `out` is `x` or disjoint from it.
    unsafe fn map_contiguous(x: *const Self, out: *mut Self, len: usize, f: impl Fn(Self::R) -> Self::R);
}

impl FloatElement for f16 {
    type R = f32;
    #[inline(always)]
    fn up(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn down(r: f32) -> f16 {
        f16::from_f32(r)
    }
    /// Through a float32 buffer on the stack (see [`widen_f16`]): computed in float32 and
    /// rounded once, as one element at a time.
    #[inline(always)]
    unsafe fn map_contiguous(x: *const f16, out: *mut f16, len: usize, f: impl Fn(f32) -> f32) {
        let mut buf = [0f32; F16_CHUNK];
        let mut start = 0;
        while start < len {
            let buf = &mut buf[..F16_CHUNK.min(len - start)];
            // SAFETY: inside the run (caller's contract); when `out` is `x`, the shared slice
            // is gone before the mutable one over the same elements is made.
            widen_f16(unsafe { std::slice::from_raw_parts(x.add(start), buf.len()) }, buf);
            for v in buf.iter_mut() {
                *v = f(*v);
            }
            // SAFETY: as above.
            narrow_f16(buf, unsafe { std::slice::from_raw_parts_mut(out.add(start), buf.len()) });
            start += buf.len();
        }
    }
}

/// Elements of float16 widened at a time into a float32 buffer on the stack (2 KiB).
pub(crate) const F16_CHUNK: usize = 512;

/// `dst[i] = src[i]` widened to float32 (exact). With F16C, eight at a time in one instruction:
/// `half`'s slice conversion checks the CPU and calls out of line for every four elements,
/// which cost a float16 `neg` more than the whole of numpy's loop.
///
/// # Panics
/// If the lengths differ.
pub(crate) fn widen_f16(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen_f16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has the features (checked just above); the lengths are equal.
        return unsafe { widen_f16c(src, dst) };
    }
    use half::slice::HalfFloatSliceExt;
    src.convert_to_f32_slice(dst);
}

/// `dst[i] = src[i]` rounded to float16 (to nearest, ties to even; overflow to inf; NaN stays
/// NaN), eight at a time with F16C.
///
/// # Panics
/// If the lengths differ.
pub(crate) fn narrow_f16(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "narrow_f16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: as in `widen_f16`.
        return unsafe { narrow_f16c(src, dst) };
    }
    use half::slice::HalfFloatSliceExt;
    dst.convert_from_f32_slice(src);
}

/// # Safety
/// The CPU has F16C and AVX; `src` and `dst` have the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16c(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements `i..i + 8` are inside both slices (equal lengths); unaligned
        // loads and stores.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for (d, s) in dst[i..].iter_mut().zip(&src[i..]) {
        *d = s.to_f32();
    }
}

/// # Safety
/// As for [`widen_f16c`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn narrow_f16c(src: &[f32], dst: &mut [f16]) {
    use std::arch::x86_64::*;
    let n = src.len();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: as in `widen_f16c`.
        unsafe {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), h);
        }
        i += 8;
    }
    for (d, &s) in dst[i..].iter_mut().zip(&src[i..]) {
        *d = f16::from_f32(s);
    }
}

macro_rules! float_element {
    ($t:ty) => {
        impl FloatElement for $t {
            type R = $t;
            #[inline(always)]
            fn up(self) -> $t {
                self
            }
            #[inline(always)]
            fn down(r: $t) -> $t {
                r
            }
            #[inline(always)]
            unsafe fn map_contiguous(x: *const $t, out: *mut $t, len: usize, f: impl Fn($t) -> $t) {
                if std::ptr::eq(x, out) {
                    // SAFETY: the caller's contract; one slice over the aliased run.
                    for v in unsafe { std::slice::from_raw_parts_mut(out, len) } {
                        *v = f(*v);
                    }
                } else {
                    // SAFETY: the caller's contract; disjoint runs.
                    let xs = unsafe { std::slice::from_raw_parts(x, len) };
                    // SAFETY: as above.
                    let os = unsafe { std::slice::from_raw_parts_mut(out, len) };
                    for (o, &v) in os.iter_mut().zip(xs) {
                        *o = f(v);
                    }
                }
            }
        }
    };
}
float_element!(f32);
float_element!(f64);

/// An integer element: every operation wraps on overflow, as numpy's do.
pub(crate) trait IntElement: Element + Ord {
    const ZERO: Self;
    fn wrapping_sub(self, b: Self) -> Self;
    fn wrapping_mul(self, b: Self) -> Self;
    fn wrapping_neg(self) -> Self;
    fn wrapping_abs(self) -> Self;
    /// `self ** e` by squaring, wrapping; `e` is the exponent's bits read as unsigned (callers
    /// reject negative exponents first).
    #[inline(always)]
    fn wrapping_pow(self, e: Self) -> Self {
        let mut e = e.to_i64() as u64;
        let (mut base, mut acc) = (self, Self::from_i64(1));
        while e > 0 {
            if e & 1 == 1 {
                acc = acc.wrapping_mul(base);
            }
            base = base.wrapping_mul(base);
            e >>= 1;
        }
        acc
    }
}

macro_rules! int_element {
    ($t:ty) => {
        impl IntElement for $t {
            const ZERO: Self = 0;
            #[inline(always)]
            fn wrapping_sub(self, b: Self) -> Self {
                <$t>::wrapping_sub(self, b)
            }
            #[inline(always)]
            fn wrapping_mul(self, b: Self) -> Self {
                <$t>::wrapping_mul(self, b)
            }
            #[inline(always)]
            fn wrapping_neg(self) -> Self {
                <$t>::wrapping_neg(self)
            }
            #[inline(always)]
            fn wrapping_abs(self) -> Self {
                <$t>::wrapping_abs(self)
            }
        }
    };
}
int_element!(i32);
int_element!(i64);
