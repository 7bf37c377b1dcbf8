"""Registered operators, built-in and loaded from libraries.

Every operator is an attribute of this module (its latest version) and is also reachable by name
and version::

    >>> import numpy as np, opbridge as ob
    >>> ob.ops.vector_add(np.ones(3), np.ones(3))
    array([2., 2., 2.])
    >>> ob.ops.get("vector_add", version=1)
    <opbridge op vector_add v1 (built-in)>

Each ``Op`` has a docstring and a signature generated from its schema, so ``help(ob.ops.matmul)``
and ``inspect.signature`` describe it. Unknown names and versions raise ``OpBridgeError`` listing
what exists.
"""

from __future__ import annotations

import inspect
from typing import Any

from . import _native
from ._native import Op, OpBridgeError

__all__ = ["Op", "get", "list_ops"]

# (name, version or None) -> Op, valid for one registry generation.
_cache: dict[tuple[str, int | None], Op] = {}
_generation = -1

_EMPTY = inspect.Parameter.empty


def _signature(schema: dict[str, Any]) -> inspect.Signature:
    params = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None if optional else _EMPTY)
        for name, optional in schema["inputs"]
    ]
    for name, default, required, _doc in schema["attrs"]:
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=_EMPTY if required else default))
    params.append(inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature(params)


def _docstring(op: Op, schema: dict[str, Any]) -> str:
    lines = [f"{op.signature}", "", schema["doc"] or f"The {op.name} operator.", ""]
    lines.append("Args:")
    per_input = schema.get("input_dtypes") or [schema["dtypes"]] * len(schema["inputs"])
    for (name, optional), dtypes in zip(schema["inputs"], per_input, strict=True):
        lines.append(f"    {name}: {'optional ' if optional else ''}array or Tensor of {', '.join(dtypes)}.")
    for name, default, required, doc in schema["attrs"]:
        suffix = "" if required else f" Default: {default!r}."
        lines.append(f"    {name}: {doc}{suffix}")
    lines.append("    out: optional output array(s) to write into.")
    lines += ["", f"Version {op.version}, from {op.source}."]
    return "\n".join(lines)


def get(name: str, version: int | None = None) -> Op:
    """The operator ``name`` at ``version`` (the latest when omitted)."""
    global _generation
    generation = _native.registry_generation()
    if generation != _generation:
        _cache.clear()
        _generation = generation
    key = (name, version)
    op = _cache.get(key)
    if op is None:
        op = _native.get_op(name, version)
        schema = op.schema
        op.__doc__ = _docstring(op, schema)
        op.__signature__ = _signature(schema)  # type: ignore[attr-defined]
        _cache[key] = op
    return op


def list_ops() -> list[dict[str, Any]]:
    """Every registered operator: name, versions, and per version its source, dtypes, devices."""
    return _native.list_ops()


# Names of operators installed as module attributes by `__getattr__`: the first `ob.ops.add`
# goes through `__getattr__` (which Python reaches only after a failed lookup, a microsecond and
# more), later ones are plain attribute lookups. `load_library` and `Library.unload` call
# `_invalidate`, so an attribute never outlives the operator version it names.
_installed: set[str] = set()


def _invalidate() -> None:
    """Forgets the operators installed as attributes (the native layer calls this when
    operators change; `get`'s own cache follows the registry generation by itself)."""
    # A copy: another thread may install a name while this loop runs (between bytecodes).
    for name in list(_installed):
        globals().pop(name, None)
        _installed.discard(name)


def __getattr__(name: str) -> Op:
    if name.startswith("__"):
        raise AttributeError(name)
    generation = _native.registry_generation()
    try:
        op = get(name)
    except OpBridgeError as e:
        raise AttributeError(str(e)) from None
    globals()[name] = op
    _installed.add(name)
    # A load or unload on another thread since the lookup: its `_invalidate` may have run
    # before the install above, so take the name back (the next access looks it up again).
    if _native.registry_generation() != generation:
        globals().pop(name, None)
        _installed.discard(name)
    return op


def __dir__() -> list[str]:
    return sorted({*__all__, *(info["name"] for info in _native.list_ops())})
