"""Requests and bytes through storage per save and per load, and their times: dcp_zarr's collective I/O (aggregated
writes, reads done once) beside DCP's FsspecWriter/Reader and FileSystemWriter/Reader, in real gloo runs.

    python benchmarks/storage_traffic.py                                  # 2, 4 and 8 ranks, 0 and 20 ms
    python benchmarks/storage_traffic.py --world-sizes 4 --latency-ms 0 --repeats 1
    python benchmarks/storage_traffic.py --simulate 8,64,256,1024         # the counting simulation instead

The state: ``--arrays`` fp32 tensors of ``--shape`` (default 240 of 96 x 40: pieces of about 4 KB a rank at 4
ranks, as an 8B model's are at 1,024) in three layouts, each rank holding what its layout gives it: ``fsdp``
(DTensor ``Shard(0)`` over all ranks), ``hsdp`` (``(Replicate, Shard(0))`` on a (2, n/2) mesh) and ``ddp`` (plain
tensors, every rank all of them).

Against a loopback S3 server (moto, started here behind s3_latency.py's middleware, which sleeps ``--latency-ms``
before every request and counts requests by method and the bytes of PUT and GET bodies) each layout is saved and
loaded by dcp_zarr (``ZarrWriter`` with ``ZarrSavePlanner``, ``ZarrReader``, their defaults for object stores) and
by DCP's FsspecWriter/FsspecReader (4 threads), and with ``--off`` by dcp_zarr without collective I/O (``zarr-off``:
``aggregate_below=0``, ``read_once=False``, as before it), in rotating order, one untimed round first; times are
medians of the slowest rank's over ``--repeats``, counts those of the first timed round. Against a local directory
(``--local-dir``, default /dev/shm) dcp_zarr and FileSystemWriter/Reader (and ``zarr-off``), with requests counted
where each calls its files: dcp_zarr's ``LocalStorage`` calls, and the streams FileSystemWriter/Reader open (the
files opened, and the bytes written or read through them).

Output: ``--out`` (JSON, default benchmarks/results/storage_traffic.json) and a Markdown table beside it, stamped with
the commit and torch version. The simulation (``--simulate``, traffic_simulation.py) counts the same requests at up
to 1,024 ranks from the plans the library makes, without a process group.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

BUCKET = "traffic"
CREDENTIALS = {"key": "testing", "secret": "testing"}
LAYOUTS = ("fsdp", "hsdp", "ddp")


# --------------------------------------------------------------------------------------------------
# The state
# --------------------------------------------------------------------------------------------------


def full_tensors(arrays: int, shape: tuple[int, ...]) -> dict:
    import torch

    g = torch.Generator().manual_seed(11)
    return {f"layers.{i}.weight": torch.randn(shape, generator=g) for i in range(arrays)}


def layout_state(layout: str, world_size: int, full: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if layout == "ddp":
        return {k: v.clone() for k, v in full.items()}
    if layout == "fsdp":
        mesh, placements = init_device_mesh("cpu", (world_size,)), [Shard(0)]
    else:
        mesh, placements = init_device_mesh("cpu", (2, max(world_size // 2, 1))), [Replicate(), Shard(0)]
    return {k: distribute_tensor(v, mesh, placements) for k, v in full.items()}


# --------------------------------------------------------------------------------------------------
# Counting a local directory's calls (the object store's are counted by the server)
# --------------------------------------------------------------------------------------------------


class LocalCalls:
    """Counts, in this process, the files each kind opens to write or read a checkpoint (a local file system's
    requests: each open is a metadata operation, the cost a parallel file system feels most) and the bytes it
    writes or reads through them, while installed."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()

    def add(self, what: str, nbytes: int, opened: int = 1) -> None:
        with self.lock:
            self.counts[what] += opened
            self.counts[f"{what}_bytes"] += nbytes

    def install(self) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystem

        from dcp_zarr.storage.local import LocalStorage, OpenFile

        calls = self

        def wrap(cls, name, what, size, opened):
            original = getattr(cls, name)

            def counted(*args, **kwargs):
                result = original(*args, **kwargs)
                calls.add(what, size(args, result), opened)
                return result

            setattr(cls, name, counted)

        written = lambda args, _: sum(memoryview(b).nbytes for b in args[-1])  # noqa: E731
        wrap(LocalStorage, "write", "writes", written, 1)  # one open (and rename) per file
        wrap(LocalStorage, "write_at", "writes", written, 1)  # one open per run of a shared shard file
        wrap(LocalStorage, "read", "reads", lambda args, result: len(result), 1)
        wrap(LocalStorage, "read_range", "reads", lambda args, result: len(result), 1)
        wrap(LocalStorage, "open_value", "reads", lambda args, result: 0, 1)  # then reads through the handle:
        wrap(OpenFile, "read_range_into", "reads", lambda args, result: result, 0)
        wrap(OpenFile, "read_tail", "reads", lambda args, result: len(result), 0)
        original_stream = FileSystem.create_stream

        def counted_stream(self, path, mode):
            return _CountedStream(original_stream(self, path, mode), calls, "writes" if "w" in mode else "reads")

        FileSystem.create_stream = counted_stream

    def take(self) -> dict:
        with self.lock:
            counts, self.counts = dict(self.counts), Counter()
        return counts


class _CountedStream:
    """FileSystemWriter/Reader's stream context: one open, and the bytes written or read through it."""

    def __init__(self, context, calls: LocalCalls, what: str):
        self.context, self.calls, self.what = context, calls, what

    def __enter__(self):
        stream = self.context.__enter__()
        calls, what = self.calls, self.what
        calls.add(what, 0, 1)

        class Counted:
            def __getattr__(self, name):
                return getattr(stream, name)

            def write(self, data):
                calls.add(what, memoryview(data).nbytes, 0)
                return stream.write(data)

            def read(self, n=-1):
                data = stream.read(n)
                calls.add(what, len(data), 0)
                return data

            def readinto(self, buffer):
                n = stream.readinto(buffer)
                calls.add(what, n or 0, 0)
                return n

        return Counted()

    def __exit__(self, *exc):
        return self.context.__exit__(*exc)


# --------------------------------------------------------------------------------------------------
# One rank's program, under torchrun
# --------------------------------------------------------------------------------------------------


def measure(args, rt) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckpt_measure import timed_region
    from s3_latency import control
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter

    options = {"endpoint_url": args.endpoint, **CREDENTIALS}
    shape = tuple(int(n) for n in args.shape.split("x"))
    full = full_tensors(args.arrays, shape)
    calls = LocalCalls()
    calls.install()
    rows: list[dict] = []

    def save(kind: str, where: str, state) -> None:
        if kind in ("zarr", "zarr-off"):
            writer = ZarrWriter(where, storage_options=None if where.startswith("/") else options,
                                **({"aggregate_below": 0} if kind == "zarr-off" else {}))
            dcp.save(state, storage_writer=writer, planner=ZarrSavePlanner())
        elif kind == "fsspec":
            dcp.save(state, storage_writer=FsspecWriter(where, thread_count=4, sync_files=False, **options))
        else:
            dcp.save(state, storage_writer=FileSystemWriter(where, thread_count=4, sync_files=False))

    def load(kind: str, where: str, target) -> None:
        if kind in ("zarr", "zarr-off"):
            reader = ZarrReader(where, storage_options=None if where.startswith("/") else options,
                                read_once=None if kind == "zarr" else False)  # zarr: the storage's default
        elif kind == "fsspec":
            reader = FsspecReader(where, **options)
        else:
            reader = FileSystemReader(where)
        dcp.load(target, storage_reader=reader)

    def counted(fn, object_store: bool) -> tuple[float, dict]:
        if object_store and rt.rank == 0:
            control(args.endpoint, "reset")
        calls.take()
        dist.barrier()
        elapsed, _ = timed_region(fn, rt.device)
        local = calls.take()
        every: list = [None] * rt.world_size
        dist.all_gather_object(every, local)
        if object_store:
            report = control(args.endpoint, "counts") if rt.rank == 0 else {}
            return elapsed.max_s, {"requests": report.get("methods", {}), "bytes_in": report.get("bytes_in"),
                                   "bytes_out": report.get("bytes_out")}
        total: Counter = Counter()
        for c in every:
            total.update(c)
        return elapsed.max_s, {"requests": {"writes": total["writes"], "reads": total["reads"]},
                               "bytes_in": total["writes_bytes"], "bytes_out": total["reads_bytes"]}

    targets = [("s3", float(lat)) for lat in args.latency_ms.split(",")] + ([("local", 0.0)] if args.local else [])
    for layout in LAYOUTS:
        if layout == "hsdp" and rt.world_size % 2:
            continue
        state = layout_state(layout, rt.world_size, full)
        for storage, latency in targets:
            kinds = (("zarr", "fsspec") if storage == "s3" else ("zarr", "fs")) + (("zarr-off",) if args.off else ())
            if storage == "s3" and rt.rank == 0:
                control(args.endpoint, f"latency?ms={latency}")
            times: dict[tuple[str, str], list[float]] = {}
            counts: dict[tuple[str, str], dict] = {}
            for repeat in range(args.repeats + 1):
                turn = repeat % len(kinds)
                for kind in kinds[turn:] + kinds[:turn]:
                    name = f"{layout}-{kind}-{latency:g}-{repeat}"
                    where = (f"s3://{BUCKET}/{name}" if storage == "s3" else os.path.join(args.local, name))
                    save_s, save_counts = counted(lambda: save(kind, where, state), storage == "s3")
                    target = {k: torch.zeros_like(v) for k, v in state.items()}
                    load_s, load_counts = counted(lambda: load(kind, where, target), storage == "s3")
                    if not all(torch.equal(_plain(target[k]), _plain(v)) for k, v in state.items()):
                        raise SystemExit(f"{kind} {layout}: the loaded state differs from the saved one")
                    if storage == "local" and rt.rank == 0:
                        save_counts["files"] = sum(len(f) for _, _, f in os.walk(where))
                    if repeat:
                        times.setdefault((kind, "save"), []).append(save_s)
                        times.setdefault((kind, "load"), []).append(load_s)
                        counts.setdefault((kind, "save"), save_counts)
                        counts.setdefault((kind, "load"), load_counts)
                    dist.barrier()
                    if rt.rank == 0:
                        _remove(where, options)
                    dist.barrier()
            for (kind, op), samples in times.items():
                rows.append({"world_size": rt.world_size, "layout": layout, "storage": storage, "latency_ms": latency,
                             "kind": kind, "op": op, "median_s": statistics.median(samples), "samples_s": samples,
                             **counts[(kind, op)]})
    nbytes = args.arrays * _prod(shape) * 4
    return {"world_size": rt.world_size, "tensor_bytes": nbytes, "arrays": args.arrays, "shape": list(shape),
            "rows": rows}


def _plain(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _remove(where: str, options: dict) -> None:
    if where.startswith("s3://"):
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, key=options["key"],
                               secret=options["secret"], endpoint_url=options["endpoint_url"])
        fs.rm(where, recursive=True)
    else:
        shutil.rmtree(where, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# The launcher and the report
# --------------------------------------------------------------------------------------------------


def serve_and_launch(args) -> list[dict]:
    from s3_latency import LatencyAndCounts

    from tests.support.s3 import S3Server

    server = S3Server()
    server._server._server.app = LatencyAndCounts(server._server._server.app)
    server.make_bucket(BUCKET)
    results = []
    try:
        for ws in [int(w) for w in args.world_sizes.split(",")]:
            out = tempfile.mktemp(suffix=f"-ws{ws}.json")
            command = ["torchrun", "--standalone", f"--nproc-per-node={ws}", os.path.abspath(__file__),
                       "--rank-program", "--endpoint", server.endpoint, "--latency-ms", args.latency_ms,
                       "--repeats", str(args.repeats), "--arrays", str(args.arrays), "--shape", args.shape,
                       "--local-dir", args.local or "", "--out", out] + (["--off"] if args.off else [])
            if subprocess.call(command) != 0:
                raise SystemExit(f"the ranks of world size {ws} failed")
            with open(out) as f:
                results.append(json.load(f))
            os.remove(out)
    finally:
        server.stop()
    return results


def stamp() -> dict:
    import torch

    def git(*a):
        return subprocess.run(["git", *a], cwd=os.path.join(HERE, ".."), capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "torch": torch.__version__, "date": datetime.date.today().isoformat()}


def markdown(report: dict) -> str:
    s = report["stamp"]
    lines = [f"At {s['commit']}{' (dirty tree)' if s['dirty'] else ''}, torch {s['torch']}, {s['date']}: "
             f"{report['arrays']} fp32 arrays of {report['shape']}, gloo ranks on this machine's 2 cores. Requests "
             "per save are PUTs (object store) or files opened to write (local), per load GETs or files opened to "
             "read; `read x`: bytes read per load over the tensors' bytes; times: medians of the slowest rank's.", "",
             "| ranks | layout | storage | kind | requests per save | requests per load | read x | save s | load s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in report["runs"]:
        by = {(r["layout"], r["storage"], r["latency_ms"], r["kind"], r["op"]): r for r in run["rows"]}
        for (layout, storage, latency, kind, op), row in by.items():
            if op != "save":
                continue
            loaded = by[(layout, storage, latency, kind, "load")]
            put = row["requests"].get("PUT", row["requests"].get("writes", 0))
            get = loaded["requests"].get("GET", loaded["requests"].get("reads", 0))
            where = f"S3, {latency:g} ms" if storage == "s3" else "local"
            read_x = (loaded["bytes_out"] or 0) / run["tensor_bytes"]
            lines.append(f"| {run['world_size']} | {layout} | {where} | {kind} | {put:,} | {get:,} | {read_x:.2f} | "
                         f"{row['median_s']:.3f} | {loaded['median_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4,8")
    parser.add_argument("--latency-ms", default="0,20")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arrays", type=int, default=240)
    parser.add_argument("--shape", default="96x40")
    parser.add_argument("--local-dir", dest="local",
                        default=os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                                             "dcp-zarr-traffic"),
                        help="a local directory to measure too ('' for none)")
    parser.add_argument("--off", action="store_true",
                        help="also dcp_zarr without collective I/O (aggregate_below=0, read_once=False: as before it)")
    parser.add_argument("--simulate", default=None, help="world sizes to simulate instead (traffic_simulation.py)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "storage_traffic.json"))
    parser.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_program:
        from ckpt_dist import run_rank_program

        run_rank_program(lambda rt: measure(args, rt), args.out)
        return 0
    if args.simulate:
        from traffic_simulation import simulate_report

        report = simulate_report([int(w) for w in args.simulate.split(",")], args.arrays,
                                 tuple(int(n) for n in args.shape.split("x")))
        text = report.pop("markdown")
    else:
        if args.local:
            os.makedirs(args.local, exist_ok=True)
        runs = serve_and_launch(args)
        report = {"stamp": stamp(), "arrays": args.arrays, "shape": args.shape, "runs": runs}
        text = markdown(report)
        if args.local:
            shutil.rmtree(args.local, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
