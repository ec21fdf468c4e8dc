"""The markers are checked claims: a test that starts rank processes or the S3 server without carrying the marker
fails at once (tests/support/marks.py), so `-m "not distributed"` or `-m "not s3"` really leaves them out."""

from __future__ import annotations

import pytest

from tests.support.ranks import Zygote, run_ranks
from tests.support.s3 import S3Server


def _never_run(rank, world_size):
    raise AssertionError("no rank may start in an unmarked test")


def test_run_ranks_refuses_to_start_ranks_in_a_test_not_marked_distributed():
    with pytest.raises(AssertionError, match="not marked 'distributed'"):
        run_ranks(_never_run, 1)


def test_the_zygote_refuses_to_start_in_a_test_not_marked_distributed():
    with pytest.raises(AssertionError, match="not marked 'distributed'"):
        Zygote()


def test_the_s3_server_refuses_to_start_in_a_test_not_marked_s3():
    with pytest.raises(AssertionError, match="not marked 's3'"):
        S3Server()
