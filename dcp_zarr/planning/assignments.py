"""The coordinator's decisions for one save, made once from every rank's plan: node paths and chunk layouts.

``array_specs_for_plans`` sees the deduplicated global plan (DCP already assigned each replicated item to one
rank), so the boxes it sees are exactly what will be written, each by one rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import dcp_zarr.torch_floor  # noqa: F401  (first: torch missing or too old is one clear error)

import torch
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from dcp_zarr.errors import InvalidKeyError
from dcp_zarr.format.array_spec import ArraySpec
from dcp_zarr.format.chunk_layout import ChunkLayout, array_shard_layout, chunk_layout_for_boxes, node_path
from dcp_zarr.format.compression import Compression
from dcp_zarr.format.torch_arrays import numpy_dtype, torch_dtype_name, zarr_dtype_name
from dcp_zarr.placement.box_writers import describing_ranks


@dataclass(frozen=True)
class RankAssignment:
    """What the coordinator sends each rank in ``SavePlan.storage_data``."""

    staging_location: str
    arrays: dict[str, ArraySpec]  # fqn -> spec, for this rank's tensor items
    nodes: dict[str, str]  # fqn -> node, for this rank's non-tensor items
    describes: frozenset[str] = frozenset()  # fqns whose zarr.json this rank writes (one rank per array)
    replica_checks: tuple = ()  # MetadataIndex of each replicated item whose value this rank checksums (replicas.py)


def node_paths(plans: list[SavePlan]) -> dict[str, str]:
    """fqn -> zarr node for every item, checked for escapes and collisions."""
    mapping: dict = {}
    for plan in plans:
        mapping.update(plan.planner_data or {})
    return checked_node_paths((item.index.fqn, mapping.get(item.index.fqn, (item.index.fqn,)))
                              for plan in plans for item in plan.items)


def checked_node_paths(paths: Iterable[tuple[str, tuple]]) -> dict[str, str]:
    """fqn -> zarr node of each (fqn, state-dict path), checked for escapes and collisions."""
    nodes: dict[str, str] = {}
    owners: dict[str, str] = {}
    for fqn, path in paths:
        if fqn in nodes:
            continue
        node = node_path(path, key=fqn)
        other = owners.setdefault(node, fqn)
        if other != fqn:
            raise InvalidKeyError(f"state-dict keys {other!r} and {fqn!r} would both be stored at {node!r}")
        nodes[fqn] = node
    _check_prefixes(owners)
    return nodes


def _check_prefixes(owners: dict[str, str]) -> None:
    """An entry cannot also be a group holding other entries (``a`` and ``a/b``)."""
    for node, fqn in owners.items():
        parts = node.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in owners:
                raise InvalidKeyError(
                    f"state-dict key {owners[prefix]!r} is stored at {prefix!r}, which {fqn!r} needs as a group"
                )


def array_specs_for_plans(plans: list[SavePlan], nodes: dict[str, str], inner_chunk_bytes: int,
                          array_shards: bool = False, compression: Compression | None = None,
                          records_chunks: bool = False, whole_arrays: frozenset[str] = frozenset()
                          ) -> dict[str, ArraySpec]:
    """One ArraySpec per tensor; with ``array_shards`` (a backend that writes at offsets: local files), an array that
    several ranks hold in row blocks is one shard file they all write (``layout.array_shard_layout``). With
    ``compression``, every candidate array is compressed: a save DCP plans carries no samples of the data
    (planning/compression_sample.py serves saves planned locally), and a codec stores data that does not compress
    within its overhead (format/codecs.py). With ``records_chunks`` (an incremental save), ``ChunkLayout.recorded``:
    one object per chunk, or a full save's shards of at most 16 inner chunks for the ``whole_arrays`` (nodes:
    ``PlanOptions.whole_arrays``), and no shard spanning an array (the chunk path records each object its rank
    wrote)."""
    boxes: dict[str, list] = defaultdict(list)  # fqn -> [ChunkStorageMetadata]: (offsets, sizes) read in place
    tensor_data = {}
    byte_io = WriteItemType.BYTE_IO
    for plan in plans:
        for item in plan.items:
            if item.type is byte_io:
                continue
            data = item.tensor_data
            assert data is not None  # DCP sets it on every item that is not BYTE_IO
            fqn = item.index.fqn
            boxes[fqn].append(data.chunk)
            if fqn not in tensor_data:
                tensor_data[fqn] = data
    specs = {}
    # Arrays of one shape and sharding share one layout object, and so one copy in each rank's unpickled plan: a
    # model has few shapes, and thousands of equal copies would only feed the garbage collector.
    layouts: dict[ChunkLayout, ChunkLayout] = {}
    for fqn, data in tensor_data.items():
        np_dtype = numpy_dtype(data.properties.dtype)
        saved = [(c.offsets, c.sizes) for c in boxes[fqn]]
        layout = chunk_layout_for_boxes(tuple(data.size), saved, np_dtype.itemsize, inner_chunk_bytes)
        nbytes = math.prod(data.size) * np_dtype.itemsize
        codec = (compression.codec(np_dtype.itemsize)
                 if compression is not None and compression.compresses(str(data.properties.dtype), nbytes) else None)
        if records_chunks:
            layout = layout.recorded(whole=nodes[fqn] in whole_arrays)
        elif array_shards and codec is None:
            layout = array_shard_layout(layout, saved) or layout
        layout = layout.compressed(codec)
        layout = layouts.setdefault(layout, layout)
        specs[fqn] = array_spec(fqn, nodes[fqn], data.properties.dtype, layout)
    return specs


def array_spec(fqn: str, node: str, dtype: torch.dtype, layout: ChunkLayout) -> ArraySpec:
    return ArraySpec(fqn, node, *_dtype_names(dtype)[:2], layout, _dtype_names(dtype)[2])


@lru_cache(maxsize=64)
def _dtype_names(dtype: torch.dtype) -> tuple[str, int, str]:
    """(zarr data type, itemsize, torch name) of a dtype: looked up once, not once per array."""
    return zarr_dtype_name(dtype), numpy_dtype(dtype).itemsize, torch_dtype_name(dtype)


def assignments(plans: list[SavePlan], specs: dict[str, ArraySpec], nodes: dict[str, str],
                staging_location: str, replica_checks: list[tuple]) -> list[RankAssignment]:
    describers = describing_ranks(([item.index.fqn for item in plan.items] for plan in plans), specs)
    result = []
    for rank, (plan, checks) in enumerate(zip(plans, replica_checks)):
        fqns = {item.index.fqn for item in plan.items}
        result.append(RankAssignment(
            staging_location=staging_location,
            arrays={f: specs[f] for f in fqns if f in specs},
            nodes={f: nodes[f] for f in fqns if f not in specs},
            describes=frozenset(f for f in fqns if describers.get(f) == rank),
            replica_checks=checks,
        ))
    return result
