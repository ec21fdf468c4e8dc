"""Where aggregated writes and chunk-at-a-time reads pay on a local file system: saves and loads of FSDP2-style
DTensors (``Shard(0)``) with the pieces of every size from 4 KiB to 1 MiB, with and without collective I/O.

    torchrun --standalone --nproc-per-node 4 benchmarks/aggregation_sweep.py                # /dev/shm, 32 MiB a size
    torchrun --standalone --nproc-per-node 4 benchmarks/aggregation_sweep.py --target /tmp/s --total-mib 64

For each piece size, ``total / (piece x ranks)`` arrays of 256 fp32 columns (at least 8) are saved with
``ZarrWriter(aggregate_below=0)`` (each rank writes its pieces, into one shard file per array) and with every array
aggregated (``aggregate_below`` above any piece), and loaded with ``ZarrReader(read_once_below=0)`` and with every
array read a stored chunk at a time; in turn, ``--repeats`` times after one untimed round, medians of the slowest
rank's times. This is what chose the local file systems' default (storage/local.py): never aggregate there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ALWAYS = 1 << 40


def run(args, rt) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckpt_measure import timed_region
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter

    rows = []
    for piece in [int(p) << 10 for p in args.pieces_kib.split(",")]:
        count = max(8, (args.total_mib << 20) // (piece * rt.world_size))
        rows_per_array = piece * rt.world_size // (256 * 4)
        g = torch.Generator().manual_seed(0)
        state = {f"t{i}": distribute_tensor(torch.rand(rows_per_array, 256, generator=g), rt.mesh, [Shard(0)])
                 for i in range(count)}
        times: dict[str, list[float]] = {}
        for repeat in range(args.repeats + 1):
            for below in ((0, ALWAYS) if repeat % 2 == 0 else (ALWAYS, 0)):
                name = "aggregated" if below else "each rank"
                path = os.path.join(args.target, f"sweep-{below}-{repeat}")
                if rt.rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                dist.barrier()
                saved, _ = timed_region(lambda: dcp.save(state, storage_writer=ZarrWriter(path, aggregate_below=below),
                                                         planner=ZarrSavePlanner()), rt.device)
                target = {k: torch.zeros_like(v) for k, v in state.items()}
                loaded, _ = timed_region(lambda: dcp.load(target, storage_reader=ZarrReader(
                    path, read_once_below=below)), rt.device)
                if not all(torch.equal(target[k].to_local(), v.to_local()) for k, v in state.items()):
                    raise SystemExit("the loaded state differs from the saved one")
                if repeat:
                    times.setdefault(f"save/{name}", []).append(saved.max_s)
                    times.setdefault(f"load/{name}", []).append(loaded.max_s)
                dist.barrier()
                if rt.rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
        medians = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"piece_bytes": piece, "arrays": count, "medians_s": medians, "samples_s": times,
                     "save_speedup_aggregated": medians["save/each rank"] / medians["save/aggregated"],
                     "load_speedup_read_once": medians["load/each rank"] / medians["load/aggregated"]})
        if rt.rank == 0:
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "samples_s"}), flush=True)
    return {"world_size": rt.world_size, "target": args.target, "torch": torch.__version__, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    parser.add_argument("--pieces-kib", default="4,16,64,256,1024")
    parser.add_argument("--total-mib", type=int, default=32, help="bytes of the state dict per piece size")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from ckpt_dist import run_rank_program

    run_rank_program(lambda rt: run(args, rt), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
