"""layout.py: the chunk grid of a tensor from its saved boxes, and when one shard can span the array."""

from __future__ import annotations

import pytest

from dcp_zarr.format.layout import ChunkLayout, array_shard_layout, chunk_layout_for_boxes, chunk_key


def rows(*bounds: int, width: int = 64) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Boxes of whole rows between consecutive bounds."""
    return [((a, 0), (b - a, width)) for a, b in zip(bounds, bounds[1:])]


def test_the_gcd_grid_makes_every_fsdp_shard_one_chunk():
    layout = chunk_layout_for_boxes((1000, 64), rows(0, 334, 668, 1000), itemsize=4)
    assert layout.chunk_shape == (334, 64) and layout.grid_shape == (3, 1) and not layout.sharded


def test_an_uneven_split_across_ranks_is_one_shard_padded_to_whole_inner_chunks():
    boxes = rows(0, 334, 668, 1000)
    layout = array_shard_layout(chunk_layout_for_boxes((1000, 64), boxes, itemsize=4), boxes)
    assert layout == ChunkLayout((1000, 64), (1002, 64), 334)
    assert layout.spans_array and layout.grid_shape == (1, 1) and layout.inner_chunks_per_chunk == 3


def test_large_shards_keep_their_inner_chunks():
    boxes = rows(0, 2048, 4096, width=1024)
    base = chunk_layout_for_boxes((4096, 1024), boxes, itemsize=4)  # 8 MiB per rank: 1 MiB inner chunks
    assert base.inner_rows == 256
    assert array_shard_layout(base, boxes) == ChunkLayout((4096, 1024), (4096, 1024), 256)


def test_empty_shards_are_ignored():
    boxes = rows(0, 3, 6, 6, 6, width=2)  # 4 ranks, two of them empty
    layout = array_shard_layout(chunk_layout_for_boxes((6, 2), boxes, itemsize=4), boxes)
    assert layout == ChunkLayout((6, 2), (6, 2), 3)


@pytest.mark.parametrize("shape, boxes, why", [
    ((100, 8), rows(0, 100, width=8), "one box: the array is one chunk already"),
    ((100, 8), [((0, 0), (100, 4)), ((0, 4), (100, 4))], "a column split (tensor parallel)"),
    ((100, 8), rows(0, 40, 80, width=8), "rows 80..100 are in no box"),
    ((0, 8), [((0, 0), (0, 8)), ((0, 0), (0, 8))], "an empty array"),
    ((), [((), ()), ((), ())], "a scalar"),
])
def test_no_array_shard_where_boxes_do_not_tile_the_rows(shape, boxes, why):
    assert array_shard_layout(chunk_layout_for_boxes(shape, boxes, itemsize=4), boxes) is None, why


def test_chunk_keys_use_the_dot_separator_unless_the_layout_says_otherwise():
    assert chunk_key((1, 0)) == "c.1.0" and chunk_key(()) == "c"
    assert ChunkLayout((4, 4), (2, 4), 0, "/").chunk_key((1, 0)) == "c/1/0"
