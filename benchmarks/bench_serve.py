"""`opbridge serve` against MLServer (the Python V2 server), both measured in the same run.

Both servers serve the same operator: `add` (FP32 inputs `a`, `b`, output `out = a + b`). MLServer
1.7.1 is installed into its own virtualenv (benchmarks/.venv-mlserver, git-ignored) on first use;
its runtime (an `MLModel`) and settings (`parallel_workers: 0`: in-process, see
/work/shared/notes/v2-protocol.md) are written to a temporary folder. Servers are pinned to CPU 0,
clients to CPU 1 (when the machine has two), started on free loopback ports and stopped by PID.

Clients:
- tritonclient: HTTP (binary tensors where the server supports the extension, which MLServer does
  not: JSON there) and gRPC, 1 and 8 concurrent threads, n=4 and n=65,536 float32;
- opbridge-loadgen (benchmarks/loadgen, Rust): HTTP/1.1 keep-alive and gRPC, 1 and 8
  connections, n=4 to n=1M, so the server's ceiling is measured rather than the Python client's.

Server CPU per request is the server's user + system time (/proc/PID/stat) over the timed
requests, divided by their count. Every result is checked against a + b (the first of each
tritonclient thread; a sample of loadgen's).

    python benchmarks/bench_serve.py            # the full table and the issue's targets
    python benchmarks/bench_serve.py --quick    # fewer requests, a smoke run
    python benchmarks/bench_serve.py --only-loadgen --serve-arg=--workers-per-model=1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MLSERVER_VENV = ROOT / "benchmarks" / ".venv-mlserver"
MLSERVER_VERSION = "1.7.1"
TICKS = os.sysconf("SC_CLK_TCK")
SERVER_CPU, CLIENT_CPU = 0, 1
N_SMALL, N_MEDIUM, N_LARGE = 4, 65_536, 1 << 20

RUNTIME = '''\
"""`add` for MLServer: out = a + b in float32, the same operator opbridge serves."""

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput


class AddRuntime(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        out = np.add(inputs["a"], inputs["b"], dtype=np.float32).reshape(-1)
        return InferenceResponse(
            model_name=self.name,
            outputs=[ResponseOutput(name="out", datatype="FP32", shape=[out.size], data=out.tolist())],
        )
'''


# --------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cpu: int | None):
    """A `preexec_fn` pinning the child (and every thread it starts) to `cpu`."""
    if cpu is None:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (MLServer may start helper processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / TICKS


def steal_ticks() -> tuple[int, int]:
    """Host steal and total jiffies so far (/proc/stat), for the steal % of a case."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return values[7], sum(values)


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    http: str
    grpc: str
    http_binary: bool
    log: Path
    pids: list[int] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log {log}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s; log {log}")


def opbridge_binary() -> Path:
    for candidate in (
        os.environ.get("OPBRIDGE_SERVE_BIN"),
        ROOT / "python" / "opbridge" / "_bin" / "opbridge-serve",
        ROOT / "target" / "release" / "opbridge-serve",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    sys.exit("no opbridge-serve binary: set OPBRIDGE_SERVE_BIN or run `make build`")


def start_opbridge(work: Path, cpu: int | None, extra: list[str]) -> Server:
    log = work / "opbridge.log"
    cmd = [str(opbridge_binary()), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    cmd += ["--log-level", "warn", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, preexec_fn=pinned(cpu))
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.wait()
        raise RuntimeError(f"opbridge-serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
    ready = json.loads(line)
    server = Server("opbridge", proc, ready["http"], ready["grpc"], True, log)
    wait_ready(f"http://{server.http}/v2/models/add/ready", proc, log)
    server.pids = [proc.pid]
    return server


def ensure_mlserver() -> Path:
    mlserver = MLSERVER_VENV / "bin" / "mlserver"
    if not mlserver.exists():
        print(f"installing mlserver=={MLSERVER_VERSION} into {MLSERVER_VENV} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(MLSERVER_VENV)], check=True)
        pip = [str(MLSERVER_VENV / "bin" / "python"), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, f"mlserver=={MLSERVER_VERSION}"], check=True)
    return mlserver


def start_mlserver(work: Path, cpu: int | None) -> Server:
    mlserver = ensure_mlserver()
    folder = work / "mlserver"
    model = folder / "add"
    model.mkdir(parents=True)
    (model / "add_runtime.py").write_text(RUNTIME)
    (model / "model-settings.json").write_text(
        json.dumps({"name": "add", "implementation": "add_runtime.AddRuntime", "parameters": {"version": "1"}})
    )
    http, grpc, metrics = free_port(), free_port(), free_port()
    settings = {
        "host": "127.0.0.1",
        "http_port": http,
        "grpc_port": grpc,
        "metrics_port": metrics,
        # In-process: the default (1) crashes at start under uvloop 0.23 here (see the notes).
        "parallel_workers": 0,
        # The default 4 MiB refuses n=1M requests (8 MB); lift it so the big cases run.
        "grpc_max_message_length": 256 << 20,
    }
    (folder / "settings.json").write_text(json.dumps(settings))
    log = work / "mlserver.log"
    env = {**os.environ, "PYTHONPATH": str(model)}
    proc = subprocess.Popen(
        [str(mlserver), "start", str(folder)],
        cwd=folder,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        preexec_fn=pinned(cpu),
    )
    server = Server("mlserver", proc, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", False, log)
    wait_ready(f"http://{server.http}/v2/models/add/ready", proc, log)
    server.pids = process_tree(proc.pid)
    return server


# --------------------------------------------------------------------------------------------
# Clients


@dataclass
class Result:
    server: str
    client: str
    protocol: str
    n: int
    conc: int
    wire: str = ""  # "http" or "grpc": what a row is compared with (protocol says how it was encoded)
    ok: int = 0
    errors: int = 0
    wrong: int = 0
    first_error: str = ""
    req_s: float = 0.0
    p50_us: float = 0.0
    p99_us: float = 0.0
    cpu_us: float | None = None
    gbps_per_conn: float = 0.0
    steal: float = 0.0

    def __post_init__(self) -> None:
        self.wire = self.wire or self.protocol.split()[0]

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.client, self.wire, self.n, self.conc)


def inputs(n: int) -> tuple[np.ndarray, np.ndarray]:
    a = (np.arange(n) % 1000).astype(np.float32) * np.float32(0.25)
    b = (np.arange(n) % 7).astype(np.float32) + np.float32(1.0)
    return a, b


def triton_case(server: Server, protocol: str, n: int, conc: int, requests: int, max_s: float) -> Result:
    """`conc` threads, each with its own tritonclient client, sharing `requests` (or `max_s`)."""
    if protocol == "grpc":
        import tritonclient.grpc as tc

        url = server.grpc
    else:
        import tritonclient.http as tc

        url = server.http
    binary = protocol == "grpc" or server.http_binary
    label = "grpc" if protocol == "grpc" else ("http binary" if binary else "http json")
    a, b = inputs(n)
    expected = a + b
    result = Result(server.name, "tritonclient", label, n, conc)
    lock = threading.Lock()
    latencies: list[float] = []
    counter = iter(range(requests))
    deadline = [float("inf")]  # set once every thread has warmed up

    def make():
        client = tc.InferenceServerClient(url) if protocol == "grpc" else tc.InferenceServerClient(url, concurrency=1)
        ins = [tc.InferInput("a", [n], "FP32"), tc.InferInput("b", [n], "FP32")]
        if protocol == "grpc":
            ins[0].set_data_from_numpy(a)
            ins[1].set_data_from_numpy(b)
            outs = [tc.InferRequestedOutput("out")]
        else:
            ins[0].set_data_from_numpy(a, binary_data=binary)
            ins[1].set_data_from_numpy(b, binary_data=binary)
            # MLServer: no outputs listed (it answers JSON whatever binary_data_output says).
            outs = [tc.InferRequestedOutput("out", binary_data=True)] if binary else None
        return client, ins, outs

    def call(client, ins, outs) -> np.ndarray:
        return client.infer("add", ins, outputs=outs).as_numpy("out")

    def worker(warmup: int) -> None:
        client, ins, outs = make()
        try:
            try:
                for _ in range(warmup):
                    call(client, ins, outs)
            except Exception as e:  # noqa: BLE001 - counted below; the timed loop reports the rest
                with lock:
                    result.errors += 1
                    result.first_error = result.first_error or str(e)[:200]
            barrier.wait()
            first, mine = True, []
            while time.perf_counter() < deadline[0]:
                with lock:
                    if next(counter, None) is None:
                        break
                started = time.perf_counter()
                try:
                    out = call(client, ins, outs)
                except Exception as e:  # noqa: BLE001 - a benchmark reports every failure
                    with lock:
                        result.errors += 1
                        result.first_error = result.first_error or str(e)[:200]
                    continue
                mine.append(time.perf_counter() - started)
                if first:
                    first = False
                    if out is None or not np.array_equal(out.reshape(-1), expected):
                        with lock:
                            result.wrong += 1
            with lock:
                latencies.extend(mine)
        finally:
            client.close()

    barrier = threading.Barrier(conc + 1)
    threads = [threading.Thread(target=worker, args=(5,)) for _ in range(conc)]
    for t in threads:
        t.start()
    barrier.wait()
    cpu0, (st0, tot0) = cpu_seconds(server.pids), steal_ticks()
    started = time.perf_counter()
    deadline[0] = started + max_s
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    cpu1, (st1, tot1) = cpu_seconds(server.pids), steal_ticks()
    lat = np.sort(np.array(latencies)) * 1e6
    result.ok = len(lat)
    if result.ok:
        result.req_s = result.ok / seconds
        result.p50_us = float(np.percentile(lat, 50))
        result.p99_us = float(np.percentile(lat, 99))
        result.cpu_us = (cpu1 - cpu0) * 1e6 / result.ok
        result.gbps_per_conn = result.ok * 12 * n / seconds / 1e9 / conc
    result.steal = 100 * (st1 - st0) / max(1, tot1 - tot0)
    return result


def loadgen_binary() -> Path:
    explicit = os.environ.get("OPBRIDGE_LOADGEN_BIN")
    if explicit:
        return Path(explicit)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "opbridge-loadgen"], cwd=ROOT, check=True)
    return target / "release" / "opbridge-loadgen"


def loadgen_case(
    binary: Path, server: Server, protocol: str, n: int, conc: int, requests: int, warmup: int, cpu: int | None
) -> Result:
    mode = "grpc" if protocol == "grpc" else ("http" if server.http_binary else "http-json")
    url = server.grpc if protocol == "grpc" else server.http
    label = {"grpc": "grpc", "http": "http binary", "http-json": "http json"}[mode]
    cmd = [str(binary), "--mode", mode, "--url", url, "--n", str(n), "--connections", str(conc)]
    cmd += ["--requests", str(requests), "--warmup", str(warmup)]
    cmd += [f"--server-pid={pid}" for pid in server.pids]
    st0, tot0 = steal_ticks()
    run = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=pinned(cpu))
    st1, tot1 = steal_ticks()
    result = Result(server.name, "loadgen", label, n, conc, steal=100 * (st1 - st0) / max(1, tot1 - tot0))
    if not run.stdout.strip():
        result.errors, result.first_error = 1, run.stderr.strip()[-200:]
        return result
    report = json.loads(run.stdout)
    result.ok, result.errors, result.wrong = report["ok"], report["errors"], report["wrong"]
    result.first_error = report["first_error"] or ""
    result.req_s, result.p50_us, result.p99_us = report["req_per_s"], report["p50_us"], report["p99_us"]
    result.cpu_us = report["server_cpu_us_per_request"]
    result.gbps_per_conn = report["payload_gb_per_s_per_connection"]
    return result


# --------------------------------------------------------------------------------------------
# Report


def fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def table(results: list[Result]) -> None:
    ours = {r.key: r for r in results if r.server == "opbridge"}
    peer = {r.key: r for r in results if r.server == "mlserver"}
    print(
        "| client | protocol (ours / MLServer) | n | conc | server | ok | err | req/s | p50 µs | p99 µs | "
        "server CPU µs/req | payload GB/s/conn | steal % |"
    )
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    keys = list(dict.fromkeys(r.key for r in results))
    for key in keys:
        for r in (ours.get(key), peer.get(key)):
            if r is None:
                continue
            err = f"{r.errors}" + (f" ({r.first_error[:60]})" if r.errors else "") + (" WRONG" if r.wrong else "")
            print(
                f"| {r.client} | {r.protocol} | {r.n:,} | {r.conc} | {r.server} | {r.ok} | {err} | {fmt(r.req_s)} | "
                f"{fmt(r.p50_us)} | {fmt(r.p99_us)} | {fmt(r.cpu_us)} | {fmt(r.gbps_per_conn, 3)} | {r.steal:.0f} |"
            )
    print("\n| client | protocol | n | conc | req/s ours / MLServer | p99 MLServer / ours | CPU/req MLServer / ours |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for key in keys:
        o, m = ours.get(key), peer.get(key)
        if not (o and m and o.ok and m.ok):
            continue
        cpu = f"{m.cpu_us / o.cpu_us:.1f}x" if o.cpu_us and m.cpu_us else "n/a"
        print(
            f"| {key[0]} | {o.protocol} / {m.protocol} | {key[2]:,} | {key[3]} | {o.req_s / m.req_s:.1f}x | "
            f"{m.p99_us / o.p99_us:.1f}x | {cpu} |"
        )


def targets(results: list[Result]) -> None:
    get = {(r.server, r.client, r.protocol, r.n, r.conc): r for r in results}

    def lg(server: str, protocol: str, n: int, conc: int) -> Result | None:
        r = get.get((server, "loadgen", protocol, n, conc))
        return r if r and r.ok else None

    http_peer = "http json"
    rows = []
    o, m = lg("opbridge", "grpc", N_SMALL, 8), lg("mlserver", "grpc", N_SMALL, 8)
    if o and m:
        ratio = o.req_s / m.req_s
        rows.append(("n=4 gRPC, 8 connections: req/s ≥ 20× MLServer", f"{ratio:.1f}x", ratio >= 20))
    for protocol in ("grpc", "http binary"):
        o = lg("opbridge", protocol, N_SMALL, 1)
        if o:
            rows.append((f"n=4 {protocol}, 1 connection: p99 ≤ 1 ms", f"{o.p99_us:.0f} µs", o.p99_us <= 1000))
    for protocol, peer_protocol in (("grpc", "grpc"), ("http binary", http_peer)):
        for conc in (1, 8):
            o, m = lg("opbridge", protocol, N_SMALL, conc), lg("mlserver", peer_protocol, N_SMALL, conc)
            if o and m and o.cpu_us and m.cpu_us:
                ratio = m.cpu_us / o.cpu_us
                rows.append(
                    (
                        f"n=4 {protocol}, {conc} conn.: server CPU/request ≤ 1/20 of MLServer's",
                        f"1/{ratio:.1f} ({o.cpu_us:.1f} vs {m.cpu_us:.1f} µs)",
                        ratio >= 20,
                    )
                )
    for protocol in ("http binary", "grpc"):
        o = lg("opbridge", protocol, N_LARGE, 1)
        if o:
            rows.append(
                (
                    f"n=1M {protocol}: ≥ 1 GB/s tensor payload per connection",
                    f"{o.gbps_per_conn:.2f} GB/s",
                    o.gbps_per_conn >= 1,
                )
            )
    print("\n| target (native load generator) | measured | |")
    print("|---|---:|---|")
    for name, measured, ok in rows:
        print(f"| {name} | {measured} | {'pass' if ok else 'MISS'} |")
    print(
        "\nPayload is the tensor bytes carried per request (both inputs sent and the output received, 12 × n), "
        "over the timed requests' wall time, per connection."
    )


# --------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests per case (a smoke run)")
    parser.add_argument("--no-mlserver", action="store_true", help="only opbridge (no ratios)")
    parser.add_argument("--only-loadgen", action="store_true", help="skip the tritonclient cases")
    parser.add_argument("--only-tritonclient", action="store_true", help="skip the loadgen cases")
    parser.add_argument("--no-pin", action="store_true", help="do not pin servers and clients to CPUs")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra opbridge-serve flag (repeatable), e.g. --serve-arg=--workers-per-model=1",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON")
    parser.add_argument("--report", type=Path, help="print the tables of a --json file again, run nothing")
    args = parser.parse_args()
    if args.report:
        results = [Result(**r) for r in json.loads(args.report.read_text())]
        table(results)
        targets(results)
        return

    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    server_cpu, client_cpu = (SERVER_CPU, CLIENT_CPU) if pin else (None, None)
    if pin:
        os.sched_setaffinity(0, {CLIENT_CPU})  # this process runs the tritonclient threads
    scale = 0.2 if args.quick else 1.0

    def count(x: int) -> int:
        return max(3, int(x * scale))

    load = os.getloadavg()
    print(f"# opbridge serve vs MLServer {MLSERVER_VERSION}: add(a, b) float32\n")
    print(
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        + (f"servers pinned to CPU {SERVER_CPU}, clients to CPU {CLIENT_CPU}" if pin else "not pinned")
        + (f"; opbridge-serve flags: {' '.join(args.serve_arg)}" if args.serve_arg else "")
        + "\n"
    )
    loadgen = None if args.only_tritonclient else loadgen_binary()
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    servers: list[Server] = []
    results: list[Result] = []
    try:
        servers.append(start_opbridge(work, server_cpu, args.serve_arg))
        if not args.no_mlserver:
            servers.append(start_mlserver(work, server_cpu))
        # Cases in one order for both servers, back to back, so their ratios share the conditions.
        cases: list[tuple] = []
        if not args.only_loadgen:
            for protocol in ("http", "grpc"):
                for n in (N_SMALL, N_MEDIUM):
                    for conc in (1, 8):
                        cases.append(("tritonclient", protocol, n, conc))
        if loadgen:
            for protocol in ("grpc", "http"):
                for conc in (1, 8):
                    cases.append(("loadgen", protocol, N_SMALL, conc))
                cases.append(("loadgen", protocol, N_MEDIUM, 1))
                cases.append(("loadgen", protocol, N_LARGE, 1))
        for client, protocol, n, conc in cases:
            for server in servers:
                fast = server.name == "opbridge"
                json_body = protocol == "http" and not server.http_binary
                if client == "tritonclient":
                    requests = count(2000 if n == N_SMALL else 200)
                    r = triton_case(server, protocol, n, conc, requests, max_s=4 if args.quick else 10)
                else:
                    if n == N_SMALL:
                        requests = count(20_000 if fast else 3_000)
                    elif n == N_MEDIUM:
                        requests = count(2_000 if fast else (20 if json_body else 200))
                    else:
                        requests = count(200 if fast else (3 if json_body else 20))
                    warmup = max(1, min(500, requests // 10))
                    r = loadgen_case(loadgen, server, protocol, n, conc, requests, warmup, client_cpu)
                results.append(r)
                print(
                    f"  {client:12} {r.protocol:11} n={n:<8} conc={conc} {server.name:9} "
                    f"{r.req_s:10.1f} req/s  p99 {r.p99_us:9.1f} µs  cpu/req {fmt(r.cpu_us)} µs"
                    + (f"  errors {r.errors}: {r.first_error[:80]}" if r.errors else ""),
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for server in servers:
            server.stop()
    print()
    table(results)
    targets(results)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
