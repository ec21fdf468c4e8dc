"""Lossless compression of arrays: what a save may ask for (``Compression``), and the one codec it writes
(``BloscCodec``): zarr v3's standard ``blosc`` codec between ``bytes`` and ``crc32c``, which zarr-python and
TensorStore read without dcp_zarr.

The codec chain of a compressed chunk (or inner chunk) is ``bytes`` -> ``blosc`` -> ``crc32c``: the crc32c is of the
stored, compressed bytes, so a corrupt chunk is refused before it reaches the decompressor, and ``verify`` checks a
store without decompressing it (docs/format.md, "Compression").

Blosc, not plain ``zstd``: it shuffles the bytes or bits of each element before compressing, which groups the
exponent bits of floats. Measured on a model and its AdamW state after three steps (docs/compression.md, "Which
compressor"), bit shuffle then lz4, which codes no entropy, stores bfloat16 1.30x and float32 1.13x smaller, as
zstd does after it, about three times as fast (2.7-3.1 against 0.9-1.2 GB/s a thread): the default. zstd, which
codes entropy, does best on bfloat16 after a byte shuffle (1.34x; bit shuffle 1.30x), on float32 after a bit
shuffle (1.12x), and on float8 unshuffled (1.24x; bit shuffle 1.14x). Torch-free.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import NamedTuple

import numpy as np
from numcodecs import blosc

from dcp_zarr.errors import CorruptChunkError, MalformedMetadataError

# blosc's compressors, as zarr v3's blosc codec names them
COMPRESSORS = ("zstd", "lz4", "lz4hc", "blosclz", "zlib")
# The shuffle before an entropy coder, by element size (the module docstring); other compressors bit-shuffle all.
_ENTROPY_CODER_SHUFFLES = {"zstd": {1: "noshuffle", 2: "shuffle"}, "zlib": {1: "noshuffle", 2: "shuffle"}}
# Torch dtypes whose arrays a save compresses: floating point only. Integer and bool tensors (step counters, masks,
# token ids) are small or already dense, and stored as they are.
COMPRESSIBLE_DTYPES = frozenset({
    "torch.float16", "torch.bfloat16", "torch.float32", "torch.float64", "torch.float8_e4m3fn", "torch.float8_e5m2"})
# blosc's header, before the compressed blocks: version, version of the compressor's format, flags, typesize, then
# the uncompressed size, block size and compressed size as little-endian uint32
_HEADER = struct.Struct("<BBBBIII")
BLOSC_OVERHEAD = blosc.MAX_OVERHEAD  # the most blosc adds to data that does not compress: its header


@dataclasses.dataclass(frozen=True)
class Compression:
    """What ``ZarrWriter(compression=...)`` compresses, and how.

    Args:
        compressor: blosc's compressor (``COMPRESSORS``): ``"lz4"`` (after blosc's bit shuffle) is three times as
            fast as ``"zstd"``, which stores bfloat16 and float8 a few percent smaller.
        level: the compressor's level, 1 (fastest) to 9.
        min_bytes: arrays smaller than this are stored as they are (a bias, a norm's weight: little to gain).
        min_ratio: a float array is compressed only where a sample of each rank's part of it shrinks at least this
            much (``planning/compression_sample.py``); data that does not compress is stored as it is. 0: every
            candidate is compressed, unsampled.
    """

    compressor: str = "lz4"
    level: int = 1
    min_bytes: int = 64 << 10
    min_ratio: float = 1.03

    def __post_init__(self):
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"Compression(compressor={self.compressor!r}): blosc's compressors are "
                             f"{', '.join(COMPRESSORS)}")
        if type(self.level) is not int or not 1 <= self.level <= 9:
            raise ValueError(f"Compression(level={self.level!r}): a level is an int from 1 to 9")
        if type(self.min_bytes) is not int or self.min_bytes < 0:
            raise ValueError(f"Compression(min_bytes={self.min_bytes!r}): a size in bytes, 0 or more")
        if isinstance(self.min_ratio, bool) or not isinstance(self.min_ratio, (int, float)) or not self.min_ratio >= 0:
            raise ValueError(f"Compression(min_ratio={self.min_ratio!r}): a ratio, 0 (compress every candidate) or "
                             "more")

    @classmethod
    def of(cls, value) -> Compression | None:
        """``ZarrWriter``'s ``compression`` argument as a Compression: None or False (off), True (the default
        Compression), a compressor's name, or a Compression."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, str):
            return cls(compressor=value)
        if isinstance(value, cls):
            return value
        raise TypeError(f"ZarrWriter(compression={value!r}): pass None, True, a compressor's name "
                        f"({', '.join(map(repr, COMPRESSORS))}) or a dcp_zarr.Compression")

    def compresses(self, dtype_name: str, nbytes: int) -> bool:
        """Whether an array of torch dtype ``dtype_name`` and ``nbytes`` is a candidate (its sample decides)."""
        return dtype_name in COMPRESSIBLE_DTYPES and nbytes >= max(self.min_bytes, 1)

    def codec(self, itemsize: int) -> BloscCodec:
        """The codec of an array of ``itemsize``-byte elements: bit shuffle, except before an entropy coder for one-
        and two-byte elements (none and byte shuffle)."""
        shuffle = _ENTROPY_CODER_SHUFFLES.get(self.compressor, {}).get(itemsize, "bitshuffle")
        return BloscCodec(self.compressor, self.level, shuffle, itemsize)

    def key(self) -> str:
        """The options every rank of a save must share, as one string (planning/protocol.py compares them and
        names them when ranks differ)."""
        return repr(self)


class BloscCodec(NamedTuple):
    """zarr v3's ``blosc`` codec, as one array's zarr.json names it."""

    cname: str
    clevel: int
    shuffle: str  # "noshuffle", "shuffle" or "bitshuffle"
    typesize: int

    def to_json(self) -> dict:
        return {"name": "blosc", "configuration": {"cname": self.cname, "clevel": self.clevel,
                                                   "shuffle": self.shuffle, "typesize": self.typesize,
                                                   "blocksize": 0}}

    @classmethod
    def from_json(cls, doc, where: str) -> BloscCodec:
        """The codec of a zarr.json's codec entry; MalformedMetadataError naming ``where`` for anything else."""
        try:
            config = doc["configuration"]
            codec = cls(config["cname"], config["clevel"], config["shuffle"], config["typesize"])
            extra = set(config) - {"cname", "clevel", "shuffle", "typesize", "blocksize"}
        except (KeyError, TypeError) as exc:
            raise MalformedMetadataError(f"{where}: blosc codec {doc!r} is malformed ({exc!r})") from None
        if (doc.get("name") != "blosc" or codec.cname not in COMPRESSORS or type(codec.clevel) is not int
                or codec.shuffle not in _SHUFFLES or type(codec.typesize) is not int or codec.typesize < 1 or extra):
            raise MalformedMetadataError(f"{where}: blosc codec {doc!r} is not one dcp_zarr reads")
        return codec

    def encode(self, data: np.ndarray) -> bytes:
        """The compressed bytes of ``data`` (C-contiguous), its elements shuffled as ``typesize``-byte units.
        numcodecs releases the GIL while blosc works, so the IO threads compress in parallel."""
        return blosc.compress(data.reshape(-1).view(np.uint8), self.cname.encode(), self.clevel,
                              _SHUFFLES[self.shuffle], 0, typesize=self.typesize)

    def decode_into(self, stored, out: memoryview, where: str) -> None:
        """Decompress ``stored`` into ``out`` (exactly its size), its sizes checked against blosc's header."""
        if len(stored) < _HEADER.size:
            raise CorruptChunkError(f"{where}: compressed chunk of {len(stored)} bytes has no blosc header")
        _, _, _, _, nbytes, _, cbytes = _HEADER.unpack_from(stored)
        if nbytes != len(out) or cbytes != len(stored):
            raise CorruptChunkError(f"{where}: blosc header says {nbytes} bytes compressed into {cbytes}; the chunk "
                                    f"holds {len(out)} bytes stored in {len(stored)}")
        try:
            blosc.decompress(stored, out)
        except RuntimeError as exc:
            raise CorruptChunkError(f"{where}: blosc cannot decompress it ({exc})") from None


_SHUFFLES = {"noshuffle": blosc.NOSHUFFLE, "shuffle": blosc.SHUFFLE, "bitshuffle": blosc.BITSHUFFLE}
