"""asyncio support: ``await event`` and ``await tensor``.

A device wait blocks a thread, so it runs in the loop's default executor; the event loop itself
never blocks.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._native import Event, Tensor


async def wait_event(event: Event) -> None:
    if not event.query():
        await asyncio.get_running_loop().run_in_executor(None, event.synchronize)


async def wait_tensor(tensor: Tensor) -> Tensor:
    if not tensor.is_ready():
        await asyncio.get_running_loop().run_in_executor(None, tensor.synchronize)
    return tensor
