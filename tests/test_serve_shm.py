"""`opbridge serve` system shared memory (Triton's extension) over HTTP and gRPC, with tritonclient.

Each region a test creates is destroyed in a `finally`; the server runs on free loopback ports.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from test_serve import Served, http_inputs, start_server, stop_server

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")

RNG = np.random.default_rng(7)
A = RNG.random((64, 32), dtype=np.float32)
B = RNG.random((64, 32), dtype=np.float32)
SIZE = A.nbytes


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    server = start_server("--allow-shared-memory", "--workers-per-model", "2")
    try:
        yield server
    finally:
        assert stop_server(server) == 0


@contextmanager
def client(module, address: str) -> Iterator:  # type: ignore[no-untyped-def]
    """A tritonclient of `module`; the regions it registered without a session go with it."""
    connection = module.InferenceServerClient(address)
    try:
        yield connection
    finally:
        connection.unregister_system_shared_memory()
        connection.close()


@pytest.fixture()
def http(served: Served) -> Iterator[th.InferenceServerClient]:
    with client(th, served.http) as connection:
        yield connection


@pytest.fixture()
def grpc(served: Served) -> Iterator[tg.InferenceServerClient]:
    with client(tg, served.grpc) as connection:
        yield connection


@contextmanager
def region(name: str, size: int, *arrays: np.ndarray) -> Iterator[object]:
    """A client's shared-memory region of `size` bytes holding `arrays` back to back."""
    handle = shm.create_shared_memory_region(name, f"/opbridge-test-{os.getpid()}-{name}", size)
    try:
        if arrays:
            shm.set_shared_memory_region(handle, list(arrays))
        yield handle
    finally:
        shm.destroy_shared_memory_region(handle)


def key(name: str) -> str:
    return f"/opbridge-test-{os.getpid()}-{name}"


def shm_inputs(module, names_offsets: list[tuple[str, int]], region_name: str) -> list:  # type: ignore[no-untyped-def]
    inputs = []
    for name, offset in names_offsets:
        i = module.InferInput(name, list(A.shape), "FP32")
        i.set_shared_memory(region_name, SIZE, offset=offset)
        inputs.append(i)
    return inputs


def shm_output(module, region_name: str, size: int = SIZE, offset: int = 0):  # type: ignore[no-untyped-def]
    out = module.InferRequestedOutput("out")
    out.set_shared_memory(region_name, size, offset=offset)
    return out


def refused(call, match: str) -> InferenceServerException:  # type: ignore[no-untyped-def]
    with pytest.raises(InferenceServerException, match=match) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_add_in_shared_memory_is_bit_identical(protocol: str, request: pytest.FixtureRequest) -> None:
    client = request.getfixturevalue(protocol)
    module = th if protocol == "http" else tg
    with region("in", 2 * SIZE, A, B), region("out", SIZE) as output:
        client.register_system_shared_memory("in", key("in"), 2 * SIZE)
        client.register_system_shared_memory("out", key("out"), SIZE)
        result = client.infer(
            "add", shm_inputs(module, [("a", 0), ("b", SIZE)], "in"), outputs=[shm_output(module, "out")]
        )
        out = result.get_output("out")
        params = (
            out["parameters"]
            if protocol == "http"
            else {k: v.string_param or v.int64_param for k, v in out.parameters.items()}
        )
        assert params["shared_memory_region"] == "out" and params["shared_memory_byte_size"] == SIZE
        np.testing.assert_array_equal(shm.get_contents_as_numpy(output, np.float32, list(A.shape)), A + B)
        # Mixed: one input in shared memory, one sent; the output answered as binary.
        mixed = [shm_inputs(module, [("a", 0)], "in")[0]]
        b = module.InferInput("b", list(B.shape), "FP32")
        b.set_data_from_numpy(B)
        plain = (
            module.InferRequestedOutput("out", binary_data=True) if module is th else module.InferRequestedOutput("out")
        )
        result = client.infer("add", [*mixed, b], outputs=[plain])
        np.testing.assert_array_equal(result.as_numpy("out"), A + B)


def test_unaligned_slices_are_copied_with_the_same_result(http: th.InferenceServerClient) -> None:
    with region("u", 3 * SIZE + 8) as handle:
        shm.set_shared_memory_region(handle, [A], offset=1)
        shm.set_shared_memory_region(handle, [B], offset=1 + SIZE)
        http.register_system_shared_memory("u", key("u"), 3 * SIZE + 8)
        http.infer(
            "add", shm_inputs(th, [("a", 1), ("b", 1 + SIZE)], "u"), outputs=[shm_output(th, "u", offset=2 * SIZE + 3)]
        )
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(handle, np.float32, list(A.shape), offset=2 * SIZE + 3), A + B
        )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_status_unregister_and_unregister_all(protocol: str, request: pytest.FixtureRequest) -> None:
    client = request.getfixturevalue(protocol)
    with region("s1", 64), region("s2", 128):
        client.register_system_shared_memory("s1", key("s1"), 64)
        client.register_system_shared_memory("s2", key("s2"), 32, offset=16)
        status = client.get_system_shared_memory_status()
        if protocol == "http":
            assert sorted((r["name"], r["key"], r["offset"], r["byte_size"]) for r in status) == [
                ("s1", key("s1"), 0, 64),
                ("s2", key("s2"), 16, 32),
            ]
        else:
            assert sorted(status.regions) == ["s1", "s2"]
            assert status.regions["s2"].byte_size == 32 and status.regions["s2"].offset == 16
        refused(lambda: client.register_system_shared_memory("s1", key("s1"), 64), "already registered")
        client.unregister_system_shared_memory("s1")
        refused(lambda: client.get_system_shared_memory_status("s1"), "unable to find")
        client.register_system_shared_memory("s1", key("s1"), 64)  # the name is free again
        client.unregister_system_shared_memory()
        empty = client.get_system_shared_memory_status()
        assert (empty if protocol == "http" else list(empty.regions)) == []


def test_disabled_by_default() -> None:
    served = start_server()
    try:
        with th.InferenceServerClient(served.http) as http, region("d", 64):
            refused(lambda: http.register_system_shared_memory("d", key("d"), 64), "--allow-shared-memory")
        grpc = tg.InferenceServerClient(served.grpc)
        try:
            refused(lambda: grpc.get_system_shared_memory_status(), "--allow-shared-memory")
            refused(lambda: grpc.infer("add", shm_inputs(tg, [("a", 0), ("b", 0)], "d")), "--allow-shared-memory")
        finally:
            grpc.close()
    finally:
        assert stop_server(served) == 0


@pytest.mark.parametrize("bad", ["../etc/passwd", "/a/b", "/..", ""])
def test_keys_escaping_the_folder_are_refused(http: th.InferenceServerClient, bad: str) -> None:
    refused(lambda: http.register_system_shared_memory("bad", bad, 64), "invalid shared memory key")


def test_registration_bounds(http: th.InferenceServerClient, grpc: tg.InferenceServerClient) -> None:
    with region("r", 64):
        refused(lambda: http.register_system_shared_memory("r", key("r"), 65), "fewer than")
        refused(lambda: http.register_system_shared_memory("r", key("r"), 64, offset=1), "fewer than")
        refused(lambda: grpc.register_system_shared_memory("r", key("r"), 8, offset=2**63), "not a valid span")
        refused(lambda: http.register_system_shared_memory("r", key("missing"), 8), "cannot open")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tensor_bounds_sizes_and_overlaps(protocol: str, request: pytest.FixtureRequest) -> None:
    client = request.getfixturevalue(protocol)
    module = th if protocol == "http" else tg
    with region("t", 3 * SIZE, A, B):
        client.register_system_shared_memory("t", key("t"), 3 * SIZE)

        def infer(inputs, outputs=None):  # type: ignore[no-untyped-def]
            return lambda: client.infer("add", inputs, outputs=outputs)

        out_of_bounds = shm_inputs(module, [("a", 0), ("b", 2 * SIZE + 4)], "t")
        refused(infer(out_of_bounds), "exceed")
        overflow = shm_inputs(module, [("a", 0), ("b", 0)], "t")
        # Past u64 over JSON (the sum overflows), int64's largest over gRPC.
        overflow[1].set_shared_memory("t", SIZE, offset=2**64 - 1 if module is th else 2**63 - 1)
        refused(infer(overflow), "exceed")
        mismatch = shm_inputs(module, [("a", 0), ("b", SIZE)], "t")
        mismatch[1].set_shared_memory("t", SIZE - 4, offset=SIZE)
        refused(infer(mismatch), "does not match")
        unknown = shm_inputs(module, [("a", 0), ("b", SIZE)], "nope")
        refused(infer(unknown), "unknown shared memory region")
        inputs = shm_inputs(module, [("a", 0), ("b", SIZE)], "t")
        refused(infer(inputs, [shm_output(module, "t", SIZE - 4, 2 * SIZE)]), "less than")
        refused(infer(inputs, [shm_output(module, "t", SIZE, SIZE // 2)]), "overlaps")
        # Data and shared memory together.
        both = module.InferInput("a", list(A.shape), "FP32")
        both.set_data_from_numpy(A)
        if module is th:
            both._parameters.update({"shared_memory_region": "t", "shared_memory_byte_size": SIZE})
        else:
            both._input.parameters["shared_memory_region"].string_param = "t"
            both._input.parameters["shared_memory_byte_size"].int64_param = SIZE
        refused(infer([both, inputs[1]]), "cannot also have")
        # The region still works after every refusal.
        result = client.infer("add", inputs, outputs=[shm_output(module, "t", SIZE, 2 * SIZE)])
        assert result.get_output("out") is not None


def test_another_sessions_region_does_not_exist(served: Served) -> None:
    with (
        th.InferenceServerClient(served.http) as http,
        region("mine", 2 * SIZE, A, B),
    ):
        alice = {"opbridge-session": "alice"}
        bob = {"opbridge-session": "bob"}
        http.register_system_shared_memory("mine", key("mine"), 2 * SIZE, headers=alice)
        try:
            assert http.get_system_shared_memory_status(headers=bob) == []
            refused(lambda: http.get_system_shared_memory_status("mine", headers=bob), "unable to find")
            inputs = shm_inputs(th, [("a", 0), ("b", SIZE)], "mine")
            refused(lambda: http.infer("add", inputs, headers=bob), "unknown shared memory region")
            http.unregister_system_shared_memory("mine", headers=bob)  # not bob's: nothing happens
            # Bob may use the same name for his own region.
            http.register_system_shared_memory("mine", key("mine"), SIZE, headers=bob)
            result = http.infer("add", inputs, headers=alice)
            np.testing.assert_array_equal(result.as_numpy("out"), A + B)
        finally:
            http.unregister_system_shared_memory(headers=alice)
            http.unregister_system_shared_memory(headers=bob)


def test_symbolic_links_and_long_names_are_refused(http: th.InferenceServerClient, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A link in /dev/shm to a file outside it: never followed (shm_open's O_NOFOLLOW), so a
    # client cannot map a file the server can open.
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"s" * 4096)
    link = f"/dev/shm/opbridge-test-{os.getpid()}-link"
    os.symlink(secret, link)
    try:
        refused(lambda: http.register_system_shared_memory("link", link[len("/dev/shm") :], 64), "symbolic link")
    finally:
        os.unlink(link)
    assert secret.read_bytes() == b"s" * 4096
    with region("long", 64):
        refused(lambda: http.register_system_shared_memory("n" * 256, key("long"), 64), "1 to 255 bytes")
        http.register_system_shared_memory("n" * 255, key("long"), 64)


def test_duplicate_registration_is_already_exists(
    http: th.InferenceServerClient, grpc: tg.InferenceServerClient
) -> None:
    with region("dup", 64):
        http.register_system_shared_memory("dup", key("dup"), 64)
        refused(lambda: http.register_system_shared_memory("dup", key("dup"), 64), "already registered")
        grpc.register_system_shared_memory("dup2", key("dup"), 64)
        error = refused(lambda: grpc.register_system_shared_memory("dup2", key("dup"), 64), "already registered")
        assert error.status() == "StatusCode.ALREADY_EXISTS"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_output_in_another_region_of_the_input_file_is_an_overlap(
    protocol: str, request: pytest.FixtureRequest
) -> None:
    # Two registrations of one file are two mappings: their bytes still alias.
    client = request.getfixturevalue(protocol)
    module = th if protocol == "http" else tg
    with region("one", 2 * SIZE, A, B) as handle:
        client.register_system_shared_memory("in", key("one"), 2 * SIZE)
        client.register_system_shared_memory("again", key("one"), 2 * SIZE)
        inputs = shm_inputs(module, [("a", 0), ("b", SIZE)], "in")
        refused(lambda: client.infer("add", inputs, outputs=[shm_output(module, "again", SIZE, SIZE)]), "overlaps")
        # Disjoint bytes of the same file are fine.
        client.register_system_shared_memory("tail", key("one"), SIZE, offset=SIZE)
        result = client.infer(
            "add", shm_inputs(module, [("a", 0), ("b", 0)], "in"), outputs=[shm_output(module, "tail")]
        )
        assert result.get_output("out") is not None
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, A.shape, offset=SIZE), A + A)


def test_regions_per_caller_are_bounded(served: Served) -> None:
    with th.InferenceServerClient(served.http) as http, region("many", 64):
        hog = {"opbridge-session": "hog"}
        try:
            for i in range(128):
                http.register_system_shared_memory(f"r{i}", key("many"), 64, headers=hog)
            error = refused(
                lambda: http.register_system_shared_memory("r128", key("many"), 64, headers=hog), "too many"
            )
            assert error.status() == "429"
            # Another caller is not locked out.
            http.register_system_shared_memory("mine", key("many"), 64, headers={"opbridge-session": "victim"})
        finally:
            http.unregister_system_shared_memory(headers=hog)
            http.unregister_system_shared_memory(headers={"opbridge-session": "victim"})


def test_the_session_id_parameter_names_the_regions_owner(served: Served) -> None:
    with th.InferenceServerClient(served.http) as http, region("param", 2 * SIZE, A, B):
        http.register_system_shared_memory("p", key("param"), 2 * SIZE, headers={"opbridge-session": "carol"})
        try:
            inputs = shm_inputs(th, [("a", 0), ("b", SIZE)], "p")
            result = http.infer("add", inputs, parameters={"session_id": "carol"})
            np.testing.assert_array_equal(result.as_numpy("out"), A + B)
            refused(
                lambda: http.infer("add", inputs, parameters={"session_id": "dave"}), "unknown shared memory region"
            )
            refused(lambda: http.infer("add", inputs, parameters={"session_id": 5}), "must be a string")
        finally:
            http.unregister_system_shared_memory(headers={"opbridge-session": "carol"})


def mapped(served: Served) -> str:
    with open(f"/proc/{served.process.pid}/maps") as maps:
        return maps.read()


def test_unregister_during_a_request_is_deferred(http: th.InferenceServerClient, served: Served) -> None:
    # Large enough that the request is still running when the regions are unregistered (a few
    # tenths of a second); the test holds either way.
    big = RNG.random((2048, 2048), dtype=np.float32)
    size = big.nbytes
    with region("long", 2 * size, big, big), region("long_out", size) as output:
        http.register_system_shared_memory("long", key("long"), 2 * size)
        http.register_system_shared_memory("long_out", key("long_out"), size)
        assert key("long") in mapped(served)
        inputs = []
        for name, offset in (("a", 0), ("b", size)):
            i = th.InferInput(name, list(big.shape), "FP32")
            i.set_shared_memory("long", size, offset=offset)
            inputs.append(i)
        outputs = [shm_output(th, "long_out", size)]
        result: dict[str, object] = {}

        def run() -> None:
            with th.InferenceServerClient(served.http) as client:
                result["r"] = client.infer("matmul", inputs, outputs=outputs)

        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(0.05)
        http.unregister_system_shared_memory("long")
        http.unregister_system_shared_memory("long_out")
        worker.join(timeout=30)
        assert "r" in result
        # The last request using the regions has finished: they are unmapped.
        assert key("long") not in mapped(served)
        np.testing.assert_allclose(shm.get_contents_as_numpy(output, np.float32, list(big.shape)), big @ big, rtol=1e-4)
        http.register_system_shared_memory("long", key("long"), size)  # the name is free


def test_a_truncated_file_is_an_error_and_the_server_goes_on(http: th.InferenceServerClient) -> None:
    with region("cut", 2 * SIZE, A, B):
        http.register_system_shared_memory("cut", key("cut"), 2 * SIZE)
        os.truncate(f"/dev/shm{key('cut')}", SIZE)
        inputs = shm_inputs(th, [("a", 0), ("b", SIZE)], "cut")
        refused(lambda: http.infer("add", inputs), "truncated by its owner")
        http.unregister_system_shared_memory("cut")
    result = http.infer("add", http_inputs({"a": A, "b": B}))
    np.testing.assert_array_equal(result.as_numpy("out"), A + B)


def test_truncated_during_a_request_is_an_error_not_a_crash(http: th.InferenceServerClient, served: Served) -> None:
    # The file is cut while a large matmul reads it (the cut lands before, during or, on a very
    # fast machine, after the call): the answer is the truncation error or the right result,
    # and the server lives on (the SIGBUS guard; its fault path is unit-tested in opbridge-shm).
    big = RNG.random((2048, 2048), dtype=np.float32)
    size = big.nbytes
    with region("cut_late", 2 * size, big, big):
        http.register_system_shared_memory("cut_late", key("cut_late"), 2 * size)
        inputs = []
        for name, offset in (("a", 0), ("b", size)):
            i = th.InferInput(name, list(big.shape), "FP32")
            i.set_shared_memory("cut_late", size, offset=offset)
            inputs.append(i)
        outcome: dict[str, object] = {}

        def run() -> None:
            with th.InferenceServerClient(served.http) as connection:
                try:
                    outcome["result"] = connection.infer("matmul", inputs).as_numpy("out")
                except InferenceServerException as error:
                    outcome["error"] = str(error)

        worker = threading.Thread(target=run)
        worker.start()
        time.sleep(0.05)
        os.truncate(f"/dev/shm{key('cut_late')}", 0)
        worker.join(timeout=30)
        if "error" in outcome:
            assert "truncated" in str(outcome["error"])
        else:
            np.testing.assert_allclose(outcome["result"], big @ big, rtol=1e-4)
        refused(lambda: http.infer("matmul", inputs), "truncated by its owner")
    assert served.process.poll() is None
    np.testing.assert_array_equal(http.infer("add", http_inputs({"a": A, "b": B})).as_numpy("out"), A + B)
