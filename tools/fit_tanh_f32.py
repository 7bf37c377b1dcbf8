"""Fits the coefficient table `TANH_F32_ROWS` of the AVX-512 float32 tanh kernel in
crates/opbridge-ops/src/cpu/math/x86_avx512.rs (see the doc comment there for the scheme).

    python tools/fit_tanh_f32.py [max_degree, default 5] > rows.txt

Prints the rows to stdout and each interval's fit error (in float32 ulp) to stderr. Needs numpy.
"""

import struct
import sys

import numpy as np

f32 = np.float32


def bits(v):
    return struct.unpack("<I", struct.pack("<f", v))[0]


def fromb(b):
    return struct.unpack("<f", struct.pack("<I", b))[0]


def lawson(X, f, w, fixed, deg, iters=60):
    # minimize max |(sum c_k y^k - f) * w| with some coefficients fixed
    free = [k for k in range(deg + 1) if k not in fixed]
    rhs = f - sum(fixed[k] * X**k for k in fixed)
    A = np.stack([X**k for k in free], 1)
    u = np.ones_like(X) / len(X)
    for _ in range(iters):
        sw = np.sqrt(u) * w
        c, *_ = np.linalg.lstsq(A * sw[:, None], rhs * sw, rcond=None)
        e = np.abs((A @ c - rhs) * w)
        u = u * e
        u /= u.sum()
    full = dict(fixed)
    full.update(zip(free, c, strict=True))
    return full, e.max()


def fit(lo, hi, b, deg, odd=False, c0=None):
    t = np.cos(np.pi * (np.arange(3000) + 0.5) / 3000)
    x = (lo + hi) / 2 + (hi - lo) / 2 * t
    x = np.concatenate([x, [lo, hi]])
    x = x[x > 0] if odd else x
    y = x - b
    f = np.tanh(x)
    w = 1 / f
    fixed = {} if c0 is None else {0: c0}
    if odd:
        fixed = {0: 0.0, 1: 1.0}
        for k in range(2, deg + 1, 2):
            fixed[k] = 0.0
    c, err = lawson(y, f, w, fixed, deg)
    # sequential rounding to f32 with refit
    for k in range(deg + 1):
        if k in fixed and k not in c:
            continue
        fixed[k] = float(f32(c[k]))
        if len(fixed) <= deg:
            c, err = lawson(y, f, w, fixed, deg)
        else:
            c = dict(fixed)
    cs = [float(f32(c[k])) for k in range(deg + 1)] + [0.0] * (5 - deg)
    # approximation error with f32 coefs in exact arithmetic
    p = sum(cs[k] * y**k for k in range(6))
    return cs, np.max(np.abs((p - f) / f))


def intervals():
    iv = [(0.0, 0.046875)]
    e = -5
    j = 2
    while True:
        lo = 2.0**e * (1 + j / 4)
        hi = 2.0**e * (1 + (j + 1) / 4)
        iv.append((lo, hi))
        if lo == 8.0:
            iv[-1] = (8.0, 9.5)
            break
        j += 1
        if j == 4:
            j = 0
            e += 1
    return iv


def pick_b(lo, hi):
    # an f32 near the centre whose tanh is close to an f32
    c = (lo + hi) / 2
    cb = bits(c)
    best = None
    for d in range(-2000, 2001):
        v = fromb(cb + d)
        t = np.tanh(v)
        r = abs(float(f32(t)) - t) / (np.spacing(f32(t)))
        if best is None or r < best[0]:
            best = (r, v)
    return best[1]


def lit(v):
    v = np.float32(v)
    if v == 0:
        return "0.0"
    s = (
        np.format_float_scientific(v, unique=True, trim="0", exp_digits=1)
        if abs(v) < 1e-3
        else np.format_float_positional(v, unique=True, trim="0")
    )
    s = s.replace("e+", "e")
    m = s.split("e")[0]
    if "." not in m:
        s = s.replace(m, m + ".0", 1)
    return s


def print_rows(rows):
    """The rows as `TANH_F32_ROWS` spells them (Rust array literals)."""
    for lo, hi, b, cs in rows:
        print(f"    [{', '.join(lit(v) for v in [b] + list(cs))}], // [{lo:g}, {hi:g})")


if __name__ == "__main__":
    deg = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    iv = intervals()
    print(len(iv), file=sys.stderr)
    rows = []
    worst = 0
    for i, (lo, hi) in enumerate(iv):
        if i == 0:
            b = 0.0
            cs, err = fit(lo, hi, 0.0, deg, odd=True)
        elif i == len(iv) - 1:
            b = 9.5
            cs, err = fit(lo, hi, b, deg, c0=1.0)
        else:
            b = pick_b(lo, hi)
            for d in range(3, deg + 1):
                cs, err = fit(lo, hi, b, d)
                if err < 0.1 * 2**-24:
                    break
        worst = max(worst, err / 2**-24)
        print(f"{i:2d} [{lo:.6g},{hi:.6g}) b={b:.8g} rel err {err:.3g} = {err / 2**-24:.3f} ulp", file=sys.stderr)
        rows.append((lo, hi, b, cs))
    print("worst", worst, file=sys.stderr)
    print_rows(rows)
