"""A child made with fork() after large (multi-threaded) calls keeps working.

fork() copies only the calling thread: the parent's stream workers and rayon's compute threads
are not in the child. Every probe runs in a fresh interpreter with a timeout, so a hang fails one
test instead of the suite.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

N = 1 << 21  # well above every parallel threshold (and the streaming-store size)

PRELUDE = f"""
import multiprocessing as mp, os, sys, threading
import numpy as np
import opbridge as ob

N = {N}
a = np.arange(N, dtype=np.float32)
b = np.ones(N, dtype=np.float32)

def parent_warm_up():
    # Large calls start rayon's global pool; Tensor ops start the current stream's worker.
    assert np.array_equal(ob.vector_add(a, b), a + b)
    t = ob.asarray(a)
    assert np.array_equal(ob.vector_add(t, t).numpy(), a + a)
    ob.synchronize()

def child_work():
    # Large kernels: elementwise (streaming and plain), reduction, matmul, softmax.
    assert np.array_equal(ob.vector_add(a, b), a + b)
    assert np.array_equal(ob.ops.add(a, b), a + b)
    assert np.allclose(ob.ops.sum(a.reshape(1024, -1), axis=0), a.reshape(1024, -1).sum(axis=0), rtol=1e-4)
    x = np.random.default_rng(0).random((256, 256), dtype=np.float32)
    assert np.allclose(ob.matmul(x, x), x @ x, rtol=1e-4, atol=1e-3)
    s = ob.ops.softmax(a.reshape(512, -1) / N, axis=-1)
    assert np.allclose(s.sum(axis=-1), 1, rtol=1e-4)
    # Tensor ops on the (inherited, replaced) current stream, a new stream, synchronize.
    t = ob.asarray(a)
    assert np.array_equal(ob.vector_add(t, t).numpy(), a + a)
    with ob.Stream() as s:
        r = ob.vector_add(t, t)
    s.synchronize()
    assert np.array_equal(r.numpy(), a + a)
    ob.synchronize()
    return "ok"
"""


def run(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"probe hung (killed after {timeout} s); stderr: {e.stderr!r}")
    assert done.returncode == 0, done.stderr
    return done


def test_os_fork_child_runs_large_kernels_streams_and_synchronize():
    done = run("""
        parent_warm_up()
        pid = os.fork()
        if pid == 0:
            try:
                child_work()
                print("child ok", flush=True)
                os._exit(0)
            except BaseException as e:
                print("child failed:", type(e).__name__, e, flush=True)
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        child_work()  # the parent keeps working
        print("parent ok")
    """)
    assert "child ok" in done.stdout and "parent ok" in done.stdout, done.stdout


def test_multiprocessing_fork_context_pool():
    done = run("""
        def task(i):
            return child_work() + str(i)

        if __name__ == "__main__":
            parent_warm_up()
            with mp.get_context("fork").Pool(2) as pool:
                assert pool.map(task, range(4)) == ["ok0", "ok1", "ok2", "ok3"]
            child_work()
            print("parent ok")
    """)
    assert "parent ok" in done.stdout


def test_grandchild_of_a_forked_child_works_too():
    done = run("""
        parent_warm_up()
        pid = os.fork()
        if pid == 0:
            child_work()  # the child's own pool and workers now exist
            pid2 = os.fork()
            if pid2 == 0:
                child_work()
                os._exit(0)
            _, status = os.waitpid(pid2, 0)
            os._exit(os.waitstatus_to_exitcode(status))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        print("ok")
    """)
    assert "ok" in done.stdout


def test_a_parent_stream_used_in_the_child_raises_device_error_at_once():
    done = run("""
        parent_warm_up()
        s = ob.Stream()
        t = ob.asarray(a)
        with s:
            r = ob.vector_add(t, t)
        s.synchronize()
        ev = ob.Event()
        ev.record(s)
        ev.synchronize()
        pid = os.fork()
        if pid == 0:
            outcomes = []
            probes = [("enter", lambda: s.__enter__()), ("sync", s.synchronize), ("wait", lambda: s.wait_event(ev))]
            for name, call in probes:
                try:
                    call()
                    outcomes.append(name + ":no error")
                except ob.DeviceError as e:
                    outcomes.append(name + (":fork" if "fork" in str(e) else ":other"))
            # Finished parent work is readable; the device-wide synchronize skips the parent's streams.
            assert np.array_equal(r.numpy(), a + a)
            ob.synchronize()
            print(" ".join(outcomes), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert np.array_equal(ob.vector_add(t, t).numpy(), a + a)
    """)
    assert "no error" not in done.stdout and ":other" not in done.stdout, done.stdout
    assert "enter:fork" in done.stdout and "sync:fork" in done.stdout and "wait:fork" in done.stdout, done.stdout


def test_fork_while_another_thread_runs_large_calls():
    # The parent's compute pool is busy (another thread loops over large calls) when it forks.
    done = run("""
        parent_warm_up()
        stop = threading.Event()
        def busy():
            while not stop.is_set():
                ob.vector_add(a, b)
                ob.ops.sum(a)
        th = threading.Thread(target=busy)
        th.start()
        try:
            for _ in range(5):
                pid = os.fork()
                if pid == 0:
                    try:
                        child_work()
                        os._exit(0)
                    except BaseException as e:
                        print("child failed:", e, flush=True)
                        os._exit(1)
                _, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0, status
        finally:
            stop.set()
            th.join()
        print("ok")
    """)
    assert "ok" in done.stdout


def test_work_in_flight_at_fork_raises_device_error_in_the_child_never_hangs():
    # Many large ops queued on a parent stream, then fork at once: in the child that work never
    # runs (its worker stayed in the parent), so reading its result or waiting for its event is a
    # DeviceError naming fork (or, if the parent finished first, the right answer), never a hang.
    done = run("""
        parent_warm_up()
        t = ob.asarray(a)
        s = ob.Stream()
        with s:
            r = t
            for _ in range(300):
                r = ob.vector_add(r, t)
            ev = s.record_event()
        pid = os.fork()
        if pid == 0:
            outcomes = []
            for name, call in [("read", r.numpy), ("event", ev.synchronize), ("tensor_sync", r.synchronize)]:
                try:
                    call()
                    outcomes.append(name + ":done")
                except ob.DeviceError as e:
                    outcomes.append(name + (":fork" if "fork" in str(e) else ":other"))
            # A new stream waiting for the parent's event refuses at once rather than stalling.
            try:
                with ob.Stream() as s2:
                    s2.wait_event(ev)
                outcomes.append("wait:done")
            except ob.DeviceError as e:
                outcomes.append("wait" + (":fork" if "fork" in str(e) else ":other"))
            child_work()
            print(" ".join(outcomes), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert np.allclose(r.numpy(), a * 301, rtol=1e-5)
        print("parent ok")
    """)
    assert "parent ok" in done.stdout and ":other" not in done.stdout, done.stdout


def test_fork_inside_a_with_block_and_parent_tensors_freed_in_the_child():
    # Forked inside `with s:` (the open block's stream and the thread's base are the parent's):
    # the child's current stream is replaced in the block and after it, the block still exits
    # cleanly, and a parent tensor used on another parent stream, freed in the child, does not
    # poison the child's next allocation.
    done = run("""
        parent_warm_up()
        t = ob.asarray(a)
        u = ob.asarray(a)
        s, s2 = ob.Stream(), ob.Stream()
        with s2:
            w = ob.vector_add(u, u)  # u is used on s2 as well as its own stream
        ob.synchronize()
        with s:
            pid = os.fork()
            if pid == 0:
                try:
                    assert np.array_equal(ob.vector_add(t, t).numpy(), a + a)  # inside the block
                    assert ob.current_stream() != s
                    s.__exit__(None, None, None)
                    assert np.array_equal(ob.vector_add(t, t).numpy(), a + a)  # after the block
                    del u, w
                    x = ob.asarray(a)
                    assert np.array_equal(ob.vector_add(x, x).numpy(), a + a)
                    child_work()
                    print("child ok", flush=True)
                    os._exit(0)
                except BaseException as e:
                    print("child failed:", type(e).__name__, e, flush=True)
                    os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert np.array_equal(ob.vector_add(u, u).numpy(), a + a)
        print("parent ok")
    """)
    assert "child ok" in done.stdout and "parent ok" in done.stdout, done.stdout
