"""Times, requests and bytes of saves and loads on a real S3 server (Ceph's radosgw, dcp_zarr.testing's), in real
gloo runs, or, with ``--simulate``, the requests counted at up to 1,024 ranks from the plans dcp_zarr makes
(commands: benchmarks/README.md).

Real runs: every kind runs in ``--fresh`` new sets of rank processes of its own (forked from a server that imported
torch and dcp_zarr): their first save and load pay the one-time setup of its client, ``--repeats`` later ones in the
same processes do not. Each load is checked equal, each store's objects listed. States: ``small`` (64
nn.Linear(256, 256)) and ``large`` (12 nn.Linear(2048, 2048)), FSDP2 with AdamW state, or ``--arrays`` fp32 tensors
of ``--shape`` (240 of 96 x 40: pieces of about 4 KB a rank at 4 ranks, as an 8B model's are at 1,024) in the
``fsdp``, ``hsdp`` and ``ddp`` layouts. Kinds: ``zarr`` (an ``s3://`` URL: obstore), ``zarr-s3fs`` (the same with
``client="fsspec"``), ``zarr-off`` (dcp_zarr without collective I/O), ``incremental`` (``zarr``, each later save
``incremental_from`` the round before's, the first ``incremental=True``; its later saves are counted from the third,
``CHAIN_LEARNS``) and DCP's ``fsspec``; ZarrSavePlanner plans
dcp_zarr's saves. The server is reached directly, or, with ``--latency-ms``, through its proxy, which sleeps that
long before each request (concurrent sleeps overlap: a distant server, not a slow one) and counts each save's and
load's requests, bytes and server CPU. The floor: the objects ``zarr`` stored (their count and sizes) PUT again by
a tight obstore loop, 32 in flight per rank: what any writer of that many objects pays on this server.

The simulation plans every rank of a job in turn, on torch's fake process group with meta tensors, by the functions
a real save and load call (ZarrSavePlanner, ``RankPlanning.rank_writes`` and its aggregation, then DCP's load planner,
``rank_needs``, ``SharedReads``), and counts a PUT per stored chunk of each box a rank writes, per block it
aggregates and per ``zarr.json`` it describes (the coordinator each group's and the root's); a GET per plain chunk,
two per shard (index, inner chunks); the coordinator the root. No bytes move.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist

from benchmarks import harness as h
from benchmarks import writers
from dcp_zarr.testing import s3_server
from dcp_zarr.testing.shardings import LAYOUTS, in_layout

BUCKET = "bench"
OFF = "zarr:aggregate_below=0:read_once=False"  # zarr-off: without collective I/O, as before it
# kind: (writers.py's kind, the storage options it adds). DCP's files go up in multipart parts of s3fs's block size, 50
# MiB by default: above the test server's largest PUT (radosgw.MAX_PUT_BYTES, 48 MiB), which refuses such a part.
KINDS = {"zarr": ("zarr", {}), "zarr-s3fs": ("zarr", {"client": "fsspec"}), "zarr-off": (OFF, {}),
         "fsspec": ("fsspec", {"default_block_size": 32 << 20}), "incremental": ("zarr", {})}
STATES = {"small": (64, 256), "large": (12, 2048), "lora": (12, 2048)}  # nn.Linear layers, width
QUICK_STATES = {"small": (8, 64), "large": (2, 256), "lora": (2, 256)}
LORA_RANK = 8
FLOOR_IN_FLIGHT = 32
# The targets, for ZarrWriter/ZarrReader (zarr) at the server itself: first / later save and load and later save /
# floor at most; load speed against FsspecReader's at least (small, large); an incremental save's time over a full
# one's (lora) at most
FIRST_VS_LATER, SAVE_VS_FLOOR, LOAD_VS_PEER, INCREMENTAL_VS_FULL = 1.3, 1.2, {"small": 1.0, "large": 2.0}, 1.0
# A chain's later saves that learn which arrays are frozen (an object per chunk linked, then those laid out whole and
# written: docs/design.md, "Arrays unchanged whole"): not in an incremental kind's later saves (in ``each_run_s``)
CHAIN_LEARNS = 2


def build_state(name: str, args, ranks: h.Ranks):
    """A layout (LAYOUTS) of ``--arrays`` tensors of ``--shape``, or a stack of STATES, each nn.Linear and the stack
    FSDP2-sharded (``lora``: frozen, each followed by trainable rank-LORA_RANK down and up projections, a LoRA
    adapter's state), after an AdamW step; and a function that takes the next step and returns the state."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(11)  # the same tensors on every rank: each cuts or shards its own piece
    if name in LAYOUTS:
        shape = tuple(int(n) for n in args.shape.split("x"))
        tensors = {f"layers.{i}.weight": torch.randn(shape) for i in range(args.arrays)}
        return in_layout(name, ranks.world_size, tensors), lambda: in_layout(name, ranks.world_size, tensors)
    layers, width = (QUICK_STATES if args.quick else STATES)[name]
    nn = torch.nn
    model = nn.Sequential(*(nn.Linear(width, width) if name != "lora" else nn.Sequential(
        nn.Linear(width, width).requires_grad_(False), nn.Linear(width, LORA_RANK), nn.Linear(LORA_RANK, width))
        for _ in range(layers)))
    for module in [*model, model]:
        fully_shard(module, mesh=ranks.mesh)
    optim = torch.optim.AdamW((p for p in model.parameters() if p.requires_grad), lr=1e-3)

    def step() -> dict:
        model(torch.randn(4, width)).square().mean().backward()
        optim.step()
        return h._state(model, optim)

    return step(), step


def put_floor(ranks: h.Ranks, bucket, sizes: list[int], prefix: str) -> float:
    """The slowest rank's seconds to PUT its deal of ``sizes`` (the largest first, dealt in turn) under ``prefix``,
    FLOOR_IN_FLIGHT at a time, each PUT as dcp_zarr's obstore storage makes it."""
    import obstore

    from dcp_zarr.storage.obstore_storage import MULTIPART_ABOVE, PART_BYTES, PARTS_IN_FLIGHT

    mine = sorted(sizes, reverse=True)[ranks.rank::ranks.world_size]
    data = memoryview(os.urandom(max(mine, default=0)))

    async def put_all() -> None:
        slots = asyncio.Semaphore(FLOOR_IN_FLIGHT)

        async def put(i: int, size: int) -> None:
            async with slots:
                await obstore.put_async(bucket, f"{prefix}/{ranks.rank}.{i}", data[:size], chunk_size=PART_BYTES,
                                        use_multipart=size > MULTIPART_ABOVE, max_concurrency=PARTS_IN_FLIGHT)

        await asyncio.gather(*(put(i, size) for i, size in enumerate(mine)))

    return h.timed(lambda: asyncio.run(put_all()))[0]


def rounds(ranks: h.Ranks, args, name: str, kind: str, endpoint: str, latency: float | None) -> dict:
    """Fresh rank processes: ``kind``'s first save and load of state ``name`` at ``endpoint``, then ``--repeats``
    more, each store deleted after its load; the requests, bytes and server CPU of each, where the proxy counts them
    (``latency`` set); for ``zarr``, the floor after each save (the first one's warms its client)."""
    import obstore

    from dcp_zarr.storage.obstore_options import obstore_store

    options, (spec, extra) = {"endpoint_url": endpoint, **s3_server.CREDENTIALS}, KINDS[kind]
    threads = args.zarr_threads if kind.startswith("zarr") else args.fsspec_threads  # FsspecReader takes none
    bucket, proxy = obstore_store(f"s3://{BUCKET}", options), latency is not None and ranks.rank == 0
    if proxy:
        s3_server.control(endpoint, f"latency?ms={latency}")
    state, step = build_state(name, args, ranks)
    target, run = h.zeroed(state), h.gather(f"{name}-{kind}-{os.getpid()}")[0]
    times, counts = {"save": [], "load": [], "floor": []}, []

    def counted(op: str, tree, where: str, **writer_options) -> dict:
        if proxy:
            s3_server.control(endpoint, "reset")
        io, url = getattr(writers, op), f"s3://{BUCKET}/{where}"
        times[op].append(h.timed(lambda: io(spec, tree, url, threads, {**options, **extra}, **writer_options))[0])
        found = s3_server.control(endpoint, "counts") if proxy else {}
        return {"requests": found.get("methods", {}), **{k: found.get(k) for k in ("bytes_out", "server_cpu_s")}}

    for round_ in range(args.repeats + 1):
        where = f"{run}/{round_}"
        state = step() if round_ else state  # a training step between saves: an incremental save's earlier one
        chain = {} if kind != "incremental" else {"incremental_from": f"s3://{BUCKET}/{run}/{round_ - 1}"} if (
            round_) else {"incremental": True}
        counts.append({"save": counted("save", state, where, **chain)})
        h.fill_zeros(target)
        counts[-1]["load"] = counted("load", target, where)
        if not all(h.gather(h.equal(target, state))):
            raise SystemExit(f"{kind} {name}: the loaded state differs from the saved one")
        sizes = h.gather([o["size"] for o in obstore.list(bucket, where).collect()] if ranks.rank == 0 else None)[0]
        if kind == "zarr":
            times["floor"].append(put_floor(ranks, bucket, sizes, f"{run}/floor-{round_}"))
        dist.barrier()
        if ranks.rank == 0:  # all but this round's store, the next incremental save's earlier one; the last one too
            obstore.delete(bucket, [o["path"] for o in obstore.list(bucket, run).collect() if round_ == args.repeats
                                    or not o["path"].startswith(f"{where}/")])
        dist.barrier()
    return {"times_s": times, "counts": counts, "objects": len(sizes), "tensors": len(h.leaves(state)),
            "bytes": h.global_bytes(state)}


def summary(runs: dict[tuple, list[dict]]) -> list[dict]:
    """A row per (ranks, state, storage, kind): each fresh process's first save and load (and floor), every later
    one, medians; the first round's counts, the server's median CPU in later ones; the ratios."""
    rows = []
    for (world, name, storage, kind), found in runs.items():
        first = {op: [r["times_s"][op][0] for r in found if r["times_s"][op]] for op in ("save", "load", "floor")}
        later = {op: [t for r in found for t in r["times_s"][op][1 + CHAIN_LEARNS * (kind == "incremental"):]]
                 for op in first}
        cpu = {op: [c[op]["server_cpu_s"] for r in found for c in r["counts"][1:] if c[op].get("server_cpu_s")]
               for op in ("save", "load")}
        rows.append({"world_size": world, "state": name, "storage": storage, "kind": kind, **{
            k: found[0][k] for k in ("objects", "tensors", "bytes")}, "counts": found[0]["counts"][0],
            "server_cpu_s": {op: statistics.median(c) if c else None for op, c in cpu.items()}, "first_s": first,
            "each_run_s": [r["times_s"] for r in found],
            "later_s": later, "median_s": {f"{when}_{op}": statistics.median(t) for when, times in (
                ("first", first), ("later", later)) for op, t in times.items() if t}})
    by = {(r["world_size"], r["state"], r["storage"], r["kind"]): r["median_s"] for r in rows}
    for r in rows:
        m, at = r["median_s"], (r["world_size"], r["state"], r["storage"])
        floor, peer, full = (by.get((*at, "zarr"), {}).get("later_floor"), by.get((*at, "fsspec")),
                             by.get((*at, "zarr"), {}).get("later_save"))
        r["ratios"] = {"first_vs_later_save": m["first_save"] / m["later_save"],
                       "first_vs_later_load": m["first_load"] / m["later_load"],
                       "later_save_vs_floor": m["later_save"] / floor if floor and "zarr" in r["kind"] else None,
                       **{f"{op}_speed_vs_peer": peer[f"later_{op}"] / m[f"later_{op}"] if peer else None
                          for op in ("save", "load")},
                       "later_save_vs_full": m["later_save"] / full if full and r["kind"] == "incremental" else None}
    return rows


def verdicts(rows: list[dict]) -> list[dict]:
    """The targets, for ZarrWriter and ZarrReader (zarr) at the server itself: (state, ratio, bound, met)."""
    found = []
    for r in (r for r in rows if (r["kind"], r["storage"]) == ("zarr", "s3") and r["state"] in LOAD_VS_PEER):
        for ratio, bound in (("first_vs_later_save", FIRST_VS_LATER), ("first_vs_later_load", FIRST_VS_LATER),
                             ("later_save_vs_floor", SAVE_VS_FLOOR), ("load_speed_vs_peer", LOAD_VS_PEER[r["state"]])):
            value, most = r["ratios"][ratio], "speed" not in ratio
            found.append({"state": r["state"], "target": f"{ratio} {'<=' if most else '>='} {bound}", "value": value,
                          "met": value is not None and (value <= bound if most else value >= bound)})
    for r in (r for r in rows if (r["kind"], r["storage"]) == ("incremental", "s3")):
        value = r["ratios"]["later_save_vs_full"]
        found.append({"state": r["state"], "target": f"incremental later save / zarr's <= {INCREMENTAL_VS_FULL}",
                      "value": value, "met": value is not None and value <= INCREMENTAL_VS_FULL})
    return found


def markdown(result: dict) -> str:
    def cell(times: list[float]) -> str:
        return f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})" if times else ""

    def pair(*values, fmt: str = "{:.2f}") -> str:
        return " / ".join("" if v is None else fmt.format(v) for v in values).strip(" /")

    c, out = result["config"], []
    out.append(f"Each kind in {c['fresh']} fresh sets of gloo rank processes, {c['repeats']} later rounds in each; "
               "times: the slowest rank's, median (range) in seconds. Objects: what a save stored; requests (through "
               "the proxy): a save's PUTs / a load's GETs, the first round's; `read x`: bytes read per load over the "
               f"tensors' bytes; floor: zarr's objects PUT by obstore, {FLOOR_IN_FLIGHT} in flight per rank; `vs "
               "peer`: the later saves' / loads' time of FsspecWriter/Reader over the kind's; server CPU s per save / "
               "load, median.")
    for world, name in dict.fromkeys((r["world_size"], r["state"]) for r in result["rows"]):
        rows = [r for r in result["rows"] if (r["world_size"], r["state"]) == (world, name)]
        layers, width = (QUICK_STATES if c["quick"] else STATES).get(name, (0, 0))
        what = (f"{c['arrays']} fp32 arrays of {c['shape']}" if name in LAYOUTS else
                f"{layers} nn.Linear({width}, {width}) with AdamW state" + (
                    f", frozen, with rank-{LORA_RANK} adapters, a step between saves" if name == "lora" else ""))
        out += ["", f"**{name}**, {world} ranks: {what}; {rows[0]['tensors']} tensors, {rows[0]['bytes'] / 1e6:.1f} MB",
                ""]
        cells = []
        for r in rows:
            put, get = (r["counts"][op]["requests"].get(method) for op, method in (("save", "PUT"), ("load", "GET")))
            read, ratios = r["counts"]["load"]["bytes_out"], list(r["ratios"].values())
            cells.append([r["storage"], r["kind"], *(cell(r[f"{w}_s"][op]) for op in ("save", "load") for w in (
                "first", "later")), f"{r['objects']:,}", pair(put, get, fmt="{:,}"), pair(read and read / r["bytes"]),
                *(pair(v) for v in ratios[:3]), pair(*ratios[3:5]), pair(*r["server_cpu_s"].values())])
            if r["later_s"]["floor"]:
                cells.append([r["storage"], "floor", "", cell(r["later_s"]["floor"]), "", "", *[""] * 8])
        out.append(h.table(["storage", "kind", "first save s", "later saves s", "first load s", "later loads s",
                            "objects", "requests", "read x", "first / later save", "first / later load",
                            "later save / floor", "vs peer", "server CPU s"], cells))
    out += ["", "Targets (zarr: ZarrWriter and ZarrReader at the server itself):", ""] if result["verdicts"] else []
    return "\n".join(out + [f"- {v['state']}: {v['target']}: {pair(v['value']) or 'not measured'}, "
                            f"{'met' if v['met'] else 'NOT met'}" for v in result["verdicts"]])


def real_runs(args, server) -> dict:
    """Every (ranks, state, storage, kind) in ``--fresh`` new sets of rank processes, kinds in rotating order."""
    storages = [("s3", server.direct_endpoint, None)] if not args.latency_ms else [
        (f"s3, {float(ms):g} ms", server.endpoint, float(ms)) for ms in args.latency_ms.split(",")]
    runs: dict[tuple, list[dict]] = {}
    for world in (int(w) for w in args.world_sizes.split(",")):
        for name in (s for s in args.states.split(",") if s != "hsdp" or world % 2 == 0):
            for storage, endpoint, latency in storages:
                for fresh in range(args.fresh):
                    for kind in h.rotated(args.kinds.split(","), fresh):
                        found = h.spawn(rounds, world, args, name, kind, endpoint, latency)[0]
                        runs.setdefault((world, name, storage, kind), []).append(found)
                        print(f"{world} ranks, {name}, {storage}, {kind}: {found['times_s']}", flush=True)
    rows = summary(runs)
    return {"config": {k: v for k, v in vars(args).items() if k not in ("simulate", "out")}, "rows": rows,
            "verdicts": verdicts(rows)}


# -- The simulation ---------------------------------------------------------------------------------------------------


def rank_state(layout: str, world: int, arrays: int, shape: tuple[int, ...]) -> dict:
    """A rank's state dict of meta tensors (DTensors on its mesh: no data, no communication)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from dcp_zarr.placement.boxes import dtensor_local_box

    if layout == "ddp":
        return {f"layers.{i}.weight": torch.empty(shape, device="meta") for i in range(arrays)}
    mesh, placements = ((init_device_mesh("cpu", (world,)), (Shard(0),)) if layout == "fsdp" else
                        (init_device_mesh("cpu", (2, world // 2)), (Replicate(), Shard(0))))
    piece = dtensor_local_box(shape, tuple(mesh.shape), placements, tuple(mesh.get_coordinate()))[1]
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return {f"layers.{i}.weight": DTensor.from_local(torch.empty(piece, device="meta"), mesh, placements,
                                                     run_check=False, shape=torch.Size(shape), stride=stride)
            for i in range(arrays)}


def _gets(layout, offsets, sizes) -> tuple[int, int]:
    """(GETs, bytes) a RegionReader makes to read the box ``offsets`` + ``sizes`` of an array of ``layout``."""
    from dcp_zarr.format.encoding import shard_index_bytes

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


def _fake_ranks(world: int):
    """Each rank of a ``world``-rank job in turn, on torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            yield rank
        finally:
            dist.destroy_process_group()


def simulate(layout: str, world: int, arrays: int, shape: tuple[int, ...], collective: bool = True) -> dict:
    """PUTs per save, GETs per load and the bytes a load reads, summed over every rank of one simulated job;
    ``collective=False``: without aggregation or shared reads (``aggregate_below=0``, ``read_once=False``)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from dcp_zarr import ZarrSavePlanner
    from dcp_zarr.collective.needs import needs_digest, rank_needs
    from dcp_zarr.collective.shared_reads import SharedReads
    from dcp_zarr.collective.transfer import DEFAULT_EXCHANGE_BYTES
    from dcp_zarr.format.chunk_layout import INNER_CHUNK_TARGET_BYTES as INNER
    from dcp_zarr.format.chunk_layout import parent_groups
    from dcp_zarr.format.encoding import array_metadata, group_metadata
    from dcp_zarr.format.manifest import Manifest, TensorEntry
    from dcp_zarr.format.node_copies import encoded_root
    from dcp_zarr.json_documents import json_text
    from dcp_zarr.loading.metadata import dcp_metadata
    from dcp_zarr.placement.holdings import group_rank_of
    from dcp_zarr.planning.protocol import PlanOptions, Ticket
    from dcp_zarr.planning.rank_planning import RankPlanning
    from dcp_zarr.storage.base import Storage

    below = Storage.aggregate_below if collective else 0  # an object store's default
    puts, put_bytes = Counter(), Counter()
    started = time.perf_counter()
    for rank in _fake_ranks(world):
        planner = ZarrSavePlanner()
        planner.set_up_planner(rank_state(layout, world, arrays, shape), None, rank == 0)
        local = RankPlanning(planner.create_local_plan().planner_data, rank, rank == 0, "none", 0,
                          PlanOptions(INNER, below, DEFAULT_EXCHANGE_BYTES, None))
        items, assignment = local.rank_writes(Ticket("sim", "s3://sim/x", False, frozenset()), False)
        plan = local.plan
        for item in items:
            spec, chunk = assignment.arrays[item.index.fqn], item.tensor_data.chunk
            for coords in spec.layout.chunks_in_box(chunk.offsets, chunk.sizes):
                puts[rank] += 1
                put_bytes[rank] += math.prod(spec.layout.chunk_box(coords)[1]) * spec.itemsize
        for unit in (u for units in plan.aggregation.rounds for u in units if u.owner == rank):
            puts[rank] += 1
            put_bytes[rank] += unit.nbytes
        puts[rank] += len(assignment.describes)
        if rank == 0:
            specs, shards, nodes = plan.saved_specs, plan.saved_shards, plan.nodes
            entries = {fqn: TensorEntry(fqn, e.path, nodes[fqn], specs[fqn].dtype_name, e.size,
                                        specs[fqn].layout.chunk_shape, specs[fqn].layout.inner_rows, False, shards[fqn])
                       for fqn, e in local.save_entries().items()}
            groups = {g for e in entries.values() for g in parent_groups(e.node)}
            puts[rank] += len(groups) + 1  # each group's zarr.json, the root's
            manifest = Manifest(entries=entries, saved_world_size=world)
            document = manifest.to_json()
            copies = {group: json_text(group_metadata()) for group in groups}
            copies.update((s.node, json_text(array_metadata(s.layout, s.data_type, s.itemsize, {"dcp_zarr": {
                "fqn": fqn}}, node=s.node))) for fqn, s in specs.items())
            root_bytes = len(encoded_root(group_metadata({"dcp_zarr": document}), document, copies))
    save_s = time.perf_counter() - started
    metadata = dcp_metadata(manifest)  # manifest, specs, root_bytes: rank 0's
    readers = [0] if collective else range(world)  # the coordinator reads the root and broadcasts it
    gets, get_bytes = Counter({r: 1 for r in readers}), Counter({r: root_bytes for r in readers})
    shared = digest = None
    started = time.perf_counter()
    for rank in _fake_ranks(world):
        planner = DefaultLoadPlanner()
        planner.set_up_planner(rank_state(layout, world, arrays, shape), metadata, rank == 0)
        items = planner.create_local_plan().items
        needs, _ = rank_needs(items, planner.state_dict, lambda key: key, group_rank_of(None))
        mine = needs_digest(needs, world, (below, DEFAULT_EXCHANGE_BYTES))
        if shared is None:
            digest = mine
            shared = SharedReads(needs if collective else {}, manifest.entries, world, below, DEFAULT_EXCHANGE_BYTES)
        if mine != digest:
            raise AssertionError(f"rank {rank}'s needs differ from rank 0's: a real load would read alone")
        regions = [(specs[u.key[0]].layout, *shared.info[u.key].box) for units in shared.rounds for u in units
                   if u.owner == rank]
        regions += [(specs[i.storage_index.fqn].layout, [a + b for a, b in zip(i.storage_index.offset,
                     i.storage_offsets)], i.lengths) for i in items if not shared.shared(i.dest_index.fqn)]
        for region in regions:
            n, b = _gets(*region)
            gets[rank] += n
            get_bytes[rank] += b
    tensor_bytes = arrays * math.prod(shape) * 4
    return {"layout": layout, "world_size": world, "arrays": arrays, "shape": list(shape), "collective": collective,
            "puts_per_save": sum(puts.values()), "put_bytes": sum(put_bytes.values()),
            "gets_per_load": sum(gets.values()), "get_bytes": sum(get_bytes.values()),
            "read_x": sum(get_bytes.values()) / tensor_bytes, "most_requests": 2 * arrays + 8 + 4 * world,
            "most_puts_on_a_rank": max(puts.values()), "most_gets_on_a_rank": max(gets.values()),
            "simulated_save_s": round(save_s, 2), "simulated_load_s": round(time.perf_counter() - started, 2)}


def simulate_report(worlds: list[int], arrays: int, shape: tuple[int, ...]) -> tuple[dict, str]:
    rows, lines = [], []
    for layout in LAYOUTS:
        for world in worlds:
            if layout != "hsdp" or world % 2 == 0:
                on, off = simulate(layout, world, arrays, shape), simulate(layout, world, arrays, shape, False)
                rows += [on, off]
                print(on, off, sep="\n", flush=True)
                lines.append([layout, f"{world:,}", f"{on['puts_per_save']:,}", f"{off['puts_per_save']:,}",
                              f"{on['gets_per_load']:,}", f"{off['gets_per_load']:,}", f"{on['most_requests']:,}",
                              f"{on['read_x']:.3f}", f"{off['read_x']:.2f}"])
    text = (f"Simulated: {arrays} fp32 arrays of {'x'.join(map(str, shape))} on an object store (dcp_zarr's defaults "
            "there), requests summed over every rank; `without`: the same job without collective I/O "
            "(aggregate_below=0, read_once=False). `limit`: 2 x arrays + 8 + 4 x ranks (issue 25); `read x`: bytes "
            "read per load over the tensors' bytes, the root zarr.json included.\n\n")
    return {"rows": rows}, text + h.table(["layout", "ranks", "PUTs per save", "without", "GETs per load", "without",
                                           "limit", "read x", "without"], lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--states", default="small,large", help=f"comma-separated of {', '.join([*STATES, *LAYOUTS])}")
    p.add_argument("--kinds", default="zarr,zarr-s3fs,fsspec", help=f"comma-separated of {', '.join(KINDS)}")
    p.add_argument("--world-sizes", default="2", help="comma-separated")
    p.add_argument("--latency-ms", default="", help="through the proxy, counted, at each of these added latencies "
                   "(comma-separated) instead of at the server itself")
    h.add_options(p, fresh=3, repeats=4, arrays=240, shape="96x40", zarr_threads=4, fsspec_threads=4)
    p.add_argument("--quick", action="store_true", help="states of a few layers, 1 fresh set, 1 later round")
    p.add_argument("--simulate", help="world sizes to simulate instead, as 8,64,256,1024")
    p.add_argument("--out", help="result JSON (default benchmarks/results/storage_traffic.json)")
    args = p.parse_args(argv)
    if set(args.states.split(",")) - {*STATES, *LAYOUTS} or set(args.kinds.split(",")) - set(KINDS):
        p.error("--states or --kinds names an unknown one")
    if args.quick:
        args.fresh, args.repeats = 1, 1
    if "incremental" in args.kinds.split(",") and args.repeats <= CHAIN_LEARNS:
        p.error(f"the incremental kind needs --repeats above {CHAIN_LEARNS}: its first {CHAIN_LEARNS} are not timed")
    if args.simulate:
        shape = tuple(int(n) for n in args.shape.split("x"))
        result, text = simulate_report([int(w) for w in args.simulate.split(",")], args.arrays, shape)
        return h.write_result("storage_traffic", args.out, result, text)
    server = s3_server.S3Server()
    server.make_bucket(BUCKET)
    try:
        result = real_runs(args, server)
    finally:
        server.stop()
    h.write_result("storage_traffic", args.out, result, markdown(result))


if __name__ == "__main__":
    main()
