"""opbridge.Tensor: construction, properties, numpy/DLPack interop, async ops, awaitables."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

import opbridge as ob
from conftest import ADD_DTYPES, pool_allocated_bytes, random_array

# --- construction ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ADD_DTYPES)
def test_asarray_round_trip(rng: np.random.Generator, dtype) -> None:
    a = random_array(rng, (3, 5), dtype)
    t = ob.asarray(a)
    assert isinstance(t, ob.Tensor)
    assert t.shape == (3, 5)
    assert t.dtype == np.dtype(dtype)
    back = t.numpy()
    assert back.dtype == a.dtype
    np.testing.assert_array_equal(back, a)
    np.testing.assert_array_equal(np.asarray(t), a)


def test_asarray_copies_the_source(rng: np.random.Generator) -> None:
    a = random_array(rng, 1000, np.float32)
    want = a.copy()
    t = ob.asarray(a)
    assert not np.shares_memory(t.numpy(), a)
    a[:] = -1
    np.testing.assert_array_equal(t.numpy(), want)


def test_asarray_memory_is_pooled_and_aligned() -> None:
    t = ob.asarray(np.ones(1000, np.float32))
    assert t.data_ptr % 64 == 0
    assert ob.get_memory_pool_stats()["allocated_bytes.current"] >= t.nbytes


def test_asarray_of_strided_and_swapped_inputs(rng: np.random.Generator) -> None:
    a = random_array(rng, (20, 30), np.float64)
    for src in (a.T, a[::2, ::3], a.astype(a.dtype.newbyteorder())):
        t = ob.asarray(src)
        assert t.shape == src.shape
        np.testing.assert_array_equal(t.numpy(), src)


def test_asarray_with_dtype() -> None:
    t = ob.asarray(np.arange(4, dtype=np.int64), dtype=np.float32)
    assert t.dtype == np.float32
    np.testing.assert_array_equal(t.numpy(), np.arange(4, dtype=np.float32))
    assert ob.asarray([1, 2, 3], dtype="int32").dtype == np.int32


def test_asarray_of_list_and_scalar() -> None:
    t = ob.asarray([[1.0, 2.0], [3.0, 4.0]])
    assert t.shape == (2, 2)
    np.testing.assert_array_equal(t.numpy(), [[1.0, 2.0], [3.0, 4.0]])
    s = ob.asarray(np.float64(2.5))
    assert s.shape == () and s.ndim == 0 and s.size == 1
    assert s.numpy()[()] == 2.5


def test_asarray_of_tensor_is_identity() -> None:
    t = ob.asarray(np.ones(3, np.float32))
    assert ob.asarray(t) is t
    converted = ob.asarray(t, dtype=np.float64)
    assert converted is not t
    assert converted.dtype == np.float64
    np.testing.assert_array_equal(converted.numpy(), np.ones(3))


def test_asarray_unsupported_dtype() -> None:
    with pytest.raises(ob.DTypeError):
        ob.asarray(np.ones(3, dtype=bool))
    with pytest.raises(ob.DTypeError):
        ob.asarray(np.ones(3, dtype=np.complex128))


def test_asarray_unknown_device() -> None:
    with pytest.raises(ob.DeviceError):
        ob.asarray(np.ones(3), device="cuda:0")
    with pytest.raises(ob.DeviceError):
        ob.asarray(np.ones(3), device="nonsense")


@pytest.mark.parametrize("dtype", ADD_DTYPES)
def test_zeros(dtype) -> None:
    t = ob.zeros((4, 5), dtype=dtype)
    assert t.shape == (4, 5) and t.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(t.numpy(), np.zeros((4, 5), dtype))


def test_zeros_reuses_dirty_pool_memory() -> None:
    dirty = ob.asarray(np.full(1 << 16, 9.0, np.float32))
    del dirty
    gc.collect()
    np.testing.assert_array_equal(ob.zeros(1 << 16).numpy(), np.zeros(1 << 16, np.float32))


def test_empty() -> None:
    t = ob.empty((2, 3, 4), dtype=np.int32)
    assert t.shape == (2, 3, 4)
    assert t.dtype == np.int32
    assert t.numpy().shape == (2, 3, 4)


def test_shape_as_int_and_default_dtype() -> None:
    t = ob.empty(7)
    assert t.shape == (7,)
    assert t.dtype == np.float32
    assert ob.zeros(0).shape == (0,)


def test_empty_bad_arguments() -> None:
    with pytest.raises(ob.DTypeError):
        ob.empty(3, dtype=bool)
    with pytest.raises(ob.OpBridgeError):
        ob.empty((2, -1))
    with pytest.raises(ob.OpBridgeError):
        ob.zeros("abc")


# --- properties ------------------------------------------------------------------------------


def test_properties() -> None:
    t = ob.asarray(np.zeros((2, 3, 4), np.float64))
    assert t.shape == (2, 3, 4)
    assert t.dtype == np.float64
    assert t.device in ("cpu", "cpu:0")
    assert t.ndim == 3
    assert t.size == 24
    assert t.nbytes == 24 * 8
    assert t.strides == (96, 32, 8)
    assert len(t) == 2


def test_repr() -> None:
    r = repr(ob.zeros((2, 3), dtype=np.int64))
    assert r.startswith("Tensor(")
    assert "(2, 3)" in r and "int64" in r and "cpu" in r
    assert "(5,)" in repr(ob.empty(5))


def test_len_of_zero_dimensional_raises() -> None:
    with pytest.raises(TypeError):
        len(ob.asarray(np.float32(1)))


# --- numpy interop ---------------------------------------------------------------------------


def test_numpy_is_a_view_of_the_tensor() -> None:
    t = ob.asarray(np.arange(5, dtype=np.int32))
    v1, v2 = t.numpy(), t.numpy()
    assert np.shares_memory(v1, v2)
    v1[0] = 42
    assert t.numpy()[0] == 42


def test_numpy_view_keeps_tensor_alive() -> None:
    t = ob.asarray(np.arange(1 << 16, dtype=np.float64))
    view = t.numpy()
    del t
    gc.collect()
    np.testing.assert_array_equal(view, np.arange(1 << 16, dtype=np.float64))


def test_array_protocol() -> None:
    t = ob.asarray(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(t), np.arange(4, dtype=np.float32))
    converted = np.asarray(t, dtype=np.float64)
    assert converted.dtype == np.float64
    np.testing.assert_array_equal(converted, np.arange(4.0))
    copied = np.array(t, copy=True)
    assert not np.shares_memory(copied, t.numpy())
    np.testing.assert_array_equal(copied, np.arange(4, dtype=np.float32))


def test_tensor_memory_returns_to_pool() -> None:
    baseline = pool_allocated_bytes()
    t = ob.asarray(np.ones(1 << 18, np.float32))
    assert pool_allocated_bytes() >= baseline + t.nbytes
    del t
    assert pool_allocated_bytes() == baseline


# --- operators on tensors --------------------------------------------------------------------


def test_vector_add_on_tensors_returns_tensor(rng: np.random.Generator) -> None:
    a = random_array(rng, (100, 10), np.float32)
    b = random_array(rng, (100, 10), np.float32)
    r = ob.vector_add(ob.asarray(a), ob.asarray(b))
    assert isinstance(r, ob.Tensor)
    assert r.shape == (100, 10) and r.dtype == np.float32
    np.testing.assert_array_equal(r.numpy(), a + b)


@pytest.mark.parametrize("dtype", ADD_DTYPES)
def test_vector_add_on_tensors_bit_exact(rng: np.random.Generator, dtype) -> None:
    a = random_array(rng, 200_000, dtype)
    b = random_array(rng, 200_000, dtype)
    r = ob.vector_add(ob.asarray(a), ob.asarray(b)).numpy()
    np.testing.assert_array_equal(r.view(np.uint8), (a + b).view(np.uint8))


def test_vector_add_on_tensors_mixed_dtypes() -> None:
    r = ob.vector_add(ob.asarray(np.ones(3, np.int32)), ob.asarray(np.ones(3, np.float16)))
    assert r.dtype == (np.ones(3, np.int32) + np.ones(3, np.float16)).dtype
    np.testing.assert_array_equal(r.numpy(), np.full(3, 2.0))


def test_matmul_on_tensors_returns_tensor(rng: np.random.Generator) -> None:
    a = rng.standard_normal((30, 20))
    b = rng.standard_normal((20, 10))
    r = ob.matmul(ob.asarray(a), ob.asarray(b))
    assert isinstance(r, ob.Tensor)
    assert r.shape == (30, 10)
    np.testing.assert_allclose(r.numpy(), a @ b, rtol=1e-12, atol=1e-12)


def test_matmul_on_tensors_mixed_and_empty() -> None:
    r = ob.matmul(ob.asarray(np.ones((2, 3), np.float32)), ob.asarray(np.ones((3, 4))))
    assert r.dtype == np.float64
    np.testing.assert_array_equal(r.numpy(), np.full((2, 4), 3.0))
    dirty = ob.asarray(np.full((64, 64), 3.0))
    del dirty
    gc.collect()
    z = ob.matmul(ob.asarray(np.ones((64, 0))), ob.asarray(np.ones((0, 64))))
    np.testing.assert_array_equal(z.numpy(), np.zeros((64, 64)))


def test_matmul_tensor_errors() -> None:
    with pytest.raises(ob.ShapeError):
        ob.matmul(ob.asarray(np.ones(3)), ob.asarray(np.ones((3, 3))))
    with pytest.raises(ob.DTypeError):
        ob.matmul(ob.asarray(np.ones((2, 2), np.int32)), ob.asarray(np.ones((2, 2), np.int32)))


def test_vector_add_tensor_errors() -> None:
    with pytest.raises(ob.ShapeError) as info:
        ob.vector_add(ob.asarray(np.ones(3)), ob.asarray(np.ones(4)))
    assert "vector_add" in str(info.value)
    with pytest.raises(ob.DTypeError):
        ob.vector_add(ob.asarray(np.ones(3)), np.ones(3, bool))
    with pytest.raises(ob.ShapeError):
        ob.vector_add(ob.asarray(np.ones(3)), ob.asarray(np.ones(3)), out=ob.empty(4, dtype=np.float64))
    with pytest.raises(ob.DTypeError):
        ob.vector_add(ob.asarray(np.ones(3)), ob.asarray(np.ones(3)), out=ob.empty(3, dtype=np.float32))


def test_tensor_out_tensor() -> None:
    a = ob.asarray(np.arange(6, dtype=np.float32))
    out = ob.zeros(6)
    r = ob.vector_add(a, a, out=out)
    assert r is out
    np.testing.assert_array_equal(out.numpy(), 2 * np.arange(6, dtype=np.float32))


def test_tensor_out_is_input() -> None:
    a = ob.asarray(np.arange(6, dtype=np.int64))
    assert ob.vector_add(a, a, out=a) is a
    np.testing.assert_array_equal(a.numpy(), 2 * np.arange(6))


def test_matmul_tensor_out_is_input(rng: np.random.Generator) -> None:
    x = rng.standard_normal((16, 16))
    t = ob.asarray(x)
    assert ob.matmul(t, t, out=t) is t
    np.testing.assert_allclose(t.numpy(), x @ x, rtol=1e-12, atol=1e-12)


def test_mixing_numpy_and_tensor(rng: np.random.Generator) -> None:
    a = random_array(rng, 50, np.float64)
    b = random_array(rng, 50, np.float64)
    t = ob.asarray(a)
    r1 = ob.vector_add(t, b)
    r2 = ob.vector_add(b, t)
    assert isinstance(r1, ob.Tensor) and isinstance(r2, ob.Tensor)
    np.testing.assert_array_equal(r1.numpy(), a + b)
    np.testing.assert_array_equal(r2.numpy(), b + a)
    m = ob.matmul(ob.asarray(a.reshape(5, 10)), b.reshape(10, 5))
    assert isinstance(m, ob.Tensor)
    np.testing.assert_allclose(m.numpy(), a.reshape(5, 10) @ b.reshape(10, 5), rtol=1e-12)


def test_numpy_out_with_tensor_inputs_is_filled_on_return() -> None:
    t = ob.asarray(np.arange(1000, dtype=np.float32))
    out = np.empty(1000, np.float32)
    assert ob.vector_add(t, t, out=out) is out
    np.testing.assert_array_equal(out, 2 * np.arange(1000, dtype=np.float32))


def test_tensor_out_with_numpy_inputs() -> None:
    a = np.arange(10, dtype=np.float64)
    out = ob.empty(10, dtype=np.float64)
    assert ob.vector_add(a, a, out=out) is out
    np.testing.assert_array_equal(out.numpy(), 2 * a)


def test_read_only_tensor_out_is_rejected() -> None:
    ro = np.zeros(3)
    ro.flags.writeable = False
    t = ob.from_dlpack(ro)
    assert not t.numpy().flags.writeable
    with pytest.raises(ob.ArgumentError):
        ob.vector_add(t, t, out=t)
    np.testing.assert_array_equal(ro, np.zeros(3))


def test_strided_tensors_as_inputs() -> None:
    base = np.arange(40, dtype=np.float64)
    v = base[::2]
    r = ob.vector_add(ob.from_dlpack(v), ob.from_dlpack(v))
    np.testing.assert_array_equal(r.numpy(), 2 * v)
    m = np.arange(12, dtype=np.float32).reshape(3, 4)
    r = ob.vector_add(ob.from_dlpack(m.T), m.T)
    np.testing.assert_array_equal(r.numpy(), 2 * m.T)


def test_tensor_out_partially_overlapping_input() -> None:
    x = np.arange(10.0)
    a, b, out = x[:8], x[1:9], x[2:]
    want = a.copy() + b.copy()
    try:
        ob.vector_add(ob.from_dlpack(a), ob.from_dlpack(b), out=ob.from_dlpack(out))
    except ob.OpBridgeError:
        return
    ob.synchronize()
    np.testing.assert_array_equal(x[2:], want)


# --- DLPack ----------------------------------------------------------------------------------


def test_dlpack_device() -> None:
    assert ob.zeros(3).__dlpack_device__() == (1, 0)


@pytest.mark.parametrize("dtype", ADD_DTYPES)
def test_numpy_from_tensor_is_zero_copy(dtype) -> None:
    t = ob.asarray(np.arange(12, dtype=dtype).reshape(3, 4))
    a = np.from_dlpack(t)
    assert a.dtype == np.dtype(dtype)
    assert a.shape == (3, 4)
    assert np.shares_memory(a, t.numpy())
    np.testing.assert_array_equal(a, np.arange(12, dtype=dtype).reshape(3, 4))


@pytest.mark.parametrize("dtype", ADD_DTYPES)
def test_tensor_from_numpy_is_zero_copy(dtype) -> None:
    a = np.arange(12, dtype=dtype).reshape(4, 3)
    t = ob.from_dlpack(a)
    assert t.shape == (4, 3) and t.dtype == np.dtype(dtype)
    assert np.shares_memory(t.numpy(), a)
    a[0, 0] = 99
    assert t.numpy()[0, 0] == 99


def test_from_dlpack_keeps_producer_alive() -> None:
    t = ob.from_dlpack(np.arange(1000, dtype=np.int64))
    gc.collect()
    np.testing.assert_array_equal(t.numpy(), np.arange(1000))


def test_dlpack_export_keeps_tensor_alive() -> None:
    t = ob.asarray(np.arange(1 << 16, dtype=np.float32))
    a = np.from_dlpack(t)
    del t
    gc.collect()
    np.testing.assert_array_equal(a, np.arange(1 << 16, dtype=np.float32))


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(40, dtype=np.float64)[::3],
        lambda: np.arange(24, dtype=np.float32).reshape(4, 6).T,
        lambda: np.arange(60, dtype=np.int32).reshape(3, 4, 5)[:, 1:3, ::2],
        lambda: np.arange(24, dtype=np.float64).reshape(4, 6)[1:3],
    ],
    ids=["step", "transpose", "3d-slice", "offset-rows"],
)
def test_dlpack_of_strided_numpy_views(make) -> None:
    view = make()
    t = ob.from_dlpack(view)
    assert t.shape == view.shape
    back = t.numpy()
    assert np.shares_memory(back, view)
    np.testing.assert_array_equal(back, view)
    again = np.from_dlpack(t)
    assert np.shares_memory(again, view)
    np.testing.assert_array_equal(again, view)


def test_unaligned_numpy_with_tensors_is_rejected_or_correct() -> None:
    buf = bytearray(8 * 100 + 8)
    a = np.frombuffer(buf, dtype=np.float64, offset=4, count=100)
    a[:] = np.arange(100.0)
    assert not a.flags.aligned
    t = ob.asarray(a)  # a copy: always fine
    np.testing.assert_array_equal(t.numpy(), np.arange(100.0))
    try:
        r = ob.vector_add(t, a)
    except ob.OpBridgeError:
        pass
    else:
        np.testing.assert_array_equal(r.numpy(), 2 * np.arange(100.0))
    try:
        imported = ob.from_dlpack(a)
    except (ob.OpBridgeError, BufferError):
        return
    assert np.shares_memory(imported.numpy(), a)
    np.testing.assert_array_equal(ob.vector_add(imported, imported).numpy(), 2 * np.arange(100.0))


def test_from_dlpack_of_tensor_is_identity() -> None:
    t = ob.zeros(3)
    assert ob.from_dlpack(t) is t


def test_from_dlpack_rejects_non_producers() -> None:
    with pytest.raises(TypeError):
        ob.from_dlpack([1, 2, 3])


def test_from_dlpack_unsupported_dtype() -> None:
    with pytest.raises(ob.DTypeError):
        ob.from_dlpack(np.ones(3, dtype=np.uint8))


def test_dlpack_waits_for_pending_work() -> None:
    s = ob.Stream()
    t = ob.asarray(np.ones(1 << 16, np.float32))
    with s:
        r = t
        for _ in range(10):
            r = ob.vector_add(r, t)
    np.testing.assert_array_equal(np.from_dlpack(r), np.full(1 << 16, 11, np.float32))


# --- devices ---------------------------------------------------------------------------------


def test_to_same_device_is_identity() -> None:
    t = ob.zeros(3)
    assert t.to("cpu") is t
    assert t.to("cpu:0") is t


def test_to_missing_device_raises() -> None:
    t = ob.zeros(3)
    with pytest.raises(ob.DeviceError) as info:
        t.to("cuda:0")
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ob.DeviceError):
        t.to("nonsense")


# --- synchronization and awaitables ----------------------------------------------------------


def test_synchronize_and_is_ready() -> None:
    t = ob.asarray(np.ones(1 << 16, np.float32))
    r = ob.vector_add(t, t)
    r.synchronize()
    assert r.is_ready()
    np.testing.assert_array_equal(r.numpy(), np.full(1 << 16, 2, np.float32))


def test_await_tensor() -> None:
    t = ob.asarray(np.arange(1000, dtype=np.float64))

    async def main() -> np.ndarray:
        r = await ob.vector_add(t, t)
        assert isinstance(r, ob.Tensor)
        return r.numpy()

    np.testing.assert_array_equal(asyncio.run(main()), 2 * np.arange(1000.0))


def test_await_event() -> None:
    s = ob.Stream()
    done: list[int] = []

    async def main() -> None:
        s.launch_host_func(lambda: done.append(1))
        e = ob.Event()
        e.record(s)
        result = await e
        assert result is None
        assert e.query()

    asyncio.run(main())
    assert done == [1]


def test_await_slow_event_does_not_block_loop() -> None:
    import time

    s = ob.Stream()
    ticks: list[int] = []

    async def ticker() -> None:
        for i in range(5):
            ticks.append(i)
            await asyncio.sleep(0.005)

    async def main() -> None:
        s.launch_host_func(lambda: time.sleep(0.1))
        e = s.record_event()
        await asyncio.gather(e, ticker())
        assert e.query()

    asyncio.run(main())
    assert ticks == [0, 1, 2, 3, 4]


# numpy 2's __array__(dtype=None, copy=None) protocol, exactly.


def test_array_protocol_copy_false_never_copies():
    t = ob.asarray(np.arange(4, dtype=np.float32))
    view = np.asarray(t, copy=False)
    assert np.shares_memory(view, t.numpy())
    same = np.asarray(t, dtype=np.float32, copy=False)
    assert np.shares_memory(same, t.numpy())
    for other in (np.float64, np.int32, ">f4", np.float16):
        with pytest.raises(ValueError, match="copy"):
            np.asarray(t, dtype=other, copy=False)
        with pytest.raises(ValueError):
            t.__array__(dtype=np.dtype(other), copy=False)


def test_array_protocol_copy_true_always_copies():
    t = ob.asarray(np.arange(4, dtype=np.float32))
    for dtype in (None, np.float32, np.float64):
        a = np.array(t, dtype=dtype, copy=True)
        assert not np.shares_memory(a, t.numpy())
        assert a.dtype == (dtype or np.float32)
        a[0] = 42  # a private, writable copy
        assert t.numpy()[0] == 0
    direct = t.__array__(copy=True)
    assert not np.shares_memory(direct, t.numpy())


def test_array_protocol_copy_none_copies_only_to_convert():
    t = ob.asarray(np.arange(4, dtype=np.float32))
    assert np.shares_memory(np.asarray(t), t.numpy())
    assert np.shares_memory(np.asarray(t, dtype="<f4"), t.numpy())
    converted = np.asarray(t, dtype=np.float64)
    assert converted.dtype == np.float64 and not np.shares_memory(converted, t.numpy())
    np.testing.assert_array_equal(converted, np.arange(4))
    swapped = np.asarray(t, dtype=">f4")
    assert swapped.dtype == np.dtype(">f4")
    np.testing.assert_array_equal(swapped, np.arange(4))
