"""The per-entry cost: ``dcp.save`` and ``dcp.load`` of many equal tensors with every writer kind and thread count,
interleaved in one run (the kinds and commands: benchmarks/README.md).

The state: ``--count`` fp32 tensors of ``--entry-bytes`` (rows of 256 floats) or of ``--shape``, as FSDP2 holds them
(DTensors, ``Shard(0)`` over the ranks: 1025 rows on 2 ranks are uneven shards); ``--owned``: plain tensors, each
held by one rank; ``--workload``: one of ``WORKLOADS``. Loads are checked equal, and each store's files and
directories counted.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil

import torch
import torch.distributed as dist

from benchmarks import harness as h
from benchmarks import writers

WORKLOADS = {  # name: (count, shape)
    "mib": (800, (1024, 256)),  # 1 MiB each: a transformer's weights and Adam state, 800 tensors
    "uneven": (800, (1025, 255)),  # FSDP2's uneven shards
    "large": (16, (65536, 256)),  # 64 MiB each
    "small": (5000, (64,))}  # 64 floats each


def transfer(op: str, kind: str, threads: int, state, path: str, freeze: bool) -> None:
    """``writers.save`` or ``writers.load`` (raw-io: writers.py's raw I/O; thread count 0: the writer's default);
    ``freeze``: with ``gc.freeze()`` around it, so that the objects alive before it stay out of every collection it
    triggers, as in a training loop that manages the collector itself (torchtitan turns it off)."""
    if freeze:
        gc.freeze()
    try:
        getattr(writers, op)("raw" if kind == "raw-io" else kind, state, path, threads or None)
    finally:
        if freeze:
            gc.unfreeze()


def build_state(count: int, shape: tuple[int, ...], mesh, owned: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    if owned:
        rank, world = mesh.get_local_rank(), mesh.size()
        return {f"small.{i:06d}": torch.rand(math.prod(shape), generator=g) for i in range(count) if i % world == rank}
    # every rank makes the same tensors and cuts its own piece: no communication
    return {f"layers.{i}.weight": distribute_tensor(torch.rand(shape, generator=g), mesh, [Shard(0)],
                                                    src_data_rank=None) for i in range(count)}


def run(args, ranks: h.Ranks) -> tuple[dict, str]:
    count, shape = WORKLOADS[args.workload] if args.workload else (args.count, args.shape)
    state = build_state(count, shape, ranks.mesh, args.owned)
    root = os.path.join(args.target, "dcp-zarr-entries")
    zarr_threads = [int(t) for t in args.zarr_threads.split(",")]
    counts = {"fs": [int(t) for t in args.fs_threads.split(",")], "zarr": zarr_threads, "raw-io": [4]}
    peers = [(kind, threads) for kind in args.kinds  # other kinds: the first zarr thread count, or 1
             for threads in counts.get(kind, [zarr_threads[0] if kind.startswith("zarr") else 1])]
    samples, files = {}, {}  # "save/zarr/0" -> seconds of each repeat; kind -> its store's files and directories
    if ranks.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    for repeat in range(args.repeats + 1):  # round 0 warms up
        for kind, threads in h.rotated(peers, repeat):
            path = os.path.join(root, f"{peers.index((kind, threads))}-{repeat}")  # kinds hold ':' and '='
            times = {"save": h.timed(lambda: transfer("save", kind, threads, state, path, args.gc_freeze))[0]}
            target = {k: torch.zeros_like(v) for k, v in state.items()}
            times["load"] = h.timed(lambda: transfer("load", kind, threads, target, path, args.gc_freeze))[0]
            if not all(h.gather(h.equal(target, state))):
                raise SystemExit(f"{kind}: the loaded state dict differs from the saved one")
            for op, seconds in times.items() if repeat else ():
                samples.setdefault(f"{op}/{kind}/{threads}", []).append(seconds)
            if ranks.rank == 0:
                files.setdefault(kind, h.footprint(path))
                if not args.keep_stores:
                    shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
    if ranks.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = sum(h.gather(h.local_bytes(state)))
    result = {"workload": args.workload, "count": count, "shape": list(shape), "bytes": nbytes,
              "world_size": ranks.world_size, "zarr_threads": zarr_threads, **{k: getattr(args, k) for k in (
                  "owned", "target", "keep_stores", "gc_freeze", "repeats", "kinds")},
              "peers": peers, "medians_s": h.medians(samples), "samples_s": samples, "files": files}
    result.update(ratios(result["medians_s"], zarr_threads[0], nbytes))
    return result, markdown(result)


def ratios(medians: dict[str, float], threads: int, nbytes: int) -> dict:
    """time(peer) / time(zarr) for saves and loads: above 1, dcp_zarr is faster (FileSystemWriter at its best)."""
    found: dict = {}
    for op in ("save", "load"):
        fs = {name: s for name, s in medians.items() if name.startswith(f"{op}/fs/")}
        zarr = medians.get(f"{op}/zarr/{threads}")
        if fs:
            found[f"{op}_best_fs"] = min(fs, key=fs.__getitem__)
        if zarr is None:
            continue
        peers = {"best_fs": min(fs.values()) if fs else None, "zarr_dcp": medians.get(f"{op}/zarr-dcp/{threads}"),
                 "zarr_plain": medians.get(f"{op}/zarr-plain/{threads}"), "raw_io": medians.get(f"{op}/raw-io/4")}
        found.update({f"{op}_speedup_zarr_vs_{peer}": s / zarr for peer, s in peers.items() if s is not None})
        if op == "save":
            found["zarr_save_GBps"] = nbytes / zarr / h.GB
    return found


def markdown(r: dict) -> str:
    held = "each held by one rank" if r["owned"] else "Shard(0)"
    what = f"{r['count']} x {'x'.join(map(str, r['shape']))} fp32, {held}"
    rows = []
    for kind, threads in r["peers"]:
        save, load = (r["medians_s"].get(f"{op}/{kind}/{threads}") for op in ("save", "load"))
        files = r["files"].get(kind, {})
        rows.append([kind, threads, f"{save:.3f}", "" if load is None else f"{load:.3f}",
                     f"{files.get('files', '')} / {files.get('directories', '')}"])
    text = [f"{what}, {r['world_size']} ranks, {r['target']}, medians of {r['repeats']} (s)", "",
            h.table(["kind", "threads", "save", "load", "files / directories"], rows), ""]
    return "\n".join(text + [f"- {k}: {v:.3f}" for k, v in r.items() if "speedup" in k or k == "zarr_save_GBps"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), help="count and shape, one of WORKLOADS")
    p.add_argument("--count", type=int, default=800, help="tensors (default 800)")
    p.add_argument("--entry-bytes", type=int, default=1 << 20, help="bytes per tensor, rows of 256 floats (1 MiB)")
    p.add_argument("--shape", help="each tensor's shape instead, as 1025x255")
    p.add_argument("--owned", action="store_true", help="plain tensors, each held by one rank, not DTensors")
    p.add_argument("--kinds", default="zarr,zarr-plain,zarr-dcp,fs,raw-io", help="comma-separated (default: "
                   "all; benchmarks/README.md says what each is)")
    p.add_argument("--zarr-threads", default="0", help="ZarrWriter/Reader thread counts, first compared (0: default)")
    p.add_argument("--fs-threads", default="1,2,4,8", help="FileSystemWriter thread counts (default 1,2,4,8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target", default=h.SCRATCH, help="directory for the checkpoints (default: tmpfs)")
    p.add_argument("--keep-stores", action="store_true", help="delete the stores at the end, not each after its "
                   "load (why: benchmarks/README.md)")
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() around every timed save and load")
    p.add_argument("--quick", action="store_true", help="60 x 64 KiB, 1 repeat")
    p.add_argument("--out", help="result JSON (default benchmarks/results/entries.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.count, args.entry_bytes, args.repeats = 60, 64 << 10, 1
    args.shape = tuple(int(n) for n in args.shape.split("x")) if args.shape else (
        (args.entry_bytes // 4,) if args.owned else (max(16, args.entry_bytes // 1024), 256))
    args.kinds = [k for k in args.kinds.split(",") if k]
    h.on_ranks("entries", args.out, lambda ranks: run(args, ranks))


if __name__ == "__main__":
    main()
