"""`opbridge serve` sessions: per-session pools with a byte quota, over HTTP and gRPC, with tritonclient.

Each test starts a server on free loopback ports and stops it by its PID.
"""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from test_serve import Served, get, grpc_inputs, http_inputs, start_server, stop_server

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")

QUOTA = 1 << 20  # 1 MiB per session pool


def sessions(served: Served, name: str | None = None) -> tuple[int, dict]:
    path = "/v2/sessions" + (f"/{name}" if name else "")
    status, body = get(f"http://{served.http}{path}")
    return status, json.loads(body)


def metric(served: Served, name: str, labels: str) -> float | None:
    _, text = get(f"http://{served.metrics}/metrics")
    series = f"{name}{{{labels}}}" if labels else name
    found = re.search(rf"^{re.escape(series)} (\S+)$", text.decode(), re.M)
    return float(found.group(1)) if found else None


@pytest.fixture()
def served():  # type: ignore[no-untyped-def]
    server = start_server("--session-quota", str(QUOTA), "--max-sessions", "40", "--session-idle-secs", "2")
    try:
        yield server
    finally:
        assert stop_server(server) == 0


def test_quota_is_enforced_per_session_and_the_session_stays_usable(served: Served) -> None:
    client = th.InferenceServerClient(served.http)
    small = np.ones(1000, np.float32)
    big = np.ones(200_000, np.float32)  # 800 KB per input: inputs and output need 2.4 MB
    result = client.infer("add", http_inputs({"a": small, "b": small}), parameters={"session_id": "alice"})
    assert np.array_equal(result.as_numpy("out"), small + small)
    with pytest.raises(InferenceServerException) as error:
        client.infer("add", http_inputs({"a": big, "b": big}), parameters={"session_id": "alice"})
    assert error.value.status() == "429"
    message = error.value.message()
    assert "session 'alice'" in message and f"quota {QUOTA} bytes" in message and "needs" in message, message
    # Still usable, and another session or no session is not affected.
    result = client.infer("add", http_inputs({"a": small, "b": small}), parameters={"session_id": "alice"})
    assert np.array_equal(result.as_numpy("out"), small + small)
    result = client.infer("add", http_inputs({"a": big, "b": big}))
    assert np.array_equal(result.as_numpy("out"), big + big)
    # gRPC: the same through metadata.
    grpc = tg.InferenceServerClient(served.grpc)
    try:
        with pytest.raises(InferenceServerException) as error:
            grpc.infer("add", grpc_inputs({"a": big, "b": big}), headers={"opbridge-session": "bob"})
        assert error.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "session 'bob'" in error.value.message()
        out = grpc.infer("add", grpc_inputs({"a": small, "b": small}), headers={"opbridge-session": "bob"})
        assert np.array_equal(out.as_numpy("out"), small + small)
    finally:
        grpc.close()
    status, alice = sessions(served, "alice")
    assert status == 200
    assert alice["requests"] == 3 and alice["used_bytes"] == 0 and 0 < alice["peak_bytes"] <= QUOTA
    assert alice["pools"][0]["model"] == "add" and alice["pools"][0]["quota_bytes"] == QUOTA
    assert metric(served, "opbridge_session_pool_bytes", 'session="alice",state="used"') == 0
    assert metric(served, "opbridge_session_quota_bytes", 'session="bob"') == QUOTA
    assert 'reason="REJECTED"' in get(f"http://{served.metrics}/metrics")[1].decode()


def test_bad_session_names_and_conflicts_are_400(served: Served) -> None:
    client = th.InferenceServerClient(served.http)
    a = np.ones(4, np.float32)
    for params, headers in [
        ({"session_id": "has space"}, None),
        ({"session_id": "x"}, {"opbridge-session": "y"}),
        ({"session_id": 7}, None),
    ]:
        with pytest.raises(InferenceServerException) as error:
            client.infer("add", http_inputs({"a": a, "b": a}), parameters=params, headers=headers)
        assert error.value.status() == "400", (params, error.value.message())
    assert sessions(served, "nobody")[0] == 404
    assert sessions(served, "bad%20name")[0] == 400


def test_many_sessions_concurrently_keep_the_invariants_then_expire(served: Served) -> None:
    names = [f"user-{k}" for k in range(32)]
    errors: list[str] = []
    rng = np.random.default_rng(7)
    arrays = [rng.random(int(n), dtype=np.float32) for n in rng.integers(1, 60_000, 16)]

    def client_loop(worker: int) -> None:
        client = tg.InferenceServerClient(served.grpc)
        try:
            for k in range(40):
                name = names[(worker * 40 + k) % len(names)]
                a = arrays[(worker + k) % len(arrays)]
                try:
                    out = client.infer("add", grpc_inputs({"a": a, "b": a}), headers={"opbridge-session": name})
                    if not np.array_equal(out.as_numpy("out"), a + a):
                        errors.append(f"{name}: wrong result")
                except InferenceServerException as error:
                    if error.status() != "StatusCode.RESOURCE_EXHAUSTED":
                        errors.append(f"{name}: {error.message()}")
                _, listing = sessions(served)
                for session in listing["sessions"]:
                    for pool in session["pools"]:
                        if pool["used_bytes"] > pool["quota_bytes"]:
                            errors.append(f"{session['id']} over quota: {pool}")
        finally:
            client.close()

    threads = [threading.Thread(target=client_loop, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:5]
    _, listing = sessions(served)
    assert {s["id"] for s in listing["sessions"]} == set(names)
    assert all(s["used_bytes"] == 0 and s["in_flight"] == 0 for s in listing["sessions"])
    # Idle for --session-idle-secs: every session is released.
    deadline = time.monotonic() + 10
    while sessions(served)[1]["sessions"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sessions(served)[1]["sessions"] == []
    assert metric(served, "opbridge_session_pool_bytes", 'session="user-0",state="used"') is None
    assert metric(served, "opbridge_sessions", "") == 0


def test_too_many_sessions_is_503() -> None:
    served = start_server("--max-sessions", "2", "--session-idle-secs", "60")
    try:
        client = th.InferenceServerClient(served.http)
        a = np.ones(4, np.float32)
        for name in ("one", "two"):
            client.infer("add", http_inputs({"a": a, "b": a}), parameters={"session_id": name})
        with pytest.raises(InferenceServerException) as error:
            client.infer("add", http_inputs({"a": a, "b": a}), parameters={"session_id": "three"})
        assert error.value.status() == "503" and "--max-sessions 2" in error.value.message()
        client.infer("add", http_inputs({"a": a, "b": a}), parameters={"session_id": "one"})
    finally:
        assert stop_server(served) == 0
