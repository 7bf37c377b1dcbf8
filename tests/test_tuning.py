"""ob.calibrate(): measured thresholds, saved per user, loaded by later runs."""

import json
import os
import subprocess
import sys

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
