"""Elementwise operators of ob.ops against numpy (float64 reference, stated tolerances)."""

import numpy as np
import pytest

import opbridge as ob

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
FLOATS = [np.float16, np.float32, np.float64]
# Relative tolerance per result dtype: one rounding of the result, plus transcendental error.
RTOL = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-13}

BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "pow": np.power,
}
UNARY = {
    "neg": np.negative,
    "abs": np.abs,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x.astype(np.float64))),
    "silu": lambda x: x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64))),
}

SHAPES = [((7,), (7,)), ((3, 1, 4), (1, 5, 1)), ((), (4,)), ((2, 3), (3,)), ((0, 3), (1, 3))]


def sample(rng, shape, dtype, positive=False):
    if np.issubdtype(dtype, np.integer):
        low = 1 if positive else -20
        return rng.integers(low, 20, size=shape).astype(dtype)
    x = rng.uniform(0.1 if positive else -3, 3, size=shape)
    return x.astype(dtype)


def check_close(got, want, dtype):
    want = np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape
    if np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want)
    else:
        rtol = RTOL.get(want.dtype.type, 1e-6)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", SHAPES)
def test_binary_matches_numpy_with_broadcasting(name, dtype, shapes, rng):
    a = sample(rng, shapes[0], dtype, positive=name == "pow")
    b = sample(rng, shapes[1], dtype, positive=name in ("pow", "div"))
    if name == "pow" and np.issubdtype(dtype, np.integer):
        b = b % 4
    if name == "pow" and dtype == np.float16:
        a, b = a / 2, b / 2  # keep float16 powers in range
    check_close(getattr(ob.ops, name)(a, b), BINARY[name](a, b), dtype)


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_on_strided_and_mixed_dtype_inputs(name, rng):
    a = sample(rng, (6, 8), np.float64, positive=True)[::2, ::-3]
    b = sample(rng, (8, 6), np.float32, positive=True).T[::2, 1::3]
    check_close(getattr(ob.ops, name)(a, b), BINARY[name](a, b), np.float64)


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("dtype", DTYPES)
def test_unary_matches_numpy(name, dtype, rng):
    x = sample(rng, (5, 7), dtype, positive=name in ("log", "sqrt"))
    got = getattr(ob.ops, name)(x)
    want = UNARY[name](x)
    if name in ("sigmoid", "silu"):
        want = want.astype(got.dtype)  # the reference is computed in float64
    check_close(got, want, dtype)


def test_nan_and_inf_behave_as_in_numpy():
    x = np.array([0.0, -1.0, np.inf, -np.inf, np.nan])
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(ob.ops.log(x), np.log(x))
        np.testing.assert_array_equal(ob.ops.sqrt(x), np.sqrt(x))
        np.testing.assert_array_equal(ob.ops.exp(x), np.exp(x))
    np.testing.assert_array_equal(ob.ops.maximum(x, np.zeros(5)), np.maximum(x, 0))
    np.testing.assert_array_equal(ob.ops.relu(x), np.maximum(x, 0))
    assert ob.ops.sigmoid(np.array([-1000.0, 1000.0])).tolist() == [0.0, 1.0]


def test_integer_overflow_wraps_like_numpy():
    big = np.array([np.iinfo(np.int32).max], np.int32)
    np.testing.assert_array_equal(ob.ops.add(big, big), big + big)
    np.testing.assert_array_equal(
        ob.ops.abs(np.array([np.iinfo(np.int32).min], np.int32)), np.abs(np.array([np.iinfo(np.int32).min], np.int32))
    )


def test_negative_integer_power_is_an_error():
    with pytest.raises(ob.ArgumentError, match="negative integer powers"):
        ob.ops.pow(np.arange(3), np.array([1, -1, 2]))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_forms(approximate):
    from math import erf, pi, sqrt, tanh

    x = np.linspace(-6, 6, 101)
    if approximate == "none":
        want = np.array([0.5 * v * (1 + erf(v / sqrt(2))) for v in x])
    else:
        want = np.array([0.5 * v * (1 + tanh(sqrt(2 / pi) * (v + 0.044715 * v**3))) for v in x])
    np.testing.assert_allclose(ob.ops.gelu(x, approximate=approximate), want, rtol=1e-12, atol=1e-15)
    with pytest.raises(ob.ArgumentError, match="approximate"):
        ob.ops.gelu(x, approximate="sigmoid")


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_cast_matches_astype(src, dst, rng):
    x = sample(rng, (4, 5), src)
    np.testing.assert_array_equal(ob.ops.cast(x, dtype=np.dtype(dst).name), x.astype(dst))
    with pytest.raises(ob.DTypeError):
        ob.ops.cast(x, dtype="complex64")


def test_contiguous_and_transpose_copies(rng):
    x = rng.random((3, 4, 5))
    np.testing.assert_array_equal(ob.ops.contiguous(x[:, ::2, ::-1]), np.ascontiguousarray(x[:, ::2, ::-1]))
    np.testing.assert_array_equal(ob.ops.transpose(x), np.transpose(x))
    np.testing.assert_array_equal(ob.ops.transpose(x, axes=[1, 0, 2]), np.transpose(x, (1, 0, 2)))
    assert ob.ops.transpose(x).flags.c_contiguous
    with pytest.raises(ob.ShapeError):
        ob.ops.transpose(x, axes=[0, 0, 1])


def test_out_in_place_and_overlap(rng):
    a = rng.random(10)
    b = rng.random(10)
    want = a * b
    assert ob.ops.mul(a, b, out=a) is a
    np.testing.assert_array_equal(a, want)
    # An output that overlaps an input without being it is computed aside, then copied.
    x = np.arange(10.0)
    want = x[:-1] + x[1:]
    ob.ops.add(x[:-1], x[1:], out=x[1:])
    np.testing.assert_array_equal(x[1:], want)


def test_errors_name_the_op_and_what_was_expected():
    with pytest.raises(ob.ShapeError, match="add: .*broadcast"):
        ob.ops.add(np.ones(3), np.ones(4))
    with pytest.raises(ob.DTypeError, match="exp: expected x of dtype"):
        ob.ops.exp(np.ones(3, np.uint8))
    with pytest.raises(ob.ShapeError, match="out of shape"):
        ob.ops.add(np.ones(3), np.ones(3), out=np.empty(4))
    with pytest.raises(ob.DTypeError, match="out of dtype"):
        ob.ops.add(np.ones(3), np.ones(3), out=np.empty(3, np.float32))


def test_tensor_path_matches_numpy_path(rng):
    a = rng.random((4, 1)).astype(np.float32)
    b = rng.random((1, 3)).astype(np.float32)
    ta, tb = ob.asarray(a), ob.asarray(b)
    r = ob.ops.sub(ta, tb)
    assert isinstance(r, ob.Tensor)
    np.testing.assert_array_equal(r.numpy(), a - b)
    np.testing.assert_array_equal(ob.ops.tanh(ta).numpy(), ob.ops.tanh(a))


def test_large_inputs_use_the_parallel_path_and_stay_exact(rng):
    n = 1 << 20
    a, b = rng.random(n).astype(np.float32), rng.random(n).astype(np.float32)
    np.testing.assert_array_equal(ob.ops.mul(a, b), a * b)
    np.testing.assert_allclose(ob.ops.exp(a), np.exp(a), rtol=2e-6)


# The fast lane (plain contiguous arrays of one dtype and shape) must give exactly what the
# generic path gives: a strided copy of the same values forces the generic path.
@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 33, 200_000])
def test_binary_fast_lane_equals_the_generic_path(name, dtype, n, rng):
    a = sample(rng, (n,), dtype, positive=name == "pow")
    b = sample(rng, (n,), dtype, positive=name in ("pow", "div"))
    if name == "pow":
        b = b % 4 if np.issubdtype(dtype, np.integer) else b / 2
    op = getattr(ob.ops, name)
    strided_a = np.repeat(a, 2)[::2]
    generic = op(strided_a, b)
    lane = op(a, b)
    np.testing.assert_array_equal(lane, generic)
    check_close(lane, BINARY[name](a, b), dtype)


@pytest.mark.parametrize("name", ["add", "sub", "maximum"])
def test_fast_lane_in_place_and_aliased_operands(name, rng):
    op, ref = getattr(ob.ops, name), BINARY[name]
    a = rng.random(1000).astype(np.float32)
    b = rng.random(1000).astype(np.float32)
    for args, out in [((a, b), "a"), ((a, b), "b"), ((a, a), "a"), ((a, b), "fresh")]:
        x, y = args[0].copy(), (args[1].copy() if args[1] is not args[0] else None)
        y = x if y is None else y
        want = ref(x, y)
        target = {"a": x, "b": y, "fresh": np.empty_like(x)}[out]
        assert op(x, y, out=target) is target
        np.testing.assert_array_equal(target, want)


def test_fast_lane_leaves_odd_calls_to_the_generic_path(rng):
    a = rng.random(64)
    b = rng.random(64)
    # Partial overlap of out and an input: computed aside, as on the generic path.
    x = np.arange(65.0)
    want = x[:-1] + x[1:]
    ob.ops.add(x[:-1], x[1:], out=x[1:])
    np.testing.assert_array_equal(x[1:], want)
    # A read-only out, an out of another dtype or shape: the generic path's typed errors.
    ro = np.empty(64)
    ro.flags.writeable = False
    with pytest.raises(ob.ArgumentError, match="read-only"):
        ob.ops.add(a, b, out=ro)
    with pytest.raises(ob.DTypeError, match="out of dtype"):
        ob.ops.add(a, b, out=np.empty(64, np.float32))
    with pytest.raises(ob.ShapeError, match="out of shape"):
        ob.ops.add(a, b, out=np.empty((8, 8)))
    # 0-d arrays, a Fortran-ordered out, byte-swapped inputs, mixed dtypes.
    np.testing.assert_array_equal(ob.ops.mul(np.float32(3) * np.ones((), np.float32), np.ones((), np.float32)), 3)
    f = np.empty((8, 8), order="F")
    with pytest.raises(ob.ArgumentError, match="C-contiguous"):
        ob.ops.add(a.reshape(8, 8), b.reshape(8, 8), out=f)
    np.testing.assert_array_equal(ob.ops.add(a.astype(">f8"), b), a + b)
    np.testing.assert_array_equal(ob.ops.add(a.astype(np.float32), b), a.astype(np.float32) + b)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shapes", SHAPES)
def test_axpy_matches_numpy(dtype, shapes, rng):
    x = sample(rng, shapes[0], dtype)
    y = sample(rng, shapes[1], dtype)
    want = (np.float64(-1.5) * x.astype(np.float64) + y.astype(np.float64)).astype(dtype)
    check_close(ob.ops.axpy(x, y, alpha=-1.5), want, dtype)
    check_close(ob.ops.axpy(x, y), (x.astype(np.float64) + y).astype(dtype), dtype)


def test_axpy_in_place_strided_and_errors(rng):
    x = rng.random((6, 8))
    y = rng.random((6, 8))
    want = 2 * x + y
    assert ob.ops.axpy(x, y, alpha=2, out=y) is y
    np.testing.assert_allclose(y, want, rtol=1e-15)
    np.testing.assert_allclose(
        ob.ops.axpy(x[::2, ::-3], x.T[1::3, ::2].T, alpha=0.5), 0.5 * x[::2, ::-3] + x.T[1::3, ::2].T
    )
    with pytest.raises(ob.DTypeError, match="axpy"):
        ob.ops.axpy(np.ones(3, np.int32), np.ones(3, np.int32))
    with pytest.raises(ob.ShapeError, match="axpy"):
        ob.ops.axpy(np.ones(3), np.ones(4))
    with pytest.raises(ob.ArgumentError, match="alpha"):
        ob.ops.axpy(np.ones(3), np.ones(3), alpha="two")


@pytest.mark.parametrize("name", sorted(UNARY) + ["gelu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 33, 200_000])
def test_unary_fast_lane_matches_the_generic_path(name, dtype, n, rng):
    if name == "gelu" and dtype not in FLOATS:
        pytest.skip("gelu takes float dtypes")
    x = sample(rng, (n,), dtype, positive=name in ("log", "sqrt"))
    op = getattr(ob.ops, name)
    lane = op(x)
    generic = op(np.repeat(x, 2)[::2])
    assert lane.dtype == generic.dtype
    # Contiguous runs may use fused multiply-adds where strided ones do not: within an ulp or two.
    rtol = RTOL.get(lane.dtype.type, 0)
    np.testing.assert_allclose(lane.astype(np.float64), generic.astype(np.float64), rtol=rtol, atol=rtol)
    if name in UNARY:
        want = np.asarray(UNARY[name](x)).astype(np.float64)
        np.testing.assert_allclose(lane.astype(np.float64), want, rtol=rtol, atol=rtol)
    y = x.copy()
    if lane.dtype == x.dtype:
        assert op(y, out=y) is y
        np.testing.assert_array_equal(y, lane)


def test_arrays_with_more_dimensions_than_the_plugin_abi_allows_work_with_builtins(rng):
    # Built-ins are SDK operators called in-process: only the C ABI limits ndim (to 16).
    shape = (1,) * 18 + (2, 3)
    x = rng.standard_normal(shape)
    y = rng.standard_normal(shape)[..., ::-1]  # strided, to take the generic path
    np.testing.assert_array_equal(ob.ops.add(x, y), x + y)
    np.testing.assert_allclose(ob.ops.sum(x, axis=-1), x.sum(axis=-1))
    np.testing.assert_array_equal(ob.ops.transpose(x), np.transpose(x))
