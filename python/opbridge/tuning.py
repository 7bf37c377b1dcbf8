"""Dispatch thresholds (one thread vs all cores; host vs accelerator), measured per machine.

opbridge ships thresholds measured on its reference machine. ``calibrate()`` re-measures them on
yours and saves them in a per-user cache file, which every later ``import opbridge`` loads::

    >>> import opbridge as ob
    >>> ob.calibrate()          # about a second (plus a few with an accelerator)
    {'elementwise_parallel_min_elems': 262144, 'matmul_parallel_min_flops': 110592,
     'transcendental_parallel_min_elems': 131072}

With an accelerator available, it also measures, per operator and dtype, the size from which
staging a numpy call through the device (copies included) beats the host kernel: the
crossovers that ``device="auto"`` follows (the seed's ``HybridOperator``, measured instead of
``if n < 1024``). They are saved beside the thresholds with the device's chip and driver
library, and not used on another device::

    >>> ob.ops.add(a, b, device="auto")     # host below the crossover, the device above it
    >>> ob.explain("add", a, b)              # {'path': 'host', 'reason': 'host: add on 4096 ...'}
    >>> ob.crossovers()                      # [{'op': 'add', 'dtype': 'float32', 'device': ...}]

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
from collections.abc import Callable
from pathlib import Path

from . import _native

__all__ = [
    "cache_dir",
    "calibrate",
    "cpu_identity",
    "crossovers",
    "crossovers_path",
    "explain",
    "set_crossover",
    "thresholds",
    "thresholds_path",
]


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


def calibrate(save: bool = True, devices: bool = True) -> dict[str, int]:
    """Measures the thresholds on this machine, applies them, and (by default) saves them.

    With ``devices`` (the default), also measures the host/device crossovers of every
    available accelerator (see the module's docstring), applies and saves them. Returns the
    CPU thresholds; ``crossovers()`` lists the rest."""
    measured = _native.calibrate_thresholds()
    found: list[dict[str, object]] = []
    measured_devices: set[str] = set()
    if devices:
        for report in _native.devices():
            name = str(report.get("name", ""))
            if report.get("available") and report.get("kind") != "cpu" and ":" in name:  # a device, not a backend
                found.extend(measure_crossovers(name))
                measured_devices.add(name)
        # What was measured replaces what was in force for those devices (an entry that could
        # not be measured again is not kept); other devices' entries stay.
        kept = [e for e in crossovers() if e["device"] not in measured_devices]
        _native.clear_crossovers()
        for entry in kept + found:
            _apply(entry)
    if save:
        path = thresholds_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_json(path, measured)
        _write_json(identity_path(), cpu_identity())
        if devices:
            # Saved entries of devices not measured here (another machine sharing the cache,
            # a busy device) are kept.
            saved = [e for e in _saved_crossovers() if e.get("device") not in measured_devices]
            _write_json(crossovers_path(), saved + found)
    return measured


def _saved_crossovers() -> list[dict[str, object]]:
    """The saved crossover entries that are well formed (nothing when the file is unreadable)."""
    try:
        saved = json.loads(_read_small_regular_file(crossovers_path()))
    except (OSError, ValueError, RecursionError, RuntimeError, MemoryError):
        return []
    return [e for e in saved if _well_formed(e)] if isinstance(saved, list) else []


def _write_json(path: Path, value: object) -> None:
    # Write-then-rename: a concurrent import never reads a half-written file.
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(value, f)
    os.replace(f.name, path)


def crossovers_path() -> Path:
    """Where ``calibrate`` saves the host/device crossovers."""
    return cache_dir() / "crossovers.json"


def crossovers() -> list[dict[str, object]]:
    """The crossovers in force: ``[{'op', 'dtype', 'device', 'elems', 'identity'}]``
    (``elems`` None: the device was never faster)."""
    return _native.crossovers()


def set_crossover(op: str, dtype: str, elems: int | None, device: str = "ascend:0") -> None:
    """Sets by hand the size from which ``device="auto"`` stages ``op`` in ``dtype`` through
    ``device`` (``None``: never), for this process, as if measured on the device now present."""
    if elems is not None and (type(elems) is not int or elems < 1):
        raise _native.ArgumentError(f"set_crossover: elems must be a positive int or None, got {elems!r}")
    identity = _native.device_identity(device)
    if identity is None:
        raise _native.DeviceError(f"set_crossover: {device} is not available")
    staged = {name: dtypes for name, _, dtypes in _native.staged_ops(device)}
    if op not in staged or dtype not in staged[op]:
        raise _native.ArgumentError(
            f"set_crossover: {device} cannot stage {op} in {dtype} (stageable: {', '.join(sorted(staged))})"
        )
    _native.set_crossover(op, dtype, device, elems, identity)


def explain(op: object, *args: object, out: object = None, device: str = "auto") -> dict[str, str]:
    """Which path ``op(*args, out=out, device=device)`` takes, and why:
    ``{'path': 'host' | 'ascend:0', 'reason': ...}``. ``op`` is a name or an ``ob.ops`` operator."""
    return _native.explain(op, *args, out=out, device=device)


# Sizes the crossover search times, in elements (float32: 16 KiB to 16 MiB per array).
_SWEEP = [1 << k for k in range(12, 23, 2)]


def _best(f: object, repeat: int = 3) -> float:
    import time

    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        f()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t)
    return best


def measure_crossovers(device: str) -> list[dict[str, object]]:
    """The crossover of every operator ``device`` can stage, in float32 and float16: the
    smallest size of the sweep from which the staged call (copies included) is at least 5%
    faster than the host kernel at that size and every larger one; ``None`` when it never is.
    The largest size is timed first: a device that loses there loses below it too (copies and
    launch costs weigh more on small inputs), so such an operator costs one comparison."""
    import numpy as np

    from . import ops

    identity = _native.device_identity(device)
    if identity is None:
        return []
    found: list[dict[str, object]] = []
    for name, arity, dtypes in _native.staged_ops(device):
        op = ops.get(name)
        for dtype in ("float32", "float16"):
            if dtype not in dtypes:
                continue
            arrays = [np.ones(_SWEEP[-1], dtype) for _ in range(arity)]
            try:
                elems: int | None = None
                for n in reversed(_SWEEP):
                    if not _staged_wins(op, [a[:n] for a in arrays], device):
                        break
                    elems = n
            except _native.OpBridgeError:
                continue  # the device has no kernel for this dtype
            found.append({"op": name, "dtype": dtype, "device": device, "elems": elems, "identity": identity})
    return found


def _staged_wins(op: object, args: list[object], device: str) -> bool:
    """Whether ``op(*args, device=device)`` is at least 5% faster than ``op(*args)``."""
    op(*args, device=device)  # type: ignore[operator]  # warm: the pools, the device's executors
    staged = _best(lambda: op(*args, device=device), 1)  # type: ignore[operator]
    host = _best(lambda: op(*args), 1)  # type: ignore[operator]
    if staged > 1.5 * host:
        return False  # clearly slower: no need for the best of several
    return _best(lambda: op(*args, device=device)) < 0.95 * _best(lambda: op(*args))  # type: ignore[operator]


def _apply(entry: dict[str, object]) -> None:
    _native.set_crossover(entry["op"], entry["dtype"], entry["device"], entry["elems"], entry["identity"])


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
    path, saved = _read_saved(thresholds_path, "thresholds")
    if saved is None:
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


def _read_saved(locate: Callable[[], Path], what: str) -> tuple[Path | None, object | None]:
    """The path and JSON value of a saved file; value None when there is none or it cannot be
    read (a ``RuntimeWarning`` then; never an import failure)."""
    path = None
    try:
        path = locate()
        text = _read_small_regular_file(path)
    except FileNotFoundError:
        return path, None
    except (OSError, ValueError, RuntimeError, MemoryError) as e:  # a directory, a FIFO, no home...
        _warn(f"opbridge: ignoring unreadable {what} file: {e}")
        return path, None
    try:
        return path, json.loads(text)
    except (ValueError, RecursionError) as e:
        _warn(f"opbridge: ignoring unreadable {what} file {path}: {e}")
        return path, None


def _well_formed(entry: object) -> bool:
    """A crossover entry as ``calibrate`` writes it."""
    return (
        isinstance(entry, dict)
        and all(isinstance(entry.get(k), str) for k in ("op", "dtype", "device", "identity"))
        and (entry.get("elems") is None or (type(entry.get("elems")) is int and 0 < entry["elems"] <= _MAX))
    )


def _load_saved_crossovers() -> None:
    """Applies the saved crossovers, if any; a malformed file or entry is a ``RuntimeWarning``
    and is skipped (``device="auto"`` then stays on the host), never an import failure. Entries
    keep the device they were measured on: on another device they are not used."""
    path, saved = _read_saved(crossovers_path, "crossovers")
    if saved is None:
        return
    if not isinstance(saved, list):
        _warn(f"opbridge: ignoring malformed crossovers file {path}: not a JSON list")
        return
    for entry in saved:
        if not _well_formed(entry):
            _warn(f"opbridge: ignoring malformed entry {_short(entry)} in crossovers file {path}")
            continue
        try:
            _apply(entry)
        except Exception as e:  # noqa: BLE001  (an unknown dtype or device name: skip the entry)
            _warn(f"opbridge: ignoring entry {_short(entry)} in crossovers file {path}: {e}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
