"""Metadata and planning at 8 to 8,192 ranks, simulated in one process, beside DCP's FileSystemWriter/Reader
(commands: benchmarks/README.md).

No process group: each saving rank's SavePlan is built as its DefaultSavePlanner would (one WriteItem per tensor
shard: FSDP ``Shard(0)``, HSDP ``(Replicate, Shard(0))`` on an (n/8, 8) mesh, FSDP+TP on an (n/8, 8) (dp, tp) mesh)
for a transformer's bf16 weights, and the functions a real save and load call are timed on them: the coordinator's
planning (DCP's ``create_global_plan``, then what each writer's ``prepare_global_plan`` adds), each writer's
``finish`` (the bytes of ``.metadata`` and of the root ``zarr.json``), a loading rank's ``read_metadata`` and DCP's
read items for its shard of a 128-rank FSDP job, and ``Manifest.from_json``.

Then the planning measures (planning.json, planning.md): the bytes DCP's object collectives carry per save and load
(pickles of the real objects) for dcp_zarr (ZarrSavePlanner, its ranks planned for real on torch's fake process
group, one representative per replica group, checked against every rank of a 16-rank job), DCP's default, DCP with
``enable_plan_caching`` (later saves) and ``use_collectives=False`` (nothing); DCP's exact at 100 tensors and scaled
to 2,000 by its sampled ranks' plans (``~``); one rank's planning from cold caches, world sizes interleaved; and the
coordinator's CPU per dcp_zarr save at 8,192 x 2,000.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import pickle
import statistics
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

from benchmarks import harness as h
from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter
from dcp_zarr.format.manifest import Manifest
from dcp_zarr.planning import replicas
from dcp_zarr.planning.protocol import REPORT_FQN, RankReport, check_summaries
from dcp_zarr.saving.locally_planned_save import LocallyPlannedSave

HIDDEN, LOAD_WORLD_SIZE = 4096, 128
_PROPS = TensorProperties(dtype=torch.bfloat16)
_CHECKED_WORLD = 16  # every rank planned for real, to check the summaries built from representative ranks
_SAMPLED_RANKS = 16  # ranks whose local plans are pickled to scale DCP's bytes from 100 tensors to more
LAYOUTS = ("fsdp", "hsdp", "fsdp_tp")
WORLDS = {"fsdp": [8, 64, 512, 2048, 8192], "hsdp": [8, 512, 8192], "fsdp_tp": [8, 512, 8192]}
QUICK_WORLDS = {layout: [8, 64] for layout in LAYOUTS}


def model_tensors(entries: int) -> list[tuple[str, tuple[int, ...]]]:
    """A transformer's weights: per layer four (d, d) attention matrices, (4d, d) and (d, 4d) MLP, two norms."""
    d = HIDDEN
    per_layer = [("wq", (d, d)), ("wk", (d, d)), ("wv", (d, d)), ("wo", (d, d)), ("w1", (4 * d, d)),
                 ("w2", (d, 4 * d)), ("norm1", (d,)), ("norm2", (d,))]
    return [(f"model.layers.{i // 8}.{per_layer[i % 8][0]}", per_layer[i % 8][1]) for i in range(entries)]


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's split, as FSDP2 uses it: (offset, size) of part ``index``; trailing parts may be empty."""
    step = -(-n // parts)
    start = min(index * step, n)
    return start, min(step, n - start)


def rank_box(layout: str, shape: tuple[int, ...], rank: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if layout == "fsdp":
        start, size = _split(shape[0], world, rank)
    elif layout == "hsdp":  # (replicate, shard) mesh with 8-way sharding: replicas hold the same box
        start, size = _split(shape[0], 8, rank % 8)
    else:  # fsdp_tp: (dp, tp) mesh, tp = 8 colwise; FSDP splits each TP shard (a _StridedShard)
        tp_start, tp_size = _split(shape[0], 8, rank % 8)
        start, size = _split(tp_size, world // 8, rank // 8)
        start += tp_start
    if size == 0:  # an empty shard sits at the tensor's end, as FSDP2's do: it must not share a real shard's offset
        start = shape[0]
    return (start, *(0 for _ in shape[1:])), (size, *shape[1:])


def _new(cls, **fields):
    """A DCP plan object with its fields set directly: its frozen dataclass __init__ costs ~10 us, which at 16M
    items would dominate the run. Building plans is each rank's own work in a real job, and is not timed."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def save_plans(tensors, layout: str, world: int, ranks=None) -> list[SavePlan]:
    """The SavePlan of each of ``ranks`` (default: every rank), as DefaultSavePlanner makes it."""
    data, plans = {fqn: ("model", fqn.removeprefix("model.")) for fqn, _ in tensors}, []
    for rank in range(world) if ranks is None else ranks:
        items = []
        for fqn, shape in tensors:
            offsets, sizes = rank_box(layout, shape, rank, world)
            items.append(_new(WriteItem, index=_new(MetadataIndex, fqn=fqn, offset=torch.Size(offsets), index=None),
                              type=WriteItemType.SHARD, bytes_io_data=None, tensor_data=_new(
                                  TensorWriteData, chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                  properties=_PROPS, size=torch.Size(shape))))
        plans.append(SavePlan(items, planner_data=data))
    return plans


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
    return {"dcp_global_plan_s": dcp_s, "zarr_added_s": zarr_s, "fs_added_s": fs_s, "global_plan": global_plan,
            "metadata": metadata, "zarr_writer": zarr_writer, "fs_writer": fs_writer}


def zarr_results(global_plan: list[SavePlan], world: int) -> list[list[WriteResult]]:
    """The WriteResults each rank's ZarrWriter.write_data would return (the chunks themselves are not written)."""
    source = {"type": "dtensor", "placements": ["S(0)"], "mesh_shape": [world], "mesh_dim_names": None}
    return [[WriteResult(item.index, 0, {"source": source}) for item in plan.items] for plan in global_plan]


def _fs_results(plan: SavePlan, rank: int) -> list[WriteResult]:
    """The WriteResults FileSystemWriter.write_data returns: one per item, where its bytes lie in the rank's file."""
    lengths = [math.prod(item.tensor_data.chunk.sizes) * _PROPS.dtype.itemsize for item in plan.items]
    return [WriteResult(item.index, length, _StorageInfo(f"__{rank}_0.distcp", offset, length))
            for item, length, offset in zip(plan.items, lengths, itertools.accumulate(lengths, initial=0))]


def rank_shards(tensors, layout: str, rank: int, world: int) -> dict[str, list[ChunkStorageMetadata]]:
    """The rank's shard of each tensor, as its load plan asks for it."""
    return {fqn: [ChunkStorageMetadata(*map(torch.Size, rank_box(layout, shape, rank, world)))]
            for fqn, shape in tensors}


def read_items(metadata, local: dict) -> int:
    """DCP's read items for the rank's shards (what create_default_local_load_plan makes per tensor)."""
    return sum(len(create_read_items_for_chunk_list(fqn, metadata.state_dict_metadata[fqn], chunks))
               for fqn, chunks in local.items())


def measure(layout: str, world: int, entries: int, repeats: int) -> dict:
    """One row: the coordinator's planning, each writer's metadata, DCP's protocol bytes, a loading rank's work."""
    tensors = model_tensors(entries)
    with tempfile.TemporaryDirectory(prefix="dcp-zarr-scale-") as work:
        plans = save_plans(tensors, layout, world)
        planning = coordinator_planning(plans, work)
        row = {"layout": layout, "world": world, "entries": entries,
               **{k: v for k, v in planning.items() if k.endswith("_s")}}
        os.makedirs(os.path.join(work, "dcp"), exist_ok=True)
        planning["fs_writer"].finish(planning["metadata"], [_fs_results(p, r) for r, p in enumerate(
            planning["global_plan"])])
        planning["zarr_writer"].finish(planning["metadata"], zarr_results(planning["global_plan"], world))
        root = os.path.join(work, "ckpt.zarr", "zarr.json")
        with open(root) as f:
            document = json.load(f)["attributes"]["dcp_zarr"]
        # the root zarr.json (what a loading rank reads) holds the manifest and a copy of every node's zarr.json
        row.update(zarr_root_bytes=os.path.getsize(root),
                   zarr_manifest_bytes=len(json.dumps(document, separators=(",", ":"))),
                   dcp_metadata_bytes=os.path.getsize(os.path.join(work, "dcp", ".metadata")))
        row["wire"] = dcp_wire(plans, planning, tensors, layout, world)
        planning = plans = None
        # A loading rank: dcp_zarr's steps take milliseconds, so they get more repeats than DCP's (seconds at 8,192
        # ranks); each side runs with only its own metadata alive, as on a real rank: DCP's (millions of objects at
        # 8,192 ranks) would otherwise slow dcp_zarr's steps through the garbage collector.
        cheap, local = max(25, repeats), rank_shards(tensors, "fsdp", 0, LOAD_WORLD_SIZE)  # rank 0 of an FSDP job
        gc.collect()
        row["zarr_read_metadata_s"], zarr_md = timed(lambda: ZarrReader(os.path.join(work, "ckpt.zarr"))
                                                     .read_metadata(), cheap)
        row["zarr_load_plan_s"], row["zarr_read_items"] = timed(lambda: read_items(zarr_md, local), cheap)
        row["zarr_validate_s"], _ = timed(lambda: Manifest.from_json(document, "scale"), cheap)
        zarr_md = document = None  # None, not del: pyflakes would read the lambdas above as using deleted names
        gc.collect()
        row["dcp_read_metadata_s"], fs_md = timed(lambda: FileSystemReader(os.path.join(work, "dcp"))
                                                  .read_metadata(), repeats)
        row["dcp_load_plan_s"], row["dcp_read_items"] = timed(lambda: read_items(fs_md, local), repeats)
        return row


# -- what DCP's collectives carry: each object as its pickle (torch's _object_to_tensor), padded to the largest rank's
# and preceded by an int64 size; the pickles of the real objects are counted -----------------------------------------


def pickled(obj) -> int:
    return len(pickle.dumps(obj))


def _totals(world: int, parts: dict) -> dict:
    moved = parts["plans_up"] + parts["plans_down"] + parts["results_up"]
    return {**parts, "per_rank": moved / world + parts["broadcast"], "coordinator": moved + parts["broadcast"],
            "broadcast_delivered": parts["broadcast"] * (world - 1)}


def _traffic(world: int, up: list[int], down: list[int], results: list[int], broadcast: int) -> dict:
    """A save's bytes: the gathered plans (up), the scattered replies (down), the gathered write results and one
    object broadcast to every rank. Through the coordinator: what it receives and sends, the broadcast once (a tree
    or ring broadcast sends it from rank 0 about once; every rank receives it: ``broadcast_delivered``)."""
    return _totals(world, {"plans_up": sum(up), "plans_down": sum(down), "results_up": sum(results),
                           "broadcast": broadcast, "max_rank": max(u + d + r for u, d, r in zip(up, down, results))
                           + broadcast, "coordinator_padded": world * (max(up) + max(results)) + sum(down) + broadcast})


def _load_traffic(world: int, up: float, down: float) -> dict:
    """A load's bytes: plans gathered and scattered, then DCP's all_gather of every rank's read result (None): each
    rank receives all of them, whatever the reader."""
    done = world * pickled(None)
    return {"per_rank": (up + down) / world + done, "coordinator": up + down + done, "plans_up": up,
            "plans_down": down, "read_done_per_rank": done}


def dcp_load_plans(tensors, layout: str, world: int, metadata, ranks: list[int]) -> list[LoadPlan]:
    """DCP's LoadPlan of each of ``ranks`` loading at the saved layout, as FileSystemReader passes it on."""
    return [LoadPlan([item for fqn, chunks in rank_shards(tensors, layout, rank, world).items()
                      for item in create_read_items_for_chunk_list(fqn, metadata.state_dict_metadata[fqn], chunks)])
            for rank in ranks]


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
    load_up = sum(pickled(plan) for plan in load_plans) * world / len(ranks)
    load_down = sum(pickled(plan) for plan in DefaultLoadPlanner().create_global_plan(load_plans)) * world / len(ranks)
    return {"save": {"dcp_default": _traffic(world, up, down, results, broadcast),
                     "dcp_cached_later": _traffic(world, [pickled(unusable)] * world, cached_down, results, broadcast)},
            "load": {"dcp_default": _load_traffic(world, load_up, load_down)},
            "sampled_plan_bytes": sum(up[r] for r in sampled(world, _SAMPLED_RANKS)), "exact": True}


def scaled_dcp_wire(exact: dict, tensors, layout: str, world: int) -> dict:
    """DCP's bytes at more tensors than a measured row: the row's, times the ratio of the sampled ranks' pickled
    local plans (exact, at both sizes). A caching planner's later plans and deltas do not grow."""
    ratio = sum(pickled(plan) for plan in save_plans(tensors, layout, world, sampled(world, _SAMPLED_RANKS))) / exact[
        "sampled_plan_bytes"]
    parts = ("plans_up", "plans_down", "results_up", "broadcast")
    save = {kind: _totals(world, {**{k: traffic[k] * (ratio if kind == "dcp_default" or k in parts[2:] else 1)
                                     for k in parts}, "max_rank": None, "coordinator_padded": None})
            for kind, traffic in exact["save"].items()}
    load = {k: _load_traffic(world, v["plans_up"] * ratio, v["plans_down"] * ratio) for k, v in exact["load"].items()}
    return {"save": save, "load": load, "exact": False, "scaled_by": ratio}


# -- dcp_zarr's ranks planned for real, on torch's fake process group --------------------------------------------------

_PLAN_CACHES = {"dcp_zarr.planning.recent_plans": "recent_plans", "dcp_zarr.placement.holdings": "_positions_made"}


def clear_caches() -> None:
    """Empty every cache of dcp_zarr's planning (functools caches, and the module-level ones of _PLAN_CACHES): a
    restarted process's first save. Says so when a named cache is gone (the library changed: update _PLAN_CACHES)."""
    modules = [module for name, module in list(sys.modules.items()) if name.partition(".")[0] == "dcp_zarr"]
    for value in [value for module in modules for value in vars(module).values()]:
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()
    for module_name, attribute in _PLAN_CACHES.items():
        cache = getattr(sys.modules.get(module_name), attribute, None)
        cache = getattr(cache, "_plans", cache)  # planning/recent_plans.py's RecentPlans keeps an OrderedDict
        if hasattr(cache, "clear"):
            cache.clear()
        else:
            print(f"scale: no cache {module_name}.{attribute} to clear", file=sys.stderr)


class FakeRank:
    """One rank of a ``world``-rank job in this process: torch's fake process group, the layout's mesh and the
    rank's state dict of DTensors (none of it timed). Local tensors are meta (planning reads no data), but for boxes
    other ranks hold too that the replica check reads: those are real, as the check is real work."""

    def __init__(self, tensors, layout: str, world: int, rank: int, work: str):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.placement_types import _StridedShard
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        self.layout, self.world, self.rank, self.work = layout, world, rank, work
        mesh_shape, names, placements = {  # fsdp_tp: FSDP over TP's colwise shards, as FSDP2 makes it
            "fsdp": ((world,), ("dp",), (Shard(0),)),
            "hsdp": ((world // 8, 8), ("replicate", "shard"), (Replicate(), Shard(0))),
            "fsdp_tp": ((world // 8, 8), ("dp", "tp"), (_StridedShard(0, split_factor=8), Shard(0)))}[layout]
        self.mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        replicated, self.state = layout == "hsdp" and world > 8, {}
        for fqn, shape in tensors:
            sizes = rank_box(layout, shape, rank, world)[1]
            real = replicated and math.prod(sizes) * _PROPS.dtype.itemsize <= replicas.DEFAULT_MAX_BYTES
            local = torch.zeros(sizes, dtype=_PROPS.dtype, device="cpu" if real else "meta")
            self.state[fqn] = DTensor.from_local(local, self.mesh, placements, run_check=False, shape=torch.Size(
                shape), stride=tuple(math.prod(shape[d + 1:]) for d in range(len(shape))))

    def __enter__(self) -> FakeRank:
        return self

    def __exit__(self, *exc) -> None:
        self.state = self.mesh = None
        dist.destroy_process_group()

    def writer(self, name: str) -> ZarrWriter:
        writer = ZarrWriter(os.path.join(self.work, name), sync_files=False)
        writer.set_up_storage_writer(self.rank == 0, rank=self.rank)
        return writer

    def coordinator(self, name: str) -> ZarrWriter:
        """A coordinator's writer for the gathered Summaries: its own local plan made first, as in a save."""
        writer = self.writer(name)
        self.local_plan(writer, timing=False, cold=False)
        return writer

    def local_plan(self, writer: ZarrWriter, timing: bool = True, cold: bool = True) -> tuple[SavePlan, dict]:
        """ZarrSavePlanner's local plan and ZarrWriter.prepare_local_plan, from cold caches if ``cold``: (the plan DCP
        gathers, times). ``timing``: collect garbage first (it costs more than planning when only bytes count)."""
        if cold:
            clear_caches()
        if timing:
            gc.collect()
        start = time.perf_counter()
        self.planner = ZarrSavePlanner()
        self.planner.set_up_planner(self.state, None, self.rank == 0)
        plan = self.planner.create_local_plan()
        planned = time.perf_counter()
        sent = writer.prepare_local_plan(plan)
        self.items = plan.planner_data.items
        return sent, {"create_local_plan_s": planned - start, "prepare_local_plan_s": time.perf_counter() - planned}

    def rank_writes(self, writer: ZarrWriter, ticket) -> tuple[float, list]:
        save = writer._save
        assert isinstance(save, LocallyPlannedSave)
        array_shards = save.settings.open(ticket.staging_location).writes_at_offsets
        seconds, (items, _) = timed(lambda: save.local.rank_writes(ticket, array_shards))
        return seconds, items


def _fake(tensors, layout: str, world: int, rank: int, work: str, then=None):
    """A rank planned for real: its Summary, and ``then(fake_rank, the plan it sends)`` while the rank is open."""
    with FakeRank(tensors, layout, world, rank, work) as fake:
        sent = fake.local_plan(fake.writer(f"r{rank}.zarr"), timing=False)[0]
        return sent.storage_data, then(fake, sent) if then else None


def _representative(layout: str, rank: int) -> int:
    """The rank whose Summary equals ``rank``'s but for the rank itself: HSDP's replicas of one box (rank % 8) share
    its replica group and checksums; FSDP's and FSDP+TP's boxes have no replicas, so every rank's entries agree."""
    return rank % 8 if layout == "hsdp" else 0


def _all_summaries(layout: str, world: int, summaries: dict[int, object]) -> list[SavePlan]:
    return [SavePlan([], storage_data=summaries[_representative(layout, r)]._replace(rank=r)) for r in range(world)]


def _report(nbytes: int) -> list[WriteResult]:
    """What a rank's ZarrWriter.write_data returns with ZarrSavePlanner: one WriteResult carrying its RankReport, here
    with no values, objects or checksums asked for (replicas agree)."""
    return [WriteResult(index=MetadataIndex(REPORT_FQN), size_in_bytes=nbytes, storage_data=RankReport({}, {}, {}))]


def _held_bytes(items) -> int:
    return sum(math.prod(i.tensor_data.chunk.sizes) * i.tensor_data.properties.dtype.itemsize for i in items)


def zarr_wire(layout: str, world: int, entries: int) -> dict:
    """dcp_zarr's save and load bytes at one point: the representative ranks planned for real, every rank's Summary
    from them, the coordinator's real replies, a RankReport per rank, the planner's Metadata."""
    tensors = model_tensors(entries)
    with tempfile.TemporaryDirectory(prefix="dcp-zarr-wire-") as work:
        summaries, held, metadata = {}, {}, None
        for rank in sorted({_representative(layout, r) for r in range(world)}):
            summaries[rank], (held[rank], found) = _fake(tensors, layout, world, rank, work, lambda fake, sent: (
                _held_bytes(fake.items), fake.planner.create_global_plan([sent])[1] if fake.rank == 0 else None))
            metadata = metadata or found
        plans = _all_summaries(layout, world, summaries)
        with FakeRank(tensors[:1], layout, world, 0, work) as fake:  # the coordinator's writer needs only the group
            replies = fake.coordinator("coordinator.zarr").prepare_global_plan(plans)
        results = [pickled(_report(held[_representative(layout, r)])) for r in range(world)]
        one = DefaultSavePlanner().create_global_plan(save_plans(tensors[:1], "fsdp", 1))[1]
        load = pickled(ZarrReader(os.path.join(work, "none.zarr")).prepare_local_plan(
            LoadPlan(dcp_load_plans(tensors[:1], "fsdp", 1, one, [0])[0].items)))
        return {"save": {"dcp_zarr": _traffic(world, [pickled(p) for p in plans], [pickled(p) for p in replies],
                                              results, pickled(metadata))},
                "load": {"dcp_zarr": _load_traffic(world, load * world, load * world)}}


def check_representatives(layout: str, world: int, entries: int) -> int:
    """Every rank of a small job planned for real: its Summary is its representative's but for the rank, and its
    DTensor boxes are the synthetic plans' (rank_box). Returns the ranks checked."""
    tensors, real = model_tensors(entries), {}
    with tempfile.TemporaryDirectory(prefix="dcp-zarr-wire-") as work:
        for rank in range(world):
            real[rank], boxes = _fake(tensors, layout, world, rank, work, lambda fake, _: {i.index.fqn: (tuple(
                i.tensor_data.chunk.offsets), tuple(i.tensor_data.chunk.sizes)) for i in fake.items})
            assert boxes == {fqn: rank_box(layout, shape, rank, world) for fqn, shape in tensors}, (layout, rank)
        built = [plan.storage_data for plan in _all_summaries(layout, world, real)]
        assert built == [real[r] for r in range(world)], (layout, world)
        return world


def rank_planning(layout: str, worlds: list[int], entries: int, repeats: int) -> dict:
    """Rank 0's planning (ZarrSavePlanner.create_local_plan, ZarrWriter.prepare_local_plan, RankPlanning.rank_writes),
    cold caches, at each world size, interleaved over ``repeats`` rounds; medians."""
    tensors = model_tensors(entries)
    times: dict[int, dict[str, list[float]]] = {w: defaultdict(list) for w in worlds}
    with tempfile.TemporaryDirectory(prefix="dcp-zarr-rank-") as work:
        for round_, world in itertools.product(range(repeats), worlds):  # world sizes interleaved
            with FakeRank(tensors, layout, world, 0, work) as fake:
                writer = fake.writer(f"w{world}-{round_}.zarr")
                sent, found = fake.local_plan(writer)
                plans = _all_summaries(layout, world, defaultdict(lambda: sent.storage_data))  # each like rank 0's
                ticket = fake.coordinator(f"c{world}-{round_}.zarr").prepare_global_plan(plans)[0].storage_data
                found["rank_writes_s"], items = fake.rank_writes(writer, ticket)
                found["total_s"], found["writes"] = sum(found.values()), len(items)
                warm_writer = fake.writer(f"w{world}-{round_}-warm.zarr")  # the next save: caches kept
                warm = fake.local_plan(warm_writer, timing=False, cold=False)[1]
                found["warm_total_s"] = sum(warm.values()) + fake.rank_writes(warm_writer, ticket)[0]
                for key, value in found.items():
                    times[world][key].append(value)
    return {str(w): h.medians(found) for w, found in times.items()}


def coordinator_cpu(layout: str, world: int, entries: int, repeats: int) -> dict:
    """The coordinator's part of a ZarrSavePlanner save (rank 0, cold caches: the first save after a restart),
    medians of ``repeats``: unpickling the gathered Summaries, create_global_plan + prepare_global_plan (and
    check_summaries alone), pickling the replies, unpickling the RankReports, ZarrWriter.finish (into a temporary
    directory), pickling the Metadata it broadcasts. Rank 0's own rank_writes runs untimed between them."""
    tensors, times = model_tensors(entries), defaultdict(list)

    def clock(name: str, fn):
        seconds, result = timed(fn)
        times[name].append(seconds)
        return result

    with tempfile.TemporaryDirectory(prefix="dcp-zarr-coordinator-") as work:
        others = {r: _fake(tensors, layout, world, r, work)[0]  # HSDP's other replica groups' Summaries
                  for r in sorted({_representative(layout, r) for r in range(world)} - {0})}
        with FakeRank(tensors, layout, world, 0, work) as fake:
            for round_ in range(repeats):
                writer = fake.writer(f"ckpt-{round_}.zarr")
                sent, _ = fake.local_plan(writer)
                wire = [pickle.dumps(p) for p in _all_summaries(layout, world, {**others, 0: sent.storage_data})]
                plans = clock("unpickle_plans_s", lambda: [pickle.loads(data) for data in wire])
                clock("check_summaries_s", lambda: check_summaries([plan.storage_data for plan in plans]))
                start = time.perf_counter()
                plans, metadata = fake.planner.create_global_plan(plans)
                replies = writer.prepare_global_plan(plans)
                times["global_plan_s"].append(time.perf_counter() - start)
                clock("pickle_replies_s", lambda: [pickle.dumps(plan) for plan in replies])
                held = _held_bytes(fake.rank_writes(writer, replies[0].storage_data)[1])
                wire = [pickle.dumps(_report(held))] * world
                results = clock("unpickle_results_s", lambda: [pickle.loads(data) for data in wire])
                clock("finish_s", lambda: writer.finish(metadata, results))
                clock("pickle_metadata_s", lambda: pickle.dumps(metadata))
                times["total_s"].append(sum(times[k][-1] for k in times if k not in ("total_s", "check_summaries_s")))
    return {"layout": layout, "world": world, "entries": entries, **h.medians(times)}


def planning_grid(rows: list[dict], worlds: dict[str, list[int]], entry_counts: list[int]) -> list[dict]:
    """Bytes per save and per load for every kind, at each layout, world size and tensor count: dcp_zarr from its
    real objects; DCP from a measured row's (exact), or scaled from the row at 100 tensors."""
    exact = {(r["layout"], r["world"], r["entries"]): r["wire"] for r in rows if "wire" in r}
    points, none = [], {"per_rank": 0, "coordinator": 0}  # none: use_collectives=False
    for layout, world, entries in [(lay, w, n) for lay, ws in worlds.items() for w in ws for n in entry_counts]:
        dcp = exact.get((layout, world, entries)) or scaled_dcp_wire(exact[(layout, world, 100)],
                                                                     model_tensors(entries), layout, world)
        zarr = zarr_wire(layout, world, entries)
        points.append({"layout": layout, "world": world, "entries": entries, "dcp_exact": dcp["exact"],
                       "save": {**zarr["save"], **dcp["save"], "no_collectives": none},
                       "load": {**zarr["load"], **dcp["load"]}})
        print(planning_tables({"wire": points[-1:]}).splitlines()[2], flush=True)
    return points


def measure_planning(rows: list[dict], args, wire: bool = True) -> dict:
    worlds = QUICK_WORLDS if args.quick else WORLDS
    if args.quick:
        rank_worlds, rank_entries, checked_entries = QUICK_WORLDS, 100, 16
        coordinator = [(layout, 64, 300) for layout in LAYOUTS]
    else:  # HSDP at 8 ranks is (1, 8): no replicas; 16 is the first world whose ranks checksum replicated boxes
        rank_worlds = {"fsdp": [8, 8192], "hsdp": [8, 16, 8192], "fsdp_tp": [8, 8192]}
        rank_entries, checked_entries, coordinator = 2000, 100, [("fsdp", 8192, 2000), ("hsdp", 8192, 2000)]
    planning: dict = {"checked_ranks": {layout: check_representatives(layout, _CHECKED_WORLD, checked_entries)
                                        for layout in worlds},
                      "wire": planning_grid(rows, worlds, [100, 2000]) if wire else [], "rank_planning": {},
                      "coordinator_cpu": []}
    for layout, layout_worlds in rank_worlds.items():
        planning["rank_planning"][layout] = {"entries": rank_entries, "worlds": rank_planning(
            layout, layout_worlds, rank_entries, args.rank_repeats)}
        print(layout, planning["rank_planning"][layout], flush=True)
    for point in coordinator:
        planning["coordinator_cpu"].append(coordinator_cpu(*point, args.repeats))
        print(planning["coordinator_cpu"][-1], flush=True)
    return planning


# -- tables -------------------------------------------------------------------------------------------------------


def _size(n: float) -> str:
    unit, step = next(((u, s) for u, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if n >= s), ("B", 1))
    return f"{n / step:.{1 if unit != 'B' and n < 100 * step else 0}f} {unit}"


def table(rows: list[dict]) -> str:
    return h.table(["layout", "ranks", "entries", "DCP plan s", "zarr added s", "root zarr.json kB (manifest)",
                    "DCP .metadata kB", "read+parse s zarr / DCP", "load plan s zarr / DCP", "read items zarr / DCP",
                    "validate s"], [[
        r["layout"], r["world"], r["entries"], f"{r['dcp_global_plan_s']:.3f}", f"{r['zarr_added_s']:.3f}",
        f"{r['zarr_root_bytes'] / 1e3:.1f} ({r['zarr_manifest_bytes'] / 1e3:.1f})",
        f"{r['dcp_metadata_bytes'] / 1e3:.1f}", f"{r['zarr_read_metadata_s']:.4f} / {r['dcp_read_metadata_s']:.3f}",
        f"{r['zarr_load_plan_s']:.4f} / {r['dcp_load_plan_s']:.3f}", f"{r['zarr_read_items']} / {r['dcp_read_items']}",
        f"{r['zarr_validate_s']:.4f}"] for r in rows])


def planning_tables(planning: dict) -> str:
    def sizes(p: dict, op: str, kinds: tuple[str, ...], part: str) -> list[str]:  # ~: DCP's, scaled from 100 tensors
        return [("" if p["dcp_exact"] or kind == "dcp_zarr" else "~") + _size(p[op][kind][part]) for kind in kinds]

    saves, loads = ("dcp_zarr", "dcp_default", "dcp_cached_later"), ("dcp_zarr", "dcp_default")
    text = h.table(["layout", "ranks", "tensors", "dcp_zarr / rank", "DCP / rank", "DCP cached, later / rank",
                    "dcp_zarr coordinator", "DCP coordinator", "DCP cached, later coordinator"], [
        [p["layout"], p["world"], p["entries"], *sizes(p, "save", saves, "per_rank"),
         *sizes(p, "save", saves, "coordinator")] for p in planning["wire"]]) if planning["wire"] else ""
    if len(planning["wire"]) == 1 or "rank_planning" not in planning:
        return text
    if planning["wire"]:
        text += ("\n\nLoads (plans gathered and scattered, then DCP's all_gather of each rank's read result):\n\n" +
                 h.table(["layout", "ranks", "tensors", "dcp_zarr / rank", "DCP / rank", "dcp_zarr coordinator",
                          "DCP coordinator", "of which DCP's read-done all_gather / rank"], [
                     [p["layout"], p["world"], p["entries"], *sizes(p, "load", loads, "per_rank"),
                      *sizes(p, "load", loads, "coordinator"), _size(p["load"]["dcp_zarr"]["read_done_per_rank"])]
                     for p in planning["wire"]]))
    rows = []
    for layout, found in planning["rank_planning"].items():
        first = next(iter(found["worlds"].values()))["total_s"]
        rows += [[layout, found["entries"], world, *[f"{t[k]:.4f}" for k in ("create_local_plan_s",
                  "prepare_local_plan_s", "rank_writes_s", "total_s")], f"{t['total_s'] / first:.2f}x",
                  f"{t['warm_total_s']:.4f}", f"{t['writes']:.0f}"] for world, t in found["worlds"].items()]
    text += "\n\nOne rank's planning (rank 0, cold caches; medians, world sizes interleaved):\n\n" + h.table(
        ["layout", "tensors", "ranks", "create_local_plan s", "prepare_local_plan s", "rank_writes s", "total s",
         "total / first world's", "next save (warm) s", "items written"], rows)
    return text + "\n\nThe coordinator's CPU per dcp_zarr save (rank 0, cold caches; medians):\n\n" + h.table(
        ["layout", "ranks", "tensors", "unpickle Summaries s", "create_global_plan + prepare_global_plan s "
         "(check_summaries)", "pickle Tickets s", "unpickle RankReports s", "finish s", "pickle Metadata s", "total s"],
        [[c["layout"], c["world"], c["entries"], f"{c['unpickle_plans_s']:.4f}",
          f"{c['global_plan_s']:.4f} ({c['check_summaries_s']:.4f})", f"{c['pickle_replies_s']:.4f}",
          f"{c['unpickle_results_s']:.4f}", f"{c['finish_s']:.4f}", f"{c['pickle_metadata_s']:.5f}",
          f"{c['total_s']:.3f}"] for c in planning["coordinator_cpu"]])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes: 8 and 64 ranks, 300 and 1,000 entries")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/scale", help="directory for scale.* and planning.*")
    p.add_argument("--planning-only", action="store_true", help="only the 100-tensor rows, then the planning measures")
    p.add_argument("--timing-only", action="store_true", help="only one rank's planning and the coordinator's CPU")
    p.add_argument("--rank-repeats", type=int, default=5, help="rounds of the per-rank planning timing")
    args = p.parse_args(argv)
    rows = []
    if not args.timing_only:  # --timing-only: no rows and no bytes, only one rank's planning and the coordinator's CPU
        points = [(layout, world, 100) for layout, worlds in (QUICK_WORLDS if args.quick else WORLDS).items()
                  for world in worlds]
        if not args.planning_only:
            points += [("fsdp", 64, n) for n in ([300, 1000] if args.quick else [300, 2000, 6000, 20000])]
        for point in points:
            rows.append(measure(*point, args.repeats))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    planning = measure_planning(rows, args, wire=not args.timing_only)
    name = "planning-timing" if args.timing_only else "planning"
    h.write_result(name, os.path.join(args.out, f"{name}.json"), planning, planning_tables(planning))
    if not (args.planning_only or args.timing_only):
        h.write_result("scale", os.path.join(args.out, "scale.json"), {"rows": rows, "planning": planning},
                       table(rows) + "\n\nBytes per save (pickles of what DCP's collectives carry; ~: DCP scaled from "
                       "100 tensors):\n\n" + planning_tables(planning))


if __name__ == "__main__":
    main()
