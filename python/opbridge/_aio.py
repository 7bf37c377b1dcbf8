"""asyncio support: ``await event`` and ``await tensor``.

A device wait blocks a thread, so it runs in the loop's default executor; the event loop itself
never blocks. Inside stream work (a host function running an event loop of its own) the wait runs
on the calling worker thread instead: only there can the runtime see that it waits for work queued
behind itself, and raise ``DeviceError`` rather than hang in an executor thread.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from . import _native

if TYPE_CHECKING:
    from ._native import Event, Tensor


async def wait_event(event: Event) -> None:
    if not event.query():
        if _native.on_stream_worker():
            event.synchronize()  # checked for waits on the worker's own queue
        else:
            await asyncio.get_running_loop().run_in_executor(None, event.synchronize)


async def wait_tensor(tensor: Tensor) -> Tensor:
    if not tensor.is_ready():
        if _native.on_stream_worker():
            tensor.synchronize()  # checked for waits on the worker's own queue
        else:
            await asyncio.get_running_loop().run_in_executor(None, tensor.synchronize)
    return tensor
