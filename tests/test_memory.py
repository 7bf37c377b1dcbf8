"""The CPU device's caching pool seen from Python: statistics, cache reuse, limits, OOM."""

from __future__ import annotations

import gc
import re

import numpy as np
import pytest

import opbridge as ob

MiB = 1 << 20

KEYS = [
    "allocated_blocks",
    "free_blocks",
    "total_memory",
    "allocated_bytes.current",
    "allocated_bytes.peak",
    "reserved_bytes.current",
    "reserved_bytes.peak",
    "num_allocs",
    "num_cache_hits",
    "num_alloc_retries",
    "num_ooms",
    "fragmented_bytes",
]


def stats(device: str | None = None) -> dict:
    gc.collect()
    ob.synchronize(device)
    return ob.get_memory_pool_stats(device)


def assert_invariants(s: dict) -> None:
    assert 0 <= s["allocated_bytes.current"] <= s["reserved_bytes.current"]
    assert s["allocated_bytes.current"] <= s["allocated_bytes.peak"]
    assert s["reserved_bytes.current"] <= s["reserved_bytes.peak"]
    assert s["total_memory"] == s["reserved_bytes.current"]
    assert 0 <= s["fragmented_bytes"] <= s["reserved_bytes.current"] - s["allocated_bytes.current"]
    assert s["num_cache_hits"] <= s["num_allocs"]
    assert s["allocated_blocks"] >= 0 and s["free_blocks"] >= 0


def test_stats_keys_and_types() -> None:
    s = ob.get_memory_pool_stats()
    assert isinstance(s, dict)
    for key in KEYS:
        assert key in s, key
        assert isinstance(s[key], int), key
        assert s[key] >= 0, key
    assert_invariants(s)


def test_stats_for_explicit_device() -> None:
    assert set(KEYS) <= set(ob.get_memory_pool_stats("cpu"))
    assert set(KEYS) <= set(ob.get_memory_pool_stats("cpu:0"))
    with pytest.raises(ob.DeviceError):
        ob.get_memory_pool_stats("cuda:0")


def test_allocation_and_free_are_counted(device: str) -> None:
    before = stats(device)
    t = ob.empty(MiB, dtype=np.float32, device=device)
    during = stats(device)
    assert during["allocated_bytes.current"] >= before["allocated_bytes.current"] + t.nbytes
    assert during["allocated_blocks"] == before["allocated_blocks"] + 1
    assert during["num_allocs"] == before["num_allocs"] + 1
    assert during["allocated_bytes.peak"] >= during["allocated_bytes.current"]
    assert_invariants(during)
    del t
    after = stats(device)
    assert after["allocated_bytes.current"] == before["allocated_bytes.current"]
    assert after["allocated_blocks"] == before["allocated_blocks"]
    assert after["reserved_bytes.current"] >= after["allocated_bytes.current"]
    assert_invariants(after)


def test_repeated_large_allocations_hit_the_cache(device: str) -> None:
    t = ob.empty(2 * MiB, device=device)  # warm: one block of this size is now cached after del
    del t
    before = stats(device)
    for _ in range(10):
        t = ob.empty(2 * MiB, device=device)
        del t
    after = stats(device)
    assert after["num_allocs"] == before["num_allocs"] + 10
    assert after["num_cache_hits"] >= before["num_cache_hits"] + 10
    assert after["reserved_bytes.current"] == before["reserved_bytes.current"]


def test_numpy_outputs_reuse_cached_blocks() -> None:
    a = np.ones(MiB, np.float32)
    del_me = ob.vector_add(a, a)
    del del_me
    before = stats()
    for _ in range(10):
        c = ob.vector_add(a, a)
        assert type(c.base).__name__ == "PooledMemory"
        del c
    after = stats()
    assert after["num_cache_hits"] >= before["num_cache_hits"] + 10
    assert after["reserved_bytes.current"] == before["reserved_bytes.current"]
    assert after["allocated_bytes.current"] == before["allocated_bytes.current"]


def test_blocks_are_64_byte_aligned(device: str) -> None:
    tensors = [ob.empty(n, dtype=np.float16, device=device) for n in (1, 3, 17, 1000, 70_000, 300_001)]
    for t in tensors:
        assert t.data_ptr % 64 == 0


def test_reset_peak_memory_stats(device: str) -> None:
    t = ob.empty(8 * MiB, device=device)
    del t
    s = stats(device)
    assert s["allocated_bytes.peak"] > s["allocated_bytes.current"]
    ob.reset_peak_memory_stats(device)
    s = stats(device)
    assert s["allocated_bytes.peak"] == s["allocated_bytes.current"]
    assert s["reserved_bytes.peak"] == s["reserved_bytes.current"]
    t = ob.empty(MiB, device=device)
    s = stats(device)
    assert s["allocated_bytes.peak"] >= s["allocated_bytes.current"] >= t.nbytes


def test_empty_cache_lowers_reserved_bytes(device: str) -> None:
    keep = ob.empty(MiB, device=device)
    tensors = [ob.empty(2 * MiB, device=device) for _ in range(4)]
    del tensors
    before = stats(device)
    assert before["reserved_bytes.current"] > before["allocated_bytes.current"]
    ob.empty_cache(device)
    after = stats(device)
    assert after["reserved_bytes.current"] < before["reserved_bytes.current"]
    assert after["reserved_bytes.current"] >= after["allocated_bytes.current"] >= keep.nbytes
    assert after["allocated_bytes.current"] == before["allocated_bytes.current"]
    assert_invariants(after)
    # The kept tensor is intact and the pool still serves new requests.
    np.testing.assert_array_equal(ob.zeros(100, device=device).numpy(), np.zeros(100, np.float32))
    assert keep.numpy().shape == (MiB,)


def test_fragmented_bytes_is_bounded_by_cached_bytes(device: str) -> None:
    small = [ob.empty(64 * 1024, device=device) for _ in range(16)]
    del small[::2]
    big = ob.empty(16 * MiB, device=device)
    s = stats(device)
    assert_invariants(s)
    del big, small


# --- limits and out of memory ----------------------------------------------------------------


def oom_figures(message: str) -> dict:
    numbers = {}
    for name, pattern in [
        ("requested", r"(\d+) bytes"),
        ("limit", r"limit (\d+)"),
        ("allocated", r"(\d+) bytes allocated"),
        ("cached", r"(\d+) bytes cached"),
    ]:
        m = re.search(pattern, message)
        assert m, f"no {name} figure in {message!r}"
        numbers[name] = int(m.group(1))
    return numbers


def test_memory_limit_raises_out_of_memory(memory_limit) -> None:
    keep = ob.empty(MiB)  # 4 MiB held
    ob.empty_cache()
    s = stats()
    allocated = s["allocated_bytes.current"]
    # The limit caps reserved bytes; leave 8 MiB of headroom above what is reserved now.
    limit = s["reserved_bytes.current"] + 8 * MiB
    memory_limit(limit)
    assert ob.get_memory_pool_stats()["limit"] == limit
    ooms = ob.get_memory_pool_stats()["num_ooms"]
    with pytest.raises(ob.OutOfMemoryError) as info:
        ob.empty(limit // 4)  # more bytes than the limit
    assert isinstance(info.value, MemoryError)
    assert isinstance(info.value, ob.OpBridgeError)
    message = str(info.value)
    assert "requested" in message or "allocate" in message
    assert "limit" in message and "allocated" in message and "cached" in message
    figures = oom_figures(message)
    assert figures["requested"] >= limit
    assert figures["limit"] == limit
    assert figures["allocated"] == allocated
    assert figures["cached"] >= 0
    assert ob.get_memory_pool_stats()["num_ooms"] == ooms + 1
    # Allocations within the limit still work.
    small = ob.zeros(1024)
    np.testing.assert_array_equal(small.numpy(), np.zeros(1024, np.float32))
    del keep


def test_memory_limit_applies_to_numpy_outputs(memory_limit) -> None:
    a = np.ones(4 * MiB, np.float32)  # 16 MiB result
    ob.empty_cache()
    memory_limit(stats()["allocated_bytes.current"] + 4 * MiB)
    with pytest.raises(MemoryError) as info:
        ob.vector_add(a, a)
    assert isinstance(info.value, ob.OutOfMemoryError)
    # out= needs no pool memory, so it still works under the limit.
    out = np.empty_like(a)
    assert ob.vector_add(a, a, out=out) is out
    np.testing.assert_array_equal(out[:10], np.full(10, 2.0, np.float32))


def test_recovery_after_removing_the_limit(memory_limit) -> None:
    memory_limit(stats()["allocated_bytes.current"] + MiB)
    with pytest.raises(ob.OutOfMemoryError):
        ob.empty(4 * MiB)
    memory_limit(None)
    assert ob.get_memory_pool_stats()["limit"] is None
    t = ob.zeros(4 * MiB)
    np.testing.assert_array_equal(t.numpy()[:5], np.zeros(5, np.float32))
    a = np.ones(4 * MiB, np.float32)
    assert ob.vector_add(a, a)[0] == 2.0


def test_oom_releases_cache_and_retries(memory_limit) -> None:
    # Cache blocks of one size, then ask for a larger one that fits only once the cache is gone.
    cached = [ob.empty(MiB) for _ in range(4)]  # 16 MiB
    del cached
    s = stats()
    assert s["reserved_bytes.current"] - s["allocated_bytes.current"] >= 16 * MiB
    limit = s["reserved_bytes.current"] + 8 * MiB
    memory_limit(limit)
    retries = s["num_alloc_retries"]
    t = ob.empty(5 * MiB)  # 20 MiB: more than the headroom, less than headroom + cache
    after = stats()
    assert after["num_alloc_retries"] == retries + 1
    assert after["reserved_bytes.current"] <= limit
    assert t.nbytes == 20 * MiB


def test_limit_on_unknown_device() -> None:
    with pytest.raises(ob.DeviceError):
        ob.set_memory_limit(MiB, device="cuda:3")
