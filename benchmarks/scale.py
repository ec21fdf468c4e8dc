"""Metadata and planning at 8 to 8,192 ranks, simulated in one process, beside DCP's FileSystemWriter/Reader.

    python benchmarks/scale.py --out benchmarks/results/scale     # the README's table and plot (~15 min here)
    python benchmarks/scale.py --quick --out /tmp/scale            # small sizes, a minute (what the tests run)

No process group: each saving rank's SavePlan is built as that rank's DefaultSavePlanner would (one WriteItem per
tensor shard, FSDP ``Shard(0)``, HSDP ``(Replicate, Shard(0))`` on an (n/8, 8) mesh, or FSDP+TP on a (n/8, 8)
(dp, tp) mesh), and then the functions a real save and load call are timed on them:

- coordinator save planning: DCP's ``DefaultSavePlanner.create_global_plan`` (dedup, metadata, validation), then
  what each writer adds in ``prepare_global_plan`` (``ZarrWriter``: node paths, chunk grids, assignments);
- metadata: each writer's ``finish`` on the global plan (synthetic WriteResults), bytes of ``.metadata`` / root
  ``zarr.json``;
- per loading rank: ``read_metadata`` (read and parse), then DCP's ``create_read_items_for_chunk_list`` for every
  tensor with the rank's shard of a 128-rank FSDP job (what ``create_default_local_load_plan`` calls): time and
  read items;
- validation: ``Manifest.from_json`` of the root document, and of a format-1 entry of 1,000,000 boxes.

Rank-local planning (building each rank's plan) runs on every rank in parallel in a real job and is not timed. The
8,192 x 2,000 save-planning point would hold 16.4M write items (~11 GB) and take DCP most of an hour here, so it is
measured on 2 planning calls of 50 tensors each and scaled to 2,000: every step timed is per tensor.
"""

from __future__ import annotations

import argparse
import gc
import glob
import hashlib
import json
import math
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter, replicas  # noqa: E402
from dcp_zarr.format.manifest import Manifest  # noqa: E402
from dcp_zarr.local_plan.protocol import REPORT_FQN, RankReport, check_summaries  # noqa: E402

HIDDEN = 4096
LOAD_WORLD_SIZE = 128
_PROPS = TensorProperties(dtype=torch.bfloat16)


def model_tensors(entries: int) -> list[tuple[str, tuple[int, ...]]]:
    """A transformer's weights: per layer four (d, d) attention matrices, (4d, d) and (d, 4d) MLP, two norms."""
    per_layer = [("wq", (HIDDEN, HIDDEN)), ("wk", (HIDDEN, HIDDEN)), ("wv", (HIDDEN, HIDDEN)), ("wo", (HIDDEN, HIDDEN)),
                 ("w1", (4 * HIDDEN, HIDDEN)), ("w2", (HIDDEN, 4 * HIDDEN)), ("norm1", (HIDDEN,)), ("norm2", (HIDDEN,))]
    return [(f"model.layers.{i // 8}.{per_layer[i % 8][0]}", per_layer[i % 8][1]) for i in range(entries)]


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's split, as FSDP2 uses it: (offset, size) of part ``index``; trailing parts may be empty."""
    step = -(-n // parts)
    start = min(index * step, n)
    return start, min(step, n - start)


def rank_box(layout: str, shape: tuple[int, ...], rank: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    rest = tuple(shape[1:])
    if layout == "fsdp":
        start, size = _split(shape[0], world, rank)
    elif layout == "hsdp":  # (replicate, shard) mesh with 8-way sharding: replicas hold the same box
        start, size = _split(shape[0], 8, rank % 8)
    elif layout == "fsdp_tp":  # (dp, tp) mesh, tp = 8 colwise; FSDP splits each TP shard (a _StridedShard)
        tp_start, tp_size = _split(shape[0], 8, rank % 8)
        start, size = _split(tp_size, world // 8, rank // 8)
        start += tp_start
    else:
        raise ValueError(layout)
    if size == 0:  # an empty shard sits at the tensor's end, as FSDP2's do: it must not share a real shard's offset
        start = shape[0]
    return (start, *(0 for _ in rest)), (size, *rest)


def _new(cls, **fields):
    """A DCP plan object with its fields set directly: its frozen dataclass __init__ costs ~10 us, which at 16M
    items would dominate the run. Building plans is each rank's own work in a real job, and is not timed."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def rank_plan(tensors, layout: str, rank: int, world: int, planner_data: dict | None = None) -> SavePlan:
    if planner_data is None:
        planner_data = {fqn: ("model", fqn.removeprefix("model.")) for fqn, _ in tensors}
    items = []
    for fqn, shape in tensors:
        offsets, sizes = rank_box(layout, shape, rank, world)
        offsets = torch.Size(offsets)
        items.append(_new(WriteItem, index=_new(MetadataIndex, fqn=fqn, offset=offsets, index=None),
                          type=WriteItemType.SHARD, bytes_io_data=None,
                          tensor_data=_new(TensorWriteData, chunk=ChunkStorageMetadata(offsets, torch.Size(sizes)),
                                           properties=_PROPS, size=torch.Size(shape))))
    return SavePlan(items, planner_data=planner_data)


def save_plans(tensors, layout: str, world: int) -> list[SavePlan]:
    planner_data = {fqn: ("model", fqn.removeprefix("model.")) for fqn, _ in tensors}
    return [rank_plan(tensors, layout, rank, world, planner_data) for rank in range(world)]


def timed(fn, repeats: int = 1):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def coordinator_planning(plans: list[SavePlan], work: str) -> dict:
    """DCP's global planning, then each writer's prepare_global_plan on its result."""
    dcp_s, (global_plan, metadata) = timed(lambda: DefaultSavePlanner().create_global_plan(plans))
    zarr_writer = ZarrWriter(os.path.join(work, "ckpt.zarr"), sync_files=False)
    zarr_s, _ = timed(lambda: zarr_writer.prepare_global_plan(global_plan))
    fs_writer = FileSystemWriter(os.path.join(work, "dcp"), sync_files=False)
    fs_writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    fs_s, _ = timed(lambda: fs_writer.prepare_global_plan(global_plan))
    return {"dcp_global_plan_s": dcp_s, "zarr_added_s": zarr_s, "fs_added_s": fs_s,
            "global_plan": global_plan, "metadata": metadata, "zarr_writer": zarr_writer, "fs_writer": fs_writer}


def zarr_results(global_plan: list[SavePlan], world: int) -> list[list[WriteResult]]:
    """The WriteResults each rank's ZarrWriter.write_data would return (the chunks themselves are not written)."""
    source = {"type": "dtensor", "placements": ["S(0)"], "mesh_shape": [world], "mesh_dim_names": None}
    return [[WriteResult(item.index, 0, {"source": source}) for item in plan.items] for plan in global_plan]


def loading_shards(tensors) -> dict[str, list[ChunkStorageMetadata]]:
    """Rank 0's shard of each tensor in a 128-rank FSDP job."""
    return {fqn: [ChunkStorageMetadata(*map(torch.Size, rank_box("fsdp", shape, 0, LOAD_WORLD_SIZE)))]
            for fqn, shape in tensors}


def read_items(metadata, local: dict) -> int:
    """DCP's read items for the rank's shards (what create_default_local_load_plan makes per tensor)."""
    return sum(len(create_read_items_for_chunk_list(fqn, metadata.state_dict_metadata[fqn], chunks))
               for fqn, chunks in local.items())


def write_metadata(planning: dict, world: int, work: str) -> dict:
    """Each writer's finish on synthetic WriteResults; the bytes of what it wrote."""
    fs_results = [_fs_results(plan, rank) for rank, plan in enumerate(planning["global_plan"])]
    os.makedirs(os.path.join(work, "dcp"), exist_ok=True)
    planning["fs_writer"].finish(planning["metadata"], fs_results)
    planning["zarr_writer"].finish(planning["metadata"], zarr_results(planning["global_plan"], world))
    root = os.path.join(work, "ckpt.zarr", "zarr.json")
    with open(root) as f:
        manifest = json.load(f)["attributes"]["dcp_zarr"]
    # the root zarr.json (what a loading rank reads) holds the manifest and a copy of every node's zarr.json
    return {"zarr_root_bytes": os.path.getsize(root),
            "zarr_manifest_bytes": len(json.dumps(manifest, separators=(",", ":"))),
            "dcp_metadata_bytes": os.path.getsize(os.path.join(work, "dcp", ".metadata"))}


def loading_rank(tensors, work: str, repeats: int) -> dict:
    """Rank 0 of a 128-rank FSDP job: read and parse the metadata, then DCP's read items for each of its shards.
    dcp_zarr's steps take milliseconds, so they get more repeats than DCP's (seconds at 8,192 ranks)."""
    cheap = max(25, repeats)
    local = loading_shards(tensors)

    def plan(metadata):
        return read_items(metadata, local)

    # Each side runs with only its own metadata alive, as on a real rank: DCP's unpickled metadata (millions of
    # objects at 8,192 ranks) would otherwise slow dcp_zarr's steps through Python's garbage collector.
    gc.collect()
    zarr_s, zarr_md = timed(lambda: ZarrReader(os.path.join(work, "ckpt.zarr")).read_metadata(), cheap)
    zarr_plan_s, zarr_items = timed(lambda: plan(zarr_md), cheap)
    with open(os.path.join(work, "ckpt.zarr", "zarr.json")) as f:
        document = json.load(f)["attributes"]["dcp_zarr"]
    validate_s, _ = timed(lambda: Manifest.from_json(document, "scale"), cheap)
    # Release both for the GC (None, not del: pyflakes would read the lambdas above as using deleted names).
    zarr_md = document = None
    gc.collect()
    fs_s, fs_md = timed(lambda: FileSystemReader(os.path.join(work, "dcp")).read_metadata(), repeats)
    fs_plan_s, fs_items = timed(lambda: plan(fs_md), repeats)
    return {"zarr_read_metadata_s": zarr_s, "dcp_read_metadata_s": fs_s, "zarr_load_plan_s": zarr_plan_s,
            "dcp_load_plan_s": fs_plan_s, "zarr_read_items": zarr_items, "dcp_read_items": fs_items,
            "zarr_validate_s": validate_s}


def measure(layout: str, world: int, entries: int, repeats: int) -> dict:
    tensors = model_tensors(entries)
    work = tempfile.mkdtemp(prefix="dcp-zarr-scale-")
    try:
        plans = save_plans(tensors, layout, world)
        planning = coordinator_planning(plans, work)
        row = {"layout": layout, "world": world, "entries": entries,
               **{k: v for k, v in planning.items() if k.endswith("_s")}}
        row.update(write_metadata(planning, world, work))
        row["wire"] = dcp_wire(plans, planning, tensors, layout, world)
        del planning, plans
        row.update(loading_rank(tensors, work, repeats))
        return row
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- what DCP's collectives carry, and planning with ZarrSavePlanner on real (fake-group) ranks -----------------------
#
# DCP's object collectives (gather_object, scatter_object_list, broadcast_object_list, all_gather_object) send each
# object as its pickle (torch's _object_to_tensor: pickle.Pickler, default protocol), padded to the largest rank's
# and preceded by an int64 size; the pickles of the real objects are what is counted here.

KINDS = ("dcp_zarr", "dcp_default", "dcp_cached_later", "no_collectives")
_CHECKED_WORLD = 16  # every rank planned for real, to check the summaries built from representative ranks
_SAMPLED_RANKS = 16  # ranks whose local plans are pickled to scale DCP's bytes from 100 tensors to more


def pickled(obj) -> int:
    return len(pickle.dumps(obj))


def _traffic(world: int, up: list[int], down: list[int], results: list[int], broadcast: int) -> dict:
    """A save's bytes: the gathered plans (up), the scattered replies (down), the gathered write results and one
    object broadcast to every rank. Through the coordinator: what it receives and sends, the broadcast once (a tree
    or ring broadcast sends it from rank 0 about once; every rank receives it: ``broadcast_delivered``)."""
    return _totals(world, {"plans_up": sum(up), "plans_down": sum(down), "results_up": sum(results),
                           "broadcast": broadcast, "max_rank": max(u + d + r for u, d, r in zip(up, down, results))
                           + broadcast, "coordinator_padded": world * (max(up) + max(results)) + sum(down) + broadcast})


def _totals(world: int, parts: dict) -> dict:
    moved = parts["plans_up"] + parts["plans_down"] + parts["results_up"]
    return {**parts, "per_rank": moved / world + parts["broadcast"], "coordinator": moved + parts["broadcast"],
            "broadcast_delivered": parts["broadcast"] * (world - 1)}


def _fs_results(plan: SavePlan, rank: int) -> list[WriteResult]:
    """The WriteResults FileSystemWriter.write_data returns: one per item, where its bytes lie in the rank's file."""
    results, offset = [], 0
    for item in plan.items:
        length = math.prod(item.tensor_data.chunk.sizes) * _PROPS.dtype.itemsize
        results.append(WriteResult(item.index, length, _StorageInfo(f"__{rank}_0.distcp", offset, length)))
        offset += length
    return results


def dcp_load_plans(tensors, layout: str, world: int, metadata, ranks: list[int]) -> list[LoadPlan]:
    """DCP's LoadPlan of each of ``ranks`` loading at the saved layout: DCP's read items for its box of each tensor
    (what create_default_local_load_plan makes), as FileSystemReader.prepare_local_plan passes them on."""
    plans = []
    for rank in ranks:
        items = []
        for fqn, shape in tensors:
            box = ChunkStorageMetadata(*map(torch.Size, rank_box(layout, shape, rank, world)))
            items.extend(create_read_items_for_chunk_list(fqn, metadata.state_dict_metadata[fqn], [box]))
        plans.append(LoadPlan(items))
    return plans


def sampled(world: int, count: int) -> list[int]:
    return sorted({round(i * (world - 1) / max(count - 1, 1)) for i in range(min(count, world))})


def dcp_wire(plans: list[SavePlan], planning: dict, tensors, layout: str, world: int) -> dict:
    """Bytes of DCP's save protocol with FileSystemWriter (default and cached planner) and of its load, from the
    real objects of a measured row (all ranks; loads on sampled ranks, scaled)."""
    fs_writer, global_plan = planning["fs_writer"], planning["global_plan"]
    up = [pickled(plan) for plan in plans]
    down = [pickled(plan) for plan in fs_writer.prepare_global_plan(global_plan)]
    results = [pickled(_fs_results(plan, rank)) for rank, plan in enumerate(global_plan)]
    broadcast = pickled(planning["metadata"])  # finish has filled in its storage_data, as DCP broadcasts it
    unusable = SavePlan([], usable=False)  # a caching planner's later local plans, and the deltas it scatters
    cached_down = [pickled(plan) for plan in fs_writer.prepare_global_plan([unusable] * world)]
    ranks = sampled(world, 64)
    load_plans = dcp_load_plans(tensors, layout, world, planning["metadata"], ranks)
    load_up = [pickled(plan) for plan in load_plans]
    load_down = [pickled(plan) for plan in DefaultLoadPlanner().create_global_plan(load_plans)]
    scale = world / len(ranks)
    return {"save": {"dcp_default": _traffic(world, up, down, results, broadcast),
                     "dcp_cached_later": _traffic(world, [pickled(unusable)] * world, cached_down, results, broadcast)},
            "load": {"dcp_default": _load_traffic(world, sum(load_up) * scale, sum(load_down) * scale)},
            "sampled_plan_bytes": sum(up[r] for r in sampled(world, _SAMPLED_RANKS)), "exact": True}


def _load_traffic(world: int, up: float, down: float) -> dict:
    """A load's bytes: plans gathered and scattered, then DCP's all_gather of every rank's read result (None): each
    rank receives all of them, whatever the reader."""
    done = world * pickled(None)
    return {"per_rank": (up + down) / world + done, "coordinator": up + down + done, "plans_up": up,
            "plans_down": down, "read_done_per_rank": done}


def scaled_dcp_wire(exact: dict, tensors, layout: str, world: int) -> dict:
    """DCP's bytes at more tensors than a measured row: the row's, times the ratio of the sampled ranks' pickled local
    plans (exact, at both sizes). Per-rank caching plans and deltas do not grow."""
    ratio = sum(pickled(rank_plan(tensors, layout, rank, world)) for rank in sampled(world, _SAMPLED_RANKS)) \
        / exact["sampled_plan_bytes"]
    save = {}
    for kind, traffic in exact["save"].items():  # a caching planner's later plans and deltas do not grow
        grown = ("plans_up", "plans_down", "results_up", "broadcast") if kind == "dcp_default" else (
            "results_up", "broadcast")
        save[kind] = _totals(world, {**{k: traffic[k] * (ratio if k in grown else 1) for k in
                                        ("plans_up", "plans_down", "results_up", "broadcast")},
                                     "max_rank": None, "coordinator_padded": None})
    load = {k: _load_traffic(world, v["plans_up"] * ratio, v["plans_down"] * ratio) for k, v in exact["load"].items()}
    return {"save": save, "load": load, "exact": False, "scaled_by": ratio}


def layout_mesh(layout: str, world: int):
    if layout == "fsdp":
        return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), (Shard(0),)
    mesh = init_device_mesh("cpu", (world // 8, 8), mesh_dim_names=("replicate", "shard") if layout == "hsdp"
                            else ("dp", "tp"))
    if layout == "hsdp":
        return mesh, (Replicate(), Shard(0))
    return mesh, (_StridedShard(0, split_factor=8), Shard(0))  # FSDP over TP's colwise shards, as FSDP2 makes it


def rank_state_dict(tensors, layout: str, world: int, rank: int, mesh, placements, check_bytes: int) -> dict:
    """This rank's state dict of DTensors. Local tensors are meta (planning reads no data), except boxes other ranks
    hold too and the replica check reads (up to check_bytes): those are real, as the check is real work."""
    replicated = layout == "hsdp" and world > 8
    state = {}
    for fqn, shape in tensors:
        _, sizes = rank_box(layout, shape, rank, world)
        real = replicated and math.prod(sizes) * _PROPS.dtype.itemsize <= check_bytes
        local = torch.zeros(sizes, dtype=_PROPS.dtype, device="cpu" if real else "meta")
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        state[fqn] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                        stride=stride)
    return state


# Module-level caches of dcp_zarr's planning, beside its functools caches: emptied for a restarted process's first save
_PLAN_CACHES = {"dcp_zarr.local_plan.save": "_recent_plans", "dcp_zarr.local_plan.entries": "_positions_made"}


def clear_caches() -> None:
    """Empty every cache of dcp_zarr's planning (functools caches and _PLAN_CACHES): a restarted process's first
    save. Says so when a named cache is gone (the library changed: update _PLAN_CACHES)."""
    for name, module in list(sys.modules.items()):
        if name == "dcp_zarr" or name.startswith("dcp_zarr."):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()
    for module_name, attribute in _PLAN_CACHES.items():
        cache = getattr(sys.modules.get(module_name), attribute, None)
        cache = getattr(cache, "_plans", cache)  # save.py's _RecentPlans keeps an OrderedDict
        if not hasattr(cache, "clear"):
            print(f"scale.py: no cache {module_name}.{attribute} to clear", file=sys.stderr)
            continue
        cache.clear()


class FakeRank:
    """One rank of a ``world``-rank job in this process: torch's fake process group, the layout's mesh and the
    rank's state dict (none of it timed)."""

    def __init__(self, tensors, layout: str, world: int, rank: int, work: str):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        self.layout, self.world, self.rank, self.work = layout, world, rank, work
        self.mesh, placements = layout_mesh(layout, world)
        self.state = rank_state_dict(tensors, layout, world, rank, self.mesh, placements, replicas.DEFAULT_MAX_BYTES)

    def close(self) -> None:
        self.state = self.mesh = None
        dist.destroy_process_group()

    def writer(self, name: str) -> ZarrWriter:
        writer = ZarrWriter(os.path.join(self.work, name), sync_files=False)
        writer.set_up_storage_writer(self.rank == 0, rank=self.rank)
        return writer

    def local_plan(self, writer: ZarrWriter, timing: bool = True) -> tuple[SavePlan, dict]:
        """ZarrSavePlanner's local plan and ZarrWriter.prepare_local_plan, from cold caches: (the plan DCP gathers,
        times). ``timing``: collect garbage first (it costs more than planning when only bytes are counted)."""
        clear_caches()
        if timing:
            gc.collect()
        start = time.perf_counter()
        planner = ZarrSavePlanner()
        planner.set_up_planner(self.state, None, self.rank == 0)
        plan = planner.create_local_plan()
        planned = time.perf_counter()
        sent = writer.prepare_local_plan(plan)
        prepared = time.perf_counter()
        self.planner, self.items = planner, plan.planner_data.items
        return sent, {"create_local_plan_s": planned - start, "prepare_local_plan_s": prepared - planned}

    def rank_writes(self, writer: ZarrWriter, ticket) -> tuple[float, list]:
        array_shards = writer._open(ticket.staging_location).writes_at_offsets
        start = time.perf_counter()
        items, _ = writer._local.rank_writes(ticket, writer.inner_chunk_bytes, array_shards)
        return time.perf_counter() - start, items


def _representative(layout: str, rank: int) -> int:
    """The rank whose Summary equals ``rank``'s but for the rank itself: HSDP's replicas of one box (rank % 8) share
    its replica group and checksums; FSDP's and FSDP+TP's boxes have no replicas, so every rank's entries agree."""
    return rank % 8 if layout == "hsdp" else 0


def _all_summaries(layout: str, world: int, summaries: dict[int, object]) -> list[SavePlan]:
    return [SavePlan([], storage_data=summaries[_representative(layout, r)]._replace(rank=r)) for r in range(world)]


def _report(nbytes: int) -> list[WriteResult]:
    """What a rank's ZarrWriter.write_data returns with ZarrSavePlanner (writer.py: _write_planned_locally): one
    WriteResult carrying its RankReport, here with no values, objects or checksums asked for (replicas agree)."""
    return [WriteResult(index=MetadataIndex(REPORT_FQN), size_in_bytes=nbytes, storage_data=RankReport({}, {}, {}))]


def _held_bytes(items) -> int:
    return sum(math.prod(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize for i in items)


def zarr_wire(layout: str, world: int, entries: int) -> dict:
    """dcp_zarr's save and load bytes at one point: the representative ranks planned for real (fake process group),
    every rank's Summary from them, the coordinator's real replies, a RankReport per rank, the planner's Metadata."""
    tensors = model_tensors(entries)
    work = tempfile.mkdtemp(prefix="dcp-zarr-wire-")
    try:
        summaries, held = {}, {}
        for rank in sorted({_representative(layout, r) for r in range(world)}):
            fake = FakeRank(tensors, layout, world, rank, work)
            try:
                sent, _ = fake.local_plan(fake.writer(f"r{rank}.zarr"), timing=False)
                summaries[rank], held[rank] = sent.storage_data, _held_bytes(fake.items)
                if rank == 0:
                    metadata = fake.planner.create_global_plan([sent])[1]
            finally:
                fake.close()
        plans = _all_summaries(layout, world, summaries)
        fake = FakeRank(tensors[:1], layout, world, 0, work)  # the coordinator's writer needs only the group
        try:
            replies = fake.writer("coordinator.zarr").prepare_global_plan(plans)
        finally:
            fake.close()
        up = [pickled(plan) for plan in plans]
        down = [pickled(plan) for plan in replies]
        results = [pickled(_report(held[_representative(layout, r)])) for r in range(world)]
        load_plan = ZarrReader(os.path.join(work, "none.zarr")).prepare_local_plan(
            LoadPlan(dcp_load_plans(tensors[:1], "fsdp", 1, _one_rank_metadata(tensors[:1]), [0])[0].items))
        load = pickled(load_plan)
        return {"save": {"dcp_zarr": _traffic(world, up, down, results, pickled(metadata))},
                "load": {"dcp_zarr": _load_traffic(world, load * world, load * world)}}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _one_rank_metadata(tensors):
    return DefaultSavePlanner().create_global_plan(save_plans(tensors, "fsdp", 1))[1]


def check_representatives(layout: str, world: int, entries: int) -> int:
    """Every rank of a small job planned for real: its Summary is its representative's but for the rank, and its
    DTensor boxes are the synthetic plans' (rank_box). Returns the ranks checked."""
    tensors = model_tensors(entries)
    work = tempfile.mkdtemp(prefix="dcp-zarr-wire-")
    try:
        real = {}
        for rank in range(world):
            fake = FakeRank(tensors, layout, world, rank, work)
            try:
                real[rank] = fake.local_plan(fake.writer(f"r{rank}.zarr"), timing=False)[0].storage_data
                boxes = {i.index.fqn: (tuple(i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes))
                         for i in fake.items}
                expected = {fqn: rank_box(layout, shape, rank, world) for fqn, shape in tensors}
                assert boxes == expected, (layout, world, rank)
            finally:
                fake.close()
        built = [plan.storage_data for plan in _all_summaries(layout, world, real)]
        assert built == [real[r] for r in range(world)], (layout, world)
        return world
    finally:
        shutil.rmtree(work, ignore_errors=True)


def rank_planning(layout: str, worlds: list[int], entries: int, repeats: int) -> dict:
    """Rank 0's planning (ZarrSavePlanner.create_local_plan, ZarrWriter.prepare_local_plan, LocalSave.rank_writes),
    cold caches, at each world size, interleaved over ``repeats`` rounds; medians."""
    tensors = model_tensors(entries)
    times: dict[int, dict[str, list[float]]] = {w: defaultdict(list) for w in worlds}
    work = tempfile.mkdtemp(prefix="dcp-zarr-rank-")
    try:
        for round_ in range(repeats):
            for world in worlds:
                fake = FakeRank(tensors, layout, world, 0, work)
                try:
                    writer = fake.writer(f"w{world}-{round_}.zarr")
                    sent, found = fake.local_plan(writer)
                    plans = _all_summaries(layout, world, {r: sent.storage_data._replace(rank=r) for r in
                                                           {_representative(layout, r) for r in range(world)}})
                    ticket = fake.writer(f"c{world}-{round_}.zarr").prepare_global_plan(plans)[0].storage_data
                    found["rank_writes_s"], items = fake.rank_writes(writer, ticket)
                    found["total_s"] = sum(found.values())
                    found["writes"] = len(items)
                    warm_writer = fake.writer(f"w{world}-{round_}-warm.zarr")  # the next save: caches kept
                    start = time.perf_counter()
                    planner = ZarrSavePlanner()
                    planner.set_up_planner(fake.state, None, True)
                    warm_writer.prepare_local_plan(planner.create_local_plan())
                    found["warm_total_s"] = time.perf_counter() - start + fake.rank_writes(warm_writer, ticket)[0]
                    for key, value in found.items():
                        times[world][key].append(value)
                finally:
                    fake.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {str(w): {k: statistics.median(v) for k, v in found.items()} for w, found in times.items()}


def coordinator_cpu(layout: str, world: int, entries: int, repeats: int) -> dict:
    """The coordinator's part of a ZarrSavePlanner save (rank 0, cold caches: the first save after a restart), medians
    of ``repeats``: unpickling the gathered Summaries, ZarrSavePlanner.create_global_plan and
    ZarrWriter.prepare_global_plan (check_summaries, the Tickets; check_summaries also alone), pickling the replies,
    unpickling the RankReports, ZarrWriter.finish (manifest entries, every group's and the root's zarr.json, the
    commit, into a temporary directory) and pickling the Metadata it broadcasts. Rank 0's own rank_writes runs
    untimed between them, as in a save."""
    tensors = model_tensors(entries)
    work = tempfile.mkdtemp(prefix="dcp-zarr-coordinator-")
    times: dict[str, list[float]] = defaultdict(list)
    others = {}  # HSDP's other replica groups' Summaries, planned for real once
    for rank in sorted({_representative(layout, r) for r in range(world)} - {0}):
        other = FakeRank(tensors, layout, world, rank, work)
        try:
            others[rank] = other.local_plan(other.writer(f"r{rank}.zarr"), timing=False)[0].storage_data
        finally:
            other.close()
    fake = FakeRank(tensors, layout, world, 0, work)
    try:
        for round_ in range(repeats):
            writer = fake.writer(f"ckpt-{round_}.zarr")
            sent, _ = fake.local_plan(writer)
            summaries = {**others, 0: sent.storage_data}
            wire = [pickle.dumps(plan) for plan in _all_summaries(layout, world, summaries)]
            found = {}
            start = time.perf_counter()
            plans = [pickle.loads(data) for data in wire]
            found["unpickle_plans_s"] = time.perf_counter() - start
            start = time.perf_counter()
            check_summaries([plan.storage_data for plan in plans])
            check_s = time.perf_counter() - start
            start = time.perf_counter()
            plans, metadata = fake.planner.create_global_plan(plans)
            replies = writer.prepare_global_plan(plans)
            found["global_plan_s"] = time.perf_counter() - start
            start = time.perf_counter()
            scattered = [pickle.dumps(plan) for plan in replies]
            found["pickle_replies_s"] = time.perf_counter() - start
            _, items = fake.rank_writes(writer, replies[0].storage_data)
            wire = [pickle.dumps(_report(_held_bytes(items))) for _ in range(world)]
            start = time.perf_counter()
            results = [pickle.loads(data) for data in wire]
            found["unpickle_results_s"] = time.perf_counter() - start
            start = time.perf_counter()
            writer.finish(metadata, results)
            found["finish_s"] = time.perf_counter() - start
            start = time.perf_counter()
            pickle.dumps(metadata)
            found["pickle_metadata_s"] = time.perf_counter() - start
            found["total_s"] = sum(found.values())
            found["check_summaries_s"] = check_s  # inside global_plan_s
            for key, value in found.items():
                times[key].append(value)
            del scattered, wire, results
    finally:
        fake.close()
        shutil.rmtree(work, ignore_errors=True)
    return {"layout": layout, "world": world, "entries": entries, **{k: statistics.median(v) for k, v in times.items()}}


def sampled_save_planning(world: int, entries: int, batch: int, batches: int) -> dict:
    """Coordinator save planning over ``entries`` tensors, estimated from ``batches`` full planning calls of
    ``batch`` tensors each, scaled by entries / (batch x batches): every step timed is per tensor."""
    totals = {"dcp_global_plan_s": 0.0, "zarr_added_s": 0.0, "fs_added_s": 0.0}
    tensors = model_tensors(batch * batches)
    for start in range(0, batch * batches, batch):
        work = tempfile.mkdtemp(prefix="dcp-zarr-scale-")
        try:
            planning = coordinator_planning(save_plans(tensors[start:start + batch], "fsdp", world), work)
            for key in totals:
                totals[key] += planning[key]
            del planning
        finally:
            shutil.rmtree(work, ignore_errors=True)
    scale = entries / (batch * batches)
    return {"layout": "fsdp", "world": world, "entries": entries, "measured_entries": batch * batches,
            **{key: value * scale for key, value in totals.items()}}


def interleaved_load_planning(worlds: list[int], entries: int, rounds: int) -> dict[int, float]:
    """A loading rank's read_metadata + read items of dcp_zarr stores saved at each world size, timed round-robin
    over the world sizes (``rounds`` rounds, medians), so this machine's drifting speed falls on all of them alike."""
    tensors = model_tensors(entries)
    keep = tempfile.mkdtemp(prefix="dcp-zarr-scale-kept-")
    local = loading_shards(tensors)
    try:
        for world in worlds:
            work = tempfile.mkdtemp(prefix="dcp-zarr-scale-")
            try:
                planning = coordinator_planning(save_plans(tensors, "fsdp", world), work)
                planning["zarr_writer"].finish(planning["metadata"], zarr_results(planning["global_plan"], world))
                del planning
                shutil.copytree(os.path.join(work, "ckpt.zarr"), os.path.join(keep, f"ws{world}.zarr"))
            finally:
                shutil.rmtree(work, ignore_errors=True)
        gc.collect()
        times: dict[int, list[float]] = {world: [] for world in worlds}
        for _ in range(rounds):
            for world in worlds:
                start = time.perf_counter()
                read_items(ZarrReader(os.path.join(keep, f"ws{world}.zarr")).read_metadata(), local)
                times[world].append(time.perf_counter() - start)
        return {world: statistics.median(values) for world, values in times.items()}
    finally:
        shutil.rmtree(keep, ignore_errors=True)


def format1_validation(boxes: int, repeats: int) -> float:
    entry = {"path": ["w"], "kind": "tensor", "node": "w", "dtype": "torch.float32", "shape": [boxes, 2],
             "chunk_shape": [1, 2], "saved_chunks": [{"offsets": [i, 0], "sizes": [1, 2]} for i in range(boxes)]}
    document = {"format": "dcp_zarr", "format_version": 1, "complete": True, "entries": {"w": entry}}
    return timed(lambda: Manifest.from_json(document, "scale"), repeats)[0]


def table(rows: list[dict]) -> str:
    head = ("| layout | ranks | entries | DCP plan s | zarr added s | root zarr.json kB (manifest) | DCP .metadata kB "
            "| read+parse s "
            "zarr / DCP | load plan s zarr / DCP | read items zarr / DCP | validate s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['world']} | {r['entries']} | {r['dcp_global_plan_s']:.3f} | {r['zarr_added_s']:.3f} "
            f"| {r['zarr_root_bytes'] / 1e3:.1f} ({r['zarr_manifest_bytes'] / 1e3:.1f}) "
            f"| {r['dcp_metadata_bytes'] / 1e3:.1f} "
            f"| {r['zarr_read_metadata_s']:.4f} / {r['dcp_read_metadata_s']:.3f} "
            f"| {r['zarr_load_plan_s']:.4f} / {r['dcp_load_plan_s']:.3f} "
            f"| {r['zarr_read_items']} / {r['dcp_read_items']} | {r['zarr_validate_s']:.4f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fsdp = sorted((r for r in rows if r["layout"] == "fsdp" and r["entries"] == rows[0]["entries"]),
                  key=lambda r: r["world"])
    worlds = [r["world"] for r in fsdp]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = [
        ("metadata bytes", [("dcp_zarr root zarr.json", "zarr_root_bytes"),
                            ("dcp_zarr manifest", "zarr_manifest_bytes"), ("DCP .metadata", "dcp_metadata_bytes")]),
        ("per-rank read + parse + load plan (s)",
         [("dcp_zarr", ("zarr_read_metadata_s", "zarr_load_plan_s")),
          ("DCP", ("dcp_read_metadata_s", "dcp_load_plan_s"))]),
        ("coordinator save planning (s)", [("dcp_zarr prepare_global_plan (added)", "zarr_added_s"),
                                           ("DCP create_global_plan", "dcp_global_plan_s")]),
    ]
    for ax, (title, lines) in zip(axes, series):
        for label, keys in lines:
            keys = keys if isinstance(keys, tuple) else (keys,)
            ax.plot(worlds, [sum(r[k] for k in keys) for r in fsdp], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"saving ranks (FSDP, {fsdp[0]['entries']} entries)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _interleaved_text(medians: dict[int, float]) -> str:
    first = min(medians)
    return ("a loading rank's read_metadata + read items (FSDP, 100 entries), round-robin over saving world sizes, "
            "medians of 51: " + ", ".join(f"{world} ranks {s * 1e3:.2f} ms ({s / medians[first]:.2f}x)"
                                          for world, s in medians.items()))


def planning_grid(rows: list[dict], worlds: dict[str, list[int]], entry_counts: list[int]) -> list[dict]:
    """Bytes per save and per load for every kind, at each layout, world size and tensor count: dcp_zarr from its
    real objects; DCP from a measured row's (exact), or scaled from the row at 100 tensors."""
    exact = {(r["layout"], r["world"], r["entries"]): r["wire"] for r in rows if "wire" in r}
    points = []
    for layout, layout_worlds in worlds.items():
        for world in layout_worlds:
            for entries in entry_counts:
                dcp = exact.get((layout, world, entries))
                if dcp is None:
                    dcp = scaled_dcp_wire(exact[(layout, world, 100)], model_tensors(entries), layout, world)
                zarr = zarr_wire(layout, world, entries)
                none = {"per_rank": 0, "coordinator": 0}
                points.append({"layout": layout, "world": world, "entries": entries, "dcp_exact": dcp["exact"],
                               "save": {**zarr["save"], **dcp["save"], "no_collectives": none},
                               "load": {**zarr["load"], **dcp["load"]}})
                print(planning_tables({"wire": points[-1:]}).splitlines()[2], flush=True)
    return points


def _size(n: float) -> str:
    for unit, step in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= step:
            return f"{n / step:.{1 if n < 100 * step else 0}f} {unit}"
    return f"{n:.0f} B"


def planning_tables(planning: dict) -> str:
    lines = ["| layout | ranks | tensors | dcp_zarr / rank | DCP / rank | DCP cached, later / rank "
             "| dcp_zarr coordinator | DCP coordinator | DCP cached, later coordinator |", "|" + "---|" * 9]
    for p in planning["wire"]:
        mark = "" if p["dcp_exact"] else "~"
        save = p["save"]
        lines.append(f"| {p['layout']} | {p['world']} | {p['entries']} | {_size(save['dcp_zarr']['per_rank'])} "
                     f"| {mark}{_size(save['dcp_default']['per_rank'])} "
                     f"| {mark}{_size(save['dcp_cached_later']['per_rank'])} "
                     f"| {_size(save['dcp_zarr']['coordinator'])} | {mark}{_size(save['dcp_default']['coordinator'])} "
                     f"| {mark}{_size(save['dcp_cached_later']['coordinator'])} |")
    text = "\n".join(lines) if planning["wire"] else ""
    if len(planning["wire"]) == 1 or "rank_planning" not in planning:
        return text
    lines = ["| layout | ranks | tensors | dcp_zarr / rank | DCP / rank | dcp_zarr coordinator | DCP coordinator "
             "| of which DCP's read-done all_gather / rank |", "|" + "---|" * 8]
    for p in planning["wire"]:
        mark = "" if p["dcp_exact"] else "~"
        load = p["load"]
        lines.append(f"| {p['layout']} | {p['world']} | {p['entries']} | {_size(load['dcp_zarr']['per_rank'])} "
                     f"| {mark}{_size(load['dcp_default']['per_rank'])} | {_size(load['dcp_zarr']['coordinator'])} "
                     f"| {mark}{_size(load['dcp_default']['coordinator'])} "
                     f"| {_size(load['dcp_zarr']['read_done_per_rank'])} |")
    if planning["wire"]:
        text += "\n\nLoads (plans gathered and scattered, then DCP's all_gather of each rank's read result):\n\n"
        text += "\n".join(lines)
    lines = ["| layout | tensors | ranks | create_local_plan s | prepare_local_plan s | rank_writes s | total s "
             "| total / first world's | next save (warm) s | items written |", "|" + "---|" * 10]
    for layout, found in planning["rank_planning"].items():
        first = next(iter(found["worlds"].values()))["total_s"]
        for world, t in found["worlds"].items():
            lines.append(f"| {layout} | {found['entries']} | {world} | {t['create_local_plan_s']:.4f} "
                         f"| {t['prepare_local_plan_s']:.4f} | {t['rank_writes_s']:.4f} | {t['total_s']:.4f} "
                         f"| {t['total_s'] / first:.2f}x | {t['warm_total_s']:.4f} | {t['writes']:.0f} |")
    text += "\n\nOne rank's planning (rank 0, cold caches; medians, world sizes interleaved):\n\n" + "\n".join(lines)
    lines = ["| layout | ranks | tensors | unpickle Summaries s | create_global_plan + prepare_global_plan s "
             "(check_summaries) | pickle Tickets s | unpickle RankReports s | finish s | pickle Metadata s | total s "
             "|", "|" + "---|" * 10]
    for c in planning["coordinator_cpu"]:
        lines.append(f"| {c['layout']} | {c['world']} | {c['entries']} | {c['unpickle_plans_s']:.4f} "
                     f"| {c['global_plan_s']:.4f} ({c['check_summaries_s']:.4f}) | {c['pickle_replies_s']:.4f} "
                     f"| {c['unpickle_results_s']:.4f} | {c['finish_s']:.4f} | {c['pickle_metadata_s']:.5f} "
                     f"| {c['total_s']:.3f} |")
    text += ("\n\nThe coordinator's CPU per dcp_zarr save (rank 0, cold caches; medians):\n\n" + "\n".join(lines))
    return text


def plot_planning(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({p["entries"] for p in points})
    fig, axes = plt.subplots(1, len(counts), figsize=(5.2 * len(counts), 3.8), squeeze=False)
    labels = {"dcp_zarr": "dcp_zarr (ZarrSavePlanner)", "dcp_default": "DCP default (= cached, first save)",
              "dcp_cached_later": "DCP cached, later saves"}
    for ax, entries in zip(axes[0], counts):
        fsdp = sorted((p for p in points if p["layout"] == "fsdp" and p["entries"] == entries),
                      key=lambda p: p["world"])
        worlds = [p["world"] for p in fsdp]
        for kind, label in labels.items():
            ax.plot(worlds, [p["save"][kind]["coordinator"] for p in fsdp], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"saving ranks (FSDP, {entries} tensors)")
        ax.set_ylabel("bytes through the coordinator per save")
        ax.set_title("use_collectives=False: 0 (no resharding)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def stamp() -> dict:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    sources = hashlib.blake2b(digest_size=8)  # which library code ran, when it is not a commit's
    for path in sorted(glob.glob(os.path.join(root, "dcp_zarr", "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            sources.update(os.path.relpath(path, root).encode() + b"\0" + f.read())
    return {"commit": git("rev-parse", "--short", "HEAD"), "dcp_zarr_uncommitted": bool(git("status", "--porcelain",
            "dcp_zarr")), "dcp_zarr_sources": sources.hexdigest(), "torch": torch.__version__,
            "command": " ".join(["python", "benchmarks/scale.py", *sys.argv[1:]])}


def measure_planning(rows: list[dict], quick: bool, repeats: int, rank_repeats: int, tp_worlds: list[int],
                     wire: bool = True) -> dict:
    if quick:
        worlds = {"fsdp": [8, 64], "hsdp": [8, 64], "fsdp_tp": [8, 64]}
        rank_worlds = {"fsdp": [8, 64], "hsdp": [8, 64], "fsdp_tp": [8, 64]}
        rank_entries, coordinator, checked_entries = 100, [(layout, 64, 300) for layout in worlds], 16
    else:
        worlds = {"fsdp": [8, 64, 512, 2048, 8192], "hsdp": [8, 512, 8192], "fsdp_tp": [8, 512, 8192]}
        # HSDP at 8 ranks is (1, 8): no replicas; 16 is the first world whose ranks checksum replicated boxes
        rank_worlds = {"fsdp": [8, 8192], "hsdp": [8, 16, 8192], "fsdp_tp": tp_worlds}
        rank_entries, coordinator, checked_entries = 2000, [("fsdp", 8192, 2000), ("hsdp", 8192, 2000)], 100
    checked = {layout: check_representatives(layout, _CHECKED_WORLD, checked_entries) for layout in worlds}
    planning: dict = {"checked_ranks": checked, "wire": planning_grid(rows, worlds, [100, 2000]) if wire else []}
    planning["rank_planning"] = {}
    for layout, layout_worlds in rank_worlds.items():
        planning["rank_planning"][layout] = {"entries": rank_entries,
                                             "worlds": rank_planning(layout, layout_worlds, rank_entries,
                                                                     rank_repeats)}
        print(layout, planning["rank_planning"][layout], flush=True)
    planning["coordinator_cpu"] = []
    for point in coordinator:
        planning["coordinator_cpu"].append(coordinator_cpu(*point, repeats))
        print(planning["coordinator_cpu"][-1], flush=True)
    return planning


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: 8 and 64 ranks, 300 and 1,000 entries")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/scale",
                        help="directory for scale.json, scale.md, scale.png")
    parser.add_argument("--interleaved-only", action="store_true",
                        help="only the round-robin timing of a loading rank's read_metadata + read items")
    parser.add_argument("--planning-only", action="store_true",
                        help="only the rows the planning measures need (100 tensors), then those measures")
    parser.add_argument("--timing-only", action="store_true",
                        help="only the per-rank planning and the coordinator's CPU (no bytes, no rows)")
    parser.add_argument("--rank-repeats", type=int, default=5, help="rounds of the per-rank planning timing")
    parser.add_argument("--tp-worlds", default="8,8192",
                        help="world sizes of FSDP+TP's per-rank planning timing (full run)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    interleaved_worlds = [8, 64] if args.quick else [8, 64, 512, 2048, 8192]
    if args.interleaved_only:
        print(_interleaved_text(interleaved_load_planning(interleaved_worlds, 100, 51)))
        return 0
    if args.timing_only:
        planning = measure_planning([], args.quick, args.repeats, args.rank_repeats,
                                    [int(w) for w in args.tp_worlds.split(",")], wire=False)
        with open(os.path.join(args.out, "planning-timing.json"), "w") as f:
            json.dump({**stamp(), **planning}, f, indent=1)
        print(planning_tables({**planning, "wire": []}), flush=True)
        return 0
    if args.quick:
        worlds = {"fsdp": [8, 64], "hsdp": [8, 64], "fsdp_tp": [8, 64]}
        world_entries, entry_counts, target, boxes = 100, [300, 1000], None, 10_000
    else:
        worlds = {"fsdp": [8, 64, 512, 2048, 8192], "hsdp": [8, 512, 8192], "fsdp_tp": [8, 512, 8192]}
        world_entries, entry_counts, target, boxes = 100, [300, 2000, 6000, 20000], (8192, 2000, 50, 2), 1_000_000
    rows = []
    for layout, layout_worlds in worlds.items():
        for world in layout_worlds:
            rows.append(measure(layout, world, world_entries, args.repeats))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    for entries in [] if args.planning_only else entry_counts:
        rows.append(measure("fsdp", 64, entries, args.repeats))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    tp_worlds = [int(w) for w in args.tp_worlds.split(",")]
    planning = measure_planning(rows, args.quick, args.repeats, args.rank_repeats, tp_worlds)
    planning_text = planning_tables(planning)
    with open(os.path.join(args.out, "planning.json"), "w") as f:
        json.dump({**stamp(), **planning}, f, indent=1)
    with open(os.path.join(args.out, "planning.md"), "w") as f:
        f.write(planning_text + "\n")
    plot_planning(planning["wire"], os.path.join(args.out, "planning.png"))
    print(planning_text, flush=True)
    if args.planning_only:
        return 0
    report = {"rows": rows,
              "format1_validation_s": {"boxes": boxes, "seconds": format1_validation(boxes, args.repeats)},
              "torch": torch.__version__, **stamp(), "planning": planning}
    if target:
        report["target"] = sampled_save_planning(*target)
    report["interleaved_load_planning_s"] = interleaved_load_planning(interleaved_worlds, 100, 51)
    text = table(rows)
    text += (f"\n\nformat-1 entry of {boxes:,} boxes: "
             f"Manifest.from_json {report['format1_validation_s']['seconds']:.2f} s")
    if target:
        t = report["target"]
        text += (f"\ncoordinator save planning at {t['world']} ranks x {t['entries']} tensors (measured on "
                 f"{t['measured_entries']}, scaled): "
                 f"DCP {t['dcp_global_plan_s']:.1f} s, dcp_zarr adds {t['zarr_added_s']:.1f} s "
                 f"({t['zarr_added_s'] / t['dcp_global_plan_s']:.0%}), FileSystemWriter adds {t['fs_added_s']:.2f} s")
    text += "\n" + _interleaved_text(report["interleaved_load_planning_s"])
    text += "\n\nBytes per save (pickles of what DCP's collectives carry; ~: DCP scaled from 100 tensors):\n\n"
    text += planning_text
    print(text)
    with open(os.path.join(args.out, "scale.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "scale.md"), "w") as f:
        f.write(text + "\n")
    plot(rows, os.path.join(args.out, "scale.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
