"""Where an incremental save's earlier checkpoint is, as ``open_earlier`` tells it: a ``file://`` URL and a plain path
name one local file system (the storage registry serves both with LocalStorage), so chunks are linked between them,
as a save into one from the other. (The save's own path however spelt, and other storage:
tests/incremental/test_incremental_bases.py, tests/incremental/test_incremental_s3.py.)"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_zarr import ZarrWriter
from tests.support.compare import assert_state_equal
from tests.support.states import load_full

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

OPTIONS = {"inner_chunk_bytes": 16 << 10}


def state() -> dict:
    return {"w": torch.randn(256, 64, generator=torch.Generator().manual_seed(3))}


@pytest.mark.parametrize("url_for", ["the save", "the earlier checkpoint"])
def test_a_file_url_and_a_plain_path_are_one_storage_and_chunks_are_linked(tmp_path, url_for):
    earlier, path = str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")
    dcp.save(state(), storage_writer=ZarrWriter(earlier, incremental=True, **OPTIONS), no_dist=True)
    if url_for == "the save":
        writer = ZarrWriter(f"file://{path}", incremental_from=earlier, **OPTIONS)
    else:
        writer = ZarrWriter(path, incremental_from=f"file://{earlier}", **OPTIONS)
    dcp.save(state(), storage_writer=writer, no_dist=True)
    assert writer.reuse_counts is not None and writer.reuse_counts.written_chunks == 0, writer.reuse_counts
    assert os.stat(os.path.join(path, "w", "c.0.0")).st_ino == os.stat(os.path.join(earlier, "w", "c.0.0")).st_ino
    assert_state_equal(load_full(path, state()), state())
