"""The seed's demo on the CPU device: vector_add on a million floats, then the benchmark table."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

import opbridge as ob


def main() -> None:
    a = np.random.rand(1_000_000).astype(np.float32)
    b = np.ones_like(a)
    c = ob.vector_add(a, b)
    assert np.array_equal(c, a + b)
    print(f"vector_add of 1M float32: first values {c[:3]}, max error vs numpy {np.abs(c - (a + b)).max()}")

    t = ob.asarray(a)
    with ob.Stream() as s:
        r = ob.vector_add(t, t)  # enqueued on s; returns at once
    print(f"async on {s}: {r} -> matches numpy: {np.array_equal(r.numpy(), a + a)}")
    stats = ob.get_memory_pool_stats()
    print(
        f"pool: {stats['allocated_blocks']} blocks in use, {stats['reserved_bytes.current'] / 2**20:.0f} MiB reserved\n"
    )
    sys.stdout.flush()
    here = os.path.dirname(__file__)
    subprocess.run([sys.executable, os.path.join(here, "bench_vector_add.py"), "--quick"], check=True)


if __name__ == "__main__":
    main()
