"""Many calls on every device (`cpu:0`, and `ascend:0` on the ACL test double): results stay
exact, and the memory pool and the driver come back to where they started."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

import opbridge as ob
from conftest import ASCEND_LIB_DIR

CALLS = 100_000


def driver_counts() -> dict[str, int]:
    """The double's live device allocations, pinned host allocations, streams and events."""
    lib = ctypes.CDLL(str(Path(str(ASCEND_LIB_DIR)) / "libacl_rt_impl.so"))
    counts = [ctypes.c_uint64() for _ in range(4)]
    assert lib.acldoubleOutstanding(*[ctypes.byref(c) for c in counts]) == 0
    return dict(zip(("device", "host", "streams", "events"), (c.value for c in counts), strict=True))


def test_100k_calls_return_the_pool_and_the_driver_to_baseline(device: str) -> None:
    a = np.arange(8, dtype=np.float32)
    x, y = ob.asarray(a, device=device), ob.asarray(a[::-1].copy(), device=device)
    ob.synchronize(device)
    on_ascend = device.startswith("ascend")
    pool_before = ob.get_memory_pool_stats(device)["allocated_bytes.current"]
    driver_before = driver_counts() if on_ascend else None
    for _ in range(CALLS):
        r = ob.ops.add(x, y)
    ob.synchronize(device)
    np.testing.assert_array_equal(r.numpy(), a + a[::-1])
    del r
    ob.synchronize(device)
    assert ob.get_memory_pool_stats(device)["allocated_bytes.current"] == pool_before
    if driver_before is not None:
        after = driver_counts()
        # No allocation, stream or host buffer per call; events are reused, a bounded few kept.
        assert after["device"] == driver_before["device"], (driver_before, after)
        assert after["host"] == driver_before["host"] and after["streams"] == driver_before["streams"]
        assert after["events"] <= driver_before["events"] + 128, (driver_before, after)
