"""Many Python threads: bit-exact results, the Tensor path, no leaks over many calls, and the
GIL released while large kernels run."""

from __future__ import annotations

import gc
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import opbridge as ob
from conftest import random_array

THREADS = 8
CALLS_PER_THREAD = 1000
MiB = 1 << 20


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))


def run_threads(target, count: int) -> list[BaseException]:
    """Runs `target(index)` in `count` threads; returns what they raised."""
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(count, timeout=60)

    def wrapper(i: int) -> None:
        try:
            start.wait()
            target(i)
        except BaseException as e:  # reported to the test thread
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=wrapper, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_many_threads_bit_exact(rng: np.random.Generator) -> None:
    # float32 20_000 and 70_000 elements are above the 64 KiB GIL-release threshold;
    # 70_000 float32 outputs also come from the pool.
    specs = [
        (7, np.float32),
        (1000, np.float64),
        (20_000, np.float32),
        (70_000, np.float32),
        (5000, np.int64),
        (3000, np.float16),
        (40_000, np.int32),
        (10_000, np.float64),
    ]
    cases = []
    for n, dtype in specs:
        a = random_array(rng, n, dtype)
        b = random_array(rng, n, dtype)
        cases.append((a, b, a + b))
    mismatches: list[tuple[int, int]] = []
    lock = threading.Lock()

    def work(index: int) -> None:
        outs = [np.empty_like(want) for _, _, want in cases]
        for call in range(CALLS_PER_THREAD):
            k = (index + call) % len(cases)
            a, b, want = cases[k]
            if call % 3 == 0:
                got = ob.vector_add(a, b, out=outs[k])
                ok = got is outs[k] and same_bits(got, want)
            else:
                got = ob.vector_add(a, b)
                ok = same_bits(got, want)
            if not ok:
                with lock:
                    mismatches.append((index, call))

    errors = run_threads(work, THREADS)
    assert errors == []
    assert mismatches == []


def test_many_threads_in_place_on_private_arrays(rng: np.random.Generator) -> None:
    def work(index: int) -> None:
        acc = np.zeros(30_000, np.float64)
        one = np.ones(30_000, np.float64)
        for _ in range(200):
            ob.vector_add(acc, one, out=acc)
        assert np.array_equal(acc, np.full(30_000, 200.0))

    assert run_threads(work, THREADS) == []


def test_tensor_path_from_several_threads(rng: np.random.Generator) -> None:
    shared = random_array(rng, 50_000, np.float32)
    shared_t = ob.asarray(shared)
    results: dict[int, bool] = {}

    def work(index: int) -> None:
        own = random_array(np.random.default_rng(index), 50_000, np.float32)
        t = ob.asarray(own)
        r = t
        want = own.copy()
        for _ in range(50):
            r = ob.vector_add(r, shared_t)
            want = want + shared
        acc = ob.zeros(1000, dtype=np.int64)
        one = ob.asarray(np.ones(1000, np.int64))
        for _ in range(100):
            ob.vector_add(acc, one, out=acc)
        m = ob.matmul(ob.asarray(own[:400].reshape(20, 20).astype(np.float64)), np.eye(20))
        results[index] = (
            same_bits(r.numpy(), want)
            and np.array_equal(acc.numpy(), np.full(1000, 100))
            and np.allclose(m.numpy(), own[:400].reshape(20, 20))
        )

    errors = run_threads(work, 4)
    assert errors == []
    assert results == {i: True for i in range(4)}


def test_stream_per_thread_with_blocks(rng: np.random.Generator) -> None:
    def work(index: int) -> None:
        s = ob.Stream()
        x = ob.asarray(np.full(10_000, float(index)))
        with s:
            r = x
            for _ in range(20):
                r = ob.vector_add(r, x)
            assert ob.current_stream() == s
        s.synchronize()
        assert np.array_equal(r.numpy(), np.full(10_000, 21.0 * index))

    assert run_threads(work, THREADS) == []


def _calls(count: int, small_a, small_b, big_a, out, tensor_a) -> None:
    for i in range(count):
        ob.vector_add(small_a, small_b)
        if i % 100 == 0:
            ob.vector_add(big_a, big_a)  # pooled output, freed at once
            ob.vector_add(big_a, big_a, out=out)
        if i % 20 == 0:
            ob.vector_add(tensor_a, tensor_a).numpy()


def test_hundred_thousand_calls_do_not_leak() -> None:
    small_a = np.arange(1000, dtype=np.float32)
    small_b = np.ones(1000, dtype=np.float32)
    big_a = np.ones(1 << 17, dtype=np.float32)  # 512 KiB: pooled output
    out = np.empty_like(big_a)
    tensor_a = ob.asarray(np.ones(1000, np.float64))
    process = psutil.Process()

    _calls(5000, small_a, small_b, big_a, out, tensor_a)  # warm-up: caches, pools, workers
    gc.collect()
    ob.synchronize()
    pool_before = ob.get_memory_pool_stats()
    rss_before = process.memory_info().rss

    _calls(100_000, small_a, small_b, big_a, out, tensor_a)

    gc.collect()
    ob.synchronize()
    pool_after = ob.get_memory_pool_stats()
    rss_after = process.memory_info().rss
    assert pool_after["allocated_bytes.current"] == pool_before["allocated_bytes.current"]
    assert pool_after["allocated_blocks"] == pool_before["allocated_blocks"]
    assert pool_after["reserved_bytes.current"] <= pool_before["reserved_bytes.current"] + 4 * MiB
    assert rss_after - rss_before < 20 * MiB, f"RSS grew by {(rss_after - rss_before) / MiB:.1f} MiB"
    np.testing.assert_array_equal(ob.vector_add(small_a, small_b), small_a + small_b)


def test_gil_is_released_for_large_inputs() -> None:
    n = 16 * MiB  # 64 MiB of float32 per array
    a = np.ones(n, dtype=np.float32)
    out = np.empty_like(a)
    ob.vector_add(a, a, out=out)  # warm-up (page faults of out)
    state = {"in_call": False, "stop": False, "during": 0}

    def counter() -> None:
        while not state["stop"]:
            if state["in_call"]:
                state["during"] += 1
            time.sleep(0.0001)  # gives the GIL back promptly when the adder wants it

    def adder() -> None:
        for _ in range(4):
            state["in_call"] = True
            ob.vector_add(a, a, out=out)  # noqa: F821 -- runs before the `del a, out` below, which pyflakes misreads
            state["in_call"] = False

    # A long switch interval: while the adder holds the GIL, the counter cannot be scheduled
    # at all, so it only counts if vector_add itself releases the GIL.
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        counter_thread = threading.Thread(target=counter)
        counter_thread.start()
        time.sleep(0.01)
        adder_thread = threading.Thread(target=adder)
        adder_thread.start()
        adder_thread.join()
        state["stop"] = True
        counter_thread.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert state["during"] > 0
    assert out[0] == 2.0 and out[-1] == 2.0
    del a, out
    gc.collect()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_concurrent_matmul(rng: np.random.Generator, dtype) -> None:
    x = rng.standard_normal((128, 128)).astype(dtype)
    y = rng.standard_normal((128, 128)).astype(dtype)
    want = ob.matmul(x, y)
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(want, x.astype(np.float64) @ y.astype(np.float64), rtol=tol * 10, atol=tol * 10)

    def work(index: int) -> None:
        for _ in range(20):
            assert same_bits(ob.matmul(x, y), want)

    assert run_threads(work, 4) == []
