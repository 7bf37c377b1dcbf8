"""The kernels of issue 15's last target, against numpy in the same run (time ratio ob / np):

- `sigmoid` and `silu` in float32 against the numpy expressions users write for them
  (`1 / (1 + np.exp(-x))`, `x / (1 + np.exp(-x))`);
- every float16 unary operator against numpy's float16 ufunc (or the float16 expression where
  numpy has no ufunc: relu, sigmoid, silu, the two gelus), target ≤ 1.0;
- the reductions at 64K float32 elements (and 1M for scale), target ≤ 0.8.

Each side is timed as a statement (`timeit` of `f(x)`), best of 5 loops.

    python benchmarks/bench_kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import opbridge as ob  # noqa: E402
from _timing import best_call_time, fmt_time  # noqa: E402


def _erf(x: np.ndarray) -> np.ndarray:
    # numpy has no erf; math.erf per element is what a numpy-only user would fall back to, so
    # the gelu_erf row is a courtesy, not a target.
    return np.frompyfunc(math.erf, 1, 1)(x).astype(x.dtype)


def numpy_unary(name: str, dtype: type):
    """numpy's way to compute `name` in `dtype` (a ufunc, or the expression users write)."""
    one, half = dtype(1), dtype(0.5)
    return {
        "neg": np.negative,
        "abs": np.abs,
        "exp": np.exp,
        "log": np.log,
        "sqrt": np.sqrt,
        "tanh": np.tanh,
        "relu": lambda x: np.maximum(x, dtype(0)),
        "sigmoid": lambda x: one / (one + np.exp(-x)),
        "silu": lambda x: x / (one + np.exp(-x)),
        "gelu_tanh": lambda x: half * x * (one + np.tanh(dtype(0.7978846) * (x + dtype(0.044715) * x * x * x))),
        "gelu_erf": lambda x: half * x * (one + _erf(x * dtype(0.70710678))),
    }[name]


UNARY = ["neg", "abs", "exp", "log", "sqrt", "relu", "tanh", "sigmoid", "silu", "gelu_tanh", "gelu_erf"]


def ob_unary(name: str):
    """`ob.ops`' call for a row of `UNARY` (the two gelus are one operator with an argument)."""
    if name == "gelu_tanh":
        return functools.partial(ob.ops.gelu, approximate="tanh")
    return ob.ops.gelu if name == "gelu_erf" else ob.ops.get(name)


REDUCTIONS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "argmax": np.argmax}


def row(label: str, f_ob, f_np, args, min_time: float) -> tuple[str, float]:
    t_ob = best_call_time(f_ob, *args, min_time=min_time)
    t_np = best_call_time(f_np, *args, min_time=min_time)
    return f"| {label} | {fmt_time(t_ob)} | {fmt_time(t_np)} | {t_ob / t_np:.2f} |", t_ob / t_np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter loops (noisier)")
    args = parser.parse_args()
    min_time = 0.05 if args.quick else 0.2
    rng = np.random.default_rng(0)
    print(f"# issue 15 kernels: ob.ops vs numpy {np.__version__} (time ratio ob / np, below 1 is faster)\n")

    print("| float32 sigmoid / silu | ob | np expression | ratio |\n|---|---:|---:|---:|")
    for n in (1 << 10, 1 << 16, 1 << 20):
        x = (rng.standard_normal(n) * 4).astype(np.float32)
        for name in ("sigmoid", "silu"):
            print(row(f"{name} {n}", ob.ops.get(name), numpy_unary(name, np.float32), (x,), min_time)[0])

    print("\n| float16 unary (64K) | ob | np | ratio |\n|---|---:|---:|---:|")
    n = 1 << 16
    x16 = (rng.standard_normal(n) * 2).astype(np.float16)
    pos16 = np.abs(x16) + np.float16(0.25)
    worst = 0.0
    for name in UNARY:
        xs = pos16 if name in ("log", "sqrt") else x16
        line, ratio = row(name, ob_unary(name), numpy_unary(name, np.float16), (xs,), min_time)
        if name != "gelu_erf":
            worst = max(worst, ratio)
        print(line)
    print(f"\nworst float16 ratio (gelu_erf aside): {worst:.2f} (target ≤ 1.0)")

    print("\n| float32 reduction | ob | np | ratio |\n|---|---:|---:|---:|")
    worst = 0.0
    for n in (1 << 16, 1 << 20):
        x = rng.standard_normal(n).astype(np.float32)
        for name, f_np in REDUCTIONS.items():
            line, ratio = row(f"{name} {n}", ob.ops.get(name), f_np, (x,), min_time)
            if n == 1 << 16:
                worst = max(worst, ratio)
            print(line)
    print(f"\nworst 64K reduction ratio: {worst:.2f} (target ≤ 0.8)")


if __name__ == "__main__":
    main()
