#!/usr/bin/env python3
"""The binding table: per-call cost of `c = a + b` on float32 arrays, per binding technology.

Every peer takes two contiguous 1-D float32 numpy arrays and returns a new float32 numpy array
holding their sum. At n=4 the time is almost all call overhead (argument conversion, output
allocation, return); at n=1024 the add itself starts to show.

Peers: opbridge (`ob.vector_add`), numpy (`np.add`), a bare PyO3 + rust-numpy function,
pybind11, Cython, SWIG, cffi and ctypes. Each peer is built from benchmarks/peers/<name>/ into
benchmarks/_build/ on first use (rebuilt when a source is newer than its product, or with
--rebuild); build tools that are missing are pip-installed. A peer that cannot be built or
imported is reported as skipped, with the reason, instead of failing the run.

Usage:
    python3 benchmarks/bench_bindings.py [--json PATH] [--repeat 7] [--min-time 0.2]
                                         [--rebuild] [--only numpy,pybind11,...]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PEERS_DIR = HERE / "peers"
BUILD_DIR = HERE / "_build"
KERNEL_DIR = PEERS_DIR / "c_kernel"
SIZES = (4, 1024)
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"

VectorAdd = Callable[[np.ndarray, np.ndarray], np.ndarray]


class Skip(Exception):
    """A peer cannot be built or loaded; the message says why (shown in the table)."""


@dataclass
class Options:
    rebuild: bool = False


OPTIONS = Options()


# --------------------------------------------------------------------------------------------
# Build helpers
# --------------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[bench_bindings] {message}", file=sys.stderr, flush=True)


def run(cmd: list, env: dict | None = None, cwd: Path | None = None) -> None:
    """Run a build command, echoing it; on failure print its output and raise Skip."""
    cmd = [str(c) for c in cmd]
    log("$ " + " ".join(cmd))
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(cmd, env=full_env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()
        print(output, file=sys.stderr)
        last = output.splitlines()[-1] if output else f"exit status {proc.returncode}"
        raise Skip(f"`{Path(cmd[0]).name}` failed: {last[:120]}")


def ensure_module(module: str, package: str | None = None):
    """Import `module`, pip-installing `package` (default: same name) if it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    package = package or module
    log(f"{module} is not installed: installing {package} with pip")
    try:
        run([sys.executable, "-m", "pip", "install", package])
    except Skip as e:
        raise Skip(f"{package} not installed and pip install failed ({e})") from None
    importlib.invalidate_caches()
    return importlib.import_module(module)


def ensure_tool(name: str, package: str) -> str:
    """Path of the executable `name`, pip-installing `package` if it is not found."""
    scripts = sysconfig.get_path("scripts")  # where pip puts console scripts of this Python
    found = shutil.which(name) or shutil.which(name, path=scripts)
    if found:
        return found
    log(f"{name} not found: installing {package} with pip")
    try:
        run([sys.executable, "-m", "pip", "install", package])
    except Skip as e:
        raise Skip(f"{name} not found and pip install {package} failed ({e})") from None
    found = shutil.which(name, path=scripts) or shutil.which(name)
    if not found:
        raise Skip(f"{name} not found after pip install {package}")
    return found


def is_stale(product: Path, sources: list) -> bool:
    """True when `product` must be (re)built: missing, older than a source, or --rebuild."""
    if OPTIONS.rebuild or not product.exists():
        return True
    built = product.stat().st_mtime
    return any(Path(s).stat().st_mtime > built for s in sources)


def build_dir(name: str) -> Path:
    path = BUILD_DIR / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_shared(
    sources: list, output: Path, include_dirs: list = (), cxx: bool = False, python: bool = True
) -> None:
    """Compile C/C++ sources into one shared object (a Python extension if `python`)."""
    if sys.platform == "win32":
        raise Skip("compiler driver only written for Unix-like systems")
    compiler = os.environ.get("CXX", "c++") if cxx else os.environ.get("CC", "cc")
    if not shutil.which(compiler):
        raise Skip(f"no {'C++' if cxx else 'C'} compiler ({compiler}) found")
    flags = ["-O3", "-shared", "-fPIC", "-w"] + (["-std=c++17"] if cxx else [])
    if python:
        include_dirs = [*include_dirs, sysconfig.get_paths()["include"]]
        if sys.platform == "darwin":
            flags += ["-undefined", "dynamic_lookup"]
    includes = [f"-I{d}" for d in include_dirs]
    run([compiler, *flags, *includes, *sources, "-o", output])


def import_from(directory: Path, module: str):
    """Import `module` from `directory` (a build folder), without leaving it on sys.path."""
    sys.path.insert(0, str(directory))
    saved, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no __pycache__ in peers/
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Skip(f"cannot import {module} from {directory}: {e}") from None
    finally:
        sys.dont_write_bytecode = saved
        sys.path.remove(str(directory))


# --------------------------------------------------------------------------------------------
# Peers: each returns vector_add(a, b) -> new float32 array, or raises Skip
# --------------------------------------------------------------------------------------------


def peer_opbridge() -> VectorAdd:
    try:
        import opbridge as ob
    except ImportError as e:
        raise Skip(f"import opbridge failed ({e}); build it with `maturin develop --release`") from None
    if not hasattr(ob, "vector_add"):
        raise Skip("opbridge has no vector_add")
    return ob.vector_add


def peer_numpy() -> VectorAdd:
    return np.add


def peer_bare_pyo3() -> VectorAdd:
    crate = PEERS_DIR / "bare_pyo3"
    out_dir = build_dir("bare_pyo3")
    product = out_dir / "bare_pyo3.abi3.so"
    if is_stale(product, [crate / "Cargo.toml", crate / "src" / "lib.rs"]):
        cargo = shutil.which("cargo")
        if not cargo:
            raise Skip("cargo not found (install Rust from https://rustup.rs)")
        target = BUILD_DIR / "target-bare"
        env = {
            "CARGO_TARGET_DIR": str(target),
            "PYO3_PYTHON": sys.executable,
            # Replaces pyo3's deprecated `extension-module` feature (maturin sets it too).
            "PYO3_BUILD_EXTENSION_MODULE": "1",
        }
        run([cargo, "build", "--release", "--manifest-path", crate / "Cargo.toml"], env=env)
        library = "libbare_pyo3.dylib" if sys.platform == "darwin" else "libbare_pyo3.so"
        shutil.copyfile(target / "release" / library, product)
    return import_from(out_dir, "bare_pyo3").vector_add


def peer_pybind11() -> VectorAdd:
    source = PEERS_DIR / "pybind11" / "vadd_pybind11.cpp"
    out_dir = build_dir("pybind11")
    product = out_dir / f"vadd_pybind11{EXT_SUFFIX}"
    if is_stale(product, [source]):
        pybind11 = ensure_module("pybind11")
        compile_shared([source], product, include_dirs=[pybind11.get_include()], cxx=True)
    return import_from(out_dir, "vadd_pybind11").vector_add


def peer_cython() -> VectorAdd:
    source = PEERS_DIR / "cython" / "vadd_cython.pyx"
    out_dir = build_dir("cython")
    product = out_dir / f"vadd_cython{EXT_SUFFIX}"
    if is_stale(product, [source]):
        ensure_module("Cython", "cython")
        c_file = out_dir / "vadd_cython.c"
        run([sys.executable, "-m", "cython", "-3", source, "-o", c_file])
        compile_shared([c_file], product)
    return import_from(out_dir, "vadd_cython").vector_add


def peer_swig() -> VectorAdd:
    interface = PEERS_DIR / "swig" / "vadd_swig.i"
    kernel = [KERNEL_DIR / "vadd.c", KERNEL_DIR / "vadd.h"]
    out_dir = build_dir("swig")
    product = out_dir / f"_vadd_swig{EXT_SUFFIX}"
    if is_stale(product, [interface, *kernel]):
        swig = ensure_tool("swig", "swig")
        wrapper = out_dir / "vadd_swig_wrap.c"
        # Writes the C wrapper and the Python proxy module vadd_swig.py into out_dir.
        run([swig, "-python", f"-I{KERNEL_DIR}", "-outdir", out_dir, "-o", wrapper, interface])
        compile_shared([wrapper, KERNEL_DIR / "vadd.c"], product, include_dirs=[KERNEL_DIR])
    return import_from(out_dir, "vadd_swig").vector_add


def peer_cffi() -> VectorAdd:
    peer = import_from(PEERS_DIR / "cffi", "vadd_cffi_peer")
    kernel = [KERNEL_DIR / "vadd.c", KERNEL_DIR / "vadd.h"]
    out_dir = build_dir("cffi")
    product = out_dir / f"{peer.MODULE_NAME}{EXT_SUFFIX}"
    ensure_module("cffi")  # the built module needs cffi's backend at import time too
    if is_stale(product, [Path(peer.__file__), *kernel]):
        ensure_module("setuptools")  # cffi compiles through setuptools/distutils
        log(f"cffi: compiling {peer.MODULE_NAME} into {out_dir}")
        try:
            peer.build(out_dir, KERNEL_DIR)
        except Exception as e:  # cffi raises VerificationError, CompileError, ...
            raise Skip(f"cffi build failed: {e}") from None
    return peer.make_vector_add(import_from(out_dir, peer.MODULE_NAME))


def peer_ctypes() -> VectorAdd:
    peer = import_from(PEERS_DIR / "ctypes", "vadd_ctypes_peer")
    kernel = [KERNEL_DIR / "vadd.c", KERNEL_DIR / "vadd.h"]
    product = build_dir("ctypes") / "libvadd.so"
    if is_stale(product, kernel):
        compile_shared([KERNEL_DIR / "vadd.c"], product, python=False)
    return peer.make_vector_add(product)


PEERS = [
    ("opbridge", peer_opbridge),
    ("numpy", peer_numpy),
    ("bare PyO3 + rust-numpy", peer_bare_pyo3),
    ("pybind11", peer_pybind11),
    ("Cython", peer_cython),
    ("SWIG", peer_swig),
    ("cffi", peer_cffi),
    ("ctypes", peer_ctypes),
]
PEER_KEYS = {name.split()[0].lower(): name for name, _ in PEERS}  # for --only


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    status: str = "ok"
    ns: dict = field(default_factory=dict)  # n -> ns per call
    ratio: dict = field(default_factory=dict)  # n -> ns / numpy ns at the same n


def inputs(n: int):
    rng = np.random.default_rng(n)
    return rng.random(n, dtype=np.float32), rng.random(n, dtype=np.float32)


def check(fn: VectorAdd, n: int) -> None:
    """Raise Skip unless fn returns a fresh float32 array equal to np.add."""
    a, b = inputs(n)
    c = fn(a, b)
    if not isinstance(c, np.ndarray) or c.dtype != np.float32 or c.shape != (n,):
        raise Skip(f"wrong result type at n={n}: {type(c).__name__} {getattr(c, 'dtype', '')}")
    if c is a or c is b or np.shares_memory(c, a) or np.shares_memory(c, b):
        raise Skip(f"result aliases an input at n={n}")
    if not np.array_equal(c, np.add(a, b)):
        raise Skip(f"wrong values at n={n}")


def ns_per_call(fn: VectorAdd, n: int, repeat: int, min_time: float) -> float:
    """timeit-style: best of `repeat` loops of N calls, N sized so one loop takes min_time."""
    a, b = inputs(n)
    timer = timeit.Timer("fn(a, b)", globals={"fn": fn, "a": a, "b": b})
    number = 1
    while True:
        elapsed = timer.timeit(number)
        if elapsed >= min_time:
            break
        number = max(number * 2, int(number * min_time / max(elapsed, 1e-9) * 1.1))
    return min(timer.repeat(repeat, number)) / number * 1e9


def measure(name: str, factory: Callable[[], VectorAdd], repeat: int, min_time: float) -> Result:
    result = Result(name)
    try:
        fn = factory()
        for n in SIZES:
            check(fn, n)
    except Skip as e:
        result.status = f"skipped: {e}"
        log(f"{name}: {result.status}")
        return result
    for n in SIZES:
        result.ns[n] = ns_per_call(fn, n, repeat, min_time)
    log(f"{name}: " + ", ".join(f"n={n} {t:.0f} ns" for n, t in result.ns.items()))
    return result


def add_ratios(results: list) -> None:
    numpy_ns = next((r.ns for r in results if r.name == "numpy"), {})
    for r in results:
        r.ratio = {n: r.ns[n] / numpy_ns[n] for n in r.ns if n in numpy_ns}


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
    }


def markdown_table(results: list) -> str:
    def cell(mapping: dict, n: int, fmt: str) -> str:
        return format(mapping[n], fmt) if n in mapping else "-"

    header = ["peer"] + [f"n={n} ns/call" for n in SIZES] + [f"vs numpy n={n}" for n in SIZES] + ["status"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * 4 + ["---"]) + "|"]
    for r in results:
        row = (
            [r.name]
            + [cell(r.ns, n, ",.0f") for n in SIZES]
            + [cell(r.ratio, n, ".2f") + ("x" if n in r.ratio else "") for n in SIZES]
            + [r.status]
        )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_json(path: Path, env: dict, results: list, args) -> None:
    payload = {
        "benchmark": "bench_bindings",
        "operation": "c = a + b, float32, new output array",
        "environment": env,
        "settings": {"sizes": list(SIZES), "repeat": args.repeat, "min_time_s": args.min_time},
        "results": [
            {
                "name": r.name,
                "status": "ok" if r.status == "ok" else "skipped",
                "reason": None if r.status == "ok" else r.status.removeprefix("skipped: "),
                "ns_per_call": {str(n): t for n, t in r.ns.items()},
                "ratio_vs_numpy": {str(n): x for n, x in r.ratio.items()},
            }
            for r in results
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    log(f"wrote {path}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--repeat", type=int, default=7, help="timing loops per size (best is kept)")
    parser.add_argument(
        "--min-time", type=float, default=0.2, help="seconds per timing loop; sets the number of calls per loop"
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild every peer")
    parser.add_argument(
        "--only", metavar="NAMES", help=f"comma-separated subset of: {', '.join(PEER_KEYS)} (numpy always runs)"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    OPTIONS.rebuild = args.rebuild
    selected = PEERS
    if args.only:
        keys = {k.strip().lower() for k in args.only.split(",")} | {"numpy"}
        unknown = keys - PEER_KEYS.keys()
        if unknown:
            sys.exit(f"unknown peer(s): {', '.join(sorted(unknown))}")
        selected = [(name, f) for name, f in PEERS if name.split()[0].lower() in keys]

    env = environment()
    results = [measure(name, factory, args.repeat, args.min_time) for name, factory in selected]
    add_ratios(results)

    print(f"\n## Binding overhead: c = a + b (float32, fresh output), ns per call, best of {args.repeat}\n")
    print(f"Python {env['python']}, numpy {env['numpy']}, {env['cpu']} ({env['cpu_count']} CPUs), {env['date']}\n")
    print(markdown_table(results))
    print("\n`vs numpy` is time / np.add time at the same n in the same run: below 1x is faster.")
    if args.json:
        write_json(args.json, env, results, args)


if __name__ == "__main__":
    main()
