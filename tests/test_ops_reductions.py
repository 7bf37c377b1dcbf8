"""Reductions, softmax, norms, embedding_bag and batched matmul of ob.ops against numpy."""

import numpy as np
import pytest

import opbridge as ob

FLOATS = [np.float16, np.float32, np.float64]
RTOL = {np.float16: 5e-3, np.float32: 1e-5, np.float64: 1e-12}

REDUCTIONS = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions_match_numpy(name, dtype, axis, keepdims, rng):
    x = (rng.random((6, 7, 5)) * 10).astype(dtype)
    got = getattr(ob.ops, name)(x, axis=axis, keepdims=keepdims)
    want = np.asarray(REDUCTIONS[name](x, axis=axis, keepdims=keepdims))
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol = RTOL.get(want.dtype.type, 0)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol)


@pytest.mark.parametrize("axis", [None, 0, 2, -2])
def test_argmax_matches_numpy_on_strided_input(axis, rng):
    x = rng.random((5, 8, 6))[:, ::2, ::-1]
    got = ob.ops.argmax(x, axis=axis)
    want = np.argmax(x, axis=axis)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)


def test_reductions_nan_empty_and_axis_errors():
    x = np.array([1.0, np.nan, 3.0])
    assert np.isnan(ob.ops.max(x)) and np.isnan(ob.ops.sum(x))
    assert ob.ops.argmax(x) == np.argmax(x)
    assert ob.ops.sum(np.zeros(0)) == 0.0
    with np.errstate(invalid="ignore", divide="ignore"):
        assert np.isnan(ob.ops.mean(np.zeros(0)))
    with pytest.raises(ob.ArgumentError, match="zero-size array"):
        ob.ops.max(np.zeros(0))
    with pytest.raises(ob.ShapeError, match="out of bounds"):
        ob.ops.sum(np.ones((2, 2)), axis=2)


def test_large_sum_is_accurate_and_parallel_safe(rng):
    x = rng.random(1 << 22).astype(np.float32)
    np.testing.assert_allclose(ob.ops.sum(x), x.astype(np.float64).sum(), rtol=1e-6)


def np_softmax(x, axis):
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_and_log_softmax(dtype, axis, rng):
    x = (rng.standard_normal((4, 9, 6)) * 20).astype(dtype)
    want = np_softmax(x, axis)
    np.testing.assert_allclose(ob.ops.softmax(x, axis=axis).astype(np.float64), want, rtol=RTOL[dtype] * 10, atol=1e-7)
    np.testing.assert_allclose(
        ob.ops.log_softmax(x, axis=axis).astype(np.float64),
        np.log(want),
        rtol=RTOL[dtype] * 10,
        atol=1e-3 if dtype == np.float16 else 1e-9,
    )
    # Stable for huge logits.
    big = np.array([[1000.0, 1000.0, -1000.0]])
    np.testing.assert_allclose(ob.ops.softmax(big), [[0.5, 0.5, 0.0]])


@pytest.mark.parametrize("dtype", FLOATS)
def test_layer_norm_and_rms_norm(dtype, rng):
    x = rng.standard_normal((8, 32)).astype(dtype)
    w = rng.random(32).astype(dtype)
    b = rng.random(32).astype(dtype)
    x64 = x.astype(np.float64)
    ln = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5) * w + b
    tol = 5e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(ob.ops.layer_norm(x, w, b).astype(np.float64), ln, rtol=tol, atol=tol)
    np.testing.assert_allclose(
        ob.ops.layer_norm(x, eps=1e-3),
        (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-3),
        rtol=tol,
        atol=tol,
    )
    rms = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(ob.ops.rms_norm(x, w).astype(np.float64), rms, rtol=tol, atol=tol)
    with pytest.raises(ob.ShapeError, match="weight of shape"):
        ob.ops.layer_norm(x, np.ones(31, dtype))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_embedding_bag(mode, index_dtype, rng):
    weight = rng.random((20, 4))
    indices = rng.integers(0, 20, size=15).astype(index_dtype)
    offsets = np.array([0, 3, 3, 9], index_dtype)  # bag 1 is empty
    got = ob.ops.embedding_bag(weight, indices, offsets, mode=mode)
    bounds = list(offsets) + [len(indices)]
    reduce = {"sum": np.sum, "mean": np.mean, "max": np.max}[mode]
    for bag in range(len(offsets)):
        rows = weight[indices[bounds[bag] : bounds[bag + 1]]]
        want = reduce(rows, axis=0) if len(rows) else np.zeros(4)
        np.testing.assert_allclose(got[bag], want, rtol=1e-12)


def test_embedding_bag_rejects_bad_indices_and_offsets(rng):
    weight = rng.random((5, 2))
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.ops.embedding_bag(weight, np.array([0, 5]), np.array([0]))
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.ops.embedding_bag(weight, np.array([-1]), np.array([0]))
    with pytest.raises(ob.ArgumentError):
        ob.ops.embedding_bag(weight, np.array([0, 1]), np.array([1]))
    with pytest.raises(ob.DTypeError):
        ob.ops.embedding_bag(weight, np.array([0.0]), np.array([0]))


@pytest.mark.parametrize(
    "shapes",
    [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 1, 3, 4), (5, 4, 2)), ((4,), (4, 3)), ((3, 4), (4,)), ((4,), (4,))],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_batched_matmul_follows_numpy_at_rules(shapes, dtype, rng):
    a = (rng.random(shapes[0]) * 10).astype(dtype)
    b = (rng.random(shapes[1]) * 10).astype(dtype)
    got, want = ob.ops.matmul(a, b), a @ b
    assert np.shape(got) == np.shape(want) and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_matmul_float16_accumulates_in_float32(rng):
    a = rng.random((8, 512)).astype(np.float16)
    b = rng.random((512, 8)).astype(np.float16)
    want = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
    np.testing.assert_allclose(ob.ops.matmul(a, b).astype(np.float32), want.astype(np.float32), rtol=2e-3)


def test_matmul_versions_coexist(rng):
    a, b = rng.random((2, 3, 4)), rng.random((4, 2))
    assert ob.ops.matmul.version == 2
    np.testing.assert_allclose(ob.ops.matmul(a, b), a @ b)
    with pytest.raises(ob.ShapeError):
        ob.ops.get("matmul", version=1)(a, b)  # version 1 is 2-D only
    with pytest.raises(ob.ShapeError, match="matmul"):
        ob.ops.matmul(np.ones((2, 3)), np.ones((4, 2)))


def test_tensor_path_for_reductions_and_nn(rng):
    x = rng.random((4, 16)).astype(np.float32)
    t = ob.asarray(x)
    np.testing.assert_allclose(ob.ops.sum(t, axis=1).numpy(), x.sum(1), rtol=1e-6)
    np.testing.assert_allclose(ob.ops.softmax(t).numpy(), np_softmax(x, -1), rtol=1e-5)


@pytest.mark.parametrize("name", ["sum", "mean", "max", "min", "argmax"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
def test_the_whole_array_lane_equals_the_generic_path(name: str, dtype: type) -> None:
    # `op(x)` alone takes the view lane; `op(x, axis=None)` (a keyword) the generic path: the
    # same bits, dtype, shape and type, in every layout, with and without out=.
    op = ob.ops.get(name)
    rng = np.random.default_rng(11)
    for shape in [(), (1,), (7,), (3, 5), (4, 1, 6), (70_000,)]:
        x = (rng.standard_normal(shape) * 10).astype(dtype)
        views = [x]
        if x.ndim >= 1 and x.shape[-1] > 1:
            views.append(x[..., ::-2])
        if x.ndim == 2:
            views.append(x.T)
        for v in views:
            lane, generic = op(v), op(v, axis=None)
            assert type(lane) is type(generic) and lane.dtype == generic.dtype and lane.shape == generic.shape
            assert lane.tobytes() == generic.tobytes(), (shape, v.strides)
            out = np.empty((), dtype=lane.dtype)
            assert op(v, out=out) is out and out.tobytes() == lane.tobytes()
    # Empty inputs and outputs of another dtype are the generic path's, errors included.
    if name in ("max", "min", "argmax"):
        with pytest.raises(ob.ArgumentError, match="empty|zero-size"):
            op(np.zeros((0,), dtype))
    with pytest.raises(ob.OpBridgeError):
        op(np.ones(3, dtype), out=np.empty((), dtype=np.int8))
