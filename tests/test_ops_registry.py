"""The operator registry from Python: ob.ops, ob.ops.get, ob.list_ops, docs and errors."""

import inspect

import numpy as np
import pytest

import opbridge as ob


def test_list_ops_reports_builtins_with_versions_dtypes_devices_source():
    ops = {info["name"]: info for info in ob.list_ops()}
    assert {"vector_add", "matmul"} <= set(ops)
    add = ops["vector_add"]
    assert add["versions"] == [1]
    assert add["source"] == "built-in"
    assert "float32" in add["dtypes"] and "cpu" in add["devices"]
    assert add["by_version"][1]["source"] == "built-in"


def test_ops_attribute_is_latest_version_and_get_selects_one():
    op = ob.ops.vector_add
    assert op.name == "vector_add" and op.version == 1
    assert ob.ops.get("vector_add", version=1).version == 1
    assert ob.ops.get("vector_add") is ob.ops.get("vector_add")  # cached per registry state


def test_registered_op_matches_numpy_and_direct_function():
    rng = np.random.default_rng(0)
    a, b = rng.random((3, 4)).astype(np.float32), rng.random((3, 4)).astype(np.float32)
    np.testing.assert_array_equal(ob.ops.vector_add(a, b), a + b)
    np.testing.assert_allclose(ob.ops.matmul(a, b.T), a @ b.T, rtol=1e-5)
    # Inputs may be strided: the operator reads them in place or copies once.
    np.testing.assert_array_equal(ob.ops.vector_add(a[:, ::2], b[:, ::2]), a[:, ::2] + b[:, ::2])


def test_out_and_in_place():
    a = np.arange(6, dtype=np.float64)
    expected = a + a
    r = ob.ops.vector_add(a, a, out=a)
    assert r is a
    np.testing.assert_array_equal(a, expected)


def test_out_overlapping_an_input_is_computed_aside():
    a = np.arange(4, dtype=np.float64).reshape(2, 2)
    expected = a @ a
    ob.ops.matmul(a, a, out=a)
    np.testing.assert_array_equal(a, expected)


def test_tensor_path_is_async_and_correct():
    t = ob.asarray(np.arange(5, dtype=np.float32))
    r = ob.ops.vector_add(t, t)
    assert isinstance(r, ob.Tensor)
    np.testing.assert_array_equal(r.numpy(), np.arange(5, dtype=np.float32) * 2)


def test_docstring_and_signature_come_from_the_schema():
    op = ob.ops.matmul
    assert "matmul(a, b, *, out=None)" in op.__doc__
    assert f"Version {op.version}" in op.__doc__
    assert list(inspect.signature(op).parameters) == ["a", "b", "out"]
    assert "matmul" in dir(ob.ops)


def test_unknown_names_versions_and_arguments_are_typed_errors_listing_what_exists():
    with pytest.raises(AttributeError, match="available: .*matmul"):
        ob.ops.no_such_op  # noqa: B018 -- the attribute access is what must raise
    with pytest.raises(ob.OpBridgeError, match="available versions: 1, 2"):
        ob.ops.get("matmul", version=9)
    with pytest.raises(ob.ArgumentError, match="unexpected argument"):
        ob.ops.vector_add(np.ones(2), np.ones(2), alpha=2)
    with pytest.raises(TypeError, match="missing required tensor argument"):
        ob.ops.vector_add(np.ones(2))
    with pytest.raises(ob.DTypeError, match="matmul: expected a of dtype"):
        ob.ops.get("matmul", version=1)(np.ones((2, 2), np.int32), np.ones((2, 2), np.int32))
    with pytest.raises(ob.ShapeError):
        ob.ops.vector_add(np.ones(2), np.ones(3))


def test_attribute_values_of_every_python_and_numpy_kind():
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(ob.ops.sum(x, axis=np.int64(1)), x.sum(axis=1))
    np.testing.assert_array_equal(ob.ops.sum(x, axis=-1, keepdims=True), x.sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(ob.ops.layer_norm(x, eps=np.float32(1e-3)), ob.ops.layer_norm(x, eps=1e-3))
    assert ob.ops.cast(x, dtype=np.int32).dtype == np.int32
    np.testing.assert_array_equal(ob.ops.transpose(x, axes=(1, 0)), x.T)
    with pytest.raises(ob.ArgumentError, match="expected axis to be an int"):
        ob.ops.sum(x, axis=1.5)
