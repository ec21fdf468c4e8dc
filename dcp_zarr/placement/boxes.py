"""Where a rank's box of a DTensor lies, in arithmetic: what torch's ``compute_local_shape_and_global_offset``
computes, without its index tensors.

torch builds, for every sharded dim, a tensor of the global indices the rank holds (``torch.arange`` of the piece,
or for ``_StridedShard`` an index tensor split and listed): O(piece) per array, and for FSDP2-over-TP's
``_StridedShard`` a cost that grows with the world size, enough to make DCP's ``create_local_plan`` an order of
magnitude slower at thousands of ranks than at eight (benchmarks/reports/planning.md, "One rank's planning, 8 vs
8,192 ranks, 2,000 tensors"). Here the indices held along a dim are kept as runs
``(start, length)``; a ``Shard`` keeps a torch.chunk piece of them, a ``_StridedShard(split_factor=k)`` a
torch.chunk piece of each of k torch.chunk pieces. O(runs) a dim. ``tests/placement/test_local_layouts.py`` checks the
boxes against torch's on every coordinate of many meshes and uneven sizes.
"""

from __future__ import annotations

from functools import lru_cache

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.tensor import Replicate, Shard

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)
Runs = list[tuple[int, int]]  # the global indices held along a dim: (start, length), in order


def torch_chunk_piece(n: int, k: int, index: int) -> tuple[int, int]:
    """[a, b) of piece ``index`` of n cut by torch.chunk into k (empty at the end when pieces run out)."""
    size = -(-n // k) if n else 0
    return min(index * size, n), min((index + 1) * size, n)


def torch_chunks(n: int, k: int) -> list[tuple[int, int]]:
    """The non-empty pieces (offset, size) of n cut by torch.chunk into k."""
    return [(a, b - a) for a, b in (torch_chunk_piece(n, k, s) for s in range(k)) if b > a]


def index_at(held: Runs, position: int) -> int:
    """The global index at ``position`` of the indices held."""
    for start, size in held:
        if position < size:
            return start + position
        position -= size
    raise AssertionError("a piece past the indices held")


def strided_split_factor(placement) -> int | None:
    """The split factor of FSDP2-over-TP's strided shard (torch's ``_StridedShard(dim, split_factor=k)``); None for
    any other placement. Told by what the placement says of itself, not by its class, whose name is private to
    torch: a ``Placement`` other than a plain ``Shard``, a replica or a partial (by their public methods) that
    carries a ``dim`` and a ``split_factor``. ``is_shard()`` is not asked: it is False for torch 2.11 to 2.15's, and
    would be True were it a ``Shard`` subclass again. ``tests/placement/test_local_layouts.py`` checks that torch's
    own class is told so."""
    if type(placement) is Shard or placement.is_replicate() or placement.is_partial():
        return None
    factor = getattr(placement, "split_factor", None)
    return int(factor) if factor is not None and isinstance(getattr(placement, "dim", None), int) else None


@lru_cache(maxsize=65536)
def dtensor_local_box(size: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple,
                      coordinate: tuple[int, ...]) -> Box | None:
    """The box at ``coordinate`` of a DTensor of global ``size``, as DTensor reports it (an empty piece of a sharded
    dim at offset ``size[dim]``, each dim at its first index held); None for placements other than ``Shard``,
    ``_StridedShard`` and ``Replicate`` (``Partial`` among them: DCP refuses those, and the caller leaves it to).
    Cached: a model's arrays have few shapes, and a rank has one coordinate per mesh."""
    held: dict[int, Runs] = {}
    for mesh_dim, placement in enumerate(placements):
        split_factor = strided_split_factor(placement)
        if split_factor is not None:
            dim = placement.dim
            runs = held.get(dim, [(0, size[dim])])
            held[dim] = _strided_piece(runs, mesh_shape[mesh_dim], split_factor, coordinate[mesh_dim])
        elif type(placement) is Shard:
            dim = placement.dim
            runs = held.get(dim, [(0, size[dim])])
            a, b = torch_chunk_piece(_length(runs), mesh_shape[mesh_dim], coordinate[mesh_dim])
            held[dim] = _positions(runs, a, b)
        elif not isinstance(placement, Replicate):
            return None
    offsets, sizes = list((0,) * len(size)), list(size)
    for dim, runs in held.items():
        sizes[dim] = _length(runs)
        offsets[dim] = runs[0][0] if sizes[dim] else size[dim]
    return tuple(offsets), tuple(sizes)


def _strided_piece(runs: Runs, mesh_size: int, split_factor: int, index: int) -> Runs:
    """``_StridedShard(split_factor)``'s piece ``index`` of ``mesh_size``: the held indices cut by torch.chunk into
    ``split_factor`` pieces, and piece ``index`` of each of those cut into ``mesh_size``, concatenated."""
    kept: Runs = []
    for start, length in torch_chunks(_length(runs), split_factor):
        a, b = torch_chunk_piece(length, mesh_size, index)
        kept += _positions(runs, start + a, start + b)
    return kept


def _positions(runs: Runs, a: int, b: int) -> Runs:
    """The runs of the held indices at positions [a, b)."""
    kept: Runs = []
    position = 0
    for start, length in runs:
        lo, hi = max(a, position), min(b, position + length)
        if lo < hi:
            kept.append((start + lo - position, hi - lo))
        position += length
        if position >= b:
            break
    return kept


def _length(runs: Runs) -> int:
    return sum(length for _, length in runs)


def mesh_place(mesh, known: dict) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The shape of ``mesh`` and this rank's coordinate in it (None: not in it), kept in ``known`` (id(mesh) ->
    (mesh, shape, coordinate), the caller's across a state dict's entries: a model has few meshes)."""
    place = known.get(id(mesh))
    if place is None or place[0] is not mesh:
        coordinate = mesh.get_coordinate()
        place = known[id(mesh)] = (mesh, tuple(mesh.shape), None if coordinate is None else tuple(coordinate))
    return place[1], place[2]


# torch 2.14's CheckpointableTensor (torch.distributed.checkpoint.protocol): a plain tensor carrying these attributes
# is, for DCP, boxes of a larger tensor, which DCP's own functions find (a runtime-checked Protocol: slow to ask).
_OWN_BOXES = ("global_shape", "global_offsets", "local_offsets", "local_sizes")


def says_its_own_boxes(tensor) -> bool:
    """Whether a plain tensor carries any of the attributes by which torch 2.14 makes it boxes of a larger tensor."""
    attributes = getattr(tensor, "__dict__", None) or {}
    return any(name in attributes for name in _OWN_BOXES)


def own_boxes_refused(fqn: str) -> str:
    """Why a save refuses a tensor that ``says_its_own_boxes``."""
    return (f"state-dict entry {fqn!r} is a tensor carrying torch 2.14's CheckpointableTensor attributes ("
            f"{', '.join(_OWN_BOXES)}), which dcp_zarr does not save: save it as a DTensor, or remove them")
