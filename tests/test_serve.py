"""`opbridge serve` over real sockets on loopback, with tritonclient (HTTP and gRPC) as the client.

One server per module (started with `python -m opbridge serve` on free ports), stopped by its PID.
"""

from __future__ import annotations

import gzip
import http.client as http_client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import opbridge as ob
from opbridge.cli import server_binary

tritonclient = pytest.importorskip("tritonclient")
import gevent  # noqa: E402  (tritonclient.http's event loop)
import tritonclient.grpc as tg  # noqa: E402
import tritonclient.http as th  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

# tritonclient's HTTP client (geventhttpclient) leaves sockets for the garbage collector.
pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")

if server_binary() is None:
    pytest.skip("the server binary is not built (make build)", allow_module_level=True)


@dataclass
class Served:
    process: subprocess.Popen[str]
    http: str
    grpc: str
    metrics: str

    def url(self, path: str) -> str:
        return f"http://{self.http}{path}"


def start_server(
    *args: str,
    timeout: float = 30.0,
    free_ports: bool = True,
    env: dict[str, str] | None = None,
    stderr: Any = subprocess.DEVNULL,
) -> Served:
    """`opbridge serve` with `args`, after port flags of 0 unless `free_ports` is False (`args` name the ports)."""
    cmd = [sys.executable, "-m", "opbridge", "serve"]
    if free_ports:
        cmd += ["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    process = subprocess.Popen(
        [*cmd, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.2)
        if ready:
            line = process.stdout.readline()
            if not line:
                break
            event = json.loads(line)
            assert event["event"] == "ready"
            return Served(process, event["http"], event["grpc"], event["metrics"])
        if process.poll() is not None:
            break
    stop_server(Served(process, "", "", ""))
    raise AssertionError("the server did not print its ready line")


def stop_server(served: Served) -> int:
    if served.process.poll() is None:
        os.kill(served.process.pid, signal.SIGTERM)
    try:
        return served.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.kill(served.process.pid, signal.SIGKILL)
        served.process.wait()
        raise
    finally:
        if served.process.stdout is not None:
            served.process.stdout.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    served = start_server()
    try:
        yield served
    finally:
        assert stop_server(served) == 0


@pytest.fixture(scope="module")
def http(server: Served) -> Iterator[th.InferenceServerClient]:
    client = th.InferenceServerClient(server.http)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc(server: Served) -> Iterator[tg.InferenceServerClient]:
    client = tg.InferenceServerClient(server.grpc)
    yield client
    client.close()


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def http_inputs(arrays: dict[str, np.ndarray], binary: bool = True) -> list[th.InferInput]:
    inputs = []
    for name, array in arrays.items():
        i = th.InferInput(
            name, list(array.shape), {np.float32: "FP32", np.float64: "FP64"}.get(array.dtype.type, "FP32")
        )
        if array.dtype == np.int32:
            i = th.InferInput(name, list(array.shape), "INT32")
        i.set_data_from_numpy(array, binary_data=binary)
        inputs.append(i)
    return inputs


def grpc_inputs(arrays: dict[str, np.ndarray]) -> list[tg.InferInput]:
    names = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64", np.dtype(np.int32): "INT32"}
    inputs = []
    for name, array in arrays.items():
        i = tg.InferInput(name, list(array.shape), names[array.dtype])
        i.set_data_from_numpy(array)
        inputs.append(i)
    return inputs


NEG_ONE = json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}).encode()

RNG = np.random.default_rng(0)
A = RNG.random((4, 256), dtype=np.float32)
B = RNG.random((4, 256), dtype=np.float32)


# --- the ready line, health and metadata -----------------------------------------------------------


def test_ready_line_names_every_listener(server: Served) -> None:
    for address in (server.http, server.grpc, server.metrics):
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0


def test_health_and_server_metadata(http: th.InferenceServerClient, grpc: tg.InferenceServerClient) -> None:
    assert http.is_server_live() and http.is_server_ready()
    assert grpc.is_server_live() and grpc.is_server_ready()
    meta = http.get_server_metadata()
    assert meta["name"] == "opbridge"
    assert "binary_tensor_data" in meta["extensions"] and "model_repository" in meta["extensions"]
    assert grpc.get_server_metadata().name == "opbridge"


def test_model_metadata_names_the_schema(http: th.InferenceServerClient, grpc: tg.InferenceServerClient) -> None:
    meta = http.get_model_metadata("layer_norm")
    assert [i["name"] for i in meta["inputs"]] == ["x", "weight", "bias"]
    assert [o["name"] for o in meta["outputs"]] == ["out"]
    assert meta["inputs"][0]["datatype"] == "FP32" and meta["inputs"][0]["shape"] == [-1]
    g = grpc.get_model_metadata("add", model_version="1")
    assert [i.name for i in g.inputs] == ["a", "b"] and g.versions == ["1"]
    assert http.is_model_ready("softmax") and http.is_model_ready("softmax", "1")
    assert grpc.is_model_ready("softmax")


def test_model_config_lists_every_accepted_datatype(
    http: th.InferenceServerClient, grpc: tg.InferenceServerClient
) -> None:
    config = http.get_model_config("add")
    assert config["name"] == "add" and [i["name"] for i in config["input"]] == ["a", "b"]
    assert set(config["input"][0]["accepted_data_types"]) >= {"TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_INT32"}
    softmax = http.get_model_config("softmax")
    assert softmax["parameters"]["attribute.axis"]["string_value"] == "-1"
    g = grpc.get_model_config("add").config
    assert g.name == "add" and [i.name for i in g.input] == ["a", "b"]


# --- inference: results equal ob.ops --------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False])
def test_http_infer_equals_ob_ops(http: th.InferenceServerClient, binary: bool) -> None:
    r = http.infer(
        "add", http_inputs({"a": A, "b": B}, binary), outputs=[th.InferRequestedOutput("out", binary_data=binary)]
    )
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.add(A, B))
    r = http.infer("softmax", http_inputs({"x": A}, binary), parameters={"axis": -1})
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.softmax(A, axis=-1))
    r = http.infer("softmax", http_inputs({"x": A}, binary), parameters={"axis": 0})
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.softmax(A, axis=0))


def test_grpc_infer_equals_ob_ops(grpc: tg.InferenceServerClient) -> None:
    r = grpc.infer("add", grpc_inputs({"a": A, "b": B}), model_version="1")
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.add(A, B))
    r = grpc.infer("softmax", grpc_inputs({"x": A}), parameters={"axis": -1})
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.softmax(A, axis=-1))
    w = RNG.random(256, dtype=np.float32)
    r = grpc.infer("layer_norm", grpc_inputs({"x": A, "weight": w}))
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.layer_norm(A, w))
    i = RNG.integers(-100, 100, (3, 5), dtype=np.int32)
    r = grpc.infer("mul", grpc_inputs({"a": i, "b": i}))
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.mul(i, i))


def test_optional_inputs_and_broadcasting(http: th.InferenceServerClient) -> None:
    x = RNG.random((3, 8), dtype=np.float32)
    r = http.infer("layer_norm", http_inputs({"x": x}))
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.layer_norm(x))
    row = RNG.random(8, dtype=np.float32)
    r = http.infer("add", http_inputs({"a": x, "b": row}))
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.add(x, row))


def queue_ns(http: th.InferenceServerClient, model: str) -> int:
    """Queue time of every version of `model`."""
    stats = http.get_inference_statistics(model)["model_stats"]
    return sum(int(version["inference_stats"]["queue"]["ns"]) for version in stats)


def test_small_calls_run_on_the_connection_thread_larger_ones_on_the_workers(
    http: th.InferenceServerClient, grpc: tg.InferenceServerClient
) -> None:
    # A small call of a built-in runs where it arrived (no queue: its queue time is 0); one whose
    # output proves larger than 64 KiB after the checks, or whose inputs need converting, goes
    # to the compute workers already checked. Every answer equals ob.ops bit for bit.
    before = queue_ns(http, "sub")
    small_a, small_b = RNG.random((4, 16), dtype=np.float32), RNG.random((4, 16), dtype=np.float32)
    for _ in range(20):
        r = grpc.infer("sub", grpc_inputs({"a": small_a, "b": small_b}))
        np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.sub(small_a, small_b))
        r = http.infer("sub", http_inputs({"a": small_a, "b": small_b}))
        np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.sub(small_a, small_b))
    assert queue_ns(http, "sub") == before
    column, row = RNG.random((512, 1), dtype=np.float32), RNG.random((1, 512), dtype=np.float32)
    r = grpc.infer("sub", grpc_inputs({"a": column, "b": row}))  # 1 MiB out of 4 KiB in
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.sub(column, row))
    after_large = queue_ns(http, "sub")
    assert after_large > before
    wide = RNG.random((4, 16)).astype(np.float64)  # float32 - float64: converted first
    r = grpc.infer("sub", grpc_inputs({"a": small_a, "b": wide}))
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.sub(small_a, wide))
    assert queue_ns(http, "sub") > after_large
    # Operators whose work a few bytes do not bound (matmul) always go to the workers.
    before_matmul = queue_ns(http, "matmul")
    square = RNG.random((4, 4), dtype=np.float32)
    r = grpc.infer("matmul", grpc_inputs({"a": square, "b": square}))
    np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.matmul(square, square))
    assert queue_ns(http, "matmul") > before_matmul
    # Refusals from the checks are the same on either path.
    with pytest.raises(InferenceServerException, match="shape"):
        grpc.infer("sub", grpc_inputs({"a": small_a, "b": RNG.random((3, 5), dtype=np.float32)}))


def test_request_id_is_echoed(http: th.InferenceServerClient, grpc: tg.InferenceServerClient) -> None:
    assert http.infer("neg", http_inputs({"x": A}), request_id="abc-1").get_response()["id"] == "abc-1"
    assert grpc.infer("neg", grpc_inputs({"x": A}), request_id="abc-2").get_response().id == "abc-2"


def test_gzip_request_body(server: Served) -> None:
    body = json.dumps({"inputs": [{"name": "x", "shape": [3], "datatype": "FP64", "data": [1.0, -2.0, 3.5]}]}).encode()
    status, raw = post(server.url("/v2/models/neg/infer"), gzip.compress(body), {"Content-Encoding": "gzip"})
    assert status == 200, raw
    out = json.loads(raw)["outputs"][0]
    assert out["data"] == [-1.0, 2.0, -3.5] and out["datatype"] == "FP64"


def test_raw_binary_request(server: Served) -> None:
    x = np.arange(6, dtype=np.float32)
    status, raw = post(server.url("/v2/models/neg/infer"), x.tobytes(), {"Inference-Header-Content-Length": "0"})
    assert status == 200, raw


# --- client mistakes: 4xx with {"error"}, gRPC codes, never 5xx ----------------------------------


def error_of(status_and_body: tuple[int, bytes]) -> tuple[int, str]:
    status, body = status_and_body
    return status, json.loads(body)["error"]


@pytest.mark.parametrize(
    "body,status,match",
    [
        (b"{not json", 400, "parse"),
        (b"{}", 400, "inputs"),
        (json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}]}), 400, "takes"),
        (
            json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP99", "data": [1, 2]}]}),
            400,
            "unknown datatype",
        ),
        (json.dumps({"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2]}]}), 400, "elements"),
        (json.dumps({"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]}]}), 400, "negative"),
        (json.dumps({"inputs": [{"name": "y", "shape": [1], "datatype": "FP32", "data": [1]}]}), 400, "unexpected"),
        (
            json.dumps({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}] * 2}),
            400,
            "twice",
        ),
        (
            json.dumps(
                {
                    "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
                    "outputs": [{"name": "nope"}],
                }
            ),
            400,
            "output",
        ),
        (
            json.dumps(
                {"parameters": {"bogus": 1}, "inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}
            ),
            400,
            "bogus",
        ),
        (
            json.dumps({"inputs": [{"name": "x", "shape": [2**40, 2**40], "datatype": "FP32", "data": [1]}]}),
            400,
            "overflows|maximum",
        ),
    ],
)
def test_bad_requests_are_400_with_an_error_body(server: Served, body: bytes | str, status: int, match: str) -> None:
    got_status, message = error_of(
        post(server.url("/v2/models/neg/infer"), body if isinstance(body, bytes) else body.encode())
    )
    assert got_status == status
    assert __import__("re").search(match, message), message


def test_binary_byte_size_mismatch_is_400(server: Served) -> None:
    header = json.dumps(
        {"inputs": [{"name": "x", "shape": [4], "datatype": "FP32", "parameters": {"binary_data_size": 12}}]}
    ).encode()
    status, message = error_of(
        post(
            server.url("/v2/models/neg/infer"),
            header + bytes(12),
            {"Inference-Header-Content-Length": str(len(header))},
        )
    )
    assert status == 400 and "byte size mismatch" in message and "Expected 16, got 12" in message


def test_unknown_models_versions_and_paths(server: Served, grpc: tg.InferenceServerClient) -> None:
    assert error_of(post(server.url("/v2/models/nope/infer"), b"{}"))[0] == 404
    assert error_of(post(server.url("/v2/models/add/versions/7/infer"), b"{}"))[0] == 404
    assert error_of(post(server.url("/v2/models/add/versions/x/infer"), b"{}"))[0] == 400
    for name in ["..", "a..b", "%2e%2e", "%2Fetc%2Fpasswd", "%20"]:
        status, _ = get(server.url(f"/v2/models/{name}"))
        assert status in (400, 404), name
    assert get(server.url("/v2/no/such/path"))[0] == 404
    status, body = get(server.url("/v2/models/add/infer"))
    assert status == 405 and "error" in json.loads(body)
    with pytest.raises(InferenceServerException) as error:
        grpc.infer("nope", grpc_inputs({"x": A}))
    assert error.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as error:
        grpc.infer("neg", [tg.InferInput("x", [3], "FP32")])  # no data
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"


def raw_grpc_infer(server: Served, request: object) -> object:
    """A hand-made ModelInferRequest (tritonclient checks shapes itself before sending)."""
    import grpc as grpcio
    from tritonclient.grpc import service_pb2_grpc

    with grpcio.insecure_channel(server.grpc) as channel:
        return service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)


def test_grpc_raw_size_mismatch_and_mixed_contents_are_invalid_argument(server: Served) -> None:
    import grpc as grpcio
    from tritonclient.grpc import service_pb2

    for raw, shape, datatype, match in [
        (np.ones(4, np.float32).tobytes(), [5], "FP32", "byte size mismatch"),
        (np.ones(4, np.float32).tobytes(), [4], "UINT32", "not supported; it takes"),
        (np.ones(4, np.float32).tobytes(), [3], "FP64", "byte size mismatch"),
        (np.ones(4, np.float32).tobytes(), [2, -2], "FP32", "negative"),
    ]:
        request = service_pb2.ModelInferRequest(model_name="neg")
        tensor = request.inputs.add(name="x", datatype=datatype, shape=shape)
        del tensor
        request.raw_input_contents.append(raw)
        with pytest.raises(grpcio.RpcError) as error:
            raw_grpc_infer(server, request)
        assert error.value.code() == grpcio.StatusCode.INVALID_ARGUMENT, error.value.details()
        assert __import__("re").search(match, error.value.details()), error.value.details()
    # Typed contents and raw contents for one input: refused.
    request = service_pb2.ModelInferRequest(model_name="neg")
    request.inputs.add(name="x", datatype="FP32", shape=[2])
    request.inputs[0].contents.fp32_contents.extend([1.0, 2.0])
    request.raw_input_contents.append(np.ones(2, np.float32).tobytes())
    with pytest.raises(grpcio.RpcError) as error:
        raw_grpc_infer(server, request)
    assert error.value.code() == grpcio.StatusCode.INVALID_ARGUMENT


# --- statistics and metrics ----------------------------------------------------------------------


def test_statistics_and_metrics_after_a_known_mix(server: Served, http: th.InferenceServerClient) -> None:
    before = http.get_inference_statistics("exp")["model_stats"][0]
    for _ in range(3):
        http.infer("exp", http_inputs({"x": A}))
    post(server.url("/v2/models/exp/infer"), b'{"inputs": []}')  # a failure: missing input
    after = http.get_inference_statistics("exp")["model_stats"][0]
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 3
    assert after["inference_stats"]["fail"]["count"] - before["inference_stats"]["fail"]["count"] == 1
    _, text = get(f"http://{server.metrics}/metrics")
    metrics = text.decode()
    assert 'nv_inference_request_success{model="exp",version="1"} 3' in metrics
    assert 'nv_inference_request_failure{model="exp",reason="REJECTED",version="1"} 1' in metrics
    assert "nv_inference_queue_duration_us" in metrics and "opbridge_pool_allocated_bytes" in metrics
    post(server.url("/v2/models/never-heard-of/infer"), b"{}")
    _, text = get(f"http://{server.metrics}/metrics")
    assert "never-heard-of" not in text.decode(), "no label from an unvalidated name"
    assert 'opbridge_requests_rejected_total{code="404",endpoint="infer",protocol="http"}' in text.decode()


# --- limits, auth, control --------------------------------------------------------------------------


def test_limits_just_under_and_just_over() -> None:
    served = start_server("--http-max-input-size", "4096", "--grpc-max-message-size", "4096")
    try:
        http = th.InferenceServerClient(served.http)
        ok = np.ones(512, np.float32)  # 2 KiB of data + the JSON header: under 4 KiB
        np.testing.assert_array_equal(http.infer("neg", http_inputs({"x": ok})).as_numpy("out"), -ok)
        with pytest.raises(InferenceServerException, match="--http-max-input-size"):
            http.infer("neg", http_inputs({"x": np.ones(2048, np.float32)}))
        # JSON expansion: under 4 KiB of JSON that is 4.8 KiB as FP64
        status, message = error_of(
            post(
                served.url("/v2/models/neg/infer"),
                json.dumps({"inputs": [{"name": "x", "shape": [600], "datatype": "FP64", "data": [0] * 600}]}).encode(),
            )
        )
        assert status == 400 and "4096 bytes" in message and "--http-max-input-size" in message, message
        # A declared body over the limit is refused unread, and the client's next request works.
        conn = http_client.HTTPConnection(served.http, timeout=30)
        try:
            conn.request("POST", "/v2/models/neg/infer", body=bytes(8192))
            response = conn.getresponse()
            assert response.status == 400 and "4096" in json.loads(response.read())["error"]
            conn.request("POST", "/v2/models/neg/infer", body=NEG_ONE)
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["outputs"][0]["data"] == [-1.0]
        finally:
            conn.close()
        # JSON expansion: few bytes of JSON claiming a large tensor
        status, message = error_of(
            post(
                served.url("/v2/models/neg/infer"),
                json.dumps(
                    {"inputs": [{"name": "x", "shape": [100000], "datatype": "FP64", "data": [0] * 10}]}
                ).encode(),
            )
        )
        assert status == 400 and "maximum" in message
        grpc = tg.InferenceServerClient(served.grpc)
        with pytest.raises(InferenceServerException) as error:
            grpc.infer("neg", grpc_inputs({"x": np.ones(2048, np.float32)}))
        assert error.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "--grpc-max-message-size" in error.value.message()
        np.testing.assert_array_equal(grpc.infer("neg", grpc_inputs({"x": ok})).as_numpy("out"), -ok)
    finally:
        assert stop_server(served) == 0


def test_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "auth").write_text("s3cret\n")
    (tmp_path / "control").write_text("root-token")
    served = start_server(
        "--auth-token-file",
        str(tmp_path / "auth"),
        "--control-token-file",
        str(tmp_path / "control"),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "neg",
    )
    try:
        assert get(served.url("/v2/health/ready"))[0] == 200, "health stays open"
        assert get(served.url("/v2"))[0] == 401
        assert get(served.url("/v2"), {"Authorization": "Bearer wrong"})[0] == 401
        status, body = get(served.url("/v2"), {"Authorization": "Bearer s3cret"})
        assert status == 200
        # RFC 7235: the scheme is case-insensitive.
        for scheme in ["bearer", "BEARER", "bEaReR"]:
            assert get(served.url("/v2"), {"Authorization": f"{scheme} s3cret"})[0] == 200, scheme
        assert get(served.url("/v2"), {"Authorization": "Basic s3cret"})[0] == 401
        # An unauthenticated request with a body does not cost the client its connection.
        conn = http_client.HTTPConnection(served.http, timeout=30)
        try:
            conn.request("POST", "/v2/models/neg/infer", body=bytes(2_000_000))
            response = conn.getresponse()
            assert response.status == 401 and "error" in json.loads(response.read())
            conn.request("POST", "/v2/models/neg/infer", body=NEG_ONE, headers={"Authorization": "Bearer s3cret"})
            response = conn.getresponse()
            assert response.status == 200, response.read()
            response.read()
        finally:
            conn.close()
        http = th.InferenceServerClient(served.http)
        with pytest.raises(InferenceServerException):
            http.infer("neg", http_inputs({"x": A}))
        r = http.infer("neg", http_inputs({"x": A}), headers={"Authorization": "Bearer s3cret"})
        np.testing.assert_array_equal(r.as_numpy("out"), -A)
        grpc = tg.InferenceServerClient(served.grpc)
        with pytest.raises(InferenceServerException) as error:
            grpc.infer("neg", grpc_inputs({"x": A}))
        assert error.value.status() == "StatusCode.UNAUTHENTICATED"
        r = grpc.infer("neg", grpc_inputs({"x": A}), headers={"authorization": "Bearer s3cret"})
        np.testing.assert_array_equal(r.as_numpy("out"), -A)
        assert post(served.url("/v2/repository/models/exp/load"), b"", {"Authorization": "Bearer s3cret"})[0] == 401
        assert post(served.url("/v2/repository/models/exp/load"), b"", {"Authorization": "Bearer root-token"})[0] == 200
    finally:
        assert stop_server(served) == 0


def test_explicit_mode_load_unload() -> None:
    served = start_server("--model-control-mode", "explicit", "--load-model", "add")
    try:
        http = th.InferenceServerClient(served.http)
        grpc = tg.InferenceServerClient(served.grpc)
        assert http.is_model_ready("add") and not http.is_model_ready("exp")
        index = {m["name"]: m for m in http.get_model_repository_index()}
        assert index["add"]["state"] == "READY" and index["exp"]["state"] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException, match="not loaded"):
            http.infer("exp", http_inputs({"x": A}))
        http.load_model("exp")
        np.testing.assert_array_equal(http.infer("exp", http_inputs({"x": A})).as_numpy("out"), ob.ops.exp(A))
        grpc.unload_model("exp")
        status, message = error_of(post(served.url("/v2/models/exp/infer"), b"{}"))
        assert status == 503 and "unloading / not loaded" in message
        index = {m["name"]: m for m in http.get_model_repository_index()}
        assert "host RSS" in index["exp"]["reason"]
        grpc.load_model("exp")
        assert grpc.is_model_ready("exp")
        with pytest.raises(InferenceServerException):
            http.load_model("no_such_op")
        assert http.is_server_live() and http.is_server_ready()
    finally:
        assert stop_server(served) == 0


def test_sigterm_lets_requests_in_flight_finish() -> None:
    served = start_server()
    try:
        big = RNG.random((512, 512), dtype=np.float32)
        http = th.InferenceServerClient(served.http, concurrency=4)
        pending = [http.async_infer("matmul", http_inputs({"a": big, "b": big})) for _ in range(4)]
        # The client's greenlets connect and send only when this one yields: a plain sleep let
        # SIGTERM close the listener before they connected (a refused connection, not a drain).
        gevent.sleep(0.05)
        os.kill(served.process.pid, signal.SIGTERM)
        for request in pending:
            np.testing.assert_allclose(request.get_result().as_numpy("out"), big @ big, rtol=1e-4)
    finally:
        assert stop_server(served) == 0


# --- protocol hardening ------------------------------------------------------------------------------


def json_infer(
    server: Served, model: str, body: bytes | dict, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = post(server.url(f"/v2/models/{model}/infer"), raw, headers)
    return status, json.loads(answer)


def test_fp16_json_rounds_once(server: Served) -> None:
    # Just above the tie between 1 and the next FP16: through f32 it lands on the tie (-> 1.0).
    x = 1.0 + 2.0**-11 + 1e-8
    body = {"inputs": [{"name": "x", "shape": [1], "datatype": "FP16", "data": [x]}]}
    status, answer = json_infer(server, "neg", body)
    assert status == 200, answer
    assert np.float16(answer["outputs"][0]["data"][0]) == -np.float16(1.0 + 2.0**-10)


def test_json_nan_and_infinity(server: Served) -> None:
    data = b'"data": [NaN, Infinity, -Infinity, 1]'
    body = b'{"id": "NaN", "inputs": [{"name": "x", "shape": [4], "datatype": "FP32", ' + data + b"}]}"
    status, raw = post(server.url("/v2/models/neg/infer"), body)
    assert status == 200, raw
    assert b"[NaN,-Infinity,Infinity,-1.0]" in raw, raw
    answer = json.loads(raw)  # Python's json reads Triton's tokens
    assert answer["id"] == "NaN", "a string is left alone"
    out = np.array(answer["outputs"][0]["data"])
    assert np.isnan(out[0]) and out[1] == -np.inf and out[2] == np.inf and out[3] == -1
    for token in [b"NaN", b"Infinity", b"-Infinity"]:
        body = b'{"inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [' + token + b"]}]}"
        status, answer = json_infer(server, "neg", body)
        assert status == 400 and token.decode() in answer["error"], answer


def test_list_attributes_over_http_and_grpc(http: th.InferenceServerClient, grpc: tg.InferenceServerClient) -> None:
    x = RNG.random((2, 3, 4), dtype=np.float32)
    r = http.infer("transpose", http_inputs({"x": x}), parameters={"axes": [1, 0, 2]})
    np.testing.assert_array_equal(r.as_numpy("out"), np.transpose(x, (1, 0, 2)))
    r = grpc.infer("transpose", grpc_inputs({"x": x}), parameters={"axes": "[2, 0, 1]"})
    np.testing.assert_array_equal(r.as_numpy("out"), np.transpose(x, (2, 0, 1)))
    with pytest.raises(InferenceServerException, match="permutation"):
        http.infer("transpose", http_inputs({"x": x}), parameters={"axes": [0, 0, 1]})


def test_keep_alive_after_an_early_error(server: Served) -> None:
    conn = http_client.HTTPConnection(server.http, timeout=30)
    try:
        for path, status in [
            ("/v2/models/nope/infer", 404),
            ("/v2/models/add/versions/9/infer", 404),
            ("/v2/models/add/versions/x/infer", 400),
            ("/v2/no/such/route", 404),
            ("/v2/health/live", 405),
        ]:
            conn.request("POST", path, body=bytes(2_000_000))
            response = conn.getresponse()
            assert response.status == status and "error" in json.loads(response.read()), path
            conn.request("POST", "/v2/models/neg/infer", body=NEG_ONE)
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["outputs"][0]["data"] == [-1.0]
    finally:
        conn.close()


def raw_exchange(server: Served, request: bytes, timeout: float = 10.0) -> bytes:
    """Sends `request` on a fresh socket and reads until the server closes (or the timeout)."""
    host, port = server.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_malformed_chunked_body_is_400(server: Served) -> None:
    head = b"POST /v2/models/neg/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    answer = raw_exchange(server, head + b"zz\r\nabc\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer
    message = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "chunk" in message and "exceeds" not in message, message


def test_slowloris_client_is_cut_off() -> None:
    served = start_server(env={"OPBRIDGE_SERVE_READ_TIMEOUT_MS": "300"})
    try:
        host, port = served.http.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # and never the end of the head
            started = time.monotonic()
            while s.recv(4096):
                pass
            assert time.monotonic() - started < 5
        assert get(served.url("/v2/health/live"))[0] == 200
    finally:
        assert stop_server(served) == 0


def test_every_error_is_json(server: Served) -> None:
    cases = [
        ("GET", "/v2/models/%ff/config", b"", 400),
        ("GET", "/v2/models/add/versions/x/config", b"", 400),
        ("GET", "/v2/models/add/versions/x/stats", b"", 400),
        ("GET", "/v2/models/add/infer", b"", 405),
        ("PUT", "/v2", b"", 405),
        ("GET", "/no/such/route", b"", 404),
        ("POST", "/v2/repository/index", bytes(3_000_000), 413),
        ("POST", "/v2/repository/index", b"{not json", 400),
        ("POST", "/v2/models/neg/infer", b"[1, 2]", 400),
    ]
    for method, path, body, status in cases:
        conn = http_client.HTTPConnection(server.http, timeout=30)
        try:
            conn.request(method, path, body=body)
            response = conn.getresponse()
            assert response.status == status, (path, response.status)
            assert response.getheader("content-type") == "application/json", path
            assert json.loads(response.read())["error"], path
        finally:
            conn.close()
    assert get(server.url("/v2/models/add/versions/1/config"))[0] == 200
    assert get(server.url("/v2/models/add/versions/1/stats"))[0] == 200
    assert get(server.url("/v2/models/add/versions/1/ready"))[0] == 200


def test_messages_echo_values_as_written(server: Served) -> None:
    status, message = error_of(get(server.url("/v2/models/add/versions/x1/ready")))
    assert status == 400 and "'x1'" in message and '"x1"' not in message, message
    body: dict = {
        "parameters": {"axis": "x"},
        "inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1, 2]}],
    }
    status, answer = json_infer(server, "softmax", body)
    assert status == 400 and 'got "x"' in answer["error"] and "Str(" not in answer["error"], answer
    body["parameters"] = {"axis": 1.5}
    status, answer = json_infer(server, "softmax", body)
    assert status == 400 and "got 1.5" in answer["error"] and "Float(" not in answer["error"], answer


def test_unsupported_and_unknown_tensor_parameters(server: Served, grpc: tg.InferenceServerClient) -> None:
    x = {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}
    cases = [
        ({"inputs": [x], "outputs": [{"name": "out", "parameters": {"classification": 2}}]}, 501, "classification"),
        # Shared memory is off unless --allow-shared-memory (tests/test_serve_shm.py).
        ({"inputs": [{**x, "parameters": {"shared_memory_region": "r"}}]}, 400, "--allow-shared-memory"),
        ({"inputs": [x], "outputs": [{"name": "out", "parameters": {"shared_memory_region": "r"}}]}, 400, "--allow"),
        ({"inputs": [x], "parameters": {"shared_memory_region": "r"}}, 400, "belongs to an input or output"),
        ({"inputs": [{**x, "parameters": {"colour": "red"}}]}, 400, "'colour'"),
        ({"inputs": [x], "outputs": [{"name": "out", "parameters": {"flavour": 1}}]}, 400, "'flavour'"),
    ]
    for body, status, match in cases:
        got, answer = json_infer(server, "neg", body)
        assert got == status and match in answer["error"], answer
    with pytest.raises(InferenceServerException) as error:
        grpc.infer("neg", grpc_inputs({"x": A}), outputs=[tg.InferRequestedOutput("out", class_count=2)])
    assert error.value.status() == "StatusCode.UNIMPLEMENTED" and "classification" in error.value.message()


def test_content_encodings(server: Served) -> None:
    body = json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP64", "data": [1.5, -2.0]}]}).encode()
    for encoding, compressed in [("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))]:
        status, answer = json_infer(server, "neg", compressed, {"Content-Encoding": encoding})
        assert status == 200 and answer["outputs"][0]["data"] == [-1.5, 2.0], (encoding, answer)
    status, answer = json_infer(server, "neg", body, {"Content-Encoding": "br"})
    assert status == 415 and "br" in answer["error"], answer
    status, answer = json_infer(server, "neg", b"not gzip", {"Content-Encoding": "gzip"})
    assert status == 400, answer


def test_kernel_errors_carry_the_kernels_message(server: Served) -> None:
    weight = {"name": "weight", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}
    indices = {"name": "indices", "shape": [2], "datatype": "INT64", "data": [0, 1]}
    offsets = {"name": "offsets", "shape": [2], "datatype": "INT64", "data": [1, 0]}  # must start at 0
    status, answer = json_infer(server, "embedding_bag", {"inputs": [weight, indices, offsets]})
    assert status == 400 and answer["error"].startswith("embedding_bag: offsets[0] must be 0"), answer


def failures(server: Served, model: str, reason: str) -> int:
    """`nv_inference_request_failure{reason}` of `model`, all versions."""
    _, text = get(f"http://{server.metrics}/metrics")
    pattern = rf'nv_inference_request_failure\{{model="{model}",reason="{reason}",version="\d+"\}} (\d+)'
    found = re.findall(pattern, text.decode())
    assert found, text
    return sum(int(n) for n in found)


def pending_requests(server: Served, model: str) -> int:
    _, text = get(f"http://{server.metrics}/metrics")
    pattern = rf'nv_inference_pending_request_count\{{model="{model}",version="\d+"\}} (\d+)'
    return sum(int(n) for n in re.findall(pattern, text.decode()))


def wait_for(condition, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def binary_request(model: str, array: np.ndarray) -> tuple[bytes, bytes]:
    """An HTTP request (head, body) of `model` with inputs `a` and `b` both `array` (FP32, binary)."""
    inputs = [
        {"name": name, "shape": list(array.shape), "datatype": "FP32", "parameters": {"binary_data_size": array.nbytes}}
        for name in ("a", "b")
    ]
    header = json.dumps({"inputs": inputs}).encode()
    body = header + array.tobytes() * 2
    head = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: x\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head, body


def test_client_gone_mid_request_counts_as_canceled() -> None:
    # One worker and large matmuls (3072²: more than a tenth of a second each, longer than
    # sending the next one; 2048² ran in 40 ms, and on a fast run the queue never held two):
    # requests wait in the queue, where their clients leave them. The pending gauge counts
    # queued requests only, so with `count` large requests sent it stays below `count`.
    served = start_server("--workers-per-model", "1", "--http-max-input-size", str(300 << 20))
    opened: list[socket.socket] = []
    try:
        head, body = binary_request("matmul", np.ones((3072, 3072), np.float32))
        host, port = served.http.rsplit(":", 1)

        def send_large(count: int) -> list[socket.socket]:
            """`count` large requests on connections of their own, left unanswered."""
            sent = []
            for _ in range(count):
                s = socket.create_connection((host, int(port)), timeout=30)
                opened.append(s)
                s.sendall(head + body)
                sent.append(s)
            return sent

        def close(sockets: list[socket.socket]) -> None:
            for s in sockets:
                s.close()

        # HTTP: the connection dropped while the request is queued.
        sockets = send_large(4)
        assert wait_for(lambda: pending_requests(served, "matmul") >= 2)
        close(sockets)
        assert wait_for(lambda: failures(served, "matmul", "CANCELED") >= 1)
        assert wait_for(lambda: pending_requests(served, "matmul") == 0)
        # gRPC: small calls queued behind large HTTP requests, cancelled there. Five large
        # requests queue at most four, so a pending count of five includes a gRPC call.
        blockers = send_large(5)
        assert wait_for(lambda: pending_requests(served, "matmul") >= 2)
        before = failures(served, "matmul", "CANCELED")
        client = tg.InferenceServerClient(served.grpc)
        try:
            small = {"a": np.ones((4, 4), np.float32), "b": np.ones((4, 4), np.float32)}
            calls = [
                client.async_infer("matmul", grpc_inputs(small), callback=lambda result, error: None) for _ in range(4)
            ]
            assert wait_for(lambda: pending_requests(served, "matmul") >= 5)
            for call in calls:
                call.cancel()
            assert wait_for(lambda: failures(served, "matmul", "CANCELED") > before)
        finally:
            client.close()
            close(blockers)
    finally:
        # Closed before the stop on every path: an open connection with an answer unread would
        # hold the graceful shutdown until --exit-timeout-secs.
        for s in opened:
            s.close()
        assert stop_server(served) == 0


def test_json_logs_carry_the_request_id(tmp_path) -> None:  # type: ignore[no-untyped-def]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        served = start_server("--log-format", "json", "--log-level", "debug", stderr=log)
        try:
            client = th.InferenceServerClient(served.http)
            x = np.ones((2, 3), np.float32)
            tensor = th.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            client.infer("softmax", [tensor], request_id="trace-me-42", parameters={"axis": -1})
            with pytest.raises(InferenceServerException):
                client.infer("softmax", [tensor], request_id="bad-7", parameters={"colour": 1})
            grpc = tg.InferenceServerClient(served.grpc)
            g = tg.InferInput("x", list(x.shape), "FP32")
            g.set_data_from_numpy(x)
            grpc.infer("softmax", [g], request_id="grpc-9")
        finally:
            assert stop_server(served) == 0
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    by_id = {r["fields"].get("id"): r for r in records if "id" in r.get("fields", {})}
    done = by_id["trace-me-42"]
    assert done["fields"]["message"] == "inference done" and done["fields"]["model"] == "softmax"
    assert done["fields"]["protocol"] == "http" and done["fields"]["duration_us"] >= 0
    refused = by_id["bad-7"]
    assert refused["fields"]["message"] == "inference refused" and refused["fields"]["code"] == "400"
    assert "colour" in refused["fields"]["error"]
    assert by_id["grpc-9"]["fields"]["protocol"] == "grpc"


def test_a_small_call_never_overtakes_the_workers() -> None:
    # A small call runs on its connection's thread only while the model has nothing queued and
    # a worker to spare (--workers-per-model bounds its calls at once). With its one worker busy
    # on a large `pow` (16M elements: a tenth of a second and more), a small `pow` waits in the
    # queue; with that one queued (max_queue_size 1), the next is refused at once (503).
    served = start_server("--workers-per-model", "1", "--max-queue-size", "1", "--http-max-input-size", str(300 << 20))
    opened: list[socket.socket] = []
    host, port = served.http.rsplit(":", 1)
    head, body = binary_request("pow", np.full(1 << 24, 1.0001, np.float32))
    client = tg.InferenceServerClient(served.grpc)
    try:
        before = http_queue_ns(served, "pow")
        s = socket.create_connection((host, int(port)), timeout=60)
        opened.append(s)
        s.sendall(head + body)
        small = {"a": np.full((4, 4), 1.5, np.float32), "b": np.full((4, 4), 2.0, np.float32)}
        answers: list[Any] = []
        client.async_infer("pow", grpc_inputs(small), callback=lambda result, error: answers.append((result, error)))
        assert wait_for(lambda: pending_requests(served, "pow") == 1)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("pow", grpc_inputs(small))
        assert refused.value.status() == "StatusCode.UNAVAILABLE", refused.value
        assert s.recv(64).startswith(b"HTTP/1.1 200")
        assert wait_for(lambda: len(answers) == 1)
        result, error = answers[0]
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("out"), ob.ops.pow(small["a"], small["b"]))
        assert http_queue_ns(served, "pow") > before  # the small call waited in the queue
        r = client.infer("pow", grpc_inputs(small))  # the worker idle again: it runs where it arrived
        np.testing.assert_array_equal(r.as_numpy("out"), ob.ops.pow(small["a"], small["b"]))
    finally:
        client.close()
        for s in opened:
            s.close()
        assert stop_server(served) == 0


def http_queue_ns(served: Served, model: str) -> int:
    _, body = get(served.url(f"/v2/models/{model}/stats"))
    return sum(int(version["inference_stats"]["queue"]["ns"]) for version in json.loads(body)["model_stats"])
