"""API keys, request ids, the generic 500, JSON logs, settings, the `serve` flags, and the `inf2serve`
command line loading only the command it runs."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from app import cli as inf2serve_cli
from app.api import cli
from app.logs import REQUEST_ID, JsonFormatter
from app.settings import ServerSettings

PROMPT = {"prompt": "x", "max_tokens": 1}


def test_api_keys_guard_inference_but_not_probes(client_for, tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("from-file\n\n")
    client = client_for(api_keys="from-env", api_keys_file=keys_file)
    missing = client.post("/v1/completions", json=PROMPT)
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    assert (
        client.post("/v1/completions", json=PROMPT, headers={"authorization": "Bearer wrong"}).status_code
        == 401
    )
    assert client.post("/invocations", json={"inputs": "x"}).status_code == 401
    for key in ("from-env", "from-file"):
        headers = {"authorization": f"Bearer {key}"}
        assert client.post("/v1/completions", json=PROMPT, headers=headers).status_code == 200
    assert client.get("/v1/models", headers={"authorization": "Basic from-env"}).status_code == 401
    for probe in ("/ping", "/ready", "/health", "/metrics"):
        assert client.get(probe).status_code == 200


def test_request_id_is_echoed_or_generated(client):
    assert client.get("/ping", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
    generated = client.get("/ping", headers={"x-request-id": "bad id\twith spaces"}).headers["x-request-id"]
    assert len(generated) == 32 and generated.isalnum()
    error = client.post("/v1/completions", json={"prompt": "x", "n": 99})
    assert error.headers["x-request-id"] and error.headers["x-artifact-id"] == "fake-model/0123456789ab"


def test_unexpected_error_is_a_generic_500_without_a_trace(client, engine, caplog):
    engine.fail_with = RuntimeError("secret internal detail")
    with caplog.at_level(logging.ERROR):
        response = client.post("/v1/completions", json=PROMPT, headers={"x-request-id": "boom-1"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "boom-1"
    error = response.json()["error"]
    assert error["message"] == "internal server error (request id boom-1)"
    assert "secret" not in response.text and "Traceback" not in response.text
    assert any("secret internal detail" in (r.exc_text or "") for r in caplog.records)


def test_json_log_lines_carry_the_request_id():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "served %s", ("it",), None)
    record.status = 200
    token = REQUEST_ID.set("req-9")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        REQUEST_ID.reset(token)
    assert line["msg"] == "served it" and line["request_id"] == "req-9" and line["status"] == 200


def test_settings_defaults_follow_sagemaker(monkeypatch):
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT", raising=False)
    settings = ServerSettings()
    assert (settings.host, settings.port, settings.artifact) == ("0.0.0.0", 8080, "/opt/ml/model")
    assert settings.keep_alive_s > 60  # above ALB's default idle timeout
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "9001")
    assert ServerSettings().port == 9001
    monkeypatch.setenv("INF2SERVE_PORT", "7000")
    assert ServerSettings().port == 7000
    assert ServerSettings(port=6000).port == 6000


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_flags_override_environment(monkeypatch):
    monkeypatch.setenv("INF2SERVE_ARTIFACT", "/from/env")
    monkeypatch.setenv("INF2SERVE_DRAIN_S", "3")
    args = parse_serve(["--artifact", "s3://bucket/model", "--port", "8000", "--no-verify-golden"])
    settings = cli.settings_from(args)
    assert settings.artifact == "s3://bucket/model" and settings.port == 8000
    assert settings.drain_s == 3.0 and settings.verify_golden is False


def test_serve_rejects_invalid_settings(capsys):
    args = parse_serve(["--port", "0"])
    assert cli.run(args) == 2
    assert "port" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--api-keys", "--api_keys"])
def test_api_keys_are_not_a_flag(flag):
    with pytest.raises(SystemExit):
        parse_serve([flag, "secret"])


def test_engine_settings_reach_the_engine_config(monkeypatch):
    monkeypatch.setenv("INF2SERVE_RUN_AHEAD", "false")
    monkeypatch.setenv("INF2SERVE_MAX_PREFILLS_PER_STEP", "2")
    config = ServerSettings().engine_config()
    assert config.run_ahead is False and config.max_prefills_per_step == 2
    monkeypatch.delenv("INF2SERVE_RUN_AHEAD")
    assert ServerSettings().engine_config().run_ahead is True


class RecordingEntryPoint:
    """An `inf2serve.commands` entry point whose command does nothing; loading it is recorded."""

    def __init__(self, name: str, loaded: list[str]) -> None:
        self.name = name
        self.loaded = loaded

    def load(self):
        self.loaded.append(self.name)
        return lambda subparsers: subparsers.add_parser(self.name).set_defaults(handler=lambda args: 0)


def test_the_command_line_loads_only_the_command_it_runs(monkeypatch):
    loaded: list[str] = []
    entries = [RecordingEntryPoint(name, loaded) for name in ("compile", "deploy", "serve")]
    monkeypatch.setattr(inf2serve_cli, "entry_points", lambda group: entries)
    assert inf2serve_cli.main(["serve"]) == 0
    assert loaded == ["serve"]


def test_the_command_line_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exited:
        inf2serve_cli.main(["--help"])
    assert exited.value.code == 0
    assert "{artifacts,canary,compile,deploy,serve}" in capsys.readouterr().out
