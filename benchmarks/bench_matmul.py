"""matmul against numpy (OpenBLAS) in the same run: square products, then batched ones with
broadcast batch dimensions (float32 and float16, which numpy computes without BLAS).

numpy is measured as it runs for users; OPENBLAS_CORETYPE pins an older kernel on some
machines here, so for a fair peer run this with it unset (``make bench`` does).

The square products are also set against the machine's floating-point peak, measured in the same
run by benchmarks/peers/fma_peak/fma_peak.c (compiled here with -march=native, one thread per
core, independent FMAs on the widest vectors): no matmul runs above it, so a time ratio below
numpy's share of the peak cannot be had.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_matmul.py
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import opbridge as ob  # noqa: E402
from _timing import best_time, fmt_time  # noqa: E402

PEAK_SOURCE = Path(__file__).resolve().parent / "peers" / "fma_peak" / "fma_peak.c"


def fma_peak() -> dict[str, float] | None:
    """GFLOP/s at the FMA peak of every core, per dtype; None without a C compiler."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        return None
    out = Path(tempfile.mkdtemp(prefix="opbridge-peak-")) / "libfma_peak.so"
    cmd = [compiler, "-O2", "-march=native", "-shared", "-fPIC", "-pthread", str(PEAK_SOURCE), "-o", str(out)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.fma_peak.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_int]
    lib.fma_peak.restype = ctypes.c_double
    threads = len(os.sched_getaffinity(0))
    return {"float32": lib.fma_peak(threads, 0, 50_000_000, 3), "float64": lib.fma_peak(threads, 1, 50_000_000, 3)}


def main() -> None:
    print(f"# matmul vs numpy {np.__version__} (OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')})\n")
    peak = fma_peak()
    if peak:
        f32, f64 = peak["float32"], peak["float64"]
        print(f"FMA peak of this machine, this run: {f32:.0f} GFLOP/s float32, {f64:.0f} float64\n")
    print("| shape | dtype | opbridge | GFLOP/s | of peak | numpy | numpy GFLOP/s | of peak | time ratio ob/np |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    result = {}
    floor: dict[tuple[int, str], float] = {}
    squares = [(n, dtype) for n in (64, 256, 1024) for dtype in (np.float32, np.float64)] + [(2048, np.float32)]
    for n, dtype in squares:
        a = rng.random((n, n)).astype(dtype)
        b = rng.random((n, n)).astype(dtype)
        c = np.empty_like(a)
        assert np.allclose(ob.matmul(a, b), a @ b, rtol=1e-3)
        # Each side timed alone: OpenBLAS's threads busy-wait ~0.1 s after numpy's last call
        # and would take the second core from the next opbridge run.
        time.sleep(0.3)
        t_ob = best_time(lambda: ob.matmul(a, b, out=c), 0.3)
        t_np = best_time(lambda: np.matmul(a, b, out=c), 0.3)
        flops = 2 * n**3
        name = np.dtype(dtype).name
        result[(n, name)] = t_ob / t_np
        ob_rate, np_rate = flops / t_ob / 1e9, flops / t_np / 1e9
        share = (lambda rate: f"{rate / peak[name]:.0%}") if peak else (lambda rate: "-")
        print(
            f"| {n}² | {name} | {fmt_time(t_ob)} | {ob_rate:.1f} | {share(ob_rate)} | "
            f"{fmt_time(t_np)} | {np_rate:.1f} | {share(np_rate)} | {t_ob / t_np:.2f} |"
        )
        if peak and n >= 1024:
            # Time ratio r needs numpy's rate / r: at most the peak.
            floor[(n, name)] = np_rate / peak[name]
    print("\n## batched and broadcast batches (`ob.ops.matmul`, numpy's `@` rules)\n")
    print("| a | b | dtype | opbridge | GFLOP/s | numpy | time ratio ob/np |")
    print("|---|---|---|---:|---:|---:|---:|")
    batched = [
        ((64, 64, 64), (64, 64, 64)),  # many small products: per-matrix overhead
        ((8, 256, 256), (8, 256, 256)),
        ((16, 128, 64), (64, 128)),  # one weight broadcast over a batch (a linear layer)
        ((4, 1, 128, 128), (1, 6, 128, 128)),  # broadcasting both batch dimensions
    ]
    # float32 first: after numpy's float16 matmul (no BLAS), its float32 batched matmul ran
    # 150x slower in the same process on the project machine (an OpenBLAS thread state, not ours).
    for dtype in (np.float32, np.float16):
        for a_shape, b_shape in batched:
            a = rng.random(a_shape).astype(dtype)
            b = rng.random(b_shape).astype(dtype)
            want = np.matmul(a.astype(np.float32), b.astype(np.float32))
            c = np.empty(want.shape, dtype)
            np.testing.assert_allclose(ob.ops.matmul(a, b).astype(np.float32), want, rtol=2e-2, atol=1e-2)
            time.sleep(0.3)  # alone, as above
            t_ob = best_time(lambda: ob.ops.matmul(a, b, out=c), 0.3)
            t_np = best_time(lambda: np.matmul(a, b, out=c), 0.3)
            flops = 2 * want.size * a_shape[-1]
            print(
                f"| {a_shape} | {b_shape} | {np.dtype(dtype).name} | {fmt_time(t_ob)} | {flops / t_ob / 1e9:.1f} | "
                f"{fmt_time(t_np)} | {t_ob / t_np:.2f} |"
            )
    print("\nTarget: ≤ 0.9 of numpy's time for float32 1024² and 2048², float64 1024²:")
    for key in [(1024, "float32"), (2048, "float32"), (1024, "float64")]:
        ratio = result[key]
        bound = f"; no ratio below {floor[key]:.2f} is possible (numpy's share of the peak)" if key in floor else ""
        print(f"  {key[1]} {key[0]}²: {ratio:.2f}× — {'met' if ratio <= 0.9 else 'NOT met'}{bound}")


if __name__ == "__main__":
    main()
