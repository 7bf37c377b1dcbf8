"""Small-call overhead, robust to a noisy machine: paired medians at 1K elements.

Each row times an `ob.ops` operator and the numpy call it replaces back to back, several times,
and prints the median of the time ratios (below 1 is faster) with its spread: on a shared
2-core machine single best-of runs move by ±0.1, medians of pairs much less. The issue's
target at 1K is ≤ 0.6× numpy's time for elementwise operators and reductions.

    python benchmarks/bench_small_calls.py [--pairs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import opbridge as ob  # noqa: E402
from _timing import best_call_time  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=9, help="paired measurements per row (default 9)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    a = rng.random(1024, dtype=np.float32) + 0.5
    b = rng.random(1024, dtype=np.float32) + 0.5
    rows = [
        ("add", ob.ops.add, np.add, (a, b)),
        ("mul", ob.ops.mul, np.multiply, (a, b)),
        ("exp", ob.ops.exp, np.exp, (a,)),
        ("tanh", ob.ops.tanh, np.tanh, (a,)),
        ("sum", ob.ops.sum, np.sum, (a,)),
        ("max", ob.ops.max, np.max, (a,)),
    ]
    print(f"# ob.ops vs numpy {np.__version__} at 1K float32: median of {args.pairs} paired time ratios\n")
    print("| op | median | min | max |")
    print("|---|---:|---:|---:|")
    for name, ours, theirs, operands in rows:
        np.testing.assert_allclose(ours(*operands), theirs(*operands), rtol=1e-5)
        ratios = [
            best_call_time(lambda: ours(*operands)) / best_call_time(lambda: theirs(*operands))
            for _ in range(args.pairs)
        ]
        print(f"| {name} | {statistics.median(ratios):.2f} | {min(ratios):.2f} | {max(ratios):.2f} |")


if __name__ == "__main__":
    main()
