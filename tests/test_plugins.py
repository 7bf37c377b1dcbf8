"""Operator libraries (the plugin ABI): the C and Rust example plugins are built, loaded, called in
both versions, unloaded under concurrent calls, and reloaded after a rebuild; invalid files raise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import opbridge as ob

REPO = Path(__file__).resolve().parent.parent
C_EXAMPLE = REPO / "examples" / "plugins" / "c" / "scale_add.c"
# Every feature of plugin ABI 2 in one library (also built by crates/opbridge-ops/tests/plugin.rs).
ABI2_FEATURES = REPO / "tests" / "plugins" / "abi2_features.c"
# The header as opbridge shipped it for ABI 2: libraries built against it must keep loading.
ABI2_INCLUDE = REPO / "tests" / "plugins" / "abi2"
RUST_EXAMPLE = REPO / "examples" / "plugins" / "rust" / "Cargo.toml"
# Kept across runs so the Rust example compiles once (CI's cache of `target/` keeps it too).
RUST_TARGET_DIR = REPO / "target" / "plugin-tests"


def cc(source: Path, out: Path, *extra: str, include: Path | None = None) -> Path:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) to build the plugin")
    headers = str(include or ob.get_include())
    cmd = [compiler, "-O3", "-shared", "-fPIC", "-I", headers, *extra, str(source), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="session")
def c_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cc(C_EXAMPLE, tmp_path_factory.mktemp("c-plugin") / "libscale_add.so")


@pytest.fixture(scope="session")
def rust_plugin() -> Path:
    if shutil.which("cargo") is None:
        pytest.skip("no cargo to build the Rust plugin")
    env = dict(os.environ, CARGO_TARGET_DIR=str(RUST_TARGET_DIR))
    cmd = ["cargo", "build", "--release", "--quiet", "--manifest-path", str(RUST_EXAMPLE)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    return RUST_TARGET_DIR / "release" / "libscale_add_rs.so"


@pytest.fixture(params=["c", "rust"])
def plugin(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_plugin")


@pytest.fixture
def loaded(plugin: Path) -> Iterator[ob.Library]:
    with ob.load_library(plugin) as lib:
        yield lib
    assert not lib.loaded


def test_get_include_ships_the_header() -> None:
    header = Path(ob.get_include()) / "opbridge" / "plugin.h"
    assert "#define OPBRIDGE_PLUGIN_ABI_VERSION 3" in header.read_text()
    assert "opbridge_plugin_init" in header.read_text()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_both_versions_compute(loaded: ob.Library, plugin: Path, rng: np.random.Generator, dtype: type) -> None:
    assert loaded.ops == [("scale_add", 1), ("scale_add", 2)]
    assert loaded.path == str(plugin)
    a: np.ndarray = rng.standard_normal(1000).astype(dtype)
    b: np.ndarray = rng.standard_normal(1000).astype(dtype)
    rtol = 1e-6 if dtype == np.float32 else 1e-12

    v1 = ob.ops.get("scale_add", version=1)(a, b, alpha=2.0)
    np.testing.assert_allclose(v1, a * 2 + b, rtol=rtol)
    assert v1.dtype == dtype
    latest = ob.ops.scale_add(a, b, alpha=2.0, beta=0.5)
    np.testing.assert_allclose(latest, a * 2 + b * 0.5, rtol=rtol)
    assert ob.ops.scale_add.version == 2
    # The versions differ where they should, and agree at beta = 1.
    assert not np.allclose(v1, latest)
    np.testing.assert_allclose(ob.ops.scale_add(a, b, alpha=2.0), v1, rtol=rtol)
    # Defaults come from the descriptor: alpha = beta = 1.
    np.testing.assert_allclose(ob.ops.get("scale_add", version=2)(a, b), a + b, rtol=rtol)


def test_strided_inputs_out_and_tensors(loaded: ob.Library) -> None:
    base = np.arange(20, dtype=np.float64)
    a, b = base[::2], base[1::2][::-1]
    np.testing.assert_allclose(ob.ops.scale_add(a, b, alpha=3.0, beta=-1.0), a * 3 - b)
    out = np.empty(10)
    assert ob.ops.scale_add(a, b, out=out) is out
    np.testing.assert_allclose(out, a + b)
    m = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(ob.ops.scale_add(m.T, m.T, alpha=2.0), m.T * 3)
    ta, tb = ob.asarray(a), ob.asarray(b)
    t = ob.ops.get("scale_add", version=1)(ta, tb, alpha=2.0)
    assert isinstance(t, ob.Tensor)
    np.testing.assert_allclose(t.numpy(), a * 2 + b)


def test_repeated_and_alternating_call_signatures(loaded: ob.Library) -> None:
    # opbridge reuses the shape function's last result for an identical call (inputs and
    # attributes): every change of shape, dtype or attribute must still be seen.
    v2 = ob.ops.get("scale_add", version=2)
    shapes = [(4,), (4,), (2, 2), (4,), (3, 5), (3, 5)]
    for i, shape in enumerate(shapes):
        dtype = np.float32 if i % 2 else np.float64
        a = np.full(shape, 2, dtype)
        b = np.ones(shape, dtype)
        for alpha, beta in [(1.0, 1.0), (3.0, 1.0), (3.0, -1.0)]:
            r = v2(a, b, alpha=alpha, beta=beta)
            assert r.shape == shape and r.dtype == dtype
            np.testing.assert_array_equal(r, a * alpha + b * beta)
        with pytest.raises(ob.ShapeError):
            v2(a, np.ones((7,), dtype))
        with pytest.raises(ob.DTypeError):
            v2(a, b.astype(np.float32 if dtype == np.float64 else np.float64))


def test_errors_are_typed(loaded: ob.Library) -> None:
    a = np.ones(4, np.float32)
    with pytest.raises(ob.ShapeError, match=r"scale_add: .*shape.*\[?5"):
        ob.ops.scale_add(a, np.ones(5, np.float32))
    with pytest.raises(ob.DTypeError, match="scale_add"):
        ob.ops.scale_add(a, np.ones(4, np.float64))
    with pytest.raises(ob.DTypeError, match="float32, float64"):
        ob.ops.scale_add(np.ones(4, np.int32), np.ones(4, np.int32))
    # A kernel's status and message: ArgumentError (a ValueError) with the kernel's words.
    with pytest.raises(ob.ArgumentError, match="alpha and beta must be finite") as info:
        ob.ops.scale_add(a, a, alpha=float("nan"))
    assert isinstance(info.value, ValueError)
    with pytest.raises(ob.ArgumentError, match="gamma"):
        ob.ops.scale_add(a, a, gamma=1.0)


def test_listed_with_their_source(loaded: ob.Library, plugin: Path) -> None:
    info = next(op for op in ob.list_ops() if op["name"] == "scale_add")
    assert info["versions"] == [1, 2]
    assert info["source"] == str(plugin)
    assert info["dtypes"] == ["float32", "float64"]
    assert "scale_add" in repr(loaded) and "v2" in repr(loaded)
    assert "example plugin" in (ob.ops.scale_add.__doc__ or "")


def test_unload_unregisters_and_stale_ops_fail_cleanly(plugin: Path) -> None:
    lib = ob.load_library(plugin)
    op = ob.ops.get("scale_add", version=1)
    a = np.ones(3)
    np.testing.assert_allclose(op(a, a), 2 * a)
    lib.unload()
    assert not lib.loaded and "unloaded" in repr(lib)
    lib.unload()  # twice: nothing happens
    with pytest.raises(ob.OpBridgeError, match="unknown operator"):
        ob.ops.get("scale_add")
    with pytest.raises(AttributeError):
        ob.ops.scale_add  # noqa: B018
    with pytest.raises(ob.OpBridgeError, match="was unloaded"):
        op(a, a)
    assert all(info["name"] != "scale_add" for info in ob.list_ops())


def test_loading_twice_is_an_error_and_keeps_the_first(loaded: ob.Library, plugin: Path) -> None:
    with pytest.raises(ob.OpBridgeError, match="already registered"):
        ob.load_library(plugin)
    a = np.ones(2)
    np.testing.assert_allclose(ob.ops.scale_add(a, a), 2 * a)


def test_c_and_rust_plugins_agree(c_plugin: Path, rust_plugin: Path, rng: np.random.Generator) -> None:
    a, b = rng.standard_normal(100), rng.standard_normal(100)
    results = []
    for path in (c_plugin, rust_plugin):
        with ob.load_library(path):
            results.append(ob.ops.scale_add(a, b, alpha=1.5, beta=-2.0))
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("hold_op", [False, True], ids=["lookup-per-call", "held-op"])
def test_unload_under_concurrent_calls(plugin: Path, hold_op: bool) -> None:
    lib = ob.load_library(plugin)
    a = np.ones(1 << 18)  # big enough that calls release the GIL and overlap the unload
    expected = a * 2 + a
    stop = threading.Event()
    outcomes: list[tuple[str, float]] = []  # (outcome, when the call started)
    failures: list[BaseException] = []

    def worker() -> None:
        held = ob.ops.get("scale_add", version=1) if hold_op else None
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    op = held if held is not None else ob.ops.get("scale_add", version=1)
                    out = op(a, a, alpha=2.0)
                    np.testing.assert_array_equal(out, expected)
                    outcomes.append(("ok", started))
                except ob.OpBridgeError as e:
                    assert "unknown operator" in str(e) or "was unloaded" in str(e), str(e)
                    outcomes.append(("gone", started))
        except BaseException as e:  # reported below, not lost in the thread
            failures.append(e)

    def wait_for(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline and not failures:
            time.sleep(0.001)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(o == "ok" for o, _ in outcomes) >= 20)
    lib.unload()
    unloaded = time.monotonic()
    wait_for(lambda: sum(s > unloaded for _, s in outcomes) >= 20)
    stop.set()
    for t in threads:
        t.join()
    assert not failures, failures
    assert sum(o == "ok" for o, _ in outcomes) >= 20
    # Calls begun before the unload may complete; every call begun after it fails cleanly.
    after = [o for o, started in outcomes if started > unloaded]
    assert len(after) >= 20 and set(after) == {"gone"}


def test_reload_after_rebuilding_the_same_path(tmp_path: Path) -> None:
    source = C_EXAMPLE.read_text()
    changed = tmp_path / "changed.c"
    changed.write_text(source.replace("pa[i] * al + pb[i] * be;", "pa[i] * al + pb[i] * be + 1000;"))
    path = tmp_path / "libscale_add.so"
    a = np.ones(4, np.float32)
    for src, offset in [(C_EXAMPLE, 0), (changed, 1000), (C_EXAMPLE, 0)]:
        cc(src, path)
        with ob.load_library(path):
            np.testing.assert_array_equal(ob.ops.scale_add(a, a), 2 * a + offset)


def test_invalid_files_raise(tmp_path: Path) -> None:
    text = tmp_path / "libnot_a_plugin.so"
    text.write_text("not an ELF file")
    with pytest.raises(ob.OpBridgeError, match="not a loadable shared library"):
        ob.load_library(text)
    with pytest.raises(ob.OpBridgeError, match="no such file"):
        ob.load_library(tmp_path / "missing.so")
    plain = tmp_path / "plain.c"
    plain.write_text("int answer(void) { return 42; }\n")
    with pytest.raises(ob.OpBridgeError, match="opbridge_plugin_init"):
        ob.load_library(cc(plain, tmp_path / "libplain.so"))
    wrong_abi = tmp_path / "wrong_abi.c"
    wrong_abi.write_text(
        "#include <opbridge/plugin.h>\n"
        "OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *h, OpbPluginInfo *info) {\n"
        "  (void)h; info->abi_version = 99; return OPB_ERR_ABI_MISMATCH; }\n"
    )
    with pytest.raises(ob.OpBridgeError, match="ABI version mismatch"):
        ob.load_library(cc(wrong_abi, tmp_path / "libwrong_abi.so"))


def test_library_class_loads_too(c_plugin: Path) -> None:
    lib = ob.Library(c_plugin)
    try:
        assert isinstance(lib, ob.Library) and lib.loaded
    finally:
        lib.unload()


def test_op_attributes_follow_loads_and_unloads_under_threads(c_plugin: Path) -> None:
    # `ob.ops.<name>` is cached as a module attribute: readers racing loads and unloads must
    # never leave one behind that names an unloaded operator.
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                ob.ops.scale_add  # noqa: B018
            except AttributeError:
                pass

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers:
        t.start()
    try:
        for _ in range(20):
            lib = ob.load_library(str(c_plugin))
            assert ob.ops.scale_add.version == 2
            lib.unload()
            with pytest.raises(AttributeError):
                ob.ops.scale_add  # noqa: B018
    finally:
        stop.set()
        for t in readers:
            t.join()


@pytest.fixture(scope="session")
def abi2_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built against the ABI 2 header, as its users built it: it loads unchanged (CPU only).
    out = tmp_path_factory.mktemp("abi2-plugin") / "libabi2_features.so"
    return cc(ABI2_FEATURES, out, include=ABI2_INCLUDE)


@pytest.fixture
def abi2(abi2_plugin: Path) -> Iterator[ob.Library]:
    with ob.load_library(abi2_plugin) as lib:
        yield lib


def combine_stats() -> tuple[int, int]:
    """(calls of `combine`'s callbacks so far, whether its last kernel call wrote over `a`)."""
    calls, in_place = ob.ops.combine_stats()
    return int(calls), int(in_place)


def test_abi2_library_loads_with_its_signature(abi2: ob.Library) -> None:
    assert abi2.ops == [("combine", 1), ("combine", 2), ("combine_stats", 1)]
    assert abi2.abi_version == 2, "built against the frozen ABI 2 header"
    combine = next(op for op in ob.list_ops() if op["name"] == "combine")
    assert combine["by_version"][2]["devices"] == ["cpu"]
    info = next(op for op in ob.list_ops() if op["name"] == "combine")
    assert info["dtypes"] == ["float64", "int32"]
    assert ob.ops.combine.schema["inputs"] == [("a", False), ("b", True)]
    assert ob.ops.combine.signature == 'combine(a, b=None, *, mode="sum", offsets=[1, 2], scale=None, out=None)'
    assert ob.ops.combine.signature in (ob.ops.combine.__doc__ or "")


def test_abi2_string_list_and_none_attributes(abi2: ob.Library) -> None:
    a, b = np.array([1.0, 5.0, -2.0]), np.array([4.0, 2.0, -3.0])
    # Defaults: mode "sum", offsets [1, 2] in turn, scale None.
    np.testing.assert_array_equal(ob.ops.combine(a, b), a + b + [1, 2, 1])
    # The string chooses the behaviour; a value the library refuses is its typed error.
    np.testing.assert_array_equal(ob.ops.combine(a, b, mode="max"), np.maximum(a, b) + [1, 2, 1])
    with pytest.raises(ob.ArgumentError, match="mode must be"):
        ob.ops.combine(a, b, mode="prod")
    # Lists: any sequence of ints, empty too.
    np.testing.assert_array_equal(ob.ops.combine(a, b, offsets=[10, 20, 30]), a + b + [10, 20, 30])
    np.testing.assert_array_equal(ob.ops.combine(a, b, offsets=(7,)), a + b + 7)
    np.testing.assert_array_equal(ob.ops.combine(a, b, offsets=[]), a + b)
    # A DEFAULT_NONE int: None or a value.
    np.testing.assert_array_equal(ob.ops.combine(a, b, scale=None), a + b + [1, 2, 1])
    np.testing.assert_array_equal(ob.ops.combine(a, b, scale=3), (a + b + [1, 2, 1]) * 3)
    # Repeated calls with changing strings and lists are all seen (the shape-function memo).
    for mode in ["sum", "max", "sum", "max"]:
        for offsets in ([1], [2], [1, 1]):
            got = ob.ops.combine(a, b, mode=mode, offsets=offsets)
            base = a + b if mode == "sum" else np.maximum(a, b)
            np.testing.assert_array_equal(got, base + np.resize(offsets, 3))


def test_abi2_optional_input(abi2: ob.Library) -> None:
    a, b = np.array([1.0, 5.0, -2.0]), np.array([4.0, 2.0, -3.0])
    with_b = ob.ops.combine(a, b, offsets=[])
    np.testing.assert_array_equal(with_b, a + b)
    np.testing.assert_array_equal(ob.ops.combine(a, b=b, offsets=[]), with_b)
    # Left out, or passed as None: the library sees it absent (and counts it as 0).
    np.testing.assert_array_equal(ob.ops.combine(a, offsets=[]), a)
    np.testing.assert_array_equal(ob.ops.combine(a, None, offsets=[]), a)
    np.testing.assert_array_equal(ob.ops.combine(a, b=None, mode="max", offsets=[]), np.maximum(a, 0))
    with pytest.raises(TypeError, match='missing required tensor argument "a"'):
        ob.ops.combine(None, b)
    with pytest.raises(ob.ShapeError, match="b must have the shape of a"):
        ob.ops.combine(a, np.ones(2))


def test_abi2_input_dtypes_promote_int32_before_the_kernel(abi2: ob.Library) -> None:
    # The kernel refuses anything but float64, so an int32 input reaching it would raise.
    a = np.array([1, 2, 3], np.int32)
    b = np.array([10.0, 20.0, 30.0])
    out = ob.ops.combine(a, b, offsets=[])
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [11.0, 22.0, 33.0])
    np.testing.assert_array_equal(ob.ops.combine(a, a, offsets=[]), [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(ob.ops.combine(a, offsets=[], scale=2), [2.0, 4.0, 6.0])
    assert a.dtype == np.int32 and list(a) == [1, 2, 3], "the caller's array is not converted in place"
    with pytest.raises(ob.DTypeError, match="float64, int32"):
        ob.ops.combine(np.ones(3, np.float32))


def test_abi2_in_place_flag_lets_out_be_an_input(abi2: ob.Library) -> None:
    a, b = np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.0, 1.0])
    # Version 2 is OPB_OP_IN_PLACE_OK: the kernel writes over `a` itself.
    assert ob.ops.combine(a, b, offsets=[], out=a) is a
    np.testing.assert_array_equal(a, [2.0, 3.0, 4.0])
    assert combine_stats()[1] == 1
    # Version 1 is not: opbridge computes aside and copies back; the kernel never sees `out` over `a`.
    v1 = ob.ops.get("combine", version=1)
    assert v1(a, b, offsets=[], out=a) is a
    np.testing.assert_array_equal(a, [3.0, 4.0, 5.0])
    assert combine_stats()[1] == 0
    # A fresh output is not in place either.
    ob.ops.combine(a, b)
    assert combine_stats()[1] == 0


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"offsets": "1, 2"}, "expected offsets to be a list of ints"),
        ({"offsets": 1.5}, "expected offsets to be a list of ints"),
        ({"mode": None}, "expected mode to be a string, got None"),
        ({"mode": [1, 2]}, "expected mode to be a string"),
        ({"scale": 2.5}, "expected scale to be an int or None"),
        ({"scale": "2"}, "expected scale to be an int or None"),
    ],
)
def test_abi2_wrong_kind_attributes_raise_before_the_library_runs(
    abi2: ob.Library, attrs: dict[str, object], message: str
) -> None:
    a = np.ones(3)
    calls = combine_stats()[0]
    with pytest.raises(ob.ArgumentError, match=message):
        ob.ops.combine(a, **attrs)
    with pytest.raises(ob.ArgumentError, match=message):
        ob.ops.combine(a, a, **attrs, out=np.empty(3))
    assert combine_stats()[0] == calls, "a callback of the library ran"


def test_abi2_malformed_new_fields_are_load_errors(tmp_path: Path) -> None:
    source = ABI2_FEATURES.read_text()
    scale = '.flags = OPB_ATTR_DEFAULT_NONE, .doc = "factor of the result, or None"'
    offsets = ".n_default_ints = 2,"
    cases = {
        "attr_flags": (
            scale,
            scale.replace("OPB_ATTR_DEFAULT_NONE", "OPB_ATTR_DEFAULT_NONE | 16"),
            'attribute "scale": unknown flags 0x10',
        ),
        "required_none": (
            scale,
            scale.replace("OPB_ATTR_DEFAULT_NONE", "OPB_ATTR_DEFAULT_NONE | OPB_ATTR_REQUIRED"),
            'attribute "scale": OPB_ATTR_REQUIRED and OPB_ATTR_DEFAULT_NONE contradict each other',
        ),
        "many_ints": (offsets, ".n_default_ints = 65,", 'attribute "offsets": n_default_ints is 65; expected 0 to 64'),
        "op_flags": (
            "COMBINE(2, OPB_OP_IN_PLACE_OK)",
            "COMBINE(2, OPB_OP_IN_PLACE_OK | 8)",
            'operator "combine": unknown operator flags 0x8',
        ),
    }
    for name, (old, new, message) in cases.items():
        assert old in source, old
        src = tmp_path / f"{name}.c"
        src.write_text(source.replace(old, new))
        with pytest.raises(ob.OpBridgeError, match="malformed descriptor ops") as info:
            ob.load_library(cc(src, tmp_path / f"lib{name}.so", include=ABI2_INCLUDE))
        assert message in str(info.value)
        assert all(op["name"] != "combine" for op in ob.list_ops())


def test_a_library_built_for_abi_1_is_refused(tmp_path: Path) -> None:
    old = tmp_path / "abi1.c"
    old.write_text(
        "#include <opbridge/plugin.h>\n"
        "OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *h, OpbPluginInfo *info) {\n"
        "  (void)h; info->abi_version = 1; return OPB_OK; }\n"
    )
    with pytest.raises(ob.OpBridgeError, match="built for plugin ABI 1, this opbridge loads ABI 2 to 3.*rebuild"):
        ob.load_library(cc(old, tmp_path / "libabi1.so"))


UNLOAD_FROM_HOST_FUNCTION = """
import sys, threading
import numpy as np
import opbridge as ob

lib = ob.load_library(sys.argv[1])
a = ob.asarray(np.ones(4))
s, other = ob.Stream(), ob.Stream()
gate, finished, result = threading.Event(), threading.Event(), []

def unload():
    try:
        lib.unload()
        result.append("returned")
    except ob.OpBridgeError as e:
        result.append(f"{type(e).__name__}: {e}")
    finally:
        finished.set()

s.launch_host_func(lambda: gate.wait(20))
s.launch_host_func(unload)
{extra}
with {stream}:
    r = ob.ops.scale_add(a, a, alpha=2.0)  # queued on {stream}
gate.set()
assert finished.wait(20), "the unload hung"
print(result[0])
ob.synchronize()
np.testing.assert_array_equal(r.numpy(), 3 * np.ones(4))  # the queued call still ran
print("unregistered" if all(i["name"] != "scale_add" for i in ob.list_ops()) else "still registered")
"""


@pytest.mark.parametrize(
    ("stream", "extra", "expected"),
    [
        ("s", "", "DeviceError"),  # the call is queued behind the unloading host function
        ("other", "other.wait_stream(s)", "DeviceError"),  # on a stream that waits for it
        ("other", "", "returned"),  # on an independent stream: the unload waits for it
    ],
    ids=["same-stream", "stream-waiting-on-it", "independent-stream"],
)
def test_unload_from_a_host_function(c_plugin: Path, stream: str, extra: str, expected: str) -> None:
    """An unload from a host function raises (instead of hanging) when a call of the library is
    queued behind that host function; the call still runs, and the operators are gone."""
    code = UNLOAD_FROM_HOST_FUNCTION.replace("{stream}", stream).replace("{extra}", extra)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(c_plugin)], capture_output=True, text=True, timeout=60, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the unload from a host function hung")
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert first.startswith(expected), first
    assert second == "unregistered"


def test_plugin_crash_hazard_is_documented_where_authors_and_users_read():
    # A crashing plugin kernel cannot be caught in-process: the docs must say so and say how to find it.
    from pathlib import Path

    header = (Path(ob.get_include()) / "opbridge" / "plugin.h").read_text()
    readme = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    for text in (ob.load_library.__doc__, ob.Library.__doc__, header, readme):
        assert text and "faulthandler" in text and "subprocess" in text
        assert "doctor --plugin" in text and "planned" not in text


def test_a_failed_load_still_calls_the_release_callback(tmp_path: Path) -> None:
    """opbridge_plugin_init succeeded, then a descriptor is refused: the library is closed, and
    its release callback runs first (it may have set things up in init)."""
    marker = tmp_path / "released"
    source = tmp_path / "bad_after_init.c"
    source.write_text(
        "#include <stdio.h>\n#include <opbridge/plugin.h>\n"
        'static void release(void) { FILE *f = fopen(MARKER, "w"); if (f) fclose(f); }\n'
        'static const OpbOpDesc ops[] = {{.name = "bad op", .version = 1}};\n'
        "OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *h, OpbPluginInfo *info) {\n"
        "  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;\n"
        "  if (h->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;\n"
        "  info->n_ops = 1; info->ops = ops; info->release = release; return OPB_OK; }\n"
    )
    library = cc(source, tmp_path / "libbad_after_init.so", f'-DMARKER="{marker}"')
    with pytest.raises(ob.OpBridgeError, match="malformed descriptor"):
        ob.load_library(library)
    assert marker.exists(), "the release callback ran"
