"""Ascend-specific entry points: kernels built by the Ascend C toolchain, launched from Python.

    import opbridge as ob
    k = ob.ascend.Kernel.from_file("vector_add.o", "vector_add_kernel",
                                   params=["tensor", "tensor", "tensor", "uint32"])
    x = ob.asarray(a, device="ascend:0"); y = ob.asarray(b, device="ascend:0")
    z = ob.empty(a.shape, dtype=a.dtype, device="ascend:0")
    k(8, x, y, z, a.size)          # 8 blocks, on this thread's current ascend stream; returns at once
    z.numpy()                      # waits for the kernel

``params`` names the kernel's parameters in order, as its C declaration says (a kernel binary does
not carry them): ``"tensor"`` for a global-memory pointer (``GM_ADDR``), ``"int32"``,
``"uint32"``, ``"int64"``, ``"uint64"``, ``"float32"``. Arguments are checked against them before
anything is enqueued: a wrong count, kind or value is an ``ArgumentError``; a tensor on another
device a ``DeviceError``. Without ``params``, each call's arguments give the types: Tensors, and
numpy scalars for the rest (``k(8, x, y, z, numpy.uint32(n))``); a plain Python number is then an
``ArgumentError`` (its C type is unknown). Tensors are passed as device pointers; the kernel may write any of them,
so later work on them (on any stream, or ``Tensor.numpy()``) waits for it. A failure while the
kernel runs is reported by the next synchronizing call, naming the kernel.

Loading uses ``aclrtBinaryLoadFromFile`` / ``aclrtBinaryLoadFromData`` and
``aclrtBinaryGetFunction``; the launch ``aclrtLaunchKernelWithHostArgs`` (CANN 8.2 or later). On
the ACL test double (``python -m opbridge.testing.ascend_double``), a kernel binary is a shared
object built from C in the double's test-only dialect (``acldouble_kernel.h``; see
``opbridge.testing.ascend_double.compile_kernel``).
"""

from __future__ import annotations

from ._native import Kernel

__all__ = ["Kernel"]
