"""The checksums of a rank's replicated entries (those other ranks hold too), by replica group: one digest per group
goes into the rank's ``Summary``; the per-item checksums only to the coordinator, and only when asked
(protocol.py's ``Ticket``)."""

from __future__ import annotations

import hashlib
from collections import defaultdict

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType

from dcp_zarr.placement.box_writers import box_holders, replica_group
from dcp_zarr.placement.holdings import DTENSOR, EVERY_RANK
from dcp_zarr.planning import replicas
from dcp_zarr.planning.protocol import Ticket
from dcp_zarr.planning.rank_part import RankPart, item_nbytes

Checksums = dict[str, dict[MetadataIndex, str]]  # replica group -> {item index: checksum}


def replica_checksums(part: RankPart, mode: str, max_bytes: int) -> Checksums:
    """The checksums of the replicated items ``mode`` compares (replicas.py's modes)."""
    sums: Checksums = defaultdict(dict)
    if mode == replicas.NONE:
        return sums
    for fqn, entry in part.entries.items():
        if entry.holding == EVERY_RANK and part.world_size > 1:
            name = replica_group(entry, part.rank)
        elif entry.holding == DTENSOR and len(box_holders(entry.mesh, entry.placements, part.rank)) > 1:
            name = replica_group(entry, part.rank)
        else:
            continue
        for item in part.items[fqn]:
            if mode == replicas.ALL or item.type == WriteItemType.BYTE_IO or item_nbytes(item) <= max_bytes:
                sums[name][item.index] = replicas.value_checksum(item, part.planner)
    return sums


def group_digests(sums: Checksums) -> tuple[tuple[str, str], ...]:
    """(replica group, one digest of its checksums), sorted: what the ``Summary`` carries."""
    return tuple(sorted((name, _digest_of(group_sums)) for name, group_sums in sums.items()))


def reported_checksums(sums: Checksums, ticket: Ticket) -> dict[MetadataIndex, str]:
    """The per-item checksums the coordinator asked for (replica groups that disagreed; all on an exchange)."""
    return {index: digest for name, group_sums in sums.items()
            if ticket.exchange or name in ticket.detail_groups for index, digest in group_sums.items()}


def _digest_of(sums: dict[MetadataIndex, str]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for index in sorted(sums, key=lambda i: (i.fqn, tuple(i.offset or ()))):
        digest.update(f"{index.fqn}|{list(index.offset or ())}|{sums[index]}\n".encode())
    return digest.hexdigest()
