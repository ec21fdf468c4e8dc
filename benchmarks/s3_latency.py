"""Save and load through a loopback S3 server with added per-request latency: ZarrWriter/ZarrReader against DCP's
FsspecWriter/FsspecReader, with the requests each one makes counted by method.

    python benchmarks/s3_latency.py --latency-ms 0,20 --repeats 3          # 2 ranks, the 2 GB FSDP2 model
    python benchmarks/s3_latency.py --layers 2 --hidden 512 --vocab 8000  # a 170 MB model (moto is the limit)
    python benchmarks/s3_latency.py --quick                                 # a 16 MB model, seconds (tests)
    python benchmarks/s3_latency.py --backends s3fs,obstore --latency-ms 0  # dcp_zarr through s3fs and obstore
    NODE_PATH=DIR/node_modules python benchmarks/s3_latency.py --server s3rver ...  # npm install --prefix DIR s3rver

This process runs the S3 server (moto, from the test extras) behind a middleware that sleeps ``--latency-ms`` before
every request and counts requests; the sleeps of concurrent requests overlap, so it models a distant server, not a
slow one. ``--server s3rver`` runs s3rver instead (Node, objects in files under a temporary directory on /dev/shm,
``s3rver_server.js``, the same front): a server that spends less CPU per request than moto, still on the ranks'
own cores. The ranks (``torchrun``, launched from here) set the latency and read the counts through the middleware's
``/__bench__/`` path, which also reports the server's CPU time per operation (``server_cpu_medians_s``): moto serves
in Python under one GIL, so a figure near an operation's wall time means the server, not the client, set its pace.
Each round saves and loads with every kind, in rotating order; one untimed round first; medians of the slowest
rank's times.

Kinds: ``fsspec`` (DCP's FsspecWriter/Reader) and one dcp_zarr kind per ``--backends`` entry: ``zarr`` (a URL, so
zarr's FsspecStore over s3fs) and ``zarr-obstore`` (``store=zarr.storage.ObjectStore(obstore S3Store)``, built on
each rank), writing the same state dict from the same ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

BUCKET = "bench"
# moto takes any key; s3rver knows one account (its models/account.js)
SERVER_CREDENTIALS = {"moto": {"key": "testing", "secret": "testing"}, "s3rver": {"key": "S3RVER", "secret": "S3RVER"}}
ZARR_KINDS = {"s3fs": "zarr", "obstore": "zarr-obstore"}  # --backends -> kind


class LatencyAndCounts:
    """WSGI middleware: sleeps before each request and counts requests by method, the bytes of PUT bodies received
    (``bytes_in``) and of GET bodies sent (``bytes_out``); ``/__bench__/`` controls it."""

    def __init__(self, app):
        self.app = app
        self.latency_s = 0.0
        self.counts: Counter = Counter()
        self.bytes_in = self.bytes_out = 0
        self.lock = threading.Lock()
        self.cpu_at_reset = time.process_time()

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path.startswith("/__bench__/"):
            return self._control(path, environ.get("QUERY_STRING", ""), start_response)
        method = environ.get("REQUEST_METHOD", "?")
        with self.lock:
            self.counts[method] += 1
            if method == "PUT":
                self.bytes_in += int(environ.get("CONTENT_LENGTH") or 0)
        if self.latency_s:
            time.sleep(self.latency_s)
        body = self.app(environ, start_response)
        return self._counted(body) if method == "GET" else body

    def _counted(self, body):
        for piece in body:
            with self.lock:
                self.bytes_out += len(piece)
            yield piece
        close = getattr(body, "close", None)
        if close is not None:
            close()

    def _control(self, path: str, query: str, start_response):
        if path == "/__bench__/latency":
            self.latency_s = float(query.removeprefix("ms=")) / 1000
        with self.lock:
            # the server's CPU since the last reset (this process does nothing else; see the module docstring)
            body = json.dumps({"methods": dict(self.counts), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                               "server_cpu_s": time.process_time() - self.cpu_at_reset}).encode()
            if path == "/__bench__/reset":
                self.counts.clear()
                self.bytes_in = self.bytes_out = 0
                self.cpu_at_reset = time.process_time()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]


def control(endpoint: str, what: str) -> dict:
    with urllib.request.urlopen(f"{endpoint}/__bench__/{what}", timeout=30) as response:
        return json.loads(response.read())


class S3rverProcess:
    """s3rver_server.js in a Node process of its own, serving BUCKET from a temporary directory."""

    def __init__(self):
        self.directory = tempfile.mkdtemp(prefix="s3rver-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.process = subprocess.Popen(["node", os.path.join(HERE, "s3rver_server.js"), self.directory, BUCKET],
                                        stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline() if self.process.stdout else ""
        if not line.startswith("listening "):
            self.stop()
            raise SystemExit("s3rver did not start (is NODE_PATH naming a node_modules that holds s3rver?)")
        self.endpoint = f"http://127.0.0.1:{int(line.split()[1])}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        shutil.rmtree(self.directory, ignore_errors=True)


def serve_and_launch(args) -> int:
    if args.server == "s3rver":
        server = S3rverProcess()
    else:
        from tests.support.s3 import S3Server

        server = S3Server()
        server._server._server.app = LatencyAndCounts(server._server._server.app)  # outermost: every request
        server.make_bucket(BUCKET)
    out = args.out or os.path.join(tempfile.gettempdir(), "s3_latency.json")
    command = ["torchrun", "--standalone", f"--nproc-per-node={args.nproc}", os.path.abspath(__file__),
               "--rank-program", "--server", args.server, "--endpoint", server.endpoint,
               "--latency-ms", args.latency_ms, "--repeats", str(args.repeats),
               "--layers", str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
               "--zarr-threads", str(args.zarr_threads), "--fsspec-threads", str(args.fsspec_threads),
               "--backends", args.backends, "--out", out] + (["--quick"] if args.quick else [])
    try:
        code = subprocess.call(command)
    finally:
        server.stop()
    if code == 0:
        with open(out) as f:
            print(f.read())
    return code


def rank_program(args) -> int:
    from ckpt_dist import run_rank_program

    run_rank_program(lambda rt: measure(args, rt), args.out)
    return 0


def measure(args, rt) -> dict:
    """Every round of saves and loads on this rank; the result (complete on rank 0, which counts the requests)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckpt_measure import timed_region
    from ckpt_model import ModelConfig, build_sharded_state_dict, global_bytes, locally_equal, zeroed_copy
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from dcp_zarr import ZarrReader, ZarrSavePlanner, ZarrWriter
    options = {"endpoint_url": args.endpoint, **SERVER_CREDENTIALS[args.server]}
    cfg = ModelConfig(4, 128, 2048, "float32") if args.quick else ModelConfig(args.layers, args.hidden, args.vocab,
                                                                              "float32")
    repeats = 1 if args.quick else args.repeats
    state_dict = build_sharded_state_dict(cfg, rt.mesh, rt.device)
    latencies = [float(x) for x in args.latency_ms.split(",")]
    times: dict[str, list[float]] = {}
    requests: dict[str, dict] = {}
    server_cpu: dict[str, list[float]] = {}

    kinds = tuple(ZARR_KINDS[b] for b in args.backends.split(",")) + ("fsspec",)

    def save(kind: str, url: str) -> None:
        if kind == "zarr-obstore":
            writer = ZarrWriter(store=_obstore(url, options), thread_count=args.zarr_threads)
        elif kind == "zarr":
            writer = ZarrWriter(url, storage_options=options, thread_count=args.zarr_threads)
        else:
            writer = FsspecWriter(url, thread_count=args.fsspec_threads, sync_files=False, **options)
        planner = ZarrSavePlanner() if isinstance(writer, ZarrWriter) else None  # planned locally, as README saves
        dcp.save(state_dict, storage_writer=writer, planner=planner)

    def load(kind: str, url: str, target) -> None:
        if kind == "zarr-obstore":
            reader = ZarrReader(store=_obstore(url, options), thread_count=args.zarr_threads)
        elif kind == "zarr":
            reader = ZarrReader(url, storage_options=options, thread_count=args.zarr_threads)
        else:
            reader = FsspecReader(url, **options)
        dcp.load(target, storage_reader=reader)

    def counted(name: str, fn, timed: bool) -> float:
        if rt.rank == 0:
            control(args.endpoint, "reset")
        elapsed, _ = timed_region(fn, rt.device)
        if rt.rank == 0:
            report = control(args.endpoint, "counts")
            requests.setdefault(name, report["methods"])
            if timed:
                server_cpu.setdefault(name, []).append(report["server_cpu_s"])
        return elapsed.max_s

    for latency in latencies:
        if rt.rank == 0:
            control(args.endpoint, f"latency?ms={latency}")
        dist.barrier()
        for repeat in range(repeats + 1):  # round 0 warms up
            turn = repeat % len(kinds)
            for kind in kinds[turn:] + kinds[:turn]:
                url = f"s3://{BUCKET}/{kind}-{latency:g}ms-{repeat}"
                name = f"{kind}/{latency:g}ms"
                save_s = counted(f"save/{name}", lambda: save(kind, url), timed=repeat > 0)
                target = zeroed_copy(state_dict)
                load_s = counted(f"load/{name}", lambda: load(kind, url, target), timed=repeat > 0)
                if not locally_equal(target, state_dict):
                    raise SystemExit(f"{kind}: the loaded state dict differs from the saved one")
                if repeat:
                    times.setdefault(f"save/{name}", []).append(save_s)
                    times.setdefault(f"load/{name}", []).append(load_s)
                if rt.rank == 0:
                    _remove(url, options)
                dist.barrier()
    medians = {name: statistics.median(v) for name, v in times.items()}
    ratios = {f"{op}_speedup_{kind}_vs_fsspec/{lat:g}ms":
              medians[f"{op}/fsspec/{lat:g}ms"] / medians[f"{op}/{kind}/{lat:g}ms"]
              for op in ("save", "load") for lat in latencies for kind in kinds if kind != "fsspec"}
    return {"server": args.server, "world_size": rt.world_size, "bytes": global_bytes(state_dict),
            "torch": torch.__version__, "repeats": repeats, "zarr_threads": args.zarr_threads,
            "fsspec_threads": args.fsspec_threads,
            "medians_s": medians, "samples_s": times, "requests": requests,
            "server_cpu_medians_s": {name: statistics.median(v) for name, v in server_cpu.items()}, **ratios}


def _obstore(url: str, options: dict):
    """zarr's ObjectStore over obstore's S3 client for ``url``'s prefix (each rank builds its own)."""
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    return ObjectStore(S3Store(BUCKET, prefix=url.removeprefix(f"s3://{BUCKET}/"), endpoint=options["endpoint_url"],
                               region="us-east-1", access_key_id=options["key"],
                               secret_access_key=options["secret"], client_options={"allow_http": True}))


def _remove(url: str, options: dict) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, key=options["key"],
                           secret=options["secret"], endpoint_url=options["endpoint_url"])
    fs.rm(url, recursive=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", default="0,20", help="comma-separated added latencies (default 0,20)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8: the 2 GB model)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--zarr-threads", type=int, default=4)
    parser.add_argument("--fsspec-threads", type=int, default=4)
    parser.add_argument("--backends", default="s3fs",
                        help="comma-separated dcp_zarr clients: s3fs (a URL, zarr's FsspecStore), obstore (store=)")
    parser.add_argument("--server", choices=sorted(SERVER_CREDENTIALS), default="moto",
                        help="the S3 server: moto (default, from the test extras) or s3rver (Node; see above)")
    parser.add_argument("--out", default=None, help="result JSON")
    parser.add_argument("--quick", action="store_true", help="a 16 MB model, 1 repeat")
    parser.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.backends.split(",")) - set(ZARR_KINDS)
    if unknown:
        parser.error(f"--backends: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ZARR_KINDS)}")
    return rank_program(args) if args.rank_program else serve_and_launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
