"""Where a state-dict entry lives in the store, and how its array is cut into chunks.

Two decisions are made here and nowhere else:

* the zarr node path of a state-dict key (``("optim", "state", "layers.0.w", "exp_avg")`` ->
  ``"optim/state/layers.0.w/exp_avg"``), with every component checked so no key can escape the store;
* the chunk layout of a tensor, decided once from the global save plan so that every saved box (one rank's
  shard) is a union of whole chunks: no chunk is ever written by two ranks.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from dcp_zarr.errors import InvalidKeyError
from dcp_zarr.format.codecs import Codec

# Chunk keys of the arrays a save writes: zarr v3's default encoding with the "." separator (``c.0.1``), so a
# chunk is a file in its array's directory. "/" (``c/0/1``, what format 1 and 2 stores hold) makes a directory per
# chunk row and (2 + ranks) directories per array, each a slow file-system operation
# (benchmarks/reports/performance.md, "Many entries, files and requests"). Readers take the separator from each
# array's zarr.json, so stores of either kind load.
CHUNK_KEY_SEPARATOR = "."
LEGACY_CHUNK_KEY_SEPARATOR = "/"
CHUNK_KEY_SEPARATORS = (CHUNK_KEY_SEPARATOR, LEGACY_CHUNK_KEY_SEPARATOR)

# Inner chunks of a sharded array are aimed at this size: small enough that a resharded load reads little more
# than it needs, large enough that per-chunk overhead (one checksum, one index entry, one read) stays negligible.
INNER_CHUNK_TARGET_BYTES = 1 << 20

# An incremental save stores an array that changed whole, or not at all, as a full save does, but in shards of at most
# this many inner chunks (``ChunkLayout.shards_of_at_most``): a save confirms that an array that changed whole stopped
# changing by reading its shards back (store_io/chunk_reuse.py), and that read stays about 16 MiB a shard, whatever a
# rank's box holds; a link to a shard is checked by one small read per inner chunk, at most 17 a shard. Four MiB chunks
# already wrote as fast as a full save's shards (benchmarks/reports/incremental.md).
WHOLE_ARRAY_SHARD_INNER_CHUNKS = 16

_FORBIDDEN_CHARACTERS = re.compile(r"[/\\\x00-\x1f\x7f]")
_MAX_NAME_BYTES = 255  # NAME_MAX of ext4, xfs, btrfs, NTFS; a chunk directory is one name per component


def check_node_name(name: str, key: object) -> str:
    """Return ``name`` if it is safe as one zarr node name; raise naming ``key`` otherwise."""
    if not isinstance(name, str) or name == "":
        raise InvalidKeyError(f"state-dict key {key!r}: empty component {name!r} cannot name a zarr node")
    if name in (".", ".."):
        raise InvalidKeyError(f"state-dict key {key!r}: component {name!r} would escape the checkpoint store")
    if name.startswith("__"):
        raise InvalidKeyError(f"state-dict key {key!r}: component {name!r} starts with '__', reserved by zarr v3")
    if _FORBIDDEN_CHARACTERS.search(name):
        raise InvalidKeyError(
            f"state-dict key {key!r}: component {name!r} contains '/', '\\\\' or a control character, "
            "which would escape or split the checkpoint store"
        )
    if name.lower() == "zarr.json":
        raise InvalidKeyError(f"state-dict key {key!r}: component {name!r} collides with zarr's own keys")
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > _MAX_NAME_BYTES:  # refused before anything is written: the save would fail halfway with ENAMETOOLONG
        raise InvalidKeyError(f"state-dict key {key!r}: component {name!r} is {size} bytes; file systems allow "
                              f"{_MAX_NAME_BYTES} per name")
    return name


def node_path(path: Sequence[str | int], key: object = None) -> str:
    """The zarr node path of a state-dict path; list indices become decimal names."""
    if len(path) == 0:
        raise InvalidKeyError(f"state-dict key {key!r} has an empty path")
    names = [check_node_name(str(part) if isinstance(part, int) else part, key if key is not None else path)
             for part in path]
    return "/".join(names)


def parent_groups(node: str) -> list[str]:
    """Every group above ``node``, outermost first (the root, ``""``, excluded)."""
    parts = node.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def dimension_names(node: str, ndim: int) -> list[str]:
    """zarr v3 ``dimension_names`` for the array at ``node``: ``model/w.dim0``, ``model/w.dim1``. xarray needs names
    to open an array, and takes one name in two arrays of a group (or of a group and its parent) as one dimension
    that must have one length; so each name carries its array's full path and is never shared."""
    return [f"{node}.dim{axis}" for axis in range(ndim)]


class ChunkLayout(NamedTuple):
    """How one array is cut: ``chunk_shape`` is zarr's (outer) chunk grid; each outer chunk is written by one rank.

    ``inner_rows`` > 0 means the outer chunks are shards of zarr's ``sharding_indexed`` codec, each split into inner
    chunks of ``inner_rows`` rows along dim 0 (full extent along the other dims), so readers can fetch parts.
    ``separator`` is the chunk key encoding's (``CHUNK_KEY_SEPARATORS``). ``codec``: the compression of each
    (inner) chunk, or None; a compressed array is always sharded, so the shard indexes give every stored size.
    """

    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    inner_rows: int = 0
    separator: str = CHUNK_KEY_SEPARATOR
    codec: Codec | None = None

    @property
    def sharded(self) -> bool:
        return self.inner_rows > 0

    @property
    def inner_chunk_shape(self) -> tuple[int, ...]:
        return (self.inner_rows, *self.chunk_shape[1:]) if self.sharded else self.chunk_shape

    @property
    def inner_chunks_per_chunk(self) -> int:
        return self.chunk_shape[0] // self.inner_rows if self.sharded else 1

    @property
    def spans_array(self) -> bool:
        """One shard holds the whole array (``array_shard_layout``)."""
        return self.sharded and all(map(operator.le, self.shape, self.chunk_shape))

    @property
    def fixed_offsets(self) -> bool:
        """Every inner chunk of its one shard is stored at its full size, at an offset known before it is written,
        so ranks write their inner chunks into the shard at those offsets; not so for compressed ones."""
        return self.spans_array and self.codec is None

    def one_object_per_chunk(self) -> ChunkLayout:
        """This layout with each inner chunk an outer chunk of its own: the layout of a save that records its chunks
        (incremental), whose unit of reuse is one stored object, so a few changed rows cost a few chunks. The grid
        refines this one's, so every chunk still lies in one saved box."""
        if not self.sharded:
            return self
        return ChunkLayout(self.shape, self.inner_chunk_shape, 0, self.separator, self.codec)

    def shards_of_at_most(self, count: int) -> ChunkLayout:
        """This layout with each shard cut along dim 0 into shards of at most ``count`` inner chunks (the most that
        divides its inner chunks evenly; one object per chunk where that is one), so that every chunk still lies in
        one saved box."""
        if not self.sharded or self.inner_chunks_per_chunk <= count:
            return self
        per_shard = max(d for d in _divisors(self.inner_chunks_per_chunk) if d <= count)
        if per_shard == 1:
            return self.one_object_per_chunk()
        return self._replace(chunk_shape=(self.inner_rows * per_shard, *self.chunk_shape[1:]))

    def recorded(self, whole: bool) -> ChunkLayout:
        """This layout in a save that records its chunks (incremental): an object per chunk, or, for an array laid out
        whole (it changed whole, or not at all, in the earlier checkpoint: ``PlanOptions.whole_arrays``), shards of at
        most ``WHOLE_ARRAY_SHARD_INNER_CHUNKS``."""
        if whole:
            return self.shards_of_at_most(WHOLE_ARRAY_SHARD_INNER_CHUNKS)
        return self.one_object_per_chunk()

    def compressed(self, codec: Codec | None) -> ChunkLayout:
        """This layout with ``codec``: sharded (one inner chunk per chunk where it was not), so that the shard
        indexes record each compressed chunk's size."""
        if codec is None or not self.chunk_shape:  # a 0-d array is one element: stored as it is
            return self
        return self._replace(inner_rows=self.inner_rows or self.chunk_shape[0], codec=codec)

    @property
    def grid_shape(self) -> tuple[int, ...]:
        """Chunks along each dim (edge chunks counted)."""
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunk_shape))

    @property
    def chunk_count(self) -> int:
        return math.prod(self.grid_shape)

    def all_chunks(self) -> Iterable[tuple[int, ...]]:
        """Grid coordinates of every chunk, in C order (``()`` once for a 0-d array)."""
        return _product([range(n) for n in self.grid_shape])

    def chunks_in_box(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterable[tuple[int, ...]]:
        """Grid coordinates of every chunk that intersects the box."""
        ranges = []
        for off, size, c in zip(offsets, sizes, self.chunk_shape):
            if size == 0:
                return
            ranges.append(range(off // c, (off + size - 1) // c + 1))
        yield from _product(ranges)

    def chunk_key(self, coords: Sequence[int]) -> str:
        """The key of the chunk at grid ``coords``, below the array's node."""
        return chunk_key(coords, self.separator)

    def chunk_box(self, coords: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Offsets and sizes of the chunk's data inside the global array (edge chunks clipped to the shape)."""
        offsets = tuple(i * c for i, c in zip(coords, self.chunk_shape))
        sizes = tuple(min(c, n - o) for o, c, n in zip(offsets, self.chunk_shape, self.shape))
        return offsets, sizes


def chunk_key(coords: Sequence[int], separator: str = CHUNK_KEY_SEPARATOR) -> str:
    """Zarr v3's default chunk key encoding (``c.0.1``, or ``c/0/1`` with "/"; ``c`` for 0-d arrays)."""
    return separator.join(["c", *map(str, coords)])


def _product(ranges: list[range]) -> Iterable[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    head, *rest = ranges
    for i in head:
        for tail in _product(rest):
            yield (i, *tail)


def chunk_layout_for_boxes(
    shape: Sequence[int],
    boxes: Iterable[tuple[Sequence[int], Sequence[int]]],
    itemsize: int,
    inner_target_bytes: int = INNER_CHUNK_TARGET_BYTES,
) -> ChunkLayout:
    """The regular chunk grid in which every box (offsets, sizes) is a union of whole chunks.

    Along each dim the chunk length is the gcd of all box boundaries inside the array, so FSDP2's ``torch.chunk``
    split (boundaries at multiples of ceil(n/k)) gives one chunk per rank. Irregular splits (FSDP+TP, hand-made
    ShardedTensors) can shrink it down to 1: correct, but many small files; see docs/format.md ("Chunk grid").
    """
    shape = tuple(int(n) for n in shape)
    gcds = [0] * len(shape)  # running gcd of each dim's inner boundaries (gcd(0, b) == b): one pass, no sets
    gcd = math.gcd
    for offsets, sizes in boxes:
        if 0 in sizes:
            continue  # an empty shard (a rank with no rows) writes nothing and constrains nothing
        for d, (off, size) in enumerate(zip(offsets, sizes)):
            n = shape[d]
            if 0 < off < n:
                gcds[d] = gcd(gcds[d], off)
            if off + size < n:
                gcds[d] = gcd(gcds[d], off + size)
    chunk_shape = [max(g or n, 1) for g, n in zip(gcds, shape)]
    chunk = tuple(chunk_shape)
    return ChunkLayout(shape, chunk, inner_rows_for_chunk(chunk, itemsize, inner_target_bytes))


def array_shard_layout(layout: ChunkLayout, boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> ChunkLayout | None:
    """The layout of one shard spanning the array, whose inner chunks are ``layout``'s chunks (or their inner
    chunks), when the saved boxes allow it; else None.

    Several ranks then write one file, each its inner chunks at offsets known in advance (every inner chunk is stored
    at its full size, edge padding included), so an array is two files at any world size instead of one per rank's
    chunk. It needs boxes that split dim 0 only, at least two of them, covering every row (their rows add up to the
    array's: DCP's deduplication leaves no overlaps), so that every inner chunk is written and the index can list
    them all.
    """
    shape = layout.shape
    if not shape or 0 in shape:
        return None
    held = [(o, s) for o, s in boxes if 0 not in s]
    if len(held) < 2 or sum(s[0] for _, s in held) != shape[0]:
        return None
    if any(tuple(o[1:]) != (0,) * (len(shape) - 1) or tuple(s[1:]) != shape[1:] for o, s in held):
        return None
    rows = layout.inner_rows or layout.chunk_shape[0]  # every box boundary is a multiple of it
    shard_rows = -(-shape[0] // rows) * rows  # zarr wants the shard a multiple of the inner chunk: pad the last one
    return ChunkLayout(shape, (shard_rows, *shape[1:]), rows, layout.separator)


def inner_rows_for_chunk(chunk_shape: tuple[int, ...], itemsize: int, target: int) -> int:
    """Rows per inner chunk (a divisor of the chunk's rows), or 0 when the chunk is small enough to stay whole."""
    if not chunk_shape:
        return 0
    row_bytes = math.prod(chunk_shape[1:]) * itemsize
    rows = chunk_shape[0]
    if rows * row_bytes <= target or rows == 1:
        return 0
    wanted = max(1, target // max(row_bytes, 1))
    best = max((d for d in _divisors(rows) if d <= wanted), default=1)
    # A chunk whose row count has no divisor near the target (a large prime) would split into tiny inner chunks
    # with an index entry each; keep it whole instead.
    if best * 8 < wanted:
        return 0
    return best if best < rows else 0


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
