"""What one rank holds, described so that every rank holding the same entry describes it the same way.

A ``Holding`` is one state-dict key as this rank sees it, with how the key is held across ranks:

* ``EVERY_RANK``: a plain tensor or a non-tensor value, which every rank of the save is taken to hold whole (the
  digests check that they do);
* ``DTENSOR``: a DTensor; its mesh (a slice of a root mesh: the ranks, in DCP's process group) and placements give
  every rank's box, so no rank needs to be told another's;
* ``SHARDS``: a ShardedTensor; its metadata lists every shard and the rank holding it;
* ``BOX``: anything else that is a part of its tensor (a planner that cut it): only the ranks themselves know their
  boxes, so the entry differs from rank to rank, the digests differ, and the boxes are exchanged (exchange.py).

``signature`` is the part that must agree between ranks, ``structure_digest`` the digest a rank sends instead of its
plan. Both leave out the mesh's rank list (a mesh of 8,192 ranks is one short token) and the rank's own items.
"""

from __future__ import annotations

import array
import hashlib
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from dcp_zarr.format.sources import SourceDescriptions
from dcp_zarr.placement.boxes import Box

TENSOR, VALUE = "tensor", "value"
EVERY_RANK, DTENSOR, SHARDS, BOX = "every_rank", "dtensor", "shards", "box"


class Mesh(NamedTuple):
    """A root device mesh as the save sees it: its shape and its ranks in DCP's process group, in C order."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    token: str  # a digest of shape and ranks: what signatures and digests carry instead of the rank list

    @classmethod
    def of(cls, shape: Sequence[int], ranks: Sequence[int]) -> Mesh:
        shape, ranks = tuple(int(n) for n in shape), tuple(int(r) for r in ranks)
        digest = hashlib.blake2b(repr(shape).encode(), digest_size=8)
        digest.update(array.array("q", ranks).tobytes())  # 8,192 ranks: bytes, not their repr
        return cls(shape, ranks, digest.hexdigest())

    # Compared and hashed by token: a mesh of 8,192 ranks is looked up once per array and per save.
    def __hash__(self) -> int:
        return hash(self.token)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and self.token == other.token

    def __ne__(self, other) -> bool:
        return not self == other

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return _unravel(_positions(self.ranks, self.token)[rank], self.shape)

    def rank_at(self, coordinate: Sequence[int]) -> int:
        index = 0
        for i, n in zip(coordinate, self.shape):
            index = index * n + i
        return self.ranks[index]


class MeshSlice(NamedTuple):
    """A DTensor's mesh, as one of the like slices of its root mesh (``mesh["dp"]`` of a (dp, tp) mesh; a flattened
    one): the same DTensor lives on every slice, each rank's on the slice through it. ``free`` are the root dims the
    slice runs along, ``pattern`` the coordinates on them of each of its positions (C order of its own shape).
    ``whole``: the mesh is its root (FSDP's and HSDP's), with no pattern to make or look up: 8,192 ranks of it cost
    nothing per rank beyond the root's own rank list."""

    root: Mesh
    shape: tuple[int, ...]
    free: tuple[int, ...]
    pattern: tuple[tuple[int, ...], ...]
    token: str
    whole: bool = False

    @classmethod
    def of_root(cls, root: Mesh) -> MeshSlice:
        token = hashlib.blake2b(repr((root.token, "whole")).encode(), digest_size=8).hexdigest()
        return cls(root, root.shape, tuple(range(len(root.shape))), (), token, True)

    @classmethod
    def of(cls, root: Mesh, shape: Sequence[int], ranks: Sequence[int]) -> MeshSlice:
        coordinates = [root.coordinate(r) for r in ranks]
        free = tuple(d for d in range(len(root.shape)) if len({c[d] for c in coordinates}) > 1)
        pattern = tuple(tuple(c[d] for d in free) for c in coordinates)
        shape = tuple(int(n) for n in shape)
        token = hashlib.blake2b(repr((root.token, shape, free, pattern)).encode(), digest_size=8).hexdigest()
        return cls(root, shape, free, pattern, token)

    def __hash__(self) -> int:
        return hash(self.token)

    def __eq__(self, other) -> bool:
        return isinstance(other, MeshSlice) and self.token == other.token

    def __ne__(self, other) -> bool:
        return not self == other

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate in the slice through it."""
        root = self.root.coordinate(rank)
        if self.whole:
            return root
        return _unravel(_positions(self.pattern, self.token)[tuple(root[d] for d in self.free)], self.shape)

    def slice_ranks(self, rank: int) -> list[int]:
        """The ranks of the slice through ``rank``, in its own C order."""
        if self.whole:
            return list(self.root.ranks)
        root = self.root.coordinate(rank)
        ranks = []
        for position in self.pattern:
            point = list(root)
            for d, v in zip(self.free, position):
                point[d] = v
            ranks.append(self.root.rank_at(point))
        return ranks

    def ranks_at(self, coordinate: Sequence[int]) -> list[int]:
        """The ranks at ``coordinate`` of every slice (the root's other dims varied), in C order of the root."""
        if self.whole:
            return [self.root.rank_at(coordinate)]
        index = 0
        for i, n in zip(coordinate, self.shape):
            index = index * n + i
        fixed = dict(zip(self.free, self.pattern[index]))
        ranges = [range(1) if d in fixed else range(n) for d, n in enumerate(self.root.shape)]
        ranks = []
        for point in itertools.product(*ranges):
            ranks.append(self.root.rank_at([fixed.get(d, v) for d, v in enumerate(point)]))
        return ranks


_positions_made: dict[str, dict] = {}  # mesh token -> value -> position; a few meshes per job


def _positions(values: tuple, token: str) -> dict:
    """value -> its position in ``values`` (a mesh's ranks, a slice's pattern), made once per mesh (by its token):
    ``tuple.index`` would cost O(ranks) a lookup, O(ranks^2) for the slices of an 8,192-rank mesh."""
    found = _positions_made.get(token)
    if found is None:
        if len(_positions_made) > 64:
            _positions_made.clear()
        found = _positions_made[token] = {value: i for i, value in enumerate(values)}
    return found


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coordinate = []
    for n in reversed(shape):
        index, i = divmod(index, n)
        coordinate.append(i)
    return tuple(reversed(coordinate))


class Holding(NamedTuple):
    """One state-dict key on one rank (NamedTuple: thousands are built per save, and pickled on an exchange)."""

    fqn: str
    path: tuple  # the key's path in the nested state dict (DCP's flatten mapping)
    kind: str  # TENSOR or VALUE
    dtype: torch.dtype | None
    size: tuple[int, ...]
    requires_grad: bool
    holding: str  # EVERY_RANK, DTENSOR, SHARDS or BOX
    mesh: MeshSlice | None = None  # DTENSOR
    placements: tuple = ()  # DTENSOR: the placement objects
    boxes: tuple = ()  # SHARDS: every shard's (offsets, sizes, rank); BOX: this rank's (offsets, sizes, rank)
    source: dict | None = None  # format/sources.describe_source of the value, for the manifest

    @property
    def nbytes(self) -> int:
        if self.dtype is None:
            return 0
        count = 1
        for n in self.size:
            count *= n
        return count * self.dtype.itemsize


def signature(entry: Holding) -> tuple:
    """What every rank holding ``entry`` must see alike (a BOX entry's boxes make it differ by design)."""
    return (entry.fqn, entry.path, entry.kind, str(entry.dtype), entry.size, entry.requires_grad, entry.holding,
            entry.mesh.token if entry.mesh else "", tuple(str(p) for p in entry.placements), entry.boxes)


def structure_digest(entries: Iterable[Holding]) -> str:
    """One digest of a rank's entries, in key order: equal on two ranks exactly when their signatures are."""
    digest = hashlib.blake2b(digest_size=16)
    for entry in sorted(entries, key=lambda e: e.fqn):
        digest.update(repr(signature(entry)).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def rank_entries(items: Sequence[WriteItem], state_dict: dict, mappings: dict, rank: int,
                 group_rank: Callable[[int], int], sharded_tensor_type: Any
                 ) -> tuple[dict[str, Holding], dict[str, list[WriteItem]]]:
    """This rank's entries, and its items by key. ``group_rank`` maps a global rank (a mesh's) to DCP's group;
    ``sharded_tensor_type``: torch's ShardedTensor, passed in by planning (torch_private.sharded_tensor_type)."""
    items_by_fqn: dict[str, list[WriteItem]] = {}
    for item in items:
        items_by_fqn.setdefault(item.index.fqn, []).append(item)
    meshes: dict = {}
    roots: dict = {}
    describe = SourceDescriptions(sharded_tensor_type)
    entries = {}
    for fqn, held in items_by_fqn.items():
        path = tuple(mappings.get(fqn, (fqn,)))
        first = held[0]
        if first.type == WriteItemType.BYTE_IO:
            entries[fqn] = Holding(fqn, path, VALUE, None, (), False, EVERY_RANK)
            continue
        data = first.tensor_data
        assert data is not None  # DCP sets it on every item that is not BYTE_IO
        size = tuple(int(n) for n in data.size)
        value = state_dict.get(fqn)
        common = (fqn, path, TENSOR, data.properties.dtype, size, bool(data.properties.requires_grad))
        source = describe(value)
        if isinstance(value, DTensor):
            mesh = meshes.get(value.device_mesh)
            if mesh is None:
                mesh = meshes[value.device_mesh] = mesh_slice(value.device_mesh, roots, group_rank)
            entries[fqn] = Holding(*common, DTENSOR, mesh, tuple(value.placements), source=source)
        elif sharded_tensor_type is not None and isinstance(value, sharded_tensor_type):
            shards = tuple(sorted((tuple(s.shard_offsets), tuple(s.shard_sizes), group_rank(s.placement.rank()))
                                  for s in value.metadata().shards_metadata))
            entries[fqn] = Holding(*common, SHARDS, boxes=shards, source=source)
        elif len(held) == 1 and not any(data.chunk.offsets) and tuple(data.chunk.sizes) == size:
            entries[fqn] = Holding(*common, EVERY_RANK, source=source)
        else:
            boxes = tuple(sorted((tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes), rank)
                                 for i in held if i.tensor_data is not None))
            entries[fqn] = Holding(*common, BOX, boxes=boxes, source=source)
    return entries, items_by_fqn


def mesh_slice(device_mesh, roots: dict, group_rank: Callable[[int], int]) -> MeshSlice:
    """A DeviceMesh as a slice of its root mesh, ranks in DCP's group (``roots``: root meshes made so far)."""
    # A sub-mesh knows its root through a private method (torch 2.2 on); without it the mesh is taken as its own
    # root, and ranks on other slices then differ in their digests and are planned by an exchange.
    get_root = getattr(device_mesh, "_get_root_mesh", None)
    root_mesh = get_root() if get_root is not None else device_mesh
    root = roots.get(root_mesh)
    if root is None:
        ranks = root_mesh.mesh.flatten().tolist()
        if group_rank is not int:  # the default group: its ranks are the mesh's
            ranks = [group_rank(r) for r in ranks]
        root = roots[root_mesh] = Mesh.of(root_mesh.shape, ranks)
    if device_mesh is root_mesh:
        return MeshSlice.of_root(root)
    return MeshSlice.of(root, device_mesh.shape, [group_rank(r) for r in device_mesh.mesh.flatten().tolist()])


def group_rank_of(group) -> Callable[[int], int]:
    """Global rank (a DeviceMesh's) -> rank in ``group`` (the same for the default group)."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return int
    return lambda global_rank: dist.get_group_rank(group, global_rank)


class Merged(NamedTuple):
    """The plan of a save whose ranks differ, the same on every rank: every tensor and value as the boxes the ranks
    hold, each distinct box written by one of its holders."""

    entries: dict[str, Holding]  # one holder's entry per key (the lowest rank's), in the coordinator's key order
    boxes: dict[str, list[Box]]  # every distinct box of each tensor whose grid follows from its boxes (not DTensors)
    writers: dict[MetadataIndex, int]  # (key, box offsets) -> the rank writing it
    describers: dict[str, int]  # key -> the rank writing its array's zarr.json (the writer of its first box)
