"""Operators on Tensors of every available device (`cpu:0`, and `ascend:0` on the ACL test
double), checked against numpy: the unary family in every float dtype and the integer ones where
numpy keeps them integer, softmax and log_softmax along any axis, and transpose (any axes, any
dtype)."""

from __future__ import annotations

import numpy as np
import pytest

import opbridge as ob

# op -> (numpy reference in float64, the dtypes it keeps, the input's domain)
UNARY = {
    "neg": (np.negative, ["float16", "float32", "float64", "int32", "int64"], "any"),
    "abs": (np.abs, ["float16", "float32", "float64", "int32", "int64"], "any"),
    "exp": (np.exp, ["float16", "float32", "float64"], "small"),
    "log": (np.log, ["float16", "float32", "float64"], "positive"),
    "sqrt": (np.sqrt, ["float16", "float32", "float64"], "positive"),
    "relu": (lambda x: np.maximum(x, 0), ["float16", "float32", "float64", "int32", "int64"], "any"),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), ["float16", "float32", "float64"], "small"),
    "tanh": (np.tanh, ["float16", "float32", "float64"], "small"),
    "silu": (lambda x: x / (1 + np.exp(-x)), ["float16", "float32", "float64"], "small"),
}
TOLERANCE = {"float16": 2e-3, "float32": 2e-6, "float64": 1e-13}


def inputs(rng: np.random.Generator, domain: str, dtype: str, shape) -> np.ndarray:
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    x = rng.standard_normal(shape) * (3 if domain == "small" else 30)
    if domain == "positive":
        x = np.abs(x) + 0.01
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_ops_match_numpy(device: str, op: str, dtype: str, rng) -> None:
    reference, dtypes, domain = UNARY[op]
    if dtype not in dtypes:
        pytest.skip(f"numpy's {op} of {dtype} is not {dtype}")
    a = inputs(rng, domain, dtype, (7, 33))
    f = getattr(ob.ops, op)
    t = ob.asarray(a, device=device)
    # as given; transposed on the device; a sliced copy
    for x, tensor in ((a, t), (a.T, ob.ops.transpose(t)), (a[::2, 3:], ob.asarray(a[::2, 3:], device=device))):
        got = f(tensor).numpy()
        with np.errstate(over="ignore"):
            want = reference(x.astype(np.float64)).astype(dtype)  # rounded (and overflowed) as dtype
        assert got.dtype == np.dtype(dtype) and got.shape == x.shape
        if np.dtype(dtype).kind == "i":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_ops_on_empty_and_special_values(device: str, op: str) -> None:
    f = getattr(ob.ops, op)
    empty = f(ob.asarray(np.zeros((0, 3), np.float32), device=device)).numpy()
    assert empty.shape == (0, 3)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)
    got = f(ob.asarray(special, device=device)).numpy()
    with np.errstate(all="ignore"):
        want = f(special)  # the host kernel: the device agrees with it on every special value
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("axes", [None, (1, 0, 2), (2, 0, 1), (-1, -3, -2)])
def test_transpose_matches_numpy(device: str, axes, dtype: str, rng) -> None:
    a = inputs(rng, "any", dtype, (3, 4, 5))
    got = ob.ops.transpose(ob.asarray(a, device=device), axes=axes)
    assert got.device == device
    np.testing.assert_array_equal(got.numpy(), np.transpose(a, axes))
    with pytest.raises(ob.ShapeError):
        ob.ops.transpose(ob.asarray(a, device=device), axes=(0, 0, 1))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_matches_numpy(device: str, op: str, axis: int, dtype: str, rng) -> None:
    a = (rng.standard_normal((4, 5, 6)) * 4).astype(dtype)
    x = a.astype(np.float64)
    shifted = x - x.max(axis=axis, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
    want = np.exp(shifted - log_sum) if op == "softmax" else shifted - log_sum
    got = getattr(ob.ops, op)(ob.asarray(a, device=device), axis=axis).numpy()
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, want.astype(dtype), rtol=TOLERANCE[dtype] * 4, atol=TOLERANCE[dtype] * 4)
    with pytest.raises(ob.OpBridgeError):
        getattr(ob.ops, op)(ob.asarray(a, device=device), axis=3)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int32", "int64"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "argmax"])
def test_reductions_match_the_host(device: str, op: str, axis, dtype: str, rng) -> None:
    a = inputs(rng, "small", dtype, (5, 6, 7))
    if dtype == "float16":
        a[1, 2, 3] = a.max()  # a tie: argmax takes the first
    f = getattr(ob.ops, op)
    keepdims_cases = [False] if op == "argmax" else [False, True]
    for keepdims in keepdims_cases:
        kwargs = {"axis": axis} if op == "argmax" else {"axis": axis, "keepdims": keepdims}
        got = f(ob.asarray(a, device=device), **kwargs).numpy()
        want = f(a, **kwargs)  # the host kernel (checked against numpy by the CPU suite)
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
        if got.dtype.kind in "iu":
            np.testing.assert_array_equal(got, want)
        else:
            tol = {"float16": 2e-3, "float32": 2e-5, "float64": 1e-12}[str(got.dtype)]
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_reductions_of_nan_and_empty(device: str) -> None:
    a = np.array([[1.0, np.nan, 3.0], [4.0, 5.0, 6.0]], np.float32)
    t = ob.asarray(a, device=device)
    np.testing.assert_array_equal(ob.ops.max(t, axis=1).numpy(), [np.nan, 6.0])
    np.testing.assert_array_equal(ob.ops.min(t, axis=1).numpy(), [np.nan, 4.0])
    np.testing.assert_array_equal(ob.ops.argmax(t, axis=1).numpy(), [1, 2])
    empty = ob.asarray(np.zeros((0, 3), np.float32), device=device)
    np.testing.assert_array_equal(ob.ops.sum(empty, axis=0).numpy(), [0.0, 0.0, 0.0])
    assert np.isnan(ob.ops.mean(empty, axis=0).numpy()).all()
    with pytest.raises(ob.OpBridgeError, match="zero-size|empty"):
        ob.ops.max(empty, axis=0).numpy()
    try:  # on the CPU the kernel's failure is also its stream's, reported once more here
        ob.synchronize(device)
    except ob.OpBridgeError:
        pass


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("params", ["none", "weight", "both"])
def test_layer_norm_matches_the_host(device: str, params: str, dtype: str, rng) -> None:
    x = (rng.standard_normal((3, 4, 16)) * 5 + 2).astype(dtype)
    w = rng.standard_normal(16).astype(dtype) if params != "none" else None
    b = rng.standard_normal(16).astype(dtype) if params == "both" else None
    args = [ob.asarray(v, device=device) if v is not None else None for v in (x, w, b)]
    got = ob.ops.layer_norm(*args, eps=1e-3).numpy()
    want = ob.ops.layer_norm(x, w, b, eps=1e-3)
    tol = {"float16": 4e-3, "float32": 2e-5, "float64": 1e-12}[dtype]
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("shape", [(3, 4, 16), (5, 1), (2, 0, 8)])
def test_rms_norm_matches_the_host(device: str, weight: bool, dtype: str, shape, rng) -> None:
    x = (rng.standard_normal(shape) * 5).astype(dtype)
    w = rng.standard_normal(shape[-1]).astype(dtype) if weight else None
    got = ob.ops.rms_norm(ob.asarray(x, device=device), None if w is None else ob.asarray(w, device=device), eps=1e-3)
    want = ob.ops.rms_norm(x, w, eps=1e-3)
    tol = {"float16": 4e-3, "float32": 2e-5}[dtype]
    assert got.dtype == dtype and got.shape == shape
    np.testing.assert_allclose(got.numpy(), want, rtol=tol, atol=tol)
    # A float32 weight for a float16 x is converted on the device first, as on the host.
    if weight and dtype == "float16":
        w32 = ob.asarray(w.astype(np.float32), device=device)
        np.testing.assert_allclose(
            ob.ops.rms_norm(ob.asarray(x, device=device), w32, eps=1e-3).numpy(), want, rtol=tol, atol=tol
        )


def test_rms_norm_in_float64_names_what_the_device_takes(device: str) -> None:
    x = np.linspace(-3, 3, 12).reshape(3, 4)
    t = ob.asarray(x, device=device)
    if device.startswith("ascend"):
        # CANN's RmsNorm has no DOUBLE kernel: refused before anything is enqueued.
        with pytest.raises(ob.DTypeError, match="float16, float32 on ascend.*float64"):
            ob.ops.rms_norm(t)
    else:
        np.testing.assert_allclose(ob.ops.rms_norm(t).numpy(), ob.ops.rms_norm(x))


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_of_a_0d_input_matches_the_host(device: str, op: str) -> None:
    for value in (3.0, -np.inf, np.nan):
        x = np.array(value, np.float32)
        got = getattr(ob.ops, op)(ob.asarray(x, device=device))
        assert got.shape == ()
        np.testing.assert_array_equal(got.numpy(), getattr(ob.ops, op)(x))


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_norms_of_a_0d_input_are_shape_errors_everywhere(device: str, op: str) -> None:
    with pytest.raises(ob.ShapeError, match="at least one dimension"):
        getattr(ob.ops, op)(ob.asarray(np.array(3.0, np.float32), device=device))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_the_host(device: str, approximate: str, dtype: str, rng) -> None:
    x = (rng.standard_normal((6, 50)) * 3).astype(dtype)
    got = ob.ops.gelu(ob.asarray(x, device=device), approximate=approximate).numpy()
    want = ob.ops.gelu(x, approximate=approximate)
    tol = {"float16": 4e-3, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_gelu_in_float64_names_what_the_device_takes(device: str) -> None:
    x = np.linspace(-3, 3, 11)
    t = ob.asarray(x, device=device)
    if device.startswith("ascend"):
        with pytest.raises(ob.DTypeError, match="float16, float32 on ascend.*float64"):
            ob.ops.gelu(t)  # CANN's GeluV2 has no DOUBLE kernel
    else:
        np.testing.assert_allclose(ob.ops.gelu(t).numpy(), ob.ops.gelu(x))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("alpha", [1.0, -2.5, 0.1, 2])
def test_axpy_matches_the_host(device: str, alpha: float, dtype: str, rng) -> None:
    x, y = (rng.standard_normal((4, 33)) * 10).astype(dtype), (rng.standard_normal((1, 33)) * 10).astype(dtype)
    got = ob.ops.axpy(ob.asarray(x, device=device), ob.asarray(y, device=device), alpha=alpha).numpy()
    want = ob.ops.axpy(x, y, alpha=alpha)  # broadcasting y
    tol = {"float16": 4e-3, "float32": 1e-6, "float64": 1e-14}[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_embedding_bag_matches_the_host(device: str, mode: str, index_dtype: str, dtype: str, rng) -> None:
    weight = rng.standard_normal((20, 6)).astype(dtype)
    weight[7, 2] = np.nan  # max propagates NaN, as the host kernel does
    indices = rng.integers(0, 20, size=17).astype(index_dtype)
    indices[:2] = 7
    offsets = np.array([0, 3, 3, 9, 16], index_dtype)  # an empty bag, a bag of one
    on_device = [ob.asarray(v, device=device) for v in (weight, indices, offsets)]
    if device.startswith("ascend") and dtype == "float64":
        with pytest.raises(ob.DTypeError, match="on ascend"):  # CANN's EmbeddingBag: no DOUBLE
            ob.ops.embedding_bag(*on_device, mode=mode)
        return
    got = ob.ops.embedding_bag(*on_device, mode=mode)
    want = ob.ops.embedding_bag(weight, indices, offsets, mode=mode)
    assert got.dtype == dtype and got.shape == (5, 6)
    tol = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12}[dtype]
    np.testing.assert_allclose(got.numpy(), want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.isnan(got.numpy()), np.isnan(want))


def test_embedding_bag_with_a_bad_index_fails_on_either_device(device: str) -> None:
    """A bad index never reads out of bounds: on the host the kernel checks every index before
    reading a row; on the device the check is the kernel's, as CANN's. Either way the launch
    fails and the stream reports it, naming the index or the operator; the stream works again."""
    weight, offsets = np.ones((5, 2), np.float32), np.array([0], np.int64)
    on = [ob.asarray(v, device=device) for v in (weight, np.array([0, 5], np.int64), offsets)]
    with pytest.raises(ob.OpBridgeError, match="out of range|aclnnEmbeddingBag"):
        ob.ops.embedding_bag(*on).numpy()
    try:  # the stream's own report of the failure, where the read did not take it already
        ob.synchronize(device)
    except ob.OpBridgeError as e:
        assert "out of range" in str(e) or "aclnnEmbeddingBag" in str(e)
    good = [ob.asarray(v, device=device) for v in (weight, np.array([0, 4], np.int64), offsets)]
    np.testing.assert_array_equal(ob.ops.embedding_bag(*good).numpy(), [[2, 2]])
    # An empty output still has its indices checked (no bag reads them, but they are wrong).
    empty = [ob.asarray(v, device=device) for v in (weight, np.array([7], np.int64), np.zeros(0, np.int64))]
    with pytest.raises(ob.OpBridgeError, match="out of range|aclnnEmbeddingBag"):
        ob.ops.embedding_bag(*empty).numpy()  # no bytes to read: the stream may report it
        ob.synchronize(device)
    try:  # whichever of the two did not report it
        ob.synchronize(device)
    except ob.OpBridgeError as e:
        assert "out of range" in str(e) or "aclnnEmbeddingBag" in str(e)
