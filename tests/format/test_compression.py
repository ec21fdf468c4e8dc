"""Compressed arrays (issue 43): zarr v3's blosc codec inside each inner chunk, a crc32c of the stored bytes, read
back exactly by dcp_zarr, zarr-python and TensorStore, at any region; refused by name when corrupt or unknown."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorstore as ts
import torch
import torch.distributed.checkpoint as dcp
import zarr

from dcp_zarr import Compression, CorruptChunkError, ZarrReader, ZarrWriter
from dcp_zarr.errors import MalformedMetadataError
from dcp_zarr.format import manifest as manifest_module
from dcp_zarr.format.chunk_layout import ChunkLayout
from dcp_zarr.format.codecs import BloscCodec
from dcp_zarr.format.encoding import array_metadata, encode_chunk, layout_from_array_metadata
from dcp_zarr.format.manifest import FORMAT_VERSION
from dcp_zarr.format.torch_arrays import tensor_as_numpy
from dcp_zarr.offline import open_checkpoint
from dcp_zarr.storage import open_storage
from dcp_zarr.store_io.chunks import RegionReader
from tests.support.states import random_bits
from tests.support.stores import drop_root_copies

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def weights(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values drawn as trained weights are, N(0, 0.02), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=g) * 0.02
    return (values * 20).to(dtype) if dtype.itemsize == 1 else values.to(dtype)  # float8: in its normal range


def state_dict() -> dict[str, torch.Tensor]:
    sd = {str(dtype).removeprefix("torch."): weights((96, 72), dtype, i) for i, dtype in enumerate(FLOATS)}
    sd["edge"] = weights((37, 5), torch.float32, 9)  # 37 rows: the last inner chunk is padded
    sd["ints"] = torch.arange(96 * 72, dtype=torch.int64).reshape(96, 72)
    sd["step"] = torch.tensor(7.0)
    return sd


ALL_CANDIDATES = Compression(min_bytes=0, min_ratio=0)  # every float array of 1 or more dims is compressed


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("compressed") / "ckpt.zarr")
    dcp.save(state_dict(), storage_writer=ZarrWriter(path, compression=ALL_CANDIDATES, inner_chunk_bytes=2048),
             no_dist=True)
    return path


def zarr_json(path: str, node: str) -> dict:
    with open(os.path.join(path, node, "zarr.json")) as f:
        return json.load(f)


def inner_codecs(doc: dict) -> list[dict]:
    codecs = doc["codecs"]
    return codecs[0]["configuration"]["codecs"] if codecs[0]["name"] == "sharding_indexed" else codecs


def test_float_arrays_are_blosc_then_crc32c_and_the_rest_as_they_are(store):
    for dtype in FLOATS:
        name = str(dtype).removeprefix("torch.")
        codecs = inner_codecs(zarr_json(store, name))
        assert [c["name"] for c in codecs] == ["bytes", "blosc", "crc32c"], name
        config = codecs[1]["configuration"]
        assert config["typesize"] == dtype.itemsize and config["cname"] == "lz4" and config["clevel"] == 1
        assert config["shuffle"] == "bitshuffle", name
    for name in ("ints", "step"):
        assert all(c["name"] != "blosc" for c in inner_codecs(zarr_json(store, name))), name
    with open(os.path.join(store, "zarr.json")) as f:
        assert json.load(f)["attributes"]["dcp_zarr"]["format_version"] == FORMAT_VERSION


def test_dcp_zarr_loads_every_value_exactly(store):
    expected = state_dict()
    target = {k: torch.zeros_like(v) for k, v in expected.items()}

    dcp.load(target, storage_reader=ZarrReader(store), no_dist=True)

    for key, tensor in expected.items():
        assert tensor_as_numpy(target[key]).tobytes() == tensor_as_numpy(tensor).tobytes(), key


def test_the_compressed_arrays_are_smaller_than_their_data(store):
    sizes = {}
    for name in ("bfloat16", "float32"):
        directory = os.path.join(store, name)
        sizes[name] = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
                          if f != "zarr.json")
    assert sizes["bfloat16"] < 96 * 72 * 2 / 1.2, sizes
    assert sizes["float32"] < 96 * 72 * 4 / 1.05, sizes


def test_zarr_python_reads_every_compressed_array_exactly(store):
    group = zarr.open_group(store, mode="r")
    for key, tensor in state_dict().items():
        assert np.asarray(group[key][...]).tobytes() == tensor_as_numpy(tensor).tobytes(), key
    region = np.asarray(group["float32"][17:61, 5:40])
    assert region.tobytes() == tensor_as_numpy(state_dict()["float32"][17:61, 5:40]).copy().tobytes()


def test_tensorstore_reads_every_compressed_array_exactly(store):
    for key, tensor in state_dict().items():
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(store, key)}},
                        read=True).result()
        data = array.read().result()
        assert data.tobytes() == tensor_as_numpy(tensor).tobytes(), key


@pytest.mark.slow
def test_zarr_python_without_dcp_zarr_imported_reads_the_float32_array(store):
    program = ("import sys, zarr, numpy as np; a = zarr.open_array(sys.argv[1] + '/float32', mode='r')[...]; "
               "assert 'dcp_zarr.writer' not in sys.modules; np.save(sys.argv[2], a)")
    out = os.path.join(os.path.dirname(store), "read.npy")
    subprocess.run([sys.executable, "-c", program, store, out], check=True, timeout=120)
    assert np.load(out).tobytes() == tensor_as_numpy(state_dict()["float32"]).tobytes()


def test_any_region_reads_exactly_and_only_the_inner_chunks_it_needs(store):
    layout = layout_from_array_metadata(zarr_json(store, "bfloat16"), "bfloat16")
    expected = tensor_as_numpy(state_dict()["bfloat16"])
    reader = RegionReader(open_storage(store), "bfloat16", layout, expected.dtype)
    assert layout.codec is not None and layout.inner_chunks_per_chunk > 4
    whole = reader.read_into([0, 0], np.empty_like(expected))

    for offsets, shape in [((0, 0), (96, 72)), ((13, 7), (30, 50)), ((95, 71), (1, 1)), ((40, 0), (7, 72))]:
        out = np.empty(shape, dtype=expected.dtype)
        fetched = reader.read_into(list(offsets), out)
        window = expected[offsets[0]: offsets[0] + shape[0], offsets[1]: offsets[1] + shape[1]]
        assert out.tobytes() == window.tobytes(), offsets
        if shape[0] < 10:
            assert fetched < whole / 3, (offsets, fetched, whole)


def _first_shard(path: str, node: str) -> str:
    return os.path.join(path, node, sorted(f for f in os.listdir(os.path.join(path, node)) if f != "zarr.json")[0])


def test_a_flipped_byte_in_a_compressed_chunk_is_refused_naming_it(store, tmp_path):
    import shutil
    copy = str(tmp_path / "copy.zarr")
    shutil.copytree(store, copy)
    shard = _first_shard(copy, "float32")
    with open(shard, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))

    with pytest.raises(CorruptChunkError, match=r"'float32' shard c\.0\.0 inner chunk 0: crc32c mismatch"):
        open_checkpoint(copy).read("float32")


def test_a_shard_index_giving_a_compressed_chunk_more_than_it_can_hold_is_refused_unread(tmp_path):
    layout = ChunkLayout((8, 4), (8, 4), 4).compressed(BloscCodec("zstd", 1, "bitshuffle", 4))
    data = np.arange(32, dtype="<f4").reshape(8, 4)
    buffers = encode_chunk(data, layout)
    blob = bytearray(b"".join(bytes(b) for b in buffers))
    index = np.frombuffer(blob[-36:-4], dtype="<u8").reshape(2, 2).copy()
    index[0, 1] = 1 << 40
    blob[-36:-4] = index.tobytes()
    from dcp_zarr.format.encoding import checksum
    blob[-4:] = checksum(bytes(blob[-36:-4]))
    storage = open_storage(str(tmp_path))
    storage.write("a/c.0.0", [bytes(blob)])

    with pytest.raises(CorruptChunkError, match="stored length 1099511627776 is not that of a compressed chunk"):
        RegionReader(storage, "a", layout, np.dtype("<f4")).read_into([0, 0], np.empty((8, 4), "<f4"))


def test_a_chunk_whose_blosc_header_disagrees_with_its_shape_is_refused():
    codec = BloscCodec("zstd", 1, "bitshuffle", 4)
    stored = codec.encode(np.zeros(16, dtype="<f4"))

    with pytest.raises(CorruptChunkError, match="blosc header says 64 bytes"):
        codec.decode_into(stored, memoryview(bytearray(128)), "array 'x' shard c.0 inner chunk 0")


@pytest.mark.parametrize("codecs, message", [
    ([{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip", "configuration": {"level": 1}},
      {"name": "crc32c"}], "zarr.json has codecs"),
    ([{"name": "bytes", "configuration": {"endian": "little"}},
      {"name": "blosc", "configuration": {"cname": "snappy", "clevel": 1, "shuffle": "shuffle", "typesize": 4,
                                          "blocksize": 0}}, {"name": "crc32c"}], "not one dcp_zarr reads"),
])
def test_an_array_with_a_codec_dcp_zarr_does_not_write_is_refused_by_name(store, tmp_path, codecs, message):
    import shutil
    copy = str(tmp_path / "copy.zarr")
    shutil.copytree(store, copy)
    doc = zarr_json(copy, "float32")
    doc["codecs"][0]["configuration"]["codecs"] = codecs
    with open(os.path.join(copy, "float32", "zarr.json"), "w") as f:
        json.dump(doc, f)
    drop_root_copies(copy)  # the array's own zarr.json is then the one read

    with pytest.raises(MalformedMetadataError, match=message) as caught:
        open_checkpoint(copy).read("float32")
    assert "float32" in str(caught.value)


def test_a_reader_that_knows_formats_up_to_4_refuses_a_compressed_store_by_its_version(store, monkeypatch):
    written = manifest_module.FORMAT_VERSION
    monkeypatch.setattr(manifest_module, "READABLE_VERSIONS", (1, 2, 3, 4))
    monkeypatch.setattr(manifest_module, "FORMAT_VERSION", 4)

    refused = f"format version {written} is newer than .* reads .versions 1, 2, 3, 4"
    with pytest.raises(MalformedMetadataError, match=refused):
        open_checkpoint(store)


def test_without_compression_a_save_writes_no_codec(tmp_path):
    path = str(tmp_path / "plain.zarr")
    dcp.save(state_dict(), storage_writer=ZarrWriter(path, inner_chunk_bytes=2048), no_dist=True)

    with open(os.path.join(path, "zarr.json")) as f:
        document = json.load(f)["attributes"]["dcp_zarr"]
    assert document["format_version"] == FORMAT_VERSION
    assert all("codec" not in entry for entry in document["entries"].values())
    for key in state_dict():
        assert all(c["name"] != "blosc" for c in inner_codecs(zarr_json(path, key))), key


def test_data_that_does_not_compress_is_stored_as_it_is(tmp_path):
    path = str(tmp_path / "c.zarr")
    sd = {"noise": random_bits((256, 256), torch.float32, seed=3), "weights": weights((256, 256), torch.bfloat16)}
    dcp.save(sd, storage_writer=ZarrWriter(path, compression="zstd"), no_dist=True)

    assert all(c["name"] != "blosc" for c in inner_codecs(zarr_json(path, "noise")))
    assert [c["name"] for c in inner_codecs(zarr_json(path, "weights"))] == ["bytes", "blosc", "crc32c"]
    assert open_checkpoint(path).entries["noise"].codec is None


def test_small_arrays_are_stored_as_they_are(tmp_path):
    path = str(tmp_path / "c.zarr")
    sd = {"small": weights((100, 100), torch.float32), "large": weights((200, 200), torch.float32)}  # 40 KB, 160 KB
    dcp.save(sd, storage_writer=ZarrWriter(path, compression=Compression(min_bytes=64 << 10)), no_dist=True)

    entries = open_checkpoint(path).entries
    assert entries["small"].codec is None and entries["large"].codec is not None


@pytest.mark.parametrize("value, message", [
    (5, "ZarrWriter\\(compression=5\\): pass None, True"),
    ("gzip", "Compression\\(compressor='gzip'\\): the compressors are zstd, lz4"),
])
def test_a_compression_it_cannot_write_is_refused_naming_it(value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        ZarrWriter("/tmp/unused.zarr", compression=value)


@pytest.mark.parametrize("options, message", [
    ({"level": 0}, "level=0"), ({"level": 10}, "level=10"), ({"min_bytes": -1}, "min_bytes=-1"),
    ({"min_ratio": -0.5}, "min_ratio=-0.5"), ({"compressor": "brotli"}, "compressor='brotli'"),
])
def test_compression_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        Compression(**options)


@pytest.mark.parametrize("compressor, shuffles", [
    ("lz4", {1: "bitshuffle", 2: "bitshuffle", 4: "bitshuffle", 8: "bitshuffle"}),
    ("zstd", {1: "noshuffle", 2: "shuffle", 4: "bitshuffle", 8: "bitshuffle"}),
])
def test_the_shuffle_follows_the_compressor_and_the_element_size(compressor, shuffles):
    """docs/compression.md, "Which compressor": what each measured best on a model and its AdamW state."""
    for itemsize, shuffle in shuffles.items():
        assert Compression(compressor).codec(itemsize) == BloscCodec(compressor, 1, shuffle, itemsize)


def test_compression_true_is_the_default_compression():
    assert Compression.of(True) == Compression() == Compression("lz4", 1)
    assert Compression.of(None) is None and Compression.of(False) is None


def test_the_layout_read_back_from_a_compressed_zarr_json_is_the_one_written():
    layout = ChunkLayout((10, 3), (5, 3), 0).compressed(BloscCodec("lz4", 1, "bitshuffle", 2))
    doc = array_metadata(layout, "bfloat16", 2, node="w")

    assert layout.sharded and layout.inner_rows == 5 and not layout.fixed_offsets
    assert layout_from_array_metadata(doc, "w") == layout
