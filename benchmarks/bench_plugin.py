"""Plugin operator call overhead against the built-in operator doing the same work.

Builds the C example plugin (`examples/plugins/c/scale_add.c`, `-O3`) into benchmarks/_build,
loads it, and times `scale_add(a, b, alpha=2.0)` against its built-in twin `axpy(a, b, alpha=2.0)`
(the same schema: two inputs and a float attribute, the same arithmetic) at n=4 (call overhead)
and n=64K (kernel plus overhead), float32. Target: within 10%.

    python benchmarks/bench_plugin.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import opbridge as ob  # noqa: E402
from _timing import best_call_time, fmt_time  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "examples" / "plugins" / "c" / "scale_add.c"
BUILD = ROOT / "benchmarks" / "_build" / "plugin"


def build() -> Path:
    BUILD.mkdir(parents=True, exist_ok=True)
    out = BUILD / "libscale_add_bench.so"
    if not out.exists() or out.stat().st_mtime < SOURCE.stat().st_mtime:
        cmd = [
            os.environ.get("CC", "cc"),
            "-O3",
            "-shared",
            "-fPIC",
            "-I",
            ob.get_include(),
            str(SOURCE),
            "-o",
            str(out),
        ]
        subprocess.run(cmd, check=True)
    return out


def main() -> None:
    library = ob.load_library(str(build()))
    try:
        plugin = ob.ops.get("scale_add", version=1)
        builtin = ob.ops.get("axpy")
        print("# plugin (C, scale_add) vs built-in axpy, alpha=2, float32\n")
        print("| n | plugin | built-in | ratio | median of 7 paired ratios |")
        print("|---|---:|---:|---:|---:|")
        for n in (4, 1 << 16):
            a = np.ones(n, np.float32)
            b = np.ones(n, np.float32)
            np.testing.assert_array_equal(plugin(a, b, alpha=2.0), builtin(a, b, alpha=2.0))
            t_plugin = best_call_time(lambda: plugin(a, b, alpha=2.0))
            t_builtin = best_call_time(lambda: builtin(a, b, alpha=2.0))
            # Paired ratios: on a noisy machine their median moves far less than one ratio.
            pairs = [
                best_call_time(lambda: plugin(a, b, alpha=2.0)) / best_call_time(lambda: builtin(a, b, alpha=2.0))
                for _ in range(7)
            ]
            print(
                f"| {n} | {fmt_time(t_plugin)} | {fmt_time(t_builtin)} | {t_plugin / t_builtin:.2f} | "
                f"{statistics.median(pairs):.2f} |"
            )
    finally:
        library.unload()


if __name__ == "__main__":
    main()
