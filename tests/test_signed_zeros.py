"""`maximum`, `minimum`, `max` and `min` break -0.0 vs 0.0 ties exactly as numpy does (numpy's
choice depends on its loops' comparison order, not on values: see
crates/opbridge-ops/src/cpu/reduce/zeros.rs), for float16/32/64, contiguous and strided, on the
fast lane, the generic path and Tensors; NaN still propagates."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import opbridge as ob

FLOATS = [np.float16, np.float32, np.float64]


def same_bits(got: np.ndarray, want: np.ndarray) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    np.testing.assert_array_equal(got, want)


def zeros(rng: np.random.Generator, n: int, dtype: type, losers: float = 0.0, sign: float = -1.0) -> np.ndarray:
    """n signed zeros (a random share negative), some replaced by values that lose to zero."""
    x = np.where(rng.random(n) < rng.random(), -0.0, 0.0).astype(dtype)
    if losers:
        m = rng.random(n) < losers
        x[m] = sign * (rng.random(int(m.sum())) + 0.25)
    return x


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", ["maximum", "minimum"])
def test_binary_scalar_ties(dtype: type, name: str) -> None:
    fn, op = getattr(np, name), getattr(ob.ops, name)
    for a, b in [(-0.0, 0.0), (0.0, -0.0), (-0.0, -0.0), (0.0, 0.0)]:
        x, y = np.array([a], dtype), np.array([b], dtype)
        same_bits(op(x, y), fn(x, y))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", ["maximum", "minimum"])
@pytest.mark.parametrize("n", [1, 3, 8, 17, 64, 1000, 70_000])
def test_binary_ties_on_every_path(dtype: type, name: str, n: int) -> None:
    rng = np.random.default_rng(n)
    fn, op = getattr(np, name), getattr(ob.ops, name)
    a, b = zeros(rng, n, dtype, 0.2), zeros(rng, n, dtype, 0.2, sign=1.0)
    a[rng.random(n) < 0.01] = np.nan
    same_bits(op(a, b), fn(a, b))  # the lane
    same_bits(op(b, a), fn(b, a))
    same_bits(op(a[::2], b[::2]), fn(a[::2], b[::2]))  # strided: the generic path
    same_bits(op(a[::-1], b), fn(a[::-1], b))
    same_bits(op(a, dtype(0.0)), fn(a, dtype(0.0)))  # broadcast
    same_bits(op(dtype(-0.0), b), fn(dtype(-0.0), b))
    same_bits(op(a.reshape(1, -1), b.reshape(-1, 1)[:5]), fn(a.reshape(1, -1), b.reshape(-1, 1)[:5]))
    same_bits(op(ob.asarray(a), ob.asarray(b)).numpy(), fn(a, b))  # Tensors
    out = np.empty_like(a)
    same_bits(op(a, b, out=out), fn(a, b))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", ["max", "min"])
def test_reductions_of_mixed_zeros_match_numpy_over_many_cases(dtype: type, name: str) -> None:
    fn, op = getattr(np, name), getattr(ob.ops, name)
    rng = np.random.default_rng(7)
    sign = -1.0 if name == "max" else 1.0
    for trial in range(600):
        n = int(rng.choice([rng.integers(1, 40), rng.integers(40, 700), rng.integers(700, 40_000)]))
        x = zeros(rng, n, dtype, [0.0, 0.3, 0.9][trial % 3], sign)
        same_bits(op(x), fn(x))
        step = int(rng.integers(2, 5))
        same_bits(op(x[::step]), fn(x[::step]))
        if trial % 10 == 0:
            same_bits(op(x[::-1]), fn(x[::-1]))
            same_bits(op(ob.asarray(x)).numpy(), fn(x))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", ["max", "min"])
def test_axis_reductions_of_mixed_zeros(dtype: type, name: str) -> None:
    fn, op = getattr(np, name), getattr(ob.ops, name)
    rng = np.random.default_rng(9)
    sign = -1.0 if name == "max" else 1.0
    for trial in range(150):
        r, c = int(rng.integers(1, 50)), int(rng.integers(1, 50))
        a = zeros(rng, r * c, dtype, [0.0, 0.4][trial % 2], sign).reshape(r, c)
        for axis in [0, 1, -1, None]:
            same_bits(op(a, axis=axis), fn(a, axis=axis))
            same_bits(op(a, axis=axis, keepdims=True), fn(a, axis=axis, keepdims=True))
        f = np.asfortranarray(a)
        same_bits(op(f), fn(f))
        same_bits(op(f, axis=0), fn(f, axis=0))
        same_bits(op(a[:, ::2], axis=1), fn(a[:, ::2], axis=1))
        if trial % 10 == 0:
            same_bits(op(ob.asarray(a), axis=0).numpy(), fn(a, axis=0))
            same_bits(op(ob.asarray(a), axis=1).numpy(), fn(a, axis=1))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("name", "sign"), [("max", -1.0), ("min", 1.0)])
def test_a_single_odd_zero_at_every_position(dtype: type, name: str, sign: float) -> None:
    # One zero of the other sign: numpy's result depends on its position (the lanes of its loops).
    fn, op = getattr(np, name), getattr(ob.ops, name)
    for n in [2, 9, 16, 17, 18, 33, 129, 130, 200]:
        for base, odd in [(-0.0, 0.0), (0.0, -0.0)]:
            for k in range(n):
                x = np.full(n, base, dtype)
                x[k] = odd
                same_bits(op(x), fn(x))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("call", [lambda x: ob.ops.max(x), lambda x: ob.ops.min(x, axis=0)])
def test_nan_still_propagates(dtype: type, call: Callable[[np.ndarray], np.ndarray]) -> None:
    x = np.array([-0.0, 0.0, np.nan, 0.0, -0.0] * 7, dtype)
    assert np.isnan(call(x))
    assert np.isnan(ob.ops.maximum(x, np.zeros_like(x))[2])
    assert np.isnan(ob.ops.minimum(np.zeros_like(x), x)[2])
