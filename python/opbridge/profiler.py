"""The profiler: what opbridge did, where and for how long, as a Chrome/Perfetto trace and a table.

    import opbridge as ob
    with ob.profiler.profile(record_shapes=True, profile_memory=True) as prof:
        y = ob.ops.softmax(x, axis=-1)
    prof.export_chrome_trace("trace.json")           # open in https://ui.perfetto.dev or chrome://tracing
    print(prof.key_averages().table(sort_by="device_time_total"))

Recorded: every operator call (name, version, device, stream, and with ``record_shapes`` its input
shapes and dtypes), the kernels where they ran (a stream's worker thread is that stream's track;
each kernel is linked to the call that enqueued it by a flow arrow), copies (direction, bytes,
GB/s), stream waits and synchronizes, host functions, plugin loads and unloads, JIT compiles, and
with ``profile_memory`` the pool's events (allocations with cache hit or new segment, frees, retries,
out-of-memory, ``empty_cache``). ``record_function("name")`` adds your own ranges.

``device_time`` is the time the work ran where it runs: the kernel's span on its stream for
tensor calls, the call itself for numpy calls (their kernel runs on the calling thread).

``OPBRIDGE_TRACE=trace.json python app.py`` profiles a whole process (shapes and memory included)
and writes the trace when it exits (``%p`` in the path becomes the pid; child processes that
inherit the variable write ``trace.<pid>.json`` beside it instead of overwriting it).

With no profile active each instrumented point costs one relaxed atomic load.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from . import _native
from ._native import OpBridgeError

__all__ = ["EventList", "FunctionEventAvg", "profile", "record_function"]


@dataclass
class FunctionEventAvg:
    """Totals for one operator (or one operator and input shapes): times in microseconds."""

    key: str
    count: int = 0
    cpu_time_total: float = 0.0
    device_time_total: float = 0.0
    input_shapes: str = ""

    @property
    def cpu_time(self) -> float:
        return self.cpu_time_total / self.count if self.count else 0.0

    @property
    def device_time(self) -> float:
        return self.device_time_total / self.count if self.count else 0.0

    # torch.profiler's names, for code written against it.
    @property
    def self_cpu_time_total(self) -> float:
        return self.cpu_time_total

    @property
    def cuda_time_total(self) -> float:
        return self.device_time_total


_SORT_ALIASES = {
    "self_cpu_time_total": "cpu_time_total",
    "cuda_time_total": "device_time_total",
    "self_device_time_total": "device_time_total",
    "self_cuda_time_total": "device_time_total",
    "calls": "count",
}


class EventList(list[FunctionEventAvg]):
    """``key_averages()``'s rows; ``table()`` renders them."""

    def table(self, sort_by: str | None = None, row_limit: int = 100) -> str:
        rows = list(self)
        if sort_by is not None:
            key = _SORT_ALIASES.get(sort_by, sort_by)
            if key not in ("count", "cpu_time_total", "device_time_total", "cpu_time", "device_time"):
                raise ValueError(
                    f"sort_by {sort_by!r}: use cpu_time_total, device_time_total, cpu_time, device_time or count"
                )
            rows.sort(key=lambda r: getattr(r, key), reverse=True)
        rows = rows[:row_limit] if row_limit >= 0 else rows
        shapes = any(r.input_shapes for r in rows)
        width = max([len("Name"), *(len(r.key) for r in rows)])
        header = (
            f"{'Name':<{width}}  {'Calls':>7}  {'CPU total':>11}  {'CPU avg':>10}  {'Device total':>12}"
            f"  {'Device avg':>10}"
        )
        if shapes:
            header += "  Input shapes"
        lines = [header, "-" * len(header)]
        for r in rows:
            line = (
                f"{r.key:<{width}}  {r.count:>7}  {_us(r.cpu_time_total):>11}  {_us(r.cpu_time):>10}"
                f"  {_us(r.device_time_total):>12}  {_us(r.device_time):>10}"
            )
            if shapes:
                line += f"  {r.input_shapes}"
            lines.append(line)
        total_cpu = sum(r.cpu_time_total for r in self)
        total_device = sum(r.device_time_total for r in self)
        lines.append(f"Self CPU time total: {_us(total_cpu)}; device time total: {_us(total_device)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _us(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.3f}s"
    if value >= 1e3:
        return f"{value / 1e3:.3f}ms"
    return f"{value:.3f}us"


@dataclass
class _Call:
    """An operator call reconstructed from its begin / end events."""

    name: str
    track: int
    begin_ns: int
    end_ns: int = 0
    args: dict[str, Any] = field(default_factory=dict)
    flows: list[int] = field(default_factory=list)


class profile:  # noqa: N801  (torch.profiler's spelling, which users know)
    """Records what opbridge does while active (a context manager, or ``start()`` / ``stop()``).

    One profile records at a time in a process. Leaving it synchronizes every stream first, so
    the kernels enqueued inside it are in the trace.
    """

    def __init__(self, *, record_shapes: bool = False, profile_memory: bool = False) -> None:
        self.record_shapes = bool(record_shapes)
        self.profile_memory = bool(profile_memory)
        self._events: list[tuple[str, str, str, int, int, int, dict[str, Any], int]] = []
        self._tracks: dict[int, str] = {}
        self._thread_names: dict[int, str] = {}
        self._running = False

    def start(self) -> profile:
        try:
            _native.profiler_start(self.record_shapes, self.profile_memory)
        except RuntimeError as e:
            if _env_profile is not None and _env_profile._running:
                raise RuntimeError(f"{e}: OPBRIDGE_TRACE is profiling the whole process") from None
            raise
        self._events, self._tracks = [], {}
        self._running = True
        self._thread_names = _python_thread_names()
        return self

    def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        try:
            # Work enqueued inside the profile runs inside it. A drain, not a synchronize: a
            # failed kernel's error stays for the user's own synchronize.
            _native.drain()
        except OpBridgeError:
            pass  # a device that cannot be waited for: what ran is still recorded
        recorded = _native.profiler_stop()
        if recorded is not None:
            events, tracks = recorded
            self._events = list(events)
            # Python's threads have no OS-level names here: name their tracks after them.
            names = {**self._thread_names, **_python_thread_names()}
            self._tracks = {
                track: names.get(os_id, name) if name.startswith("thread ") else name for track, name, os_id in tracks
            }

    def __enter__(self) -> profile:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what was recorded ------------------------------------------------------------------

    def _stopped(self) -> None:
        if self._running:
            raise RuntimeError("the profile is still recording: stop it (leave its `with`) before reading it")

    def events(self) -> list[dict[str, Any]]:
        """The raw events: phase (B, E, X, i, s, f), category, name, ts_ns, track, flow, args,
        dur_ns (of X events)."""
        self._stopped()
        keys = ("phase", "category", "name", "ts_ns", "track", "flow", "args", "dur_ns")
        return [dict(zip(keys, e, strict=True)) for e in self._events]

    def _calls(self) -> tuple[list[_Call], dict[int, int]]:
        """Operator calls (host spans of category ``op``) and each flow's kernel duration (ns)."""
        calls: list[_Call] = []
        stacks: dict[int, list[tuple[str, str, int, dict[str, Any], _Call | None]]] = {}
        kernel_ns: dict[int, int] = {}
        pending_flow: dict[int, int] = {}  # track -> the flow that ends at its next begin
        for phase, category, name, ts, track, flow, args, _ in self._events:
            stack = stacks.setdefault(track, [])
            if phase == "B":
                call = _Call(name, track, ts, args=dict(args)) if category == "op" else None
                ended = pending_flow.pop(track, None)  # a flow ends at the begin right after it
                if category == "kernel" and ended is not None:
                    args = {**args, "_flow": ended}
                stack.append((category, name, ts, args, call))
            elif phase == "E" and stack:
                category_b, _, begin, args_b, call = stack.pop()
                if call is not None:
                    call.end_ns = ts
                    calls.append(call)
                if category_b == "kernel" and "_flow" in args_b:
                    kernel_ns[args_b["_flow"]] = ts - begin
            elif phase == "s":
                for entry in reversed(stack):
                    if entry[4] is not None:
                        entry[4].flows.append(flow)
                        break
            elif phase == "f":
                pending_flow[track] = flow
        return calls, kernel_ns

    def key_averages(self, group_by_input_shape: bool = False) -> EventList:
        """Per operator (and input shapes): calls, host time and device time, in microseconds."""
        self._stopped()
        calls, kernel_ns = self._calls()
        rows: dict[tuple[str, str], FunctionEventAvg] = {}
        for call in calls:
            shapes = call.args.get("input_shapes", "") if group_by_input_shape else ""
            row = rows.setdefault((call.name, shapes), FunctionEventAvg(call.name, input_shapes=shapes))
            host_ns = call.end_ns - call.begin_ns
            row.count += 1
            row.cpu_time_total += host_ns / 1e3
            if call.args.get("stream") == "inline":
                row.device_time_total += host_ns / 1e3
            else:
                row.device_time_total += sum(kernel_ns.get(f, 0) for f in call.flows) / 1e3
        return EventList(rows.values())

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Writes the Chrome trace-event JSON (Perfetto and chrome://tracing open it)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome_trace(), f)

    def chrome_trace(self) -> dict[str, Any]:
        """The trace as a dict in the Chrome trace-event format."""
        self._stopped()
        pid = os.getpid()
        trace: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": "opbridge"}}]
        for track, name in sorted(self._tracks.items()):
            trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": track, "args": {"name": name}})
        for phase, category, name, ts, track, flow, args, dur in self._events:
            event: dict[str, Any] = {
                "name": name,
                "cat": category,
                "ph": phase,
                "ts": ts / 1e3,
                "pid": pid,
                "tid": track,
            }
            if phase == "X":
                event["dur"] = dur / 1e3
            if phase in ("s", "f"):
                event["id"] = flow
                event["cat"] = "flow"
            if phase == "i":
                event["s"] = "t"
            if args:
                event["args"] = dict(args)
            trace.append(event)
        return {"traceEvents": trace, "displayTimeUnit": "ns"}


def _python_thread_names() -> dict[int, str]:
    """OS thread id -> Python thread name, for the threads alive now."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


@contextlib.contextmanager
def record_function(name: str) -> Iterator[None]:
    """A range of your own on the calling thread's track (when a profile is recording). It is
    recorded whole when it ends, so ranges may interleave (two asyncio tasks' on one thread)."""
    if not _native.profiler_active():
        yield
        return
    label = str(name)
    begin = _native.profiler_now()
    try:
        yield
    finally:
        _native.profiler_complete("user", label, begin)


_env_profile: profile | None = None
_env_lock = threading.Lock()


def _trace_path(raw: str) -> str:
    """Where this process writes its trace: ``%p`` becomes the pid; a child process that inherited
    the variable from a traced parent writes ``<name>.<pid>.json`` instead of overwriting it."""
    path = raw.replace("%p", str(os.getpid()))
    owner = os.environ.get("OPBRIDGE_TRACE_OWNER")
    if "%p" not in raw and owner not in (None, str(os.getpid())):
        root, ext = os.path.splitext(path)
        path = f"{root}.{os.getpid()}{ext or '.json'}"
    os.environ["OPBRIDGE_TRACE_OWNER"] = str(os.getpid())
    return os.path.abspath(path)


def _trace_from_env() -> None:
    """``OPBRIDGE_TRACE=path``: profile the whole process and write the trace at exit. A path
    that cannot be written is a warning at import, and nothing is recorded."""
    global _env_profile
    raw = os.environ.get("OPBRIDGE_TRACE")
    if not raw:
        return
    path = _trace_path(raw)
    folder = os.path.dirname(path)
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        import warnings

        warnings.warn(f"OPBRIDGE_TRACE={raw!r}: cannot write {path}; not tracing", RuntimeWarning, stacklevel=3)
        return
    with _env_lock:
        if _env_profile is not None:
            return
        _env_profile = profile(record_shapes=True, profile_memory=True).start()

    def write() -> None:
        assert _env_profile is not None
        _env_profile.stop()
        try:
            _env_profile.export_chrome_trace(path)
        except OSError as e:
            import sys

            print(f"opbridge: OPBRIDGE_TRACE: cannot write {path}: {e}", file=sys.stderr)

    atexit.register(write)
