"""What the profiler costs per operator call: inactive (against numpy's call in the same run) and
recording (the time added per call), on the numpy path and on the tensor path.

    python benchmarks/bench_profiler.py [--pairs N]

The issue's targets: with no profile active, the instrumented small call stays within 2% of its
time before the instrumentation (one relaxed atomic load per instrumented point: compare this
script's "inactive / numpy" column with `bench_small_calls.py` on the previous build); with a
profile recording, at most 1 µs added per operator call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import opbridge as ob  # noqa: E402

CALLS = 20_000  # per timing loop: bounded, since a recording profile keeps every event


def per_call(stmt: str, env: dict[str, object]) -> float:
    """Seconds per call: best of 5 loops of CALLS calls."""
    return min(timeit.Timer(stmt, globals=env).repeat(repeat=5, number=CALLS)) / CALLS


def recording(stmt: str, env: dict[str, object], **options: bool) -> float:
    """Seconds per call while a profile records (a fresh profile per loop)."""
    best = float("inf")
    for _ in range(5):
        with ob.profiler.profile(**options):
            best = min(best, timeit.Timer(stmt, globals=env).timeit(number=CALLS) / CALLS)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5, help="paired measurements per row (default 5)")
    args = parser.parse_args()
    a = np.ones(4, np.float32)
    t = ob.asarray(a)
    rows = [
        ("ob.ops.add(a, a), numpy n=4", "f(a, a)", {"f": ob.ops.add, "a": a}, "g(a, a)", {"g": np.add, "a": a}),
        ("ob.ops.softmax(a), numpy n=4", "f(a)", {"f": ob.ops.softmax, "a": a}, None, None),
        ("ob.ops.add(t, t), tensor n=4", "f(t, t)", {"f": ob.ops.add, "t": t}, None, None),
    ]
    print(f"# profiler cost per call ({CALLS} calls per loop, median of {args.pairs} pairs)\n")
    print("| call | inactive | inactive / numpy | recording | added | recording + shapes + memory | added |")
    print("|---|---|---|---|---|---|---|")
    for label, stmt, env, peer_stmt, peer_env in rows:
        off, on, full, ratio = [], [], [], []
        for _ in range(args.pairs):
            off.append(per_call(stmt, env))
            if peer_stmt is not None:
                ratio.append(off[-1] / per_call(peer_stmt, peer_env or {}))
            on.append(recording(stmt, env))
            full.append(recording(stmt, env, record_shapes=True, profile_memory=True))
            if "t" in env:
                ob.synchronize()
        base, rec, rec_full = (statistics.median(x) for x in (off, on, full))
        versus = f"{statistics.median(ratio):.3f}" if ratio else "-"
        print(
            f"| {label} | {base * 1e9:.0f} ns | {versus} | {rec * 1e9:.0f} ns | {(rec - base) * 1e9:+.0f} ns"
            f" | {rec_full * 1e9:.0f} ns | {(rec_full - base) * 1e9:+.0f} ns |"
        )
    print("\ntarget: added ≤ 1000 ns per call while recording; inactive within 2% of the previous build")


if __name__ == "__main__":
    main()
