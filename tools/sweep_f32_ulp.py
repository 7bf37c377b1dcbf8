"""Exhaustive accuracy of a float32 unary operator: every one of the 2^32 float32 bit patterns
through `ob.ops.<op>`, against float64 numpy, in units of the float32 spacing at the exact
result (the smallest subnormal, 2^-149, below the normal range, so subnormal results are held to
the same bound). Prints the worst error, where it is, and how many results are not the float32
nearest to the exact one. It also checks NaN in, NaN out.

    python tools/sweep_f32_ulp.py sigmoid silu log exp tanh     # about a minute per op

The unit tests sweep every 97th float32 (CI time); this is the proof behind their bounds.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import opbridge as ob


def reference(op: str, x: np.ndarray) -> np.ndarray:
    """`op` in float64, from the definitions (written so they neither overflow nor cancel)."""
    with np.errstate(all="ignore"):
        if op == "exp":
            return np.exp(x)
        if op == "log":
            return np.log(x)
        if op == "tanh":
            return np.tanh(x)
        e = np.exp(-np.abs(x))
        sig = np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        if op == "sigmoid":
            return sig
        if op == "silu":
            return x * sig
    raise SystemExit(f"no reference for {op!r}")


def spacing32(want: np.ndarray) -> np.ndarray:
    """The float32 spacing at each exact result (2^-149 below the normal range)."""
    a = np.abs(want).astype(np.float32)
    a = np.where(np.isinf(a), np.float32(np.finfo(np.float32).max), a)
    up = np.nextafter(a, np.float32(np.inf))
    s = (up - a).astype(np.float64)
    return np.maximum(s, 2.0**-149)


@np.errstate(all="ignore")
def sweep(op: str, chunk_bits: int = 24) -> None:
    f = ob.ops.get(op)
    worst, worst_x, not_nearest, nan_bad = 0.0, 0.0, 0, 0
    step = 1 << chunk_bits
    t0 = time.time()
    for start in range(0, 1 << 32, step):
        bits = np.arange(start, start + step, dtype=np.uint64).astype(np.uint32)
        x = bits.view(np.float32)
        got = f(x).astype(np.float64)
        want = reference(op, x.astype(np.float64))
        nan_in = np.isnan(want)
        nan_bad += int(np.count_nonzero(nan_in != np.isnan(got)))
        ok = ~nan_in & ~np.isnan(got)
        g, w = got[ok], want[ok]
        inf = np.isinf(w) | np.isinf(g)
        nan_bad += int(np.count_nonzero(inf & (g != w)))
        g, w, xs = g[~inf], w[~inf], x[ok][~inf]
        err = np.abs(g - w) / spacing32(w)
        not_nearest += int(np.count_nonzero(g != w.astype(np.float32).astype(np.float64)))
        k = int(np.argmax(err)) if err.size else 0
        if err.size and err[k] > worst:
            worst, worst_x = float(err[k]), float(xs[k])
    print(
        f"{op}: max {worst:.3f} ulp (at x = {worst_x!r}), {not_nearest} of 2^32 results not the nearest float32, "
        f"{nan_bad} NaN/inf mismatches, {time.time() - t0:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ops", nargs="+")
    args = parser.parse_args()
    for op in args.ops:
        sweep(op)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
