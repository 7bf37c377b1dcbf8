"""`opbridge serve` with system shared memory against binary HTTP, gRPC and the in-process call.

One large `add`: n = 16M float32 (64 MiB per tensor). Rows:
- in-process: `ob.ops.add(a, b, out=c)` (into a preallocated output, as the server writes into the
  client's region) and `ob.ops.add(a, b)` (a new output);
- shared memory: tritonclient HTTP, inputs and output in registered regions (registered once; only
  the infer calls are timed), result read back with `get_contents_as_numpy` (a view, no copy);
- binary HTTP and gRPC: tritonclient, tensors in the messages.

The server is started on free loopback ports with `--allow-shared-memory` and limits large enough
for 64 MiB tensors, and stopped by PID. Every row's result is checked against a + b. Targets
(issue 11): shared memory at least 5x gRPC's throughput and within 2x of the in-process call.

    python benchmarks/bench_serve_shm.py              # median of 7 calls per row
    python benchmarks/bench_serve_shm.py --repeat 3   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm

import opbridge as ob

N = 16 << 20
LIMIT = str(512 << 20)


def start_server() -> tuple[subprocess.Popen[str], dict]:
    cmd = [sys.executable, "-m", "opbridge", "serve", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    cmd += ["--allow-shared-memory", "--http-max-input-size", LIMIT, "--grpc-max-message-size", LIMIT]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    event = json.loads(process.stdout.readline())
    assert event["event"] == "ready", event
    return process, event


def median_ms(call: Callable[[], object], repeat: int) -> float:
    call()  # warm: pools, connections, page faults
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="timed calls per row (the median is kept)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    a = rng.random(N, dtype=np.float32)
    b = rng.random(N, dtype=np.float32)
    expected = a + b
    c = np.empty_like(a)
    rows: dict[str, float] = {}
    rows["in-process `ob.ops.add(a, b, out=c)`"] = median_ms(lambda: ob.ops.add(a, b, out=c), args.repeat)
    rows["in-process `ob.ops.add(a, b)`"] = median_ms(lambda: ob.ops.add(a, b), args.repeat)
    np.testing.assert_array_equal(c, expected)

    process, ready = start_server()
    size = a.nbytes
    key = f"/opbridge-bench-{os.getpid()}"
    inputs_region = shm.create_shared_memory_region("in", key + "-in", 2 * size)
    output_region = shm.create_shared_memory_region("out", key + "-out", size)
    http = th.InferenceServerClient(ready["http"], network_timeout=600, connection_timeout=600)
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    grpc = tg.InferenceServerClient(ready["grpc"], channel_args=options)
    try:
        shm.set_shared_memory_region(inputs_region, [a, b])
        http.register_system_shared_memory("in", key + "-in", 2 * size)
        http.register_system_shared_memory("out", key + "-out", size)
        shm_inputs = []
        for name, offset in (("a", 0), ("b", size)):
            tensor = th.InferInput(name, [N], "FP32")
            tensor.set_shared_memory("in", size, offset=offset)
            shm_inputs.append(tensor)
        shm_output = th.InferRequestedOutput("out")
        shm_output.set_shared_memory("out", size)
        rows["server, shared memory (HTTP client)"] = median_ms(
            lambda: http.infer("add", shm_inputs, outputs=[shm_output]), args.repeat
        )
        np.testing.assert_array_equal(shm.get_contents_as_numpy(output_region, np.float32, [N]), expected)

        http_inputs = [th.InferInput("a", [N], "FP32"), th.InferInput("b", [N], "FP32")]
        for tensor, array in zip(http_inputs, (a, b), strict=True):
            tensor.set_data_from_numpy(array, binary_data=True)
        http_output = th.InferRequestedOutput("out", binary_data=True)
        rows["server, binary HTTP"] = median_ms(
            lambda: http.infer("add", http_inputs, outputs=[http_output]), args.repeat
        )
        np.testing.assert_array_equal(http.infer("add", http_inputs).as_numpy("out"), expected)

        grpc_inputs = [tg.InferInput("a", [N], "FP32"), tg.InferInput("b", [N], "FP32")]
        for tensor, array in zip(grpc_inputs, (a, b), strict=True):
            tensor.set_data_from_numpy(array)
        rows["server, gRPC"] = median_ms(lambda: grpc.infer("add", grpc_inputs), args.repeat)
        np.testing.assert_array_equal(grpc.infer("add", grpc_inputs).as_numpy("out"), expected)
        http.unregister_system_shared_memory()
    finally:
        http.close()
        grpc.close()
        shm.destroy_shared_memory_region(inputs_region)
        shm.destroy_shared_memory_region(output_region)
        os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        if process.stdout is not None:
            process.stdout.close()

    print(f"`add`, n = {N:,} float32 ({size >> 20} MiB per tensor), median of {args.repeat} calls\n")
    print("| path | ms per call | calls/s |")
    print("|---|---:|---:|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.1f} | {1e3 / ms:.1f} |")
    shm_ms = rows["server, shared memory (HTTP client)"]
    vs_grpc = rows["server, gRPC"] / shm_ms
    vs_local = shm_ms / rows["in-process `ob.ops.add(a, b, out=c)`"]
    print()
    print(f"- shared memory / gRPC throughput: {vs_grpc:.1f}x (target >= 5x: {'met' if vs_grpc >= 5 else 'MISSED'})")
    print(
        f"- shared memory time / in-process `out=` time: {vs_local:.2f}x "
        f"(target <= 2x: {'met' if vs_local <= 2 else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
