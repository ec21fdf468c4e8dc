"""Requests, bytes and times through storage per save and per load: dcp_zarr (with its collective I/O: aggregated
writes, reads done once) beside DCP's FsspecWriter/Reader and FileSystemWriter/Reader, in real gloo runs against a
loopback S3 server with added latency per request and a local directory; or, with ``--simulate``, the requests
counted at up to 1,024 ranks from the plans dcp_zarr makes (commands: benchmarks/README.md).

The state: ``--arrays`` fp32 tensors of ``--shape`` (240 of 96 x 40: pieces of about 4 KB a rank at 4 ranks, as an
8B model's are at 1,024) in the FSDP, HSDP and DDP layouts; or, with ``--model``, the FSDP2 transformer with AdamW
state. This process runs the S3 server (moto) and spawns the ranks. The server sleeps the latency before each request
(concurrent sleeps overlap: a distant server, not a slow one) and counts requests, bytes and its own CPU per
operation (moto serves in Python under one GIL: a CPU time near an operation's time means the server set its pace).
Kinds on S3: ``zarr`` (a URL: zarr's FsspecStore over s3fs), ``zarr-obstore`` (``--backends obstore``: ``store=``
zarr's ObjectStore over obstore) and ``fsspec``; on ``--local-dir`` (the files each kind opens, the bytes through
them) ``zarr`` and ``fs``; ``--off`` adds ``zarr-off``, dcp_zarr without collective I/O. ZarrSavePlanner plans
dcp_zarr's saves; the counts are those of the first timed round.

The simulation plans every rank of a job in turn, on torch's fake process group with meta tensors, by the functions
a real save and load call (ZarrSavePlanner, ``LocalSave.rank_writes`` and its aggregation, then DCP's load planner,
``rank_needs``, ``SharedReads``), and counts a PUT per stored chunk of each box a rank writes, per block it
aggregates and per ``zarr.json`` it describes (the coordinator each group's and the root's); a GET per plain chunk,
two per shard (index, inner chunks); the coordinator the root. No bytes move.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import threading
import time
from collections import Counter
from types import SimpleNamespace

import torch
import torch.distributed as dist

from benchmarks import harness as h
from benchmarks import writers
from dcp_zarr.testing import s3_server
from dcp_zarr.testing.shardings import LAYOUTS, in_layout

BUCKET = "bench"
BACKENDS = {"s3fs": "zarr", "obstore": "zarr-obstore"}  # --backends -> kind
OFF = "zarr:aggregate_below=0:read_once=False"  # zarr-off: without collective I/O, as before it


class LocalCalls:
    """Counts, in this process, the files each writer and reader opens (a local file system's requests: each open is
    a metadata operation, what a parallel file system feels most) and the bytes through them: dcp_zarr's local
    storage's calls, and DCP's files through ``file_system``, the FileSystem the ``fs`` kind is given."""

    def __init__(self):
        from dcp_zarr.storage.local import LocalStorage, OpenFile

        self.lock, self.counts = threading.Lock(), Counter()
        written = lambda args, _: sum(memoryview(b).nbytes for b in args[-1])  # noqa: E731
        read = lambda args, result: len(result)  # noqa: E731
        for cls, name, what, size, opens in (
                (LocalStorage, "write", "writes", written, 1), (LocalStorage, "write_at", "writes", written, 1),
                (LocalStorage, "read", "reads", read, 1), (LocalStorage, "read_range", "reads", read, 1),
                (LocalStorage, "open_value", "reads", lambda a, r: 0, 1),  # then reads through the handle:
                (OpenFile, "read_range_into", "reads", lambda a, r: r, 0), (OpenFile, "read_tail", "reads", read, 0)):
            setattr(cls, name, self._counted(getattr(cls, name), what, size, opens))
        self.file_system = writers.metered_file_system(self._stream)

    def _counted(self, original, what, size, opens):
        def counted(*args, **kwargs):
            result = original(*args, **kwargs)
            self.add(what, size(args, result), opens)
            return result

        return counted

    def _stream(self, mode: str) -> SimpleNamespace:
        """A DCP stream opened: one open counted, then the bytes written or read through it (its meter's ``timed``)."""
        what = "writes" if "w" in mode else "reads"
        self.add(what, 0, 1)
        return SimpleNamespace(timed=lambda transfer, size: self._counted(transfer, what, lambda _, r: size(r), 0)())

    def add(self, what: str, nbytes: int, opens: int) -> None:
        with self.lock:
            self.counts[what] += opens
            self.counts[f"{what}_bytes"] += nbytes

    def take(self) -> Counter:
        with self.lock:
            counts, self.counts = self.counts, Counter()
        return counts


def _obstore(url: str, options: dict):
    """zarr's ObjectStore over obstore's S3 client, for ``url``'s prefix (each rank builds its own)."""
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    return ObjectStore(S3Store(BUCKET, prefix=url.removeprefix(f"s3://{BUCKET}/"), endpoint=options["endpoint_url"],
                               region="us-east-1", access_key_id=options["key"],
                               secret_access_key=options["secret"], client_options={"allow_http": True}))


def transfer(op: str, kind: str, state, where: str, args, options: dict | None, file_system=None) -> None:
    """``writers.save`` or ``writers.load`` (``op``) of a kind: ``zarr-obstore`` is dcp_zarr given ``store=``."""
    threads = args.zarr_threads if kind.startswith("zarr") else args.fsspec_threads if op == "save" else None
    store = _obstore(where, options or {}) if kind == "zarr-obstore" else None
    spec = "zarr" if store else OFF if kind == "zarr-off" else kind
    getattr(writers, op)(spec, state, "" if store else where, threads, None if store else options, store, file_system)


def measure(ranks: h.Ranks, args, endpoint: str) -> dict:
    """One rank's rounds; complete on rank 0, which reads the server's counts."""
    options = {"endpoint_url": endpoint, **s3_server.CREDENTIALS}
    shape = tuple(int(n) for n in args.shape.split("x"))
    calls, rows = LocalCalls() if args.local_dir else None, []
    if args.model:
        cfg = h.ModelConfig(4, 128, 2048) if args.quick else h.ModelConfig(args.layers, args.hidden, args.vocab)
        states = {"model": h.fsdp_model_state(cfg, ranks.mesh, ranks.device)}
    else:
        g = torch.Generator().manual_seed(11)
        full = {f"layers.{i}.weight": torch.randn(shape, generator=g) for i in range(args.arrays)}
        states = {layout: in_layout(layout, ranks.world_size, full) for layout in LAYOUTS
                  if layout != "hsdp" or ranks.world_size % 2 == 0}
    tensor_bytes = h.global_bytes(next(iter(states.values())))

    def counted(fn, s3: bool) -> tuple[float, dict]:
        if s3 and ranks.rank == 0:
            s3_server.control(endpoint, "reset")
        if calls:
            calls.take()
        seconds = h.timed(fn)[0]
        if not s3:
            local = sum(h.gather(calls.take() if calls else {}), Counter())
            return seconds, {"requests": {"writes": local["writes"], "reads": local["reads"]},
                             "bytes_in": local["writes_bytes"], "bytes_out": local["reads_bytes"]}
        counts = s3_server.control(endpoint, "counts") if ranks.rank == 0 else {}
        return seconds, {"requests": counts.get("methods", {}), "bytes_in": counts.get("bytes_in"),
                         "bytes_out": counts.get("bytes_out"), "server_cpu_s": counts.get("server_cpu_s")}

    targets = [("s3", float(ms)) for ms in args.latency_ms.split(",")] + ([("local", 0.0)] if args.local_dir else [])
    for name, state in states.items():
        for storage, latency in targets:
            s3 = storage == "s3"
            kinds = ([BACKENDS[b] for b in args.backends.split(",")] + ["fsspec"] if s3 else ["zarr", "fs"])
            kinds += ["zarr-off"] * args.off
            if s3 and ranks.rank == 0:
                s3_server.control(endpoint, f"latency?ms={latency}")
            times: dict[tuple[str, str], list[float]] = {}
            counts: dict[tuple[str, str], dict] = {}
            for repeat in range(args.repeats + 1):  # round 0 warms up
                for kind in h.rotated(kinds, repeat):
                    label = f"{name}-{kind}-{latency:g}-{repeat}"
                    where = f"s3://{BUCKET}/{label}" if s3 else os.path.join(args.local_dir, label)
                    opts, fs = (options, None) if s3 else (None, calls and calls.file_system)
                    save_s, save_counts = counted(lambda: transfer("save", kind, state, where, args, opts, fs), s3)
                    target = h.zeroed(state)
                    load_s, load_counts = counted(lambda: transfer("load", kind, target, where, args, opts, fs), s3)
                    if not all(h.gather(h.equal(target, state))):
                        raise SystemExit(f"{kind} {name}: the loaded state differs from the saved one")
                    if not s3 and ranks.rank == 0:
                        save_counts["files"] = h.footprint(where)["files"]
                    for op, seconds, found in (("save", save_s, save_counts), ("load", load_s, load_counts)):
                        if repeat:
                            times.setdefault((kind, op), []).append(seconds)
                            counts.setdefault((kind, op), {**found, "server_cpu_s": []})["server_cpu_s"].append(
                                found.get("server_cpu_s"))
                    dist.barrier()
                    if ranks.rank == 0:
                        writers.remove_s3(where, options) if s3 else shutil.rmtree(where, ignore_errors=True)
                    dist.barrier()
            for (kind, op), samples in times.items():
                cpu = [c for c in counts[(kind, op)].pop("server_cpu_s") if c is not None]
                rows.append({"world_size": ranks.world_size, "state": name, "storage": storage, "latency_ms": latency,
                             "kind": kind, "op": op, "median_s": statistics.median(samples), "samples_s": samples,
                             "server_cpu_s": statistics.median(cpu) if cpu else None, **counts[(kind, op)]})
    return {"world_size": ranks.world_size, "tensor_bytes": tensor_bytes, "rows": rows}


def markdown(report: dict) -> str:
    rows = []
    for run in report["runs"]:
        by = {(r["state"], r["storage"], r["latency_ms"], r["kind"], r["op"]): r for r in run["rows"]}
        states = list(dict.fromkeys(r["state"] for r in run["rows"]))
        for (state, storage, latency, kind, op), row in sorted(by.items(), key=lambda item: (
                states.index(item[0][0]), item[0][1] != "s3", *item[0][2:4])):
            if op == "save":
                loaded = by[(state, storage, latency, kind, "load")]
                peers = [by.get((state, storage, latency, "fsspec" if storage == "s3" else "fs", o)) for o in (
                    "save", "load")]
                put = row["requests"].get("PUT", row["requests"].get("writes", 0))
                get = loaded["requests"].get("GET", loaded["requests"].get("reads", 0))
                cpu = "" if row["server_cpu_s"] is None else f"{row['server_cpu_s']:.2f} / {loaded['server_cpu_s']:.2f}"
                rows.append([run["world_size"], state, f"S3, {latency:g} ms" if storage == "s3" else "local", kind,
                             f"{put:,}", f"{get:,}", f"{(loaded['bytes_out'] or 0) / run['tensor_bytes']:.2f}",
                             f"{row['median_s']:.3f}", f"{loaded['median_s']:.3f}", " / ".join(
                                 f"{p['median_s'] / r['median_s']:.2f}x" for p, r in zip(peers, (row, loaded))
                                 if p) if kind.startswith("zarr") else "", cpu])
    what = (f"the FSDP2 model ({report['runs'][0]['tensor_bytes'] / 1e6:.0f} MB)" if report["model"] else
            f"{report['arrays']} fp32 arrays of {report['shape']}")
    return (f"{what}, gloo ranks, moto. Requests per save are PUTs (object store) or files opened to "
            "write (local), per load GETs or files opened to read; `read x`: bytes read per load over the tensors' "
            "bytes; times: medians of the slowest rank's; `vs peer`: time of FsspecWriter/Reader (S3) or "
            "FileSystemWriter/Reader (local) over dcp_zarr's, save / load; the S3 server's CPU per operation.\n\n"
            + h.table(["ranks", "state", "storage", "kind", "requests per save", "requests per load", "read x",
                       "save s", "load s", "vs peer", "server CPU s"], rows))


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
    from dcp_zarr.planning.local_save import LocalSave
    from dcp_zarr.planning.protocol import SaveOptions, Ticket
    from dcp_zarr.storage.base import Storage

    below = Storage.aggregate_below if collective else 0  # an object store's default
    puts, put_bytes, saved = Counter(), Counter(), {}
    started = time.perf_counter()
    for rank in _fake_ranks(world):
        planner = ZarrSavePlanner()
        planner.set_up_planner(rank_state(layout, world, arrays, shape), None, rank == 0)
        local = LocalSave(planner.create_local_plan().planner_data, rank, rank == 0, "none", 0,
                          SaveOptions(INNER, below, DEFAULT_EXCHANGE_BYTES, None))
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
            saved = {"manifest": manifest, "layouts": specs,
                     "root_bytes": len(encoded_root(group_metadata({"dcp_zarr": document}), document, copies))}
    save_s = time.perf_counter() - started
    manifest, specs, metadata = saved["manifest"], saved["layouts"], dcp_metadata(saved["manifest"])
    readers = [0] if collective else range(world)  # the coordinator reads the root and broadcasts it
    gets, get_bytes = Counter({r: 1 for r in readers}), Counter({r: saved["root_bytes"] for r in readers})
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
    p.add_argument("--world-sizes", help="comma-separated (default 2,4,8; 2 with --model)")
    p.add_argument("--latency-ms", default="0,20", help="comma-separated added latencies (default 0,20)")
    h.add_options(p, repeats=3, arrays=240, shape="96x40")
    p.add_argument("--model", action="store_true", help="the FSDP2 model's state instead of the arrays")
    p.add_argument("--layers", type=int, default=8, help="--model's blocks (default 8: the 2 GB model)")
    h.add_options(p, hidden=1024, vocab=32000)
    p.add_argument("--quick", action="store_true", help="--model: a 16 MB model, 1 repeat")
    p.add_argument("--local-dir", help="a local directory to measure too ('' for none; default: one on tmpfs, "
                   "none with --model)")
    p.add_argument("--off", action="store_true", help="also dcp_zarr without collective I/O (zarr-off)")
    p.add_argument("--backends", default="s3fs", help="dcp_zarr's S3 clients: s3fs (a URL), obstore (store=)")
    h.add_options(p, zarr_threads=4, fsspec_threads=4)
    p.add_argument("--simulate", help="world sizes to simulate instead, as 8,64,256,1024")
    p.add_argument("--out", help="result JSON (default benchmarks/results/storage_traffic.json)")
    args = p.parse_args(argv)
    if set(args.backends.split(",")) - set(BACKENDS):
        p.error(f"--backends takes {', '.join(BACKENDS)}")
    args.world_sizes = args.world_sizes or ("2" if args.model else "2,4,8")
    args.repeats = 1 if args.quick else args.repeats
    if args.local_dir is None:
        args.local_dir = "" if args.model else os.path.join(h.SCRATCH, "dcp-zarr-traffic")
    if args.simulate:
        shape = tuple(int(n) for n in args.shape.split("x"))
        result, text = simulate_report([int(w) for w in args.simulate.split(",")], args.arrays, shape)
        h.write_result("storage_traffic", args.out, result, text)
        return
    server = s3_server.S3Server()
    server.make_bucket(BUCKET)
    if args.local_dir:
        os.makedirs(args.local_dir, exist_ok=True)
    try:
        runs = [h.spawn(measure, int(ws), args, server.endpoint)[0] for ws in args.world_sizes.split(",")]
    finally:
        server.stop()
        if args.local_dir:
            shutil.rmtree(args.local_dir, ignore_errors=True)
    result = {**{k: getattr(args, k) for k in ("model", "arrays", "shape", "repeats", "backends")}, "runs": runs}
    h.write_result("storage_traffic", args.out, result, markdown(result))


if __name__ == "__main__":
    main()
