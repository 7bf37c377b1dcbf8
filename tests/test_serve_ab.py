"""`opbridge serve` A/B routing: `[ab] weights` share unversioned requests between model versions.

Every test serves scale_add v1 (out = a * alpha + b) and v2 (out = a * alpha + b * beta, and only
v2 takes `beta`) from a temporary repository, over real loopback sockets with stock tritonclient,
and stops the server by its PID.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from test_serve import Served, start_server, stop_server
from test_serve_repository import add_version, call, wait_for, write_config

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")

A = np.arange(4, dtype=np.float32)
B = np.full(4, 3.0, dtype=np.float32)
BOTH = 'version_policy = "all"\n'


def ab_repo(tmp_path: Path, libraries: dict[str, Path], weights: dict[str, int] | None) -> Path:
    repo = tmp_path / "models"
    text = BOTH
    if weights is not None:
        text += "[ab]\nweights = { " + ", ".join(f'"{v}" = {w}' for v, w in weights.items()) + " }\n"
    write_config(repo, "scale_add", text)
    for version in (1, 2):
        add_version(repo, "scale_add", version, libraries[f"scale_add_{version}"])
    return repo


def serve(repo: Path, *flags: str) -> Served:
    return start_server("--repository", str(repo), "--no-builtins", *flags)


def http_infer(
    client: th.InferenceServerClient,
    version: str = "",
    headers: dict[str, str] | None = None,
    **params: object,
) -> th.InferResult:
    inputs = []
    for name, value in (("a", A), ("b", B)):
        tensor = th.InferInput(name, list(value.shape), "FP32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return client.infer("scale_add", inputs, model_version=version, parameters=params or None, headers=headers)


def grpc_infer(
    client: tg.InferenceServerClient,
    version: str = "",
    headers: dict[str, str] | None = None,
    **params: object,
) -> tg.InferResult:
    inputs = []
    for name, value in (("a", A), ("b", B)):
        tensor = tg.InferInput(name, list(value.shape), "FP32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return client.infer("scale_add", inputs, model_version=version, parameters=params or None, headers=headers)


def served_version(result: th.InferResult | tg.InferResult) -> str:
    response = result.get_response()
    return response["model_version"] if isinstance(response, dict) else response.model_version


def routed_metric(served: Served) -> dict[str, int]:
    with urllib.request.urlopen(f"http://{served.metrics}/metrics", timeout=30) as response:
        text = response.read().decode()
    found = re.findall(r'^opbridge_ab_routed_total\{model="scale_add",version="(\d+)"\} (\d+)$', text, re.M)
    return {version: int(count) for version, count in found}


def grpc_traffic(served: Served, requests: int, threads: int = 4, **params: object) -> Counter[str]:
    """`requests` unversioned gRPC infers over `threads` clients: how many each version served."""
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        client = tg.InferenceServerClient(served.grpc)
        local: Counter[str] = Counter()
        try:
            for _ in range(n):
                local[served_version(grpc_infer(client, **params))] += 1
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)
        finally:
            client.close()
            with lock:
                counts.update(local)

    pool = [threading.Thread(target=worker, args=(requests // threads,)) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert not errors, errors[:3]
    return counts


def share(counts: Counter[str], version: str) -> float:
    return counts[version] / sum(counts.values())


# --- proportions, the metric, explicit versions ---------------------------------------------------


def test_ten_thousand_requests_follow_90_10_and_the_metric_counts_them(tmp_path, libraries):
    served = serve(ab_repo(tmp_path, libraries, {"1": 90, "2": 10}))
    try:
        counts = grpc_traffic(served, 10_000)
        assert sum(counts.values()) == 10_000
        assert abs(share(counts, "2") - 0.10) <= 0.02, counts
        assert routed_metric(served) == {"1": counts["1"], "2": counts["2"]}
        # HTTP routes the same way (fewer requests: a wider, still many-sigma, bound).
        client = th.InferenceServerClient(served.http)
        http_counts = Counter(served_version(http_infer(client)) for _ in range(2_000))
        assert abs(share(http_counts, "2") - 0.10) <= 0.03, http_counts
        before = routed_metric(served)
        assert before == {"1": counts["1"] + http_counts["1"], "2": counts["2"] + http_counts["2"]}
        # Requests naming a version are served by it and are not routed (not in the metric).
        grpc = tg.InferenceServerClient(served.grpc)
        for _ in range(5):
            assert served_version(http_infer(client, version="2")) == "2"
            assert served_version(grpc_infer(grpc, version="1")) == "1"
        assert routed_metric(served) == before
        grpc.close()
        client.close()
    finally:
        assert stop_server(served) == 0


def test_weight_zero_gets_no_unpinned_traffic_but_serves_its_explicit_version(tmp_path, libraries):
    served = serve(ab_repo(tmp_path, libraries, {"1": 0, "2": 100}))
    try:
        http = th.InferenceServerClient(served.http)
        grpc = tg.InferenceServerClient(served.grpc)
        assert {served_version(http_infer(http)) for _ in range(200)} == {"2"}
        assert {served_version(grpc_infer(grpc, ab_key=f"user-{i}")) for i in range(200)} == {"2"}
        v1 = http_infer(http, version="1", alpha=2.0)
        assert served_version(v1) == "1"
        np.testing.assert_array_equal(v1.as_numpy("out"), A * 2 + B)
        assert served_version(grpc_infer(grpc, version="1")) == "1"
        assert routed_metric(served) == {"1": 0, "2": 400}
        http.close()
        grpc.close()
    finally:
        assert stop_server(served) == 0


def test_models_without_weights_have_no_ab_metric_and_serve_the_latest(tmp_path, libraries):
    served = serve(ab_repo(tmp_path, libraries, None))
    try:
        http = th.InferenceServerClient(served.http)
        assert {served_version(http_infer(http, ab_key=f"k{i}")) for i in range(50)} == {"2"}
        assert routed_metric(served) == {}
        http.close()
    finally:
        assert stop_server(served) == 0


# --- sticky keys ----------------------------------------------------------------------------------


def test_keys_pin_one_version_and_the_response_says_which_computed(tmp_path, libraries):
    served = serve(ab_repo(tmp_path, libraries, {"1": 50, "2": 50}))
    try:
        http = th.InferenceServerClient(served.http)
        grpc = tg.InferenceServerClient(served.grpc)
        ways = {
            "http ab_key": lambda key, **p: http_infer(http, ab_key=key, **p),
            "http session_id": lambda key, **p: http_infer(http, session_id=key, **p),
            "http header": lambda key, **p: http_infer(http, headers={"opbridge-session": key}, **p),
            "grpc ab_key": lambda key, **p: grpc_infer(grpc, ab_key=key, **p),
            "grpc session_id": lambda key, **p: grpc_infer(grpc, session_id=key, **p),
            "grpc metadata": lambda key, **p: grpc_infer(grpc, headers={"opbridge-session": key}, **p),
        }
        keys = [f"user-{i}" for i in range(40)]
        pinned: dict[str, str] = {}
        for way, infer in ways.items():
            for key in keys:
                seen = {served_version(infer(key)) for _ in range(5)}
                assert len(seen) == 1, (way, key, seen)
                # One key, one version, whichever way it travels (one hash of the same bytes).
                assert pinned.setdefault(key, seen.pop()) == served_version(infer(key)), (way, key)
        spread = Counter(pinned.values())
        assert spread["1"] >= 8 and spread["2"] >= 8, spread
        # ab_key wins over session_id, and a parameter over the header.
        k1 = next(k for k in keys if pinned[k] == "1")
        k2 = next(k for k in keys if pinned[k] == "2")
        assert served_version(http_infer(http, ab_key=k1, session_id=k2)) == "1"
        assert served_version(grpc_infer(grpc, ab_key=k2, session_id=k1)) == "2"
        # Two different session names (parameter and header) are a client mistake: the session
        # feature refuses them before anything runs.
        with pytest.raises(InferenceServerException) as conflict:
            http_infer(http, session_id=k1, headers={"opbridge-session": k2})
        assert conflict.value.status() == "400" and "two sessions" in conflict.value.message()
        assert served_version(grpc_infer(grpc, ab_key=k2, headers={"opbridge-session": k1})) == "2"
        # What computed the result is the version the response names: with beta = 2, v2 gives
        # a + 2b, and v1 (which has no beta) refuses the parameter.
        for key in keys[:10]:
            for infer in (ways["http ab_key"], ways["grpc ab_key"]):
                if pinned[key] == "2":
                    result = infer(key, beta=2.0)
                    assert served_version(result) == "2"
                    np.testing.assert_array_equal(result.as_numpy("out"), A + 2 * B)
                else:
                    result = infer(key, alpha=3.0)
                    assert served_version(result) == "1"
                    np.testing.assert_array_equal(result.as_numpy("out"), A * 3 + B)
                    with pytest.raises(InferenceServerException, match="beta"):
                        infer(key, beta=2.0)
        http.close()
        grpc.close()
    finally:
        assert stop_server(served) == 0


# --- changing weights at run time -----------------------------------------------------------------


def test_weight_change_through_the_load_api_under_traffic_drops_nothing(tmp_path, libraries):
    repo = ab_repo(tmp_path, libraries, {"1": 90, "2": 10})
    served = serve(repo, "--model-control-mode", "explicit", "--load-model", "scale_add")
    stop = threading.Event()
    results: list[str] = []
    errors: list[BaseException] = []

    def traffic(protocol: str) -> None:
        client = (th if protocol == "http" else tg).InferenceServerClient(
            served.http if protocol == "http" else served.grpc
        )
        infer = http_infer if protocol == "http" else grpc_infer
        try:
            while not stop.is_set():
                results.append(served_version(infer(client)))
        except BaseException as error:
            errors.append(error)
        finally:
            client.close()

    threads = [threading.Thread(target=traffic, args=(p,)) for p in ("http", "http", "grpc", "grpc")]
    try:
        for thread in threads:
            thread.start()
        http = th.InferenceServerClient(served.http)
        grpc = tg.InferenceServerClient(served.grpc)
        for weights in ({"1": 10, "2": 90}, {"1": 90, "2": 10}, {"1": 10, "2": 90}):
            time.sleep(0.3)
            config = json.dumps({"version_policy": "all", "ab": {"weights": weights}})
            http.load_model("scale_add", config=config)
            time.sleep(0.3)
            grpc.load_model("scale_add", config=config)
        stop.set()
        for thread in threads:
            thread.join()
        assert not errors, errors[:3]
        assert len(results) > 100
        # After the change, the split follows the new weights (and the config shows them).
        counts = grpc_traffic(served, 2_000)
        assert abs(share(counts, "2") - 0.90) <= 0.04, counts
        parameters = http.get_model_config("scale_add")["parameters"]
        assert parameters["ab.weights.2"] == {"string_value": "90"}, parameters
        assert grpc.get_model_config("scale_add").config.parameters["ab.weights.1"].string_value == "10"
        # A load without a config reads config.toml again (the override was for that load).
        http.load_model("scale_add")
        counts = grpc_traffic(served, 2_000)
        assert abs(share(counts, "2") - 0.10) <= 0.04, counts
        http.close()
        grpc.close()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        assert stop_server(served) == 0


# --- versions going away --------------------------------------------------------------------------


def test_removing_a_weighted_version_redistributes_its_share(tmp_path, libraries):
    repo = ab_repo(tmp_path, libraries, {"1": 50, "2": 50})
    served = serve(repo, "--model-control-mode", "poll", "--repository-poll-secs", "1")
    try:
        http = th.InferenceServerClient(served.http)
        counts = Counter(served_version(http_infer(http)) for _ in range(400))
        assert counts["1"] > 100 and counts["2"] > 100, counts
        shutil.rmtree(repo / "scale_add" / "1")
        assert wait_for(lambda: not http.is_model_ready("scale_add", "1"))
        assert {served_version(http_infer(http, ab_key=f"user-{i}")) for i in range(100)} == {"2"}
        assert set(routed_metric(served)) == {"2"}, "series only for loaded versions"
        http.close()
    finally:
        assert stop_server(served) == 0


def test_a_policy_dropping_weighted_versions_falls_back_to_the_latest(tmp_path, libraries):
    served = serve(ab_repo(tmp_path, libraries, {"1": 100, "2": 0}), "--model-control-mode", "explicit")
    try:
        http = th.InferenceServerClient(served.http)
        grpc = tg.InferenceServerClient(served.grpc)
        http.load_model("scale_add")
        assert {served_version(grpc_infer(grpc)) for _ in range(50)} == {"1"}
        # Version 1 was served, so a policy that drops it moves its share: version 2 weighs 0,
        # so the latest loaded version (2) takes everything.
        grpc.load_model(
            "scale_add", config=json.dumps({"version_policy": {"latest": 1}, "ab": {"weights": {"1": 100, "2": 0}}})
        )
        assert {served_version(http_infer(http)) for _ in range(50)} == {"2"}
        assert {served_version(grpc_infer(grpc, ab_key=f"k{i}")) for i in range(50)} == {"2"}
        http.close()
        grpc.close()
    finally:
        assert stop_server(served) == 0


# --- bad weights ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ({"version_policy": "all", "ab": {"weights": {"1": -1, "2": 10}}}, 'ab.weights."1"'),
        ({"version_policy": "all", "ab": {"weights": {"1": 0, "2": 0}}}, "at least one positive"),
        ({"version_policy": "all", "ab": {"weights": {"v1": 10}}}, "'ab.weights' key \"v1\""),
        ({"version_policy": "all", "ab": {"weights": {"1": 2.5}}}, 'ab.weights."1"'),
        ({"version_policy": "all", "ab": {"weights": {"3": 10}}}, "names version 3"),
        ({"version_policy": "all", "ab": {"weight": {"1": 10}}}, "unknown key 'weight' in [ab]"),
        ({"version_policy": "all", "ab": 5}, "[ab] must be a table"),
    ],
)
def test_bad_weights_are_clear_load_errors(tmp_path, libraries, config, names):
    served = serve(
        ab_repo(tmp_path, libraries, {"1": 90, "2": 10}),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "scale_add",
    )
    try:
        status, body = call(
            served, "POST", "/v2/repository/models/scale_add/load", {"parameters": {"config": json.dumps(config)}}
        )
        assert status == 400, body
        assert isinstance(body, dict) and names in body["error"], body
        grpc = tg.InferenceServerClient(served.grpc)
        with pytest.raises(InferenceServerException, match=re.escape(names)) as error:
            grpc.load_model("scale_add", config=json.dumps(config))
        assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
        # The failed load left the old weights serving.
        assert routed_metric(served) == {"1": 0, "2": 0}
        assert served_version(grpc_infer(grpc, version="2")) == "2"
        grpc.close()
    finally:
        assert stop_server(served) == 0


def test_bad_config_parameters_and_config_files(tmp_path, libraries):
    repo = ab_repo(tmp_path, libraries, {"1": 90, "3": 10})
    served = serve(repo, "--model-control-mode", "explicit")
    try:
        status, body = call(served, "POST", "/v2/repository/models/scale_add/load", {})
        assert status == 400 and "names version 3" in body["error"], body
        write_config(repo, "scale_add", BOTH + '[ab]\nweights = { "1" = "ninety" }\n')
        status, body = call(served, "POST", "/v2/repository/models/scale_add/load", {})
        assert status == 400 and 'ab.weights."1"' in body["error"] and "config.toml" in body["error"], body
        for parameters, says in [
            ({"config": "{not json"}, "parameter 'config': not JSON"),
            ({"config": "[1, 2]"}, "must be a JSON object"),
            ({"config": {"ab": {}}}, "must be a string"),
        ]:
            status, body = call(served, "POST", "/v2/repository/models/scale_add/load", {"parameters": parameters})
            assert status == 400 and says in body["error"], (parameters, body)
        status, body = call(
            served, "POST", "/v2/repository/models/scale_add/load", {"parameters": {"file:1/x.so": "AA=="}}
        )
        assert status == 501, body
        # A good config over the API loads although config.toml is broken: it replaces the file.
        config = json.dumps({"version_policy": "all", "ab": {"weights": {"2": 1}}})
        status, body = call(served, "POST", "/v2/repository/models/scale_add/load", {"parameters": {"config": config}})
        assert status == 200, body
        http = th.InferenceServerClient(served.http)
        assert {served_version(http_infer(http)) for _ in range(20)} == {"2"}
        http.close()
    finally:
        assert stop_server(served) == 0
