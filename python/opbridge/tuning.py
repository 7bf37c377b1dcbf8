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
import tempfile
import warnings
from pathlib import Path

from . import _native

__all__ = ["cache_dir", "calibrate", "thresholds", "thresholds_path"]


def cache_dir() -> Path:
    """opbridge's per-user cache folder (thresholds, JIT-compiled plugins)."""
    if os.environ.get("OPBRIDGE_CACHE_DIR"):
        return Path(os.environ["OPBRIDGE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "opbridge"


def thresholds_path() -> Path:
    return cache_dir() / "thresholds.json"


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
    return measured


def _load_saved() -> None:
    path = thresholds_path()
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        warnings.warn(f"opbridge: ignoring unreadable thresholds file {path}: {e}", RuntimeWarning, stacklevel=2)
        return
    if isinstance(saved, dict) and all(isinstance(v, int) and v > 0 for v in saved.values()):
        _native.set_thresholds(saved)
    else:
        warnings.warn(f"opbridge: ignoring malformed thresholds file {path}", RuntimeWarning, stacklevel=2)
