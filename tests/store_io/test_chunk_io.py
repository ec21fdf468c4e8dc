"""store_io/chunks.py's pure part: which chunk keys and views a rank's box is cut into, and the runs of inner chunks a
rank writes into an array-spanning shard."""

from __future__ import annotations

import numpy as np
import pytest

from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.store_io.chunks import chunk_regions, chunks_of_box, inner_chunk_runs


def test_a_row_block_is_cut_into_its_chunks_as_views_of_the_local_tensor():
    layout = ChunkLayout((6, 4), (2, 4))
    local = np.arange(16).reshape(4, 4)  # rows 2..6 of the array
    pieces = list(chunks_of_box(layout, (2, 0), local))
    assert [key for key, _ in pieces] == ["c.1.0", "c.2.0"]
    assert np.array_equal(pieces[0][1], local[:2]) and np.array_equal(pieces[1][1], local[2:])
    assert all(np.shares_memory(data, local) for _, data in pieces), "no copy before encoding"


def test_a_two_dimensional_grid_is_walked_in_c_order():
    layout = ChunkLayout((4, 6), (2, 3))
    local = np.arange(24).reshape(4, 6)
    pieces = dict(chunks_of_box(layout, (0, 0), local))
    assert list(pieces) == ["c.0.0", "c.0.1", "c.1.0", "c.1.1"]
    assert np.array_equal(pieces["c.1.0"], local[2:, :3])


def test_an_edge_chunk_is_clipped_to_the_array():
    layout = ChunkLayout((5, 2), (2, 2))
    pieces = list(chunks_of_box(layout, (4, 0), np.ones((1, 2))))
    assert [(key, data.shape) for key, data in pieces] == [("c.2.0", (1, 2))]


def test_chunk_regions_index_the_shard_not_the_array():
    layout = ChunkLayout((8, 3), (2, 3))
    assert list(chunk_regions(layout, (4, 0), (4, 3))) == [
        ("c.2.0", (slice(0, 2), slice(0, 3))), ("c.3.0", (slice(2, 4), slice(0, 3)))]


def test_a_zero_dimensional_array_is_one_chunk_named_c():
    local = np.array(3.5)
    assert [(key, data.item()) for key, data in chunks_of_box(ChunkLayout((), ()), (), local)] == [("c", 3.5)]


def test_an_empty_box_has_no_chunks():
    assert list(chunks_of_box(ChunkLayout((6, 4), (2, 4)), (6, 0), np.empty((0, 4)))) == []


def test_the_legacy_separator_gives_slash_keys():
    layout = ChunkLayout((4, 2), (2, 2), 0, "/")
    assert [key for key, _ in chunks_of_box(layout, (0, 0), np.zeros((4, 2)))] == ["c/0/0", "c/1/0"]


def test_a_box_that_is_not_whole_chunks_is_refused():
    # chunk_layout_for_boxes never makes such a layout; if one did, two ranks would write one chunk
    layout = ChunkLayout((8, 4), (4, 4))
    with pytest.raises(AssertionError, match="not inside the saved box"):
        list(chunks_of_box(layout, (2, 0), np.zeros((2, 4))))


# -- inner chunk runs of an array-spanning shard ---------------------------------------------------------------------

SPANNING = ChunkLayout((10, 4), (10, 4), 2)  # 5 inner chunks of 2 rows x 4 columns: 32 bytes each at itemsize 4


def test_runs_are_whole_inner_chunks_of_about_run_bytes():
    runs = list(inner_chunk_runs(SPANNING, first_row=4, rows=6, itemsize=4, run_bytes=64))
    assert runs == [(2, slice(0, 4)), (4, slice(4, 6))]


def test_a_run_is_at_least_one_inner_chunk_however_small_run_bytes_is():
    runs = list(inner_chunk_runs(SPANNING, first_row=0, rows=4, itemsize=4, run_bytes=1))
    assert runs == [(0, slice(0, 2)), (1, slice(2, 4))]


def test_runs_cover_every_row_of_the_box_once():
    for first_row, rows in ((0, 10), (2, 8), (6, 3), (8, 2)):
        for run_bytes in (1, 32, 64, 100, 1 << 20):
            runs = list(inner_chunk_runs(SPANNING, first_row, rows, 4, run_bytes))
            covered = [r for _, part in runs for r in range(part.start, part.stop)]
            assert covered == list(range(rows)), (first_row, rows, run_bytes)
            assert all(first == (first_row + part.start) // 2 for first, part in runs)


def test_an_empty_box_has_no_runs():
    assert list(inner_chunk_runs(SPANNING, first_row=3, rows=0, itemsize=4, run_bytes=64)) == []


def test_a_box_starting_inside_an_inner_chunk_is_refused():
    with pytest.raises(AssertionError, match="not whole inner chunks"):
        list(inner_chunk_runs(SPANNING, first_row=3, rows=2, itemsize=4, run_bytes=64))
