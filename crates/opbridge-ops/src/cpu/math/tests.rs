//! Accuracy tests of the math library against float64 references (std and the `libm`
//! crate): sweeps over the whole input range and around every switch point, special values,
//! for both [`Plain`](super::Plain) and [`Fused`](super::Fused) evaluation, and for the AVX-512
//! kernels where the CPU has them (every tail length, in place).
#![allow(unsafe_code)] // the tests call the kernels on buffers they own.

#[test]
fn vectorizable_exp_and_tanh_f32_stay_within_a_few_ulp() {
    exp_and_tanh_f32_within_a_few_ulp::<super::Plain>();
    exp_and_tanh_f32_within_a_few_ulp::<super::Fused>();
}

fn exp_and_tanh_f32_within_a_few_ulp<M: super::Mla>() {
    let (exp, tanh) = (super::exp_f32_with::<M>, super::tanh_f32_with::<M>);
    let ulps = |got: f32, want: f64| {
        let want32 = want as f32;
        if want32 == got || (want32.is_nan() && got.is_nan()) {
            return 0.0;
        }
        ((got as f64 - want).abs() / (want32.abs().max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64)) as f32
    };
    let mut x = -110.0f32;
    while x < 95.0 {
        let e = exp(x);
        let want = (x as f64).exp();
        if want >= f32::MIN_POSITIVE as f64 && want <= f32::MAX as f64 {
            assert!(ulps(e, want) <= 2.0, "exp({x}) = {e}, want {want}");
        } else if want > f32::MAX as f64 {
            assert_eq!(e, f32::INFINITY);
        } else {
            assert!((e as f64 - want).abs() <= 2.0 * 1.4e-45, "exp({x}) = {e}, want {want} (subnormal)");
        }
        let t = tanh(x);
        assert!(ulps(t, (x as f64).tanh()) <= 2.0, "tanh({x}) = {t}, want {}", (x as f64).tanh());
        x += 0.001_37;
    }
    for tiny in [1e-30f32, -1e-8, 3e-4, f32::MIN_POSITIVE, 1e-45] {
        assert!(ulps(tanh(tiny), (tiny as f64).tanh()) <= 1.0);
    }
    // Both sides of the switch between the polynomial and exp, and of the clamp at 9.1.
    for v in [0.625f32, 9.1] {
        for x in [v.next_down(), v, v.next_up()] {
            assert!(ulps(tanh(x), (x as f64).tanh()) <= 2.0, "tanh({x})");
        }
    }
    assert!(exp(f32::NAN).is_nan() && tanh(f32::NAN).is_nan());
    assert_eq!((tanh(f32::INFINITY), tanh(f32::NEG_INFINITY)), (1.0, -1.0));
    assert_eq!((tanh(1e30), tanh(-1e30)), (1.0, -1.0));
    assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
    assert_eq!((exp(f32::NEG_INFINITY), exp(f32::INFINITY), exp(0.0)), (0.0, f32::INFINITY, 1.0));
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_tanh_f32_stays_within_an_ulp() {
    use std::arch::is_x86_feature_detected as has;
    if !(has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") && has!("fma")) {
        return;
    }
    let tanh = |xs: &[f32]| {
        let mut out = vec![f32::NAN; xs.len()];
        // SAFETY: the CPU has the features (checked above); `xs` and `out` are disjoint, of
        // the length passed.
        unsafe { super::x86_avx512::tanh_f32_avx512(xs.as_ptr(), out.as_mut_ptr(), xs.len()) };
        out
    };
    // Relative to |tanh|, in float32 epsilons, as the scalar sweep above.
    let ulps = |got: f32, want: f64| {
        let want32 = want as f32;
        if want32 == got || (want32.is_nan() && got.is_nan()) {
            return 0.0;
        }
        (got as f64 - want).abs() / (want32.abs().max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64)
    };
    let check = |xs: &[f32], bound: f64| {
        for (&x, t) in xs.iter().zip(tanh(xs)) {
            assert!(ulps(t, (x as f64).tanh()) <= bound, "tanh({x}) = {t}, want {}", (x as f64).tanh());
        }
    };
    // Every 97th float32 from 0 to past the clamp at 9.5, both signs, then a uniform sweep.
    let pos: Vec<f32> = (0..=11.0f32.to_bits()).step_by(97).map(f32::from_bits).collect();
    check(&pos, 1.0);
    check(&pos.iter().map(|x| -x).collect::<Vec<_>>(), 1.0);
    check(&(0..150_000).map(|i| -110.0 + i as f32 * 0.001_37).collect::<Vec<_>>(), 1.0);
    // Both sides of every interval edge (the quarter-octaves from 0.0390625 up, and the
    // clamp).
    let mut edges = vec![super::x86_avx512::TANH_F32_TOP];
    let mut e = super::x86_avx512::TANH_F32_LOW.to_bits();
    while e <= 10.0f32.to_bits() {
        edges.push(f32::from_bits(e));
        e += 1 << 21;
    }
    let near: Vec<f32> = edges.iter().flat_map(|&v| [v.next_down(), v, v.next_up()]).collect();
    check(&near, 1.0);
    // Row 0 is x (1 + x^2 (c3 + c5 x^2)): exact where x^3 / 3 is below half an ulp of x.
    for tiny in [1e-30f32, -1e-8, f32::MIN_POSITIVE, 1e-45, -1e-45] {
        assert_eq!(tanh(&[tiny])[0], tiny);
    }
    let special = tanh(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, 9.6, -0.0, 0.0]);
    assert!(special[0].is_nan());
    assert_eq!(special[1..6], [1.0, -1.0, 1.0, -1.0, 1.0]);
    assert_eq!((special[6].to_bits(), special[7].to_bits()), ((-0.0f32).to_bits(), 0));
    // Every tail length (masked), and in place.
    let xs: Vec<f32> = (0..40).map(|i| i as f32 * 0.3 - 6.0).collect();
    let whole = tanh(&xs);
    for n in 0..=xs.len() {
        assert_eq!(tanh(&xs[..n]), whole[..n]);
    }
    let mut inplace = xs.clone();
    // SAFETY: as above, with `out == x`.
    unsafe { super::x86_avx512::tanh_f32_avx512(inplace.as_ptr(), inplace.as_mut_ptr(), inplace.len()) };
    assert_eq!(inplace, whole);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_exp_f32_stays_within_an_ulp() {
    use std::arch::is_x86_feature_detected as has;
    if !(has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") && has!("fma")) {
        return;
    }
    let exp = |xs: &[f32]| {
        let mut out = vec![f32::NAN; xs.len()];
        // SAFETY: the CPU has the features (checked above); `xs` and `out` are disjoint, of
        // the length passed.
        unsafe { super::x86_avx512::exp_f32_avx512(xs.as_ptr(), out.as_mut_ptr(), xs.len()) };
        out
    };
    // In units of the float32 spacing at `want` (of the smallest subnormal below the normal
    // range), so subnormal results are held to the same bound.
    let ulps = |got: f32, want: f64| {
        let want32 = want as f32;
        if want32 == got {
            return 0.0;
        }
        let a = want32.abs();
        let spacing = if a < f32::MIN_POSITIVE { f32::from_bits(1) } else { f32::from_bits(a.to_bits() + 1) - a };
        (got as f64 - want).abs() / spacing as f64
    };
    let check = |xs: &[f32]| {
        for (&x, e) in xs.iter().zip(exp(xs)) {
            let want = (x as f64).exp();
            assert!(ulps(e, want) <= 1.0, "exp({x}) = {e:e}, want {want:e}");
        }
    };
    // Every 97th float32 of both signs out to past the clamps (overflow at 88.72, 0 below
    // -103.97, subnormal results from -87.34), then a uniform sweep.
    let pos: Vec<f32> = (0..=110.0f32.to_bits()).step_by(97).map(f32::from_bits).collect();
    check(&pos);
    check(&pos.iter().map(|x| -x).collect::<Vec<_>>());
    check(&(0..150_000).map(|i| -110.0 + i as f32 * 0.001_37).collect::<Vec<_>>());
    // Both sides of the overflow threshold, the clamps, the start of the subnormal range,
    // and where results round to 0.
    let edges = [
        88.722_84f32,
        super::x86_avx512::EXP_F32_HIGH,
        super::x86_avx512::EXP_F32_LOW,
        -87.336_55,
        -103.278_93,
        -103.972_08,
    ];
    let near: Vec<f32> = edges.iter().flat_map(|&v| [v.next_down(), v, v.next_up()]).collect();
    check(&near);
    let special = exp(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, 0.0, -0.0, 1e-45, -1e-30]);
    assert!(special[0].is_nan());
    assert_eq!(special[1..], [f32::INFINITY, 0.0, f32::INFINITY, 0.0, 1.0, 1.0, 1.0, 1.0]);
    // Every tail length (masked), and in place.
    let xs: Vec<f32> = (0..40).map(|i| i as f32 * 4.7 - 95.0).collect();
    let whole = exp(&xs);
    for n in 0..=xs.len() {
        assert_eq!(exp(&xs[..n]), whole[..n]);
    }
    let mut inplace = xs.clone();
    // SAFETY: as above, with `out == x`.
    unsafe { super::x86_avx512::exp_f32_avx512(inplace.as_ptr(), inplace.as_mut_ptr(), inplace.len()) };
    assert_eq!(inplace, whole);
}

/// Distance from `want` (exact enough: libm in float64) in units of the float64 spacing at
/// `want`; subnormal results count in units of the smallest subnormal.
fn ulps_f64(got: f64, want: f64) -> f64 {
    if got == want || (got.is_nan() && want.is_nan()) {
        return 0.0;
    }
    let spacing = |v: f64| {
        let v = v.abs();
        if v < f64::MIN_POSITIVE {
            f64::from_bits(1)
        } else {
            f64::from_bits(v.to_bits() + 1) - v
        }
    };
    (got - want).abs() / spacing(want)
}

#[test]
fn vectorizable_exp_and_tanh_f64_stay_within_a_few_ulp() {
    exp_and_tanh_f64_within_a_few_ulp::<super::Plain>();
    exp_and_tanh_f64_within_a_few_ulp::<super::Fused>();
}

fn exp_and_tanh_f64_within_a_few_ulp<M: super::Mla>() {
    let (exp, tanh) = (super::exp_f64_with::<M>, super::tanh_f64_with::<M>);
    // A sweep over the whole finite range of exp (subnormal results included) with an
    // irrational step, then around every switch point and threshold.
    let mut xs: Vec<f64> = (0..400_000).map(|i| -750.0 + i as f64 * 0.003_7 * std::f64::consts::SQRT_2).collect();
    xs.extend((0..200_000).map(|i| -20.0 + i as f64 * 2e-4));
    for v in [0.625, 1e-300, 5e-324, 2.2e-308, 0.5 * 709.78, 354.9, 709.782_712_893_384, 709.79, -708.39, -745.13] {
        let mut x = v;
        for _ in 0..4 {
            xs.extend([x, -x]);
            x = x.next_up();
        }
        x = v;
        for _ in 0..4 {
            x = x.next_down();
            xs.extend([x, -x]);
        }
    }
    for &x in &xs {
        let (e, want) = (exp(x), x.exp());
        assert!(ulps_f64(e, want) <= 1.5, "exp({x}) = {e:e}, want {want:e}");
        let (t, want) = (tanh(x), x.tanh());
        assert!(ulps_f64(t, want) <= 2.0, "tanh({x}) = {t:e}, want {want:e}");
    }
    for x in [0.0, -0.0] {
        assert_eq!(exp(x), 1.0);
        assert_eq!(tanh(x).to_bits(), x.to_bits());
    }
    assert!(exp(f64::NAN).is_nan() && tanh(f64::NAN).is_nan());
    assert_eq!(
        (exp(f64::INFINITY), exp(f64::NEG_INFINITY), exp(1e300), exp(-1e300)),
        (f64::INFINITY, 0.0, f64::INFINITY, 0.0)
    );
    assert_eq!((tanh(f64::INFINITY), tanh(f64::NEG_INFINITY), tanh(1e300), tanh(-1e300)), (1.0, -1.0, 1.0, -1.0));
    assert_eq!(exp(-745.2), 0.0);
    assert_eq!(exp(-745.0), f64::from_bits(1)); // the smallest subnormal
}

/// `|got - want|` in units of the float32 spacing at `want` rounded to float32 (a correctly
/// rounded result is within 0.5); subnormal results in units of the smallest subnormal.
fn ulps_f32(got: f32, want: f64) -> f64 {
    let w = want as f32;
    if got == w || (got.is_nan() && want.is_nan()) {
        return 0.0;
    }
    let a = w.abs();
    (got as f64 - want).abs() / (a.next_up() - a) as f64
}

/// Float32 inputs over the whole positive range (every 61st bit pattern), both sides of
/// 1 bit by bit, and the special values.
fn log_inputs_f32() -> Vec<f32> {
    let mut xs: Vec<f32> = (0..0x7f80_0000u32).step_by(61).map(f32::from_bits).collect();
    xs.extend((0..100_000).flat_map(|i| [f32::from_bits(1f32.to_bits() + i), f32::from_bits(1f32.to_bits() - i)]));
    xs.extend([f32::MIN_POSITIVE, f32::MIN_POSITIVE.next_down(), 1e-45, f32::MAX, std::f32::consts::SQRT_2]);
    xs
}

#[test]
fn vectorizable_log_and_erfc_f32_stay_within_a_few_ulp() {
    log_and_erfc_f32_within_a_few_ulp::<super::Plain>();
    log_and_erfc_f32_within_a_few_ulp::<super::Fused>();
}

fn log_and_erfc_f32_within_a_few_ulp<M: super::Mla>() {
    let (log, erfc) = (super::log_f32_with::<M>, super::erfc_with::<f32, M>);
    let mut worst = 0.0f64;
    for x in log_inputs_f32() {
        let (got, want) = (log(x), (x as f64).ln());
        let u = ulps_f32(got, want);
        worst = worst.max(u);
        assert!(u <= 1.0, "log({x:e}) = {got:e}, want {want:e} ({u} ulp)");
    }
    assert!(worst > 0.5, "the sweep should reach a rounding error: {worst}");
    assert_eq!(log(1.0).to_bits(), 0);
    assert_eq!((log(0.0), log(-0.0), log(f32::INFINITY)), (f32::NEG_INFINITY, f32::NEG_INFINITY, f32::INFINITY));
    for x in [-1e-45, -1.0, -3e38, f32::NEG_INFINITY, f32::NAN] {
        assert!(log(x).is_nan(), "log({x})");
    }
    // erfc over [-6, 10.1], where float32 results go from 2 down to the last subnormal, and
    // around each switch between pieces.
    let mut xs: Vec<f32> = (0..400_000).map(|i| -6.0 + i as f32 * 4.03e-5 * std::f32::consts::PI).collect();
    for v in [0.25f32, 0.84375, 1.25, 1.0 / 0.35, 9.0, 10.0, 28.0] {
        let (mut up, mut down) = (v, v);
        for _ in 0..4 {
            xs.extend([up, -up, down, -down]);
            (up, down) = (up.next_up(), down.next_down());
        }
    }
    xs.extend([0.0, -0.0, 1e-45, -1e-45, 1e-30, -1e-30, 30.0, -30.0, 1e30, -1e30]);
    for x in xs {
        let (got, want) = (erfc(x), libm::erfc(x as f64));
        assert!(ulps_f32(got, want) <= 2.5, "erfc({x:e}) = {got:e}, want {want:e}");
    }
    assert_eq!((erfc(f32::INFINITY), erfc(f32::NEG_INFINITY)), (0.0, 2.0));
    assert!(erfc(f32::NAN).is_nan());
}

#[test]
fn vectorizable_log_and_erfc_f64_stay_within_a_few_ulp() {
    log_and_erfc_f64_within_a_few_ulp::<super::Plain>();
    log_and_erfc_f64_within_a_few_ulp::<super::Fused>();
}

fn log_and_erfc_f64_within_a_few_ulp<M: super::Mla>() {
    let (log, erfc) = (super::log_f64_with::<M>, super::erfc_with::<f64, M>);
    // Bit patterns over the whole positive range (subnormals included), both sides of 1 bit
    // by bit, and [0.5, 2] densely.
    let step = 0x7ff0_0000_0000_0000u64 / 2_000_003;
    let mut xs: Vec<f64> = (0..2_000_003u64).map(|i| f64::from_bits(i * step + i % 7)).collect();
    xs.extend((0..100_000).flat_map(|i| [f64::from_bits(1f64.to_bits() + i), f64::from_bits(1f64.to_bits() - i)]));
    xs.extend((0..500_000).map(|i| 0.5 + i as f64 * 3e-6 * std::f64::consts::SQRT_2));
    xs.extend([5e-324, f64::MIN_POSITIVE, f64::MIN_POSITIVE.next_down(), f64::MAX, std::f64::consts::SQRT_2]);
    for x in xs {
        let (got, want) = (log(x), x.ln());
        assert!(ulps_f64(got, want) <= 1.0, "log({x:e}) = {got:e}, want {want:e}");
    }
    assert_eq!(log(1.0).to_bits(), 0);
    assert_eq!((log(0.0), log(-0.0), log(f64::INFINITY)), (f64::NEG_INFINITY, f64::NEG_INFINITY, f64::INFINITY));
    for x in [-5e-324, -1.0, -1e308, f64::NEG_INFINITY, f64::NAN] {
        assert!(log(x).is_nan(), "log({x})");
    }
    // erfc over [-6, 27.3], from 2 down to the last subnormal, and around each switch. The
    // reference itself is off by up to 2.5 ulp for |x| >= 1.25 (its two exps); sampled
    // against mpmath there, this one is within 1.9 ulp (Plain) and 2.4 (Fused).
    let mut xs: Vec<f64> = (0..600_000).map(|i| -6.0 + i as f64 * 1.7e-5 * std::f64::consts::PI).collect();
    for v in [0.25, 0.84375, 1.25, 1.0 / 0.35, 26.0, 27.0, 28.0] {
        let (mut up, mut down) = (v, v);
        for _ in 0..4 {
            xs.extend([up, -up, down, -down]);
            (up, down) = (up.next_up(), down.next_down());
        }
    }
    xs.extend([0.0, -0.0, 5e-324, -5e-324, 1e-300, -1e-300, 30.0, -30.0, 1e300, -1e300]);
    for x in xs {
        let (got, want) = (erfc(x), libm::erfc(x));
        assert!(ulps_f64(got, want) <= 4.0, "erfc({x:e}) = {got:e}, want {want:e}");
    }
    assert_eq!((erfc(f64::INFINITY), erfc(f64::NEG_INFINITY)), (0.0, 2.0));
    assert!(erfc(f64::NAN).is_nan());
}

/// Whether the CPU runs the [`WholeRun`](super::WholeRun) kernels.
#[cfg(target_arch = "x86_64")]
fn has_whole_run_features() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq") && has!("fma") && has!("f16c")
}

/// `kernel` over `xs` into a new vector; every tail length and in place give the same.
#[cfg(target_arch = "x86_64")]
fn whole_run<T: Copy>(kernel: unsafe fn(*const T, *mut T, usize), xs: &[T]) -> Vec<T> {
    let mut out = xs.to_vec();
    // SAFETY: the caller checked the CPU's features; `xs` and `out` are disjoint, of the
    // length passed.
    unsafe { kernel(xs.as_ptr(), out.as_mut_ptr(), xs.len()) };
    out
}

/// Every tail length (masked) and in place give what the whole run gives.
#[cfg(target_arch = "x86_64")]
fn tails_and_in_place<T: Copy + std::fmt::Debug>(
    kernel: unsafe fn(*const T, *mut T, usize),
    xs: &[T],
    bits: impl Fn(T) -> u32,
) {
    let whole: Vec<u32> = whole_run(kernel, xs).into_iter().map(&bits).collect();
    for n in 0..=xs.len().min(70) {
        let part: Vec<u32> = whole_run(kernel, &xs[..n]).into_iter().map(&bits).collect();
        assert_eq!(part, whole[..n]);
    }
    let mut inplace = xs.to_vec();
    // SAFETY: as in `whole_run`, with `out == x`.
    unsafe { kernel(inplace.as_ptr(), inplace.as_mut_ptr(), inplace.len()) };
    assert_eq!(inplace.into_iter().map(bits).collect::<Vec<_>>(), whole);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_log_f32_is_the_fused_loop_bit_for_bit() {
    if !has_whole_run_features() {
        return;
    }
    // Every 997th bit pattern of both signs (subnormals, zeros, infinities and NaNs among
    // them), the neighbourhoods of 1 and of the normal range's edge, and vectors that mix
    // special lanes with normal ones (the kernel's slow path) or hold none (its fast path).
    let mut xs: Vec<f32> = (0..=u32::MAX).step_by(997).map(f32::from_bits).collect();
    xs.extend((0..20_000).flat_map(|i| [f32::from_bits(1f32.to_bits() + i), f32::from_bits(1f32.to_bits() - i)]));
    let edge = f32::MIN_POSITIVE.to_bits();
    xs.extend((edge - 40..edge + 40).map(f32::from_bits));
    xs.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MAX, 1e-45, -1.0]);
    let got = whole_run(super::x86_avx512::log_f32_avx512, &xs);
    for (&x, g) in xs.iter().zip(got) {
        let want = super::log_f32_with::<super::Fused>(x);
        assert_eq!(g.to_bits(), want.to_bits(), "log({x:e}) = {g:e}, the loop gives {want:e}");
    }
    let mixed: Vec<f32> = (0..80).map(|i| if i % 23 == 5 { -(i as f32) } else { 0.37 * i as f32 + 1e-40 }).collect();
    tails_and_in_place(super::x86_avx512::log_f32_avx512, &mixed, f32::to_bits);
}

/// The stable logistic function in float64: the reference for sigmoid and silu.
fn sigmoid_f64(x: f64) -> f64 {
    let e = (-x.abs()).exp();
    if x >= 0.0 {
        1.0 / (1.0 + e)
    } else {
        e / (1.0 + e)
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_sigmoid_and_silu_f32_stay_within_their_bounds() {
    if !has_whole_run_features() {
        return;
    }
    // The bounds `tools/sweep_f32_ulp.py sigmoid silu` measured over every float32, in units
    // of the float32 spacing at the exact result (2^-149 below the normal range: sigmoid's
    // results are subnormal for x in (-103.3, -87.3), where `1 / (1 + np.exp(-x))` gives 0).
    const SIGMOID_ULP: f64 = 2.5;
    const SILU_ULP: f64 = 3.5;
    let ulps = |got: f32, want: f64| {
        let w = want as f32;
        if w == got {
            return 0.0;
        }
        let a = w.abs();
        let spacing = if a < f32::MIN_POSITIVE { f32::from_bits(1) } else { a.next_up() - a };
        (got as f64 - want).abs() / spacing as f64
    };
    // Every 97th float32 out to past where sigmoid rounds to 0 and 1, both signs, and both
    // sides of the subnormal range's edges.
    let pos: Vec<f32> = (0..=130.0f32.to_bits()).step_by(97).map(f32::from_bits).collect();
    let mut xs: Vec<f32> = pos.iter().flat_map(|&x| [x, -x]).collect();
    for v in [
        -87.336_55f32,
        -103.278_93,
        -103.972_08,
        -108.7,
        super::x86_avx512::EXP_F32_LOW,
        super::x86_avx512::SIGMOID_F32_LOW,
    ] {
        let (mut up, mut down) = (v, v);
        for _ in 0..8 {
            xs.extend([up, down]);
            (up, down) = (up.next_up(), down.next_down());
        }
    }
    let (sig, silu) =
        (whole_run(super::x86_avx512::sigmoid_f32_avx512, &xs), whole_run(super::x86_avx512::silu_f32_avx512, &xs));
    let (mut worst_sig, mut worst_silu) = (0.0f64, 0.0f64);
    for ((&x, s), l) in xs.iter().zip(sig).zip(silu) {
        let want = sigmoid_f64(x as f64);
        let u = ulps(s, want);
        assert!(u <= SIGMOID_ULP, "sigmoid({x:e}) = {s:e}, want {want:e} ({u} ulp)");
        let v = ulps(l, x as f64 * want);
        assert!(v <= SILU_ULP, "silu({x:e}) = {l:e}, want {:e} ({v} ulp)", x as f64 * want);
        (worst_sig, worst_silu) = (worst_sig.max(u), worst_silu.max(v));
    }
    assert!(worst_sig > 0.5 && worst_silu > 0.5, "the sweep should reach rounding errors");
    let special = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 200.0, -200.0, -1e4];
    let s = whole_run(super::x86_avx512::sigmoid_f32_avx512, &special);
    assert!(s[0].is_nan());
    assert_eq!(s[1..], [1.0, 0.0, 0.5, 0.5, 1.0, 0.0, 0.0]);
    let l = whole_run(super::x86_avx512::silu_f32_avx512, &special);
    // silu(-inf) = -inf * 0, NaN, as the scalar loop and `x / (1 + np.exp(-x))` give.
    assert!(l[0].is_nan() && l[2].is_nan());
    assert_eq!(l[1], f32::INFINITY);
    assert_eq!([l[3].to_bits(), l[4].to_bits()], [0, (-0.0f32).to_bits()]);
    assert_eq!([l[5], l[6].to_bits() as f32, l[7]], [200.0, (-0.0f32).to_bits() as f32, -0.0]);
    assert!(l[7].is_sign_negative());
    let mixed: Vec<f32> = (0..80).map(|i| (i as f32 - 40.0) * 2.7).collect();
    tails_and_in_place(super::x86_avx512::sigmoid_f32_avx512, &mixed, f32::to_bits);
    tails_and_in_place(super::x86_avx512::silu_f32_avx512, &mixed, f32::to_bits);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_f16_kernels_are_the_f32_kernels_rounded_once() {
    use half::f16;
    if !has_whole_run_features() {
        return;
    }
    // Every float16 value: widened, the float32 kernel, rounded once, bit for bit.
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let mut wide = vec![0f32; all.len()];
    super::widen_f16(&all, &mut wide);
    use super::x86_avx512::{EXP_AVX512, LOG_AVX512, SIGMOID_AVX512, SILU_AVX512, TANH_AVX512};
    for (name, kernel) in [
        ("exp", EXP_AVX512),
        ("log", LOG_AVX512),
        ("tanh", TANH_AVX512),
        ("sigmoid", SIGMOID_AVX512),
        ("silu", SILU_AVX512),
    ] {
        let via_f32 = whole_run(kernel.f32, &wide);
        let mut want = vec![f16::ZERO; all.len()];
        super::narrow_f16(&via_f32, &mut want);
        let got = whole_run(kernel.f16, &all);
        for ((x, g), w) in all.iter().zip(&got).zip(&want) {
            assert_eq!(g.to_bits(), w.to_bits(), "{name}({x}) = {g}, want {w}");
        }
        tails_and_in_place(kernel.f16, &all[15_000..15_080], |h| h.to_bits() as u32);
    }
}

#[test]
fn f16_conversions_match_half() {
    use half::f16;
    // Every float16 widens exactly (NaNs stay NaN).
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let mut wide = vec![0f32; all.len()];
    super::widen_f16(&all, &mut wide);
    for (h, w) in all.iter().zip(&wide) {
        assert!(w.to_bits() == h.to_f32().to_bits() || (h.is_nan() && w.is_nan()), "{h:?} widened to {w}");
    }
    // Rounding: every 4099th float32 bit pattern, the midpoints between float16 neighbours
    // (ties to even) and the overflow edge; every tail length of the 8-wide loop.
    let mut xs: Vec<f32> = (0..=u32::MAX).step_by(4099).map(f32::from_bits).collect();
    xs.extend(wide.windows(2).filter(|w| w[0].is_finite() && w[1].is_finite()).map(|w| (w[0] + w[1]) / 2.0));
    xs.extend([65_504.0, 65_519.996, 65_520.0, -65_520.0, 1e-8, -6e-8, 2.98e-8]);
    for n in [xs.len(), 0, 1, 7, 8, 9, 15, 17] {
        let mut narrow = vec![f16::ZERO; n];
        super::narrow_f16(&xs[..n], &mut narrow);
        for (x, h) in xs.iter().zip(&narrow) {
            let want = f16::from_f32(*x);
            assert!(h.to_bits() == want.to_bits() || (x.is_nan() && h.is_nan()), "{x:e} rounded to {h}, want {want}");
        }
    }
}
