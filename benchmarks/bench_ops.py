"""ob.ops families against numpy in the same run (issue 3's targets).

Each row times one operator at 1K, 64K and 4M float32 elements against the numpy call (or, for
softmax and layer_norm, the numpy expression users write) and prints the time ratio. Operators
that are not registered yet are skipped, saying so.

    python benchmarks/bench_ops.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import opbridge as ob  # noqa: E402
from _timing import best_call_time, fmt_time  # noqa: E402

SIZES = {"1K": 1 << 10, "64K": 1 << 16, "4M": 1 << 22}


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def cases(n: int, rng: np.random.Generator):
    """(family, name, opbridge call, numpy call, args) for arrays of n float32 elements."""
    a = rng.random(n, dtype=np.float32) + 0.5
    b = rng.random(n, dtype=np.float32) + 0.5
    rows = n // 256 if n >= 256 else 1
    x2 = a.reshape(rows, -1)
    w, bias = np.ones(x2.shape[1], np.float32), np.zeros(x2.shape[1], np.float32)
    yield "elementwise", "add", "add", np.add, (a, b), {}
    yield "elementwise", "mul", "mul", np.multiply, (a, b), {}
    yield "unary", "exp", "exp", np.exp, (a,), {}
    yield "unary", "tanh", "tanh", np.tanh, (a,), {}
    yield "reduction", "sum", "sum", np.sum, (a,), {}
    yield "reduction", "max", "max", np.max, (a,), {}
    yield "nn", "softmax (rows of 256)", "softmax", np_softmax, (x2,), {}
    yield "nn", "layer_norm (rows of 256)", "layer_norm", np_layer_norm, (x2, w, bias), {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    min_time = 0.05 if args.quick else 0.2
    rng = np.random.default_rng(0)
    print(f"# ob.ops vs numpy {np.__version__} (float32; time ratio ob/np, below 1 is faster)\n")
    print("| family | op | " + " | ".join(f"{k} ob / np (ratio)" for k in SIZES) + " |")
    print("|---|---|" + "---:|" * len(SIZES))
    results: dict[tuple[str, str], list[str]] = {}
    for n in SIZES.values():
        for family, title, name, reference, inputs, _kwargs in cases(n, rng):
            try:
                op = ob.ops.get(name)
            except ob.OpBridgeError:
                results.setdefault((family, title), []).append("not registered")
                continue
            t_ob = best_call_time(op, *inputs, min_time=min_time)
            t_np = best_call_time(reference, *inputs, min_time=min_time)
            results.setdefault((family, title), []).append(f"{fmt_time(t_ob)} / {fmt_time(t_np)} ({t_ob / t_np:.2f})")
    for (family, title), cells in results.items():
        print(f"| {family} | {title} | " + " | ".join(cells) + " |")
    print("\nTargets: elementwise and reductions ≤ 0.6× numpy at 1K and ≥ 1.1× throughput (≤ 0.91× time) at 4M;")
    print("softmax and layer_norm ≥ 2× faster (≤ 0.5× time) than the numpy expression.")


if __name__ == "__main__":
    main()
