"""matmul on numpy arrays: 2-D float GEMM, checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest

import opbridge as ob
from conftest import FLOAT_DTYPES

SHAPES = [(1, 1, 1), (2, 3, 4), (7, 5, 3), (16, 16, 16), (33, 65, 17), (128, 64, 96), (300, 200, 150)]


def reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) @ b.astype(np.float64)


def assert_close(got: np.ndarray, a: np.ndarray, b: np.ndarray, dtype) -> None:
    """Compares against a float64 product, with an error bound scaled by sqrt(k) and by the
    magnitude of the terms (|a| @ |b|), so cancellation does not make the check flaky."""
    dtype = np.dtype(dtype)
    assert got.dtype == dtype
    want = reference(a, b)
    assert got.shape == want.shape
    k = a.shape[1]
    eps = {np.float16: 2e-3, np.float32: 1e-4, np.float64: 1e-12}[dtype.type]
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    tol = eps * np.sqrt(max(k, 1)) * (scale + 1e-30)
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= tol), f"max error {err.max()} over tolerance at k={k}, dtype={dtype}"


def operands(rng: np.random.Generator, m: int, k: int, n: int, dtype):
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    return a, b


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
def test_matches_numpy(rng: np.random.Generator, dtype, m: int, k: int, n: int) -> None:
    a, b = operands(rng, m, k, n, dtype)
    assert_close(ob.matmul(a, b), a, b, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matches_numpy_operator(rng: np.random.Generator, dtype) -> None:
    a, b = operands(rng, 64, 100, 48, dtype)
    np.testing.assert_allclose(ob.matmul(a, b), a @ b, rtol=1e-4 if dtype == np.float32 else 1e-12, atol=1e-4)


def test_one_by_one() -> None:
    c = ob.matmul(np.array([[3.0]], np.float32), np.array([[4.0]], np.float32))
    assert c.shape == (1, 1)
    assert c.dtype == np.float32
    assert c[0, 0] == 12.0


def test_identity(rng: np.random.Generator) -> None:
    a = rng.standard_normal((50, 50))
    np.testing.assert_array_equal(ob.matmul(np.eye(50), a), a)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_empty_inner_dimension_gives_zeros(dtype) -> None:
    # An out= full of garbage must still end up as zeros (an empty sum).
    out = np.full((3, 4), 7, dtype)
    c = ob.matmul(np.empty((3, 0), dtype), np.empty((0, 4), dtype))
    assert c.shape == (3, 4)
    assert c.dtype == dtype
    np.testing.assert_array_equal(c, np.zeros((3, 4), dtype))
    assert ob.matmul(np.empty((3, 0), dtype), np.empty((0, 4), dtype), out=out) is out
    np.testing.assert_array_equal(out, np.zeros((3, 4), dtype))


def test_empty_inner_dimension_large_output_is_zeroed() -> None:
    # Large enough to come from the pool, whose recycled blocks hold old data.
    dirty = ob.vector_add(np.full((256, 256), 5.0), np.full((256, 256), 5.0))
    del dirty
    c = ob.matmul(np.empty((256, 0)), np.empty((0, 256)))
    np.testing.assert_array_equal(c, np.zeros((256, 256)))


@pytest.mark.parametrize(
    ("sa", "sb", "want"), [((0, 5), (5, 3), (0, 3)), ((4, 5), (5, 0), (4, 0)), ((0, 0), (0, 0), (0, 0))]
)
def test_empty_outer_dimensions(sa, sb, want) -> None:
    c = ob.matmul(np.ones(sa, np.float32), np.ones(sb, np.float32))
    assert c.shape == want
    assert c.dtype == np.float32


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_transposed_inputs(rng: np.random.Generator, dtype) -> None:
    a0, b0 = operands(rng, 40, 30, 20, dtype)
    a, b = a0.T.copy().T, b0.T.copy().T  # Fortran order: the same values, transposed strides
    at, bt = a0.T, b0.T  # (30, 40) and (20, 30) views
    assert not at.flags.c_contiguous
    assert_close(ob.matmul(a, b), a0, b0, dtype)
    assert_close(ob.matmul(bt, at), bt, at, dtype)


def test_strided_slices(rng: np.random.Generator) -> None:
    big_a = rng.standard_normal((80, 90))
    big_b = rng.standard_normal((90, 70))
    a, b = big_a[::2, 1::3], big_b[::3, ::2]
    assert_close(ob.matmul(a, b), a, b, np.float64)


def test_negative_strides(rng: np.random.Generator) -> None:
    a = rng.standard_normal((20, 30))[::-1, ::-1]
    b = rng.standard_normal((30, 10))[::-1]
    assert_close(ob.matmul(a, b), a, b, np.float64)


def test_byte_swapped_inputs(rng: np.random.Generator) -> None:
    a, b = operands(rng, 20, 30, 10, np.float32)
    sa = a.astype(a.dtype.newbyteorder())
    assert_close(ob.matmul(sa, b), a, b, np.float32)


@pytest.mark.parametrize(
    ("da", "db", "want"),
    [
        (np.float32, np.float64, np.float64),
        (np.float64, np.float32, np.float64),
        (np.float16, np.float32, np.float32),
        (np.float16, np.float64, np.float64),
    ],
)
def test_mixed_dtypes_promote(rng: np.random.Generator, da, db, want) -> None:
    a = rng.standard_normal((12, 9)).astype(da)
    b = rng.standard_normal((9, 7)).astype(db)
    assert (a @ b).dtype == want
    assert_close(ob.matmul(a, b), a, b, want)


def test_non_square_large(rng: np.random.Generator) -> None:
    a, b = operands(rng, 257, 513, 129, np.float32)
    assert_close(ob.matmul(a, b), a, b, np.float32)


def test_unaligned_inputs(rng: np.random.Generator) -> None:
    a, b = operands(rng, 20, 30, 10, np.float64)
    buf = bytearray(a.nbytes + 8)
    ua = np.frombuffer(buf, dtype=np.float64, offset=4, count=a.size).reshape(a.shape)
    ua[...] = a
    assert not ua.flags.aligned
    assert_close(ob.matmul(ua, b), a, b, np.float64)


def test_lists_as_inputs() -> None:
    c = ob.matmul([[1.0, 2.0], [3.0, 4.0]], [[5.0], [6.0]])
    np.testing.assert_array_equal(c, np.array([[17.0], [39.0]]))


def test_read_only_inputs(rng: np.random.Generator) -> None:
    a, b = operands(rng, 10, 10, 10, np.float64)
    a.flags.writeable = False
    b.flags.writeable = False
    assert_close(ob.matmul(a, b), a, b, np.float64)


# --- out= ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_out(rng: np.random.Generator, dtype) -> None:
    a, b = operands(rng, 30, 20, 10, dtype)
    out = np.full((30, 10), np.nan, dtype)
    assert ob.matmul(a, b, out=out) is out
    assert_close(out, a, b, dtype)


def test_out_large(rng: np.random.Generator) -> None:
    a, b = operands(rng, 256, 256, 256, np.float32)
    out = np.empty((256, 256), np.float32)
    assert ob.matmul(a, b, out=out) is out
    assert_close(out, a, b, np.float32)


@pytest.mark.parametrize("which", ["a", "b", "both"])
def test_out_is_an_input(rng: np.random.Generator, which: str) -> None:
    a, b = operands(rng, 24, 24, 24, np.float64)
    a0, b0 = a.copy(), b.copy()
    if which == "both":
        out = a
        r = ob.matmul(a, a, out=a)
        want_a, want_b = a0, a0
    else:
        out = a if which == "a" else b
        r = ob.matmul(a, b, out=out)
        want_a, want_b = a0, b0
    assert r is out
    assert_close(out, want_a, want_b, np.float64)


def test_out_overlaps_transposed_input(rng: np.random.Generator) -> None:
    a = rng.standard_normal((16, 16))
    a0 = a.copy()
    r = ob.matmul(a.T, a, out=a)
    assert r is a
    assert_close(a, a0.T, a0, np.float64)


def test_out_partially_overlapping_input(rng: np.random.Generator) -> None:
    base = rng.standard_normal(200)
    a = base[:100].reshape(10, 10)
    b = rng.standard_normal((10, 10))
    out = base[50:150].reshape(10, 10)
    a0 = a.copy()
    try:
        r = ob.matmul(a, b, out=out)
    except ob.OpBridgeError:
        return
    assert r is out
    assert_close(out, a0, b, np.float64)


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sa", "sb"), [((3,), (3, 3)), ((3, 3), (3,)), ((2, 2, 2), (2, 2)), ((2, 2), (1, 2, 2)), ((), ())]
)
def test_not_two_dimensional(sa, sb) -> None:
    with pytest.raises(ob.ShapeError) as info:
        ob.matmul(np.ones(sa, np.float32), np.ones(sb, np.float32))
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "matmul" in message and "expected" in message and "got" in message


@pytest.mark.parametrize(("sa", "sb"), [((2, 3), (4, 2)), ((5, 1), (2, 5)), ((3, 0), (1, 3))])
def test_inner_dimension_mismatch(sa, sb) -> None:
    with pytest.raises(ob.ShapeError) as info:
        ob.matmul(np.ones(sa), np.ones(sb))
    message = str(info.value)
    assert "matmul" in message and "expected" in message and "got" in message


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64, np.uint8])
def test_unsupported_dtypes(dtype) -> None:
    bad = np.ones((2, 2), dtype)
    good = np.ones((2, 2), np.float32)
    for a, b in ((bad, good), (good, bad), (bad, bad)):
        with pytest.raises(ob.DTypeError) as info:
            ob.matmul(a, b)
        assert isinstance(info.value, TypeError)
        message = str(info.value)
        assert "matmul" in message and np.dtype(dtype).name in message


def test_out_wrong_shape() -> None:
    with pytest.raises(ob.ShapeError) as info:
        ob.matmul(np.ones((2, 3)), np.ones((3, 4)), out=np.empty((4, 2)))
    assert "matmul" in str(info.value)


def test_out_wrong_dtype() -> None:
    with pytest.raises(ob.DTypeError) as info:
        ob.matmul(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32), out=np.empty((2, 4)))
    message = str(info.value)
    assert "matmul" in message and "float32" in message and "float64" in message


def test_out_read_only() -> None:
    out = np.zeros((2, 2))
    out.flags.writeable = False
    with pytest.raises(ob.ArgumentError):
        ob.matmul(np.ones((2, 2)), np.ones((2, 2)), out=out)
    np.testing.assert_array_equal(out, np.zeros((2, 2)))


def test_out_not_contiguous() -> None:
    with pytest.raises(ob.ArgumentError):
        ob.matmul(np.ones((2, 2)), np.ones((2, 2)), out=np.empty((2, 2)).T)


def test_out_not_an_ndarray() -> None:
    with pytest.raises(ob.OpBridgeError):
        ob.matmul(np.ones((2, 2)), np.ones((2, 2)), out=[[0.0, 0.0], [0.0, 0.0]])
