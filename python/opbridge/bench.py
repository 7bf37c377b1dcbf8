"""``opbridge bench``: the benchmark table against numpy, in the same run, with an optional plot.

    opbridge bench                                   # default ops and sizes, a table
    opbridge bench --ops add,matmul --sizes 1K,64K,4M --json out.json --plot out.png
    opbridge bench --quick                           # tiny sizes, short timings (a smoke run)

For each operator and size both sides are timed on the same arrays, best of several loops, as
statements (no wrapper call in the loop). Memory-bound operators report GB/s and the fraction of the
machine's memory bandwidth (measured on the spot with a multi-threaded copy of 64 MiB) for
working sets of 128 MiB and more, which no cache holds; matmul reports
GFLOP/s. ``ratio`` is opbridge's time over numpy's: below 1 is faster.

The plot needs matplotlib (``pip install 'opbridge[plot]'``); everything else needs only numpy.

JSON (``schema_version`` 1)::

    {"schema_version": 1, "opbridge": str, "numpy": str, "device": str, "cpu": {...},
     "bandwidth_gbs": float,
     "results": [{"op": str, "size": str, "elements": int, "shape": [[int, ...], ...],
                  "opbridge_s": float, "numpy_s": float, "ratio": float,
                  "unit": "GB/s" | "GFLOP/s", "opbridge_rate": float, "numpy_rate": float,
                  "limit_fraction": float | null}]}
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SCHEMA_VERSION = 1
PLOT_HINT = "plotting needs matplotlib: pip install 'opbridge[plot]' (or pip install matplotlib)"


@dataclass(frozen=True)
class Case:
    """One benchmarked operator: its inputs at a size, both sides' calls, and its cost model."""

    inputs: Callable[[int, np.random.Generator], tuple[np.ndarray, ...]]
    ours: Callable[..., object]
    numpy: Callable[..., object]
    bytes_moved: Callable[[tuple[np.ndarray, ...]], int] | None = None
    flops: Callable[[tuple[np.ndarray, ...]], int] | None = None


def _vectors(count: int) -> Callable[[int, np.random.Generator], tuple[np.ndarray, ...]]:
    return lambda n, rng: tuple(rng.standard_normal(n, dtype=np.float32) for _ in range(count))


def _rows(n: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    width = min(n, 256)
    return (rng.standard_normal((max(1, n // width), width), dtype=np.float32),)


def _square(n: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    side = max(1, int(round(n**0.5)))
    return tuple(rng.standard_normal((side, side), dtype=np.float32) for _ in range(2))


def _np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _nbytes(factor: int) -> Callable[[tuple[np.ndarray, ...]], int]:
    """Bytes moved: every input read once and the output (the first input's size) written, or
    `factor` times the first input's bytes."""
    return lambda arrays: factor * arrays[0].nbytes


def cases() -> dict[str, Case]:
    import opbridge as ob

    ops = ob.ops
    return {
        "add": Case(_vectors(2), ops.add, np.add, _nbytes(3)),
        "mul": Case(_vectors(2), ops.mul, np.multiply, _nbytes(3)),
        "exp": Case(_vectors(1), ops.exp, np.exp, _nbytes(2)),
        "sum": Case(_vectors(1), ops.sum, np.sum, _nbytes(1)),
        "softmax": Case(_rows, lambda x: ops.softmax(x, axis=-1), _np_softmax, _nbytes(2)),
        "matmul": Case(_square, ob.matmul, np.matmul, flops=lambda a: 2 * a[0].shape[0] ** 3),
    }


DEFAULT_OPS = ("add", "mul", "exp", "sum", "softmax", "matmul")
DEFAULT_SIZES = ("1K", "64K", "1M", "4M", "16M")
QUICK_SIZES = ("256", "4K")


# The bandwidth is a limit only for working sets the caches cannot hold: twice the bandwidth
# probe's own (sysfs cannot be trusted for the cache size: a VM may report the whole host's).
OUT_OF_CACHE_BYTES = 128 << 20

# The largest size per op: matmul's size is its element count (side = sqrt), so 16M is 4096².
MAX_ELEMENTS = {"matmul": 16 << 20}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KkMmGg]?)\s*", text)
    if match is None:
        raise ValueError(f"bad size {text!r}: write a count like 4096, 64K or 4M")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match.group(2).lower()]
    value = int(match.group(1)) * scale
    if not 1 <= value <= 1 << 28:
        raise ValueError(f"size {text!r} is out of range (1 to 256M elements)")
    return value


def _best(fn: Callable[..., object], args: tuple[object, ...], min_time: float, repeat: int) -> float:
    """Seconds per call, timed as a statement: the best of `repeat` loops of about `min_time`."""
    names = [f"a{i}" for i in range(len(args))]
    timer = timeit.Timer(f"fn({', '.join(names)})", globals={"fn": fn, **dict(zip(names, args, strict=True))})
    number = 1
    while True:
        elapsed = timer.timeit(number)
        if elapsed >= min_time / 4 or number >= 1 << 22:
            break
        number *= 4
    number = max(1, int(number * (min_time / max(elapsed, 1e-9))))
    return min(timer.repeat(repeat=repeat, number=number)) / number


def memory_bandwidth(nbytes: int = 64 << 20, min_time: float = 0.2) -> float:
    """GB/s of a copy on every core (numpy's copy releases the GIL): read + write bytes per second."""
    import os

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    chunks = np.array_split(np.arange(src.size), threads)
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.size]

    def copy_all() -> None:
        def part(lo: int, hi: int) -> None:
            np.copyto(dst[lo:hi], src[lo:hi])

        workers = [threading.Thread(target=part, args=b) for b in bounds]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    copy_all()  # first touch
    seconds = _best(copy_all, (), min_time, 3)
    return 2 * src.nbytes / seconds / 1e9


def run(
    ops: Sequence[str],
    sizes: Sequence[str],
    device: str = "cpu:0",
    min_time: float = 0.1,
    repeat: int = 5,
    progress: Callable[[int, int, str], None] | None = None,
    default_sizes: bool = False,
) -> dict[str, Any]:
    """Runs the table and returns the JSON document described in the module's doc."""
    import opbridge as ob
    from opbridge.tuning import cpu_identity

    if device not in ("cpu", "cpu:0"):
        raise ValueError(f"device {device!r} is not available here; this build has cpu:0")
    table = cases()
    unknown = [op for op in ops if op not in table]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; choose from {', '.join(table)}")
    elements = [(size, parse_size(size)) for size in sizes]
    for op in ops:
        limit = MAX_ELEMENTS.get(op)
        for size, n in elements:
            if limit is not None and n > limit and not default_sizes:
                raise ValueError(f"{op} at {size}: at most {limit >> 20}M elements (a {int(limit**0.5)}² matrix)")
    # With the default sizes, an op's sizes beyond its cap are skipped (named sizes are refused).
    runs = [(op, size, n) for op in ops for size, n in elements if n <= MAX_ELEMENTS.get(op, n)]
    total = len(runs) + 1
    if progress:
        progress(0, total, "memory bandwidth")
    bandwidth = memory_bandwidth(min_time=min_time)
    rng = np.random.default_rng(0)
    results = []
    step = 1
    for op, size, n in runs:
        case = table[op]
        if progress:
            progress(step, total, f"{op} {size}")
        step += 1
        arrays = case.inputs(n, rng)
        if not np.allclose(np.asarray(case.ours(*arrays)), case.numpy(*arrays), rtol=1e-3, atol=1e-3):
            raise AssertionError(f"{op} at {size}: opbridge and numpy disagree")
        ours = _best(case.ours, arrays, min_time, repeat)
        theirs = _best(case.numpy, arrays, min_time, repeat)
        if case.flops is not None:
            unit, work = "GFLOP/s", case.flops(arrays)
            limit = None
        else:
            assert case.bytes_moved is not None
            unit, work = "GB/s", case.bytes_moved(arrays)
            limit = work / ours / 1e9 / bandwidth if work >= OUT_OF_CACHE_BYTES else None
        results.append(
            {
                "op": op,
                "size": size,
                "elements": n,
                "shape": [list(a.shape) for a in arrays],
                "opbridge_s": ours,
                "numpy_s": theirs,
                "ratio": ours / theirs,
                "unit": unit,
                "opbridge_rate": work / ours / 1e9,
                "numpy_rate": work / theirs / 1e9,
                "limit_fraction": limit,
            }
        )
    if progress:
        progress(total, total, "done")
    return {
        "schema_version": SCHEMA_VERSION,
        "opbridge": ob.__version__,
        "numpy": np.__version__,
        "device": "cpu:0",
        "cpu": cpu_identity(),
        "bandwidth_gbs": bandwidth,
        "results": results,
    }


def _fmt_time(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms"


def table(report: dict[str, Any]) -> str:
    lines = [
        f"opbridge {report['opbridge']} vs numpy {report['numpy']} on {report['device']} ({report['cpu']['model']}); "
        f"memory bandwidth {report['bandwidth_gbs']:.1f} GB/s",
        f"{'op':<8} {'size':>6} {'opbridge':>10} {'numpy':>10} {'ratio':>6} {'opbridge rate':>16} {'numpy rate':>14}"
        f" {'of limit':>8}",
    ]
    for r in report["results"]:
        limit = "" if r["limit_fraction"] is None else f"{100 * r['limit_fraction']:.0f}%"
        lines.append(
            f"{r['op']:<8} {r['size']:>6} {_fmt_time(r['opbridge_s']):>10} {_fmt_time(r['numpy_s']):>10}"
            f" {r['ratio']:>6.2f} {r['opbridge_rate']:>8.2f} {r['unit']:<7} {r['numpy_rate']:>6.2f} {r['unit']:<7}"
            f" {limit:>8}"
        )
    lines.append("ratio = opbridge time / numpy time (below 1: opbridge is faster)")
    return "\n".join(lines)


PANEL_WIDTH_IN, FIGURE_HEIGHT_IN, DPI = 4.0, 6.0, 100


def plot(report: dict[str, Any], path: str) -> tuple[int, int]:
    """Writes the PNG (per op: time and throughput vs size, opbridge vs numpy); its pixel size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in report["results"]))
    width, height = PANEL_WIDTH_IN * len(ops), FIGURE_HEIGHT_IN
    fig, axes = plt.subplots(2, len(ops), figsize=(width, height), dpi=DPI, squeeze=False)
    for col, op in enumerate(ops):
        rows = [r for r in report["results"] if r["op"] == op]
        x = [r["elements"] for r in rows]
        top, bottom = axes[0][col], axes[1][col]
        top.loglog(x, [r["opbridge_s"] * 1e6 for r in rows], "o-", label="opbridge")
        top.loglog(x, [r["numpy_s"] * 1e6 for r in rows], "s--", label="numpy")
        top.set_title(op)
        top.set_ylabel("time per call (µs)")
        bottom.semilogx(x, [r["opbridge_rate"] for r in rows], "o-", label="opbridge")
        bottom.semilogx(x, [r["numpy_rate"] for r in rows], "s--", label="numpy")
        if rows[0]["unit"] == "GB/s":
            bottom.axhline(report["bandwidth_gbs"], color="grey", linestyle=":", label="memory bandwidth")
        bottom.set_ylabel(rows[0]["unit"])
        bottom.set_xlabel("elements")
        top.legend(fontsize="small")
        bottom.legend(fontsize="small")
    fig.suptitle(f"opbridge vs numpy on {report['cpu']['model']}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return int(round(width * DPI)), int(round(height * DPI))


def _unwritable(path: str) -> str | None:
    """Why a results file cannot be written at `path`, or None."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a folder"
    if not os.path.isdir(folder):
        return f"no folder {folder}"
    if not os.access(folder, os.W_OK):
        return f"folder {folder} is not writable"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opbridge bench", description="opbridge's operators against numpy.")
    parser.add_argument(
        "--ops", default=",".join(DEFAULT_OPS), help=f"comma-separated (default {','.join(DEFAULT_OPS)})"
    )
    parser.add_argument("--sizes", help=f"comma-separated element counts (default {','.join(DEFAULT_SIZES)})")
    parser.add_argument("--device", default="cpu:0")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and short timings (a smoke run)")
    args = parser.parse_args(argv)
    # Everything that could fail after minutes of measuring is checked first.
    for flag, path, suffixes in (("--json", args.json, None), ("--plot", args.plot, (".png", ".svg", ".pdf"))):
        if path is None:
            continue
        problem = _unwritable(path)
        if problem is None and suffixes and not path.lower().endswith(suffixes):
            problem = f"use one of {', '.join(suffixes)}"
        if problem is not None:
            sys.stderr.write(f"opbridge bench: {flag} {path}: {problem}\n")
            return 2
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot  # noqa: F401
        except Exception as e:  # noqa: BLE001  (missing or broken: either way, no plot)
            sys.stderr.write(f"opbridge bench: --plot: {PLOT_HINT} ({type(e).__name__}: {e})\n")
            return 2
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    if args.sizes is None:
        sizes = list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    else:
        sizes = [size.strip() for size in args.sizes.split(",") if size.strip()]
    if not ops or not sizes:
        sys.stderr.write(f"opbridge bench: {'--ops' if not ops else '--sizes'} names nothing to run\n")
        return 2
    progress = None
    if sys.stderr.isatty():

        def progress(done: int, total: int, what: str) -> None:
            filled = int(30 * done / max(total, 1))
            sys.stderr.write(f"\r\033[K[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {what}")
            sys.stderr.flush()

    try:
        for size in sizes:
            parse_size(size)
        report = run(
            ops,
            sizes,
            args.device,
            0.01 if args.quick else 0.1,
            3 if args.quick else 5,
            progress,
            default_sizes=args.sizes is None,
        )
    except ValueError as e:
        sys.stderr.write(f"opbridge bench: {e}\n")
        return 2
    finally:
        if progress is not None:
            sys.stderr.write("\r\033[K")
    sys.stdout.write(table(report) + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
