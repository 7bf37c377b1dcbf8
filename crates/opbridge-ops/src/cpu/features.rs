//! What this CPU offers the kernels and which variant each kernel family runs, for
//! `opbridge doctor`. The checks are the ones the kernels make when they dispatch.

/// The instruction-set extensions the kernels look for, and whether this CPU has each.
pub fn cpu_features() -> Vec<(&'static str, bool)> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        vec![
            ("avx512f", has!("avx512f")),
            ("avx512vl", has!("avx512vl")),
            ("avx512bw", has!("avx512bw")),
            ("avx512dq", has!("avx512dq")),
            ("avx2", has!("avx2")),
            ("fma", has!("fma")),
            ("f16c", has!("f16c")),
        ]
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Vec::new()
    }
}

/// The variant each kernel family runs here: the widest its dispatch accepts on this CPU.
pub fn kernel_variants() -> Vec<(&'static str, &'static str)> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let avx2 = has!("avx2");
        // unary.rs: AVX-512 needs F, VL, BW, DQ and FMA; then AVX2 with or without FMA.
        let unary = if has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") && has!("fma") {
            "avx512"
        } else if avx2 && has!("fma") {
            "avx2+fma"
        } else if avx2 {
            "avx2"
        } else {
            "portable"
        };
        // elementwise.rs, broadcast.rs, reduce/: AVX2 or the portable loop.
        let simd = if avx2 { "avx2" } else { "portable" };
        vec![
            ("elementwise", simd),
            ("broadcast", simd),
            ("reductions", simd),
            ("unary", unary),
            ("matmul", "gemm (its own runtime dispatch)"),
        ]
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        vec![
            ("elementwise", "portable"),
            ("broadcast", "portable"),
            ("reductions", "portable"),
            ("unary", "portable"),
            ("matmul", "gemm (its own runtime dispatch)"),
        ]
    }
}

/// Threads of the compute pool that parallel kernels run on (asked of the pool itself: it was
/// sized when it started, whatever the process's CPU affinity is now).
pub fn compute_threads() -> usize {
    super::pool::threads()
}
