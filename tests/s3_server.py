"""The S3 fixtures for tests, over the shared harness's moto server (loadtest/harness/s3.py).

Reuse from any test folder: import the fixtures into its conftest.py,
`from tests.s3_server import bucket, s3, s3_server  # noqa: F401`; `s3_server` is the session's server
process, `s3` points this process's S3 client (via AWS_ENDPOINT_URL_S3 and dummy credentials) at it for
one test, `bucket` creates a fresh bucket.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from loadtest.harness.s3 import S3Server, start_s3_server, use_endpoint


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = start_s3_server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    from app.artifacts.storage import s3_client

    use_endpoint(monkeypatch, s3_server.endpoint_url)
    yield s3_server
    s3_client.cache_clear()  # later tests build their client from their own environment


@pytest.fixture
def bucket(s3: S3Server) -> str:
    name = f"bucket-{uuid.uuid4().hex[:12]}"
    s3.client().create_bucket(Bucket=name)
    return name
