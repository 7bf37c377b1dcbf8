"""The profiler: a well-formed Chrome trace with exactly the calls made, flows, memory events, averages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import opbridge as ob


def check_chrome_trace(trace: dict, pid: int | None = None) -> list[dict]:
    """Validates the trace-event format we promise; returns the non-metadata events."""
    assert set(trace) >= {"traceEvents"}
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    stacks: dict[int, list[str]] = defaultdict(list)
    last_ts: dict[int, float] = {}
    flows: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        assert e["ph"] in ("B", "E", "X", "i", "s", "f"), e
        assert isinstance(e["ts"], (int, float)) and isinstance(e["tid"], int) and e["pid"] == (pid or os.getpid())
        assert e["ts"] >= last_ts.get(e["tid"], 0.0), f"timestamps go back on track {e['tid']}: {e}"
        if e["ph"] == "X":
            assert e["dur"] >= 0
        last_ts[e["tid"]] = e["ts"]
        if e["ph"] == "B":
            stacks[e["tid"]].append(e["name"])
        elif e["ph"] == "E":
            assert stacks[e["tid"]], f"an E without its B: {e}"
            assert stacks[e["tid"]].pop() == e["name"], e
        elif e["ph"] in ("s", "f"):
            flows[e["id"]].append(e)
    assert all(not s for s in stacks.values()), f"B without E: {dict(stacks)}"
    for flow_id, ends in flows.items():
        assert sorted(x["ph"] for x in ends) == ["f", "s"], (flow_id, ends)
        start = next(x for x in ends if x["ph"] == "s")
        finish = next(x for x in ends if x["ph"] == "f")
        assert start["ts"] <= finish["ts"]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and "tid" in e}
    assert set(last_ts) <= set(names), "every track is named"
    return events


def test_trace_holds_exactly_the_calls_made_with_shapes_flows_and_memory(tmp_path: Path) -> None:
    a = np.ones((4, 8), np.float32)
    ob.ops.add(a, a)  # before the profile: not recorded
    with ob.profiler.profile(record_shapes=True, profile_memory=True) as prof:
        for _ in range(3):
            ob.ops.add(a, a)
        x = ob.asarray(a)
        for _ in range(2):
            y = ob.ops.softmax(x, axis=-1)
        np.testing.assert_array_equal(y.numpy(), ob.ops.softmax(a, axis=-1))  # a 4th...
    ob.ops.add(a, a)  # after: not recorded
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(path)
    events = check_chrome_trace(json.loads(path.read_text()))
    calls = [e for e in events if e["cat"] == "op" and e["ph"] == "B"]
    assert [c["name"] for c in calls] == ["add"] * 3 + ["softmax"] * 3
    assert calls[0]["args"]["input_shapes"] == "[[4, 8], [4, 8]]"
    assert calls[0]["args"]["input_dtypes"] == "float32, float32"
    assert calls[0]["args"]["device"] == "cpu:0" and calls[0]["args"]["stream"] == "inline"
    assert calls[0]["args"]["version"] >= 1
    # The tensor calls ran on a stream's track, each linked to its call by a flow.
    kernels = [e for e in events if e["cat"] == "kernel" and e["ph"] == "B"]
    assert [k["name"] for k in kernels] == ["softmax", "softmax"]
    assert all(k["tid"] != calls[3]["tid"] for k in kernels)
    flow_ends = [e for e in events if e["ph"] == "f"]
    assert len(flow_ends) >= 2
    # The copy of x onto the device, and the pool's events with their sizes.
    assert any(e["cat"] == "copy" and e["ph"] == "B" and e["args"]["bytes"] == a.nbytes for e in events)
    allocations = [e for e in events if e["cat"] == "memory" and e["name"].startswith("allocate")]
    assert allocations and all(e["args"]["bytes"] > 0 and e["args"]["device"] == "cpu:0" for e in allocations)


def test_key_averages_count_the_calls_and_render_a_table() -> None:
    a = np.random.default_rng(0).random((64, 64), dtype=np.float32)
    with ob.profiler.profile(record_shapes=True) as prof:
        for _ in range(5):
            ob.ops.add(a, a)
        t = ob.asarray(a)
        for _ in range(2):
            ob.ops.exp(t)
        ob.ops.exp(a)
    rows = {r.key: r for r in prof.key_averages()}
    assert rows["add"].count == 5 and rows["exp"].count == 3
    for row in rows.values():
        assert row.cpu_time_total > 0 and row.device_time_total > 0
    by_shape = prof.key_averages(group_by_input_shape=True)
    assert sorted((r.key, r.input_shapes) for r in by_shape) == [("add", "[[64, 64], [64, 64]]"), ("exp", "[[64, 64]]")]
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=10)
    assert table.splitlines()[0].startswith("Name") and "add" in table and "exp" in table
    assert "Device total" in table
    with pytest.raises(ValueError, match="sort_by"):
        prof.key_averages().table(sort_by="nonsense")


def test_one_profile_at_a_time_and_nothing_recorded_when_inactive() -> None:
    with ob.profiler.profile():
        with pytest.raises(RuntimeError, match="already recording"):
            ob.profiler.profile().start()
    assert not ob._native.profiler_active()
    empty = ob.profiler.profile()
    empty.start()
    empty.stop()
    assert empty.events() == [] and list(empty.key_averages()) == []


def test_threads_streams_host_functions_syncs_and_user_ranges_have_their_tracks() -> None:
    a = np.ones(16, np.float32)
    seen = []
    done, release = threading.Event(), threading.Event()

    def work() -> None:
        ob.ops.add(a, a)
        done.set()
        release.wait(30)  # alive until the profile ends: its track is named after it

    worker = threading.Thread(target=work, name="profiled-worker")
    with ob.profiler.profile() as prof:
        worker.start()
        done.wait(30)
        s = ob.Stream()
        with ob.profiler.record_function("my range"):
            s.launch_host_func(lambda: seen.append(1))
            s.synchronize()
    release.set()
    worker.join()
    assert seen == [1]
    trace = prof.chrome_trace()
    events = check_chrome_trace(trace)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and "tid" in e}
    add = next(e for e in events if e["cat"] == "op")
    assert names[add["tid"]] == "profiled-worker"
    host_fn = next(e for e in events if e["cat"] == "host_func" and e["ph"] == "B")
    assert names[host_fn["tid"]].startswith("opbridge-cpu-stream")
    assert any(e["name"] == "stream synchronize" for e in events)
    user = next(e for e in events if e["cat"] == "user")
    assert user["name"] == "my range" and user["ph"] == "X"
    sync = next(e for e in events if e["name"] == "stream synchronize" and e["ph"] == "B")
    assert user["ts"] <= sync["ts"] <= user["ts"] + user["dur"]  # the range holds what ran inside it


JIT_SOURCE = r"""
#include <opbridge/plugin.h>
static int infer(const OpbMeta *in, int n_in, OpbMeta *out, int n_out, const OpbAttrs *attrs, char *err, size_t len) {
  (void)n_in, (void)n_out, (void)attrs, (void)err, (void)len;
  out[0] = in[0];
  return OPB_OK;
}
static int run(const DLTensor *in, int n_in, DLTensor *out, int n_out, const OpbAttrs *attrs, void *stream,
               void *ws, size_t ws_size, char *err, size_t len) {
  (void)n_in, (void)n_out, (void)attrs, (void)stream, (void)ws, (void)ws_size, (void)err, (void)len;
  const float *x = (const float *)in[0].data;
  float *y = (float *)out[0].data;
  for (int64_t i = 0; i < in[0].shape[0]; i++) y[i] = x[i] + 1.0f;
  return OPB_OK;
}
static const char *const inputs[] = {"x"};
static const DLDataType dtypes[] = {OPB_FLOAT32};
static const OpbOpDesc ops[] = {{.name = "profiled_plus_one", .version = 1, .n_inputs = 1, .input_names = inputs,
                                 .n_outputs = 1, .n_dtypes = 1, .dtypes = dtypes, .infer = infer,
                                 .cpu_kernel = run}};
OPB_EXPORT int opbridge_plugin_init(const OpbPluginHost *host, OpbPluginInfo *info) {
  info->abi_version = OPBRIDGE_PLUGIN_ABI_VERSION;
  if (host->abi_version != OPBRIDGE_PLUGIN_ABI_VERSION) return OPB_ERR_ABI_MISMATCH;
  info->name = "profiled";
  info->n_ops = 1;
  info->ops = ops;
  return OPB_OK;
}
"""


def test_jit_compiles_and_plugin_loads_are_spans(tmp_path: Path) -> None:
    with ob.profiler.profile() as prof:
        lib = ob.jit.compile(JIT_SOURCE, "profiled", cache_dir=tmp_path)
        np.testing.assert_array_equal(ob.ops.get("profiled_plus_one")(np.zeros(3, np.float32)), np.ones(3))
        lib.unload()
    events = check_chrome_trace(prof.chrome_trace())
    spans = [(e["cat"], e["name"]) for e in events if e["ph"] == "B"]
    assert ("jit", "jit compile profiled") in spans
    assert ("plugin", "plugin load") in spans and ("plugin", "plugin unload") in spans
    assert ("op", "profiled_plus_one") in spans


def test_opbridge_trace_profiles_a_whole_process(tmp_path: Path) -> None:
    path = tmp_path / "whole.json"
    code = "import numpy as np, opbridge as ob\nx = ob.asarray(np.ones(8))\nfor _ in range(4): ob.ops.mul(x, x)\n"
    subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "OPBRIDGE_TRACE": str(path)}, check=True, timeout=60
    )
    trace = json.loads(path.read_text())
    events = check_chrome_trace(trace, pid=trace["traceEvents"][0]["pid"])
    assert [e["name"] for e in events if e["cat"] == "op" and e["ph"] == "B"] == ["mul"] * 4
    assert any(e["cat"] == "memory" for e in events)  # the whole-process trace profiles memory too


def test_memory_snapshot_agrees_with_the_pool_stats_and_names_the_allocating_op() -> None:
    a = np.ones((32, 32), np.float32)
    ob.synchronize()
    with ob.profiler.profile(profile_memory=True):
        x = ob.asarray(a)
        y = ob.ops.softmax(x, axis=-1)
        z = ob.ops.exp(y)
        z.synchronize()
    snapshot = ob.memory_snapshot()
    stats = ob.get_memory_pool_stats()
    blocks = [b for seg in snapshot for b in seg["blocks"]]
    assert sum(seg["total_size"] for seg in snapshot) == stats["reserved_bytes.current"]
    for seg in snapshot:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["device"] == "cpu:0"
    in_use = [b for b in blocks if b["state"] in ("allocated", "pending")]
    assert sum(b["size"] for b in in_use) == stats["allocated_bytes.current"]
    assert sum(b["size"] for b in blocks if b["state"] == "cached") == (
        stats["reserved_bytes.current"] - stats["allocated_bytes.current"]
    )
    ops = {b["op"] for b in in_use}
    assert {"softmax", "exp"} <= ops, ops
    summary = ob.memory_summary()
    assert "allocated" in summary and "softmax" in summary and "exp" in summary
    del x, y, z
    ob.synchronize()
    after = ob.memory_snapshot()
    assert not any(b["op"] in ("softmax", "exp") and b["state"] == "allocated" for s in after for b in s["blocks"])


def test_leaving_a_profile_keeps_the_users_asynchronous_errors() -> None:
    def boom() -> None:
        raise ValueError("boom in a host function")

    s = ob.Stream()
    with ob.profiler.profile():
        s.launch_host_func(boom)
    with pytest.raises(ob.DeviceError, match="boom"):
        s.synchronize()


def test_reading_a_profile_while_it_records_is_an_error_and_a_restart_starts_afresh() -> None:
    a = np.ones(4, np.float32)
    prof = ob.profiler.profile()
    with prof:
        ob.ops.add(a, a)
        with pytest.raises(RuntimeError, match="still recording"):
            prof.key_averages()
        with pytest.raises(RuntimeError, match="still recording"):
            prof.chrome_trace()
    assert [r.key for r in prof.key_averages()] == ["add"]
    with prof:
        ob.ops.mul(a, a)
    assert [r.key for r in prof.key_averages()] == ["mul"]


def test_input_dtypes_are_the_callers_before_any_conversion() -> None:
    f32, f64, i32 = np.ones(3, np.float32), np.ones(3, np.float64), np.ones(3, np.int32)
    with ob.profiler.profile(record_shapes=True) as prof:
        ob.ops.add(f32, f64)  # the generic numpy path converts f32 first
        ob.ops.add(i32, f32)
        ob.ops.add(ob.asarray(f32), f64)  # the tensor path copies f64's host array in
    calls = [e for e in prof.events() if e["category"] == "op" and e["phase"] == "B"]
    assert [c["args"]["input_dtypes"] for c in calls] == [
        "float32, float64",
        "int32, float32",
        "float32, float64",
    ]
    assert len(calls) == 3  # one span per call: the layers below did not open their own


def test_ranges_of_interleaved_asyncio_tasks_keep_their_own_durations() -> None:
    import asyncio

    async def task(name: str, seconds: float) -> None:
        with ob.profiler.record_function(name):
            await asyncio.sleep(seconds)

    async def both() -> None:
        await asyncio.gather(task("long", 0.06), task("short", 0.01))

    with ob.profiler.profile() as prof:
        asyncio.run(both())
    ranges = {e["name"]: e for e in check_chrome_trace(prof.chrome_trace()) if e["cat"] == "user"}
    assert ranges["long"]["dur"] >= 55_000 and ranges["short"]["dur"] < 50_000, ranges
