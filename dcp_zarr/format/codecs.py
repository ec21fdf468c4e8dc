"""The codec table: every compression a save can write and a load can read, looked up by name as zarr-python looks
its codecs up (``zarr.registry``). The rest of dcp_zarr asks the table and never names a codec.

A row (``CodecEntry``) is what ``Compression(compressor=NAME)`` and ``--compression NAME`` take: its ``name``, the
zarr codec it writes (a ``Codec`` class: its zarr codec JSON, encode and decode, the most it adds to data that does
not compress) and its shuffle rule (the shuffle of an array by element size, for codecs that shuffle). A compressed
chunk's codec chain is ``bytes`` -> the codec -> ``crc32c`` (format/encoding.py), so the crc32c is of the stored,
compressed bytes: a corrupt chunk is refused before it reaches the decompressor, and ``verify`` checks a store
without decompressing it (docs/format.md, "Compression"; "Adding a codec" says what a new row needs).

Every row today is zarr v3's standard ``blosc`` codec, which zarr-python and TensorStore read without dcp_zarr.
Blosc shuffles the bytes or bits of each element before compressing, which groups the exponent bits of floats.
Measured on a model and its AdamW state after three steps (docs/compression.md, "Which compressor"), bit shuffle
then lz4, which codes no entropy, stores bfloat16 1.30x and float32 1.13x smaller, as zstd does after it, about
three times as fast (2.7-3.1 against 0.9-1.2 GB/s a thread): the default. zstd, which codes entropy, does best on
bfloat16 after a byte shuffle (1.34x; bit shuffle 1.30x), on float32 after a bit shuffle (1.12x), and on float8
unshuffled (1.24x; bit shuffle 1.14x). Torch-free.
"""

from __future__ import annotations

import abc
import dataclasses
import struct
from collections.abc import Callable
from typing import ClassVar

import numpy as np
from numcodecs import blosc

from dcp_zarr.errors import CorruptChunkError, MalformedMetadataError


class Codec(abc.ABC):
    """One array's compression, as its zarr.json names it: a ``Codec`` class is a zarr codec, an instance that codec
    configured for one array (hashable and compared by value: layouts hold it, and a load compares the manifest's
    with the zarr.json's)."""

    zarr_name: ClassVar[str]  # the "name" of its zarr codec JSON

    @classmethod
    @abc.abstractmethod
    def for_array(cls, compressor: str, level: int, itemsize: int, shuffle: str) -> Codec:
        """The codec a save writes for the row ``compressor`` at ``level`` on ``itemsize``-byte elements, with the
        row's ``shuffle`` for them (ignored by a codec that does not shuffle)."""

    @classmethod
    @abc.abstractmethod
    def from_json(cls, doc: dict, where: str) -> Codec:
        """The codec of a zarr.json's codec entry named ``zarr_name``; MalformedMetadataError naming ``where`` for
        one this version does not write."""

    @abc.abstractmethod
    def to_json(self) -> dict:
        """Its zarr codec JSON, as the array's zarr.json and its manifest entry hold it (byte for byte: stores
        written before stay readable and their files unchanged)."""

    @abc.abstractmethod
    def encode(self, data: np.ndarray) -> bytes:
        """The stored bytes of ``data`` (C-contiguous). Called on the IO threads: a codec that releases the GIL
        compresses on all of them at once."""

    @abc.abstractmethod
    def decode_into(self, stored, out: memoryview, where: str) -> None:
        """Decode ``stored`` into ``out`` (exactly its size); CorruptChunkError naming ``where`` otherwise."""

    @abc.abstractmethod
    def overhead(self, nbytes: int) -> int:
        """The most it adds to ``nbytes`` of data that does not compress: a stored chunk longer than that is refused
        before it is read (a shard index may point anywhere)."""

    @abc.abstractmethod
    def written_by(self) -> tuple[str, int]:
        """The name of the row of the table and the level that write it again (``Compression(*written_by())``)."""

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """Its name in messages and ``inspect``'s tables, ``blosc zstd``."""

    @property
    def description(self) -> str:
        """``blosc zstd level 1``."""
        return f"{self.label} level {self.written_by()[1]}"


# blosc's header, before the compressed blocks: version, version of the compressor's format, flags, typesize, then
# the uncompressed size, block size and compressed size as little-endian uint32
_BLOSC_HEADER = struct.Struct("<BBBBIII")
_BLOSC_SHUFFLES = {"noshuffle": blosc.NOSHUFFLE, "shuffle": blosc.SHUFFLE, "bitshuffle": blosc.BITSHUFFLE}


@dataclasses.dataclass(frozen=True)
class BloscCodec(Codec):
    """zarr v3's ``blosc`` codec; each of its rows is named by its blosc compressor (``cname``)."""

    cname: str
    clevel: int
    shuffle: str  # "noshuffle", "shuffle" or "bitshuffle"
    typesize: int

    zarr_name: ClassVar[str] = "blosc"

    @classmethod
    def for_array(cls, compressor: str, level: int, itemsize: int, shuffle: str) -> BloscCodec:
        return cls(compressor, level, shuffle, itemsize)

    def written_by(self) -> tuple[str, int]:
        return self.cname, self.clevel

    @property
    def label(self) -> str:
        return f"blosc {self.cname}"

    def to_json(self) -> dict:
        return {"name": "blosc", "configuration": {"cname": self.cname, "clevel": self.clevel,
                                                   "shuffle": self.shuffle, "typesize": self.typesize,
                                                   "blocksize": 0}}

    @classmethod
    def from_json(cls, doc, where: str) -> BloscCodec:
        try:
            config = doc["configuration"]
            codec = cls(config["cname"], config["clevel"], config["shuffle"], config["typesize"])
            extra = set(config) - {"cname", "clevel", "shuffle", "typesize", "blocksize"}
        except (KeyError, TypeError) as exc:
            raise MalformedMetadataError(f"{where}: blosc codec {doc!r} is malformed ({exc!r})") from None
        if (doc.get("name") != "blosc" or codec.cname not in _rows_of(cls) or type(codec.clevel) is not int
                or codec.shuffle not in _BLOSC_SHUFFLES or type(codec.typesize) is not int or codec.typesize < 1
                or extra):
            raise MalformedMetadataError(f"{where}: blosc codec {doc!r} is not one dcp_zarr reads")
        return codec

    def encode(self, data: np.ndarray) -> bytes:
        # its elements shuffled as typesize-byte units; numcodecs releases the GIL while blosc works
        return blosc.compress(data.reshape(-1).view(np.uint8), self.cname.encode(), self.clevel,
                              _BLOSC_SHUFFLES[self.shuffle], 0, typesize=self.typesize)

    def decode_into(self, stored, out: memoryview, where: str) -> None:
        """Decompress ``stored`` into ``out``, its sizes checked against blosc's header first."""
        if len(stored) < _BLOSC_HEADER.size:
            raise CorruptChunkError(f"{where}: compressed chunk of {len(stored)} bytes has no blosc header")
        _, _, _, _, nbytes, _, cbytes = _BLOSC_HEADER.unpack_from(stored)
        if nbytes != len(out) or cbytes != len(stored):
            raise CorruptChunkError(f"{where}: blosc header says {nbytes} bytes compressed into {cbytes}; the chunk "
                                    f"holds {len(out)} bytes stored in {len(stored)}")
        try:
            blosc.decompress(stored, out)
        except RuntimeError as exc:
            raise CorruptChunkError(f"{where}: blosc cannot decompress it ({exc})") from None

    def overhead(self, nbytes: int) -> int:
        return blosc.MAX_OVERHEAD  # data that does not compress is stored as it is, after blosc's header


def bit_shuffle(itemsize: int) -> str:
    """Every element's bits grouped by position: what a compressor that codes no entropy gains most from."""
    return "bitshuffle"


def entropy_coder_shuffle(itemsize: int) -> str:
    """Before an entropy coder: one-byte elements unshuffled, two-byte ones byte shuffled, wider ones bit shuffled
    (the module docstring's measurements)."""
    return {1: "noshuffle", 2: "shuffle"}.get(itemsize, "bitshuffle")


@dataclasses.dataclass(frozen=True)
class CodecEntry:
    """A row of the table: the compressor ``name`` a save may ask for, the zarr codec it writes, and its shuffle
    by element size."""

    name: str
    kind: type[Codec]
    shuffle: Callable[[int], str] = bit_shuffle

    def codec(self, level: int, itemsize: int) -> Codec:
        """The codec of an array of ``itemsize``-byte elements compressed at ``level``."""
        return self.kind.for_array(self.name, level, itemsize, self.shuffle(itemsize))


# The table, in the order messages list it. Adding a codec adds its row here (and its Codec class above, if zarr
# names it anew): docs/format.md, "Adding a codec".
CODECS: dict[str, CodecEntry] = {entry.name: entry for entry in (
    CodecEntry("zstd", BloscCodec, entropy_coder_shuffle),
    CodecEntry("lz4", BloscCodec),
    CodecEntry("lz4hc", BloscCodec),
    CodecEntry("blosclz", BloscCodec),
    CodecEntry("zlib", BloscCodec, entropy_coder_shuffle),
)}


def _rows_of(kind: type[Codec]) -> list[str]:
    return [entry.name for entry in CODECS.values() if entry.kind is kind]


def codec_kind(zarr_name: object) -> type[Codec] | None:
    """The Codec class of a zarr codec named ``zarr_name``, or None where no row of the table writes it."""
    return next((entry.kind for entry in CODECS.values() if entry.kind.zarr_name == zarr_name), None)


def codec_from_json(doc, where: str) -> Codec:
    """The codec of a zarr codec JSON document (an array's zarr.json entry, a manifest entry's ``codec``);
    MalformedMetadataError naming ``where`` for one no row of the table writes."""
    kind = codec_kind(doc.get("name") if isinstance(doc, dict) else None)
    if kind is None:
        raise MalformedMetadataError(f"{where}: codec {doc!r} is not one dcp_zarr reads")
    return kind.from_json(doc, where)
