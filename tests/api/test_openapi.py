"""The OpenAPI surface of a running server (uvicorn on loopback, fake engine), fuzzed from its own schema
by schemathesis: no 5xx, and every status, content type, header and body is one the schema documents.
Bounded: a few examples per operation."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import ThreadedServer, make_app
from .fakes import FakeEngine

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


APP = make_app(FakeEngine(), max_n=2, max_output_tokens=8)
schema = schemathesis.openapi.from_dict(APP.openapi())
schema.config.phases.coverage.enabled = False  # its exhaustive cases of ~50 fields take minutes: fuzz only


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    with ThreadedServer(APP) as running:
        yield running


def test_the_server_serves_this_schema(server: ThreadedServer) -> None:
    assert httpx.get(f"{server.url}/openapi.json").json() == schema.raw_schema


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_every_answer_is_documented_and_none_is_a_server_error(
    case: schemathesis.Case, server: ThreadedServer
) -> None:
    case.call_and_validate(base_url=server.url, checks=CHECKS)


def test_every_route_documents_its_errors() -> None:
    paths = schema.raw_schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/invocations"):
        responses = paths[path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "429", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert responses["429"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }
    for path, operations in paths.items():
        for operation in operations.values():
            for status, response in operation["responses"].items():
                assert response.get("content"), f"{path} {status} has no content type"
