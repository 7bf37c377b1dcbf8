"""``python -m opbridge.conformance --device ascend:0``: the device test subset as a script.

For users with a real accelerator (or the Ascend test double): each check exercises one promise of
the runtime on the device, compares against numpy, and prints ``ok`` / ``FAIL`` with the reason.
The exit status is the number of failed checks (0 = conforming). Nothing here needs pytest or the
repository's tests.

    python -m opbridge.conformance --device ascend:0 [--threads 8] [--calls 1000] [-v]
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np

import opbridge as ob

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]


def _data(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * 10).astype(dtype)


class Conformance:
    def __init__(self, device: str, threads: int, calls: int) -> None:
        self.device = device
        self.threads = threads
        self.calls = calls
        self.rng = np.random.default_rng(7)

    def allocated(self) -> int:
        gc.collect()
        ob.synchronize(self.device)
        return int(ob.get_memory_pool_stats(self.device)["allocated_bytes.current"])

    # --- the checks: each raises AssertionError (or an opbridge error) on failure -------------

    def check_listed(self) -> None:
        names = {d["name"]: d for d in ob.devices()}
        assert self.device in names, f"{self.device} is not in ob.devices(): {list(names)}"
        assert names[self.device]["available"], names[self.device]

    def check_round_trips(self) -> None:
        for dtype in DTYPES:
            for shape in [(0,), (1,), (3, 5), (2, 3, 1031)]:
                a = _data(self.rng, shape, dtype)
                t = ob.asarray(a, device=self.device)
                assert t.device == self.device
                np.testing.assert_array_equal(t.numpy(), a)
                np.testing.assert_array_equal(t.to("cpu").numpy(), a)
                np.testing.assert_array_equal(ob.asarray(a).to(self.device).numpy(), a)

    def check_zeros(self) -> None:
        np.testing.assert_array_equal(ob.zeros((7, 9), dtype="int32", device=self.device).numpy(), np.zeros((7, 9)))

    def check_elementwise(self) -> None:
        ops = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "maximum": np.maximum, "minimum": np.minimum}
        for name, ref in ops.items():
            for dtype in DTYPES:
                a, b = _data(self.rng, (4, 33), dtype), _data(self.rng, (33,), dtype)
                got = getattr(ob.ops, name)(ob.asarray(a, device=self.device), ob.asarray(b, device=self.device))
                np.testing.assert_array_equal(got.numpy(), ref(a, b), err_msg=f"{name} {np.dtype(dtype).name}")

    def check_vector_add_and_cast(self) -> None:
        a, b = _data(self.rng, (1000,), np.float32), _data(self.rng, (1000,), np.float32)
        x, y = ob.asarray(a, device=self.device), ob.asarray(b, device=self.device)
        np.testing.assert_array_equal(ob.vector_add(x, y).numpy(), a + b)
        np.testing.assert_array_equal(ob.ops.cast(x, dtype="float64").numpy(), a.astype(np.float64))

    def check_matmul(self) -> None:
        for dtype in [np.float32, np.float64]:
            a, b = _data(self.rng, (3, 16, 24), dtype) / 10, _data(self.rng, (24, 8), dtype) / 10
            got = ob.ops.matmul(ob.asarray(a, device=self.device), ob.asarray(b, device=self.device)).numpy()
            np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-4)

    def check_staged_numpy_path(self) -> None:
        for n in [1, 65_537, 1_000_003]:
            a, b = _data(self.rng, (n,), np.float32), _data(self.rng, (n,), np.float32)
            np.testing.assert_array_equal(ob.vector_add(a, b, device=self.device), a + b)

    def check_streams_events_host_functions(self) -> None:
        s1, s2 = ob.Stream(device=self.device), ob.Stream(device=self.device)
        a = _data(self.rng, (1 << 16,), np.float32)
        with s1:
            t = ob.asarray(a, device=self.device)
            r = ob.ops.add(t, t)
        e = s1.record_event()
        s2.wait_event(e)
        with s2:
            back = r.numpy()
        np.testing.assert_array_equal(back, a + a)
        log: list[int] = []
        for i in range(10):
            s1.launch_host_func(lambda i=i: log.append(i))
        start = s1.record_event()
        s1.launch_host_func(lambda: time.sleep(0.02))
        end = s1.record_event()
        s1.synchronize()
        assert log == list(range(10)), log
        assert start.elapsed_time(end) >= 15.0, start.elapsed_time(end)

    def check_host_function_error(self) -> None:
        s = ob.Stream(device=self.device)
        s.launch_host_func(lambda: 1 / 0)
        try:
            s.synchronize()
        except ob.DeviceError:
            pass
        else:
            raise AssertionError("a failing host function was not reported")
        s.synchronize()

    def check_out_of_memory_and_recovery(self) -> None:
        base = self.allocated()
        ob.set_memory_limit(base + (4 << 20), device=self.device)
        try:
            try:
                ob.empty((8 << 20,), dtype="float32", device=self.device)
            except ob.OutOfMemoryError:
                pass
            else:
                raise AssertionError("an allocation past the limit succeeded")
            ob.empty((1 << 10,), dtype="float32", device=self.device)
        finally:
            ob.set_memory_limit(None, device=self.device)

    def check_threads_bit_exact(self) -> None:
        errors: list[BaseException] = []
        arrays = [_data(self.rng, (511,), np.float32) for _ in range(self.threads)]

        def work(a: np.ndarray) -> None:
            try:
                x = ob.asarray(a, device=self.device)
                for _ in range(self.calls):
                    r = ob.ops.add(x, x)
                np.testing.assert_array_equal(r.numpy(), a + a)
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=work, args=(a,)) for a in arrays]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def check_pool_back_to_baseline(self) -> None:
        base = self.allocated()
        a = _data(self.rng, (4096,), np.float32)
        for _ in range(self.calls):
            ob.ops.add(ob.asarray(a, device=self.device), ob.asarray(a, device=self.device)).numpy()
        after = self.allocated()
        assert after == base, f"{base} bytes allocated before, {after} after"

    def run(self, verbose: bool) -> int:
        checks: list[tuple[str, Callable[[], None]]] = [
            (name.removeprefix("check_"), getattr(self, name)) for name in dir(self) if name.startswith("check_")
        ]
        failed = 0
        for name, check in sorted(checks, key=lambda c: list(type(self).__dict__).index("check_" + c[0])):
            started = time.perf_counter()
            try:
                check()
            except Exception as e:  # noqa: BLE001 (every failure is reported, then the next check runs)
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
                if verbose:
                    traceback.print_exc()
                continue
            print(f"ok   {name} ({time.perf_counter() - started:.2f} s)")
        print(f"{self.device}: {failed} of {len(checks)} checks failed" if failed else f"{self.device}: conforming")
        return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opbridge.conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu:0", help="the device to check (e.g. ascend:0)")
    parser.add_argument("--threads", type=int, default=8, help="threads in the concurrency check (default 8)")
    parser.add_argument("--calls", type=int, default=1000, help="calls per thread / in the pool check (default 1000)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failures")
    args = parser.parse_args(argv)
    return Conformance(args.device, args.threads, args.calls).run(args.verbose)


if __name__ == "__main__":
    sys.exit(main())
