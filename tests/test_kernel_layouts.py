"""A unary operator gives the same bits whatever the layout of its input: contiguous, strided,
transposed, short rows, one element, in place (the strided walks gather into the contiguous
kernels). Also float16 `neg`/`abs` as numpy's sign-bit operations, signalling NaNs included."""

from __future__ import annotations

import numpy as np
import pytest

import opbridge as ob

FLOAT_OPS = ["exp", "log", "tanh", "sigmoid", "silu", "sqrt", "relu", "neg", "abs", "gelu"]


def _values(dtype: type) -> np.ndarray:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(4 * 37) * 30).astype(dtype)
    x[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, -100.0, -90.0, 1e-30 if dtype != np.float16 else 1e-7]
    return x


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("name", FLOAT_OPS)
def test_every_layout_gives_the_contiguous_bits(name: str, dtype: type) -> None:
    op = ob.ops.get(name)
    flat = _values(dtype)
    with np.errstate(all="ignore"):
        grid = flat.reshape(4, 37)
        cases = [grid.T, grid[:, ::2], grid[::-1, 1::3], grid[:, :1], flat[5:6], flat[::-3]]
        for view in cases:
            want = op(np.ascontiguousarray(view))
            got = op(view)
            assert got.tobytes() == want.tobytes(), (name, view.strides)
        inplace = grid.copy()
        op(inplace, out=inplace)
        assert inplace.tobytes() == op(grid).tobytes()


def test_silu_of_one_element_rounds_its_subnormal_once() -> None:
    # x e^x for x = -100 is 3.72e-42: a rounded subnormal sigmoid times x gave 3.78e-42.
    one = ob.ops.silu(np.float32([-100.0]))
    many = ob.ops.silu(np.full(17, -100.0, np.float32))
    assert one[0] == many[0]
    assert abs(float(one[0]) - (-100.0 * np.exp(-100.0) / (1 + np.exp(-100.0)))) <= 2.0**-149


@pytest.mark.parametrize("name", ["neg", "abs"])
def test_float16_sign_ops_keep_nan_payloads_in_every_layout(name: str) -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    x = bits.view(np.float16)
    want = bits ^ 0x8000 if name == "neg" else bits & 0x7FFF
    op = ob.ops.get(name)
    assert np.array_equal(op(x).view(np.uint16), want)
    assert np.array_equal(op(x[::2]).view(np.uint16), want[::2])
    assert np.array_equal(op(x[:1]).view(np.uint16), want[:1])
    snan = np.array([0x7C01], np.uint16).view(np.float16)
    assert op(snan).view(np.uint16)[0] == (0xFC01 if name == "neg" else 0x7C01)
