"""Bytes that torch's collectives carry per rank, per save and per load, counted in real gloo ranks on the CPU by
dcp_zarr.testing.wire's counter (its self-check runs first in every launch; commands: benchmarks/README.md).

The state: an FSDP2 stack of ``nn.Linear(8, 8)`` layers with AdamW state, 8 tensors a layer (240 and 960 by default:
the protocol is counted, not the data). Kinds, each in fresh rank processes (DCP's plan cache is class-level state),
saving ``--saves`` times in a row (``save_first``: the process's first ``dcp.save``; ``save_later``: the last):
``zarr_local`` (ZarrWriter + ZarrSavePlanner; then loads with ``ZarrReader(read_once=True)``, as on object stores, and
DCP's default load planner, ``load_zarr``, or ZarrLoadPlanner, ``load_zarr_zlp``), ``zarr_default`` (DCP's planner),
``fs_default`` (FileSystemWriter, then ``load_fs``), ``zarr_cached`` (``DefaultSavePlanner(enable_plan_caching=True)``).
Reported: the coordinator's (rank 0) and a rank's (the largest of ranks 1..) bytes and calls, the ratio 960/240 of
each and, where a locally planned operation grows more than 1.2x, the object collectives that grew; the checkpoint
bytes collective I/O moves over the process group are counted apart (``payload_bytes``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness as h
from dcp_zarr.testing.wire import WireCounter, self_check, what_grows

TENSORS_PER_LAYER = 8  # weight, bias; step, exp_avg, exp_avg_sq of each
SAVE_KINDS = ("zarr_local", "zarr_default", "fs_default", "zarr_cached")
LOADS_AFTER = {"zarr_local": ("load_zarr", "load_zarr_zlp"), "fs_default": ("load_fs",)}
LOCALLY_PLANNED = ("zarr_local", "load_zarr", "load_zarr_zlp")  # the operations meant not to grow
TITLES = {"zarr_local": "ZarrWriter + ZarrSavePlanner", "zarr_default": "ZarrWriter + DefaultSavePlanner",
          "fs_default": "FileSystemWriter", "zarr_cached": "ZarrWriter + DefaultSavePlanner(enable_plan_caching=True)",
          "load_zarr": "ZarrReader", "load_zarr_zlp": "ZarrReader + ZarrLoadPlanner", "load_fs": "FileSystemReader"}


def build_state(mesh, tensors: int) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` of an FSDP2 stack holding ``tensors`` tensors (a multiple of 8)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    if tensors % TENSORS_PER_LAYER:
        raise ValueError(f"--tensors: {tensors} is not a multiple of {TENSORS_PER_LAYER}")
    torch.manual_seed(0)
    model = torch.nn.Module()  # a stack: its state dict's names are layers.N.weight and layers.N.bias
    model.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(tensors // TENSORS_PER_LAYER))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step's state without a forward pass (FSDP's collectives are not counted)
        p.grad = torch.full_like(p, 0.01)
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    if len(h.leaves(state)) != tensors:
        raise AssertionError(f"the state holds {len(h.leaves(state))} tensors, not {tensors}")
    return state


def measure_rank(ranks: h.Ranks, kinds: list[str], tensors: int, root: str, saves: int) -> dict[str, Any]:
    """One rank's counts of each kind's first and last save (``saves`` in a row) and of the loads after it. Only the
    first kind's first save is the process's first ``dcp.save``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_zarr import ZarrLoadPlanner, ZarrReader, ZarrSavePlanner, ZarrWriter

    quiet = {"thread_count": 1, "sync_files": False}  # the bytes are counted, not the time
    writers = {"fs_default": lambda p: (FileSystemWriter(p, **quiet), None),
               "zarr_local": lambda p: (ZarrWriter(p, **quiet), ZarrSavePlanner()),
               "zarr_default": lambda p: (ZarrWriter(p, **quiet), None),
               "zarr_cached": lambda p: (ZarrWriter(p, **quiet), DefaultSavePlanner(enable_plan_caching=True))}
    readers = {"load_fs": lambda p: (FileSystemReader(p), None), "load_zarr": lambda p: (ZarrReader(
        p, read_once=True), None), "load_zarr_zlp": lambda p: (ZarrReader(p, read_once=True), ZarrLoadPlanner())}
    counter = WireCounter().install()
    try:
        result: dict[str, Any] = {"rank": ranks.rank, "self_check": self_check(counter, ranks.rank, ranks.world_size),
                                  "ops": {}}
        state = build_state(ranks.mesh, tensors)
        for kind in kinds:
            paths = [os.path.join(root, f"{kind}-{tensors}-{i}") for i in range(saves)]
            for i, path in enumerate(paths):
                writer, planner = writers[kind](path)
                dist.barrier()
                with counter.measure() as counts:
                    dcp.save(state, storage_writer=writer, planner=planner)
                if i in (0, saves - 1):
                    result["ops"][f"{kind}/{'save_first' if i == 0 else 'save_later'}"] = counts
            for load in LOADS_AFTER.get(kind, ()):
                reader, planner = readers[load](paths[0])
                dist.barrier()
                with counter.measure() as counts:
                    dcp.load(state, storage_reader=reader, planner=planner)
                result["ops"][f"{load}/load"] = counts
        dist.barrier()
        return result
    finally:
        counter.uninstall()


def summarize(per_rank: list[dict], op: str) -> dict[str, Any]:
    """The coordinator's (rank 0) and a rank's (the largest of ranks 1..) counts of ``op``."""
    counts = [r["ops"][op] for r in per_rank]
    other = max(counts[1:], key=lambda c: (c["bytes"], c["calls"])) if len(counts) > 1 else counts[0]
    return {"coordinator_bytes": counts[0]["bytes"], "coordinator_calls": counts[0]["calls"],
            "rank_bytes": other["bytes"], "rank_calls": other["calls"], "bytes_per_rank": [c["bytes"] for c in counts],
            "payload_bytes_per_rank": [c["payload_bytes"] for c in counts],
            "by_collective_coordinator": counts[0]["by_collective"], "by_collective_rank": other["by_collective"],
            "object_calls_coordinator": counts[0]["object_calls"], "object_calls_rank": other["object_calls"],
            "functional_calls": sum(v[0] for c in counts for v in c["functional"].values())}


def ratios(launches: dict[tuple[int, int, str], list[dict]], small: int, large: int) -> list[dict]:
    found = []
    for (ws, n, kind), per_rank in launches.items():
        grown = launches.get((ws, large, kind))
        if n != small or grown is None:
            continue
        for op in per_rank[0]["ops"]:
            a, b = summarize(per_rank, op), summarize(grown, op)
            rank = max(range(1, ws), key=lambda r: grown[r]["ops"][op]["bytes"], default=0)
            peers = [r["ops"][op] for r in grown]
            found.append({"world_size": ws, "op": op, "rank_ratio": b["rank_bytes"] / max(a["rank_bytes"], 1),
                          "coordinator_ratio": b["coordinator_bytes"] / max(a["coordinator_bytes"], 1),
                          "grows_on_coordinator": what_grows(per_rank[0]["ops"][op], peers[0], peers),
                          "grows_on_rank": what_grows(per_rank[rank]["ops"][op], peers[rank], peers)})
    return found


def markdown(report: dict) -> str:
    small, large = report["config"]["tensors"]
    rows = {(r["world_size"], r["tensors"], r["op"]): r for r in report["rows"]}
    lines = []
    for x in report["ratios"]:
        a, b = rows[(x["world_size"], small, x["op"])], rows[(x["world_size"], large, x["op"])]
        cells = {who: [f"{r[who + '_bytes'] / 1000:,.1f} KB ({r[who + '_calls']})" for r in (a, b)] + [
            f"{x[who + '_ratio']:.2f}"] for who in ("rank", "coordinator")}
        lines.append([x["world_size"], TITLES[x["op"].split("/")[0]], x["op"].split("/")[1], *cells["rank"],
                      *cells["coordinator"]])
    text = ("Bytes through torch's collectives per save / load (gloo, CPU). `rank`: the largest of ranks 1..ws-1; "
            "`coord`: rank 0. Calls in brackets: tensor collectives.\n\n" + h.table(
                ["ws", "kind", "op", f"rank {small}", f"rank {large}", "rank x", f"coord {small}", f"coord {large}",
                 "coord x"], lines))
    notes = [f"- ws {x['world_size']} {x['op']}, {where}: {line}" for x in report["ratios"]
             if x["op"].split("/")[0] in LOCALLY_PLANNED and max(x["rank_ratio"], x["coordinator_ratio"]) > 1.2
             for where in ("coordinator", "rank") for line in x[f"grows_on_{where}"]]
    return text + (f"\n\nWhat grows from {small} to {large} tensors in the locally planned operations:\n"
                   + "\n".join(notes) if notes else "")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="2,4,8")
    p.add_argument("--tensors", default="240,960", help="tensors per state dict (multiples of 8), two values")
    p.add_argument("--kinds", default=",".join(SAVE_KINDS), help=f"of {', '.join(SAVE_KINDS)}")
    p.add_argument("--saves", type=int, default=3, help="saves in a row per kind: the first and the last count")
    p.add_argument("--target", default=h.SCRATCH, help="where the checkpoints go (a temporary folder in it)")
    p.add_argument("--out", help="result JSON (default benchmarks/results/wire_bytes.json)")
    args = p.parse_args(argv)
    sizes, kinds = [int(n) for n in args.tensors.split(",")], [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(SAVE_KINDS) or len(sizes) != 2 or args.saves < 2:
        p.error(f"--kinds takes {', '.join(SAVE_KINDS)}; --tensors two values; --saves 2 or more")
    launches, started = {}, time.monotonic()
    with tempfile.TemporaryDirectory(prefix="wire_bytes_", dir=args.target) as root:
        for ws, n, kind in itertools.product([int(w) for w in args.world_sizes.split(",")], sizes, kinds):
            t0 = time.monotonic()
            launches[(ws, n, kind)] = h.spawn(measure_rank, ws, [kind], n, root, args.saves)
            print(f"ws {ws}, {n} tensors, {kind}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    report = {"config": {"world_sizes": args.world_sizes, "tensors": sizes, "kinds": kinds, "saves": args.saves,
                         "elapsed_s": round(time.monotonic() - started, 1)},
              "self_checks": [{"world_size": ws, "tensors": n, "kind": kind, "ok": all(
                  r["self_check"]["ok"] for r in per_rank)} for (ws, n, kind), per_rank in launches.items()],
              "rows": [{"world_size": ws, "tensors": n, "op": op, **summarize(per_rank, op)}
                       for (ws, n, kind), per_rank in launches.items() for op in per_rank[0]["ops"]],
              "ratios": ratios(launches, *sizes)}
    h.write_result("wire_bytes", args.out, report, markdown(report))


if __name__ == "__main__":
    main()
