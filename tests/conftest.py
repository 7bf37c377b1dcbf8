"""Shared fixtures of the opbridge test suite.

Tests that take the `device` fixture run once per device this build and machine can reach (the
CPU device always; accelerator devices join the list when their backend can make a tensor), as
the Rust tests do with `opbridge_runtime::test_device!`.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import opbridge as ob

ADD_DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
FLOAT_DTYPES = [np.float16, np.float32, np.float64]


# Devices whose backends exist or will: probed once; an unavailable one is left out, not failed.
_CANDIDATE_DEVICES = ("cpu:0", "ascend:0", "cuda:0")


def _ascend_double() -> Path | None:
    """Builds the strict ACL test double (cached) and chooses it for this run, so `ascend:0`
    joins the devices (never a silent fallback: explicitly named by OPBRIDGE_ASCEND_LIB_DIR).
    A machine with a real NPU (OPBRIDGE_TEST_REAL_ASCEND=1) keeps its own driver."""
    if os.environ.get("OPBRIDGE_TEST_REAL_ASCEND") == "1":
        return None
    try:
        from opbridge.testing import ascend_double

        lib_dir = ascend_double.lib_dir()
    except Exception as e:  # noqa: BLE001 (reported, and the Ascend tests are then skipped)
        print(f"conftest: the Ascend test double could not be built: {e}")
        return None
    os.environ["OPBRIDGE_ASCEND_LIB_DIR"] = str(lib_dir)
    return lib_dir


ASCEND_LIB_DIR = _ascend_double()


def available_devices() -> list[str]:
    """The devices a tensor can be made on here (each probed by making one)."""
    found = []
    for name in _CANDIDATE_DEVICES:
        try:
            ob.asarray(np.zeros(1, np.float32), device=name)
        except ob.OpBridgeError:
            continue
        found.append(name)
    return found


DEVICES = available_devices()


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """Each available device in turn (`cpu:0` on every machine)."""
    return str(request.param)


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator: every run sees the same data."""
    return np.random.default_rng(20240601)


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Values of `dtype` whose sums stay exact in range (ints) and finite (floats)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "i":
        return rng.integers(-1_000_000, 1_000_000, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype) * 100


@pytest.fixture
def memory_limit() -> Iterator[Callable[[int | None], None]]:
    """Sets the CPU pool's byte limit; the limit is always removed again afterwards."""

    def set_limit(limit: int | None) -> None:
        ob.set_memory_limit(limit)

    try:
        yield set_limit
    finally:
        ob.set_memory_limit(None)


def pool_allocated_bytes() -> int:
    gc.collect()
    ob.synchronize()
    return int(ob.get_memory_pool_stats()["allocated_bytes.current"])


@pytest.fixture(autouse=True)
def _device_is_quiet_after_each_test() -> Iterator[None]:
    """Each test leaves no pending work or unreported asynchronous error behind."""
    yield
    ob.synchronize()


_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Plugin libraries for the server's repository tests, compiled once per run with the system
    compiler: scale_add v1 and v2 (one version each) and leaky."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("libs")
    sources = {
        "scale_add_1": (_ROOT / "examples/plugins/c/scale_add.c", ["-DSCALE_ADD_VERSION=1"]),
        "scale_add_2": (_ROOT / "examples/plugins/c/scale_add.c", ["-DSCALE_ADD_VERSION=2"]),
        "leaky": (_ROOT / "tests/plugins/leaky.c", []),
    }
    built = {}
    for name, (source, flags) in sources.items():
        target = out / f"lib{name}.so"
        subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-I", ob.get_include(), *flags, str(source), "-o", str(target)], check=True
        )
        built[name] = target
    return built
