"""Plugin ABI 3 on the ACL test double: the C example library with an Ascend kernel (device code
embedded, launched with aclrtLaunchKernelWithHostArgs on opbridge's stream) agrees with numpy and
with its own CPU kernel; a device-only operator and an ABI 2 library (CPU only) raise a
DeviceError that names the devices they have; what a device kernel receives is what plugin.h
promises; unloading releases the library's kernel binaries."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import opbridge as ob
from conftest import ASCEND_LIB_DIR
from test_plugins import ABI2_INCLUDE, C_EXAMPLE, cc

pytestmark = pytest.mark.skipif(ASCEND_LIB_DIR is None, reason="the Ascend test double could not be built")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plugins" / "c" / "ascend"
DEVICE_ONLY = REPO / "tests" / "plugins" / "device_only.c"
DEV = "ascend:0"


@pytest.fixture(scope="module")
def example_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built as the example's comment says: the device code with the double's kernel compiler,
    then the library with the binary embedded, linked against the ACL runtime library."""
    from opbridge.testing import ascend_double

    out = tmp_path_factory.mktemp("ascend-plugin")
    binary = ascend_double.compile_kernel(EXAMPLE / "scale_add_kernel.c", out / "scale_add_kernel.bin")
    lib = str(ASCEND_LIB_DIR)
    # --no-as-needed: the library comes before the source on this command line.
    flags = [
        f'-DKERNEL_BINARY="{binary}"',
        "-L",
        lib,
        "-Wl,--no-as-needed",
        "-lascendcl",
        f"-Wl,-rpath,{lib}",
        "-pthread",
    ]
    return cc(EXAMPLE / "scale_add_ascend.c", out / "libscale_add_ascend.so", *flags)


@pytest.fixture
def example(example_plugin: Path) -> Iterator[ob.Library]:
    with ob.load_library(example_plugin) as lib:
        yield lib


def loaded_binaries() -> int:
    impl = ctypes.CDLL(str(Path(str(ASCEND_LIB_DIR)) / "libacl_rt_impl.so"))
    impl.acldoubleLoadedBinaries.restype = ctypes.c_uint64
    return int(impl.acldoubleLoadedBinaries())


def test_the_example_lists_both_devices(example: ob.Library) -> None:
    assert example.abi_version == 3 and example.ops == [("scale_add_ascend", 1)]
    listed = next(op for op in ob.list_ops() if op["name"] == "scale_add_ascend")
    assert listed["devices"] == ["cpu", "ascend"]


@pytest.mark.parametrize("shape", [(1,), (1000,), (3, 4097), (2, 3, 4), ()])
def test_the_ascend_kernel_agrees_with_numpy_and_the_cpu_kernel(example: ob.Library, shape, rng) -> None:
    a = rng.standard_normal(shape).astype(np.float32)
    b = rng.standard_normal(shape).astype(np.float32)
    want = a * np.float32(2.5) + b
    on_cpu = ob.ops.scale_add_ascend(a, b, alpha=2.5)
    np.testing.assert_allclose(on_cpu, want, rtol=1e-6, atol=1e-6)
    x, y = ob.asarray(a, device=DEV), ob.asarray(b, device=DEV)
    z = ob.ops.scale_add_ascend(x, y, alpha=2.5)
    assert z.device == DEV and z.shape == shape and z.dtype == "float32"
    # The host cannot read the double's device memory: these values came from the device code.
    np.testing.assert_array_equal(z.numpy(), on_cpu)
    # Stream order: a built-in operator on the result sees the kernel's writes.
    np.testing.assert_array_equal(ob.ops.add(z, x).numpy(), on_cpu + a)


def test_the_ascend_kernel_with_out_and_converted_inputs(example: ob.Library, rng) -> None:
    a = rng.standard_normal(512).astype(np.float32)
    x = ob.asarray(a, device=DEV)
    out = ob.empty((512,), dtype="float32", device=DEV)
    assert ob.ops.scale_add_ascend(x, x, alpha=-1.0, out=out) is out
    np.testing.assert_array_equal(out.numpy(), np.zeros(512, np.float32))
    # float16 inputs are not among the operator's dtypes: refused before any kernel runs.
    with pytest.raises(ob.DTypeError):
        ob.ops.scale_add_ascend(ob.asarray(a.astype(np.float16), device=DEV), x)


def test_the_kernels_own_errors_stay_typed(example: ob.Library, rng) -> None:
    a = rng.standard_normal((8, 6)).astype(np.float32)
    x = ob.asarray(a, device=DEV)
    with pytest.raises(ob.ArgumentError, match="alpha must be finite"):
        ob.ops.scale_add_ascend(x, x, alpha=float("inf"))
    with pytest.raises(ob.ShapeError, match="same shape"):
        ob.ops.scale_add_ascend(x, ob.asarray(a[:4], device=DEV))
    with pytest.raises(ob.DeviceError, match="expected all tensors on ascend:0"):
        ob.ops.scale_add_ascend(x, ob.asarray(a, device="cpu:0"))
    empty = ob.asarray(np.zeros((0, 3), np.float32), device=DEV)
    assert ob.ops.scale_add_ascend(empty, empty).shape == (0, 3)


def test_unloading_releases_the_kernel_binaries(example_plugin: Path) -> None:
    ob.synchronize(DEV)
    before = loaded_binaries()
    for _ in range(3):
        lib = ob.load_library(example_plugin)
        x = ob.asarray(np.ones(64, np.float32), device=DEV)
        y = ob.ops.scale_add_ascend(x, x, alpha=3.0)  # queued: the unload waits for it
        assert loaded_binaries() == before + 1, "loaded on first use, once per device"
        lib.unload()
        assert loaded_binaries() == before, "the release callback unloaded it"
        np.testing.assert_array_equal(y.numpy(), np.full(64, 4, np.float32))


def test_a_failing_launch_is_the_calls_error(example_plugin: Path) -> None:
    """aclrtLaunchKernelWithHostArgs failing: the kernel's status, with ACL's message."""
    code = f"""
        import numpy as np, opbridge as ob
        lib = ob.load_library({str(example_plugin)!r})
        x = ob.asarray(np.ones(8, np.float32), device="ascend:0")
        try:
            ob.ops.scale_add_ascend(x, x)
        except ob.OpBridgeError as e:
            print(type(e).__name__, e)
        print(ob.ops.scale_add_ascend(x, x).numpy()[0])
        """
    env = {
        **os.environ,
        "OPBRIDGE_ASCEND_LIB_DIR": str(ASCEND_LIB_DIR),
        "ACLDOUBLE_FAIL": "aclrtLaunchKernelWithHostArgs:1",
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert "aclrtLaunchKernelWithHostArgs failed with ACL error" in first, first
    assert second == "2.0", "the next launch works"


@pytest.fixture(scope="module")
def device_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ob.Library]:
    path = cc(DEVICE_ONLY, tmp_path_factory.mktemp("device-only") / "libdevice_only.so")
    with ob.load_library(path) as lib:
        yield lib


def test_a_device_kernel_gets_what_the_header_promises(device_only: ob.Library) -> None:
    assert next(op for op in ob.list_ops() if op["name"] == "ascend_probe")["devices"] == ["ascend"]
    x = ob.asarray(np.ones((5, 2), np.float32), device=DEV)
    assert ob.ops.ascend_probe(x).device == DEV
    with pytest.raises(ob.ShapeError, match=r"device 21:0 stream set, ndim 2, shape\[0\] 5, workspace 500"):
        ob.ops.ascend_probe(x, report=True)


def test_a_device_only_operator_on_the_host_names_its_devices(device_only: ob.Library) -> None:
    a = np.ones(4, np.float32)
    for call in (lambda: ob.ops.ascend_probe(a), lambda: ob.ops.ascend_probe(ob.asarray(a, device="cpu:0"))):
        with pytest.raises(ob.DeviceError, match="no cpu kernel for ascend_probe v1.*it has kernels for: ascend"):
            call()


def test_an_abi2_library_loads_unchanged_and_runs_on_the_host_only(tmp_path: Path) -> None:
    path = cc(C_EXAMPLE, tmp_path / "libscale_add_abi2.so", include=ABI2_INCLUDE)
    with ob.load_library(path) as lib:
        assert lib.abi_version == 2
        a = np.arange(6, dtype=np.float32)
        np.testing.assert_array_equal(ob.ops.scale_add(a, a, alpha=2.0, beta=1.0), 3 * a)
        with pytest.raises(ob.DeviceError, match="no ascend kernel for scale_add v2.*it has kernels for: cpu"):
            ob.ops.scale_add(ob.asarray(a, device=DEV), ob.asarray(a, device=DEV))


def test_unload_waits_for_queued_device_work(example_plugin: Path) -> None:  # noqa: F811
    """Launches that take 0.2 s each on the device: the unload returns only once the queued ones
    have run (the release callback then frees nothing still in use), and their results stand."""
    code = f"""
        import time, numpy as np, opbridge as ob
        lib = ob.load_library({str(example_plugin)!r})
        x = ob.asarray(np.ones(64, np.float32), device="ascend:0")
        ys = [ob.ops.scale_add_ascend(x, x, alpha=float(k)) for k in range(3)]
        began = time.perf_counter()
        lib.unload()
        print(round(time.perf_counter() - began, 3))
        print([float(y.numpy()[0]) for y in ys])
        """
    env = {**os.environ, "OPBRIDGE_ASCEND_LIB_DIR": str(ASCEND_LIB_DIR), "ACLDOUBLE_LAUNCH_US": "200000"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    waited, values = done.stdout.strip().splitlines()
    assert float(waited) >= 0.3, f"the unload returned after {waited} s with launches still queued"
    assert values == "[1.0, 2.0, 3.0]"
