"""Per-entry cost: save and load of many equal tensors (FSDP2-style DTensors, ``Shard(0)`` over the ranks) with
ZarrWriter/ZarrReader (saves planned by ZarrSavePlanner) against DCP's FileSystemWriter/Reader at its best thread
count, plus each store's file count.

    torchrun --standalone --nproc-per-node 2 benchmarks/entries.py                       # 800 x 1 MiB on /dev/shm
    torchrun --standalone --nproc-per-node 2 benchmarks/entries.py --count 5000 --entry-bytes 2048 --target /tmp/e
    torchrun --standalone --nproc-per-node 2 benchmarks/entries.py --quick                 # seconds (tests)

800 tensors of 1 MiB are the shape of a transformer's weights and Adam state; at more ranks each rank's piece of
every tensor shrinks, so the per-entry cost (not the bytes) decides the time. Every kind and thread count runs in
each round, in rotating order; medians of the slowest rank's times over ``--repeats`` rounds (one untimed round
first). FileSystemWriter is timed at 1, 2, 4 and 8 threads and its best median is the peer; dcp_zarr at
``--zarr-threads`` (its default unless given; the first one listed is the one compared). A null writer (stores
nothing) gives ``dcp.save``'s own cost for these entries, which every writer pays: ``save_over_null_s`` is what
each writer adds to it (the null writer is planned by DCP; ZarrSavePlanner skips most of that cost, so dcp_zarr's
figure can be below zero). ``--zarr-dcp`` adds ZarrWriter planned by DCP's default planner.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import Shard, distribute_tensor
from torch.futures import Future

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ckpt_dist import run_rank_program  # noqa: E402
from ckpt_measure import gather_floats, timed_region  # noqa: E402
from ckpt_runs import footprint  # noqa: E402

from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter  # noqa: E402


def build_state_dict(count: int, entry_bytes: int, mesh, owned: bool = False) -> dict[str, torch.Tensor]:
    """``count`` fp32 DTensors of about ``entry_bytes`` each (rows of 256 floats), sharded along dim 0; or, with
    ``owned``, plain 1-d tensors of ``entry_bytes`` each held by one rank (rank i % world size), distinct keys."""
    generator = torch.Generator().manual_seed(0)
    if owned:
        rank, world = mesh.get_local_rank(), mesh.size()
        return {f"small.{i:06d}": torch.rand(entry_bytes // 4, generator=generator)
                for i in range(count) if i % world == rank}
    rows = max(mesh.size(), entry_bytes // (256 * 4))
    return {f"layers.{i}.weight": distribute_tensor(torch.rand(rows, 256, generator=generator), mesh, [Shard(0)])
            for i in range(count)}


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class NullWriter(StorageWriter):
    """A StorageWriter that resolves every item, as a writer must, and stores nothing: what ``dcp.save`` itself costs
    for these entries (planning, collectives, pickling, garbage collection), which every writer pays."""

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner):
        results = []
        for item in plan.items:
            planner.resolve_data(item)
            results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata, results) -> None:
        pass

    def storage_meta(self):
        return None


class RawWriter(NullWriter):
    """Each rank ``pwrite``s every item's bytes into one file of its own, and nothing else (no checksum, no
    metadata, no fsync): the least any writer that stores the bytes once adds to ``dcp.save``'s own cost.
    Not loadable."""

    def __init__(self, path: str):
        self.path = path

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        os.makedirs(self.path, exist_ok=True)

    def write_data(self, plan, planner):
        results = []
        fd = os.open(os.path.join(self.path, f"rank{dist.get_rank()}"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            offset = 0
            for item in plan.items:
                data = _local(planner.resolve_data(item)).numpy().data.cast("B")
                os.pwrite(fd, data, offset)
                offset += len(data)
                results.append(WriteResult(index=item.index, size_in_bytes=len(data), storage_data=None))
        finally:
            os.close(fd)
        future: Future = Future()
        future.set_result(results)
        return future


# Writers that store nothing loadable: saved only.
SAVE_ONLY = ("null", "raw")


def save(kind: str, threads: int, state_dict, path: str) -> None:
    planner = None
    if kind in ("zarr", "zarr-dcp"):  # zarr: planned locally, as the README saves; zarr-dcp: DCP's own planning
        writer = ZarrWriter(path, thread_count=threads) if threads else ZarrWriter(path)
        planner = ZarrSavePlanner() if kind == "zarr" else None
    elif kind == "fs":
        writer = FileSystemWriter(path, thread_count=threads, sync_files=True)
    elif kind == "raw":
        writer = RawWriter(path)
    else:
        writer = NullWriter()
    dcp.save(state_dict, storage_writer=writer, planner=planner)


def load(kind: str, threads: int, state_dict, path: str) -> None:
    if kind not in ("zarr", "zarr-dcp"):
        reader = FileSystemReader(path)
    else:
        reader = ZarrReader(path, thread_count=threads) if threads else ZarrReader(path)
    dcp.load(state_dict, storage_reader=reader)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=800, help="tensors (default 800)")
    parser.add_argument("--entry-bytes", type=int, default=1 << 20, help="global bytes per tensor (default 1 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--zarr-threads", default=None,
                        help="ZarrWriter/ZarrReader thread counts, comma-separated (default: the writer's own "
                             "default); the ratios use the first")
    parser.add_argument("--fs-threads", default="1,2,4,8", help="FileSystemWriter thread counts (default 1,2,4,8)")
    parser.add_argument("--target", default=None,
                        help="directory for the checkpoints (default: a temp dir in /dev/shm)")
    parser.add_argument("--out", default=None, help="result JSON")
    parser.add_argument("--owned", action="store_true",
                        help="plain tensors, each held by one rank (the small-tensor case), not sharded DTensors")
    parser.add_argument("--keep-stores", action="store_true",
                        help="delete the stores at the end, not each one after its load: on ext4 without a journal "
                             "(this VM's disk) creating a file right after thousands were deleted scans the recently "
                             "deleted inodes (benchmarks/reports/performance.md), which taxes the writer that made "
                             "the most files")
    parser.add_argument("--zarr-dcp", action="store_true",
                        help="also time ZarrWriter planned by DCP's default planner (zarr-dcp), beside the local "
                             "planning of ZarrSavePlanner (zarr)")
    parser.add_argument("--raw", action="store_true",
                        help="also time a raw writer: one pwrite per item into a file per rank, nothing else")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() around every timed save and load (every writer alike)")
    parser.add_argument("--quick", action="store_true", help="60 x 64 KiB, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.count, args.entry_bytes, args.repeats = 60, 64 << 10, 1
    run_rank_program(lambda rt: run(args, rt), args.out, echo=True)
    return 0


def frozen(operation, freeze: bool):
    """``operation``, with ``gc.freeze()`` around it when asked: the objects alive before it are then left out of
    every garbage collection it triggers, as a training loop that manages the collector itself (torchtitan turns
    automatic collection off) would have them; ``gc.unfreeze()`` after."""
    if not freeze:
        return operation

    def run_frozen():
        gc.freeze()
        try:
            return operation()
        finally:
            gc.unfreeze()

    return run_frozen


def run(args, rt) -> dict:
    state_dict = build_state_dict(args.count, args.entry_bytes, rt.mesh, args.owned)
    base = args.target or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    root = os.path.join(base, "dcp-zarr-entries")
    fs_threads = [int(t) for t in args.fs_threads.split(",")]
    zarr_threads = [int(t) for t in args.zarr_threads.split(",")] if args.zarr_threads else [0]  # 0: the default
    peers = ([("zarr", t) for t in zarr_threads] + ([("zarr-dcp", zarr_threads[0])] if args.zarr_dcp else [])
             + [("null", 1)] + ([("raw", 1)] if args.raw else [])
             + [("fs", t) for t in fs_threads])
    times: dict[str, list[float]] = {f"{op}/{k}/{t}": [] for op in ("save", "load") for k, t in peers
                                     if op == "save" or k not in SAVE_ONLY}
    files: dict[str, dict] = {}
    if rt.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    for repeat in range(args.repeats + 1):  # round 0 warms up
        order = peers[repeat % len(peers):] + peers[:repeat % len(peers)]
        for kind, threads in order:
            path = os.path.join(root, f"{kind}-{threads}-{repeat}")
            elapsed, _ = timed_region(frozen(lambda: save(kind, threads, state_dict, path), args.gc_freeze),
                                      rt.device)
            if kind in SAVE_ONLY:
                if repeat:
                    times[f"save/{kind}/1"].append(elapsed.max_s)
                if rt.rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                dist.barrier()
                continue
            loaded = {k: torch.zeros_like(v) for k, v in state_dict.items()}
            load_time, _ = timed_region(frozen(lambda: load(kind, threads, loaded, path), args.gc_freeze),
                                        rt.device)
            if not all(torch.equal(_local(loaded[k]), _local(v)) for k, v in state_dict.items()):
                raise SystemExit(f"{kind}: the loaded state dict differs from the saved one")
            if repeat:
                times[f"save/{kind}/{threads}"].append(elapsed.max_s)
                times[f"load/{kind}/{threads}"].append(load_time.max_s)
            if rt.rank == 0:
                files.setdefault(kind, footprint(path))
                if not args.keep_stores:
                    shutil.rmtree(path)
            dist.barrier()
    medians = {name: statistics.median(values) for name, values in times.items()}
    best_fs = {op: min(medians[f"{op}/fs/{t}"] for t in fs_threads) for op in ("save", "load")}
    zarr = {op: medians[f"{op}/zarr/{zarr_threads[0]}"] for op in ("save", "load")}
    nbytes = sum(_local(v).numel() * v.element_size() for v in state_dict.values())
    nbytes = int(sum(gather_floats(nbytes)))
    if rt.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "zarr_threads": zarr_threads, "world_size": rt.world_size, "owned": args.owned, "count": args.count,
        "entry_bytes": args.entry_bytes,
        "bytes": nbytes,
        "target": base, "keep_stores": args.keep_stores, "gc_freeze": args.gc_freeze, "torch": torch.__version__,
        "repeats": args.repeats,
        "medians_s": medians,
        "samples_s": times, "files": files,
        "save_speedup_zarr_vs_best_fs": best_fs["save"] / zarr["save"],
        # time each writer adds to dcp.save's own cost (the null writer's), and their ratio
        "save_over_null_s": {"zarr": zarr["save"] - medians["save/null/1"],
                             "fs": best_fs["save"] - medians["save/null/1"]},
        "save_over_null_speedup_zarr_vs_best_fs": ((best_fs["save"] - medians["save/null/1"])
                                                   / max(zarr["save"] - medians["save/null/1"], 1e-9)),
        "load_speedup_zarr_vs_best_fs": best_fs["load"] / zarr["load"],
        **({"save_speedup_zarr_vs_zarr_dcp": medians[f"save/zarr-dcp/{zarr_threads[0]}"] / zarr["save"]}
           if args.zarr_dcp else {}),
        "zarr_save_GBps": nbytes / zarr["save"] / 1e9,
    }


if __name__ == "__main__":
    raise SystemExit(main())
