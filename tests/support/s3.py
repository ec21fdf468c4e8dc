"""The loopback S3 server of dcp_zarr.testing.s3_server, for tests: starting one checks that the running test is
marked ``s3`` (tests/support/marks.py). tests/conftest.py's ``s3`` fixture starts one per test module, with a bucket
of its own (``S3Server.bucket``)."""

from __future__ import annotations

from dcp_zarr.testing import s3_server
from dcp_zarr.testing.s3_server import AWS_ENVIRONMENT, CREDENTIALS, Traffic
from tests.support import marks

__all__ = ["AWS_ENVIRONMENT", "CREDENTIALS", "S3Server", "Traffic"]


class S3Server(s3_server.S3Server):
    def __init__(self) -> None:
        marks.require("s3", "starts the loopback S3 server")
        super().__init__()
