"""Fixtures shared by the test modules. The machinery behind them is in tests/support/."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dcp_zarr.testing import s3_server
from tests.support import marks
from tests.support.ranks import Zygote
from tests.support.s3 import AWS_ENVIRONMENT, S3Server


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    # Before any fixture of this test is set up: tests/support/marks.py checks the markers against what starts.
    marks.current = frozenset(m.name for m in item.iter_markers())


def pytest_terminal_summary(terminalreporter) -> None:
    if s3_server.FALLBACK_NOTE:
        terminalreporter.write_line(f"NOTE: {s3_server.FALLBACK_NOTE}", yellow=True)


@pytest.fixture(scope="module")
def s3(request) -> S3Server:
    """A loopback S3 server for this module, with a bucket named after the module (``s3.bucket``).

    Module-scoped, in front of one server for the whole session (radosgw takes about 20 s to start; moto where
    Ceph is not installed, outside CI): the bucket is the module's own, so one module never sees another's keys.
    """
    server = S3Server()
    server.bucket = server.make_bucket(request.module.__name__.rsplit(".", 1)[-1].replace("_", "-"))
    yield server
    server.stop()


@pytest.fixture
def aws_environment(monkeypatch) -> None:
    """Credentials in the environment too, as users usually have them; no real AWS account is ever reachable."""
    for name, value in AWS_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def zygote() -> Zygote:
    """Forks the ranks of kill trials; one per module (its start costs a forkserver round trip and an import)."""
    z = Zygote()
    yield z
    z.close()


@pytest.fixture
def store_copy(tmp_path):
    """``store_copy(source, name="copy.zarr")``: a private copy of a store under this test's tmp_path, to damage.

    Symlinks are copied as links, so a store that holds one (tests/store_io/test_hostile_stores.py) keeps it.
    """
    def copy(source, name: str = "copy.zarr") -> Path:
        target = tmp_path / name
        shutil.copytree(source, target, symlinks=True)
        return target

    return copy
