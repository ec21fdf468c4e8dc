"""How long zarr tools take to open a checkpoint of many arrays: ``zarr.open_group(p, mode="r")`` with zarr-python's
defaults, the same plus reading one array by its path, and ``xr.open_datatree(p, engine="zarr")``, on a local
directory and through the loopback S3 server.

The checkpoint is saved once per target by this process (``dcp.save`` with ``ZarrWriter``, ``--arrays`` fp32
tensors of 64 x 16 under ``model/``); each way of opening is timed in a fresh process of ``--python`` (default: this
interpreter; any Python with zarr, and xarray for the datatree, works: one that never saw dcp_zarr too), ``--repeats``
times after one untimed open, and the median reported. Run it at two commits to compare formats: the store is
whatever the dcp_zarr on ``sys.path`` writes.

    python -m benchmarks.reader_open --arrays 1000 --repeats 5
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

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.harness import table, write_result

# Run in the reader's own process: nothing of this repository is imported there, so a Python without dcp_zarr works.
_READER = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")  # xarray's note that it fell back from consolidated metadata: timed, not printed
import zarr
how, path, options, repeats = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
kwargs = {"storage_options": options} if options else {}
def once():
    if how == "open_group":
        zarr.open_group(path, mode="r", **kwargs)
    elif how == "open_group+read":
        zarr.open_group(path, mode="r", **kwargs)["model/layers.0.w"][...]
    else:
        import xarray as xr
        xr.open_datatree(path, engine="zarr", **kwargs)
once()
times = []
for _ in range(repeats):
    start = time.perf_counter(); once(); times.append(time.perf_counter() - start)
print(json.dumps(times))
"""

HOWS = ("open_group", "open_group+read", "open_datatree")


def save_checkpoint(path: str, arrays: int, storage_options: dict | None) -> None:
    from dcp_zarr import ZarrWriter

    state = {"model": {f"layers.{i}.w": torch.randn(64, 16) for i in range(arrays)}}
    dcp.save(state, storage_writer=ZarrWriter(path, storage_options=storage_options), no_dist=True)


def time_opening(python: str, how: str, path: str, storage_options: dict | None, repeats: int) -> float:
    done = subprocess.run([python, "-c", _READER, how, path, json.dumps(storage_options or {}), str(repeats)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{how} of {path} with {python} failed:\n{done.stderr[-3000:]}")
    return statistics.median(json.loads(done.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arrays", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that opens the stores")
    parser.add_argument("--target", default=tempfile.gettempdir(), help="the local directory (default: disk)")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()

    rows, result = [], {"arrays": args.arrays, "repeats": args.repeats, "python": args.python, "seconds": {}}
    local = os.path.join(tempfile.mkdtemp(dir=args.target), "open.zarr")
    targets: list[tuple[str, str, dict | None]] = [("local disk", local, None)]
    server = None
    if not args.no_s3:
        from dcp_zarr.testing.s3_server import S3Server

        server = S3Server()
        targets.append(("loopback S3", f"s3://{server.make_bucket('bench')}/open.zarr", server.storage_options()))
    try:
        for name, path, options in targets:
            save_checkpoint(path, args.arrays, options)
            for how in HOWS:
                seconds = time_opening(args.python, how, path, options, args.repeats)
                result["seconds"][f"{name}: {how}"] = seconds
                rows.append([name, how, f"{seconds * 1000:.1f}"])
    finally:
        shutil.rmtree(os.path.dirname(local), ignore_errors=True)
        if server is not None:
            server.stop()
    write_result("reader_open", args.out, result, table(["target", "opened with", "median ms"], rows))


if __name__ == "__main__":
    main()
