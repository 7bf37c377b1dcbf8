"""`opbridge serve` with models on the device (the ACL test double as `ascend:0`): requests are
decoded into pinned host memory and copied to the device on the model's stream, outputs come back
the same way; a plugin's ABI 3 Ascend kernel serves as a model; `device = "auto"` routes each
request by the calibrated crossover; the `path` label of the metrics says where each execution
ran. Each test starts its own server on free loopback ports and stops it by its PID."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

import opbridge as ob
from conftest import ASCEND_LIB_DIR
from test_plugin_devices import example_plugin  # noqa: F401 (a fixture)
from test_serve import Served, start_server, stop_server
from test_serve_repository import add_version, write_config

pytestmark = [
    pytest.mark.skipif(ASCEND_LIB_DIR is None, reason="the Ascend test double could not be built"),
    pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning"),
]

DEV = "ascend:0"


def device_repo(tmp_path: Path, example_plugin: Path) -> Path:  # noqa: F811
    repo = tmp_path / "models"
    write_config(repo, "add_npu", f'device = "{DEV}"\n[alias]\nop = "add"\n')
    write_config(repo, "softmax_npu", f'device = "{DEV}"\n[alias]\nop = "softmax"\n[alias.attributes]\naxis = -1\n')
    write_config(repo, "mul_auto", 'device = "auto"\n[alias]\nop = "mul"\n')
    folder = write_config(repo, "scale_add_ascend", f'device = "{DEV}"\n')
    (folder / "1").mkdir()
    shutil.copy(example_plugin, folder / "1" / "libscale_add_ascend.so")
    return repo


def serve(repo: Path, tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[Served, Path]:
    stderr = tmp_path / "server.err"
    full = {"OPBRIDGE_ASCEND_LIB_DIR": str(ASCEND_LIB_DIR), **(env or {})}
    with stderr.open("w") as err:
        served = start_server("--repository", str(repo), *extra, env=full, stderr=err)
    return served, stderr


def infer(served: Served, model: str, *arrays: np.ndarray, names=("a", "b")) -> np.ndarray:
    client = th.InferenceServerClient(served.http)
    inputs = []
    for name, array in zip(names[: len(arrays)], arrays, strict=True):
        item = th.InferInput(name, list(array.shape), "FP32")
        item.set_data_from_numpy(array, binary_data=True)
        inputs.append(item)
    return client.infer(model, inputs).as_numpy("out")


def paths(served: Served) -> dict[tuple[str, str], int]:
    text = urllib.request.urlopen(f"http://{served.metrics}/metrics", timeout=10).read().decode()
    found = re.findall(r'opbridge_execution_path_total\{model="([^"]+)",path="([^"]+)",version="\d+"\} (\d+)', text)
    return {(model, path): int(n) for model, path, n in found}


def test_models_on_the_device_serve_and_say_so(tmp_path: Path, example_plugin: Path, rng) -> None:  # noqa: F811
    report = tmp_path / "acl-report.jsonl"
    served, _ = serve(device_repo(tmp_path, example_plugin), tmp_path, env={"ACLDOUBLE_REPORT_FILE": str(report)})
    try:
        for n in (1, 1000, 70_000):
            a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
            np.testing.assert_array_equal(infer(served, "add_npu", a, b), a + b)
            np.testing.assert_allclose(
                infer(served, "scale_add_ascend", a, b), a + b, rtol=1e-6, err_msg="the plugin's Ascend kernel"
            )
        x = rng.standard_normal((4, 33)).astype(np.float32)
        want = np.exp(x - x.max(axis=-1, keepdims=True))
        want /= want.sum(axis=-1, keepdims=True)
        np.testing.assert_allclose(infer(served, "softmax_npu", x, names=("x",)), want, rtol=1e-5, atol=1e-7)
        counted = paths(served)
        assert counted[("add_npu", DEV)] == 3 and counted[("scale_add_ascend", DEV)] == 3
        assert counted[("softmax_npu", DEV)] == 1
        assert not any(model.endswith("_npu") and path == "host" for model, path in counted)
        # Client mistakes stay 400 on the device too.
        client = th.InferenceServerClient(served.http)
        wrong = th.InferInput("a", [3], "FP64")
        wrong.set_data_from_numpy(np.ones(3), binary_data=True)
        with pytest.raises(InferenceServerException, match="400|not supported"):
            client.infer("add_npu", [wrong, wrong])
    finally:
        assert stop_server(served) == 0
    # ACL was finalized at exit, after the pools went back to the driver: nothing left behind.
    (final,) = [json.loads(line) for line in report.read_text().splitlines()]
    assert (final["device_allocs"], final["host_allocs"], final["streams"], final["events"]) == (0, 0, 0, 0), final


def test_a_failing_device_kernel_fails_its_request_only(tmp_path: Path, example_plugin: Path) -> None:  # noqa: F811
    served, _ = serve(device_repo(tmp_path, example_plugin), tmp_path, env={"ACLDOUBLE_FAIL": "aclnnAdd:1"})
    try:
        a = np.arange(8, dtype=np.float32)
        with pytest.raises(InferenceServerException, match="aclnnAdd"):
            infer(served, "add_npu", a, a)
        np.testing.assert_array_equal(infer(served, "add_npu", a, a), 2 * a)  # the next one works
    finally:
        stop_server(served)


def test_auto_routes_by_the_calibrated_crossover(tmp_path: Path, example_plugin: Path, rng) -> None:  # noqa: F811
    identity = ob._native.device_identity(DEV)
    assert identity, "the double reports its chip and library"
    crossovers = tmp_path / "crossovers.json"
    entry = {"op": "mul", "dtype": "float32", "device": DEV, "elems": 4096, "identity": identity}
    stale = {**entry, "dtype": "float16", "elems": 1, "identity": "Ascend310P3 via /elsewhere/libascendcl.so"}
    crossovers.write_text(json.dumps([entry, stale]))
    served, _ = serve(device_repo(tmp_path, example_plugin), tmp_path, "--crossovers", str(crossovers))
    try:
        for n in (10, 4095, 4096, 100_000):
            a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
            np.testing.assert_array_equal(infer(served, "mul_auto", a, b), a * b)
        counted = paths(served)
        assert counted[("mul_auto", "host")] == 2 and counted[("mul_auto", DEV)] == 2, counted
    finally:
        stop_server(served)


def test_device_configs_that_cannot_work_are_load_errors(tmp_path: Path, libraries: dict[str, Path]) -> None:
    repo = tmp_path / "models"
    # The example C plugin has a CPU kernel only.
    add_version(repo, "scale_add", 1, libraries["scale_add_1"])
    write_config(repo, "scale_add", f'device = "{DEV}"\n')
    write_config(repo, "matmul_auto", 'device = "auto"\n[alias]\nop = "matmul"\n')
    write_config(repo, "nowhere", 'device = "ascend:7"\n[alias]\nop = "add"\n')
    write_config(repo, "add_ok", f'device = "{DEV}"\n[alias]\nop = "add"\n')
    served, _ = serve(repo, tmp_path)
    try:
        status = json.loads(
            urllib.request.urlopen(
                urllib.request.Request(f"http://{served.http}/v2/repository/index", data=b"{}", method="POST"),
                timeout=10,
            ).read()
        )
        reasons = {e["name"]: e.get("reason", "") for e in status}
        states = {e["name"]: e.get("state") for e in status}
        assert states["add_ok"] == "READY"
        assert "has no kernel on ascend:0; it has kernels for: cpu" in reasons["scale_add"], reasons
        assert 'device = "auto" routes' in reasons["matmul_auto"] and "not elementwise" in reasons["matmul_auto"]
        assert "ascend:7 is not available" in reasons["nowhere"], reasons
    finally:
        stop_server(served)


def test_the_server_without_crossovers_keeps_auto_on_the_host(tmp_path: Path, example_plugin: Path) -> None:  # noqa: F811
    env = {"OPBRIDGE_CACHE_DIR": str(tmp_path / "empty-cache")}
    served, _ = serve(device_repo(tmp_path, example_plugin), tmp_path, env=env)
    try:
        a = np.ones(200_000, np.float32)
        np.testing.assert_array_equal(infer(served, "mul_auto", a, a), a)
        assert paths(served)[("mul_auto", "host")] == 1
    finally:
        stop_server(served)


def test_a_broken_crossovers_file_named_on_the_command_line_stops_the_server(tmp_path: Path) -> None:
    broken = tmp_path / "crossovers.json"
    broken.write_text("{not json")
    (tmp_path / "models").mkdir()
    with pytest.raises(AssertionError, match="ready line"):  # start_server stops what it started
        serve(tmp_path / "models", tmp_path, "--crossovers", str(broken))
    assert "not a JSON list of crossovers" in (tmp_path / "server.err").read_text()


def test_a_failed_request_leaves_nothing_for_the_next(tmp_path: Path, example_plugin: Path) -> None:  # noqa: F811
    """One worker; the device's first task (request 1's input copy) fails: request 1 gets its
    error, and request 2 on the same worker and stream gets its own, correct answer."""
    env = {"ACLDOUBLE_FAIL": "task:1"}
    served, _ = serve(device_repo(tmp_path, example_plugin), tmp_path, "--workers-per-model", "1", env=env)
    try:
        a = np.arange(8, dtype=np.float32)
        with pytest.raises(InferenceServerException):
            infer(served, "add_npu", a, a)
        np.testing.assert_array_equal(infer(served, "add_npu", a, a), 2 * a)
    finally:
        stop_server(served)


def test_concurrent_staged_requests_get_their_own_results_or_errors(
    tmp_path: Path,
    example_plugin: Path,  # noqa: F811
) -> None:
    """device = "auto" requests share the device's staging streams: with some kernels failing,
    every request still gets its own correct result or an error, never another's bytes."""
    import threading

    identity = ob._native.device_identity(DEV)
    crossovers = tmp_path / "crossovers.json"
    entry = {"op": "mul", "dtype": "float32", "device": DEV, "elems": 64, "identity": identity}
    crossovers.write_text(json.dumps([entry]))
    env = {"ACLDOUBLE_FAIL": "aclnnMul:5,aclnnMul:11,aclnnMul:17"}
    served, _ = serve(device_repo(tmp_path, example_plugin), tmp_path, "--crossovers", str(crossovers), env=env)
    wrong: list[int] = []
    answered: list[int] = []

    def client(k: int) -> None:
        for j in range(10):
            n = 100 + k * 10 + j
            a, b = np.full(n, k + 1, np.float32), np.full(n, j + 2, np.float32)
            try:
                got = infer(served, "mul_auto", a, b)
            except InferenceServerException:
                continue
            answered.append(n)
            if not np.array_equal(got, a * b):
                wrong.append(n)

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not wrong, f"requests answered with another's data: {wrong}"
        assert 40 <= len(answered) < 60, f"{len(answered)} of 60 answered: the injected failures must fail some"
    finally:
        stop_server(served)


def test_a_device_model_says_where_it_runs_and_what_it_takes(tmp_path: Path, example_plugin: Path) -> None:  # noqa: F811
    repo = device_repo(tmp_path, example_plugin)
    write_config(repo, "rms_npu", f'device = "{DEV}"\n[alias]\nop = "rms_norm"\n')
    served, _ = serve(repo, tmp_path)
    try:
        config = json.loads(urllib.request.urlopen(f"http://{served.http}/v2/models/rms_npu/config", timeout=10).read())
        assert config["instance_group"][0]["kind"] == "KIND_MODEL"
        assert config["parameters"]["device"]["string_value"] == DEV
        x = next(i for i in config["input"] if i["name"] == "x")
        assert x["accepted_data_types"] == ["TYPE_FP16", "TYPE_FP32"], "CANN's RmsNorm has no float64"
        auto = json.loads(urllib.request.urlopen(f"http://{served.http}/v2/models/mul_auto/config", timeout=10).read())
        assert auto["parameters"]["device"]["string_value"] == "auto"
        assert auto["instance_group"][0]["kind"] == "KIND_CPU"
        # A float64 request is a client mistake (400), refused before the device runs anything.
        client = th.InferenceServerClient(served.http)
        x64 = th.InferInput("x", [2, 3], "FP64")
        x64.set_data_from_numpy(np.ones((2, 3)), binary_data=True)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("rms_npu", [x64])
        assert str(refused.value.status()) == "400", refused.value
        assert "float64" in str(refused.value)
        # The device's pools are in the metrics.
        infer(served, "add_npu", np.ones(1000, np.float32), np.ones(1000, np.float32))
        text = urllib.request.urlopen(f"http://{served.metrics}/metrics", timeout=10).read().decode()
        for name in ("opbridge_pool_reserved_bytes", "opbridge_pinned_pool_reserved_bytes"):
            found = re.search(rf'{name}{{device="{DEV}"}} (\d+)', text)
            assert found and int(found.group(1)) > 0, name
        assert 'opbridge_pool_allocated_bytes{device="cpu:0"}' in text
    finally:
        stop_server(served)


def test_a_bad_embedding_index_is_the_clients_mistake_on_the_device_too(tmp_path: Path, example_plugin: Path) -> None:  # noqa: F811
    """The device kernel reads indices only when it runs; the server checks them on the
    request's bytes first, as the host kernel does: 400, the same message, nothing launched."""
    repo = device_repo(tmp_path, example_plugin)
    write_config(repo, "bag_npu", f'device = "{DEV}"\n[alias]\nop = "embedding_bag"\n')
    served, _ = serve(repo, tmp_path)
    try:
        client = th.InferenceServerClient(served.http)

        def call(indices: np.ndarray, offsets: np.ndarray) -> np.ndarray:
            tensors = []
            for name, array, kind in (
                ("weight", np.arange(10, dtype=np.float32).reshape(5, 2), "FP32"),
                ("indices", indices, "INT64"),
                ("offsets", offsets, "INT64"),
            ):
                item = th.InferInput(name, list(array.shape), kind)
                item.set_data_from_numpy(array, binary_data=True)
                tensors.append(item)
            return client.infer("bag_npu", tensors).as_numpy("out")

        np.testing.assert_array_equal(call(np.array([0, 4]), np.array([0])), [[8, 10]])
        for indices, offsets, message in (
            (np.array([0, 5]), np.array([0]), "out of range"),
            (np.array([7]), np.zeros(0, np.int64), "out of range"),  # an empty output too
            (np.array([0, 1]), np.array([1]), "offsets"),
        ):
            with pytest.raises(InferenceServerException, match=message) as refused:
                call(indices, offsets)
            assert str(refused.value.status()) == "400", refused.value
        np.testing.assert_array_equal(call(np.array([1]), np.array([0])), [[2, 3]])
    finally:
        stop_server(served)
