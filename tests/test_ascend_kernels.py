"""`ob.ascend.Kernel`: kernel binaries loaded and launched from Python, on the ACL test double
(whose kernel binaries are shared objects built from C in its test-only dialect)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import opbridge as ob
from conftest import ASCEND_LIB_DIR, random_array

pytestmark = pytest.mark.skipif(ASCEND_LIB_DIR is None, reason="the Ascend test double could not be built")

DEV = "ascend:0"
VECTOR_ADD = r"""
#include "acldouble_kernel.h"
ACLDOUBLE_KERNEL_ARGS(vector_add_kernel, "pppi")
__global__ __aicore__ void vector_add_kernel(GM_ADDR x, GM_ADDR y, GM_ADDR z, uint32_t n) {
    uint32_t per = (n + GetBlockNum() - 1) / GetBlockNum(), begin = GetBlockIdx() * per;
    for (uint32_t i = begin; i < n && i < begin + per; i++)
        ((float *)z)[i] = ((const float *)x)[i] + ((const float *)y)[i];
}
ACLDOUBLE_KERNEL_ARGS(axpy_i64, "ppl")
__global__ __aicore__ void axpy_i64(GM_ADDR x, GM_ADDR y, int64_t a) {
    if (GetBlockIdx() == 0)
        for (int i = 0; i < 16; i++) ((int64_t *)y)[i] += a * ((const int64_t *)x)[i];
}
__global__ __aicore__ void undeclared(GM_ADDR x) { (void)x; }
"""
VADD_PARAMS = ["tensor", "tensor", "tensor", "uint32"]


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> str:
    from opbridge.testing import ascend_double

    return str(ascend_double.compile_kernel(VECTOR_ADD, tmp_path_factory.mktemp("kernels") / "kernels.so"))


@pytest.fixture(scope="module")
def vadd(binary):
    return ob.ascend.Kernel.from_file(binary, "vector_add_kernel", params=VADD_PARAMS)


@pytest.mark.parametrize(("blocks", "n"), [(1, 1), (3, 1000), (8, 1000), (64, 10), (8, 65537)])
def test_vector_add_kernel_matches_numpy(vadd, blocks, n, rng) -> None:
    a, b = random_array(rng, (n,), np.float32), random_array(rng, (n,), np.float32)
    x, y = ob.asarray(a, device=DEV), ob.asarray(b, device=DEV)
    z = ob.empty((n,), dtype="float32", device=DEV)
    vadd(blocks, x, y, z, n)
    np.testing.assert_array_equal(z.numpy(), a + b)


def test_a_kernel_without_params_takes_its_types_from_the_arguments(binary, tmp_path, rng) -> None:
    """A kernel binary does not carry its parameters: loaded without ``params``, each call's
    arguments give them, Tensors and numpy scalars (a plain Python number has no C type)."""
    k = ob.ascend.Kernel.from_file(binary, "vector_add_kernel")
    assert k.params is None and "params from each call" in repr(k)
    a, b = random_array(rng, (1000,), np.float32), random_array(rng, (1000,), np.float32)
    x, y = ob.asarray(a, device=DEV), ob.asarray(b, device=DEV)
    z = ob.empty((1000,), dtype="float32", device=DEV)
    k(4, x, y, z, np.uint32(1000))
    np.testing.assert_array_equal(z.numpy(), a + b)
    with pytest.raises(ob.ArgumentError, match="loaded without params.*numpy scalar"):
        k(4, x, y, z, 1000)
    with pytest.raises(ob.ArgumentError, match="numpy float64"):
        k(4, x, y, z, np.float64(1000))
    with pytest.raises(ob.ArgumentError, match="bool"):
        k(4, x, y, z, True)
    with pytest.raises(ob.ArgumentError, match="numpy scalar"):
        k(4, x, y, z, np.array(1000, np.uint32))  # an array is not a scalar
    j = ob.jit.compile(SCALE, "scale", device="ascend", flags=["-DFACTOR=2.0f"], cache_dir=tmp_path)
    assert j.params is None
    j(7, x, z, np.uint32(1000))
    np.testing.assert_array_equal(z.numpy(), 2 * a)


def test_properties_and_repr(vadd) -> None:
    assert vadd.name == "vector_add_kernel" and vadd.params == VADD_PARAMS and vadd.device == DEV
    assert "vector_add_kernel" in repr(vadd)


def test_from_binary_and_64_bit_scalars(binary) -> None:
    with open(binary, "rb") as f:
        data = f.read()
    k = ob.ascend.Kernel.from_binary(data, "axpy_i64", ["tensor", "tensor", "int64"])
    x = ob.asarray(np.arange(16, dtype=np.int64), device=DEV)
    y = ob.asarray(np.ones(16, dtype=np.int64), device=DEV)
    k(1, x, y, 3_000_000_000)
    np.testing.assert_array_equal(y.numpy(), 1 + 3_000_000_000 * np.arange(16))


def test_launches_are_ordered_with_other_work_on_their_tensors(vadd, rng) -> None:
    a = random_array(rng, (4096,), np.float32)
    x = ob.asarray(a, device=DEV)
    z = ob.empty((4096,), dtype="float32", device=DEV)
    side = ob.Stream(device=DEV)
    vadd(4, x, x, z, 4096, stream=side)  # on another stream: readers of z wait for it
    doubled = ob.ops.add(z, z)  # on this thread's current stream
    np.testing.assert_array_equal(doubled.numpy(), (a + a) + (a + a))


def test_threads_launch_concurrently(vadd, rng) -> None:
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            r = np.random.default_rng(seed)
            a, b = r.standard_normal(777).astype(np.float32), r.standard_normal(777).astype(np.float32)
            x, y, z = ob.asarray(a, device=DEV), ob.asarray(b, device=DEV), ob.empty((777,), "float32", DEV)
            for _ in range(50):
                vadd(5, x, y, z, 777)
            np.testing.assert_array_equal(z.numpy(), a + b)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_a_kernel_dropped_with_launches_queued_lets_them_finish(binary, rng) -> None:
    k = ob.ascend.Kernel.from_file(binary, "vector_add_kernel", params=VADD_PARAMS)
    a = random_array(rng, (100_000,), np.float32)
    x = ob.asarray(a, device=DEV)
    z = ob.empty((100_000,), dtype="float32", device=DEV)
    for _ in range(20):
        k(2, x, x, z, 100_000)
    del k  # unloads the binary only after its queued launches
    np.testing.assert_array_equal(z.numpy(), a + a)


def test_wrong_arguments_are_typed_errors_before_launch(vadd) -> None:
    x = ob.asarray(np.ones(8, np.float32), device=DEV)
    z = ob.empty((8,), dtype="float32", device=DEV)
    with pytest.raises(ob.ArgumentError, match="expected 4 arguments"):
        vadd(1, x, x, z)
    with pytest.raises(ob.ArgumentError, match="out of range"):
        vadd(1, x, x, z, -1)
    with pytest.raises(ob.ArgumentError, match="out of range"):
        vadd(1, x, x, z, 2**32)
    with pytest.raises(ob.ArgumentError, match="must be tensor"):
        vadd(1, x, x, 3, 8)
    with pytest.raises(ob.ArgumentError, match="must be uint32"):
        vadd(1, x, x, z, x)
    with pytest.raises(ob.ArgumentError, match="Tensor"):
        vadd(1, x, x, np.ones(8, np.float32), 8)  # a numpy array is not device memory
    with pytest.raises(ob.ArgumentError, match="bool"):
        vadd(1, x, x, z, True)
    with pytest.raises(ob.ArgumentError, match="block_dim"):
        vadd(0, x, x, z, 8)
    with pytest.raises(ob.ArgumentError, match="block_dim"):
        vadd(-1, x, x, z, 8)
    with pytest.raises(ob.DeviceError, match="cpu:0"):
        vadd(1, x, x, ob.asarray(np.ones(8, np.float32)), 8)
    assert z.numpy().shape == (8,)  # the stream is unharmed


def test_loading_errors_name_the_problem(binary, tmp_path) -> None:
    with pytest.raises(ob.DeviceError, match="no kernel named nope"):
        ob.ascend.Kernel.from_file(binary, "nope", ["tensor"])
    with pytest.raises(ob.DeviceError, match="ACLDOUBLE_KERNEL_ARGS"):
        ob.ascend.Kernel.from_file(binary, "undeclared", ["tensor"])
    missing = tmp_path / "missing.so"
    with pytest.raises(ob.DeviceError, match="missing.so"):
        ob.ascend.Kernel.from_file(missing, "vector_add_kernel", VADD_PARAMS)
    not_a_kernel = tmp_path / "text.so"
    not_a_kernel.write_text("not a binary")
    with pytest.raises(ob.DeviceError, match="100003"):
        ob.ascend.Kernel.from_file(not_a_kernel, "vector_add_kernel", VADD_PARAMS)
    with pytest.raises(ob.DeviceError, match="empty"):
        ob.ascend.Kernel.from_binary(b"", "vector_add_kernel", VADD_PARAMS)
    with pytest.raises(ob.ArgumentError, match="unknown kernel parameter kind"):
        ob.ascend.Kernel.from_file(binary, "vector_add_kernel", ["pointer"])
    with pytest.raises(ob.DeviceError, match="ascend device"):
        ob.ascend.Kernel.from_file(binary, "vector_add_kernel", VADD_PARAMS, device="cpu:0")
    with pytest.raises(ob.DeviceError, match="reports 1 Ascend device"):
        ob.ascend.Kernel.from_file(binary, "vector_add_kernel", VADD_PARAMS, device="ascend:5")


def test_a_failing_kernel_is_reported_with_its_name_and_call_site(binary) -> None:
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        import numpy as np, opbridge as ob
        k = ob.ascend.Kernel.from_file({binary!r}, "vector_add_kernel", {VADD_PARAMS!r})
        x = ob.asarray(np.ones(8, np.float32), device="ascend:0")
        z = ob.empty((8,), dtype="float32", device="ascend:0")
        k(1, x, x, z, 8)
        try:
            z.numpy()
        except ob.DeviceError as e:
            print("failed:", e)
        k(1, x, x, z, 8)
        print(z.numpy().tolist())
        """
    )
    env = {**os.environ, "OPBRIDGE_ASCEND_LIB_DIR": str(ASCEND_LIB_DIR), "ACLDOUBLE_FAIL": "task:2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    # task 1 is the upload (empty() queues nothing); the second, the kernel, fails
    assert lines[0].startswith("failed:") and "kernel vector_add_kernel at <string>:6" in lines[0], lines
    assert lines[1] == str([2.0] * 8)


# --- ob.jit.compile(device="ascend"): the runtime compiler (aclrtc) and the JIT cache -----------

SCALE = r"""
#include "acldouble_kernel.h"
ACLDOUBLE_KERNEL_ARGS(scale, "ppi")
__global__ __aicore__ void scale(GM_ADDR x, GM_ADDR y, uint32_t n) {
    for (uint32_t i = GetBlockIdx(); i < n; i += GetBlockNum()) ((float *)y)[i] = FACTOR * ((const float *)x)[i];
}
"""


def jit_scale(tmp_path, factor: str = "2.0f", **kw):
    return ob.jit.compile(
        SCALE,
        "scale",
        device="ascend",
        params=["tensor", "tensor", "uint32"],
        flags=[f"-DFACTOR={factor}"],
        cache_dir=tmp_path,
        **kw,
    )


def test_jit_compiles_caches_and_launches(tmp_path, rng) -> None:
    a = random_array(rng, (1000,), np.float32)
    x, y = ob.asarray(a, device=DEV), ob.empty((1000,), "float32", DEV)
    k = jit_scale(tmp_path)
    assert not k.cached and k.device == DEV and k.params == ["tensor", "tensor", "uint32"]
    k(7, x, y, 1000)
    np.testing.assert_array_equal(y.numpy(), 2 * a)
    again = jit_scale(tmp_path)
    assert again.cached and again.key == k.key
    other = jit_scale(tmp_path, "3.0f")  # another option: another key, compiled
    assert not other.cached and other.key != k.key
    other(2, x, y, 1000)
    np.testing.assert_array_equal(y.numpy(), 3 * a)


def test_jit_recompiles_a_damaged_cache_entry(tmp_path) -> None:
    k = jit_scale(tmp_path)
    (entry,) = tmp_path.glob("*.ascend.bin")
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    again = jit_scale(tmp_path)
    assert not again.cached and again.key == k.key


def test_jit_compile_errors_carry_the_log(tmp_path) -> None:
    with pytest.raises(ob.jit.JitCompileError, match="176003") as info:
        ob.jit.compile("int x = ;\n", "broken", device="ascend", params=[], cache_dir=tmp_path)
    assert "broken.c:1" in str(info.value) and info.value.returncode == 176003
    with pytest.raises(ob.jit.JitCompileError, match="176002"):  # not an option it takes
        ob.jit.compile(SCALE, "scale", device="ascend", params=[], flags=["-fexec"], cache_dir=tmp_path)
    # an option is one argument: a define's value never becomes another compiler flag
    with pytest.raises(ob.jit.JitCompileError, match="176003"):
        jit_scale(tmp_path, "2.0f -fexec")
    assert not list(tmp_path.glob("*.ascend.bin"))  # nothing cached from failures


def test_jit_arguments_are_checked(tmp_path) -> None:
    with pytest.raises(ob.ArgumentError, match="params"):
        ob.jit.compile(SCALE, "scale", device="ascend", params="tensor", cache_dir=tmp_path)
    with pytest.raises(ob.ArgumentError, match="compiler"):
        ob.jit.compile(SCALE, "scale", device="ascend", params=[], compiler="cc", cache_dir=tmp_path)
    with pytest.raises(ob.ArgumentError, match="device='ascend'"):
        ob.jit.compile("int x;", "plain", params=["tensor"], cache_dir=tmp_path)
    with pytest.raises(ob.ArgumentError, match="device must be"):
        ob.jit.compile("int x;", "plain", device="gpu", cache_dir=tmp_path)
    with pytest.raises(ob.DeviceError, match="ascend:3"):
        ob.jit.compile(SCALE, "scale", device="ascend:3", params=[], cache_dir=tmp_path)


def test_the_double_runtime_compiler_checks_its_inputs() -> None:
    import ctypes
    from pathlib import Path

    rtc = ctypes.CDLL(str(Path(str(ASCEND_LIB_DIR)) / "libacl_rtc.so"))
    P = ctypes.c_void_p
    prog = P()
    src = b"int x;"
    headers = (ctypes.c_char_p * 1)(b"h.h")
    assert rtc.aclrtcCreateProg(ctypes.byref(prog), src, b"p", 1, headers, headers) == 176001
    assert rtc.aclrtcCreateProg(ctypes.byref(prog), src, b"p", 0, None, None) == 0
    size = ctypes.c_size_t()
    assert rtc.aclrtcGetBinDataSize(prog, ctypes.byref(size)) == 176001  # not compiled yet
    no_arch = (ctypes.c_char_p * 1)(b"-O2")
    assert rtc.aclrtcCompileProg(prog, 1, no_arch) == 176002
    assert rtc.aclrtcGetCompileLogSize(prog, ctypes.byref(size)) == 0 and size.value > 1
    log = ctypes.create_string_buffer(size.value)
    assert rtc.aclrtcGetCompileLog(prog, log) == 0 and b"--npu-arch" in log.value
    ok = (ctypes.c_char_p * 1)(b"--npu-arch=dav-2201")
    assert rtc.aclrtcCompileProg(prog, 1, ok) == 0
    assert rtc.aclrtcGetBinDataSize(prog, ctypes.byref(size)) == 0 and size.value > 0
    assert rtc.aclrtcDestroyProg(ctypes.byref(prog)) == 0
    stale = P(12345)
    assert rtc.aclrtcDestroyProg(ctypes.byref(stale)) == 176000
