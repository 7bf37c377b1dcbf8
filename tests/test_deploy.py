"""The deployment files: `Containerfile` and `deploy/` (KServe, plain Kubernetes, Grafana).

Each file parses and says what the others rely on (kinds, probes on the HTTP port's health endpoints,
scrape annotations naming the metrics port, the dashboard's metrics exist). Then the command line each
one gives the server is run as it stands, with only its port values replaced by free ports and its
repository path by a copy of examples/repository with the plugins built: the server must print its
ready line on exactly those ports, be ready, answer tritonclient, and exit 0 on SIGTERM.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as th  # a test dependency (make setup): missing is an error, not a skip
import yaml  # pyyaml, a test dependency likewise

import opbridge as ob
from opbridge.cli import server_binary

# tritonclient's HTTP client (geventhttpclient) leaves sockets for the garbage collector.
pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CONTAINERFILE = ROOT / "Containerfile"
DASHBOARD = DEPLOY / "grafana" / "opbridge-serve.json"
PORT_FLAGS = ("--http-port", "--grpc-port", "--metrics-port")


def load_yaml(relative: str) -> dict:
    (document,) = yaml.safe_load_all((DEPLOY / relative).read_text())
    return document


def flag_values(args: list[str]) -> dict[str, str]:
    """`--flag=value` and `--flag value` pairs of a command line (the last one wins)."""
    values: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("--"), f"not a flag: {arg!r} in {args}"
        if "=" in arg:
            name, value = arg.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            name, value = arg, args[i + 1]
            i += 1
        else:
            name, value = arg, ""
        values[name] = value
        i += 1
    return values


def substitute(args: list[str], replacements: dict[str, str]) -> list[str]:
    """`args` with the values of the flags in `replacements` replaced, in either spelling; nothing else changes."""
    out, i = [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in replacements:
            if "=" in args[i]:
                out.append(f"{name}={replacements[name]}")
            else:
                out += [name, replacements[name]]
                i += 1
        else:
            out.append(args[i])
        i += 1
    return out


# --- the command lines -----------------------------------------------------------------------------


def containerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) pairs, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in CONTAINERFILE.read_text().splitlines():
        if not current and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        lines.append(current.strip())
        current = ""
    assert not current, "a continuation line at the end of the Containerfile"
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def runtime_stage() -> list[tuple[str, str]]:
    """The instructions of the Containerfile's last stage (the image that runs)."""
    instructions = containerfile_instructions()
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    return instructions[last_from:]


def exec_form(instruction: str) -> list[str]:
    stage = dict(runtime_stage())
    value = json.loads(stage[instruction])  # exec (JSON) form: the server is PID 1 and gets SIGTERM
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def kserve_container() -> dict:
    (container,) = load_yaml("kserve/servingruntime.yaml")["spec"]["containers"]
    return container


def deployment_container() -> dict:
    (container,) = load_yaml("kubernetes/deployment.yaml")["spec"]["template"]["spec"]["containers"]
    return container


def command_lines() -> dict[str, tuple[list[str], str]]:
    """The server's arguments as each deployment gives them, and the repository path each expects."""
    runtime_args = kserve_container()["args"]
    isvc_args = load_yaml("kserve/inferenceservice.yaml")["spec"]["predictor"]["model"].get("args", [])
    return {
        "Containerfile": (exec_form("CMD"), "/models"),
        "kserve-servingruntime": (runtime_args, "/mnt/models"),
        # KServe appends an InferenceService's args to its runtime's.
        "kserve-inferenceservice": (runtime_args + isvc_args, "/mnt/models"),
        "kubernetes-deployment": (deployment_container()["args"], "/models"),
    }


def test_every_command_line_names_its_ports_and_repository() -> None:
    for name, (args, repository) in command_lines().items():
        values = flag_values(args)
        assert values.get("--host") == "0.0.0.0", f"{name}: reachable from outside the container"
        for flag in PORT_FLAGS:
            assert values.get(flag, "").isdigit() and int(values[flag]) > 0, f"{name}: {flag}"
        assert values.get("--repository") == repository, name


# --- structure -------------------------------------------------------------------------------------


def test_every_manifest_parses_with_the_expected_kinds() -> None:
    found = {}
    for path in sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml")):
        for document in yaml.safe_load_all(path.read_text()):
            assert document["metadata"]["name"], path
            found[str(path.relative_to(DEPLOY))] = (document["apiVersion"], document["kind"])
    assert found == {
        "kserve/inferenceservice.yaml": ("serving.kserve.io/v1beta1", "InferenceService"),
        "kserve/servingruntime.yaml": ("serving.kserve.io/v1alpha1", "ServingRuntime"),
        "kubernetes/deployment.yaml": ("apps/v1", "Deployment"),
        "kubernetes/service.yaml": ("v1", "Service"),
    }


def probe_paths(container: dict, port_of: dict[str, int]) -> dict[str, tuple[str, int]]:
    """Each probe's (path, port number), a named port resolved through the container's ports."""
    found = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if probe in container:
            get = container[probe]["httpGet"]
            port = get["port"]
            found[probe] = (get["path"], port_of[port] if isinstance(port, str) else port)
    return found


def test_serving_runtime_speaks_v2_and_probes_health_on_the_http_port() -> None:
    runtime = load_yaml("kserve/servingruntime.yaml")
    assert {"v2", "grpc-v2"} <= set(runtime["spec"]["protocolVersions"])
    assert [f["name"] for f in runtime["spec"]["supportedModelFormats"]] == ["opbridge"]
    container = kserve_container()
    assert container["name"] == "kserve-container"
    values = flag_values(container["args"])
    assert values["--http-port"] == "8080", "KServe routes HTTP to 8080"
    http = int(values["--http-port"])
    assert probe_paths(container, {}) == {
        "livenessProbe": ("/v2/health/live", http),
        "readinessProbe": ("/v2/health/ready", http),
    }
    annotations = runtime["spec"]["annotations"]
    assert annotations["prometheus.kserve.io/port"] == values["--metrics-port"]
    assert annotations["prometheus.kserve.io/path"] == "/metrics"
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]


def test_inference_service_names_the_runtime_and_its_format() -> None:
    runtime = load_yaml("kserve/servingruntime.yaml")
    isvc = load_yaml("kserve/inferenceservice.yaml")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert model["storageUri"]
    assert isvc["metadata"]["annotations"]["serving.kserve.io/enable-prometheus-scraping"] == "true"


def test_deployment_probes_scrape_annotations_and_service_agree() -> None:
    deployment = load_yaml("kubernetes/deployment.yaml")
    service = load_yaml("kubernetes/service.yaml")
    template = deployment["spec"]["template"]
    container = deployment_container()
    values = flag_values(container["args"])
    port_of = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port_of == {
        "http": int(values["--http-port"]),
        "grpc": int(values["--grpc-port"]),
        "metrics": int(values["--metrics-port"]),
    }
    http = port_of["http"]
    assert probe_paths(container, port_of) == {
        "startupProbe": ("/v2/health/live", http),
        "livenessProbe": ("/v2/health/live", http),
        "readinessProbe": ("/v2/health/ready", http),
    }
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port_of["metrics"]
    assert annotations["prometheus.io/path"] == "/metrics"
    requests = container["resources"]["requests"]
    assert requests["cpu"] and requests["memory"]
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True
    if container["securityContext"].get("readOnlyRootFilesystem"):
        # Plugin libraries are loaded from a copy in $TMPDIR/opbridge-plugins.
        (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert "emptyDir" in volumes[tmp["name"]]
    # SIGKILL only after the server's own drain deadline.
    assert template["spec"]["terminationGracePeriodSeconds"] > int(values["--exit-timeout-secs"])
    labels = template["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {n: n for n in port_of}


def test_containerfile_builds_the_server_and_runs_it_unprivileged() -> None:
    instructions = containerfile_instructions()
    builds = [rest for name, rest in instructions if name == "RUN" and "cargo build" in rest]
    assert len(builds) == 1 and "--release" in builds[0] and "-p opbridge-serve" in builds[0]
    assert "--mount=type=cache" in builds[0], "dependencies cached across builds"
    assert sum(name == "FROM" for name, _ in instructions) == 2, "a builder stage and a runtime stage"
    stage = runtime_stage()
    assert exec_form("ENTRYPOINT") == ["/usr/local/bin/opbridge-serve"]
    assert any(name == "COPY" and rest.endswith(" /usr/local/bin/opbridge-serve") for name, rest in stage)
    assert any(name == "COPY" and rest.endswith(" /models") for name, rest in stage)
    (user,) = [rest for name, rest in stage if name == "USER"]
    assert int(user.split(":")[0]) != 0
    pod = load_yaml("kubernetes/deployment.yaml")["spec"]["template"]["spec"]["securityContext"]
    assert user == f"{pod['runAsUser']}:{pod['runAsGroup']}", "the Deployment runs as the image's user"
    values = flag_values(exec_form("CMD"))
    (exposed,) = [rest for name, rest in stage if name == "EXPOSE"]
    assert exposed.split() == [values[flag] for flag in PORT_FLAGS]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"target", ".venv", ".git"} <= set(ignored)


def healthcheck_command() -> list[str]:
    (rest,) = [rest for name, rest in runtime_stage() if name == "HEALTHCHECK"]
    return json.loads(rest.split(" CMD ", 1)[1])


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return set(re.findall(r"\b(?:nv|opbridge)_[a-z_]+\b", " ".join(queries)))


def test_dashboard_has_a_datasource_variable_and_model_filters() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["type"] == variables["version"]["type"] == "query"
    assert "$model" in variables["version"]["definition"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            if "model=" in target["expr"]:
                assert 'model=~"$model",version=~"$version"' in target["expr"], panel["title"]
    assert dashboard_metrics() >= {
        "nv_inference_request_success",
        "nv_inference_request_failure",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_inference_pending_request_count",
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
        "nv_model_load_duration_secs",
        "opbridge_pool_allocated_bytes",
        "opbridge_pool_reserved_bytes",
        "opbridge_requests_rejected_total",
    }


# --- each command line, run ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of examples/repository with scale_add's plugin built for each version folder."""
    repo = tmp_path_factory.mktemp("deploy") / "models"
    shutil.copytree(ROOT / "examples" / "repository", repo, ignore=shutil.ignore_patterns("*.so"))
    for version in (1, 2):
        subprocess.run(
            [
                "cc",
                "-O2",
                "-shared",
                "-fPIC",
                "-I",
                str(ROOT / "python" / "opbridge" / "include"),
                f"-DSCALE_ADD_VERSION={version}",
                str(ROOT / "examples" / "plugins" / "c" / "scale_add.c"),
                "-o",
                str(repo / "scale_add" / str(version) / "libscale_add.so"),
            ],
            check=True,
        )
    return repo


def free_ports(count: int) -> list[int]:
    """Ports free on every interface now (held together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("0.0.0.0", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def loopback(address: str) -> str:
    """host:port as reachable from here (a server on 0.0.0.0 is reached on 127.0.0.1)."""
    host, port = address.rsplit(":", 1)
    return f"{'127.0.0.1' if host in ('0.0.0.0', '[::]') else host}:{port}"


@pytest.fixture(scope="module")
def serving() -> Iterator[tuple]:
    """test_serve's start_server/stop_server: imported once the binary is known to exist, since
    test_serve skips its whole module without one and a deployment check must fail instead."""
    assert server_binary() is not None, "the server binary is not built (make build)"
    from test_serve import start_server, stop_server

    yield start_server, stop_server


def why_not_started(argv: list[str]) -> str:
    """The server's stderr for `argv` (start_server discards it): a rejected flag exits at once."""
    process = subprocess.Popen(
        [str(server_binary()), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        return process.communicate(timeout=5)[1].strip()
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()[1].strip() + " (it started on a second try)"


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


@pytest.mark.parametrize("deployment", list(command_lines()))
def test_the_server_accepts_the_command_line(deployment: str, repository: Path, serving: tuple) -> None:
    start_server, stop_server = serving
    args, repository_path = command_lines()[deployment]
    assert flag_values(args)["--repository"] == repository_path
    ports = dict(zip(PORT_FLAGS, map(str, free_ports(3)), strict=True))
    argv = substitute(args, {**ports, "--repository": str(repository)})
    assert flag_values(argv) == {**flag_values(args), **ports, "--repository": str(repository)}
    try:
        served = start_server(*argv, free_ports=False)
    except AssertionError:
        pytest.fail(f"{deployment}: `opbridge serve {shlex.join(argv)}` did not start: {why_not_started(argv)}")
    try:
        addresses = (served.http, served.grpc, served.metrics)
        listening = {flag: loopback(a) for flag, a in zip(PORT_FLAGS, addresses, strict=True)}
        assert {flag: a.rsplit(":", 1)[1] for flag, a in listening.items()} == ports, "listening where told"
        http_address, metrics_address = listening["--http-port"], listening["--metrics-port"]
        assert get(f"http://{http_address}/v2/health/live")[0] == 200
        assert get(f"http://{http_address}/v2/health/ready")[0] == 200
        client = th.InferenceServerClient(http_address)
        try:
            a = np.arange(8, dtype=np.float32).reshape(2, 4)
            b = np.full((2, 4), 0.5, np.float32)
            inputs = []
            for name, array in (("a", a), ("b", b)):
                i = th.InferInput(name, list(array.shape), "FP32")
                i.set_data_from_numpy(array)
                inputs.append(i)
            result = client.infer("scale_add", inputs, model_version="2", parameters={"alpha": 2.0, "beta": 4.0})
            np.testing.assert_allclose(result.as_numpy("out"), a * 2 + b * 4)
            result = client.infer("scale_add", inputs, model_version="1", parameters={"alpha": 3.0})
            np.testing.assert_allclose(result.as_numpy("out"), a * 3 + b)
            x = th.InferInput("x", [2, 4], "FP32")
            x.set_data_from_numpy(a)
            result = client.infer("softmax_rows", [x])
            np.testing.assert_array_equal(result.as_numpy("out"), ob.ops.softmax(a, axis=-1))
        finally:
            client.close()
        # One request the front end rejects, so that its counter has a series too.
        with pytest.raises(urllib.error.HTTPError) as rejected:
            urllib.request.urlopen(
                urllib.request.Request(f"http://{http_address}/v2/models/no_such_model/infer", data=b"{}"), timeout=10
            )
        assert rejected.value.code == 404
        rejected.value.close()
        # What the scrape annotations point at, and every series the dashboard queries.
        status, metrics = get(f"http://{metrics_address}/metrics")
        assert status == 200
        exposed = set(re.findall(r"^([a-z_]+)(?:\{| )", metrics, re.MULTILINE))
        assert dashboard_metrics() <= exposed, dashboard_metrics() - exposed
        assert 'nv_inference_request_success{model="softmax_rows",version="1"} 1' in metrics
        if deployment == "Containerfile":
            # The image's HEALTHCHECK, pointed at this server's HTTP port.
            command = [part.replace("/8000 ", f"/{ports['--http-port']} ") for part in healthcheck_command()]
            assert command != healthcheck_command(), "the HEALTHCHECK names the HTTP port 8000"
            assert subprocess.run(command, timeout=10).returncode == 0, shlex.join(command)
    finally:
        assert stop_server(served) == 0
