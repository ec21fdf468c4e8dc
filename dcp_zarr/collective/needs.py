"""What each rank of a load needs, described so that every rank can derive every other rank's needs.

A load's read items say what this rank needs; a region several ranks need, or a small piece of an object others
read too, is read by one of them (shared_reads.py), which must know who needs what without being told. It can,
where the need follows from what every rank holds alike: a DTensor's mesh and placements give every rank's box (as
on a save, placement/), and a plain tensor is loaded whole by every rank. Each rank describes its needs so
(``Need``) and the ranks compare one digest of them; where the digests differ, or a need is none of these (a
planner that cuts its own regions, a ShardedTensor), the rank reads for itself, as it would without any of this.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import NamedTuple

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor

from dcp_zarr.placement.boxes import Box
from dcp_zarr.placement.chunk_grids import box_at, shards_along
from dcp_zarr.placement.holdings import DTENSOR, EVERY_RANK, MeshSlice, mesh_slice


class Need(NamedTuple):
    """One state-dict key a load fills from one stored array, as every rank holding the key sees it."""

    dest: str  # the key in the state dict being loaded
    array: str  # the stored entry read into it
    size: tuple[int, ...]  # the global shape (the stored array's)
    holding: str  # DTENSOR: each rank its box; EVERY_RANK: every rank the whole
    mesh: MeshSlice | None = None
    placements: tuple = ()

    def region(self, rank: int) -> Box | None:
        """The non-empty box ``rank`` needs, or None."""
        if self.holding == EVERY_RANK:
            return ((0,) * len(self.size), self.size) if all(self.size) else None
        assert self.mesh is not None
        if rank not in _rank_set(self.mesh):
            return None
        box = box_at(self.size, self.mesh.shape, self.placements, self.mesh.coordinate(rank))
        return box if all(box[1]) else None


_rank_sets: dict[str, frozenset[int]] = {}


def _rank_set(mesh: MeshSlice) -> frozenset[int]:
    found = _rank_sets.get(mesh.root.token)
    if found is None:
        if len(_rank_sets) > 64:
            _rank_sets.clear()
        found = _rank_sets[mesh.root.token] = frozenset(mesh.root.ranks)
    return found


def rank_needs(items: Iterable[ReadItem], state_dict: dict, stored_key: Callable[[str], str | None],
               group_rank: Callable[[int], int], replicas_only: bool = False
               ) -> tuple[dict[str, Need], list[ReadItem]]:
    """(dest key -> Need of this rank, the tensor items no Need covers: read by this rank itself).

    ``stored_key``: the stored entry a state-dict key is loaded from, for keys this rank has no items for (an
    empty box of a DTensor); ``group_rank``: a mesh's rank in the load's process group; ``replicas_only``: only
    needs several ranks share (small pieces are not read a chunk at a time): a DTensor whose placements replicate
    nothing is read by its rank alone without describing it (what every rank decides alike from placements)."""
    by_dest: dict[str, list[ReadItem]] = defaultdict(list)
    for item in items:
        if item.type != LoadItemType.BYTE_IO:
            by_dest[item.dest_index.fqn].append(item)
    needs: dict[str, Need] = {}
    alone: list[ReadItem] = []
    roots: dict = {}
    meshes: dict = {}
    for dest, value in state_dict.items():
        held = by_dest.pop(dest, [])
        if replicas_only and isinstance(value, DTensor) and not _replicated(value):
            alone += held
            continue
        need = _need(dest, value, held, stored_key, group_rank, roots, meshes)
        if need is None:
            alone += held
        else:
            needs[dest] = need
    for held in by_dest.values():  # items for keys the state dict does not name (a planner's own): read alone
        alone += held
    return needs, alone


def _replicated(value: DTensor) -> bool:
    """Whether other ranks hold this rank's box of a DTensor: a mesh dim it does not shard along, or other slices of
    its root mesh (each holding the same DTensor)."""
    mesh = value.device_mesh
    if any(n > 1 and not shards_along(p) for n, p in zip(mesh.shape, value.placements)):
        return True
    get_root = getattr(mesh, "_get_root_mesh", None)
    return get_root is not None and get_root() is not mesh and get_root().size() > mesh.size()


def _need(dest: str, value, held: list[ReadItem], stored_key, group_rank, roots: dict, meshes: dict) -> Need | None:
    if not isinstance(value, torch.Tensor) or len(held) > 1:
        return None
    item = held[0] if held else None
    array = item.storage_index.fqn if item is not None else stored_key(dest)
    if array is None:
        return None
    size = tuple(int(n) for n in value.shape)
    region = None if item is None else (tuple(a + b for a, b in zip(item.storage_index.offset or (0,) * len(size),
                                                                    item.storage_offsets)),
                                        tuple(int(n) for n in item.lengths))
    if isinstance(value, DTensor):
        coordinate = value.device_mesh.get_coordinate()
        if coordinate is None:
            return None
        box = box_at(size, tuple(value.device_mesh.shape), tuple(value.placements), tuple(coordinate))
        expected = box if all(box[1]) else None
        if region != expected:
            return None
        mesh = meshes.get(value.device_mesh)
        if mesh is None:
            mesh = meshes[value.device_mesh] = mesh_slice(value.device_mesh, roots, group_rank)
        return Need(dest, array, size, DTENSOR, mesh, tuple(value.placements))
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        return None  # ShardedTensors and other subclasses: their own rules
    whole = ((0,) * len(size), size)
    if region != (whole if all(size) else None):
        return None
    return Need(dest, array, size, EVERY_RANK)


def needs_digest(needs: dict[str, Need], world_size: int, options: tuple = ()) -> bytes:
    """16 bytes, equal on two ranks exactly when their needs describe the same load, read with the same ``options``
    (the ones that decide who reads what: a default may follow the file system each rank sees the path on)."""
    digest = hashlib.blake2b(repr((world_size, options)).encode(), digest_size=16)
    for dest in sorted(needs):
        need = needs[dest]
        digest.update(repr((need.dest, need.array, need.size, need.holding, need.mesh.token if need.mesh else "",
                            tuple(str(p) for p in need.placements))).encode())
        digest.update(b"\n")
    return digest.digest()
