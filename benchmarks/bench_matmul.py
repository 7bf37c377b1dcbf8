"""matmul against numpy (OpenBLAS) in the same run: square products, then batched ones with
broadcast batch dimensions (float32 and float16, which numpy computes without BLAS).

numpy is measured as it runs for users; OPENBLAS_CORETYPE pins an older kernel on some
machines here, so for a fair peer run this with it unset (``make bench`` does):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/bench_matmul.py
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import opbridge as ob  # noqa: E402
from _timing import best_time, fmt_time  # noqa: E402


def main() -> None:
    print(f"# matmul vs numpy {np.__version__} (OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')})\n")
    print("| shape | dtype | opbridge | GFLOP/s | numpy | numpy GFLOP/s | time ratio ob/np |")
    print("|---|---|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    result = {}
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
        result[(n, np.dtype(dtype).name)] = t_ob / t_np
        print(
            f"| {n}² | {np.dtype(dtype).name} | {fmt_time(t_ob)} | {flops / t_ob / 1e9:.1f} | "
            f"{fmt_time(t_np)} | {flops / t_np / 1e9:.1f} | {t_ob / t_np:.2f} |"
        )
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
    ratio = result[(1024, "float32")]
    print(f"\nTarget: float32 1024² ≤ 1.2× numpy's time: {ratio:.2f}× — {'met' if ratio <= 1.2 else 'NOT met'}")


if __name__ == "__main__":
    main()
