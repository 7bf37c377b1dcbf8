"""`opbridge serve` with model repositories: config, versions, aliases, control modes, churn, leaks.

Each test builds its own repository in a temporary folder (the plugin libraries compiled with the
system compiler from examples/plugins/c/scale_add.c and tests/plugins/leaky.c), starts a server on
free loopback ports and stops it by its PID.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

import opbridge as ob
from test_serve import Served, start_server, stop_server

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "repository"


# --- building repositories ----------------------------------------------------------------------


def add_version(repo: Path, model: str, version: int, library: Path) -> None:
    folder = repo / model / str(version)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(library, folder / f"lib{model}.so")


def example_repo(tmp_path: Path, libraries: dict[str, Path]) -> Path:
    """A copy of examples/repository with its libraries built."""
    repo = tmp_path / "models"
    shutil.copytree(EXAMPLE, repo, ignore=shutil.ignore_patterns("*.so", ".gitignore", "README.md"))
    for version in (1, 2):
        add_version(repo, "scale_add", version, libraries[f"scale_add_{version}"])
    return repo


def write_config(repo: Path, model: str, text: str) -> Path:
    folder = repo / model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(text)
    return folder


# --- talking to the server ----------------------------------------------------------------------


def call(served: Served, method: str, path: str, body: object | None = None) -> tuple[int, object]:
    """One request on a fresh connection: (status, parsed JSON or None)."""
    conn = http.client.HTTPConnection(served.http, timeout=60)
    try:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        data = response.read()
        return response.status, (json.loads(data) if data else None)
    finally:
        conn.close()


def index(served: Served) -> dict[tuple[str, str], dict]:
    status, entries = call(served, "POST", "/v2/repository/index", {})
    assert status == 200, entries
    assert isinstance(entries, list)
    return {(e["name"], e.get("version", "")): e for e in entries}


def load(served: Served, name: str) -> tuple[int, object]:
    return call(served, "POST", f"/v2/repository/models/{name}/load", {})


def unload(served: Served, name: str, dependents: bool = False) -> tuple[int, object]:
    return call(
        served, "POST", f"/v2/repository/models/{name}/unload", {"parameters": {"unload_dependents": dependents}}
    )


def scale_add_http(
    client: th.InferenceServerClient, a: np.ndarray, b: np.ndarray, version: str = "", **params: float
) -> np.ndarray:
    inputs = []
    for name, value in (("a", a), ("b", b)):
        tensor = th.InferInput(name, list(value.shape), "FP32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result = client.infer("scale_add", inputs, model_version=version, parameters=params or None)
    return result.as_numpy("out")


def expected_scale_add(a: np.ndarray, b: np.ndarray, version: int, alpha: float, beta: float = 1.0) -> np.ndarray:
    if version == 1:
        return a * np.float32(alpha) + b
    return a * np.float32(alpha) + b * np.float32(beta)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(10)


# --- mode none: everything loaded at start --------------------------------------------------------


def test_repository_models_serve_every_version_and_aliases(tmp_path, libraries, rng):
    repo = example_repo(tmp_path, libraries)
    write_config(repo, "small_add", '[alias]\nop = "add"\n')
    (repo / "small_add" / "config.toml").write_text('max_request_bytes = 4096\n[alias]\nop = "add"\n')
    served = start_server("--repository", str(repo))
    try:
        entries = index(served)
        for key in (("scale_add", "1"), ("scale_add", "2"), ("softmax_rows", "1"), ("small_add", "1")):
            assert entries[key]["state"] == "READY", entries
        client = th.InferenceServerClient(served.http)
        a = rng.random((3, 5), dtype=np.float32)
        b = rng.random((3, 5), dtype=np.float32)
        # Each version runs its own library; unversioned requests get the latest (2).
        np.testing.assert_array_equal(scale_add_http(client, a, b, "1", alpha=2.0), expected_scale_add(a, b, 1, 2.0))
        np.testing.assert_array_equal(
            scale_add_http(client, a, b, "2", alpha=2.0, beta=0.5), expected_scale_add(a, b, 2, 2.0, 0.5)
        )
        np.testing.assert_array_equal(scale_add_http(client, a, b, beta=3.0), expected_scale_add(a, b, 2, 1.0, 3.0))
        # v1 has no `beta`: a 400 naming it.
        with pytest.raises(InferenceServerException, match="beta") as err:
            scale_add_http(client, a, b, "1", beta=3.0)
        assert err.value.status() == "400"
        # A version that never existed is 404.
        with pytest.raises(InferenceServerException) as err:
            scale_add_http(client, a, b, "3")
        assert err.value.status() == "404"

        # gRPC: the same versions, the same numbers.
        grpc = tg.InferenceServerClient(served.grpc)
        inputs = []
        for name, value in (("a", a), ("b", b)):
            tensor = tg.InferInput(name, list(value.shape), "FP32")
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        got = grpc.infer("scale_add", inputs, model_version="1", parameters={"alpha": 4.0}).as_numpy("out")
        np.testing.assert_array_equal(got, expected_scale_add(a, b, 1, 4.0))
        assert grpc.get_model_metadata("scale_add", as_json=True)["versions"] == ["1", "2"]

        # The alias: softmax with axis=-1 fixed; setting it is a 400.
        x = rng.standard_normal((4, 16)).astype(np.float32)
        tensor = th.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        got = client.infer("softmax_rows", [tensor]).as_numpy("out")
        np.testing.assert_array_equal(got, ob.ops.softmax(x, axis=-1))
        with pytest.raises(InferenceServerException, match="axis") as err:
            client.infer("softmax_rows", [tensor], parameters={"axis": 0})
        assert err.value.status() == "400"

        # /config reports the repository's policy; the alias its fixed attribute.
        config = client.get_model_config("scale_add")
        assert config["version_policy"] == {"all": {}}
        assert "fixed.axis" in client.get_model_config("softmax_rows")["parameters"]

        # A model's max_request_bytes, over HTTP and gRPC: just under passes, just over is refused.
        fits = np.ones(256, np.float32)  # 2 inputs × 1 KiB, within 4096 with the JSON header
        too_big = np.ones(1024, np.float32)
        for value, ok in ((fits, True), (too_big, False)):
            tensors = []
            for name in ("a", "b"):
                tensor = th.InferInput(name, list(value.shape), "FP32")
                tensor.set_data_from_numpy(value)
                tensors.append(tensor)
            if ok:
                np.testing.assert_array_equal(client.infer("small_add", tensors).as_numpy("out"), value + value)
            else:
                with pytest.raises(InferenceServerException, match="max_request_bytes") as err:
                    client.infer("small_add", tensors)
                assert err.value.status() == "400"
        tensors = []
        for name in ("a", "b"):
            tensor = tg.InferInput(name, [1024], "FP32")
            tensor.set_data_from_numpy(too_big)
            tensors.append(tensor)
        with pytest.raises(InferenceServerException, match="max_request_bytes") as err:
            grpc.infer("small_add", tensors)
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"

        # The index of one repository by its folder name; an unknown repository is a 404.
        status, named = call(served, "POST", f"/v2/repository/{repo.name}/index", {})
        assert status == 200 and {e["name"] for e in named} >= {"scale_add", "softmax_rows", "small_add"}
        assert call(served, "POST", "/v2/repository/elsewhere/index", {})[0] == 404
        grpc_index = grpc.get_model_repository_index(as_json=True)["models"]
        assert {"name": "scale_add", "version": "2", "state": "READY"}.items() <= grpc_index[1].items() or any(
            m["name"] == "scale_add" and m.get("version") == "2" and m["state"] == "READY" for m in grpc_index
        )

        # Explicit control is refused in mode none.
        status, body = load(served, "scale_add")
        assert status == 501 and "explicit" in body["error"]
    finally:
        assert stop_server(served) == 0


# --- configs and paths that must be refused -------------------------------------------------------


def test_bad_configs_and_path_escapes_are_load_errors(tmp_path, libraries):
    repo = tmp_path / "models"
    repo.mkdir()
    outside = tmp_path / "outside"
    add_version(outside, "scale_add", 1, libraries["scale_add_1"])
    (outside / "scale_add" / "config.toml").write_text("")

    write_config(repo, "bad_key", 'colour = "blue"\n')
    write_config(repo, "bad_alias_key", '[alias]\nop = "softmax"\nflavour = 1\n')
    write_config(repo, "bad_policy", 'version_policy = "some"\n')
    write_config(repo, "bad_attr", '[alias]\nop = "softmax"\n[alias.attributes]\naxis = "minus one"\n')
    write_config(repo, "unknown_op", '[alias]\nop = "no_such_op"\n')
    write_config(repo, "no_versions", "")
    write_config(repo, "two_libs", "")
    add_version(repo, "two_libs", 1, libraries["scale_add_1"])
    shutil.copy(libraries["scale_add_1"], repo / "two_libs" / "1" / "libother.so")
    write_config(repo, "wrong_op", "")  # its library exports scale_add, not wrong_op
    add_version(repo, "wrong_op", 1, libraries["scale_add_1"])
    write_config(repo, "scale_add", "version_policy = { specific = [2] }\n")  # v2 only: v1's library is absent
    add_version(repo, "scale_add", 1, libraries["scale_add_1"])
    # Symbolic links out of the repository: a model folder, a version folder, a library.
    (repo / "linked_model").symlink_to(outside / "scale_add", target_is_directory=True)
    write_config(repo, "linked_version", "")
    (repo / "linked_version" / "1").symlink_to(outside / "scale_add" / "1", target_is_directory=True)
    write_config(repo, "linked_library", "")
    (repo / "linked_library" / "1").mkdir()
    (repo / "linked_library" / "1" / "liblinked_library.so").symlink_to(outside / "scale_add" / "1" / "libscale_add.so")
    write_config(repo, "garbage_library", "")
    (repo / "garbage_library" / "1").mkdir()
    (repo / "garbage_library" / "1" / "libgarbage_library.so").write_bytes(b"not an ELF file")

    served = start_server("--repository", str(repo), "--model-control-mode", "explicit", "--no-builtins")
    try:
        expected = {
            "bad_key": "unknown key 'colour'",
            "bad_alias_key": "unknown key 'flavour'",
            "bad_policy": "version_policy",
            "bad_attr": "axis",
            "unknown_op": "no_such_op",
            "no_versions": "version",
            "two_libs": "exactly one",
            "wrong_op": "wrong_op",
            "scale_add": "2",
            "linked_model": "",
            "linked_version": "outside",
            "linked_library": "outside",
            "garbage_library": "libgarbage_library.so",
        }
        entries = index(served)
        for name, words in expected.items():
            status, body = load(served, name)
            assert status == 400, (name, status, body)
            assert words in body["error"], (name, body)
            assert name in body["error"] or name == "linked_model", (name, body)
            with pytest.raises(InferenceServerException) as err:
                th.InferenceServerClient(served.http).get_model_metadata(name)
            assert err.value.status() in ("400", "503"), (name, err.value)
        entries = index(served)
        assert entries[("bad_key", "")]["state"] == "UNAVAILABLE"
        assert "colour" in entries[("bad_key", "")]["reason"]
        # Names that are paths are refused before touching the file system.
        for name in ("..", "..%2Foutside", "a%5Cb", "%2e%2e"):
            status, body = load(served, name)
            assert status in (400, 404), (name, status, body)
            assert "error" in body
        # The --no-builtins server serves nothing it was not asked to: built-ins are unknown.
        status, body = call(served, "GET", "/v2/models/add")
        assert status == 404
        assert call(served, "GET", "/v2/health/ready")[0] == 200
    finally:
        assert stop_server(served) == 0


# --- explicit control: load, unload, failed reload ------------------------------------------------


def test_explicit_load_unload_and_failed_reload_keeps_serving(tmp_path, libraries, rng):
    repo = example_repo(tmp_path, libraries)
    served = start_server(
        "--repository", str(repo), "--model-control-mode", "explicit", "--load-model", "softmax_rows", "--no-builtins"
    )
    try:
        client = th.InferenceServerClient(served.http)
        a = rng.random(8, dtype=np.float32)
        b = rng.random(8, dtype=np.float32)
        assert index(served)[("scale_add", "")]["state"] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException, match="not loaded") as err:
            scale_add_http(client, a, b)
        assert err.value.status() == "503"
        with pytest.raises(InferenceServerException) as err:
            client.infer("never_there", [])
        assert err.value.status() == "404"

        assert load(served, "scale_add")[0] == 200
        np.testing.assert_array_equal(scale_add_http(client, a, b, alpha=3.0), expected_scale_add(a, b, 2, 3.0))

        # A broken library on reload: the load fails, the old versions keep serving.
        good = repo / "scale_add" / "2" / "libscale_add.so"
        saved = good.read_bytes()
        good.write_bytes(b"\x7fELF broken")
        status, body = load(served, "scale_add")
        assert status == 400 and "failed to load 'scale_add'" in body["error"], body
        np.testing.assert_array_equal(scale_add_http(client, a, b, "2", alpha=3.0), expected_scale_add(a, b, 2, 3.0))
        good.write_bytes(saved)
        assert load(served, "scale_add")[0] == 200

        # gRPC control works too; the unload reason reports memory before and after.
        grpc = tg.InferenceServerClient(served.grpc)
        grpc.unload_model("scale_add")
        reason = index(served)[("scale_add", "")]["reason"]
        assert "RSS" in reason and "pool" in reason, reason
        with pytest.raises(InferenceServerException, match="scale_add") as err:
            scale_add_http(client, a, b, "1")
        assert err.value.status() == "503"
        grpc.load_model("scale_add")
        assert grpc.is_model_ready("scale_add", "1")

        # Unloading a model with unload_dependents unloads the aliases serving it.
        write_config(repo, "scaled", '[alias]\nop = "scale_add"\nversion = 1\n[alias.attributes]\nalpha = 10.0\n')
        assert load(served, "scaled")[0] == 200
        inputs = []
        for name, value in (("a", a), ("b", b)):
            tensor = th.InferInput(name, [8], "FP32")
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        np.testing.assert_array_equal(client.infer("scaled", inputs).as_numpy("out"), expected_scale_add(a, b, 1, 10.0))
        assert unload(served, "scale_add", dependents=True)[0] == 200
        assert not client.is_model_ready("scaled")
    finally:
        assert stop_server(served) == 0


# --- poll mode --------------------------------------------------------------------------------------


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_poll_mode_picks_up_new_and_removed_versions_and_models(tmp_path, libraries, rng):
    repo = tmp_path / "models"
    write_config(repo, "scale_add", 'version_policy = "all"\n')
    add_version(repo, "scale_add", 1, libraries["scale_add_1"])
    served = start_server(
        "--repository", str(repo), "--model-control-mode", "poll", "--repository-poll-secs", "1", "--no-builtins"
    )
    try:
        client = th.InferenceServerClient(served.http)
        assert client.is_model_ready("scale_add", "1") and not client.is_model_ready("scale_add", "2")
        add_version(repo, "scale_add", 2, libraries["scale_add_2"])
        assert wait_for(lambda: client.is_model_ready("scale_add", "2")), index(served)
        a = rng.random(4, dtype=np.float32)
        np.testing.assert_array_equal(scale_add_http(client, a, a, beta=2.0), expected_scale_add(a, a, 2, 1.0, 2.0))
        shutil.rmtree(repo / "scale_add" / "1")
        assert wait_for(lambda: not client.is_model_ready("scale_add", "1")), index(served)
        assert client.is_model_ready("scale_add", "2")
        # A new model folder appears (an alias of scale_add), then the folder goes away.
        write_config(repo, "doubled", '[alias]\nop = "scale_add"\n[alias.attributes]\nalpha = 2.0\n')
        assert wait_for(lambda: client.is_model_ready("doubled")), index(served)
        shutil.rmtree(repo / "doubled")
        assert wait_for(lambda: not client.is_model_ready("doubled")), index(served)
        # Removed models answer 503 while the repository still knows them (Triton's rule).
        assert load(served, "scale_add")[0] == 501
    finally:
        assert stop_server(served) == 0


# --- churn: reloads and load/unload under traffic -------------------------------------------------


def test_reload_churn_under_traffic_gives_only_allowed_errors(tmp_path, libraries):
    repo = example_repo(tmp_path, libraries)
    served = start_server("--repository", str(repo), "--model-control-mode", "explicit", "--load-model", "scale_add")
    try:
        stop = threading.Event()
        wrong: list[str] = []
        unexpected: list[str] = []
        counts = {"ok": 0, "unavailable": 0}
        lock = threading.Lock()

        def client_loop(seed: int) -> None:
            client = th.InferenceServerClient(served.http)
            local = np.random.default_rng(seed)
            while not stop.is_set():
                a = local.random(64, dtype=np.float32)
                b = local.random(64, dtype=np.float32)
                version = str(local.integers(1, 3))
                try:
                    got = scale_add_http(client, a, b, version, alpha=2.0)
                except InferenceServerException as e:
                    with lock:
                        if e.status() == "503":
                            counts["unavailable"] += 1
                        else:
                            unexpected.append(f"{e.status()}: {e.message()}")
                    continue
                if not np.array_equal(got, expected_scale_add(a, b, int(version), 2.0)):
                    wrong.append(version)
                with lock:
                    counts["ok"] += 1

        threads = [threading.Thread(target=client_loop, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        try:
            # Reloads never drop availability: no 503 while only reloading.
            for _ in range(40):
                assert load(served, "scale_add")[0] == 200
            with lock:
                assert counts["unavailable"] == 0, counts
            # Unload / load cycles: 503 is the only error allowed.
            for _ in range(10):
                assert unload(served, "scale_add")[0] == 200
                assert load(served, "scale_add")[0] == 200
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        assert not wrong, wrong
        assert not unexpected, unexpected[:5]
        assert counts["ok"] > 100, counts

        # 8 threads × 200 concurrent load/unload of one model: the server stays live and ready.
        failures: list[tuple[int, object]] = []

        def control_loop(k: int) -> None:
            for i in range(200):
                status, body = (load if (i + k) % 2 == 0 else unload)(served, "scale_add")
                if status != 200:
                    failures.append((status, body))

        threads = [threading.Thread(target=control_loop, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not failures, failures[:5]
        assert call(served, "GET", "/v2/health/live")[0] == 200
        assert call(served, "GET", "/v2/health/ready")[0] == 200
        assert load(served, "scale_add")[0] == 200
        a = np.arange(8, dtype=np.float32)
        client = th.InferenceServerClient(served.http)
        np.testing.assert_array_equal(scale_add_http(client, a, a, "1", alpha=2.0), expected_scale_add(a, a, 1, 2.0))
    finally:
        assert stop_server(served) == 0


# --- memory growth: the plateau rule, and a leak it must flag -------------------------------------


def binary_request(model: str, inputs: dict[str, np.ndarray]) -> tuple[str, bytes, dict[str, str]]:
    """A prepared binary-extension infer request (path, body, headers) for a raw keep-alive loop."""
    header = {
        "inputs": [
            {"name": n, "shape": list(v.shape), "datatype": "FP32", "parameters": {"binary_data_size": v.nbytes}}
            for n, v in inputs.items()
        ],
        "outputs": [{"name": "out", "parameters": {"binary_data": True}}],
    }
    head = json.dumps(header).encode()
    body = head + b"".join(v.tobytes() for v in inputs.values())
    headers = {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}
    return f"/v2/models/{model}/infer", body, headers


def growth_samples(served: Served, model: str, inputs: dict[str, np.ndarray], requests: int, cycles: int) -> list[int]:
    """RSS samples (one per 250 requests) while sending `requests` requests on one keep-alive
    connection, with `cycles` unload/load cycles of the model spread evenly among them."""
    path, body, headers = binary_request(model, inputs)
    pid = served.process.pid
    every = max(1, requests // max(1, cycles))
    samples = []
    conn = http.client.HTTPConnection(served.http, timeout=60)
    try:
        for i in range(requests):
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            assert response.status == 200, response.status
            if i % every == every - 1:
                assert unload(served, model)[0] == 200
                assert load(served, model)[0] == 200
            if i % 250 == 249:
                samples.append(rss_bytes(pid))
    finally:
        conn.close()
    return samples


def plateau_growth(samples: list[int]) -> float:
    """Growth over the second half of the run: the samples' max minus their mean, after dropping
    the 5% farthest from the median (a one-off spike is not a leak; a ramp is)."""
    second = np.array(samples[len(samples) // 2 :], dtype=np.float64)
    keep = max(1, int(round(len(second) * 0.95)))
    order = np.argsort(np.abs(second - np.median(second)))
    kept = second[order[:keep]]
    return float(kept.max() - kept.mean())


GROWTH_LIMIT = 4 << 20  # bytes of second-half growth a server without leaks stays under


def test_memory_plateaus_and_a_leaking_plugin_is_flagged(tmp_path, libraries):
    repo = example_repo(tmp_path, libraries)
    write_config(repo, "leaky", "")
    add_version(repo, "leaky", 1, libraries["leaky"])
    served = start_server(
        "--repository",
        str(repo),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "scale_add",
        "--load-model",
        "leaky",
    )
    try:
        x = np.arange(256, dtype=np.float32)
        healthy = growth_samples(served, "scale_add", {"a": x, "b": x}, requests=20_000, cycles=200)
        leaking = growth_samples(served, "leaky", {"x": x}, requests=20_000, cycles=200)
    finally:
        assert stop_server(served) == 0
    print("healthy RSS samples:", healthy)
    growth = plateau_growth(healthy)
    assert growth <= GROWTH_LIMIT, f"RSS grew {growth / 2**20:.1f} MiB over the second half: {healthy}"
    leaked = plateau_growth(leaking)
    assert leaked > GROWTH_LIMIT, f"the leaking plugin was not flagged ({leaked / 2**20:.1f} MiB): {leaking}"


def test_plateau_rule_ignores_spikes_and_catches_ramps():
    flat = [100 << 20] * 40
    flat[30] += 50 << 20  # one spike in the second half
    assert plateau_growth(flat) == 0
    ramp = [(100 << 20) + i * (1 << 20) for i in range(40)]
    assert plateau_growth(ramp) > GROWTH_LIMIT
    assert os.path.exists(f"/proc/{os.getpid()}/status")
