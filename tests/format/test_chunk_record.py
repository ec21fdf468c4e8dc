"""The chunk record of incremental saves (format/chunk_record.py) and their layout (one object per chunk)."""

import base64

import numpy as np
import pytest

from dcp_zarr.format.chunk_layout import ChunkLayout, chunk_layout_for_boxes
from dcp_zarr.format.chunk_record import (
    ArrayRecord,
    ChunkRecord,
    StoredChunk,
    array_record,
    data_digest,
    metadata_digest,
)


def _chunk(seed: int) -> StoredChunk:
    rng = np.random.default_rng(seed)
    return StoredChunk(rng.bytes(16), int(rng.integers(1, 1 << 40)), rng.bytes(4))


def test_a_record_round_trips_through_json():
    record = ChunkRecord({"model/w": ArrayRecord("ab" * 16, (_chunk(1), _chunk(2))), "model/b": ArrayRecord("cd", ()),
                          "model/f": ArrayRecord("ef", (_chunk(3),), unchanged=True)},
                         {"path": "/ckpt/step-1", "save_id": "x", "reused_chunks": 1, "reused_bytes": 9})
    assert ChunkRecord.from_json(record.to_json(), "here") == record
    assert record.unchanged_whole() == {"model/f"}
    assert "unchanged" not in record.to_json()["arrays"]["model/w"], "written only where true: records stay as small"


def test_each_chunk_costs_28_bytes_before_base64():
    document = ArrayRecord("m", tuple(_chunk(i) for i in range(5))).to_json()
    assert len(base64.b64decode(document["chunks"])) == 5 * 28


@pytest.mark.parametrize("document, said", [
    ({"hash": "crc32c", "arrays": {}}, "not an xxh3_128 record"),
    ({"hash": "xxh3_128", "arrays": []}, "not an xxh3_128 record"),
    ({"hash": "xxh3_128", "arrays": {"w": {"metadata": "m", "chunks": "!!!"}}}, "malformed"),
    ({"hash": "xxh3_128", "arrays": {"w": {"metadata": "m", "chunks": base64.b64encode(b"x" * 27).decode()}}},
     "not a multiple of 28"),
    ({"hash": "xxh3_128", "arrays": {"w": {"chunks": ""}}}, "needs 'metadata' and 'chunks'"),
    ({"hash": "xxh3_128", "arrays": {"w": {"metadata": "m", "chunks": "", "unchanged": "yes"}}},
     "'unchanged' is 'yes', not true or false"),
])
def test_a_malformed_record_is_refused_naming_the_store(document, said):
    with pytest.raises(ValueError, match=said) as raised:
        ChunkRecord.from_json(document, "/ckpt/step-1")
    assert "/ckpt/step-1" in str(raised.value)


def test_an_array_is_recorded_only_when_every_chunk_was_reported():
    chunks = [(i, _chunk(i)) for i in range(4)]
    assert array_record("m", 4, reversed(chunks)) == ArrayRecord("m", tuple(c for _, c in chunks))
    assert array_record("m", 4, chunks[:3]) is None
    assert array_record("m", 3, chunks) is None  # a chunk outside the grid: not this array's


def test_digests_tell_one_changed_bit():
    data = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
    changed = data.copy()
    changed.view(np.uint32)[12345] ^= 1
    assert data_digest(data.tobytes()) == data_digest(data.copy().tobytes())
    assert data_digest(data.tobytes()) != data_digest(changed.tobytes())
    assert len(data_digest(b"")) == 16
    assert metadata_digest('{"shape": [4]}') != metadata_digest('{"shape": [5]}')


def test_one_object_per_chunk_keeps_every_chunk_inside_one_saved_box():
    boxes = [((0, 0), (3000, 256)), ((3000, 0), (3000, 256))]  # two ranks' row blocks of 6000 x 256 fp32
    layout = chunk_layout_for_boxes((6000, 256), boxes, 4, 1 << 20)
    assert layout.sharded  # each rank's box is one shard of inner chunks
    per_chunk = layout.one_object_per_chunk()
    assert not per_chunk.sharded and per_chunk.chunk_shape == layout.inner_chunk_shape
    for coords in per_chunk.all_chunks():
        (row, _), (rows, _) = per_chunk.chunk_box(coords)
        assert any(o[0] <= row and row + rows <= o[0] + s[0] for o, s in boxes)


def test_a_layout_without_inner_chunks_is_already_one_object_per_chunk():
    layout = ChunkLayout((10, 4), (5, 4))
    assert layout.one_object_per_chunk() is layout


@pytest.mark.parametrize("rows, most, shard_rows", [
    (3000, 16, 3000),  # a rank's 3000 rows: 12 inner chunks of 250; at most 16: one shard, as before
    (3000, 4, 1000),  # 12 inner chunks, at most 4 to a shard: 3 shards a rank
    (3000, 5, 1000),  # at most 5: the most that divides 12 is 4
    (3000, 1, 250),  # one inner chunk to a shard: one object per chunk
])
def test_an_array_that_changed_whole_is_cut_into_shards_of_at_most_so_many_inner_chunks(rows, most, shard_rows):
    boxes = [((0, 0), (rows, 256)), ((rows, 0), (rows, 256))]
    layout = chunk_layout_for_boxes((2 * rows, 256), boxes, 4, 250 << 10)
    assert layout.inner_chunks_per_chunk == 12
    cut = layout.shards_of_at_most(most)
    assert cut.chunk_shape == (shard_rows, 256)
    if most >= 12:
        assert cut is layout
    if most == 1:
        assert cut == layout.one_object_per_chunk()
    assert cut.sharded == (most > 1) and cut.inner_chunk_shape == layout.inner_chunk_shape
    for coords in cut.all_chunks():
        (row, _), (count, _) = cut.chunk_box(coords)
        assert any(o[0] <= row and row + count <= o[0] + s[0] for o, s in boxes)
