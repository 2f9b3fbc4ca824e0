"""Fixtures for the benchmark tests: the loopback S3 server."""

from tests.s3_server import bucket, s3, s3_server  # noqa: F401
