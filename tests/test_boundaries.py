"""What a user can get wrong at the boundary: every such mistake is a typed opbridge error that
names the argument, and messages read well. Integers out of range anywhere an int goes to Rust;
values numpy cannot turn into arrays; JIT arguments; plugin workspaces too large to allocate;
calls into an unloaded library; message wording (no doubled op names, async errors)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import opbridge as ob

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "tests" / "plugins" / "probe.c"

BIG = [2**63, 2**64, 2**70, -(2**63) - 1, 10**400]


# --- integers out of range ----------------------------------------------------------------------


@pytest.mark.parametrize("value", BIG)
@pytest.mark.parametrize(
    "call",
    [
        lambda v: ob.ops.sum(np.ones((2, 3)), axis=v),
        lambda v: ob.ops.softmax(np.ones((2, 3)), axis=v),
        lambda v: ob.ops.argmax(np.ones((2, 3)), axis=v),
        lambda v: ob.ops.sum(ob.asarray(np.ones((2, 3))), axis=v),
    ],
    ids=["sum", "softmax", "argmax", "sum-tensor"],
)
def test_int_attributes_out_of_range_name_the_argument(call: Callable[[int], object], value: int) -> None:
    with pytest.raises(ob.ArgumentError, match="axis") as info:
        call(value)
    assert not isinstance(info.value, OverflowError)
    assert len(str(info.value)) < 300, "a 400-digit int is summarized"


@pytest.mark.parametrize("value", [[1, 2**64], (2**70,), [-(2**63) - 1]])
def test_int_list_attributes_out_of_range(value: object) -> None:
    with pytest.raises(ob.ArgumentError, match=r"sum: axis\[\d\]"):
        ob.ops.sum(np.ones((2, 3)), axis=value)


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("alpha", lambda v: ob.ops.axpy(np.ones(3), np.ones(3), alpha=v)),
        ("eps", lambda v: ob.ops.layer_norm(np.ones((2, 3)), eps=v)),
        ("eps", lambda v: ob.ops.rms_norm(np.ones((2, 3)), eps=v)),
    ],
)
def test_float_attributes_take_any_int_like_float(name: str, call: Callable[[int], np.ndarray]) -> None:
    for value in [2**63, 2**64 + 1, 10**30, -(2**70), 2**53 + 1, 7]:
        got = np.asarray(call(value))
        want = np.asarray(call(float(value)))
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ob.ArgumentError, match=f"{name} is too large for a float") as info:
        call(10**400)
    assert not isinstance(info.value, OverflowError)


def test_axpy_with_an_exact_large_int_alpha_matches_float() -> None:
    x, y = np.ones(4, np.float64), np.zeros(4)
    np.testing.assert_array_equal(ob.ops.axpy(x, y, alpha=2**63), np.full(4, float(2**63)))
    np.testing.assert_array_equal(ob.ops.axpy(x, y, alpha=10**30), np.full(4, 1e30))


@pytest.mark.parametrize("version", [-1, 2**32, 2**40, 2**70, 10**400])
def test_version_out_of_range(version: int) -> None:
    with pytest.raises(ob.ArgumentError, match="version is out of range"):
        ob.ops.get("add", version=version)


@pytest.mark.parametrize("version", ["1", 1.0, True])
def test_version_of_another_type(version: object) -> None:
    with pytest.raises(ob.ArgumentError, match="version must be an int"):
        ob.ops.get("add", version=version)  # type: ignore[arg-type]


@pytest.mark.parametrize("limit", [-1, 2**64, 2**70, 10**400])
def test_memory_limit_out_of_range(limit: int) -> None:
    before = ob.get_memory_pool_stats()["limit"]
    with pytest.raises(ob.ArgumentError, match="limit is out of range"):
        ob.set_memory_limit(limit)
    assert ob.get_memory_pool_stats()["limit"] == before, "nothing changed"


def test_memory_limit_accepts_index_ints() -> None:
    ob.set_memory_limit(np.int64(1 << 40))
    try:
        assert ob.get_memory_pool_stats()["limit"] == 1 << 40
    finally:
        ob.set_memory_limit(None)
    with pytest.raises(ob.ArgumentError, match="limit must be an int"):
        ob.set_memory_limit(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cpu:99999999999999999999", "cuda:18446744073709551616", "cpu:" + "9" * 400])
def test_device_index_out_of_range(device: str) -> None:
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.asarray(np.ones(3), device=device)
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.Stream(device=device)
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.Event(device=device)
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.zeros(3, device=device)
    with pytest.raises(ob.ArgumentError, match="out of range"):
        ob.set_memory_limit(1, device=device)


@pytest.mark.parametrize("factory", [ob.empty, ob.zeros])
@pytest.mark.parametrize(
    "shape", [(2**70,), -1, (3, -1), 2**64, (2, 10**400), (np.int64(-2),)], ids=lambda s: repr(s)[:20]
)
def test_shape_dims_out_of_range(factory: Callable[..., ob.Tensor], shape: object) -> None:
    with pytest.raises(ob.ArgumentError, match=r"shape\[\d\] is out of range"):
        factory(shape)


@pytest.mark.parametrize("factory", [ob.empty, ob.zeros])
@pytest.mark.parametrize("shape", ["3", 2.0, (2, 1.5), None, (2, None)], ids=repr)
def test_shape_of_another_type(factory: Callable[..., ob.Tensor], shape: object) -> None:
    with pytest.raises(ob.ArgumentError, match="shape"):
        factory(shape)


def test_shape_dims_in_range_but_too_big_together() -> None:
    with pytest.raises((ob.ArgumentError, ob.ShapeError, ob.OutOfMemoryError)):
        ob.empty((2**62, 2**62))
    assert ob.zeros((np.int32(2), 3)).shape == (2, 3)


@pytest.mark.parametrize("dl_device", [(1, 2**40), (2**31, 0), (1, -(2**31) - 1), (1,), "cpu"])
def test_dlpack_device_out_of_range(dl_device: object) -> None:
    t = ob.asarray(np.ones(3))
    with pytest.raises(ob.ArgumentError, match="dl_device"):
        t.__dlpack__(dl_device=dl_device)


@pytest.mark.parametrize("value", [-1, 2**64, 10**400, "12", 1.5])
def test_tuning_thresholds_out_of_range(value: object) -> None:
    before = ob.tuning.thresholds()
    with pytest.raises(ob.ArgumentError, match="elementwise_parallel_min_elems"):
        ob._native.set_thresholds({"elementwise_parallel_min_elems": value})
    assert ob.tuning.thresholds() == before


# --- values numpy cannot turn into arrays ------------------------------------------------------


RAGGED = [[1.0, 2.0], [3.0]]


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: ob.ops.add(RAGGED, [1.0]), "a"),
        (lambda: ob.ops.add([1.0], RAGGED), "b"),
        (lambda: ob.vector_add(RAGGED, RAGGED), "a"),
        (lambda: ob.matmul(np.ones((2, 2)), RAGGED), "b"),
        (lambda: ob.ops.sum(RAGGED), "x"),
        (lambda: ob.ops.add(ob.asarray(np.ones(2)), RAGGED), "b"),
        (lambda: ob.asarray(RAGGED), "obj"),
    ],
)
def test_ragged_lists_are_argument_errors_naming_the_argument(call: Callable[[], object], argument: str) -> None:
    with pytest.raises(ob.ArgumentError, match=f"{argument} cannot be converted to an array") as info:
        call()
    assert isinstance(info.value.__cause__, ValueError), "numpy's own error is the cause"


def test_a_list_as_out_is_an_argument_error() -> None:
    with pytest.raises(ob.ArgumentError, match="expected out to be a numpy.ndarray, got list"):
        ob.ops.add(np.ones(2), np.ones(2), out=RAGGED)


# --- the JIT's arguments ------------------------------------------------------------------------

JIT_SOURCE = (REPO / "examples" / "plugins" / "c" / "scale_add.c").read_text()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source": JIT_SOURCE.encode()}, "source must be a str"),
        ({"source": None}, "source must be a str"),
        ({"lang": None}, "lang must be"),
        ({"lang": "fortran"}, "lang must be"),
        ({"name": "ok\n"}, "name"),
        ({"name": "ok\nmore"}, "name"),
        ({"name": ""}, "name"),
        ({"name": None}, "name"),
        ({"name": "../x"}, "name"),
        ({"name": "a" * 101}, "name"),
        ({"flags": "-O2"}, "flags must be a sequence of str"),
        ({"flags": [b"-O2"]}, "flags must be a sequence of str"),
        ({"compiler": 3}, "compiler must be"),
        ({"cache_dir": 3}, "cache_dir must be a path"),
    ],
)
def test_jit_arguments_are_checked_first(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"source": JIT_SOURCE, "name": "scale", "cache_dir": tmp_path, **kwargs}
    with pytest.raises(ob.ArgumentError, match=match):
        ob.jit.compile(**args)  # type: ignore[arg-type]
    assert not any(tmp_path.glob("*.so")), "nothing was compiled"


def test_jit_cache_dir_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    for where in [file, file / "below"]:
        with pytest.raises(ob.ArgumentError, match="cache_dir"):
            ob.jit.compile(JIT_SOURCE, "scale", cache_dir=where)


# --- plugins: workspaces and unloads -----------------------------------------------------------


@pytest.fixture(scope="module")
def probe_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) to build the plugin")
    out = tmp_path_factory.mktemp("probe") / "libprobe.so"
    cmd = [compiler, "-O2", "-shared", "-fPIC", "-I", ob.get_include(), str(PROBE), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def probe(probe_plugin: Path) -> Iterator[ob.Library]:
    with ob.load_library(probe_plugin) as lib:
        yield lib


@pytest.mark.parametrize("bytes_", [-1, 2**63 - 1, 2**62, 2**47 + 3])
def test_a_workspace_too_large_is_out_of_memory(probe: ob.Library, bytes_: int) -> None:
    x = np.arange(3.0)
    with pytest.raises(ob.OutOfMemoryError, match="probe: out of memory"):
        ob.ops.probe(x, bytes=bytes_)
    with pytest.raises(ob.OutOfMemoryError):
        ob.ops.probe(ob.asarray(x), bytes=bytes_)
    with pytest.raises(ob.OutOfMemoryError):
        ob.ops.probe(x, bytes=bytes_, out=ob.empty(3, dtype=np.float64))
    np.testing.assert_array_equal(ob.ops.probe(x, bytes=4096), x)
    np.testing.assert_array_equal(ob.ops.probe(ob.asarray(x), bytes=4096).numpy(), x)


def test_a_call_after_unload_fails_at_the_call(probe_plugin: Path) -> None:
    lib = ob.load_library(probe_plugin)
    op = ob.ops.get("probe")
    x = np.arange(3.0)
    t = ob.asarray(x)
    for _ in range(3):  # the memos now remember this signature
        np.testing.assert_array_equal(op(x), x)
        np.testing.assert_array_equal(op(t).numpy(), x)
    lib.unload()
    for arg in [x, t]:
        with pytest.raises(ob.OpBridgeError, match="was unloaded"):
            op(arg)
        with pytest.raises(ob.OpBridgeError, match="was unloaded"):
            op(arg, bytes=64)
    with pytest.raises(ob.OpBridgeError, match="was unloaded"):
        op(x, out=ob.empty(3, dtype=np.float64))
    assert ob.current_stream().query(), "nothing was enqueued"


# --- messages -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda: ob.ops.embedding_bag(np.ones((3, 2)), np.array([0]), np.array([0]), mode="x"),
        lambda: ob.ops.embedding_bag(ob.asarray(np.ones((3, 2))), np.array([0]), np.array([0]), mode="x"),
        lambda: ob.ops.gelu(np.ones(3), approximate="x"),
        lambda: ob.ops.gelu(ob.asarray(np.ones(3)), approximate="x"),
        lambda: ob.ops.embedding_bag(np.ones((3, 2)), np.array([7]), np.array([0])).sum(),
        lambda: ob.ops.embedding_bag(np.ones((3, 2)), np.array([0.5]), np.array([0])),
        lambda: ob.ops.sum(np.ones(3), axis=3),
        lambda: ob.ops.add(np.ones(3), np.ones(2)),
        lambda: ob.ops.matmul(np.ones((2, 3)), np.ones((2, 3))),
        lambda: ob.ops.pow(np.array([2]), np.array([-1])),
        lambda: ob.ops.add(np.ones(3), np.ones(3), out=np.ones(2)),
        lambda: ob.ops.cast(np.ones(3), dtype="complex64"),
        lambda: ob.ops.softmax(np.ones(3), foo=1),
    ],
)
def test_no_op_name_is_doubled(call: Callable[[], object]) -> None:
    with pytest.raises(ob.OpBridgeError) as info:
        call()
    message = str(info.value)
    name = message.split(":", 1)[0]
    assert not message.startswith(f"{name}: {name}:"), message
    assert f"{name}: {name}" not in message, message


def test_unknown_argument_of_an_op_without_attributes() -> None:
    with pytest.raises(ob.ArgumentError) as info:
        ob.ops.add(np.ones(3), np.ones(3), foo=1)
    assert str(info.value) == 'add: unexpected argument "foo"; it takes no arguments besides its inputs (and out=)'
    with pytest.raises(ob.ArgumentError, match=r'unexpected argument "foo"; it takes: axis, keepdims'):
        ob.ops.sum(np.ones(3), foo=1)


def test_docstrings_list_each_inputs_own_dtypes() -> None:
    doc = ob.ops.embedding_bag.__doc__ or ""
    assert "weight: array or Tensor of float16, float32, float64." in doc
    assert "indices: array or Tensor of int32, int64." in doc
    assert "offsets: array or Tensor of int32, int64." in doc
    schema = ob.ops.embedding_bag.schema
    assert schema["input_dtypes"] == [["float16", "float32", "float64"], ["int32", "int64"], ["int32", "int64"]]
    # What the docstring says is what the operator does.
    for dtype in schema["dtypes"]:
        ok_indices = dtype in schema["input_dtypes"][1]
        try:
            ob.ops.embedding_bag(np.ones((3, 2)), np.array([0, 1], dtype), np.array([0], np.int64))
            assert ok_indices, dtype
        except ob.DTypeError:
            assert not ok_indices, dtype
    # Operators without narrower inputs list the operator's dtypes for each.
    assert "a: array or Tensor of float16, float32, float64, int32, int64." in (ob.ops.add.__doc__ or "")


def test_async_errors_read_well() -> None:
    weight = ob.asarray(np.ones((3, 2), np.float32))
    bad = ob.ops.embedding_bag(weight, ob.asarray(np.array([7])), ob.asarray(np.array([0])))
    with pytest.raises(ob.OpBridgeError) as info:
        bad.numpy()
    message = str(info.value)
    stream = ob.current_stream()
    assert message.startswith(
        f"asynchronous error on cpu:0 stream {stream.id}, in the work that wrote this tensor: embedding_bag: "
    ), message
    assert "writing this" not in message
    with pytest.raises(ob.OpBridgeError):
        ob.synchronize()


def test_workspaces_count_against_the_memory_limit(probe: ob.Library, memory_limit) -> None:
    x = np.arange(3.0)
    memory_limit(8 << 20)  # room for a 2 MiB segment of small blocks, as the input needs
    for arg in [x, ob.asarray(x)]:
        with pytest.raises(ob.OutOfMemoryError, match="limit"):
            ob.ops.probe(arg, bytes=16 << 20)
        result = ob.ops.probe(arg, bytes=64 << 10)  # under the limit: fine
        np.testing.assert_array_equal(result if isinstance(result, np.ndarray) else result.numpy(), x)
    ob.synchronize()
    assert ob.get_memory_pool_stats()["allocated_bytes.current"] < 64 << 10, "the workspaces went back"
