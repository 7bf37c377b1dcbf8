//! Matrix multiply through the `gemm` crate (packed, SIMD micro-kernels, rayon-parallel).
#![allow(unsafe_code)]

use gemm::Parallelism;
use opbridge_runtime::DType;

/// A 2-D operand: base pointer and strides in elements (any sign, any order).
#[derive(Debug, Clone, Copy)]
pub struct MatRef {
    pub ptr: *const u8,
    pub row_stride: isize,
    pub col_stride: isize,
}

// SAFETY: a plain address with strides; whoever builds one guarantees the memory outlives every
// use (the numpy path holds the arrays while the GIL-free kernel runs; streams hold blocks).
unsafe impl Send for MatRef {}

/// `out (m x n) = a (m x k) @ b (k x n)`. float16 accumulates in float32 inside `gemm`.
///
/// # Safety
/// Each operand's elements are valid for its shape and strides; `out` is writable, does not
/// overlap `a` or `b`, and nothing else touches it during the call.
pub unsafe fn matmul(dtype: DType, m: usize, n: usize, k: usize, a: MatRef, b: MatRef, out: MatRef) {
    let parallel = m.saturating_mul(n).saturating_mul(k) >= super::thresholds::matmul_parallel_min();
    // SAFETY: forwarded from the caller's contract.
    unsafe { matmul_with(dtype, m, n, k, a, b, out, parallel) }
}

/// [`matmul`] on one thread or all cores, as told (for calibration).
///
/// # Safety
/// As for [`matmul`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_with(
    dtype: DType,
    m: usize,
    n: usize,
    k: usize,
    a: MatRef,
    b: MatRef,
    out: MatRef,
    parallel: bool,
) {
    if parallel {
        // `gemm` hands its parallel work to the current rayon pool: inside `install` that is a
        // live one even in a forked child.
        // SAFETY: forwarded from the caller's contract.
        return super::pool::install(move || unsafe { matmul_on(dtype, m, n, k, a, b, out, true) });
    }
    // SAFETY: forwarded from the caller's contract.
    unsafe { matmul_on(dtype, m, n, k, a, b, out, false) }
}

/// [`matmul_with`] once the pool is chosen.
///
/// # Safety
/// As for [`matmul`].
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_on(dtype: DType, m: usize, n: usize, k: usize, a: MatRef, b: MatRef, out: MatRef, parallel: bool) {
    let parallelism = if parallel { Parallelism::Rayon(rayon::current_num_threads()) } else { Parallelism::None };
    macro_rules! call {
        ($t:ty, $zero:expr, $one:expr) => {
            // SAFETY: forwarded from the caller's contract; `read_dst = false` means `out` is
            // only written.
            unsafe {
                gemm::gemm::<$t>(
                    m,
                    n,
                    k,
                    out.ptr as *mut $t,
                    out.col_stride,
                    out.row_stride,
                    false,
                    a.ptr.cast(),
                    a.col_stride,
                    a.row_stride,
                    b.ptr.cast(),
                    b.col_stride,
                    b.row_stride,
                    $zero,
                    $one,
                    false,
                    false,
                    false,
                    parallelism,
                )
            }
        };
    }
    match dtype {
        DType::F16 => call!(gemm::f16, gemm::f16::ZERO, gemm::f16::ONE),
        DType::F32 => call!(f32, 0.0, 1.0),
        DType::F64 => call!(f64, 0.0, 1.0),
        DType::I32 | DType::I64 => unreachable!("dispatch admits float dtypes only"),
    }
}

/// dtypes `matmul` has kernels for.
pub const MATMUL_DTYPES: [DType; 3] = [DType::F16, DType::F32, DType::F64];
