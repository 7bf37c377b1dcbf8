//! `max`/`min` of a contiguous float32 or float64 run with AVX-512: eight vectors of running
//! extremes (`vmaxps`/`vminps`, one instruction per vector) and a mask of NaNs seen beside
//! them, about twice the compiler's loop over `reducers::pick` (two compares and a blend per
//! vector, in one dependency chain per lane). A run that holds a NaN is left to that loop,
//! which propagates it as numpy does; which zero a tie of -0.0 and 0.0 gives is settled
//! afterwards for every result (see `zeros`), so the lanes' order does not matter here.
#![allow(unsafe_code)]

/// Float types with an AVX-512 extreme kernel.
pub(super) trait FastExtreme: Sized {
    /// The maximum (`MAX`) or minimum of a non-empty run, or `None` when the CPU lacks the
    /// features or the run holds a NaN.
    fn fast_extreme<const MAX: bool>(src: &[Self]) -> Option<Self>;
}

fn has_avx512() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq")
}

macro_rules! fast_extreme {
    ($t:ty, $lanes:expr, $vec:ty, $mask:ty, $set1:ident, $loadu:ident, $mask_loadu:ident, $max:ident, $min:ident, $cmp:ident) => {
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
    _mm512_cmp_ps_mask
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
    _mm512_cmp_pd_mask
);
