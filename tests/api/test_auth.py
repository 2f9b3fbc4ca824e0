"""Issue 17 item 10: authentication fails closed. A key setting that yields no usable key, or a keys file
that cannot be read, stops startup with a clear message; a 401 carries `WWW-Authenticate`; the OpenAPI
schema needs a key when keys are set; behind SageMaker the key may come as a custom attribute."""

from __future__ import annotations

import pytest

from app.api.connections import PROBE_PATHS
from app.cli import main
from app.errors import ConfigError
from app.settings import ServerSettings

PROMPT = {"prompt": "x", "max_tokens": 1}


@pytest.mark.parametrize("keys", [" , ", ",", " "])
def test_keys_that_yield_no_usable_key_are_a_startup_error(tmp_path, monkeypatch, keys) -> None:
    empty_file = tmp_path / "keys"
    empty_file.write_text("\n  \n")
    monkeypatch.setenv("INF2SERVE_API_KEYS", keys)
    with pytest.raises(ConfigError, match="none is usable"):
        ServerSettings()
    monkeypatch.delenv("INF2SERVE_API_KEYS")
    with pytest.raises(ConfigError, match="none is usable"):
        ServerSettings(api_keys_file=empty_file)


def test_a_key_with_a_space_is_refused_without_echoing_it(monkeypatch) -> None:
    monkeypatch.setenv("INF2SERVE_API_KEYS", "good,bad key")
    with pytest.raises(ConfigError, match="visible ASCII") as refused:
        ServerSettings()
    assert "bad key" not in refused.value.message


def test_a_missing_keys_file_is_a_clear_settings_error(tmp_path, capsys) -> None:
    missing = tmp_path / "nowhere" / "keys"
    assert main(["serve", "--api-keys-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"api_keys_file {missing} cannot be read" in err and "Traceback" not in err


def test_a_refusal_carries_a_bearer_challenge(client_for) -> None:
    client = client_for(api_keys="k1")
    missing = client.post("/v1/completions", json=PROMPT)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == 'Bearer realm="inf2serve"'
    wrong = client.post("/v1/completions", json=PROMPT, headers={"authorization": "Bearer k2"})
    assert wrong.headers["www-authenticate"] == 'Bearer realm="inf2serve", error="invalid_token"'


def test_the_schema_needs_a_key_when_keys_are_set_and_docs_are_off(client_for) -> None:
    open_client = client_for()
    assert open_client.get("/openapi.json").status_code == 200
    client = client_for(api_keys="k1")
    assert client.get("/openapi.json").status_code == 401
    schema = client.get("/openapi.json", headers={"authorization": "Bearer k1"})
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    for path in ("/docs", "/redoc"):
        assert client.get(path).status_code == 404
        assert open_client.get(path).status_code == 404


def test_sagemaker_custom_attribute_carries_the_key(client_for) -> None:
    client = client_for(api_keys="k1,k2")
    header = "x-amzn-sagemaker-custom-attributes"
    ok = client.post("/invocations", json={"inputs": "x"}, headers={header: "trace=1; api_key=k2"})
    assert ok.status_code == 200
    refused = client.post("/invocations", json={"inputs": "x"}, headers={header: "api_key=k3"})
    assert refused.status_code == 401


def test_every_route_but_the_probes_needs_a_key(client_for) -> None:
    client = client_for(api_keys="k1")
    paths = client.app.openapi()["paths"]
    assert {"/tokenize", "/detokenize", "/tokenizer_info", "/version", "/v1/models/{model_id}"} <= set(paths)
    for template, operations in paths.items():
        path = template.replace("{model_id}", "fake-model").replace("{response_id}", "resp_x")
        for method in operations:
            status = client.request(method, path, json={}).status_code
            assert status == (200 if template in PROBE_PATHS else 401), (method, path)
