"""`opbridge serve` dynamic batching: the same `add` with batching off and on, in one server.

One server serves the built-in `add` (no batching) and `add_b`, an alias of it with
`[dynamic_batching]` (`max_queue_delay_us`, `preferred_batch_size` = the rows that the clients
have in flight together). opbridge-loadgen (benchmarks/loadgen) drives each with 8 gRPC
connections of n=4 float32, alternately, `--repeat` times; the best req/s of each is compared, and
the batched model's p99 latency against `max_queue_delay_us + 1 ms`. The statistics extension
then says how many requests each execution merged.

    python benchmarks/bench_serve_batching.py
    python benchmarks/bench_serve_batching.py --delay-us 200 --connections 16 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from bench_serve import loadgen_binary, start_opbridge

N = 4


def run_loadgen(binary: Path, url: str, model: str, connections: int, requests: int, pid: int) -> dict:
    cmd = [str(binary), "--mode", "grpc", "--url", url, "--model", model, "--n", str(N)]
    cmd += ["--connections", str(connections), "--requests", str(requests), "--warmup", "1000"]
    cmd += [f"--server-pid={pid}"]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    report = json.loads(run.stdout)
    if report["errors"] or report["wrong"]:
        raise SystemExit(f"{model}: {report['errors']} errors, {report['wrong']} wrong: {report['first_error']}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-us", type=int, default=500, help="max_queue_delay_us of the batched model")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--requests", type=int, default=20_000, help="timed requests per run")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    loadgen = loadgen_binary()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        repo = work / "models" / "add_b"
        repo.mkdir(parents=True)
        preferred = N * args.connections
        (repo / "config.toml").write_text(
            '[alias]\nop = "add"\n[dynamic_batching]\n'
            f"max_queue_delay_us = {args.delay_us}\npreferred_batch_size = [{preferred}]\n"
            f"max_batch_size = {max(64, preferred)}\n"
        )
        server = start_opbridge(work, None, ["--repository", str(work / "models")])
        try:
            runs: dict[str, list[dict]] = {"add": [], "add_b": []}
            for _ in range(args.repeat):
                for model in runs:
                    runs[model].append(
                        run_loadgen(loadgen, server.grpc, model, args.connections, args.requests, server.proc.pid)
                    )
            with urllib.request.urlopen(f"http://{server.http}/v2/models/add_b/stats", timeout=10) as response:
                stats = json.load(response)["model_stats"][0]
        finally:
            server.stop()

    print(f"## Dynamic batching: `add`, n={N} float32, {args.connections} gRPC connections (opbridge-loadgen)\n")
    print("| model | batching | req/s (best) | p50 µs | p99 µs | server CPU µs/req |")
    print("|---|---|---:|---:|---:|---:|")
    best = {}
    for model, reports in runs.items():
        top = max(reports, key=lambda r: r["req_per_s"])
        best[model] = top
        mode = f"on ({args.delay_us} µs, preferred {preferred})" if model == "add_b" else "off"
        cpu = top["server_cpu_us_per_request"]
        print(
            f"| {model} | {mode} | {top['req_per_s']:,.0f} | {top['p50_us']:.0f} | {top['p99_us']:.0f} | {cpu:.1f} |"
            if cpu is not None
            else f"| {model} | {mode} | {top['req_per_s']:,.0f} | {top['p50_us']:.0f} | {top['p99_us']:.0f} | - |"
        )
    ratio = best["add_b"]["req_per_s"] / best["add"]["req_per_s"]
    merged = stats["inference_count"] / max(1, stats["execution_count"])
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}
    print(f"\nrows per execution of add_b: {merged:.1f} (executions by batch size: {sizes})")
    p99_limit = args.delay_us + 1000
    print("\n| target | measured | met |")
    print("|---|---:|---|")
    print(f"| batching on / off req/s ≥ 2 | {ratio:.2f} | {'yes' if ratio >= 2 else 'no'} |")
    p99 = best["add_b"]["p99_us"]
    print(f"| batched p99 ≤ delay + 1 ms = {p99_limit} µs | {p99:.0f} µs | {'yes' if p99 <= p99_limit else 'no'} |")


if __name__ == "__main__":
    main()
