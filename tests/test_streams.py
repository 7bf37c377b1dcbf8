"""Streams and events: current-stream switching, ordering, host callbacks, timing, cross-stream
dependencies."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import opbridge as ob

GATE_TIMEOUT = 30.0


def gate_func(gate: threading.Event, log: list, tag) -> Callable[[], None]:
    """A host function that blocks its stream until the test opens `gate`."""

    def func() -> None:
        gate.wait(GATE_TIMEOUT)
        log.append(tag)

    return func


# --- current stream --------------------------------------------------------------------------


def test_current_stream_is_stable_per_thread() -> None:
    s = ob.current_stream()
    assert isinstance(s, ob.Stream)
    assert ob.current_stream() == s
    assert hash(ob.current_stream()) == hash(s)
    assert s.device in ("cpu", "cpu:0")


def test_new_streams_are_distinct(device: str) -> None:
    s1, s2 = ob.Stream(device=device), ob.Stream(device=device)
    assert s1 != s2
    assert s1.id != s2.id
    assert s1 != ob.current_stream(device)
    assert s1 == s1
    assert s1 != "not a stream"


def test_with_switches_and_restores(device: str) -> None:
    default = ob.current_stream(device)
    s = ob.Stream(device=device)
    with s as entered:
        assert entered is s
        assert ob.current_stream(device) == s
    assert ob.current_stream(device) == default


def test_nested_with(device: str) -> None:
    default = ob.current_stream(device)
    s1, s2 = ob.Stream(device=device), ob.Stream(device=device)
    with s1:
        assert ob.current_stream(device) == s1
        with s2:
            assert ob.current_stream(device) == s2
            with s1:
                assert ob.current_stream(device) == s1
            assert ob.current_stream(device) == s2
        assert ob.current_stream(device) == s1
    assert ob.current_stream(device) == default


def test_with_restores_on_exception(device: str) -> None:
    default = ob.current_stream(device)
    s = ob.Stream(device=device)
    with pytest.raises(KeyError):
        with s:
            raise KeyError("inside")
    assert ob.current_stream(device) == default


def test_ops_inside_with_run_on_that_stream() -> None:
    s = ob.Stream()
    gate, log = threading.Event(), []
    s.launch_host_func(gate_func(gate, log, "gate"))
    t = ob.asarray(np.ones(1000, np.float32))
    with s:
        r = ob.vector_add(t, t)
    # r is queued behind the closed gate on s.
    assert not r.is_ready()
    assert not s.query()
    gate.set()
    np.testing.assert_array_equal(r.numpy(), np.full(1000, 2.0, np.float32))
    assert r.is_ready()
    s.synchronize()
    assert s.query()


def test_current_streams_differ_across_threads() -> None:
    main = ob.current_stream()
    seen: dict[int, ob.Stream] = {}
    again: dict[int, bool] = {}

    def worker(i: int) -> None:
        seen[i] = ob.current_stream()
        again[i] = ob.current_stream() == seen[i]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    streams = list(seen.values())
    assert len(streams) == 4
    assert all(again.values())
    assert all(s != main for s in streams)
    assert len({s.id for s in streams}) == 4


def test_with_in_one_thread_does_not_affect_another() -> None:
    main = ob.current_stream()
    s = ob.Stream()
    entered, release = threading.Event(), threading.Event()
    inside: list[bool] = []

    def worker() -> None:
        with s:
            inside.append(ob.current_stream() == s)
            entered.set()
            release.wait(GATE_TIMEOUT)
        inside.append(ob.current_stream() != s)

    t = threading.Thread(target=worker)
    t.start()
    assert entered.wait(GATE_TIMEOUT)
    try:
        assert ob.current_stream() == main
    finally:
        release.set()
        t.join()
    assert inside == [True, True]


def test_same_stream_entered_from_two_threads() -> None:
    s = ob.Stream()
    barrier = threading.Barrier(2, timeout=GATE_TIMEOUT)
    results: list[bool] = []
    lock = threading.Lock()

    def worker() -> None:
        before = ob.current_stream()
        with s:
            barrier.wait()
            ok = ob.current_stream() == s
            barrier.wait()
        with lock:
            results.append(ok and ob.current_stream() == before)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True, True]


# --- ordering --------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1000, 1 << 18])
def test_chain_of_dependent_in_place_adds(n: int) -> None:
    s = ob.Stream()
    acc = ob.zeros(n, dtype=np.float64)
    one = ob.asarray(np.ones(n))
    with s:
        for _ in range(50):
            ob.vector_add(acc, one, out=acc)
    np.testing.assert_array_equal(acc.numpy(), np.full(n, 50.0))


def test_chain_of_new_tensors(device: str) -> None:
    s = ob.Stream(device=device)
    x = ob.asarray(np.arange(1000, dtype=np.int64), device=device)
    r = x
    with s:
        for _ in range(50):
            r = ob.vector_add(r, x)
    np.testing.assert_array_equal(r.numpy(), 51 * np.arange(1000))


def test_host_funcs_run_in_order_after_prior_work(device: str) -> None:
    s = ob.Stream(device=device)
    log: list = []
    t = ob.asarray(np.ones(1 << 18, np.float32), device=device)
    with s:
        r = ob.vector_add(t, t)
    s.launch_host_func(lambda: log.append(("ready", r.is_ready())))
    for i in range(20):
        s.launch_host_func(lambda i=i: log.append(i))
    s.synchronize()
    assert log == [("ready", True)] + list(range(20))


def test_host_func_sees_data_written_before_it() -> None:
    # Host functions write a numpy array that a kernel then reads: host memory, so the CPU
    # device (test_ascend.py orders device work across streams with events).
    device = "cpu:0"
    s = ob.Stream(device=device)
    a = np.zeros(1000)
    ta = ob.from_dlpack(a)
    one = ob.asarray(np.ones(1000), device=device)
    seen: list[float] = []
    with s:
        ob.vector_add(ta, one, out=ta)
    s.launch_host_func(lambda: seen.append(float(a.sum())))
    with s:
        ob.vector_add(ta, one, out=ta)
    s.synchronize()
    assert seen == [1000.0]
    np.testing.assert_array_equal(a, np.full(1000, 2.0))


def test_host_func_raising_surfaces_at_next_synchronize(device: str) -> None:
    s = ob.Stream(device=device)

    def boom() -> None:
        raise ValueError("boom from a host function")

    s.launch_host_func(boom)
    with pytest.raises(ob.DeviceError) as info:
        s.synchronize()
    assert isinstance(info.value, RuntimeError)
    assert "boom from a host function" in str(info.value)
    # The error was reported once, and the stream keeps working.
    s.synchronize()
    log: list[int] = []
    s.launch_host_func(lambda: log.append(1))
    t = ob.asarray(np.ones(10), device=device)
    with s:
        r = ob.vector_add(t, t)
    s.synchronize()
    assert log == [1]
    np.testing.assert_array_equal(r.numpy(), np.full(10, 2.0))


def test_host_func_raising_surfaces_at_device_synchronize(device: str) -> None:
    s = ob.Stream(device=device)
    s.launch_host_func(lambda: 1 / 0)
    with pytest.raises(ob.DeviceError):
        ob.synchronize(device)
    ob.synchronize(device)


def test_device_synchronize_waits_for_all_streams() -> None:
    log: list[int] = []
    lock = threading.Lock()

    def slow(i: int) -> None:
        time.sleep(0.02)
        with lock:
            log.append(i)

    streams = [ob.Stream() for _ in range(4)]
    for i, s in enumerate(streams):
        for j in range(3):
            s.launch_host_func(lambda i=i, j=j: slow(10 * i + j))
    ob.synchronize()
    assert sorted(log) == sorted(10 * i + j for i in range(4) for j in range(3))
    assert all(s.query() for s in streams)


def test_device_synchronize_includes_other_threads_streams() -> None:
    gate, log = threading.Event(), []
    ready = threading.Event()

    def worker() -> None:
        ob.current_stream().launch_host_func(gate_func(gate, log, "worker"))
        ready.set()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert ready.is_set()
    threading.Timer(0.05, gate.set).start()
    ob.synchronize()
    assert log == ["worker"]


# --- events ----------------------------------------------------------------------------------


def test_unrecorded_event_is_complete() -> None:
    e = ob.Event()
    assert e.query()
    e.synchronize()


def test_event_record_query_synchronize() -> None:
    s = ob.Stream()
    gate, log = threading.Event(), []
    s.launch_host_func(gate_func(gate, log, "gate"))
    e = ob.Event()
    e.record(s)
    assert not e.query()
    gate.set()
    e.synchronize()
    assert e.query()
    assert log == ["gate"]


def test_record_on_current_stream_and_record_event(device: str) -> None:
    s = ob.Stream(device=device)
    with s:
        e = ob.Event(device=device)
        e.record()
        s.launch_host_func(lambda: None)
    e.synchronize()
    e2 = s.record_event()
    assert isinstance(e2, ob.Event)
    e2.synchronize()
    assert e2.query()
    e3 = ob.Event(device=device)
    assert s.record_event(e3) is e3
    e3.synchronize()


def test_elapsed_time_is_non_negative(device: str) -> None:
    s = ob.Stream(device=device)
    start, end = ob.Event(device=device), ob.Event(device=device)
    t = ob.asarray(np.ones(1 << 16, np.float32), device=device)
    start.record(s)
    with s:
        ob.vector_add(t, t)
    end.record(s)
    end.synchronize()
    elapsed = start.elapsed_time(end)
    assert isinstance(elapsed, float)
    assert elapsed >= 0.0


def test_elapsed_time_measures_host_func_sleep(device: str) -> None:
    s = ob.Stream(device=device)
    start, end = ob.Event(device=device), ob.Event(device=device)
    start.record(s)
    s.launch_host_func(lambda: time.sleep(0.05))
    end.record(s)
    end.synchronize()
    assert start.elapsed_time(end) >= 45.0


def test_elapsed_time_on_unrecorded_event_raises(device: str) -> None:
    recorded = ob.Stream(device=device).record_event()
    recorded.synchronize()
    with pytest.raises(ob.DeviceError):
        ob.Event(device=device).elapsed_time(recorded)
    with pytest.raises(ob.DeviceError):
        recorded.elapsed_time(ob.Event(device=device))


def test_event_rerecord() -> None:
    s = ob.Stream()
    e = ob.Event()
    e.record(s)
    e.synchronize()
    gate, log = threading.Event(), []
    s.launch_host_func(gate_func(gate, log, "second"))
    e.record(s)
    assert not e.query()
    gate.set()
    e.synchronize()
    assert log == ["second"]


# --- cross-stream ordering -------------------------------------------------------------------


def _slow_writer(a: np.ndarray, value: float, delay: float):
    def func() -> None:
        time.sleep(delay)
        a[:] = value

    return func


def test_wait_event_orders_streams() -> None:
    # Host functions write a numpy array that a kernel then reads: host memory, so the CPU
    # device (test_ascend.py orders device work across streams with events).
    device = "cpu:0"
    stream_a, stream_b = ob.Stream(device=device), ob.Stream(device=device)
    a = np.zeros(1000)
    ta = ob.from_dlpack(a)
    stream_a.launch_host_func(_slow_writer(a, 5.0, 0.1))
    e = stream_a.record_event()
    stream_b.wait_event(e)
    with stream_b:
        r = ob.vector_add(ta, ta)
    np.testing.assert_array_equal(r.numpy(), np.full(1000, 10.0))


def test_event_wait_method_orders_streams() -> None:
    # Host functions write a numpy array that a kernel then reads: host memory, so the CPU
    # device (test_ascend.py orders device work across streams with events).
    device = "cpu:0"
    stream_a, stream_b = ob.Stream(device=device), ob.Stream(device=device)
    a = np.zeros(100, np.float32)
    ta = ob.from_dlpack(a)
    stream_a.launch_host_func(_slow_writer(a, 3.0, 0.1))
    e = ob.Event()
    e.record(stream_a)
    e.wait(stream_b)
    with stream_b:
        r = ob.vector_add(ta, ta)
    np.testing.assert_array_equal(r.numpy(), np.full(100, 6.0, np.float32))


def test_wait_stream_orders_streams() -> None:
    # Host functions write a numpy array that a kernel then reads: host memory, so the CPU
    # device (test_ascend.py orders device work across streams with events).
    device = "cpu:0"
    stream_a, stream_b = ob.Stream(device=device), ob.Stream(device=device)
    a = np.zeros(1000, np.int64)
    ta = ob.from_dlpack(a)
    stream_a.launch_host_func(_slow_writer(a, 7, 0.1))
    stream_b.wait_stream(stream_a)
    log: list[int] = []
    stream_b.launch_host_func(lambda: log.append(int(a[0])))
    with stream_b:
        r = ob.vector_add(ta, ta)
    np.testing.assert_array_equal(r.numpy(), np.full(1000, 14))
    stream_b.synchronize()
    assert log == [7]


def test_wait_event_blocks_only_the_waiting_stream() -> None:
    stream_a, stream_b, stream_c = ob.Stream(), ob.Stream(), ob.Stream()
    gate, log = threading.Event(), []
    stream_a.launch_host_func(gate_func(gate, log, "a"))
    stream_b.wait_event(stream_a.record_event())
    stream_b.launch_host_func(lambda: log.append("b"))
    stream_c.launch_host_func(lambda: log.append("c"))
    stream_c.synchronize()
    assert log == ["c"]
    assert not stream_b.query()
    gate.set()
    stream_b.synchronize()
    assert log == ["c", "a", "b"]


# --- `with` blocks exited out of order ----------------------------------------------------------


def test_with_blocks_exited_out_of_order(device: str) -> None:
    default = ob.current_stream(device)
    s1, s2 = ob.Stream(device=device), ob.Stream(device=device)
    s1.__enter__()
    s2.__enter__()
    s1.__exit__(None, None, None)
    assert ob.current_stream(device) == s2, "s2's block is still open"
    s2.__exit__(None, None, None)
    assert ob.current_stream(device) == default, "no block open: the stream from before them"


def test_three_blocks_exited_in_every_order() -> None:
    import itertools

    default = ob.current_stream()
    streams = [ob.Stream() for _ in range(3)]
    for order in itertools.permutations(range(3)):
        for s in streams:
            s.__enter__()
        still_open = [0, 1, 2]
        for i in order:
            streams[i].__exit__(None, None, None)
            still_open.remove(i)
            expected = streams[still_open[-1]] if still_open else default
            assert ob.current_stream() == expected, (order, i)
    assert ob.current_stream() == default


def test_generators_holding_with_blocks() -> None:
    default = ob.current_stream()
    s1, s2, s3 = ob.Stream(), ob.Stream(), ob.Stream()

    def holding(s: ob.Stream):
        with s:
            yield
            yield

    g1 = holding(s1)
    next(g1)
    assert ob.current_stream() == s1
    with s2:
        g3 = holding(s3)
        next(g3)
        assert ob.current_stream() == s3
        g1.close()  # the outermost block ends first
        assert ob.current_stream() == s3
        g3.close()
        assert ob.current_stream() == s2
    assert ob.current_stream() == default
    # A block entered by a generator and ended after the block around it.
    with s1:
        g2 = holding(s2)
        next(g2)
    assert ob.current_stream() == s2, "the generator's block is still open"
    g2.close()
    assert ob.current_stream() == default


def test_generator_closed_on_another_thread() -> None:
    default = ob.current_stream()
    s = ob.Stream()

    def holding():
        with s:
            yield

    g = holding()
    next(g)
    assert ob.current_stream() == s
    closer = threading.Thread(target=g.close)
    closer.start()
    closer.join()
    assert ob.current_stream() == default


def test_same_stream_through_two_handles_exited_out_of_order() -> None:
    default = ob.current_stream()
    s = ob.Stream()
    other = ob.Stream()
    s.__enter__()
    same = ob.current_stream()  # another Python object for the same stream
    assert same == s
    other.__enter__()
    same.__enter__()
    s.__exit__(None, None, None)  # ends the outermost block (the one entered through `s`)
    assert ob.current_stream() == s, "the innermost block (through `same`) is still open"
    same.__exit__(None, None, None)
    assert ob.current_stream() == other
    other.__exit__(None, None, None)
    assert ob.current_stream() == default
