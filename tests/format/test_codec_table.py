"""The codec table (format/codecs.py): every row writes the codec JSON it reads back and decodes what it encodes
within its overhead; and a row added to the table alone (docs/format.md, "Adding a codec") is saved, loaded, verified,
inspected and re-saved by dcp_zarr, and read by zarr-python, with nothing else changed."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from numcodecs import zstd

from dcp_zarr import Compression, CorruptChunkError, ZarrReader, ZarrWriter
from dcp_zarr.errors import MalformedMetadataError
from dcp_zarr.format.codecs import CODECS, Codec, CodecEntry, codec_from_json
from dcp_zarr.format.compression import COMPRESSIBLE_DTYPES
from dcp_zarr.offline import open_checkpoint
from dcp_zarr.tools.inspection import format_summary, summarize
from dcp_zarr.tools.resave import zarr_to_zarr
from dcp_zarr.tools.verify import verify_checkpoint

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

ITEMSIZES = (1, 2, 4, 8)  # of COMPRESSIBLE_DTYPES: float8, (b)float16, float32, float64


def test_the_item_sizes_are_those_of_every_dtype_a_save_compresses():
    sizes = {getattr(torch, name.removeprefix("torch.")).itemsize for name in COMPRESSIBLE_DTYPES}
    assert sizes == set(ITEMSIZES)


@pytest.mark.parametrize("name", list(CODECS))
def test_every_row_reads_back_the_codec_json_it_writes(name):
    for itemsize in ITEMSIZES:
        codec = Compression(name, level=3).codec(itemsize)
        assert codec_from_json(codec.to_json(), "w") == codec
        assert codec.written_by() == (name, 3)


@pytest.mark.parametrize("name", list(CODECS))
def test_every_row_decodes_what_it_encodes_and_stays_within_its_overhead(name):
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)  # does not compress
    for itemsize in ITEMSIZES:
        codec = Compression(name).codec(itemsize)
        stored = codec.encode(noise.view(f"u{itemsize}"))
        assert len(stored) <= noise.nbytes + codec.overhead(noise.nbytes)
        out = bytearray(noise.nbytes)
        codec.decode_into(stored, memoryview(out), "w")
        assert bytes(out) == noise.tobytes()


@pytest.mark.parametrize("doc", [{"name": "gzip", "configuration": {"level": 1}}, {"configuration": {}}, "blosc"])
def test_a_codec_no_row_writes_is_refused_by_name(doc):
    with pytest.raises(MalformedMetadataError, match=r"^entry 'w': codec .* is not one dcp_zarr reads"):
        codec_from_json(doc, "entry 'w'")


@dataclasses.dataclass(frozen=True)
class ZstdCodec(Codec):
    """zarr v3's ``zstd`` codec, unshuffled: what docs/format.md's "Adding a codec" adds, as it would be added."""

    zstd_level: int

    zarr_name: ClassVar[str] = "zstd"

    @classmethod
    def for_array(cls, compressor, level, itemsize, shuffle):
        return cls(level)

    @classmethod
    def from_json(cls, doc, where):
        config = doc.get("configuration", {})
        if set(config) != {"level", "checksum"} or type(config["level"]) is not int or config["checksum"] is not False:
            raise MalformedMetadataError(f"{where}: zstd codec {doc!r} is not one dcp_zarr reads")
        return cls(config["level"])

    def to_json(self):
        return {"name": "zstd", "configuration": {"level": self.zstd_level, "checksum": False}}

    def encode(self, data):
        return zstd.compress(data.reshape(-1).view(np.uint8), self.zstd_level)

    def decode_into(self, stored, out, where):
        data = zstd.decompress(bytes(stored))
        if len(data) != len(out):
            raise CorruptChunkError(f"{where}: zstd gives {len(data)} bytes; the chunk holds {len(out)}")
        out[:] = data

    def overhead(self, nbytes):
        return (nbytes >> 8) + (((128 << 10) - nbytes) >> 11 if nbytes < 128 << 10 else 0) + 32  # ZSTD_compressBound

    def written_by(self):
        return "plain-zstd", self.zstd_level

    @property
    def label(self):
        return "zstd"


@pytest.fixture
def plain_zstd(monkeypatch):
    monkeypatch.setitem(CODECS, "plain-zstd", CodecEntry("plain-zstd", ZstdCodec))


def trained(shape, dtype, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def test_a_row_added_to_the_table_alone_is_saved_loaded_verified_inspected_and_read_by_zarr(plain_zstd, tmp_path):
    state = {"w": trained((256, 128), torch.bfloat16, 0), "f": trained((64, 300), torch.float32, 1),
             "ids": torch.arange(4096).reshape(64, 64)}
    path = str(tmp_path / "c.zarr")
    dcp.save(state, storage_writer=ZarrWriter(path, compression=Compression("plain-zstd", level=3, min_bytes=0,
                                                                             min_ratio=0), inner_chunk_bytes=16384),
             no_dist=True)

    ckpt = open_checkpoint(path)
    assert ckpt.entries["w"].codec == ckpt.entries["f"].codec == {"name": "zstd",
                                                                  "configuration": {"level": 3, "checksum": False}}
    assert ckpt.entries["ids"].codec is None
    loaded = {name: torch.zeros_like(t) for name, t in state.items()}
    dcp.load(loaded, storage_reader=ZarrReader(path), no_dist=True)
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    assert np.array_equal(zarr.open_array(path, path="f", mode="r")[:], state["f"].numpy())

    assert verify_checkpoint(ckpt).ok
    assert "2 of 3 tensors compressed (zstd level 3)" in format_summary(summarize(ckpt))

    copy = str(tmp_path / "copy.zarr")
    zarr_to_zarr(path, copy)  # keeps the source's compression: its row and level
    assert open_checkpoint(copy).entries["w"].codec == ckpt.entries["w"].codec


def test_a_store_with_a_codec_this_version_has_no_row_for_is_refused_at_open_naming_it(monkeypatch, tmp_path):
    path = str(tmp_path / "c.zarr")
    with monkeypatch.context() as added:
        added.setitem(CODECS, "plain-zstd", CodecEntry("plain-zstd", ZstdCodec))
        dcp.save({"w": trained((256, 128), torch.bfloat16, 0)}, no_dist=True,
                 storage_writer=ZarrWriter(path, compression=Compression("plain-zstd", min_bytes=0, min_ratio=0)))

    with pytest.raises(MalformedMetadataError, match=r"'w'.*codec \{'name': 'zstd'.* is not one dcp_zarr reads"):
        open_checkpoint(path)
