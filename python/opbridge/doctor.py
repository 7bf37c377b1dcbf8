"""``opbridge doctor``: checks the installation, the CPU, the devices, the JIT, plugins and a server.

Each check has a status (``ok``, ``warn``, ``fail``, ``skipped``), what it found, and for a warning
or a failure the fix. From the shell::

    opbridge doctor                         # a table and a summary line
    opbridge doctor --plugin ./libmyops.so  # also check an operator library (repeatable)
    opbridge doctor --server 127.0.0.1:8000 # also check a running `opbridge serve`
    opbridge doctor --json                  # the report as JSON (schema below)

Exit code: 0 when nothing failed (warnings allowed), 1 when a check failed, 2 on a usage error.
From Python, ``print(opbridge.doctor())``.

JSON schema (``schema_version`` 1; fields are only ever added)::

    {"schema_version": 1,
     "opbridge": "0.1.0",
     "status": "ok" | "warn" | "fail",           # the worst check's status (skipped counts as ok)
     "summary": {"ok": int, "warn": int, "fail": int, "skipped": int},
     "checks": [{"section": str,                  # python, native, cpu, device, jit, plugin, server
                 "name": str,
                 "status": "ok" | "warn" | "fail" | "skipped",
                 "found": str,
                 "fix": str,                      # "" when there is nothing to do
                 "details": {...}}]}              # check-specific facts (JSON values)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
STATUSES = ("ok", "warn", "fail", "skipped")
RECALIBRATE = "python -c 'import opbridge; opbridge.calibrate()'"
REBUILD = "rebuild the package in release mode: `make build` (or `maturin develop --release`)"


@dataclass
class Check:
    """One check's outcome."""

    section: str
    name: str
    status: str
    found: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "name": self.name,
            "status": self.status,
            "found": self.found,
            "fix": self.fix,
            "details": self.details,
        }


@dataclass
class Report:
    """Every check made; ``str(report)`` is the table, ``to_json()`` the documented schema."""

    checks: list[Check]

    @property
    def summary(self) -> dict[str, int]:
        return {s: sum(1 for c in self.checks if c.status == s) for s in STATUSES}

    @property
    def status(self) -> str:
        counts = self.summary
        return "fail" if counts["fail"] else "warn" if counts["warn"] else "ok"

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def to_json(self) -> dict[str, Any]:
        from . import __version__

        return {
            "schema_version": SCHEMA_VERSION,
            "opbridge": __version__,
            "status": self.status,
            "summary": self.summary,
            "checks": [c.to_json() for c in self.checks],
        }

    def table(self) -> str:
        width = max((len(c.name) for c in self.checks), default=4)
        lines = [f"{'STATUS':<8} {'CHECK':<{width}}  FOUND"]
        for c in self.checks:
            status = c.status.upper() if c.status in ("warn", "fail") else c.status
            found = " ".join(c.found.split())  # one line per check, whatever the text holds
            lines.append(f"{status:<8} {c.name:<{width}}  {found}")
            if c.fix:
                lines.append(f"{'':<8} {'':<{width}}  fix: {c.fix}")
        counts = self.summary
        lines.append(
            f"summary: {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail, {counts['skipped']} skipped"
            f" -> {self.status}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        counts = self.summary
        return f"<opbridge doctor: {self.status}; " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ">"


def _guard(section: str, name: str, run: Callable[[], Check | list[Check]]) -> list[Check]:
    """Runs one check; an unexpected exception is that check's failure, never the doctor's."""
    try:
        result = run()
    except Exception as e:  # noqa: BLE001  (the doctor reports, it does not crash)
        return [Check(section, name, "fail", f"the check itself failed: {type(e).__name__}: {e}", "report this bug")]
    return result if isinstance(result, list) else [result]


# --- python and the native module ------------------------------------------------------------


def _versions() -> Check:
    import numpy as np

    from . import __version__

    found = f"Python {platform.python_version()}, numpy {np.__version__}, opbridge {__version__}"
    details = {"python": platform.python_version(), "numpy": np.__version__, "opbridge": __version__}
    numpy_major_minor = tuple(int(p) for p in re.findall(r"\d+", np.__version__)[:2])
    if numpy_major_minor < (1, 24):
        return Check("python", "versions", "fail", found, "upgrade numpy: pip install 'numpy>=1.24'", details)
    return Check("python", "versions", "ok", found, details=details)


def _native_module() -> list[Check]:
    from . import _native

    path = getattr(_native, "__file__", "") or ""
    checks = [Check("native", "native module", "ok", f"loaded from {path}", details={"path": path})]
    try:
        library = ctypes.CDLL(path)
        exported = hasattr(library, "PyInit__native")
    except OSError as e:
        exported = False
        checks[0].details["error"] = str(e)
    checks.append(
        Check("native", "symbols", "ok", "exports PyInit__native")
        if exported
        else Check("native", "symbols", "fail", f"{path} does not export PyInit__native", REBUILD)
    )
    return checks


def _build(info: dict[str, Any]) -> list[Check]:
    from . import __version__

    checks = []
    found = f"{info['profile']} build {info['version']} for {info['target']}"
    if info["version"] != __version__:
        checks.append(
            Check(
                "native",
                "build",
                "fail",
                f"{found}, but the Python package is {__version__}: a stale native module",
                REBUILD,
                dict(info),
            )
        )
    elif info["profile"] != "release":
        checks.append(Check("native", "build", "warn", f"{found}: kernels run many times slower", REBUILD, dict(info)))
    else:
        checks.append(Check("native", "build", "ok", found))
    header = Path(__file__).resolve().parent / "include" / "opbridge" / "plugin.h"
    abi = info["plugin_abi_version"]
    match = (
        re.search(r"#define\s+OPBRIDGE_PLUGIN_ABI_VERSION\s+(\d+)", header.read_text()) if header.is_file() else None
    )
    if match is None:
        checks.append(
            Check("native", "plugin ABI", "fail", f"speaks ABI {abi}; the plugin header {header} is missing", REBUILD)
        )
    elif int(match.group(1)) != abi:
        checks.append(
            Check(
                "native",
                "plugin ABI",
                "fail",
                f"the module speaks ABI {abi} but the shipped plugin.h declares {match.group(1)}",
                REBUILD,
            )
        )
    else:
        checks.append(Check("native", "plugin ABI", "ok", f"ABI {abi} (module and plugin.h agree)"))
    return checks


# --- the CPU ------------------------------------------------------------------------------------


def _cpu(info: dict[str, Any]) -> list[Check]:
    from .tuning import cpu_identity

    identity = cpu_identity()
    features = info["cpu_features"]
    have = [name for name, present in features.items() if present]
    variants = info["kernel_variants"]
    found = f"{identity['model']} ({identity['logical_cpus']} CPUs); features: {' '.join(have) or 'none'}"
    checks = [Check("cpu", "cpu", "ok", found, details={**identity, "features": features})]
    kernels = ", ".join(f"{family}={variant}" for family, variant in variants.items())
    if identity["machine"] in ("x86_64", "AMD64") and not features.get("avx2", False):
        checks.append(
            Check(
                "cpu",
                "kernel variants",
                "warn",
                kernels,
                "this CPU has no AVX2: the kernels run their portable loops (correct, slower)",
                dict(variants),
            )
        )
    else:
        checks.append(Check("cpu", "kernel variants", "ok", kernels, details=dict(variants)))
    threads = info["compute_threads"]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else threads
    if threads > usable:
        checks.append(
            Check(
                "cpu",
                "compute threads",
                "warn",
                f"the compute pool has {threads} threads but this process may run on {usable} CPUs",
                "oversubscribed: parallel kernels wait on each other; run with the CPUs the pool expects",
                {"threads": threads, "usable_cpus": usable},
            )
        )
    else:
        checks.append(
            Check("cpu", "compute threads", "ok", f"{threads} (one per usable CPU)", details={"threads": threads})
        )
    return checks


def _calibration() -> Check:
    from . import tuning

    path = tuning.thresholds_path()
    if not os.path.lexists(path):
        return Check(
            "cpu",
            "calibration",
            "warn",
            f"no calibration file ({path}): the reference machine's thresholds are in force",
            f"measure them here (about a second): {RECALIBRATE}",
        )
    # Read the way `import opbridge` does: a file it ignores is reported as such.
    try:
        saved = json.loads(tuning._read_small_regular_file(path))
    except (OSError, ValueError, RecursionError) as e:
        return Check(
            "cpu",
            "calibration",
            "warn",
            f"{path} is unusable ({e}); the reference machine's thresholds are in force",
            f"remove it and recalibrate: rm {path} && {RECALIBRATE}",
        )
    if not isinstance(saved, dict) or not all(k in tuning._KEYS for k in saved):
        return Check(
            "cpu",
            "calibration",
            "warn",
            f"{path} is not a thresholds file opbridge writes; defaults are in force for what it lacks",
            f"recalibrate: {RECALIBRATE}",
        )
    try:
        measured_on = json.loads(tuning._read_small_regular_file(tuning.identity_path()))
    except (OSError, ValueError, RecursionError):
        measured_on = None
    if not isinstance(measured_on, dict):
        measured_on = None
    here = tuning.cpu_identity()
    details = {"path": str(path), "measured_on": measured_on, "this_cpu": here, "thresholds": tuning.thresholds()}
    if measured_on != here:
        what = "an unknown CPU" if measured_on is None else f"{measured_on.get('model')!s}"
        return Check(
            "cpu",
            "calibration",
            "warn",
            f"{path} was measured on {what}, not on this CPU: stale thresholds",
            f"recalibrate: {RECALIBRATE}",
            details,
        )
    return Check("cpu", "calibration", "ok", f"{path} (measured on this CPU)", details=details)


# --- devices ------------------------------------------------------------------------------------


def _cpu_device_smoke() -> Check:
    import numpy as np

    import opbridge as ob

    device = "cpu:0"
    before = ob.get_memory_pool_stats(device)["allocated_bytes.current"]
    a = np.arange(4096, dtype=np.float32)
    # On a stream of its own: waiting for it neither waits for nor reports the user's work.
    stream = ob.Stream(device)
    try:
        with stream:
            x = ob.asarray(a, device=device)  # copy in
            y = ob.ops.add(x, x)
            out = y.numpy()  # copy out (a view of the tensor's memory: released with it, below)
            ok = bool(np.array_equal(out, a + a))
            del x, y, out
        stream.synchronize()
    except ob.OutOfMemoryError as e:
        limit = ob.get_memory_pool_stats(device)["limit"]
        return Check(
            "device",
            device,
            "fail",
            f"out of memory for a 16 KiB test ({e})",
            "a memory limit this low leaves no room to work: ob.set_memory_limit(None)"
            if limit is not None
            else "free memory on this machine",
            {"limit": limit},
        )
    after = ob.get_memory_pool_stats(device)["allocated_bytes.current"]
    details = {"device": device, "allocated_before": before, "allocated_after": after}
    if not ok:
        return Check("device", device, "fail", "add gave a wrong result", "report this bug", details)
    if after != before:
        return Check(
            "device",
            device,
            "fail",
            f"the pool did not return to its baseline ({before} -> {after} bytes allocated)",
            "report this bug (a leak in the runtime)",
            details,
        )
    return Check(
        "device", device, "ok", "allocate, copy in, add, copy out, free: pool back to baseline", details=details
    )


def _accelerators() -> list[Check]:
    """One check per accelerator device the backends report: a copy round trip through the
    device and its pool for each available one; the reason (every library path tried) for a
    backend that cannot serve."""
    import numpy as np

    import opbridge as ob

    checks = []
    for report in ob.devices():
        name = report["name"]
        if report["kind"] == "cpu":
            continue
        if not report["available"]:
            checks.append(
                Check(
                    "device",
                    name,
                    "skipped",
                    f"not available: {report.get('reason', 'unknown reason')}",
                    "install CANN (or set OPBRIDGE_ASCEND_LIB_DIR / ASCEND_HOME_PATH) where an NPU is present",
                    dict(report),
                )
            )
            continue
        a = np.arange(4096, dtype=np.float32)
        try:
            before = ob.get_memory_pool_stats(name)["allocated_bytes.current"]
            stream = ob.Stream(name)
            with stream:
                back = ob.asarray(a, device=name).numpy()  # H2D through pinned memory, then D2H
            stream.synchronize()
            after = ob.get_memory_pool_stats(name)["allocated_bytes.current"]
        except ob.OpBridgeError as e:
            checks.append(
                Check("device", name, "fail", f"copy round trip failed: {e}", "see the driver's log", dict(report))
            )
            continue
        details = {**report, "allocated_before": before, "allocated_after": after}
        if not np.array_equal(back, a) or after != before:
            found = (
                "wrong bytes came back" if not np.array_equal(back, a) else "the pool did not return to its baseline"
            )
            checks.append(Check("device", name, "fail", found, "report this bug", details))
            continue
        what = report.get("soc", "device")
        checks.append(Check("device", name, "ok", f"{what}: copy in, copy out, pool back to baseline", details=details))
    if not checks:
        checks.append(Check("device", "accelerators", "skipped", "no accelerator backend reports a device"))
    return checks


# --- the JIT ------------------------------------------------------------------------------------

_JIT_PROBE = """
#include <opbridge/plugin.h>
static int infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs,
                 char *err, size_t err_len) {
  (void)n_in, (void)n_out, (void)attrs, (void)err, (void)err_len;
  out[0] = in[0];
  return OPB_OK;
}
static int twice(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs, void *stream,
                 void *ws, size_t ws_size, char *err, size_t err_len) {
  (void)n_in, (void)n_out, (void)attrs, (void)stream, (void)ws, (void)ws_size, (void)err, (void)err_len;
  const float *x = (const float *)((const char *)in[0].data + in[0].byte_offset);
  float *y = (float *)((char *)out[0].data + out[0].byte_offset);
  int64_t n = 1;
  for (int d = 0; d < in[0].ndim; d++) n *= in[0].shape[d];
  for (int64_t i = 0; i < n; i++) y[i] = 2.0f * x[i];
  return OPB_OK;
}
static const char *const inputs[] = {"x"};
static const DLDataType dtypes[] = {OPB_FLOAT32};
static const OpbOpDesc ops[] = {{.name = "OPNAME", .version = 1, .doc = "doctor's JIT probe", .n_inputs = 1,
                                 .input_names = inputs, .n_outputs = 1, .n_dtypes = 1, .dtypes = dtypes,
                                 .infer = infer, .cpu_kernel = twice}};
OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->name = "doctor_probe";
  info->n_ops = 1;
  info->ops = ops;
  return OPB_OK;
}
"""


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _writable_folder(folder: Path) -> str | None:
    """Why `folder` cannot hold cache files (made if missing), or None: tried, not guessed."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not folder.is_dir():
            return "not a folder"
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-", delete=True):
            pass
    except OSError as e:
        return str(e)
    return None


def _jit() -> list[Check]:
    import numpy as np

    import opbridge as ob
    from opbridge import jit

    checks = []
    try:
        compiler = jit._compiler("c", None)
    except jit.JitCompileError as e:
        return [
            Check("jit", "compiler", "fail", str(e), "install a C compiler (cc) or set CC"),
            Check("jit", "jit probe", "skipped", "no compiler"),
        ]
    version = jit._compiler_version(compiler).splitlines()[0] if jit._compiler_version(compiler) else "unknown"
    checks.append(Check("jit", "compiler", "ok", f"{compiler}: {version}", details={"path": compiler}))
    # A trivial operator compiled in a scratch cache, loaded, called and unloaded.
    name = f"_doctor_probe_{os.getpid()}_{time.monotonic_ns()}"
    with tempfile.TemporaryDirectory(prefix="opbridge-doctor-") as scratch:
        started = time.perf_counter()
        library = jit.compile(_JIT_PROBE.replace("OPNAME", name), "doctor_probe", cache_dir=scratch)
        try:
            x = np.arange(8, dtype=np.float32)
            got = np.asarray(ob.ops.get(name)(x))
        finally:
            library.unload()
        seconds = time.perf_counter() - started
        if not np.array_equal(got, 2 * x):
            checks.append(
                Check("jit", "jit probe", "fail", "the compiled probe gave a wrong result", "report this bug")
            )
        else:
            checks.append(Check("jit", "jit probe", "ok", f"compiled, loaded, called and unloaded in {seconds:.2f} s"))
    cache = jit.default_cache_dir()
    probe_dir = cache if cache.exists() else next((p for p in cache.parents if p.exists()), cache)
    writable = os.access(probe_dir, os.W_OK | os.X_OK)
    size = _folder_bytes(cache) if cache.is_dir() else 0
    details = {"path": str(cache), "bytes": size, "writable": writable}
    if not writable:
        checks.append(
            Check(
                "jit",
                "jit cache",
                "fail",
                f"{cache} is not writable",
                "set OPBRIDGE_CACHE_DIR to a writable folder",
                details,
            )
        )
    else:
        checks.append(Check("jit", "jit cache", "ok", f"{cache} (writable, {size} bytes)", details=details))
    return checks


# --- plugins ------------------------------------------------------------------------------------


def _ldd(path: Path) -> tuple[list[str], list[str]]:
    """(undefined symbols, missing dependencies) as the dynamic loader sees them, if ldd exists."""
    ldd = shutil.which("ldd")
    if ldd is None:
        return [], []
    try:
        run = subprocess.run([ldd, "-r", str(path)], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return [], []
    text = run.stdout + run.stderr
    undefined = sorted(set(re.findall(r"undefined symbol: ([^\s,(]+)", text)))
    missing = sorted(set(re.findall(r"^\s*(\S+) => not found", text, re.MULTILINE)))
    return undefined, missing


def _plugin_fix(message: str, abi: int) -> str:
    include = "$(python -c 'import opbridge; print(opbridge.get_include())')"
    rebuild = f"rebuild it against this opbridge's plugin.h (ABI {abi}): cc -O2 -shared -fPIC -I {include} ..."
    if "undefined symbol" in message:
        return "the library uses a symbol nothing provides: link the library that defines it (-l...) or remove it"
    if "cannot open shared object file" in message:
        return "a dependency is missing: install it or add its folder to LD_LIBRARY_PATH (see `ldd` below)"
    if "invalid ELF header" in message or "file too short" in message or "not an ELF" in message:
        return "not a shared library: build it with `cc -shared -fPIC ...`"
    if "ABI" in message or "abi" in message:
        return rebuild
    if "already registered" in message:
        return (
            "an operator of that name and version exists already (a built-in or another library): "
            "rename it or bump its version"
        )
    return "fix the operator descriptors the loader names (see plugin.h for every field's rule)"


def _plugin(path_text: str, abi: int, timeout: float = 60.0) -> Check:
    """Diagnoses an operator library in a child process: a library whose constructor or init
    crashes, hangs or registers names this process already has cannot take the doctor with it."""
    name = f"plugin {path_text}"
    code = (
        "import json, sys\n"
        "from opbridge.doctor import _plugin_here\n"
        "print(json.dumps(_plugin_here(sys.argv[1], int(sys.argv[2])).to_json()))\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, path_text, str(abi)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return Check(
            "plugin", name, "fail", f"loading it did not finish in {timeout:.0f} s", "its constructor or init hangs"
        )
    if done.returncode < 0:
        import signal

        try:
            what = signal.Signals(-done.returncode).name
        except ValueError:
            what = f"signal {-done.returncode}"
        return Check(
            "plugin",
            name,
            "fail",
            f"the library crashed the process that loaded it ({what})",
            "its constructor or opbridge_plugin_init crashes: debug it with gdb --args python -c "
            f"'import opbridge; opbridge.load_library(\"{path_text}\")'",
        )
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
        return Check(**found)
    except (ValueError, IndexError, TypeError) as e:
        tail = (done.stderr or "").strip().splitlines()[-1:]
        return Check(
            "plugin",
            name,
            "fail",
            f"the check's process ended with {done.returncode}: {tail[0] if tail else e}",
            "report this bug",
        )


def _plugin_here(path_text: str, abi: int) -> Check:
    import opbridge as ob

    name = f"plugin {path_text}"
    path = Path(path_text)
    if not path.exists():
        return Check("plugin", name, "fail", "no such file", "check the path")
    if not path.is_file():
        return Check("plugin", name, "fail", "not a regular file", "give the path of the library (.so) itself")
    if path.stat().st_size > 1 << 30:
        return Check("plugin", name, "fail", "larger than 1 GiB: not an operator library", "check the path")
    undefined, missing = _ldd(path)
    details: dict[str, Any] = {
        "path": str(path.resolve()),
        "undefined_symbols": undefined,
        "missing_libraries": missing,
    }
    try:
        handle = ctypes.CDLL(str(path.resolve()), mode=os.RTLD_LOCAL if hasattr(os, "RTLD_LOCAL") else 0)
    except OSError as e:
        message = str(e)
        extra = ""
        if missing:
            extra = f"; missing: {', '.join(missing)}"
        elif undefined:
            extra = f"; undefined: {', '.join(undefined[:5])}"
        return Check("plugin", name, "fail", f"cannot open: {message}{extra}", _plugin_fix(message, abi), details)
    if not hasattr(handle, "opbridge_plugin_init"):
        return Check(
            "plugin",
            name,
            "fail",
            "opens, but does not export opbridge_plugin_init",
            "export the entry point: OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *, OpbPluginInfo *)",
            details,
        )
    try:
        library = ob.load_library(path)
    except ob.OpBridgeError as e:
        message = str(e)
        return Check("plugin", name, "fail", message, _plugin_fix(message, abi), details)
    try:
        ops = library.ops
        built_for = library.abi_version
        listed = {op["name"]: op["by_version"] for op in ob.list_ops()}
        devices = {f"{op}@{v}": listed[op][v]["devices"] for op, v in ops if op in listed and v in listed[op]}
    finally:
        library.unload()
    details["ops"] = [f"{op}@{version}" for op, version in ops]
    details["abi_version"] = built_for
    details["devices"] = devices
    described = [f"{op} ({', '.join(devices.get(op, []))})" for op in details["ops"]]
    older = " (an older ABI: CPU kernels only)" if built_for != abi else ""
    found = f"ABI {built_for}{older}; {len(ops)} operator(s): {', '.join(described)}"
    if undefined or missing:
        return Check(
            "plugin",
            name,
            "warn",
            f"{found}; but the loader reports unresolved symbols {undefined} / missing libraries {missing}",
            "link the libraries that define them before a lazily bound call fails",
            details,
        )
    return Check("plugin", name, "ok", found, details=details)


# --- a running server ---------------------------------------------------------------------------


def _server(url: str, timeout: float = 10.0) -> list[Check]:
    import http.client
    import threading

    base = url if "://" in url else f"http://{url}"
    base = base.rstrip("/")
    name = f"server {url}"
    # The user's proxy settings are for the outside world, not for a server on this machine.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def fetch(path: str, body: bytes | None) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        request = urllib.request.Request(base + path, data=body, headers=headers)
        try:
            with opener.open(request, timeout=timeout) as response:
                data = response.read(1 << 20)
                status = response.status
        except urllib.error.HTTPError as e:
            data, status = e.read(1 << 20), e.code
        try:
            return status, json.loads(data) if data else None
        except ValueError:
            return status, data.decode(errors="replace")[:200]

    def get(path: str, body: bytes | None = None) -> tuple[int, Any]:
        """One request with one deadline for the whole of it (a server trickling bytes included)."""
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(fetch(path, body))
            except BaseException as e:  # noqa: BLE001  (handed to the caller's thread)
                outcome.append(e)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout)
        if not outcome:
            raise TimeoutError(f"no complete answer to {path} in {timeout:.0f} s")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    fix = f"start it (`opbridge serve`) or check the address; `curl {base}/v2/health/live` should answer 200"
    try:
        live, _ = get("/v2/health/live")
        if live == 404:
            return [
                Check(
                    "server",
                    name,
                    "fail",
                    "it answers HTTP, but not the KServe V2 protocol (404 on /v2/health/live)",
                    "point --server at the HTTP port of `opbridge serve` (8000 by default)",
                )
            ]
        ready, _ = get("/v2/health/ready")
        status, metadata = get("/v2")
    except (OSError, http.client.HTTPException) as e:
        return [Check("server", name, "fail", f"not reachable over HTTP: {type(e).__name__}: {e}", fix)]
    if live != 200 or ready != 200 or status != 200 or not isinstance(metadata, dict):
        return [
            Check(
                "server",
                name,
                "fail",
                f"live {live}, ready {ready}, metadata {status}",
                "a server that is not ready is loading or stopping: see its log",
            )
        ]
    found = f"{metadata.get('name')} {metadata.get('version')}: live and ready"
    checks = [Check("server", name, "ok", found, details={"metadata": metadata})]
    request = {
        "inputs": [
            {"name": "a", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]},
            {"name": "b", "shape": [3], "datatype": "FP32", "data": [10, 20, 30]},
        ]
    }
    try:
        status, answer = get("/v2/models/add/infer", json.dumps(request).encode())
    except (OSError, http.client.HTTPException) as e:
        checks.append(Check("server", "server inference", "fail", f"add: {type(e).__name__}: {e}", fix))
        return checks
    if status == 404:
        checks.append(Check("server", "server inference", "skipped", "the server has no `add` model to try"))
        return checks
    outputs = answer.get("outputs") if isinstance(answer, dict) else None
    first = outputs[0] if isinstance(outputs, list) and outputs and isinstance(outputs[0], dict) else {}
    data = first.get("data")
    if status != 200:
        checks.append(Check("server", "server inference", "fail", f"add answered {status}: {answer}", fix))
    elif data == [11, 22, 33]:
        checks.append(Check("server", "server inference", "ok", "add round trip gave the right answer"))
    else:
        checks.append(Check("server", "server inference", "fail", f"add gave {str(answer)[:200]}", "report this bug"))
    return checks


# --- running the checks -------------------------------------------------------------------------


def doctor(
    plugins: Iterable[str | os.PathLike[str]] = (),
    server: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Runs every check and returns the report (``print(report)`` shows the table).

    Args:
        plugins: operator libraries to check (open, entry point, ABI, descriptors, dependencies).
        server: the address of a running ``opbridge serve`` (``host:port`` or a URL).
        progress: called with each check's name before it runs.
    """
    from . import _native

    if isinstance(plugins, (str, bytes, os.PathLike)):
        plugins = [os.fsdecode(plugins)]
    info = _native.build_info()
    abi = int(info["plugin_abi_version"])
    steps: list[tuple[str, str, Callable[[], Check | list[Check]]]] = [
        ("python", "versions", _versions),
        ("native", "native module", _native_module),
        ("native", "build", lambda: _build(info)),
        ("cpu", "cpu", lambda: _cpu(info)),
        ("cpu", "calibration", _calibration),
        ("device", "cpu:0", _cpu_device_smoke),
        ("device", "accelerators", _accelerators),
        ("jit", "jit", _jit),
    ]
    steps += [("plugin", f"plugin {p}", lambda p=p: _plugin(os.fspath(p), abi)) for p in plugins]
    if server:
        steps.append(("server", f"server {server}", lambda: _server(server)))
    checks: list[Check] = []
    for section, name, run in steps:
        if progress is not None:
            progress(name)
        checks.extend(_guard(section, name, run))
    return Report(checks)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="opbridge doctor",
        description="Check the opbridge installation, CPU, devices, JIT, plugins and a server.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON (schema_version 1)")
    parser.add_argument("--plugin", action="append", default=[], metavar="PATH", help="check an operator library")
    parser.add_argument("--server", metavar="URL", help="check a running `opbridge serve` (host:port or URL)")
    args = parser.parse_args(argv)  # usage errors exit with 2
    progress = None
    if not args.json and sys.stderr.isatty():

        def progress(name: str) -> None:
            sys.stderr.write(f"\r\033[Kchecking {name}...")
            sys.stderr.flush()

    report = doctor(args.plugin, args.server, progress)
    if progress is not None:
        sys.stderr.write("\r\033[K")
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(report.table() + "\n")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
