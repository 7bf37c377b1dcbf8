"""vector_add against numpy, measured in the same run (the seed's table, plus our targets).

Prints, for sizes 1K..16M (float32): time, MElements/s, GB/s (3 arrays moved per element) and
the ratio to numpy, for a fresh output (``ob.vector_add(a, b)`` vs ``np.add(a, b)``) and with
``out=`` (vs ``np.add(a, b, out=c)``). Then the per-call overhead at n=4 and n=1024 and the
issue's targets. ``--threshold`` measures where two cores start to beat one.

    python benchmarks/bench_vector_add.py [--quick] [--threshold] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import opbridge as ob  # noqa: E402
from _timing import best_call_time, best_time, fmt_time  # noqa: E402

SIZES = [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]


def label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def measure(n: int, min_time: float) -> dict[str, float]:
    rng = np.random.default_rng(0)
    a = rng.random(n, dtype=np.float32)
    b = rng.random(n, dtype=np.float32)
    c = np.empty_like(a)
    assert np.array_equal(ob.vector_add(a, b), a + b)
    return {
        "n": n,
        "ob_fresh": best_time(lambda: ob.vector_add(a, b), min_time),
        "np_fresh": best_time(lambda: np.add(a, b), min_time),
        "ob_out": best_time(lambda: ob.vector_add(a, b, out=c), min_time),
        "np_out": best_time(lambda: np.add(a, b, out=c), min_time),
    }


def print_table(rows: list[dict[str, float]]) -> None:
    print("| n | mode | opbridge | MElem/s | GB/s | numpy | numpy GB/s | time ratio ob/np |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        n = int(r["n"])
        for mode in ("fresh", "out"):
            t_ob, t_np = r[f"ob_{mode}"], r[f"np_{mode}"]
            gbs = lambda t: 3 * 4 * n / t / 1e9  # noqa: E731
            print(
                f"| {label(n)} | {mode} | {fmt_time(t_ob)} | {n / t_ob / 1e6:,.0f} | {gbs(t_ob):.1f} | "
                f"{fmt_time(t_np)} | {gbs(t_np):.1f} | {t_ob / t_np:.2f} |"
            )


def overhead(min_time: float) -> dict[int, tuple[float, float]]:
    out = {}
    for n in (4, 1024):
        a = np.ones(n, np.float32)
        b = np.ones(n, np.float32)
        out[n] = (
            best_call_time(ob.vector_add, a, b, min_time=min_time),
            best_call_time(np.add, a, b, min_time=min_time),
        )
    return out


def threshold(min_time: float) -> None:
    """Time of one add on one core vs both, around the parallel threshold."""
    print("\n## Parallel threshold (out=, float32): one thread vs both cores")
    print(f"current PARALLEL_MIN_ELEMS = {ob._native.PARALLEL_MIN_ELEMS}")
    print("| n | numpy (1 thread) | opbridge | ratio |")
    print("|---|---:|---:|---:|")
    for shift in range(14, 21):
        n = 1 << shift
        a = np.ones(n, np.float32)
        c = np.empty_like(a)
        t_np = best_time(lambda: np.add(a, a, out=c), min_time)
        t_ob = best_time(lambda: ob.vector_add(a, a, out=c), min_time)
        print(f"| {label(n)} | {fmt_time(t_np)} | {fmt_time(t_ob)} | {t_ob / t_np:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter loops (the demo uses this)")
    parser.add_argument("--threshold", action="store_true", help="also measure the parallel threshold")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    min_time = 0.05 if args.quick else 0.25

    print(f"# vector_add vs numpy {np.__version__} (float32, {os.cpu_count()} CPUs)\n")
    rows = [measure(n, min_time) for n in SIZES]
    print_table(rows)
    calls = overhead(min_time)
    print("\n## Per-call time, fresh output")
    print("| n | opbridge | numpy | ratio |")
    print("|---|---:|---:|---:|")
    for n, (t_ob, t_np) in calls.items():
        print(f"| {n} | {fmt_time(t_ob)} | {fmt_time(t_np)} | {t_ob / t_np:.2f} |")

    big = rows[-1]
    print("\n## Targets (issue 2)")
    targets = [
        ("n=4 time ≤ 0.6× np.add", calls[4][0] / calls[4][1], 0.6, "≤"),
        ("n=1024 time ≤ 0.6× np.add", calls[1024][0] / calls[1024][1], 0.6, "≤"),
        ("16M out= throughput ≥ 1.15× np.add(out=)", big["np_out"] / big["ob_out"], 1.15, "≥"),
        ("16M fresh time ≤ 0.75× np.add", big["ob_fresh"] / big["np_fresh"], 0.75, "≤"),
    ]
    for name, value, goal, sense in targets:
        met = value <= goal if sense == "≤" else value >= goal
        print(f"- {name}: {value:.2f}× — {'met' if met else 'NOT met'}")
    if args.threshold:
        threshold(min_time)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "per_call": {str(k): v for k, v in calls.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
