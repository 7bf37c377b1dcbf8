"""Large elementwise calls against the memory-bandwidth limit (issue 15's first target).

The reference is a float32 add / mul written for the limit (AVX-512 loads, streaming stores that
skip the destination's read-for-ownership, every core): benchmarks/peers/bandwidth/ref_add.c,
compiled here with the system compiler and called through ctypes on the same arrays. Each
opbridge call is timed against it in the same run, alternately, best of several rounds (a noisy
shared machine), and the ratio reference / opbridge printed: the target is >= 0.95. Fresh
outputs (no ``out=``) come from opbridge's pool, so their pages are not faulted in per call; the
reference writes into a warm array. numpy is shown for context.

    python benchmarks/bench_bandwidth.py [--n 16777216] [--rounds 7]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import opbridge as ob  # noqa: E402
from _timing import best_time  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "peers" / "bandwidth" / "ref_add.c"


def reference() -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise SystemExit(f"no C compiler ({compiler}) for the bandwidth reference")
    out = Path(tempfile.mkdtemp(prefix="opbridge-bw-")) / "libref_add.so"
    cmd = [compiler, "-O3", "-march=native", "-shared", "-fPIC", "-pthread", str(SOURCE), "-o", str(out)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.ref_binary.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    lib.ref_binary.restype = ctypes.c_int
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24, help="elements (float32)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    lib = reference()
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    rng = np.random.default_rng(0)
    a, b = rng.random(args.n, dtype=np.float32), rng.random(args.n, dtype=np.float32)
    c = np.empty_like(a)
    pa, pb, pc = (x.ctypes.data for x in (a, b, c))

    def ref(mul: int):
        return lambda: lib.ref_binary(pa, pb, pc, args.n, threads, mul)

    ref(0)()
    assert np.array_equal(c, a + b), "the reference adds"
    ref(1)()
    assert np.array_equal(c, a * b), "the reference multiplies"
    cases = {
        "vector_add(a, b, out=c)": (0, lambda: ob.vector_add(a, b, out=c)),
        "vector_add(a, b) fresh": (0, lambda: ob.vector_add(a, b)),
        "ops.add(a, b, out=c)": (0, lambda: ob.ops.add(a, b, out=c)),
        "ops.add(a, b) fresh": (0, lambda: ob.ops.add(a, b)),
        "ops.mul(a, b, out=c)": (1, lambda: ob.ops.mul(a, b, out=c)),
        "ops.mul(a, b) fresh": (1, lambda: ob.ops.mul(a, b)),
        "numpy add(a, b, out=c)": (0, lambda: np.add(a, b, out=c)),
        "numpy add(a, b) fresh": (0, lambda: np.add(a, b)),
    }
    best = {name: float("inf") for name in cases}
    best_ref = [float("inf"), float("inf")]
    for _ in range(args.rounds):
        for mul in (0, 1):
            best_ref[mul] = min(best_ref[mul], best_time(ref(mul), 0.05, 3))
        for name, (_, fn) in cases.items():
            best[name] = min(best[name], best_time(fn, 0.05, 3))
    moved = 3 * 4 * args.n
    print(f"{args.n} float32 elements, {threads} threads; bytes moved per call: {moved / 1e6:.0f} MB")
    for mul, what in ((0, "add"), (1, "mul")):
        print(f"  reference {what}: {best_ref[mul] * 1e3:7.2f} ms ({moved / best_ref[mul] / 1e9:5.1f} GB/s)")
    for name, (mul, _) in cases.items():
        t = best[name]
        ratio = best_ref[mul] / t
        mark = "" if name.startswith("numpy") else ("  (target >= 0.95)" if ratio < 0.95 else "  ok")
        print(f"  {name:26s} {t * 1e3:7.2f} ms ({moved / t / 1e9:5.1f} GB/s)  reference / this {ratio:.2f}{mark}")


if __name__ == "__main__":
    main()
