"""How operator arguments are taken: Python scalars (numpy's promotion rules), out= that cannot
be written in place, ndarray subclasses, and broadcast views (no copy of their logical size)."""

import time
import tracemalloc
import warnings

import numpy as np
import pytest

import opbridge as ob

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "pow": np.power,
}
SCALARS = [3, -2, 1.5, 2.0, True, False]


def numpy_or_error(fn, *args):
    try:
        with np.errstate(all="ignore"):
            return fn(*args)
    except (ValueError, TypeError, OverflowError) as error:
        return error


# --- Python scalars: numpy's rules (numpy 2: NEP 50 weak scalars) --------------------------


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scalar", SCALARS, ids=repr)
@pytest.mark.parametrize("scalar_first", [False, True])
def test_python_scalars_promote_as_installed_numpy(name, dtype, scalar, scalar_first):
    a = np.array([1, 2, 3], dtype)
    args = (scalar, a) if scalar_first else (a, scalar)
    expected = numpy_or_error(BINARY[name], *args)
    if isinstance(expected, Exception):
        with pytest.raises(ob.OpBridgeError):
            getattr(ob.ops, name)(*args)
        return
    got = getattr(ob.ops, name)(*args)
    assert got.dtype == expected.dtype, (name, dtype, scalar)
    tol = 2e-3 if got.dtype == np.float16 else 1e-6
    np.testing.assert_allclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol)


@pytest.mark.parametrize("name", ["add", "mul", "sub", "maximum"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scalar", [3, 1.5, True], ids=repr)
def test_python_scalars_beside_tensors_promote_as_numpy(name, dtype, scalar):
    a = np.array([1, 2, 3], dtype)
    got = getattr(ob.ops, name)(ob.asarray(a), scalar)
    assert isinstance(got, ob.Tensor)
    expected = BINARY[name](a, scalar)
    assert got.dtype == expected.dtype
    np.testing.assert_allclose(got.numpy().astype(np.float64), expected.astype(np.float64), rtol=2e-3)


def test_issue_examples_keep_the_array_dtype():
    assert ob.ops.add(np.ones(3, np.float32), 1.5).dtype == np.float32
    assert ob.ops.mul(np.ones(3, np.int32), 3).dtype == np.int32
    assert ob.ops.sub(np.ones(3, np.float16), 2.0).dtype == np.float16
    assert ob.ops.maximum(np.ones(3, np.float32), 0).dtype == np.float32


@pytest.mark.parametrize(
    "strong", [np.float64(1.5), np.int64(3), np.float32(2.5), np.array(1.5)], ids=lambda x: type(x).__name__
)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int32])
def test_numpy_scalars_and_0d_arrays_are_strong_as_in_numpy(strong, dtype):
    a = np.ones(3, dtype)
    assert ob.ops.add(a, strong).dtype == np.add(a, strong).dtype


def test_int_subclass_promotes_as_numpy_says():
    class Int(int):
        pass

    a = np.ones(3, np.int32)
    assert ob.ops.add(a, Int(3)).dtype == np.add(a, Int(3)).dtype


@pytest.mark.parametrize(
    "dtype,value", [(np.int32, 2**40), (np.int32, -(2**31) - 1), (np.int64, 2**70), (np.int64, -(2**64))]
)
def test_python_int_too_large_for_the_array_dtype_is_an_argument_error(dtype, value):
    a = np.ones(3, dtype)
    with pytest.raises(OverflowError):
        np.add(a, value)
    for call in (lambda: ob.ops.add(a, value), lambda: ob.ops.mul(value, a), lambda: ob.ops.add(ob.asarray(a), value)):
        with pytest.raises(ob.ArgumentError, match="does not fit"):
            call()


@pytest.mark.parametrize("dtype,value", [(np.int32, 2**40), (np.int32, -(2**31) - 1), (np.int64, 2**70)])
def test_true_division_by_a_python_int_too_large_for_the_array_dtype_follows_numpy(dtype, value):
    # True division computes integers as float64, which holds the number: numpy gives float64.
    a = np.arange(1, 4, dtype=dtype)
    for got, expected in [
        (ob.ops.div(a, value), np.divide(a, value)),
        (ob.ops.div(value, a), np.divide(value, a)),
        (ob.ops.div(ob.asarray(a), value).numpy(), np.divide(a, value)),
    ]:
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)


def test_both_operands_python_scalars():
    for x, y in [(1, 2), (1, 2.5), (2.5, True), (-3, 4)]:
        got = ob.ops.add(x, y)
        expected = np.add(x, y)
        assert got.dtype == expected.dtype and got.shape == () and got == expected
    with pytest.raises(ob.DTypeError):
        ob.ops.add(True, False)  # bool: not a supported dtype
    with pytest.raises(ob.DTypeError):
        ob.ops.add(np.ones(2, np.float32), 1j)  # complex


def test_vector_add_scalars_use_numpy_dtype_and_keep_its_shape_rule():
    zero_d = np.array(2.0, np.float32)
    got = ob.vector_add(zero_d, 1.5)
    assert got.dtype == np.float32 and got == 3.5
    assert ob.vector_add(np.array(2, np.int32), 3).dtype == np.int32
    with pytest.raises(ob.ShapeError):
        ob.vector_add(np.ones(3, np.float32), 1.5)  # documented: same shapes


def test_axpy_alpha_stays_an_attribute():
    x = np.ones(3, np.float32)
    got = ob.ops.axpy(x, x, alpha=2.5)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, 3.5)


# --- out= that cannot be written in place ------------------------------------------------


def _as_matrix(a):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.asmatrix(a)


def _readonly():
    a = np.zeros(3, np.float32)
    a.flags.writeable = False
    return a


class ArrayLike:
    def __array__(self, dtype=None, copy=None):
        return np.zeros(3, np.float32)


BAD_OUTS = {
    "list": (lambda: [0.0, 0.0, 0.0], ob.ArgumentError),
    "list-of-array": (lambda: [np.zeros(3, np.float32)], ob.ArgumentError),
    "tuple-too-long": (lambda: (np.zeros(3, np.float32), np.zeros(3, np.float32)), ob.ArgumentError),
    "scalar": (lambda: 0.0, ob.ArgumentError),
    "int": (lambda: 5, ob.ArgumentError),
    "array-like": (ArrayLike, ob.ArgumentError),
    "read-only": (_readonly, ob.ArgumentError),
    "non-contiguous": (lambda: np.zeros(6, np.float32)[::2], ob.ArgumentError),
    "byte-swapped": (lambda: np.zeros(3, ">f4"), ob.ArgumentError),
    "wrong-dtype": (lambda: np.zeros(3, np.float64), ob.DTypeError),
    "wrong-shape": (lambda: np.zeros(4, np.float32), ob.ShapeError),
    "masked": (lambda: np.ma.zeros(3, np.float32), ob.ArgumentError),
    "matrix": (lambda: _as_matrix(np.zeros((1, 3), np.float32)), ob.ArgumentError),
}


def _calls():
    a = np.arange(3, dtype=np.float32)
    return {
        "ops-numpy": lambda out: ob.ops.add(a, a, out=out),
        "ops-tensor": lambda out: ob.ops.add(ob.asarray(a), ob.asarray(a), out=out),
        "ops-mixed": lambda out: ob.ops.add(a, ob.asarray(a), out=out),
        "vector_add-lane": lambda out: ob.vector_add(a, a, out=out),
        "vector_add-tensor": lambda out: ob.vector_add(ob.asarray(a), a, out=out),
        "ops-unary-tensor": lambda out: ob.ops.neg(ob.asarray(a), out=out),
    }


@pytest.mark.parametrize("bad", sorted(BAD_OUTS))
@pytest.mark.parametrize("path", sorted(_calls()))
def test_out_that_cannot_be_written_in_place_is_an_error_on_every_path(bad, path):
    make, error = BAD_OUTS[bad]
    out = make()
    with pytest.raises(error):
        _calls()[path](out)


@pytest.mark.parametrize("bad", ["list", "scalar", "read-only", "non-contiguous", "wrong-dtype", "masked"])
@pytest.mark.parametrize("on_tensors", [False, True])
def test_matmul_out_that_cannot_be_written_in_place_is_an_error(bad, on_tensors):
    make, error = BAD_OUTS[bad]
    x = np.eye(3, dtype=np.float32)[:1]  # (1, 3) @ (3, 3) -> (1, 3)
    y = np.eye(3, dtype=np.float32)
    out = make()
    if isinstance(out, np.ndarray) and not isinstance(out, np.ma.MaskedArray) and out.ndim == 1:
        out = out.reshape(1, -1) if out.flags.c_contiguous else np.zeros((1, 6), out.dtype)[:, ::2]
    if bad == "masked":
        out = np.ma.zeros((1, 3), np.float32)
    args = (ob.asarray(x), ob.asarray(y)) if on_tensors else (x, y)
    with pytest.raises(error):
        ob.matmul(*args, out=out)


def test_read_only_tensor_out_is_an_argument_error():
    src = np.zeros(3, np.float32)
    src.flags.writeable = False
    ro = ob.from_dlpack(src)
    a = ob.asarray(np.ones(3, np.float32))
    with pytest.raises(ob.ArgumentError, match="read-only"):
        ob.ops.add(a, a, out=ro)
    with pytest.raises(ob.ArgumentError, match="read-only"):
        ob.ops.add(np.ones(3, np.float32), np.ones(3, np.float32), out=ro)


def test_numpy_out_on_the_tensor_path_is_filled_in_place():
    a = np.arange(3, dtype=np.float32)
    out = np.zeros(3, np.float32)
    assert ob.ops.add(ob.asarray(a), a, out=out) is out
    np.testing.assert_array_equal(out, 2 * a)
    pair = (np.zeros(3, np.float32),)
    ob.ops.add(ob.asarray(a), a, out=pair)
    np.testing.assert_array_equal(pair[0], 2 * a)


# --- ndarray subclasses ------------------------------------------------------------------


def _masked():
    return np.ma.masked_array(np.array([1.0, 2.0, 3.0], np.float32), mask=[False, True, False])


def _matrix():
    return _as_matrix(np.ones((2, 2), np.float32))


class WithUfunc(np.ndarray):
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return NotImplemented


class Plain(np.ndarray):
    pass


@pytest.mark.parametrize("make", [_masked, _matrix, lambda: np.ones(3, np.float32).view(WithUfunc)])
def test_subclasses_with_their_own_semantics_are_refused_naming_the_type(make):
    x = make()
    name = type(x).__name__
    plain = np.asarray(x)
    calls = [
        lambda: ob.ops.add(x, plain),
        lambda: ob.ops.add(plain, x),
        lambda: ob.vector_add(x, x),  # lane-shaped
        lambda: ob.vector_add(x, plain),
        lambda: ob.ops.neg(x),
        lambda: ob.ops.add(x, ob.asarray(plain)),  # tensor path
        lambda: ob.asarray(x),
        lambda: ob.ops.add(x, 1.5),
    ]
    if plain.ndim == 2:
        calls.append(lambda: ob.matmul(x, plain))
    for call in calls:
        with pytest.raises(ob.ArgumentError, match=name):
            call()


def test_masked_array_is_never_computed_under_its_mask():
    x = _masked()
    with pytest.raises(ob.ArgumentError, match="filled"):
        ob.ops.sum(x)
    # The documented escape hatches work.
    assert ob.ops.sum(x.filled(0)) == 4.0
    assert ob.ops.sum(np.asarray(x)) == 6.0


def test_memmap_and_hookless_subclasses_are_plain_memory(tmp_path):
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(4,))
    mm[:] = [1, 2, 3, 4]
    np.testing.assert_array_equal(ob.vector_add(mm, mm), [2, 4, 6, 8])
    np.testing.assert_array_equal(ob.ops.add(mm, 1.0), [2, 3, 4, 5])
    np.testing.assert_array_equal(ob.ops.add(ob.asarray(mm), mm).numpy(), [2, 4, 6, 8])
    out = np.memmap(tmp_path / "o.bin", dtype=np.float32, mode="w+", shape=(4,))
    assert ob.ops.add(mm, mm, out=out) is out
    np.testing.assert_array_equal(out, [2, 4, 6, 8])
    p = np.arange(4, dtype=np.float32).view(Plain)
    got = ob.vector_add(p, p)
    assert type(got) is np.ndarray  # results are plain ndarrays (documented)
    np.testing.assert_array_equal(got, [0, 2, 4, 6])


# --- broadcast views: no copy of the logical size ------------------------------------------


HUGE = 1 << 34  # 64 GiB of float32 if expanded


def _fast(fn, error):
    start = time.perf_counter()
    with pytest.raises(error):
        fn()
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, elapsed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_broadcast_with_wrong_shape_fails_fast(dtype):
    huge = np.broadcast_to(np.ones(1, np.float32), (HUGE,))
    other = np.ones(3, dtype)
    _fast(lambda: ob.ops.add(huge, other), ob.ShapeError)
    _fast(lambda: ob.ops.add(huge, ob.asarray(other)), ob.ShapeError)
    _fast(lambda: ob.ops.add(ob.asarray(other), huge), ob.ShapeError)
    _fast(lambda: ob.vector_add(huge, ob.asarray(other)), ob.ShapeError)
    _fast(lambda: ob.ops.add(huge, 1.5, out=ob.empty(3)), ob.ShapeError)


def test_huge_broadcast_with_too_large_output_fails_fast(memory_limit):
    memory_limit(1 << 30)
    huge = np.broadcast_to(np.ones(1, np.float32), (HUGE,))
    one_f32 = np.ones(1, np.float32)
    _fast(lambda: ob.ops.add(huge, one_f32), ob.OutOfMemoryError)
    _fast(lambda: ob.ops.add(huge, np.ones(1, np.int32)), ob.OutOfMemoryError)  # needs a conversion
    _fast(lambda: ob.ops.add(huge, ob.asarray(one_f32)), ob.OutOfMemoryError)
    _fast(lambda: ob.ops.add(huge, ob.asarray(np.ones(1, np.float64))), ob.OutOfMemoryError)


def _traced_peak(fn):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_broadcast_views_are_read_without_a_full_copy():
    row = np.arange(1024, dtype=np.float32)
    wide = np.broadcast_to(row, (1 << 16, 1024))  # 256 MiB logical, 4 KiB real
    expected = row.astype(np.float64) * (1 << 16)
    # numpy path, read in place; and with a dtype conversion (only the unique elements).
    got, peak = _traced_peak(lambda: ob.ops.sum(wide, axis=0))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert peak < 4 << 20, peak
    narrow = np.broadcast_to(row, (2048, 1024))  # 8 MiB logical f32; 16 MiB as float64
    got, peak = _traced_peak(lambda: ob.ops.maximum(narrow, np.zeros(1024, np.float64)))
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got[-1], row)
    assert peak < 4 << 20, peak
    # Tensor path: the snapshot copies the unique elements and keeps the zero stride.
    out = ob.empty(1024)
    got, peak = _traced_peak(lambda: ob.ops.sum(wide, axis=0, out=out).numpy())
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert peak < 4 << 20, peak
    got, peak = _traced_peak(lambda: ob.ops.maximum(narrow, ob.asarray(np.zeros(1024, np.float64))).numpy())
    np.testing.assert_array_equal(got[-1], row)
    assert peak < 4 << 20, peak


def test_zero_stride_tensor_converted_without_materializing():
    row = np.arange(1024, dtype=np.float32)
    t = ob.from_dlpack(np.broadcast_to(row, (4096, 1024)))  # 16 MiB logical as float32
    assert t.strides[0] == 0
    zeros = ob.asarray(np.zeros(1024, np.float64))
    # Warm the pool with a block of the output's size: the peak then counts what the call adds.
    warm = ob.empty((4096, 1024), np.float64)
    del warm
    ob.synchronize()
    ob.reset_peak_memory_stats()
    before = ob.get_memory_pool_stats()["allocated_bytes.current"]
    r = ob.ops.maximum(t, zeros)  # float64: the broadcast input is converted
    ob.synchronize()
    assert r.dtype == np.float64
    np.testing.assert_array_equal(r.numpy()[-1], row)
    growth = ob.get_memory_pool_stats()["allocated_bytes.peak"] - before
    output = 4096 * 1024 * 8  # 32 MiB; a materialized conversion would add another 32 MiB
    assert growth < output + (1 << 20), growth


def test_asarray_of_a_huge_broadcast_view_fails_before_copying(memory_limit):
    memory_limit(1 << 30)
    huge = np.broadcast_to(np.ones(1, np.float32), (HUGE,))
    _fast(lambda: ob.asarray(huge), ob.OutOfMemoryError)
    _fast(lambda: ob.asarray(huge, dtype=np.float64), ob.OutOfMemoryError)
    _fast(lambda: ob.asarray(huge[::2]), ob.OutOfMemoryError)


@pytest.mark.parametrize("dtype", [None, np.float64, np.int32])
def test_asarray_converts_odd_layouts_in_one_pass(dtype):
    row = np.arange(1024, dtype=np.float32)
    wide = np.broadcast_to(row, (1024, 1024))  # 4 MiB logical as float32, 4 KiB real
    got, peak = _traced_peak(lambda: ob.asarray(wide, dtype=dtype))
    # numpy allocates nothing of the logical size: the pool holds the one copy.
    assert peak < 1 << 20, peak
    expected = wide.astype(dtype or np.float32)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got.numpy(), expected)
    swapped = np.arange(24, dtype=">f8").reshape(4, 6)[:, ::-2]
    np.testing.assert_array_equal(ob.asarray(swapped, dtype=dtype).numpy(), swapped.astype(dtype or np.float64))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float16])
def test_kernels_copying_a_huge_broadcast_operand_fail_with_a_typed_error(dtype):
    # Integer matmul packs b and float16 matmul widens its operands: a broadcast operand's
    # logical size. Beyond memory: OutOfMemoryError at once, never an aborted process.
    k = 1 << 40
    a = np.broadcast_to(np.ones((1, 1), dtype), (1, k))
    b = np.broadcast_to(np.ones((1, 1), dtype), (k, 1))
    _fast(lambda: ob.ops.matmul(a, b), ob.OutOfMemoryError)


def test_embedding_bag_with_huge_broadcast_indices_fails_with_a_typed_error():
    weight = np.ones((4, 8), np.float32)
    indices = np.broadcast_to(np.int64(1), (1 << 40,))
    _fast(lambda: ob.ops.embedding_bag(weight, indices, np.array([0])), ob.OutOfMemoryError)
    offsets = np.broadcast_to(np.int64(0), (1 << 40,))
    _fast(lambda: ob.ops.embedding_bag(np.ones((4, 0), np.float32), np.array([1]), offsets), ob.OutOfMemoryError)


@pytest.mark.parametrize("value", [[2**31], [2**40, 5], 2**32 + 7, [-(2**31) - 1]])
def test_asarray_refuses_python_ints_that_do_not_fit_the_dtype(value):
    with pytest.raises(ob.ArgumentError, match="int32"):
        ob.asarray(value, dtype=np.int32)


def test_asarray_converts_what_numpy_converts_given_a_dtype():
    np.testing.assert_array_equal(ob.asarray(np.array([1, 2], dtype=object), dtype=np.float64).numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(ob.asarray([True, False], dtype=np.int32).numpy(), [1, 0])
