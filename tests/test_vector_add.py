"""vector_add on numpy arrays: the synchronous path (numpy in, numpy out)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import opbridge as ob
from conftest import ADD_DTYPES, pool_allocated_bytes, random_array


def assert_bit_exact(got: np.ndarray, want: np.ndarray) -> None:
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


# --- the seed's tests ------------------------------------------------------------------------


def test_basic() -> None:
    a = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    b = np.array([4.0, 5.0, 6.0], dtype=np.float32)
    c = ob.vector_add(a, b)
    np.testing.assert_array_equal(c, np.array([5.0, 7.0, 9.0], dtype=np.float32))
    assert c.dtype == np.float32


def test_one_million_float32_matches_numpy_bit_exact(rng: np.random.Generator) -> None:
    a = rng.random(1_000_000, dtype=np.float32)
    b = rng.random(1_000_000, dtype=np.float32)
    assert_bit_exact(ob.vector_add(a, b), a + b)


@pytest.mark.parametrize("dtype", ADD_DTYPES)
def test_empty_arrays(dtype) -> None:
    a = np.empty(0, dtype=dtype)
    c = ob.vector_add(a, a)
    assert c.shape == (0,)
    assert c.dtype == dtype


def test_single_element() -> None:
    c = ob.vector_add(np.array([1.5], np.float32), np.array([2.25], np.float32))
    assert c.shape == (1,)
    assert c[0] == np.float32(3.75)


@pytest.mark.parametrize("n", [255, 511, 1023])
def test_odd_sizes(rng: np.random.Generator, n: int) -> None:
    # Sizes that leave a tail after every SIMD width.
    a = rng.random(n, dtype=np.float32)
    b = rng.random(n, dtype=np.float32)
    assert_bit_exact(ob.vector_add(a, b), a + b)


# --- dtypes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ADD_DTYPES)
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 70_000, 300_000])
def test_every_dtype_bit_exact(rng: np.random.Generator, dtype, n: int) -> None:
    # 70K and 300K elements cross the GIL-release and the both-cores thresholds.
    a = random_array(rng, n, dtype)
    b = random_array(rng, n, dtype)
    assert_bit_exact(ob.vector_add(a, b), a + b)


def test_integer_overflow_wraps_like_numpy() -> None:
    a = np.array([np.iinfo(np.int32).max, np.iinfo(np.int32).min], dtype=np.int32)
    b = np.array([1, -1], dtype=np.int32)
    assert_bit_exact(ob.vector_add(a, b), a + b)


def test_float_special_values_like_numpy() -> None:
    with np.errstate(invalid="ignore", over="ignore"):
        for dtype in (np.float16, np.float32, np.float64):
            info = np.finfo(dtype)
            a = np.array([np.inf, -np.inf, np.inf, np.nan, info.max, -0.0, 0.0], dtype=dtype)
            b = np.array([1, -1, -np.inf, 1, info.max, -0.0, -0.0], dtype=dtype)
            got, want = ob.vector_add(a, b), a + b
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            finite = ~np.isnan(want)
            assert_bit_exact(got[finite], want[finite])


@pytest.mark.parametrize("da", ADD_DTYPES)
@pytest.mark.parametrize("db", ADD_DTYPES)
def test_mixed_dtypes_follow_numpy(rng: np.random.Generator, da, db) -> None:
    a = random_array(rng, 1000, da)
    b = random_array(rng, 1000, db)
    want = a + b
    got = ob.vector_add(a, b)
    assert got.dtype == want.dtype
    assert_bit_exact(got, want)


# --- shapes and layouts ----------------------------------------------------------------------


def test_zero_dimensional() -> None:
    a = np.array(1.5, dtype=np.float64)
    b = np.array(2.0, dtype=np.float64)
    c = ob.vector_add(a, b)
    assert isinstance(c, np.ndarray)
    assert c.shape == ()
    assert c == 3.5


@pytest.mark.parametrize("shape", [(3, 4), (17, 1, 5), (2, 3, 4), (0, 5), (400, 300)])
def test_any_ndim_with_equal_shapes(rng: np.random.Generator, shape) -> None:
    a = random_array(rng, shape, np.float32)
    b = random_array(rng, shape, np.float32)
    assert_bit_exact(ob.vector_add(a, b), a + b)


@pytest.mark.parametrize("dtype", ADD_DTYPES)
def test_strided_slices(rng: np.random.Generator, dtype) -> None:
    base_a = random_array(rng, 3000, dtype)
    base_b = random_array(rng, 3000, dtype)
    a, b = base_a[::3], base_b[1::3]
    assert not a.flags.c_contiguous
    assert_bit_exact(ob.vector_add(a, b), a + b)


def test_reversed_slices(rng: np.random.Generator) -> None:
    a = random_array(rng, 1001, np.float64)[::-1]
    b = random_array(rng, 1001, np.float64)
    assert_bit_exact(ob.vector_add(a, b), a + b)


@pytest.mark.parametrize("shape", [(64, 48), (300, 500)])
def test_transposed_inputs(rng: np.random.Generator, shape) -> None:
    a = random_array(rng, shape, np.float32).T
    b = random_array(rng, shape[::-1], np.float32)
    assert not a.flags.c_contiguous
    assert_bit_exact(ob.vector_add(a, b), a + b)
    assert_bit_exact(ob.vector_add(a, a), a + a)


def test_fortran_and_sliced_3d(rng: np.random.Generator) -> None:
    a = np.asfortranarray(random_array(rng, (6, 7, 8), np.float64))
    b = random_array(rng, (12, 7, 16), np.float64)[::2, :, ::2]
    assert_bit_exact(ob.vector_add(a, b), a + b)


@pytest.mark.parametrize("dtype", ADD_DTYPES)
def test_byte_swapped_inputs(rng: np.random.Generator, dtype) -> None:
    a = random_array(rng, 1000, dtype)
    b = random_array(rng, 1000, dtype)
    swapped_a = a.astype(a.dtype.newbyteorder())
    swapped_b = b.astype(b.dtype.newbyteorder())
    want = a + b
    assert_bit_exact(ob.vector_add(swapped_a, b), want)
    assert_bit_exact(ob.vector_add(swapped_a, swapped_b), want)
    # The inputs are left as they were.
    np.testing.assert_array_equal(swapped_a, a)


def test_read_only_inputs(rng: np.random.Generator) -> None:
    a = random_array(rng, 100_000, np.float32)
    b = random_array(rng, 100_000, np.float32)
    want = a + b
    a.flags.writeable = False
    b.flags.writeable = False
    assert_bit_exact(ob.vector_add(a, b), want)


def test_inputs_are_not_modified(rng: np.random.Generator) -> None:
    a = random_array(rng, 5000, np.int64)
    b = random_array(rng, 5000, np.int64)
    a0, b0 = a.copy(), b.copy()
    ob.vector_add(a, b)
    np.testing.assert_array_equal(a, a0)
    np.testing.assert_array_equal(b, b0)


def test_lists_as_inputs() -> None:
    c = ob.vector_add([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    np.testing.assert_array_equal(c, np.array([5.0, 7.0, 9.0]))
    assert c.dtype == (np.asarray([1.0]) + np.asarray([1.0])).dtype


def test_list_and_array_mixed() -> None:
    a = np.arange(4, dtype=np.int64)
    c = ob.vector_add(a, [10, 20, 30, 40])
    np.testing.assert_array_equal(c, np.array([10, 21, 32, 43]))
    assert c.dtype == np.int64


def unaligned(values: np.ndarray) -> np.ndarray:
    """A contiguous copy of `values` whose data sits one byte off element alignment."""
    buf = bytearray(values.nbytes + 8)
    a = np.frombuffer(buf, dtype=values.dtype, offset=1, count=values.size).reshape(values.shape)
    a[...] = values
    assert not a.flags.aligned and a.flags.c_contiguous
    return a


@pytest.mark.parametrize("dtype", ADD_DTYPES)
@pytest.mark.parametrize("n", [1000, 300_000])
def test_unaligned_inputs(rng: np.random.Generator, dtype, n: int) -> None:
    a = random_array(rng, n, dtype)
    b = random_array(rng, n, dtype)
    want = a + b
    assert_bit_exact(ob.vector_add(unaligned(a), b), want)
    assert_bit_exact(ob.vector_add(unaligned(a), unaligned(b)), want)


def test_unaligned_out_is_rejected_or_correct(rng: np.random.Generator) -> None:
    a = random_array(rng, 1000, np.float64)
    out = unaligned(np.zeros(1000))
    try:
        r = ob.vector_add(a, a, out=out)
    except ob.ArgumentError:
        np.testing.assert_array_equal(out, np.zeros(1000))
        return
    assert r is out
    assert_bit_exact(out, a + a)


@pytest.mark.parametrize("dtype", ADD_DTYPES)
def test_outputs_above_8_mib(rng: np.random.Generator, dtype) -> None:
    # Large outputs take the streaming-store kernel; an odd length leaves a scalar tail.
    n = (9 << 20) // np.dtype(dtype).itemsize + 3
    a = random_array(rng, n, dtype)
    b = random_array(rng, n, dtype)
    want = a + b
    assert_bit_exact(ob.vector_add(a, b), want)
    base = np.empty(n + 1, dtype)
    out = base[1:]  # contiguous, aligned to the element but not to 16 bytes
    assert ob.vector_add(a, b, out=out) is out
    assert_bit_exact(out, want)
    assert ob.vector_add(a, b, out=a) is a
    assert_bit_exact(a, want)


# --- out= ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ADD_DTYPES)
@pytest.mark.parametrize("n", [10, 100_000])
def test_out_is_written_and_returned(rng: np.random.Generator, dtype, n: int) -> None:
    a = random_array(rng, n, dtype)
    b = random_array(rng, n, dtype)
    out = np.empty(n, dtype=dtype)
    r = ob.vector_add(a, b, out=out)
    assert r is out
    assert_bit_exact(out, a + b)


def test_out_multidimensional(rng: np.random.Generator) -> None:
    a = random_array(rng, (30, 40), np.float64)
    b = random_array(rng, (30, 40), np.float64).T.copy().T  # Fortran-ordered input
    out = np.empty((30, 40))
    assert ob.vector_add(a, b, out=out) is out
    assert_bit_exact(out, a + b)


def test_out_does_not_allocate_from_pool(rng: np.random.Generator) -> None:
    a = random_array(rng, 1 << 20, np.float32)
    out = np.empty_like(a)
    ob.vector_add(a, a, out=out)
    before = ob.get_memory_pool_stats()["num_allocs"]
    for _ in range(5):
        assert ob.vector_add(a, a, out=out) is out
    assert ob.get_memory_pool_stats()["num_allocs"] == before


@pytest.mark.parametrize("dtype", ADD_DTYPES)
@pytest.mark.parametrize("n", [100, 200_000])
def test_out_is_a_in_place(rng: np.random.Generator, dtype, n: int) -> None:
    a = random_array(rng, n, dtype)
    b = random_array(rng, n, dtype)
    want = a + b
    assert ob.vector_add(a, b, out=a) is a
    assert_bit_exact(a, want)


@pytest.mark.parametrize("n", [100, 200_000])
def test_out_is_b_in_place(rng: np.random.Generator, n: int) -> None:
    a = random_array(rng, n, np.float32)
    b = random_array(rng, n, np.float32)
    want = a + b
    assert ob.vector_add(a, b, out=b) is b
    assert_bit_exact(b, want)


@pytest.mark.parametrize("n", [100, 200_000])
def test_out_is_both_inputs(rng: np.random.Generator, n: int) -> None:
    a = random_array(rng, n, np.float64)
    want = a + a
    assert ob.vector_add(a, a, out=a) is a
    assert_bit_exact(a, want)


def test_out_is_a_view_equal_to_input() -> None:
    base = np.arange(8, dtype=np.float32)
    a = base[2:6]
    out = base[2:6]  # a different array object over exactly the same bytes
    want = a + a
    assert ob.vector_add(a, a, out=out) is out
    np.testing.assert_array_equal(base[2:6], want)


@pytest.mark.parametrize("shift", [1, 3, -1, -5])
@pytest.mark.parametrize("n", [64, 100_000])
def test_out_partially_overlapping_input(rng: np.random.Generator, shift: int, n: int) -> None:
    base = random_array(rng, n + 10, np.float32)
    start = 5
    a = base[start : start + n]
    b = random_array(rng, n, np.float32)
    out = base[start + shift : start + shift + n]
    want = a.copy() + b
    try:
        r = ob.vector_add(a, b, out=out)
    except ob.OpBridgeError:
        return  # an error is an allowed answer for a partial overlap
    assert r is out
    assert_bit_exact(out, want)


def test_out_partially_overlapping_both_inputs(rng: np.random.Generator) -> None:
    base = random_array(rng, 1000, np.int64)
    a, b, out = base[0:900], base[50:950], base[100:1000]
    want = a.copy() + b.copy()
    try:
        r = ob.vector_add(a, b, out=out)
    except ob.OpBridgeError:
        return
    assert r is out
    assert_bit_exact(out, want)


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sa", "sb"),
    [((3,), (4,)), ((2, 3), (3, 2)), ((6,), (2, 3)), ((), (1,)), ((4, 1), (4,))],
)
def test_shape_mismatch(sa, sb) -> None:
    with pytest.raises(ob.ShapeError) as info:
        ob.vector_add(np.ones(sa, np.float32), np.ones(sb, np.float32))
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, ob.OpBridgeError)
    message = str(info.value)
    assert "vector_add" in message
    assert "expected" in message and "got" in message


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.ones(3, dtype=bool),
        lambda: np.array([1, "x", None], dtype=object),
        lambda: np.ones(3, dtype=np.complex64),
        lambda: np.array(["a", "b", "c"]),
        lambda: np.ones(3, dtype=np.uint8),
    ],
    ids=["bool", "object", "complex64", "str", "uint8"],
)
@pytest.mark.parametrize("position", ["a", "b", "both"])
def test_unsupported_dtypes(make, position: str) -> None:
    good = np.ones(3, dtype=np.float32)
    bad = make()
    a = bad if position in ("a", "both") else good
    b = bad if position in ("b", "both") else good
    with pytest.raises(ob.DTypeError) as info:
        ob.vector_add(a, b)
    assert isinstance(info.value, TypeError)
    message = str(info.value)
    assert "vector_add" in message
    assert "expected" in message and "got" in message
    assert str(bad.dtype) in message


def test_out_wrong_shape() -> None:
    a = np.ones(4, np.float32)
    with pytest.raises(ob.ShapeError) as info:
        ob.vector_add(a, a, out=np.empty(5, np.float32))
    message = str(info.value)
    assert "vector_add" in message and "out" in message
    assert "expected" in message and "got" in message


def test_out_wrong_ndim() -> None:
    a = np.ones((2, 3), np.float32)
    with pytest.raises(ob.ShapeError):
        ob.vector_add(a, a, out=np.empty(6, np.float32))


@pytest.mark.parametrize("out_dtype", [np.float64, np.float16, np.int32])
def test_out_wrong_dtype(out_dtype) -> None:
    a = np.ones(4, np.float32)
    with pytest.raises(ob.DTypeError) as info:
        ob.vector_add(a, a, out=np.empty(4, out_dtype))
    assert isinstance(info.value, TypeError)
    message = str(info.value)
    assert "vector_add" in message
    assert "float32" in message and np.dtype(out_dtype).name in message


def test_out_unsupported_dtype() -> None:
    a = np.ones(4, np.float32)
    with pytest.raises(ob.DTypeError):
        ob.vector_add(a, a, out=np.empty(4, bool))


def test_out_read_only_is_not_written() -> None:
    a = np.ones(4, np.float32)
    out = np.zeros(4, np.float32)
    out.flags.writeable = False
    with pytest.raises(ob.ArgumentError) as info:
        ob.vector_add(a, a, out=out)
    assert isinstance(info.value, ValueError)
    assert "vector_add" in str(info.value)
    np.testing.assert_array_equal(out, np.zeros(4, np.float32))


@pytest.mark.parametrize(
    "make_out",
    [lambda: np.empty(8, np.float32)[::2], lambda: np.empty((4, 3), np.float32).T],
    ids=["strided", "transposed"],
)
def test_out_not_contiguous(make_out) -> None:
    out = make_out()
    a = np.ones(out.shape, np.float32)
    with pytest.raises(ob.ArgumentError) as info:
        ob.vector_add(a, a, out=out)
    assert "vector_add" in str(info.value)


def test_out_byte_swapped_is_rejected() -> None:
    a = np.ones(4, np.float32)
    out = np.empty(4, np.dtype(np.float32).newbyteorder())
    with pytest.raises(ob.OpBridgeError):
        ob.vector_add(a, a, out=out)


@pytest.mark.parametrize("out", [[0.0, 0.0, 0.0], (0.0, 0.0, 0.0), 3.0, "out"], ids=["list", "tuple", "float", "str"])
def test_out_not_an_ndarray(out) -> None:
    a = np.ones(3)
    with pytest.raises(ob.OpBridgeError) as info:
        ob.vector_add(a, a, out=out)
    assert "vector_add" in str(info.value)


def test_errors_leave_out_untouched() -> None:
    out = np.full(3, 7.0)
    with pytest.raises(ob.ShapeError):
        ob.vector_add(np.ones(3), np.ones(4), out=out)
    np.testing.assert_array_equal(out, np.full(3, 7.0))


# --- outputs from the pool -------------------------------------------------------------------


def test_large_output_comes_from_pool(rng: np.random.Generator) -> None:
    n = 1 << 16  # 256 KiB of float32
    a = random_array(rng, n, np.float32)
    c = ob.vector_add(a, a)
    assert type(c.base).__name__ == "PooledMemory"
    assert c.base.nbytes >= c.nbytes
    assert c.ctypes.data % 64 == 0
    assert c.flags.writeable and c.flags.c_contiguous
    assert_bit_exact(c, a + a)


def test_small_output_is_plain_numpy() -> None:
    a = np.ones(16, np.float32)
    c = ob.vector_add(a, a)
    assert type(c.base).__name__ != "PooledMemory"
    np.testing.assert_array_equal(c, np.full(16, 2.0, np.float32))


def test_deleting_pooled_output_returns_bytes(rng: np.random.Generator) -> None:
    a = random_array(rng, 1 << 18, np.float64)
    baseline = pool_allocated_bytes()
    c = ob.vector_add(a, a)
    assert type(c.base).__name__ == "PooledMemory"
    assert ob.get_memory_pool_stats()["allocated_bytes.current"] >= baseline + c.nbytes
    view = c[10:20]  # a view keeps the block alive
    del c
    gc.collect()
    assert ob.get_memory_pool_stats()["allocated_bytes.current"] > baseline
    assert view[0] == 2 * a[10]
    del view
    assert pool_allocated_bytes() == baseline


def test_pooled_output_survives_its_inputs(rng: np.random.Generator) -> None:
    a = random_array(rng, 1 << 17, np.float32)
    b = random_array(rng, 1 << 17, np.float32)
    want = a + b
    c = ob.vector_add(a, b)
    del a, b
    gc.collect()
    assert_bit_exact(c, want)
