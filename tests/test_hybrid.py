"""device="auto": numpy calls routed to the host kernel or staged through an accelerator by a
crossover measured per operator and dtype (ob.calibrate), with ob.explain saying why. Runs on
the Ascend test double (conftest puts it on OPBRIDGE_ASCEND_LIB_DIR)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import opbridge as ob
from conftest import ASCEND_LIB_DIR

pytestmark = pytest.mark.skipif(ASCEND_LIB_DIR is None, reason="the Ascend test double could not be built")
DEV = "ascend:0"


@pytest.fixture(autouse=True)
def _no_crossovers():
    ob._native.clear_crossovers()
    yield
    ob._native.clear_crossovers()


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "OPBRIDGE_ASCEND_LIB_DIR": str(ASCEND_LIB_DIR), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=120
    )


def test_uncalibrated_auto_stays_on_the_host_and_says_why() -> None:
    a = np.arange(5000, dtype=np.float32)
    assert np.array_equal(ob.ops.add(a, a, device="auto"), a + a)
    why = ob.explain("add", a, a)
    assert why["path"] == "host"
    assert "no crossover measured for add in float32" in why["reason"] and "ob.calibrate()" in why["reason"]


@pytest.mark.parametrize("op", ["add", "sub", "mul", "maximum", "vector_add"])
def test_a_forced_crossover_routes_by_size_and_results_agree(op: str) -> None:
    ob.set_crossover(op, "float32", 1000)
    f = ob.vector_add if op == "vector_add" else getattr(ob.ops, op)
    rng = np.random.default_rng(0)
    for n in (1, 999, 1000, 4097):
        a, b = rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)
        path = ob.explain(op, a, b)["path"]
        assert path == ("host" if n < 1000 else DEV), (n, ob.explain(op, a, b))
        want = f(a, b)  # the host path
        np.testing.assert_array_equal(f(a, b, device="auto"), want)
        np.testing.assert_array_equal(f(a, b, device=DEV), want)


def test_the_route_is_observable_in_the_driver() -> None:
    """With aclnnAdd failing from its first call, small `device="auto"` calls (host) keep
    working and the large one (staged through the device) meets the failure."""
    done = run_python(
        """
        import numpy as np, opbridge as ob
        ob.set_crossover("add", "float32", 1 << 16)
        small = np.ones(100, np.float32)
        for _ in range(100):
            assert ob.ops.add(small, small, device="auto")[0] == 2
        print("small ok", flush=True)
        big = np.ones(1 << 16, np.float32)
        ob.ops.add(big, big, device="auto")
        """,
        ACLDOUBLE_FAIL="aclnnAdd:1",
    )
    assert "small ok" in done.stdout, done.stderr
    assert done.returncode != 0 and "aclnnAdd" in done.stderr, done.stderr


def test_the_device_measured_elsewhere_is_not_used() -> None:
    a = np.ones(4096, np.float32)
    ob._native.set_crossover("add", "float32", DEV, 1000, "Ascend310P3 via /opt/other/libascendcl.so")
    why = ob.explain("add", a, a)
    assert why["path"] == "host"
    assert "measured on Ascend310P3" in why["reason"] and "run ob.calibrate()" in why["reason"]
    assert np.array_equal(ob.ops.add(a, a, device="auto"), a + a)


def test_a_crossover_is_keyed_by_chip_library_and_runtime_version() -> None:
    """A driver upgrade (same chip, same library path) is another device for the measurements."""
    identity = ob._native.device_identity(DEV)
    report = next(d for d in ob.devices() if d["name"] == DEV)
    assert identity == f"{report['soc']} via {report['library']} (runtime {report['driver_version']})"
    assert report["driver_version"] == "1.17.0"  # the double's aclrtGetVersion
    a = np.ones(4096, np.float32)
    older = identity.replace("(runtime 1.17.0)", "(runtime 1.16.2)")
    ob._native.set_crossover("add", "float32", DEV, 1000, older)
    assert ob.explain("add", a, a)["path"] == "host"
    ob._native.set_crossover("add", "float32", DEV, 1000, identity)
    assert ob.explain("add", a, a)["path"] == DEV


def test_what_auto_keeps_on_the_host_is_explained() -> None:
    ob.set_crossover("add", "float32", 1)
    a = np.ones(64, np.float32)
    out = np.empty_like(a)
    assert ob.explain("add", a, a, out=out)["path"] == "host"
    assert ob.ops.add(a, a, out=out, device="auto") is out and out[0] == 2
    assert "one shape and dtype" in ob.explain("add", a, a[:8])["reason"]  # broadcasting
    assert ob.explain("add", a, a.astype(np.float64))["path"] == "host"  # mixed dtypes
    assert "elementwise" in ob.explain("softmax", a)["reason"]
    t = ob.asarray(a, device=DEV)
    why = ob.explain(ob.ops.add, t, t)
    assert why["path"] == DEV and "where they live" in why["reason"]
    assert ob.explain("add", a, a, device="cpu")["path"] == "host"
    assert ob.explain("add", a, a, device=DEV)["path"] == DEV
    # what an explicit device refuses, explain says (and the call raises)
    assert ob.explain("add", t, t, device=DEV)["path"] == "error"
    with pytest.raises(ob.ArgumentError, match="already lives on a device"):
        ob.ops.add(t, t, device=DEV)
    assert "elementwise" in ob.explain("softmax", a, device=DEV)["reason"]
    # integer pow stays on the host's own checks, even with a crossover for it
    ob._native.set_crossover("pow", "int32", DEV, 1, ob._native.device_identity(DEV))
    i = np.arange(8, dtype=np.int32)
    assert ob.explain("pow", i, i)["path"] == "host"


def test_set_crossover_checks_what_it_is_given() -> None:
    with pytest.raises(ob.ArgumentError, match="cannot stage softmax"):
        ob.set_crossover("softmax", "float32", 10)
    with pytest.raises(ob.ArgumentError, match="cannot stage add in float8"):
        ob.set_crossover("add", "float8", 10)
    with pytest.raises(ob.ArgumentError, match="positive int"):
        ob.set_crossover("add", "float32", -5)
    with pytest.raises(ob.DeviceError, match="not available"):
        ob.set_crossover("add", "float32", 10, device="ascend:7")
    assert ob.crossovers() == []


def test_calibrate_keeps_other_devices_entries(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path))
    other = {"op": "add", "dtype": "float32", "device": "ascend:5", "elems": 4096, "identity": "Ascend310P3 via x"}
    (tmp_path / "crossovers.json").write_text(json.dumps([other]))
    before = ob.tuning.thresholds()
    try:
        ob.calibrate()
    finally:
        ob._native.set_thresholds(before)
    saved = json.loads((tmp_path / "crossovers.json").read_text())
    assert other in saved and any(e["device"] == DEV for e in saved)


def test_device_arguments_are_checked() -> None:
    a = np.ones(8, np.float32)
    with pytest.raises(ob.ArgumentError, match="device= takes a device name"):
        ob.ops.add(a, a, device=3)
    with pytest.raises(ob.OpBridgeError):
        ob.ops.add(a, a, device="gpu:7")
    with pytest.raises(ob.ArgumentError, match="elementwise"):
        ob.ops.softmax(a, device=DEV)
    with pytest.raises(ob.ArgumentError, match="accelerator"):
        ob._native.set_crossover("add", "float32", "cpu", 10, "x")
    with pytest.raises(ob.ArgumentError, match="unknown dtype"):
        ob._native.set_crossover("add", "float33", DEV, 10, "x")


def test_calibrate_measures_saves_and_a_later_run_loads_the_crossovers(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path))
    before = ob.tuning.thresholds()
    try:
        ob.calibrate()
    finally:
        ob._native.set_thresholds(before)
    saved = json.loads((tmp_path / "crossovers.json").read_text())
    staged = {name for name, _, _ in ob._native.staged_ops(DEV)}
    assert {e["op"] for e in saved} == staged
    assert {e["dtype"] for e in saved} == {"float32", "float16"}
    identity = ob._native.device_identity(DEV)
    assert all(e["device"] == DEV and e["identity"] == identity for e in saved)
    assert all(e["elems"] is None or e["elems"] > 0 for e in saved)
    assert sorted(map(json.dumps, ob.crossovers())) == sorted(map(json.dumps, saved))
    # A forced entry in the file is what a later run follows.
    (tmp_path / "crossovers.json").write_text(
        json.dumps([{"op": "mul", "dtype": "float32", "device": DEV, "elems": 128, "identity": identity}])
    )
    done = run_python(
        """
        import numpy as np, opbridge as ob
        a = np.ones(256, np.float32)
        print(ob.explain("mul", a, a)["path"], ob.explain("mul", a[:8], a[:8])["path"])
        """,
        OPBRIDGE_CACHE_DIR=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [DEV, "host"]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"op": "add"}),
        json.dumps([{"op": "add", "dtype": "float32", "device": DEV, "elems": -1, "identity": "x"}]),
        json.dumps([{"op": "add", "dtype": "float99", "device": DEV, "elems": 5, "identity": "x"}]),
        json.dumps([{"op": "add", "dtype": "float32", "device": "cpu", "elems": 5, "identity": "x"}]),
        json.dumps([5]),
    ],
)
def test_a_malformed_crossovers_file_warns_and_changes_nothing(tmp_path, content: str) -> None:
    (tmp_path / "crossovers.json").write_text(content)
    done = run_python(
        "import opbridge as ob; print(len(ob.crossovers()))",
        OPBRIDGE_CACHE_DIR=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"
    assert "crossovers file" in done.stderr


def test_the_profiler_shows_the_path() -> None:
    ob.set_crossover("add", "float32", 1000)
    a, b = np.ones(10, np.float32), np.ones(2000, np.float32)
    with ob.profiler.profile() as prof:
        ob.ops.add(a, a, device="auto")
        ob.ops.add(b, b, device="auto")
    trace = prof.chrome_trace()["traceEvents"]
    paths = [e["args"]["path"] for e in trace if e.get("name") == "hybrid add" and e.get("ph") == "B"]
    assert paths == ["host", DEV]
