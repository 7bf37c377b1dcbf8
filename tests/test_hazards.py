"""Regressions for concurrency and ordering hazards: each test once hung, raced or lost an error."""

import gc
import textwrap
import threading
import time

import numpy as np
import pytest

import opbridge as ob

MiB = 1 << 20


def finishes(fn, timeout=20.0):
    """Runs fn in a thread; fails the test instead of hanging the suite."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} did not finish within {timeout} s (deadlock?)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def test_out_of_memory_retry_does_not_deadlock_with_host_functions(memory_limit):
    ob.set_memory_limit(4 * MiB)
    t = ob.zeros(3 * MiB // 8, dtype=np.float32)  # 1.5 MiB reserved, then cached
    del t
    s = ob.current_stream()
    s.launch_host_func(lambda: time.sleep(0.2))  # needs the GIL while the pool waits
    a = np.ones(3 * MiB // 4, np.float32)

    def add():
        try:
            return ob.vector_add(a, a)[:2].tolist()
        except ob.OutOfMemoryError:
            return "oom"

    assert finishes(add) in ([2.0, 2.0], "oom")
    ob.synchronize()


def test_empty_waits_for_work_still_writing_its_reused_block():
    n = 1 << 16
    s = ob.current_stream()
    s.launch_host_func(lambda: time.sleep(0.2))
    r = ob.zeros(n)  # queued behind the sleep
    del r
    e = ob.empty(n)  # may reuse r's block while the fill is still queued
    arr = e.numpy()
    arr[:] = 7
    ob.synchronize()
    assert (arr == 7).all()


def test_tensor_matmul_with_strided_input_overlapping_out(rng):
    x = rng.random((128, 64))
    a = x[::2]  # rows 0, 2, ..., strided
    b = rng.random((64, 64))
    want = a @ b
    out = ob.from_dlpack(x[64:])  # overlaps a's span without being it
    ob.matmul(ob.from_dlpack(a), ob.from_dlpack(b), out=out)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-12)


def test_byte_swapped_arrays_on_the_tensor_path():
    t = ob.asarray(np.ones(4, np.float32))
    big = np.arange(4, dtype=">f4")
    np.testing.assert_array_equal(ob.vector_add(t, big).numpy(), 1 + np.arange(4))
    with pytest.raises(ob.ArgumentError, match="native byte order"):
        ob.ops.add(t, t, out=np.zeros(4, ">f4"))


def test_async_kernel_errors_surface_on_host_reads():
    weight = ob.asarray(np.ones((10, 2)))
    r = ob.ops.embedding_bag(weight, ob.asarray(np.array([1, 99])), ob.asarray(np.array([0])))
    # The same mistake raises the same class as on numpy arrays (test_ops_reductions), though
    # it was found by the kernel on a stream: async errors keep their kind.
    with pytest.raises(ob.ArgumentError, match="out of range") as info:
        r.numpy()
    assert not isinstance(info.value, ob.DeviceError)
    del info  # its traceback holds this frame: a cycle that would keep the tensors alive
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.synchronize()  # the stream reports it too, once
    ob.synchronize()  # and only once


def test_same_mistake_same_class_on_arrays_and_tensors():
    weight = np.ones((10, 2))
    indices, offsets = np.array([1, 99]), np.array([0])
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.ops.embedding_bag(weight, indices, offsets)
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.ops.embedding_bag(ob.asarray(weight), ob.asarray(indices), ob.asarray(offsets)).numpy()
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.synchronize()
    # A shape mistake found before launch is a ShapeError on both paths.
    with pytest.raises(ob.ShapeError):
        ob.vector_add(np.ones(3), np.ones(4))
    with pytest.raises(ob.ShapeError):
        ob.vector_add(ob.asarray(np.ones(3)), ob.asarray(np.ones(4)))


def test_rerecording_an_event_does_not_release_earlier_waiters():
    a, b, c = ob.Stream(), ob.Stream(), ob.Stream()
    start = time.monotonic()
    a.launch_host_func(lambda: time.sleep(0.3))
    e = ob.Event()
    e.record(a)
    c.wait_event(e)
    e.record(b)  # b is idle: this record completes at once
    ran = []
    c.launch_host_func(lambda: ran.append(time.monotonic() - start))
    finishes(c.synchronize)
    assert ran and ran[0] >= 0.25


def test_a_host_function_cannot_wait_for_its_own_stream():
    s = ob.Stream()
    s.launch_host_func(lambda: s.synchronize())
    with pytest.raises(ob.DeviceError, match="from work running on it"):
        finishes(s.synchronize)
    finishes(s.synchronize)  # the stream keeps working


def test_limit_waits_for_blocks_pending_on_other_streams(memory_limit):
    # Room for one 3 MiB block, not two, beyond what earlier tests left reserved (a live small
    # tensor keeps its 2 MiB segment of small blocks).
    gc.collect()
    ob.synchronize()
    ob.empty_cache()
    ob.set_memory_limit(ob.get_memory_pool_stats()["reserved_bytes.current"] + 4 * MiB)
    t = ob.zeros(3 * MiB // 4, dtype=np.float32)
    with ob.Stream():
        ob.ops.neg(t, out=t)  # used on another stream: freeing it leaves a pending block
    ob.synchronize()
    del t
    t2 = ob.zeros(3 * MiB // 4, dtype=np.float32)  # must not be a spurious OutOfMemoryError
    assert t2.nbytes == 3 * MiB


def test_memory_cached_for_finished_streams_goes_back_to_the_device():
    ob.synchronize()
    ob.empty_cache()
    before = ob.get_memory_pool_stats()["reserved_bytes.current"]

    def worker():
        t = ob.zeros(600_000, dtype=np.float32)  # 2.4 MB on this thread's own stream
        t.numpy()

    for _ in range(30):
        th = threading.Thread(target=worker)
        th.start()
        th.join()
    for _ in range(200):
        with ob.Stream():
            ob.zeros(100)
    # Streams dropped with work still queued keep their blocks until that work is done:
    # synchronize() waits for it and releases them. A thread's stream dies with the OS thread,
    # which can outlive `join()` by a moment on a loaded machine: hence the deadline.
    deadline = time.monotonic() + 10
    while True:
        ob.synchronize()
        grown = ob.get_memory_pool_stats()["reserved_bytes.current"] - before
        if grown < 16 * MiB or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert grown < 16 * MiB, f"{grown} bytes still reserved for finished streams"


@pytest.mark.parametrize("call", ["ops.add", "vector_add", "ops.matmul"])
def test_numpy_inputs_of_async_calls_are_consumed_at_the_call(call):
    # The kernel runs later (the stream is busy); changing the numpy argument right after the
    # call must not change the result, as after a pageable host-to-device copy in CUDA.
    s = ob.Stream()
    with s:
        t = ob.asarray(np.full((4, 4), 2, np.float32))
        a = np.ones((4, 4), np.float32)
        want = {"ops.add": 3, "vector_add": 3, "ops.matmul": 8}[call]
        s.launch_host_func(lambda: time.sleep(0.2))
        fn = {"ops.add": ob.ops.add, "vector_add": ob.vector_add, "ops.matmul": ob.ops.matmul}[call]
        r = fn(t, a)
        a[:] = 100
        del a
        np.testing.assert_array_equal(r.numpy(), np.full((4, 4), want, np.float32))


# --- probes that hang or leak when broken run in a subprocess with a timeout -----------------


def run_probe(code: str, timeout: float = 60.0) -> str:
    """Runs `code` in a fresh interpreter; a hang fails this test only, not the suite."""
    import subprocess
    import sys

    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the probe hung (more than {timeout} s)")
    assert done.returncode == 0, done.stderr
    return done.stdout


HOST_PRELUDE = """
import threading
import numpy as np
import opbridge as ob

s = ob.Stream()
result = []
finished = threading.Event()
gate = threading.Event()

def host(fn):
    def run():
        try:
            fn()
            result.append("returned")
        except ob.DeviceError as e:
            result.append(f"DeviceError: {e}")
        except BaseException as e:
            result.append(f"{type(e).__name__}: {e}")
        finally:
            finished.set()
    return run

def report():
    assert finished.wait(20), "the host function's wait hung"
    print(result[0])
    ob.synchronize()  # every stream recovers
    print("recovered")
"""

SELF_WAITS = {
    "own-event": """
        s.launch_host_func(host(lambda: s.record_event().synchronize()))
    """,
    "tensor-written-after-it": """
        t = ob.asarray(np.ones(4, np.float32))
        box = {}
        s.launch_host_func(lambda: gate.wait(20))
        s.launch_host_func(host(lambda: box["r"].numpy()))
        with s:
            box["r"] = ob.ops.add(t, t)
        gate.set()
    """,
    "stream-waiting-on-it": """
        s2 = ob.Stream()
        s.launch_host_func(lambda: gate.wait(20))
        s.launch_host_func(host(s2.synchronize))
        s2.wait_stream(s)
        gate.set()
    """,
    "event-on-a-stream-waiting-on-it": """
        s2, s3 = ob.Stream(), ob.Stream()
        s.launch_host_func(lambda: gate.wait(20))
        box = {}
        s.launch_host_func(host(lambda: box["e"].synchronize()))
        s2.wait_stream(s)
        s3.wait_stream(s2)
        box["e"] = s3.record_event()
        gate.set()
    """,
    "tensor-on-a-stream-waiting-on-it": """
        t = ob.asarray(np.ones(4, np.float32))
        s2 = ob.Stream()
        box = {}
        s.launch_host_func(lambda: gate.wait(20))
        s.launch_host_func(host(lambda: box["r"].numpy()))
        with s:
            u = ob.ops.add(t, t)
        with s2:
            box["r"] = ob.ops.neg(u)  # waits on s for u
        gate.set()
    """,
    "device-synchronize": """
        s.launch_host_func(host(ob.synchronize))
    """,
    "own-synchronize": """
        s.launch_host_func(host(s.synchronize))
    """,
}


@pytest.mark.parametrize("case", sorted(SELF_WAITS))
def test_host_function_waits_that_need_its_own_stream_raise(case):
    out = run_probe(HOST_PRELUDE + textwrap.dedent(SELF_WAITS[case]) + "report()\n")
    first, last = out.strip().splitlines()
    assert first.startswith("DeviceError:") and "cannot wait for" in first, first
    assert "from work running on" in first
    assert last == "recovered"


REACHABLE_WAITS = {
    "tensor-written-before-it": """
        t = ob.asarray(np.ones(4, np.float32))
        with s:
            r = ob.ops.add(t, t)
        s.launch_host_func(host(lambda: np.testing.assert_array_equal(r.numpy(), 2 * np.ones(4))))
    """,
    "independent-busy-stream": """
        s2 = ob.Stream()
        s2.launch_host_func(lambda: __import__("time").sleep(0.05))
        s.launch_host_func(host(s2.synchronize))
    """,
    "event-before-a-wait-on-it": """
        s2 = ob.Stream()
        s2.launch_host_func(lambda: __import__("time").sleep(0.05))
        e = s2.record_event()
        s.launch_host_func(host(e.synchronize))
        s2.wait_stream(s)  # after the event: the event is still reachable
    """,
}


@pytest.mark.parametrize("case", sorted(REACHABLE_WAITS))
def test_host_function_waits_that_can_end_still_wait(case):
    out = run_probe(HOST_PRELUDE + textwrap.dedent(REACHABLE_WAITS[case]) + "report()\n")
    assert out.split() == ["returned", "recovered"]


THREAD_COUNT = """
import os, time
def threads():
    return len(os.listdir("/proc/self/task"))
def settle(limit):
    deadline = time.monotonic() + 10
    while threads() > limit and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()
"""


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs /proc to count threads")
@pytest.mark.parametrize(
    "use",
    [
        # A stream used with a long-lived tensor, then dropped.
        "s = ob.Stream()\n    with s:\n        ob.ops.neg(t)\n    del s",
        # The same, dropped while its work may still be queued.
        "s = ob.Stream()\n    s.launch_host_func(lambda: None)\n    with s:\n        ob.ops.neg(t)\n    del s",
        # Dropped with slow work queued behind the tensor's use: the worker ends after it.
        "s = ob.Stream()\n    with s:\n        ob.ops.neg(t)\n"
        "    s.launch_host_func(lambda: time.sleep(0.05))\n    del s",
        # A short-lived Python thread using the tensor on its own current stream.
        "th = threading.Thread(target=lambda: ob.ops.neg(t))\n    th.start()\n    th.join()",
    ],
    ids=["dropped-stream", "dropped-busy-stream", "dropped-slow-stream", "short-lived-thread"],
)
def test_dead_streams_release_their_workers_while_a_tensor_they_used_lives(use):
    code = f"""
import threading
import numpy as np
import opbridge as ob
{THREAD_COUNT}
t = ob.asarray(np.ones(1000, np.float32))
ob.ops.neg(t)
ob.synchronize()
before = threads()
for _ in range(500):
    {use}
# No synchronize and no new stream: the workers must end by themselves once their work is done.
print(settle(before + 8) - before)
np.testing.assert_array_equal(t.numpy(), np.ones(1000))
"""
    extra = int(run_probe(code).strip())
    assert extra <= 8, f"500 dead streams left {extra} threads behind"


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs /proc to count threads")
def test_a_host_function_capturing_its_stream_releases_it_when_it_has_run():
    code = f"""
import gc, weakref
import opbridge as ob
{THREAD_COUNT}
class Payload: pass
before = threads()
refs = []
for _ in range(20):
    s = ob.Stream()
    payload = Payload()
    refs.append(weakref.ref(payload))
    s.launch_host_func(lambda s=s, payload=payload: None)
    del s, payload
# No opbridge call after this point: the callables must be released by the workers themselves.
print(settle(before + 2) - before, sum(r() is not None for r in refs))
"""
    extra, alive = map(int, run_probe(code).split())
    assert extra <= 2 and alive == 0, (extra, alive)
