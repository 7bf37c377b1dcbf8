//! `max`/`min` of a contiguous float32 or float64 run with AVX-512: eight vectors of running
//! extremes (`vmaxps`/`vminps`, one instruction per vector) and a mask of NaNs seen beside
//! them, about twice the compiler's loop over `reducers::pick` (two compares and a blend per
//! vector, in one dependency chain per lane). A run that holds a NaN is left to that loop,
//! which propagates it as numpy does; which zero a tie of -0.0 and 0.0 gives is settled
//! afterwards for every result (see `zeros`), so the lanes' order does not matter here.
//! `argmax` is one pass too: each lane keeps its first maximum and where it was, and the first
//! index among the lanes holding the overall maximum wins (the max-then-search pair it replaces
//! read the run twice, 1.4x numpy's one pass at 64K).
#![allow(unsafe_code)]

/// Float types with an AVX-512 extreme kernel.
pub(super) trait FastExtreme: Sized {
    /// The maximum (`MAX`) or minimum of a non-empty run, or `None` when the CPU lacks the
    /// features or the run holds a NaN.
    fn fast_extreme<const MAX: bool>(src: &[Self]) -> Option<Self>;
    /// The index of the first maximum of a non-empty run in one pass, or `None` when the CPU
    /// lacks the features or the run holds a NaN (numpy's argmax then answers the first NaN).
    fn fast_argmax(src: &[Self]) -> Option<usize>;
}

fn has_avx512() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq")
}

macro_rules! fast_extreme {
    (
        $t:ty, $lanes:expr, $vec:ty, $mask:ty, $set1:ident, $loadu:ident, $mask_loadu:ident, $max:ident, $min:ident, $cmp:ident,
        $mask_mov:ident, $reduce_max:ident,
        index $idx:ty, $iset1:ident, $iadd:ident, $imask_mov:ident, $imask_min:ident, $ireduce_min:ident
    ) => {
        impl FastExtreme for $t {
            fn fast_extreme<const MAX: bool>(src: &[$t]) -> Option<$t> {
                if !has_avx512() {
                    return None;
                }
                /// # Safety
                /// The CPU has AVX-512 F/VL/BW/DQ; `src` is not empty.
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq")]
                unsafe fn run<const MAX: bool>(src: &[$t]) -> Option<$t> {
                    use std::arch::x86_64::*;
                    const L: usize = $lanes;
                    let pick = |v: $vec, m: $vec| if MAX { $max(v, m) } else { $min(v, m) };
                    let (p, n) = (src.as_ptr(), src.len());
                    let first = $set1(src[0]);
                    let mut acc = [first; 8];
                    let mut nan: $mask = 0;
                    let mut i = 0;
                    while i + 8 * L <= n {
                        // A plain index loop: everything in it is compiled with this
                        // function's target features and inlined.
                        for j in 0..8 {
                            // SAFETY: elements `i + j L ..+ L` are inside the run.
                            let v = unsafe { $loadu(p.add(i + j * L)) };
                            acc[j] = pick(v, acc[j]);
                            nan |= $cmp::<_CMP_UNORD_Q>(v, v);
                        }
                        i += 8 * L;
                    }
                    while i < n {
                        let m = if n - i >= L { <$mask>::MAX } else { ((1u32 << (n - i)) - 1) as $mask };
                        // SAFETY: the mask reads only elements `i..n`; the others are `src[0]`.
                        let v = unsafe { $mask_loadu(first, m, p.add(i)) };
                        acc[0] = pick(v, acc[0]);
                        nan |= $cmp::<_CMP_UNORD_Q>(v, v);
                        i += L;
                    }
                    if nan != 0 {
                        return None;
                    }
                    let mut v = acc[0];
                    for a in &acc[1..] {
                        v = pick(*a, v);
                    }
                    let mut lanes = [0 as $t; L];
                    // SAFETY: `L` elements of the array.
                    unsafe { std::ptr::copy_nonoverlapping((&v as *const $vec).cast::<$t>(), lanes.as_mut_ptr(), L) };
                    Some(lanes.into_iter().fold(src[0], |m, x| if (MAX && x > m) || (!MAX && x < m) { x } else { m }))
                }
                // SAFETY: the CPU has the features (checked above); runs are never empty.
                (!src.is_empty()).then(|| unsafe { run::<MAX>(src) }).flatten()
            }

            fn fast_argmax(src: &[$t]) -> Option<usize> {
                if !has_avx512() || src.is_empty() || src.len() > <$idx>::MAX as usize {
                    return None;
                }
                /// # Safety
                /// The CPU has AVX-512 F/VL/BW/DQ; `src` is not empty and its indices fit
                /// the index type.
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq")]
                unsafe fn run(src: &[$t]) -> Option<usize> {
                    use std::arch::x86_64::*;
                    const L: usize = $lanes;
                    // Eight accumulators hide the compare-select latency.
                    const A: usize = 8;
                    let (p, n) = (src.as_ptr(), src.len());
                    let first = $set1(src[0]);
                    // Lane k of accumulator j keeps the largest value it has seen and where: a
                    // strictly greater value replaces it, so each lane keeps its first maximum.
                    // Lanes start at element 0, which is where `src[0]` is. Where is kept as
                    // the block's first index plus k (one add per block, not per vector);
                    // accumulator j's `j L` is added at the end.
                    let mut best = [first; A];
                    let mut best_at = [$iset1(0); A];
                    let mut lane_index = [0 as $idx; L];
                    for (k, x) in lane_index.iter_mut().enumerate() {
                        *x = k as $idx;
                    }
                    // SAFETY: `L` indices are one vector.
                    let iota = unsafe { std::ptr::read_unaligned(lane_index.as_ptr().cast()) };
                    let mut at = iota;
                    let step = $iset1((A * L) as $idx);
                    let mut nan: $mask = 0;
                    let mut i = 0;
                    while i + A * L <= n {
                        let mut v = [first; A];
                        for j in 0..A {
                            // SAFETY: elements `i + j L ..+ L` are inside the run.
                            v[j] = unsafe { $loadu(p.add(i + j * L)) };
                            let gt = $cmp::<_CMP_GT_OQ>(v[j], best[j]);
                            best[j] = $mask_mov(best[j], gt, v[j]);
                            best_at[j] = $imask_mov(best_at[j], gt, at);
                        }
                        // One unordered compare tells whether either of two vectors has a NaN.
                        for j in (0..A).step_by(2) {
                            nan |= $cmp::<_CMP_UNORD_Q>(v[j], v[j + 1]);
                        }
                        at = $iadd(at, step);
                        i += A * L;
                    }
                    for (j, b) in best_at.iter_mut().enumerate() {
                        *b = $iadd(*b, $iset1((j * L) as $idx));
                    }
                    // The rest into accumulator 0, whose lanes' indices keep rising.
                    let mut at0 = $iadd(iota, $iset1(i as $idx));
                    while i < n {
                        let m = if n - i >= L { <$mask>::MAX } else { ((1u32 << (n - i)) - 1) as $mask };
                        // SAFETY: the mask reads only elements `i..n`; the others are
                        // `src[0]`, never greater than a lane's best.
                        let v = unsafe { $mask_loadu(first, m, p.add(i)) };
                        let gt = $cmp::<_CMP_GT_OQ>(v, best[0]);
                        best[0] = $mask_mov(best[0], gt, v);
                        best_at[0] = $imask_mov(best_at[0], gt, at0);
                        nan |= $cmp::<_CMP_UNORD_Q>(v, v);
                        at0 = $iadd(at0, $iset1(L as $idx));
                        i += L;
                    }
                    if nan != 0 {
                        return None;
                    }
                    let mut top = best[0];
                    for b in &best[1..] {
                        top = $max(top, *b);
                    }
                    let top = $set1($reduce_max(top));
                    // The first index among the lanes holding the maximum (0.0 == -0.0, as
                    // numpy compares them).
                    let mut found = $iset1(<$idx>::MAX);
                    for j in 0..A {
                        found = $imask_min(found, $cmp::<_CMP_EQ_OQ>(best[j], top), found, best_at[j]);
                    }
                    Some($ireduce_min(found) as usize)
                }
                // SAFETY: the CPU has the features, the run is not empty and its indices fit
                // (all checked above).
                unsafe { run(src) }
            }
        }
    };
}

// The names below resolve inside each kernel, which imports `std::arch::x86_64::*`.
fast_extreme!(
    f32,
    16,
    __m512,
    u16,
    _mm512_set1_ps,
    _mm512_loadu_ps,
    _mm512_mask_loadu_ps,
    _mm512_max_ps,
    _mm512_min_ps,
    _mm512_cmp_ps_mask,
    _mm512_mask_mov_ps,
    _mm512_reduce_max_ps,
    index i32,
    _mm512_set1_epi32,
    _mm512_add_epi32,
    _mm512_mask_mov_epi32,
    _mm512_mask_min_epi32,
    _mm512_reduce_min_epi32
);
fast_extreme!(
    f64,
    8,
    __m512d,
    u8,
    _mm512_set1_pd,
    _mm512_loadu_pd,
    _mm512_mask_loadu_pd,
    _mm512_max_pd,
    _mm512_min_pd,
    _mm512_cmp_pd_mask,
    _mm512_mask_mov_pd,
    _mm512_reduce_max_pd,
    index i64,
    _mm512_set1_epi64,
    _mm512_add_epi64,
    _mm512_mask_mov_epi64,
    _mm512_mask_min_epi64,
    _mm512_reduce_min_epi64
);
