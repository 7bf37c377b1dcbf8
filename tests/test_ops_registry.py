"""The operator registry from Python: ob.ops, ob.ops.get, ob.list_ops, docs and errors."""

import functools
import gc
import inspect
import sys

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


# --- Calls through vectorcall (ffi/vectorcall.rs) -------------------------------------------------


@pytest.mark.skipif(hasattr(sys, "gettotalrefcount"), reason="a debug build of Python keeps tp_call")
def test_op_objects_are_called_through_vectorcall():
    # Py_TPFLAGS_HAVE_VECTORCALL: CPython passes the argument array, no tuple per call.
    assert ob.ops.Op.__flags__ & (1 << 11)  # from the import on, before any Op is made
    # And the type is immutable: before Python 3.12 a reassigned `Op.__call__` would miss
    # every call that vectorcall serves, so the assignment is refused instead.
    with pytest.raises(TypeError, match="immutable"):
        ob.ops.Op.__call__ = lambda self, *args: None  # type: ignore[method-assign]
    np.testing.assert_array_equal(ob.ops.add(np.ones(3), np.ones(3)), np.full(3, 2.0))


def test_every_way_of_calling_an_op_gives_the_same_result_and_errors():
    rng = np.random.default_rng(1)
    a, b = rng.random(1000).astype(np.float32), rng.random(1000).astype(np.float32)
    add = ob.ops.add
    expected = a + b
    out = np.empty_like(a)
    # Fast lanes (positional arrays, out=) and the declined calls handed to tp_call.
    np.testing.assert_array_equal(add(a, b), expected)
    np.testing.assert_array_equal(add(a, b, out=None), expected)
    assert add(a, b, out=out) is out
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(add(a=a, b=b), expected)
    np.testing.assert_array_equal(add(a, b=b), expected)
    np.testing.assert_array_equal(add(*(a, b), **{"out": None}), expected)
    np.testing.assert_array_equal(functools.partial(add, a)(b), expected)
    np.testing.assert_array_equal(type(add).__call__(add, a, b), expected)
    np.testing.assert_array_equal(add(a, b, device="cpu"), expected)
    np.testing.assert_array_equal(add(a[::2], b[::2]), expected[::2])  # declined: strided
    np.testing.assert_array_equal(add([1.0, 2.0], b[:2].astype(np.float64)), [1.0, 2.0] + b[:2].astype(np.float64))
    x = rng.random((4, 8)).astype(np.float32)
    np.testing.assert_allclose(ob.ops.softmax(x, axis=0), ob.ops.softmax(x, **{"axis": 0}))
    assert ob.ops.sum(x) == ob.ops.sum(x, out=None)
    # Errors: the same type and message through vectorcall as through tp_call (the slot
    # wrapper `type(op).__call__` calls tp_call itself).
    tp_call = type(add).__call__
    bad_calls = [
        ((), {}),
        ((a,), {}),
        ((a, b, a), {}),
        ((a, b), {"bogus": 1}),
        ((a, b), {"out": out, "bogus": 1}),
        ((a, b[:10]), {}),
        ((a, b), {"out": out[:10]}),
        ((a, b), {"out": "not an array"}),
        ((a, b), {"out": out, "a": a}),
        ((a.astype(np.complex64), b), {}),
        (("text", b), {}),
    ]
    for args, kwargs in bad_calls:
        with pytest.raises(Exception) as through_vectorcall:
            add(*args, **kwargs)
        with pytest.raises(Exception) as through_tp_call:
            tp_call(add, *args, **kwargs)
        assert type(through_vectorcall.value) is type(through_tp_call.value), (args, kwargs)
        assert str(through_vectorcall.value) == str(through_tp_call.value)
    with pytest.raises(ob.ShapeError):
        add(a, b[:10])


def test_vectorcall_keeps_reference_counts():
    a, b = np.ones(64, np.float32), np.ones(64, np.float32)
    out = np.empty_like(a)
    add = ob.ops.add

    def calls():
        add(a, b, out=out)
        add(a=a, b=b)
        try:
            add(a, b[:3])
        except ob.ShapeError:
            pass
        return add(a, b)

    calls()
    gc.collect()
    before = [sys.getrefcount(o) for o in (a, b, out, add)]
    for _ in range(1000):
        r = calls()
    gc.collect()
    assert sys.getrefcount(r) == 2  # the name and the call's argument: no extra reference
    assert [sys.getrefcount(o) for o in (a, b, out, add)] == before
