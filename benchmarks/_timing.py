"""Shared timing helpers for the benchmark scripts: best-of-N loops, sized automatically."""

from __future__ import annotations

import timeit
from collections.abc import Callable


def best_call_time(fn: Callable[..., object], *args: object, min_time: float = 0.2, repeat: int = 5) -> float:
    """Seconds per `fn(*args)`, timed as a statement (no wrapper call adding to every sample:
    per-call overheads of a few hundred ns are what is measured here)."""
    names = [f"a{i}" for i in range(len(args))]
    stmt = f"fn({', '.join(names)})"
    return _best(timeit.Timer(stmt, globals={"fn": fn, **dict(zip(names, args, strict=True))}), min_time, repeat)


def best_time(fn: Callable[[], object], min_time: float = 0.2, repeat: int = 5) -> float:
    """Seconds per call: the best of `repeat` loops, each sized to run about `min_time`."""
    return _best(timeit.Timer(fn), min_time, repeat)


def _best(timer: timeit.Timer, min_time: float, repeat: int) -> float:
    number, elapsed = 1, 0.0
    while True:
        elapsed = timer.timeit(number)
        if elapsed >= min_time / 4 or number >= 1 << 24:
            break
        number *= 4
    number = max(1, int(number * (min_time / max(elapsed, 1e-9))))
    return min(timer.repeat(repeat=repeat, number=number)) / number


def fmt_time(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms"
