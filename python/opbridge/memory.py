"""The device pool, block by block: ``memory_snapshot()`` and its rendering, ``memory_summary()``
(as ``torch.cuda.memory_snapshot`` / ``memory_summary``).

A snapshot is a list of segments (memory reserved from the device), each with its blocks in
address order::

    {"device": "cpu:0", "address": int, "total_size": int, "stream": int,
     "blocks": [{"address": int, "size": int, "state": "allocated" | "pending" | "cached",
                 "stream": int, "op": str | None}]}

``pending``: freed, but another stream may still use it (reused once that stream gets there).
``op`` names the operator whose call allocated the block when memory was being profiled then
(``ob.profiler.profile(profile_memory=True)``). Allocated and pending blocks add up to
``get_memory_pool_stats()["allocated_bytes.current"]``; all blocks to ``reserved_bytes.current``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from . import _native

__all__ = ["memory_snapshot", "memory_summary"]


def memory_snapshot(device: str | None = None) -> list[dict[str, Any]]:
    """The device pool's segments and blocks (see the module's doc)."""
    return _native.memory_snapshot(device)


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def memory_summary(device: str | None = None) -> str:
    """A readable report of the device pool: its counters, its segments, and who holds what."""
    stats = _native.get_memory_pool_stats(device)
    segments = memory_snapshot(device)
    name = segments[0]["device"] if segments else (device or "cpu:0")
    allocated, reserved = stats["allocated_bytes.current"], stats["reserved_bytes.current"]
    lines = [
        f"opbridge memory summary: {name}",
        f"  allocated   {_bytes(allocated):>12}  (peak {_bytes(stats['allocated_bytes.peak'])}, "
        f"{stats['allocated_blocks']} blocks, {stats['pending_free_blocks']} pending on a stream)",
        f"  reserved    {_bytes(reserved):>12}  (peak {_bytes(stats['reserved_bytes.peak'])}, "
        f"{len(segments)} segments)",
        f"  cached      {_bytes(reserved - allocated):>12}  ({stats['free_blocks']} free blocks, "
        f"{_bytes(stats['fragmented_bytes'])} fragmented)",
        f"  limit       {'none' if stats['limit'] is None else _bytes(stats['limit']):>12}",
        f"  allocations {stats['num_allocs']:>12}  ({stats['num_cache_hits']} from the cache, "
        f"{stats['num_alloc_retries']} retries, {stats['num_ooms']} out of memory)",
    ]
    if segments:
        lines.append("  segments:")
        for seg in segments:
            counts: dict[str, int] = defaultdict(int)
            for block in seg["blocks"]:
                counts[block["state"]] += block["size"]
            parts = ", ".join(f"{state} {_bytes(n)}" for state, n in sorted(counts.items()))
            lines.append(f"    {seg['address']:#x}  {_bytes(seg['total_size']):>10}  stream {seg['stream']}: {parts}")
    by_op: dict[str, list[int]] = defaultdict(list)
    for seg in segments:
        for block in seg["blocks"]:
            if block["state"] != "cached":
                by_op[block["op"] or "(no operator recorded)"].append(block["size"])
    if by_op:
        lines.append("  in use, by operator:")
        for op, sizes in sorted(by_op.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"    {op:<24} {len(sizes):>6} blocks  {_bytes(sum(sizes)):>12}")
    return "\n".join(lines)
