"""ob.calibrate(): measured thresholds, saved per user, loaded by later runs."""

import json
import os
import subprocess
import sys

import pytest

import opbridge as ob


def test_calibrate_measures_applies_and_saves(tmp_path, monkeypatch):
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path))
    before = ob.tuning.thresholds()
    try:
        measured = ob.calibrate()
        assert set(measured) == {
            "elementwise_parallel_min_elems",
            "matmul_parallel_min_flops",
            "transcendental_parallel_min_elems",
        }
        assert all(v > 0 for v in measured.values())
        assert ob.tuning.thresholds() == measured
        assert json.loads((tmp_path / "thresholds.json").read_text()) == measured
    finally:
        ob._native.set_thresholds(before)


def test_a_later_run_loads_the_saved_thresholds(tmp_path):
    (tmp_path / "thresholds.json").write_text(json.dumps({"elementwise_parallel_min_elems": 12345}))
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path)}
    code = "import opbridge as ob; print(ob.tuning.thresholds()['elementwise_parallel_min_elems'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "12345"


def test_a_malformed_file_is_ignored_with_a_warning(tmp_path):
    (tmp_path / "thresholds.json").write_text("{not json")
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path)}
    code = "import opbridge as ob; print(ob.tuning.thresholds()['elementwise_parallel_min_elems'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(ob._native.PARALLEL_MIN_ELEMS)
    assert "ignoring unreadable thresholds file" in out.stderr


# Every malformed thresholds file: a warning and the defaults, never an import failure.
BAD_FILES = {
    "too_large": json.dumps({"elementwise_parallel_min_elems": 2**64}),
    "far_too_large": json.dumps({"matmul_parallel_min_flops": 10**400}),
    "negative": json.dumps({"elementwise_parallel_min_elems": -5}),
    "zero": json.dumps({"elementwise_parallel_min_elems": 0}),
    "float": json.dumps({"elementwise_parallel_min_elems": 1.5}),
    "nan": '{"elementwise_parallel_min_elems": NaN}',
    "bool": json.dumps({"elementwise_parallel_min_elems": True}),
    "string": json.dumps({"elementwise_parallel_min_elems": "100"}),
    "null": json.dumps({"elementwise_parallel_min_elems": None}),
    "nested": json.dumps({"elementwise_parallel_min_elems": {"v": 5}}),
    "list_value": json.dumps({"elementwise_parallel_min_elems": [5]}),
    "unknown_key": json.dumps({"no_such_threshold": 5}),
    "not_json": "{not json",
    "empty": "",
    "not_an_object": json.dumps([1, 2, 3]),
    "a_number": "42",
    "deeply_nested": "[" * 100000 + "]" * 100000,
    "binary": b"\xff\xfe\x00garbage",
}


def _defaults() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", "import opbridge as ob, json; print(json.dumps(ob.tuning.thresholds()))"],
        env={**os.environ, "OPBRIDGE_CACHE_DIR": "/nonexistent/opbridge-test"},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def _write(folder, content) -> None:
    path = folder / "thresholds.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_import_survives_a_malformed_thresholds_file(tmp_path, name):
    _write(tmp_path, BAD_FILES[name])
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(tmp_path)}
    code = "import opbridge as ob, json; print(json.dumps(ob.tuning.thresholds()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == _defaults()
    assert "RuntimeWarning" in out.stderr and "thresholds file" in out.stderr, out.stderr


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_malformed_thresholds_file_warns_and_keeps_defaults(tmp_path, monkeypatch, name):
    _write(tmp_path, BAD_FILES[name])
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path))
    before = ob.tuning.thresholds()
    try:
        with pytest.warns(RuntimeWarning, match="thresholds file"):
            ob.tuning._load_saved()
        assert ob.tuning.thresholds() == before
    finally:
        ob._native.set_thresholds(before)


def test_good_values_apply_beside_bad_ones(tmp_path, monkeypatch):
    _write(tmp_path, json.dumps({"matmul_parallel_min_flops": 4321, "elementwise_parallel_min_elems": -1, "x": 1}))
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path))
    before = ob.tuning.thresholds()
    try:
        with pytest.warns(RuntimeWarning) as record:
            ob.tuning._load_saved()
        assert len(record) == 2  # the negative value and the unknown key
        now = ob.tuning.thresholds()
        assert now["matmul_parallel_min_flops"] == 4321
        assert now["elementwise_parallel_min_elems"] == before["elementwise_parallel_min_elems"]
    finally:
        ob._native.set_thresholds(before)


def test_a_directory_in_place_of_the_file_and_an_unreadable_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(tmp_path))
    (tmp_path / "thresholds.json").mkdir()
    with pytest.warns(RuntimeWarning, match="unreadable thresholds file"):
        ob.tuning._load_saved()
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("OPBRIDGE_CACHE_DIR", str(blocker))  # a file where the folder should be
    with pytest.warns(RuntimeWarning, match="unreadable thresholds file"):
        ob.tuning._load_saved()


def test_import_with_the_file_found_through_xdg_cache_home_and_warnings_as_errors(tmp_path):
    (tmp_path / "opbridge").mkdir()
    _write(tmp_path / "opbridge", json.dumps({"elementwise_parallel_min_elems": 2**70}))
    env = {k: v for k, v in os.environ.items() if k != "OPBRIDGE_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path), HOME=str(tmp_path))
    code = "import opbridge as ob, json; print(json.dumps(ob.tuning.thresholds()))"
    # -W error turns the warning into an exception: the import still succeeds (message on stderr).
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == _defaults()
    assert "thresholds file" in out.stderr
