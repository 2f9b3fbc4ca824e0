"""A canary for real, on loopback: three `inf2serve serve` processes (stable, a healthy canary built from a
different artifact of the same model, and a broken canary whose artifact answers differently) behind a
real nginx (Debian `nginx-light`) with weighted upstreams, load driven through nginx.

nginx OSS has passive health checks only (`max_fails`/`fail_timeout`: a failed connection takes a server
out for a while); active checks of `/ready` are an nginx Plus feature. Retrying connection errors on the
next upstream (`proxy_next_upstream error`, with `non_idempotent` since completions are POSTs) plus the
server's drain window (still accepting for `drain_s` after SIGTERM) is what makes a drain lossless.

The tests run in file order on one fleet: the last one drains the stable server.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from app.cli import main
from loadtest.harness.server import BIN, ServerProcess, free_port
from tests.deploy.sagemaker_runtime import sagemaker_runtime

if TYPE_CHECKING:
    from compile.pipeline import CompileResult

pytestmark = pytest.mark.slow

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
DRAIN_S = 2.0
READY_TIMEOUT_S = 240.0
PROMPT = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0}


@dataclass(eq=False)
class Server:
    """One `inf2serve serve` process and the artifact it serves (hashable by identity: nginx weights)."""

    artifact_id: str
    process: ServerProcess

    @property
    def port(self) -> int:
        return self.process.port

    @property
    def url(self) -> str:
        return self.process.url


def start_server(name: str, result: CompileResult, logs: Path) -> Server:
    port = free_port()
    argv = [str(BIN / "inf2serve"), "serve", "--artifact", result.uri, "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--drain-s", str(DRAIN_S)]
    argv += ["--shutdown-timeout-s", "10", "--no-verify-golden", "--allow-random-weights"]  # `broken`
    process = ServerProcess(argv, {"OMP_NUM_THREADS": "1"}, port, logs / f"{name}.log")
    return Server(result.manifest.artifact_id, process.start())


class Nginx:
    """nginx as its own master process in a temp dir (pid, logs, temp paths there; no buffering to disk, so
    workers that drop root privileges never write), on a free loopback port."""

    def __init__(self, root: Path) -> None:
        self.root, self.port, self.generation = root, free_port(), 0
        self.conf = root / "nginx.conf"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _args(self) -> list[str]:
        return [NGINX, "-p", str(self.root), "-c", str(self.conf), "-e", str(self.root / "error.log")]

    def _write(self, weights: dict[Server, int]) -> None:
        self.generation += 1
        upstreams = "\n".join(
            f"    server 127.0.0.1:{s.port} weight={w} max_fails=1 fail_timeout=2s;"
            for s, w in weights.items()
        )
        temp_paths = "\n".join(
            f"  {kind}_temp_path {self.root / kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        self.conf.write_text(f"""daemon off;
worker_processes 1;
pid {self.root / "nginx.pid"};
events {{ worker_connections 256; }}
http {{
  access_log {self.root / "access.log"};
{temp_paths}
  upstream inf2serve {{
{upstreams}
    keepalive 16;
    keepalive_timeout 10s;  # below the server's keep-alive (75 s), as the ALB idle timeout is
  }}
  server {{
    listen 127.0.0.1:{self.port};
    location = /__generation {{ return 200 "{self.generation}"; }}
    location / {{
      proxy_pass http://inf2serve;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_next_upstream error timeout http_502 non_idempotent;
      proxy_next_upstream_tries 3;
      proxy_connect_timeout 2s;
      proxy_read_timeout 60s;
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
""")

    def start(self, weights: dict[Server, int]) -> None:
        self._write(weights)
        errors = self.root / "error.log"
        self.process = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=errors.open("ab"))
        self._wait_generation()

    def reload(self, weights: dict[Server, int]) -> None:
        self._write(weights)
        subprocess.run([*self._args(), "-s", "reload"], check=True, timeout=30, capture_output=True)
        self._wait_generation()

    def _wait_generation(self) -> None:
        """Until the new configuration answers (a reload swaps workers asynchronously)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process is not None and self.process.poll() is None, (
                self.root / "error.log"
            ).read_text()
            try:
                if httpx.get(self.url + "/__generation", timeout=2).text == str(self.generation):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"nginx did not load configuration {self.generation}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful shutdown of the master and its workers
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@dataclass
class Result:
    started: float
    status: int | None
    artifact_id: str | None
    error: str | None = None


@dataclass
class Load:
    """Clients posting completions through the balancer until stopped (bounded by `max_s`)."""

    url: str
    workers: int = 3
    max_s: float = 120.0
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _client(self) -> None:
        """A connection per request: an nginx reload closes its old worker's idle keep-alive client
        connections, and a POST sent on one as it closes is lost between client and balancer (15 in 14,199
        over 40 reloads, measured), a race of this test's balancer that says nothing of the servers."""
        deadline = time.monotonic() + self.max_s
        with httpx.Client(base_url=self.url, timeout=60, headers={"Connection": "close"}) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                started = time.monotonic()
                try:
                    response = client.post("/v1/completions", json=PROMPT)
                    result = Result(started, response.status_code, response.headers.get("x-artifact-id"))
                    if response.status_code != 200:
                        result.error = response.text[:200]
                except httpx.HTTPError as error:
                    result = Result(started, None, None, f"{type(error).__name__}: {error}")
                self.results.append(result)

    def __enter__(self) -> Load:
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.workers)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=70)

    def wait_for(self, count: int, timeout_s: float = 60.0) -> None:
        target, deadline = len(self.results) + count, time.monotonic() + timeout_s
        while len(self.results) < target:
            assert time.monotonic() < deadline, f"load stalled at {len(self.results)} results"
            time.sleep(0.05)

    def failures(self) -> list[Result]:
        return [r for r in self.results if r.status != 200]


@dataclass
class Fleet:
    stable: Server
    canary: Server
    broken: Server
    nginx: Nginx
    stable_uri: str
    canary_uri: str


@pytest.fixture(scope="module")
def fleet(
    stable_artifact: CompileResult,
    canary_artifact: CompileResult,
    broken_artifact: CompileResult,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Fleet]:
    assert Path(NGINX).exists(), "nginx is needed: `make system-deps` installs Debian's nginx-light"
    root = tmp_path_factory.mktemp("canary-e2e")
    stable, canary, broken = stable_artifact, canary_artifact, broken_artifact
    assert len({stable.manifest.artifact_id, canary.manifest.artifact_id, broken.manifest.artifact_id}) == 3
    servers = [
        start_server(name, result, root)
        for name, result in (("stable", stable), ("canary", canary), ("broken", broken))
    ]
    nginx = Nginx(root)
    try:
        for server in servers:
            server.process.wait_ready(READY_TIMEOUT_S)
        nginx.start({servers[0]: 9, servers[1]: 1})
        yield Fleet(*servers, nginx=nginx, stable_uri=stable.uri, canary_uri=canary.uri)
    finally:
        nginx.stop()
        for server in servers:
            server.process.stop()


def test_traffic_splits_by_weight(fleet: Fleet) -> None:
    with httpx.Client(base_url=fleet.nginx.url, timeout=60) as client:
        served = Counter(
            client.post("/v1/completions", json=PROMPT).headers["x-artifact-id"] for _ in range(40)
        )
    # Smooth weighted round robin, one worker, sequential requests: exactly 9 of every 10 go to stable.
    assert served == {fleet.stable.artifact_id: 36, fleet.canary.artifact_id: 4}


# Each side is judged against its own artifact's golden record. The broken candidate is held to the stable
# artifact's record (as a recompile of the same model would be) and answers differently.
CANDIDATES = {
    "canary": ("canary_uri", 0, "PROMOTE", "pass"),
    "broken": ("stable_uri", 1, "ROLL BACK", "FAIL"),
}
# Latency here is CPU-bound servers of different shapes sharing a loaded machine, so it must not decide:
# an effect floor no scheduling hiccup reaches. Agreement and errors are the point of this test (the
# latency test is unit-tested on canned samples and measured in loadtest/canary_bench.py).
QUICK = ["--samples", "12", "--min-samples", "8", "--min-effect", "1000", "--tail-min-effect", "1000"]
QUICK += ["--ttft-tail-min-effect", "1000"]


@pytest.mark.parametrize("candidate", CANDIDATES)
def test_canary_analysis_judges_the_candidate(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], candidate: str
) -> None:
    golden_of, code, verdict, agreement = CANDIDATES[candidate]
    server: Server = getattr(fleet, candidate)
    argv = ["canary", "--baseline", fleet.stable.url, "--candidate", server.url, *QUICK]
    argv += ["--baseline-artifact", fleet.stable_uri, "--candidate-artifact", getattr(fleet, golden_of)]
    with Load(fleet.nginx.url, workers=2) as load:
        assert main(argv) == code
    table = capsys.readouterr().out
    print(table)
    assert not load.failures()
    assert table.endswith(f"verdict: {verdict}\n")
    (row,) = [line for line in table.splitlines() if line.startswith("candidate agreement with its golden  ")]
    assert row.split()[-1] == agreement
    (row,) = [line for line in table.splitlines() if line.startswith("baseline agreement with its golden  ")]
    assert row.split()[-1] == "pass"


def test_canary_reaches_a_sagemaker_endpoint_variant(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """InvokeEndpointWithResponseStream through boto3, against a local stand-in of the runtime API that
    relays to the real servers' /invocations."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with sagemaker_runtime(fleet.stable.url) as (endpoint_url, received):
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", endpoint_url)
        argv = ["canary", "--baseline", fleet.canary.url, "--candidate", "sagemaker:llm/AllTraffic", *QUICK]
        assert main([*argv, "--candidate-artifact", fleet.stable_uri]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.endswith("verdict: PROMOTE\n")
    assert {r.get("X-Amzn-SageMaker-Target-Variant") for r in received} == {"AllTraffic"}


def test_shift_and_drain_under_load_loses_no_request(fleet: Fleet) -> None:
    with Load(fleet.nginx.url, workers=3) as load:
        load.wait_for(10)
        fleet.nginx.reload({fleet.stable: 1, fleet.canary: 9})
        load.wait_for(10)
        sigterm_at = time.monotonic()
        fleet.stable.process.terminate()
        assert fleet.stable.process.wait(60) == 0, fleet.stable.process.failure("stopped uncleanly")
        load.wait_for(20)  # the stopped server is still in the config: nginx must route around it
        fleet.nginx.reload({fleet.canary: 1})
        load.wait_for(10)
    assert not load.failures(), load.failures()[:5]
    after = [r.artifact_id for r in load.results if r.started > sigterm_at]
    assert set(after) <= {fleet.stable.artifact_id, fleet.canary.artifact_id}
    assert load.results[-1].artifact_id == fleet.canary.artifact_id
    assert "drain window over" in fleet.stable.process.log_path.read_text()
    # nginx did try the stopped server (passive check, then retry on the canary), and nobody noticed.
    assert "Connection refused" in (fleet.nginx.root / "error.log").read_text()
    drained = sum(r.artifact_id == fleet.stable.artifact_id for r in load.results if r.started > sigterm_at)
    print(f"{len(load.results)} requests, {drained} served by the stable server after its SIGTERM")
