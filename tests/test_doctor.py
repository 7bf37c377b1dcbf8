"""`opbridge doctor`: its JSON schema, exit codes, calibration staleness, plugin diagnoses, servers."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import opbridge as ob
from opbridge.doctor import SCHEMA_VERSION, STATUSES

ROOT = Path(__file__).resolve().parent.parent
CHECK_FIELDS = {"section": str, "name": str, "status": str, "found": str, "fix": str, "details": dict}


def validate(report: dict) -> None:
    """The documented schema (opbridge/doctor.py), strictly."""
    assert set(report) == {"schema_version", "opbridge", "status", "summary", "checks"}
    assert report["schema_version"] == SCHEMA_VERSION
    assert report["opbridge"] == ob.__version__
    assert report["status"] in ("ok", "warn", "fail")
    assert set(report["summary"]) == set(STATUSES)
    assert isinstance(report["checks"], list) and report["checks"]
    for check in report["checks"]:
        assert set(check) == set(CHECK_FIELDS), check
        for key, kind in CHECK_FIELDS.items():
            assert isinstance(check[key], kind), (key, check)
        assert check["status"] in STATUSES
        if check["status"] in ("warn", "fail"):
            assert check["fix"], check
        json.dumps(check["details"])  # JSON values only
    for status in STATUSES:
        assert report["summary"][status] == sum(c["status"] == status for c in report["checks"])
    worst = "fail" if report["summary"]["fail"] else "warn" if report["summary"]["warn"] else "ok"
    assert report["status"] == worst


def run_doctor(*args: str, cache: Path) -> tuple[int, str, str]:
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [sys.executable, "-m", "opbridge", "doctor", *args], capture_output=True, text=True, env=env, timeout=120
    )
    return done.returncode, done.stdout, done.stderr


def by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder whose thresholds were measured on this CPU."""
    cache = tmp_path_factory.mktemp("cache")
    env = {**os.environ, "OPBRIDGE_CACHE_DIR": str(cache)}
    subprocess.run([sys.executable, "-c", "import opbridge; opbridge.calibrate()"], env=env, check=True, timeout=120)
    return cache


def test_a_healthy_setup_reports_ok_and_valid_json(calibrated: Path) -> None:
    code, out, _ = run_doctor("--json", cache=calibrated)
    report = json.loads(out)
    validate(report)
    assert code == 0, out
    checks = by_name(report)
    for name in ("versions", "native module", "symbols", "plugin ABI", "cpu", "calibration", "cpu:0", "jit probe"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["plugin ABI"]["found"].startswith("ABI 3")
    features = checks["cpu"]["details"]["features"]
    assert features and all(isinstance(v, bool) for v in features.values())
    assert checks["cpu:0"]["details"]["allocated_before"] == checks["cpu:0"]["details"]["allocated_after"]


def test_the_table_has_a_summary_line(calibrated: Path) -> None:
    code, out, err = run_doctor(cache=calibrated)
    assert code == 0
    assert out.splitlines()[0].startswith("STATUS")
    assert out.splitlines()[-1].startswith("summary: ")
    assert err == ""  # no progress output when stderr is not a terminal


def test_usage_errors_exit_2_and_help_exits_0(tmp_path: Path) -> None:
    assert run_doctor("--no-such-flag", cache=tmp_path)[0] == 2
    code, out, _ = run_doctor("--help", cache=tmp_path)
    assert code == 0 and "--plugin" in out


def test_missing_and_stale_calibration_are_warnings_with_the_command(calibrated: Path, tmp_path: Path) -> None:
    code, out, _ = run_doctor("--json", cache=tmp_path)  # nothing calibrated here
    check = by_name(json.loads(out))["calibration"]
    assert code == 0 and check["status"] == "warn" and "opbridge.calibrate()" in check["fix"]
    stale = tmp_path / "stale"
    shutil.copytree(calibrated, stale)
    identity = json.loads((stale / "thresholds.cpu.json").read_text())
    (stale / "thresholds.cpu.json").write_text(json.dumps({**identity, "model": "Some Other CPU 9000"}))
    check = by_name(json.loads(run_doctor("--json", cache=stale)[1]))["calibration"]
    assert check["status"] == "warn" and "Some Other CPU 9000" in check["found"], check
    assert "opbridge.calibrate()" in check["fix"]


# --- plugins ------------------------------------------------------------------------------------

MISSING_SYMBOL = r"""
#include <opbridge/plugin.h>
extern void opb_doctor_no_such_function(void);
OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  opb_doctor_no_such_function();
  (void)host, (void)info;
  return OPB_OK;
}
"""

OLD_ABI = r"""
#include <opbridge/plugin.h>
/* What a plugin built against an older header does: it speaks ABI 1. */
OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = 1;
  if (host->abi_version != 1) return OPB_ERR_ABI_MISMATCH;
  return OPB_OK;
}
"""

NO_ENTRY_POINT = r"""
int something_else(void) { return 1; }
"""


def build(tmp_path: Path, name: str, source: str, *extra: str) -> Path:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    out = tmp_path / f"lib{name}.so"
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-I", ob.get_include(), *extra, str(src), "-o", str(out)], check=True
    )
    return out


def test_broken_plugins_fail_with_the_right_fix(calibrated: Path, tmp_path: Path) -> None:
    missing = build(tmp_path, "missing_symbol", MISSING_SYMBOL)
    old = build(tmp_path, "old_abi", OLD_ABI)
    no_entry = build(tmp_path, "no_entry", NO_ENTRY_POINT)
    text = tmp_path / "libtext.so"
    text.write_text("this is not a shared library\n")
    good = build(tmp_path, "scale_add", (ROOT / "examples/plugins/c/scale_add.c").read_text())
    args = []
    for path in (missing, old, no_entry, text, good, tmp_path / "absent.so"):
        args += ["--plugin", str(path)]
    code, out, _ = run_doctor("--json", *args, cache=calibrated)
    report = json.loads(out)
    validate(report)
    assert code == 1
    checks = by_name(report)
    expect = {
        missing: ("undefined symbol", "symbol"),
        old: ("ABI", "rebuild it against this opbridge's plugin.h"),
        no_entry: ("opbridge_plugin_init", "OPB_EXPORT int opbridge_plugin_init"),
        text: ("cannot open", "not a shared library"),
        tmp_path / "absent.so": ("no such file", "check the path"),
    }
    for path, (found, fix) in expect.items():
        check = checks[f"plugin {path}"]
        assert check["status"] == "fail", check
        assert found in check["found"], check
        assert fix in check["fix"], check
    healthy = checks[f"plugin {good}"]
    assert healthy["status"] == "ok", healthy
    assert healthy["details"]["ops"] == ["scale_add@1", "scale_add@2"]


CRASHING = r"""
#include <opbridge/plugin.h>
OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  (void)host, (void)info;
  *(volatile int *)0 = 1;
  return OPB_OK;
}
"""


def test_a_crashing_plugin_fails_its_check_and_the_report_goes_on(calibrated: Path, tmp_path: Path) -> None:
    crashing = build(tmp_path, "crashing", CRASHING)
    code, out, _ = run_doctor("--json", "--plugin", str(crashing), cache=calibrated)
    report = json.loads(out)
    validate(report)
    check = by_name(report)[f"plugin {crashing}"]
    assert code == 1 and check["status"] == "fail" and "crashed" in check["found"], check
    assert "SIGSEGV" in check["found"]
    assert by_name(report)["cpu:0"]["status"] == "ok"  # the checks after it still ran


def test_an_already_loaded_plugin_is_diagnosed_as_healthy(tmp_path: Path) -> None:
    good = build(tmp_path, "scale_add", (ROOT / "examples/plugins/c/scale_add.c").read_text())
    with ob.load_library(good):
        report = ob.doctor(plugins=str(good))  # one path, not its characters
    check = [c for c in report.checks if c.section == "plugin"]
    assert [c.status for c in check] == ["ok"], check


# --- servers ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_checks(calibrated: Path) -> None:
    code, out, _ = run_doctor("--json", "--server", f"127.0.0.1:{free_port()}", cache=calibrated)
    check = [c for c in json.loads(out)["checks"] if c["section"] == "server"][0]
    assert code == 1 and check["status"] == "fail" and "not reachable" in check["found"]
    # Something that is not an HTTP server at all: a failed check, not a crash or a hang.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def answer_garbage() -> None:
        for _ in range(3):
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")

    import threading

    threading.Thread(target=answer_garbage, daemon=True).start()
    port = listener.getsockname()[1]
    code, out, _ = run_doctor("--json", "--server", f"127.0.0.1:{port}", cache=calibrated)
    listener.close()
    check = [c for c in json.loads(out)["checks"] if c["section"] == "server"][0]
    assert code == 1 and check["status"] == "fail" and "not reachable over HTTP" in check["found"], check
    from opbridge.cli import server_binary

    if server_binary() is None:
        pytest.skip("the server binary is not built")
    from test_serve import start_server, stop_server

    served = start_server()
    try:
        code, out, _ = run_doctor("--json", "--server", served.http, cache=calibrated)
    finally:
        assert stop_server(served) == 0
    report = json.loads(out)
    validate(report)
    server_checks = [c for c in report["checks"] if c["section"] == "server"]
    assert [c["status"] for c in server_checks] == ["ok", "ok"], server_checks
    assert code == 0


def test_doctor_from_python() -> None:
    report = ob.doctor()
    assert "summary:" in str(report)
    assert report.status in ("ok", "warn")
    validate(report.to_json())
