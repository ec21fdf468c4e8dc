"""Requests through an object store per save and load at up to 1,024 ranks, simulated in one process from the plans
dcp_zarr makes (storage_traffic.py --simulate).

Each rank of a ``world``-rank job is planned in turn, on torch's fake process group, with its own state dict of
DTensors on meta tensors (``fsdp``: ``Shard(0)``; ``hsdp``: ``(Replicate, Shard(0))`` on a (2, n/2) mesh) or plain
meta tensors (``ddp``), by the functions a real save and load call:

- save: ``ZarrSavePlanner.create_local_plan``, ``LocalSave`` (the writer's side, with an object store's
  ``aggregate_below`` and ``ZarrWriter``'s ``exchange_bytes``), ``LocalSave.rank_writes`` and its aggregation. A rank
  PUTs one object per stored chunk of each box it writes (``ChunkLayout.chunks_in_box``), one per block it
  aggregates, and one ``zarr.json`` per array it describes; the coordinator adds each group's ``zarr.json`` and the
  root's;
- load: DCP's ``DefaultLoadPlanner`` on ``reader.dcp_metadata`` of the manifest those plans give, then the reader's
  ``rank_needs`` and ``SharedReads`` (the same on every rank: checked by their digests). A rank GETs, for each unit it
  reads for others and each region it reads for itself, what ``RegionReader`` asks for: one GET per plain chunk, two
  per shard (its index, then its run of inner chunks); the coordinator adds the root ``zarr.json``.

No bytes move: what is counted is the requests and the bytes they carry (a chunk's payload and crc32c, a shard's
index, the root zarr.json as the coordinator would write it), from the plans, which are what a real run follows
(storage_traffic.py measures those at 2 to 8 ranks).
"""

from __future__ import annotations

import math
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from dcp_zarr import ZarrSavePlanner
from dcp_zarr.collective.needs import needs_digest, rank_needs
from dcp_zarr.collective.shared_reads import SharedReads
from dcp_zarr.format.consolidated import encoded_copy, encoded_root
from dcp_zarr.format.encoding import array_metadata, group_metadata, shard_index_bytes
from dcp_zarr.format.layout import parent_groups
from dcp_zarr.format.manifest import Manifest, TensorEntry
from dcp_zarr.local_plan.entries import group_rank_of
from dcp_zarr.local_plan.protocol import Ticket
from dcp_zarr.local_plan.save import LocalSave
from dcp_zarr.reader import dcp_metadata
from dcp_zarr.storage.base import Storage
from dcp_zarr.writer import DEFAULT_EXCHANGE_BYTES, INNER_CHUNK_TARGET_BYTES

LAYOUTS = ("fsdp", "hsdp", "ddp")


def rank_state(layout: str, world: int, arrays: int, shape: tuple[int, ...]) -> dict:
    if layout == "ddp":
        return {f"layers.{i}.weight": torch.empty(shape, device="meta") for i in range(arrays)}
    if layout == "fsdp":
        mesh, placements = init_device_mesh("cpu", (world,)), (Shard(0),)
    else:
        mesh, placements = init_device_mesh("cpu", (2, world // 2)), (Replicate(), Shard(0))
    coordinate = mesh.get_coordinate()
    state = {}
    for i in range(arrays):
        from dcp_zarr.local_plan.boxes import dtensor_local_box

        box = dtensor_local_box(shape, tuple(mesh.shape), placements, tuple(coordinate))
        local = torch.empty(box[1], device="meta")
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        state[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, placements, run_check=False,
                                                         shape=torch.Size(shape), stride=stride)
    return state


def _gets(layout, offsets, sizes) -> tuple[int, int]:
    """(GETs, bytes) a RegionReader makes to read the box ``offsets`` + ``sizes`` of an array of ``layout``."""
    requests = nbytes = 0
    for coords in layout.chunks_in_box(offsets, sizes):
        chunk_offsets, extent = layout.chunk_box(coords)
        if layout.sharded:
            lo = max(offsets[0], chunk_offsets[0]) - chunk_offsets[0]
            hi = min(offsets[0] + sizes[0], chunk_offsets[0] + extent[0]) - chunk_offsets[0]
            inner = -(-hi // layout.inner_rows) - lo // layout.inner_rows
            requests += 2
            nbytes += shard_index_bytes(layout) + inner * (math.prod(layout.inner_chunk_shape) * 4 + 4)
        else:
            requests += 1
            nbytes += math.prod(layout.chunk_shape) * 4 + 4
    return requests, nbytes


def simulate(layout: str, world: int, arrays: int, shape: tuple[int, ...], collective: bool = True) -> dict:
    """PUTs per save, GETs per load and the bytes a load reads, summed over every rank of one simulated job;
    ``collective=False``: without aggregation or shared reads (``aggregate_below=0``, ``read_once=False``)."""
    below = Storage.aggregate_below if collective else 0  # an object store's default
    puts, put_bytes = Counter(), Counter()
    saves = {}
    started = time.perf_counter()
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            state = rank_state(layout, world, arrays, shape)
            planner = ZarrSavePlanner()
            planner.set_up_planner(state, None, rank == 0)
            plan = planner.create_local_plan()
            local = LocalSave(plan.planner_data, rank, rank == 0, "none", 0, below, DEFAULT_EXCHANGE_BYTES)
            items, assignment = local.rank_writes(Ticket("sim", "s3://sim/x", False, frozenset()),
                                                  INNER_CHUNK_TARGET_BYTES, False)
            aggregation = local.aggregation(INNER_CHUNK_TARGET_BYTES)
            for item in items:
                spec = assignment.arrays[item.index.fqn]
                chunk = item.tensor_data.chunk
                for coords in spec.layout.chunks_in_box(chunk.offsets, chunk.sizes):
                    puts[rank] += 1
                    put_bytes[rank] += math.prod(spec.layout.chunk_box(coords)[1]) * spec.itemsize
            for units in aggregation.rounds:
                for unit in units:
                    if unit.owner == rank:
                        puts[rank] += 1
                        put_bytes[rank] += unit.nbytes
            puts[rank] += len(assignment.describes)
            if rank == 0:
                specs, shards = local.saved_arrays(INNER_CHUNK_TARGET_BYTES, False)
                nodes = local.global_nodes()
                entries = {}
                for fqn, entry in local.global_entries().items():
                    spec = specs[fqn]
                    entries[fqn] = TensorEntry(fqn, entry.path, nodes[fqn], spec.dtype_name, entry.size,
                                               spec.layout.chunk_shape, spec.layout.inner_rows, False, shards[fqn])
                groups = {g for e in entries.values() for g in parent_groups(e.node)}
                puts[rank] += len(groups) + 1  # each group's zarr.json, the root's
                saves["manifest"] = Manifest(entries=entries, saved_world_size=world)
                saves["layouts"] = specs
                copies = {group: encoded_copy(group_metadata()) for group in groups}
                copies.update((spec.node, encoded_copy(array_metadata(spec.layout, spec.data_type, spec.itemsize,
                                                                      {"dcp_zarr": {"fqn": fqn}}, node=spec.node)))
                              for fqn, spec in specs.items())
                root = {"dcp_zarr": saves["manifest"].to_json()}
                saves["root_bytes"] = len(encoded_root(group_metadata(root), copies))
        finally:
            dist.destroy_process_group()
    save_s = time.perf_counter() - started
    manifest, specs = saves["manifest"], saves["layouts"]
    metadata = dcp_metadata(manifest)
    # the coordinator reads the root once and broadcasts it; without, every rank reads it
    readers = [0] if collective else range(world)
    gets, get_bytes = Counter({r: 1 for r in readers}), Counter({r: saves["root_bytes"] for r in readers})
    shared = digest = None
    started = time.perf_counter()
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            state = rank_state(layout, world, arrays, shape)
            planner = DefaultLoadPlanner()
            planner.set_up_planner(state, metadata, rank == 0)
            items = planner.create_local_plan().items
            needs, alone = rank_needs(items, planner.state_dict, lambda key: key, group_rank_of(None))
            mine = needs_digest(needs, world, (below, DEFAULT_EXCHANGE_BYTES))
            if shared is None:
                digest = mine
                shared = SharedReads(needs if collective else {}, manifest.entries, world, below,
                                     DEFAULT_EXCHANGE_BYTES)
            if mine != digest:
                raise AssertionError(f"rank {rank}'s needs differ from rank 0's: a real load would read alone")
            for units in shared.rounds:
                for unit in units:
                    if unit.owner == rank:
                        n, b = _gets(specs[unit.key[0]].layout, *shared.info[unit.key].box)
                        gets[rank] += n
                        get_bytes[rank] += b
            direct = [i for i in items if not shared.shared(i.dest_index.fqn)]
            for item in direct:
                offsets = [a + b for a, b in zip(item.storage_index.offset, item.storage_offsets)]
                n, b = _gets(specs[item.storage_index.fqn].layout, offsets, item.lengths)
                gets[rank] += n
                get_bytes[rank] += b
        finally:
            dist.destroy_process_group()
    tensor_bytes = arrays * math.prod(shape) * 4
    return {"layout": layout, "world_size": world, "arrays": arrays, "shape": list(shape), "collective": collective,
            "puts_per_save": sum(puts.values()), "put_bytes": sum(put_bytes.values()),
            "gets_per_load": sum(gets.values()), "get_bytes": sum(get_bytes.values()),
            "read_x": sum(get_bytes.values()) / tensor_bytes, "most_requests": 2 * arrays + 8 + 4 * world,
            "most_puts_on_a_rank": max(puts.values()), "most_gets_on_a_rank": max(gets.values()),
            "simulated_save_s": round(save_s, 2), "simulated_load_s": round(time.perf_counter() - started, 2)}


def simulate_report(worlds: list[int], arrays: int, shape: tuple[int, ...]) -> dict:
    from storage_traffic import stamp

    rows = []
    for layout in LAYOUTS:
        for world in worlds:
            if layout == "hsdp" and world % 2:
                continue
            for collective in (True, False):
                rows.append(simulate(layout, world, arrays, shape, collective))
                print(rows[-1], flush=True)
    s = stamp()
    lines = [f"Simulated at {s['commit']}{' (dirty tree)' if s['dirty'] else ''}, torch {s['torch']}, {s['date']}: "
             f"{arrays} fp32 arrays of {'x'.join(map(str, shape))} on an object store (dcp_zarr's defaults there), "
             "requests summed over every rank; `without`: the same job without collective I/O (aggregate_below=0, "
             "read_once=False). `limit`: 2 x arrays + 8 + 4 x ranks (issue 25); `read x`: bytes read per load over "
             "the tensors' bytes, the root zarr.json included.", "",
             "| layout | ranks | PUTs per save | without | GETs per load | without | limit | read x | without |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    pairs = {(r["layout"], r["world_size"], r["collective"]): r for r in rows}
    for (layout, world, collective), r in pairs.items():
        if not collective:
            continue
        w = pairs[(layout, world, False)]
        lines.append(f"| {layout} | {world:,} | {r['puts_per_save']:,} | {w['puts_per_save']:,} | "
                     f"{r['gets_per_load']:,} | {w['gets_per_load']:,} | {r['most_requests']:,} | "
                     f"{r['read_x']:.3f} | {w['read_x']:.2f} |")
    return {"stamp": s, "rows": rows, "markdown": "\n".join(lines) + "\n"}
