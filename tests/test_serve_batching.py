"""`opbridge serve` dynamic batching: `[dynamic_batching]` merges queued requests along axis 0.

Alias models of built-in operators with `[dynamic_batching]`, served from a temporary repository
over real loopback sockets with stock tritonclient; the server is stopped by its PID. Results
must equal the operator called alone (in process) bit for bit, whatever got merged with what.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

import opbridge as ob
from test_serve import Served, get, pending_requests, start_server, stop_server, wait_for
from test_serve_repository import call, index, load, write_config

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")

DTYPES = {"FP32": np.float32, "FP64": np.float64}


def serve_batching(tmp_path: Path, delay_us: int, *args: str, preferred: list[int] | None = None) -> Served:
    """A server of `batching_repo` only (no built-ins), with `args` added."""
    return start_server("--repository", str(batching_repo(tmp_path, delay_us, preferred)), "--no-builtins", *args)


def batching_repo(tmp_path: Path, delay_us: int, preferred: list[int] | None = None) -> Path:
    repo = tmp_path / "models"
    batching = f"[dynamic_batching]\nmax_queue_delay_us = {delay_us}\nmax_batch_size = 64\n"
    if preferred:
        batching += f"preferred_batch_size = {preferred}\n"
    for model, op in [
        ("add_b", "add"),
        ("pow_b", "pow"),
        ("softmax_b", "softmax"),
        ("layer_norm_b", "layer_norm"),
    ]:
        write_config(repo, model, f'[alias]\nop = "{op}"\n{batching}')
    return repo


def infer(
    served: Served,
    protocol: str,
    model: str,
    inputs: dict[str, np.ndarray],
    session: str | None = None,
) -> np.ndarray:
    """One request on a fresh client; the output `out`."""
    params = {"session_id": session} if session else None
    module = th if protocol == "http" else tg
    address = served.http if protocol == "http" else served.grpc
    client = module.InferenceServerClient(address)
    try:
        tensors = []
        for name, value in inputs.items():
            datatype = "INT32" if value.dtype == np.int32 else ("FP64" if value.dtype == np.float64 else "FP32")
            tensor = module.InferInput(name, list(value.shape), datatype)
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        return client.infer(model, tensors, parameters=params).as_numpy("out")
    finally:
        client.close()


def stats(served: Served, model: str) -> dict:
    status, body = call(served, "GET", f"/v2/models/{model}/stats")
    assert status == 200, body
    return body["model_stats"][0]


def run_threads(count: int, target) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    return errors


def random_request(rng: np.random.Generator) -> tuple[str, dict[str, np.ndarray], bytes]:
    """A random request to one of the batching models, and the in-process result's bytes."""
    rows = int(rng.integers(1, 5))
    width = int(rng.choice([3, 8]))
    dtype = DTYPES[str(rng.choice(list(DTYPES)))]
    x = rng.standard_normal((rows, width)).astype(dtype)
    kind = int(rng.integers(0, 6))
    if kind == 0:
        y = rng.standard_normal((rows, width)).astype(dtype)
        return "add_b", {"a": x, "b": y}, ob.ops.add(x, y).tobytes()
    if kind == 1:
        # Broadcasting: never merged, still right.
        y = rng.standard_normal(width).astype(dtype)
        return "add_b", {"a": x, "b": y}, ob.ops.add(x, y).tobytes()
    if kind == 2:
        return "softmax_b", {"x": x}, ob.ops.softmax(x, axis=-1).tobytes()
    if kind == 3:
        # Rows long enough for the kernels' vectorized paths.
        wide = rng.standard_normal((rows, 700)).astype(dtype)
        return "softmax_b", {"x": wide}, ob.ops.softmax(wide, axis=-1).tobytes()
    if kind == 4:
        w = np.linspace(0.5, 1.5, width).astype(dtype)
        return "layer_norm_b", {"x": x, "weight": w, "bias": w}, ob.ops.layer_norm(x, w, w).tobytes()
    y = np.abs(rng.standard_normal((rows, width))).astype(dtype)
    return "pow_b", {"a": np.abs(x), "b": y}, ob.ops.pow(np.abs(x), y).tobytes()


def test_random_interleavings_equal_the_calls_alone_bit_for_bit(tmp_path):
    served = serve_batching(tmp_path, delay_us=5000)
    try:
        results: list[tuple[str, bool]] = []

        def client(i: int) -> None:
            rng = np.random.default_rng(100 + i)
            for k in range(30):
                model, inputs, expected = random_request(rng)
                protocol = "http" if (i + k) % 2 else "grpc"
                session = f"user-{(i + k) % 4}" if k % 3 == 0 else None
                got = infer(served, protocol, model, inputs, session)
                results.append((model, got.tobytes() == expected))

        assert run_threads(8, client) == []
        wrong = [model for model, same in results if not same]
        assert len(results) == 240 and wrong == []
        # Something was merged: some execution ran more rows than one request has (at most 4).
        merged = [
            b
            for model in ("add_b", "softmax_b", "layer_norm_b", "pow_b")
            for b in stats(served, model)["batch_stats"]
            if b["batch_size"] > 4
        ]
        assert merged, "no request was batched"
        # Sessions got every byte back.
        status, sessions = call(served, "GET", "/v2/sessions")
        assert status == 200
        assert all(s["used_bytes"] == 0 for s in sessions["sessions"]), sessions
    finally:
        stop_server(served)


def concurrent_rows(served: Served, model: str, requests: list[dict[str, np.ndarray]]) -> list[object]:
    """Sends `requests` at once (HTTP and gRPC alternately); each one's output or exception."""
    answers: list[object] = [None] * len(requests)

    def send(i: int) -> None:
        try:
            answers[i] = infer(served, "http" if i % 2 else "grpc", model, requests[i])
        except InferenceServerException as error:
            answers[i] = error

    assert run_threads(len(requests), send) == []
    return answers


def test_a_batch_shows_in_statistics_metrics_and_config(tmp_path):
    # A long delay and a preferred size of all eight rows: the eight requests make one batch
    # as soon as the last arrives.
    served = serve_batching(tmp_path, delay_us=3_000_000, preferred=[8])
    try:
        rng = np.random.default_rng(7)
        requests = [{"a": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(8)]
        for request in requests:
            request["b"] = rng.standard_normal((1, 4)).astype(np.float32)
        answers = concurrent_rows(served, "add_b", requests)
        for request, answer in zip(requests, answers, strict=True):
            assert isinstance(answer, np.ndarray), answer
            assert answer.tobytes() == ob.ops.add(request["a"], request["b"]).tobytes()

        s = stats(served, "add_b")
        assert s["inference_count"] == 8
        assert s["execution_count"] < 8
        assert sum(b["compute_infer"]["count"] for b in s["batch_stats"]) == s["execution_count"]
        assert max(b["batch_size"] for b in s["batch_stats"]) >= 2
        assert s["inference_stats"]["success"]["count"] == 8

        grpc = tg.InferenceServerClient(served.grpc)
        try:
            g = grpc.get_inference_statistics("add_b").model_stats[0]
            assert g.execution_count == s["execution_count"]
            assert [b.batch_size for b in g.batch_stats] == [b["batch_size"] for b in s["batch_stats"]]
            config = grpc.get_model_config("add_b").config
            assert config.max_batch_size == 64
            assert list(config.dynamic_batching.preferred_batch_size) == [8]
            assert config.dynamic_batching.max_queue_delay_microseconds == 3_000_000
        finally:
            grpc.close()
        status, config = call(served, "GET", "/v2/models/add_b/config")
        assert status == 200
        assert config["max_batch_size"] == 64
        assert config["dynamic_batching"] == {"preferred_batch_size": [8], "max_queue_delay_microseconds": 3_000_000}
        status, plain = call(served, "GET", "/v2/models/softmax_b/config")
        assert status == 200 and plain["max_batch_size"] == 64

        status, text = get(f"http://{served.metrics}/metrics")
        assert status == 200
        metrics = text.decode()
        count = re.search(r'nv_inference_count\{model="add_b",version="1"\} (\d+)', metrics)
        executions = re.search(r'nv_inference_exec_count\{model="add_b",version="1"\} (\d+)', metrics)
        assert count and executions, metrics
        assert int(count.group(1)) == 8 and int(executions.group(1)) == s["execution_count"]
    finally:
        stop_server(served)


def test_a_bad_request_in_a_batch_fails_alone(tmp_path):
    served = serve_batching(tmp_path, delay_us=3_000_000, preferred=[8])
    try:
        # Integer powers: a negative exponent is the kernel's error, found only when it runs.
        # The merged call fails, and its requests run again alone: only the bad one fails.
        base = np.array([[2, 3]], dtype=np.int32)
        requests = [{"a": base, "b": np.array([[k % 3, 1]], dtype=np.int32)} for k in range(7)]
        requests.insert(3, {"a": base, "b": np.array([[-1, 1]], dtype=np.int32)})
        answers = concurrent_rows(served, "pow_b", requests)
        for k, (request, answer) in enumerate(zip(requests, answers, strict=True)):
            if k == 3:
                assert isinstance(answer, InferenceServerException), answer
                assert "negative" in str(answer).lower(), answer
            else:
                assert isinstance(answer, np.ndarray), answer
                assert answer.tobytes() == ob.ops.pow(request["a"], request["b"]).tobytes()
        s = stats(served, "pow_b")
        assert s["inference_stats"]["fail"]["count"] == 1
        assert s["inference_stats"]["success"]["count"] == 7
    finally:
        stop_server(served)


def test_requests_failing_their_checks_are_answered_while_others_batch(tmp_path):
    served = serve_batching(tmp_path, delay_us=3_000_000, preferred=[6])
    try:
        good = [{"x": np.full((2, 3), k, dtype=np.float32)} for k in range(3)]
        bad = [{"y": np.ones((2, 3), dtype=np.float32)}]  # no input 'y': a 400 at once
        answers = concurrent_rows(served, "softmax_b", good + bad)
        for request, answer in zip(good, answers[:-1], strict=True):
            assert isinstance(answer, np.ndarray), answer
            assert answer.tobytes() == ob.ops.softmax(request["x"], axis=-1).tobytes()
        assert isinstance(answers[-1], InferenceServerException)
        assert "unexpected inference input 'y'" in str(answers[-1])
    finally:
        stop_server(served)


def test_batching_an_operator_that_cannot_batch_is_a_load_error(tmp_path):
    repo = tmp_path / "models"
    write_config(repo, "transpose_b", '[alias]\nop = "transpose"\n[dynamic_batching]\nmax_queue_delay_us = 100\n')
    write_config(repo, "bad_delay", '[alias]\nop = "add"\n[dynamic_batching]\nmax_queue_delay_us = -5\n')
    served = start_server("--repository", str(repo), "--no-builtins")
    try:
        models = index(served)
        assert models[("transpose_b", "")]["state"] == "UNAVAILABLE"
        assert "cannot be batched" in models[("transpose_b", "")]["reason"]
        assert "'dynamic_batching.max_queue_delay_us'" in models[("bad_delay", "")]["reason"]
    finally:
        stop_server(served)


def test_session_quotas_hold_inside_batches(tmp_path):
    served = serve_batching(tmp_path, 3_000_000, "--session-quota", "65536", preferred=[6])
    try:
        small = np.ones((2, 8), dtype=np.float32)
        large = np.ones((2, 8192), dtype=np.float32)  # 64 KiB per input: over the quota
        answers: list[object] = [None] * 4

        def send(i: int) -> None:
            x = large if i == 0 else small
            try:
                answers[i] = infer(served, "grpc" if i % 2 else "http", "softmax_b", {"x": x}, session=f"s{i}")
            except InferenceServerException as error:
                answers[i] = error

        assert run_threads(4, send) == []
        assert isinstance(answers[0], InferenceServerException)
        assert "quota" in str(answers[0]).lower()
        for answer in answers[1:]:
            assert isinstance(answer, np.ndarray)
            assert answer.tobytes() == ob.ops.softmax(small, axis=-1).tobytes()
    finally:
        stop_server(served)


def test_shutdown_answers_a_waiting_batch_without_sitting_out_the_delay(tmp_path):
    served = serve_batching(tmp_path, delay_us=60_000_000)
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    answers: list[object] = []

    def send(_: int) -> None:
        answers.append(infer(served, "http", "add_b", {"a": a, "b": a}))

    thread = threading.Thread(target=send, args=(0,))
    thread.start()
    try:
        # The request waits in its batch (for up to a minute) ...
        time.sleep(1.5)
        assert answers == [] and thread.is_alive()
        # ... and SIGTERM answers it at once, then exits.
        started = time.monotonic()
        assert stop_server(served) == 0
        assert time.monotonic() - started < 10
    finally:
        thread.join(timeout=30)
    assert len(answers) == 1 and isinstance(answers[0], np.ndarray)
    assert answers[0].tobytes() == (a + a).tobytes()


def test_attributes_merge_only_when_equal_bit_for_bit(tmp_path):
    # alpha 0.0 and -0.0 compare equal, but give different signed zeros: never one batch.
    repo = tmp_path / "models"
    write_config(
        repo,
        "axpy_b",
        '[alias]\nop = "axpy"\n[dynamic_batching]\nmax_queue_delay_us = 3000000\nmax_batch_size = 64\n'
        "preferred_batch_size = [8]\n",
    )
    served = start_server("--repository", str(repo), "--no-builtins")
    x = np.ones((1, 4), dtype=np.float32)
    y = np.full((1, 4), -0.0, dtype=np.float32)
    answers: list[object] = [None] * 8

    def send(i: int) -> None:
        alpha = 0.0 if i % 2 else -0.0
        module = th if i % 4 < 2 else tg
        client = module.InferenceServerClient(served.http if module is th else served.grpc)
        try:
            tensors = []
            for name, value in (("x", x), ("y", y)):
                tensor = module.InferInput(name, list(value.shape), "FP32")
                tensor.set_data_from_numpy(value)
                tensors.append(tensor)
            answers[i] = (alpha, client.infer("axpy_b", tensors, parameters={"alpha": alpha}).as_numpy("out"))
        finally:
            client.close()

    try:
        assert run_threads(8, send) == []
        for alpha, got in answers:  # type: ignore[misc]
            assert got.tobytes() == ob.ops.axpy(x, y, alpha=alpha).tobytes(), alpha
        assert {np.signbit(got[0, 0]) for _, got in answers} == {True, False}  # type: ignore[misc]
    finally:
        stop_server(served)


def test_the_queue_bound_counts_requests_a_gathering_batch_holds(tmp_path):
    # One worker gathers a batch for up to 3 s around the first request: the request it holds
    # is pending and counts against max_queue_size = 4, and a full queue ends the gathering at
    # once (requests beyond the bound meanwhile: 503 at once).
    repo = tmp_path / "models"
    write_config(
        repo,
        "add_q",
        'max_queue_size = 4\n[alias]\nop = "add"\n[dynamic_batching]\nmax_queue_delay_us = 3000000\n'
        "max_batch_size = 64\n",
    )
    served = start_server("--repository", str(repo), "--no-builtins", "--workers-per-model", "1")
    answers: list[object] = [None] * 6
    timings: list[float] = [0.0] * 6

    def send(i: int) -> None:
        # The first: one row of 4, which the worker takes and waits with; then rows of 8,
        # which do not fit its group.
        a = np.full((1, 4 if i == 0 else 8), i, dtype=np.float32)
        started = time.monotonic()
        try:
            answers[i] = infer(served, "http", "add_q", {"a": a, "b": a})
        except InferenceServerException as error:
            answers[i] = error
        timings[i] = time.monotonic() - started

    first = threading.Thread(target=send, args=(0,))
    first.start()
    try:
        assert wait_for(lambda: pending_requests(served, "add_q") == 1)
        rest = [threading.Thread(target=send, args=(i,)) for i in range(1, 6)]
        for thread in rest:
            thread.start()
        for thread in [first, *rest]:
            thread.join(timeout=30)
        refused = [i for i, a in enumerate(answers) if isinstance(a, InferenceServerException)]
        assert len(refused) <= 2, answers
        for i in refused:
            assert "exceeds maximum queue size" in str(answers[i]), answers[i]
        for i, answer in enumerate(answers):
            if i not in refused:
                assert isinstance(answer, np.ndarray) and np.all(answer == 2 * i), answer
        # The full queue ended the first request's gathering (it did not sit out its 3 s), and
        # refusals are at once. (A request left over starts a batch of its own, which waits.)
        assert timings[0] < 2.5 and all(timings[i] < 1.0 for i in refused), timings
        assert pending_requests(served, "add_q") == 0
    finally:
        stop_server(served)


def test_requests_run_alone_count_their_rows(tmp_path):
    # Over max_batch_size (4 here): run alone, still counted as its 6 rows, as Triton does.
    repo = tmp_path / "models"
    write_config(
        repo, "add_s", '[alias]\nop = "add"\n[dynamic_batching]\nmax_queue_delay_us = 100\nmax_batch_size = 4\n'
    )
    served = start_server("--repository", str(repo), "--no-builtins")
    try:
        a = np.ones((6, 3), dtype=np.float32)
        assert infer(served, "grpc", "add_s", {"a": a, "b": a}).tobytes() == (a + a).tobytes()
        s = stats(served, "add_s")
        assert s["inference_count"] == 6 and s["execution_count"] == 1
        assert [b["batch_size"] for b in s["batch_stats"]] == [6]
    finally:
        stop_server(served)


def test_a_merged_call_allocates_from_its_sessions_pool(tmp_path):
    # Eight requests of one session merge into one call: its inputs and outputs are the
    # session's memory (its peak shows them), and requests of other sessions never join it.
    served = serve_batching(tmp_path, 3_000_000, "--session-quota", str(8 << 20), preferred=[8])
    x = np.random.default_rng(3).standard_normal((1, 16384)).astype(np.float32)  # 64 KiB
    try:
        answers: list[object] = [None] * 8

        def send(i: int) -> None:
            answers[i] = infer(served, "grpc" if i % 2 else "http", "softmax_b", {"x": x}, session="one")

        assert run_threads(8, send) == []
        expected = ob.ops.softmax(x, axis=-1).tobytes()
        assert all(a.tobytes() == expected for a in answers)  # type: ignore[union-attr]
        assert max(b["batch_size"] for b in stats(served, "softmax_b")["batch_stats"]) == 8
        status, session = call(served, "GET", "/v2/sessions/one")
        assert status == 200, session
        (pool,) = session["pools"]
        # The merged call's 8 rows (its input, then its output) beside the answers' own rows:
        # twice what the answers alone hold.
        assert pool["peak_bytes"] >= 2 * 8 * x.nbytes, pool
        assert session["peak_bytes"] >= pool["peak_bytes"], session
        assert pool["used_bytes"] == 0
    finally:
        stop_server(served)


def test_a_reload_answers_the_replaced_versions_waiting_batch(tmp_path):
    # No request reaches a replaced version again: its gathering batch runs now, not after the
    # 30 s delay.
    repo = batching_repo(tmp_path, delay_us=30_000_000)
    served = start_server(
        "--repository", str(repo), "--no-builtins", "--model-control-mode", "explicit", "--load-model", "add_b"
    )
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    answers: list[object] = []
    thread = threading.Thread(target=lambda: answers.append(infer(served, "http", "add_b", {"a": a, "b": a})))
    thread.start()
    try:
        assert wait_for(lambda: pending_requests(served, "add_b") == 1)
        started = time.monotonic()
        assert load(served, "add_b")[0] == 200
        thread.join(timeout=20)
        assert not thread.is_alive() and time.monotonic() - started < 10
        assert len(answers) == 1 and answers[0].tobytes() == (a + a).tobytes()  # type: ignore[union-attr]
    finally:
        thread.join(timeout=40)
        stop_server(served)


def test_a_full_queue_ends_the_gathering(tmp_path):
    # max_queue_size 2 below the batch: once two requests are held nothing more can arrive, so
    # the batch runs then instead of waiting out its 30 s.
    repo = tmp_path / "models"
    write_config(
        repo,
        "add_f",
        'max_queue_size = 2\n[alias]\nop = "add"\n[dynamic_batching]\nmax_queue_delay_us = 30000000\n'
        "max_batch_size = 64\n",
    )
    served = start_server("--repository", str(repo), "--no-builtins", "--workers-per-model", "1")
    try:
        a = np.ones((1, 4), dtype=np.float32)
        started = time.monotonic()
        answers = concurrent_rows(served, "add_f", [{"a": a, "b": a}, {"a": a, "b": 2 * a}])
        assert time.monotonic() - started < 10
        assert [x.tobytes() for x in answers] == [(a + a).tobytes(), (a + 2 * a).tobytes()]  # type: ignore[union-attr]
        assert max(b["batch_size"] for b in stats(served, "add_f")["batch_stats"]) == 2
    finally:
        stop_server(served)
