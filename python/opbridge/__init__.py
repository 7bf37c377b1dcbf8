"""opbridge: call native accelerator operators from Python.

numpy arrays in, zero-copy; typed errors; the GIL released for real work; a device runtime with
a caching memory pool, one stream per Python thread, events and async launch.

Example:
    >>> import numpy as np, opbridge as ob
    >>> a = np.arange(4, dtype=np.float32)
    >>> ob.vector_add(a, a)
    array([0., 2., 4., 6.], dtype=float32)
"""

from __future__ import annotations

import atexit as _atexit
import os as _os

from . import _native, ops, tuning
from ._native import (
    ArgumentError,
    DeviceError,
    DTypeError,
    Event,
    Library,
    OpBridgeError,
    OutOfMemoryError,
    ShapeError,
    Stream,
    Tensor,
    asarray,
    current_stream,
    devices,
    empty,
    empty_cache,
    from_dlpack,
    get_memory_pool_stats,
    load_library,
    matmul,
    reset_peak_memory_stats,
    set_memory_limit,
    synchronize,
    vector_add,
    zeros,
)
from .ops import list_ops
from .tuning import calibrate, crossovers, explain, set_crossover


def _package_version() -> str:
    """The installed distribution's version (the native module's when run from a source tree)."""
    from importlib import metadata

    try:
        return metadata.version("opbridge")
    except metadata.PackageNotFoundError:
        return str(_native.build_info()["version"])


__version__ = _package_version()


def get_include() -> str:
    """The folder of opbridge's C headers, for ``-I``: operator libraries include
    ``<opbridge/plugin.h>`` (as with ``numpy.get_include()``)."""
    return _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "include")


from . import ascend, jit, profiler  # noqa: E402  (they use get_include and the native types above)
from .doctor import doctor  # noqa: E402
from .memory import memory_snapshot, memory_summary  # noqa: E402

tuning._load_saved()
tuning._load_saved_crossovers()


def _drain_at_exit() -> None:
    # Let queued work (host functions included) finish while the interpreter can still run it.
    try:
        _native.synchronize()
    except OpBridgeError:
        pass
    # Then accelerators return their memory and finalize their drivers (a driver's leak
    # report, such as the Ascend test double's, then shows only what live tensors hold).
    try:
        _native.shutdown_devices()
    except OpBridgeError:
        pass


_atexit.register(_drain_at_exit)
profiler._trace_from_env()  # OPBRIDGE_TRACE=trace.json: profile this whole process

__all__ = [
    "ArgumentError",
    "DTypeError",
    "DeviceError",
    "Event",
    "Library",
    "OpBridgeError",
    "OutOfMemoryError",
    "ShapeError",
    "Stream",
    "Tensor",
    "asarray",
    "ascend",
    "calibrate",
    "crossovers",
    "current_stream",
    "devices",
    "doctor",
    "empty",
    "empty_cache",
    "explain",
    "from_dlpack",
    "get_include",
    "get_memory_pool_stats",
    "jit",
    "list_ops",
    "load_library",
    "ops",
    "profiler",
    "matmul",
    "memory_snapshot",
    "memory_summary",
    "reset_peak_memory_stats",
    "set_crossover",
    "set_memory_limit",
    "synchronize",
    "tuning",
    "vector_add",
    "zeros",
]
