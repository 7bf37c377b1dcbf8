"""Dispatch thresholds (one thread vs all cores), measured per machine.

opbridge ships thresholds measured on its reference machine. ``calibrate()`` re-measures them on
yours and saves them in a per-user cache file, which every later ``import opbridge`` loads::

    >>> import opbridge as ob
    >>> ob.calibrate()          # about a second
    {'elementwise_parallel_min_elems': 262144, 'matmul_parallel_min_flops': 110592,
     'transcendental_parallel_min_elems': 131072}

The cache folder is ``$OPBRIDGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/opbridge``, else
``~/.cache/opbridge``.
"""

from __future__ import annotations

import json
import os
import platform
import stat
import struct
import sys
import tempfile
import warnings
from pathlib import Path

from . import _native

__all__ = ["cache_dir", "calibrate", "cpu_identity", "thresholds", "thresholds_path"]


def cache_dir() -> Path:
    """opbridge's per-user cache folder (thresholds, JIT-compiled plugins)."""
    if os.environ.get("OPBRIDGE_CACHE_DIR"):
        return Path(os.environ["OPBRIDGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "opbridge"


def thresholds_path() -> Path:
    return cache_dir() / "thresholds.json"


def identity_path() -> Path:
    """Where ``calibrate`` records the CPU it measured on (``opbridge doctor`` compares it)."""
    return cache_dir() / "thresholds.cpu.json"


def cpu_identity() -> dict[str, object]:
    """What identifies this CPU for the calibration: model, architecture, logical CPUs."""
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"model": model or "unknown", "machine": platform.machine(), "logical_cpus": os.cpu_count() or 1}


def thresholds() -> dict[str, int]:
    """The thresholds in force."""
    return _native.get_thresholds()


def calibrate(save: bool = True) -> dict[str, int]:
    """Measures the thresholds on this machine, applies them, and (by default) saves them."""
    measured = _native.calibrate_thresholds()
    if save:
        path = thresholds_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename: a concurrent import never reads a half-written file.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(measured, f)
        os.replace(f.name, path)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(cpu_identity(), f)
        os.replace(f.name, identity_path())
    return measured


# The keys of the thresholds file and the largest value each may hold (a native ``usize``).
_KEYS = ("elementwise_parallel_min_elems", "matmul_parallel_min_flops", "transcendental_parallel_min_elems")
_MAX = 2 ** (8 * struct.calcsize("P")) - 1


def _warn(message: str) -> None:
    """A ``RuntimeWarning`` about the thresholds file. Never fails the import: where warnings are
    turned into errors (``-W error``), the message goes to stderr instead."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    except Warning:
        print(message, file=sys.stderr)


# The file holds three numbers: anything larger is not ours (a device, a stray big file).
_MAX_FILE_BYTES = 64 * 1024


def _read_small_regular_file(path: os.PathLike[str] | str) -> str:
    """The text of a regular file of at most ``_MAX_FILE_BYTES``, opened without blocking: a FIFO
    or a device in its place is an ``OSError``, never a hang or an unbounded read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        data = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:
        raise OSError(f"{path} is larger than {_MAX_FILE_BYTES} bytes")
    return data.decode("utf-8")


def _load_saved() -> None:
    """Applies the saved thresholds, if any. Anything wrong with the file (unreadable, not JSON,
    not an object, an unknown key, a value that is not a positive integer that fits) is a
    ``RuntimeWarning`` and that value keeps its default: never an import failure."""
    try:
        path = thresholds_path()
        text = _read_small_regular_file(path)
    except FileNotFoundError:
        return
    except (OSError, ValueError, RuntimeError, MemoryError) as e:  # a directory, a FIFO, no home...
        _warn(f"opbridge: ignoring unreadable thresholds file: {e}")
        return
    try:
        saved = json.loads(text)
    except (ValueError, RecursionError) as e:
        _warn(f"opbridge: ignoring unreadable thresholds file {path}: {e}")
        return
    if not isinstance(saved, dict):
        _warn(f"opbridge: ignoring malformed thresholds file {path}: not a JSON object")
        return
    good: dict[str, int] = {}
    for key, value in saved.items():
        if key not in _KEYS:
            _warn(f"opbridge: ignoring unknown key {key!r} in thresholds file {path}")
        elif type(value) is not int or not 1 <= value <= _MAX:
            _warn(
                f"opbridge: ignoring malformed thresholds file {path} entry {key!r}: "
                f"{_short(value)} is not an integer from 1 to {_MAX}; the default is kept"
            )
        else:
            good[key] = value
    if good:
        try:
            _native.set_thresholds(good)
        except Exception as e:  # noqa: BLE001  (a value the native side refuses: keep the defaults)
            _warn(f"opbridge: ignoring thresholds file {path}: {e}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
