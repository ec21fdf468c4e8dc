"""Entries that several ranks save under one key, compared across ranks before a save commits.

DCP treats every item that more than one rank holds under the same key (a plain tensor, a non-tensor value, a
replicated DTensor shard) as a replica and keeps one rank's copy. When the ranks' copies differ (FSDP1 local
optimizer shards, per-rank RNG or dataloader state, a ``step`` that drifted) the others are silently lost, and no
peer notices. Here they are compared, in two steps, without a collective of our own:

1. on the coordinator, in ``prepare_global_plan``: kind, shape and dtype of every replicated item, from each rank's
   local plan (``prepare_local_plan`` attaches it: the same WriteItem objects, so pickling adds nothing);
2. in ``finish``: the crc32c of each replica's value that the coordinator asked for (values, and tensors up to
   ``max_bytes``), computed by every holding rank in ``write_data`` and returned as one extra WriteResult.

A mismatch raises ``ReplicaMismatchError`` naming every such key and which ranks differ; nothing is committed.
"""

from __future__ import annotations

import io
import json
import math
from collections import defaultdict
from dataclasses import dataclass

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_zarr.errors import ReplicaMismatchError
from dcp_zarr.format.encoding import as_bytes, checksum
from dcp_zarr.format.torch_arrays import tensor_as_numpy
from dcp_zarr.format.values import NotJSONError, encode_value

SMALL, ALL, NONE = "small", "all", "none"
CHECK_MODES = (SMALL, ALL, NONE)
# Replicated tensors up to this size are compared by value in the "small" mode. Measured on the benchmark's 2 GB
# FSDP2 state dict (docs/usage.md, "Replicated entries"): its replicated items are the optimizer steps and param_groups.
DEFAULT_MAX_BYTES = 1 << 20
# The WriteResult that carries a rank's replica checksums to the coordinator: a key no state dict can have, since
# node names starting with "__" are refused (layout.check_node_name).
CHECKSUMS_FQN = "__dcp_zarr_replica_checksums__"
_LISTED = 20


@dataclass(frozen=True)
class LocalItems:
    """``SavePlan.storage_data`` of a rank's local plan: every item it holds, before DCP's deduplication."""

    items: tuple[WriteItem, ...]


def _signature(item: WriteItem) -> tuple:
    if item.type == WriteItemType.BYTE_IO:
        return ("value",)
    data = item.tensor_data
    assert data is not None  # DCP sets it on every item that is not BYTE_IO
    return ("tensor", tuple(data.chunk.sizes), tuple(data.size), data.properties.dtype)


def _describe(signature: tuple) -> str:
    if signature[0] == "value":
        return "a non-tensor value"
    _, sizes, size, dtype = signature
    return f"a {str(dtype).removeprefix('torch.')} tensor of shape {list(sizes)}" + (
        f" (of {list(size)})" if size != sizes else "")


def _key(index: MetadataIndex) -> str:
    """The key, and the shard's offset when it is not the origin (a replicated DTensor shard)."""
    return f"{index.fqn} at {list(index.offset)}" if index.offset and any(index.offset) else index.fqn


def plan_checks(plans: list[SavePlan], mode: str, max_bytes: int) -> list[tuple[MetadataIndex, ...]]:
    """Compare every replicated item's kind, shape and dtype across ranks (ReplicaMismatchError if any differ,
    before anything is written: values are compared only once these agree); return, per rank, the replicated
    items whose values it must checksum."""
    if mode == NONE:
        return [() for _ in plans]
    holders: dict[MetadataIndex, list[tuple[int, WriteItem]]] = defaultdict(list)
    for rank, plan in enumerate(plans):
        if isinstance(plan.storage_data, LocalItems):
            for item in plan.storage_data.items:
                holders[item.index].append((rank, item))
    problems: list[str] = []
    checks: list[list[MetadataIndex]] = [[] for _ in plans]
    for index, held in holders.items():
        if len(held) < 2:
            continue
        signatures = defaultdict(list)
        for rank, item in held:
            signatures[_signature(item)].append(rank)
        if len(signatures) > 1:
            problems.append(f"{_key(index)!r}: " + "; ".join(
                f"{_describe(s)} on {ranks_text(r)}" for s, r in signatures.items()))
            continue
        (signature,) = signatures
        if mode == ALL or signature[0] == "value" or _nbytes(signature) <= max_bytes:
            for rank, _ in held:
                checks[rank].append(index)
    if problems:
        raise ReplicaMismatchError(mismatch_message(problems))
    return [tuple(c) for c in checks]


def _nbytes(signature: tuple) -> int:
    _, sizes, _, dtype = signature
    return math.prod(sizes) * dtype.itemsize


def checksums_result(local_items: dict[MetadataIndex, WriteItem], indexes, planner: SavePlanner) -> list[WriteResult]:
    """The WriteResult carrying this rank's checksums of ``indexes`` (none if there are none to send)."""
    if not indexes:
        return []
    digests = {index: value_checksum(local_items[index], planner) for index in indexes}
    return [WriteResult(index=MetadataIndex(CHECKSUMS_FQN), size_in_bytes=0, storage_data=digests)]


def value_checksum(item: WriteItem, planner: SavePlanner) -> str:
    """The crc32c (hex) of an item's value, as every holder computes it: its JSON form, or its bytes."""
    if item.type == WriteItemType.BYTE_IO:
        lookup = getattr(planner, "lookup_object", None)
        if lookup is not None:
            try:
                return checksum(json.dumps(encode_value(lookup(item.index)), sort_keys=True).encode()).hex()
            except NotJSONError:
                pass
        data = planner.resolve_data(item)
        assert isinstance(data, io.BytesIO)  # DCP's planners torch.save a BYTE_IO item into one
        return checksum(data.getvalue()).hex()
    tensor = planner.resolve_data(item)
    assert isinstance(tensor, torch.Tensor)  # a tensor item resolves to its tensor
    return checksum(as_bytes(tensor_as_numpy(tensor.detach().to("cpu").contiguous()))).hex()


def split_results(results: list[list[WriteResult]]) -> tuple[list[list[WriteResult]], list[dict]]:
    """(the ranks' WriteResults without the checksum results, each rank's {index: checksum})."""
    kept, digests = [], []
    for rank_results in results:
        rank_digests: dict = {}
        rest = []
        for result in rank_results:
            if result.index.fqn == CHECKSUMS_FQN:
                rank_digests.update(result.storage_data)
            else:
                rest.append(result)
        kept.append(rest)
        digests.append(rank_digests)
    return kept, digests


def compare_checksums(digests: list[dict]) -> None:
    """ReplicaMismatchError naming every replicated key whose value differs between ranks."""
    values: dict[MetadataIndex, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, rank_digests in enumerate(digests):
        for index, digest in rank_digests.items():
            values[index][digest].append(rank)
    problems = [f"{_key(index)!r}: the value differs: " + " vs ".join(ranks_text(r) for r in by_digest.values())
                for index, by_digest in values.items() if len(by_digest) > 1]
    if problems:
        raise ReplicaMismatchError(mismatch_message(problems))


def ranks_text(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def mismatch_message(problems: list[str]) -> str:
    """The ReplicaMismatchError's text for ``problems`` (one line each), whoever found them."""
    listed = "\n".join(f"  {p}" for p in problems[:_LISTED])
    more = f"\n  ... and {len(problems) - _LISTED} more" if len(problems) > _LISTED else ""
    many = len(problems) > 1
    return (f"{len(problems)} state-dict entr{'ies' if many else 'y'} saved under one key by several ranks "
            f"differ{'' if many else 's'} between them; DCP would keep one rank's copy and drop the others, so "
            f"nothing was committed:\n{listed}{more}\n"
            f"Save per-rank state under per-rank keys (e.g. f\"rng.rank{{rank}}\") or as "
            f"a DTensor sharded over the ranks; ZarrWriter(check_replicas=\"none\") skips this check.")
