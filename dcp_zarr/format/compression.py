"""Lossless compression of arrays: what a save may ask for (``Compression``): which floating-point arrays it
compresses, and with which row of the codec table (format/codecs.py) at which level. Torch-free."""

from __future__ import annotations

import dataclasses

from dcp_zarr.format.codecs import CODECS, Codec

# The compressors a save may name, in the table's order (messages list them)
COMPRESSORS = tuple(CODECS)
# Torch dtypes whose arrays a save compresses: floating point only. Integer and bool tensors (step counters, masks,
# token ids) are small or already dense, and stored as they are.
COMPRESSIBLE_DTYPES = frozenset({
    "torch.float16", "torch.bfloat16", "torch.float32", "torch.float64", "torch.float8_e4m3fn", "torch.float8_e5m2"})


@dataclasses.dataclass(frozen=True)
class Compression:
    """What ``ZarrWriter(compression=...)`` compresses, and how.

    Args:
        compressor: a row of the codec table (``COMPRESSORS``): ``"lz4"`` (after a bit shuffle) is three times as
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
        if self.compressor not in CODECS:
            raise ValueError(f"Compression(compressor={self.compressor!r}): the compressors are "
                             f"{', '.join(CODECS)}")
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
                        f"({', '.join(map(repr, CODECS))}) or a dcp_zarr.Compression")

    def compresses(self, dtype_name: str, nbytes: int) -> bool:
        """Whether an array of torch dtype ``dtype_name`` and ``nbytes`` is a candidate (its sample decides)."""
        return dtype_name in COMPRESSIBLE_DTYPES and nbytes >= max(self.min_bytes, 1)

    def codec(self, itemsize: int) -> Codec:
        """The codec of an array of ``itemsize``-byte elements, its shuffle the table row's."""
        return CODECS[self.compressor].codec(self.level, itemsize)

    def key(self) -> str:
        """The options every rank of a save must share, as one string (planning/protocol.py compares them and
        names them when ranks differ)."""
        return repr(self)
