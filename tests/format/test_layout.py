"""format/chunk_layout.py: node paths of state-dict keys, the chunk grid of a tensor from its saved boxes, and when one
shard can span the array."""

from __future__ import annotations

import pytest

from dcp_zarr.errors import InvalidKeyError
from dcp_zarr.format.chunk_layout import (
    ChunkLayout,
    array_shard_layout,
    check_node_name,
    chunk_key,
    chunk_layout_for_boxes,
    dimension_names,
    node_path,
    parent_groups,
)


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


# -- node paths ------------------------------------------------------------------------------------------------------


def test_a_state_dict_path_becomes_a_slash_joined_node_path_with_list_indices_as_decimals():
    assert node_path(("optim", "param_groups", 0, "lr")) == "optim/param_groups/0/lr"


@pytest.mark.parametrize("name, why", [
    ("", "empty component"),
    ("..", "escape"),
    (".", "escape"),
    ("__meta", "reserved by zarr"),
    ("a/b", "contains '/'"),
    ("a\\b", "contains '/'"),
    ("tab\there", "control character"),
    ("ZARR.JSON", "collides with zarr's own keys"),
    ("x" * 256, "256 bytes"),
    ("é" * 128, "256 bytes"),  # counted in UTF-8 bytes, not characters
])
def test_a_component_that_could_escape_or_break_the_store_is_refused(name, why):
    with pytest.raises(InvalidKeyError, match=why):
        node_path(("model", name), key="model." + name)


def test_a_component_of_255_bytes_is_allowed():
    assert check_node_name("x" * 255, "k") == "x" * 255


def test_an_empty_path_is_refused():
    with pytest.raises(InvalidKeyError, match="empty path"):
        node_path(())


def test_parent_groups_are_listed_outermost_first_without_the_root():
    assert parent_groups("optim/state/w/exp_avg") == ["optim", "optim/state", "optim/state/w"]
    assert parent_groups("step") == []


def test_dimension_names_carry_the_arrays_full_path_so_no_two_arrays_share_one():
    assert dimension_names("model/w", 2) == ["model/w.dim0", "model/w.dim1"]
    assert dimension_names("step", 0) == []


# -- the chunk grid --------------------------------------------------------------------------------------------------


def test_edge_chunks_count_in_the_grid_and_their_boxes_are_clipped_to_the_array():
    layout = ChunkLayout((5, 7), (2, 3))
    assert layout.grid_shape == (3, 3) and layout.chunk_count == 9
    assert layout.chunk_box((2, 2)) == ((4, 6), (1, 1))
    assert list(layout.all_chunks())[:4] == [(0, 0), (0, 1), (0, 2), (1, 0)]


def test_chunks_in_box_are_the_chunks_it_touches_and_none_for_an_empty_box():
    layout = ChunkLayout((8, 8), (4, 4))
    assert list(layout.chunks_in_box((3, 4), (2, 4))) == [(0, 1), (1, 1)]
    assert list(layout.chunks_in_box((3, 4), (0, 4))) == []


def test_a_zero_dimensional_array_is_one_chunk_at_the_empty_coordinates():
    layout = ChunkLayout((), ())
    assert list(layout.all_chunks()) == [()] and layout.chunk_count == 1 and layout.chunk_key(()) == "c"


def test_a_chunk_over_the_inner_chunk_target_is_split_into_inner_chunks_of_a_divisor_of_its_rows():
    layout = chunk_layout_for_boxes((1200, 256), rows(0, 600, 1200, width=256), itemsize=4, inner_target_bytes=64 << 10)
    assert layout.chunk_shape == (600, 256)
    assert layout.sharded and 600 % layout.inner_rows == 0 and layout.inner_rows * 256 * 4 <= 64 << 10
    assert layout.inner_chunk_shape == (layout.inner_rows, 256)


def test_a_chunk_whose_rows_are_prime_stays_whole_rather_than_splitting_into_single_rows():
    layout = chunk_layout_for_boxes((1009, 256), [((0, 0), (1009, 256))], itemsize=4, inner_target_bytes=64 << 10)
    assert layout.chunk_shape == (1009, 256) and not layout.sharded


def test_a_column_split_makes_column_chunks():
    layout = chunk_layout_for_boxes((6, 8), [((0, 0), (6, 4)), ((0, 4), (6, 4))], itemsize=4)
    assert layout.chunk_shape == (6, 4) and layout.grid_shape == (1, 2)
