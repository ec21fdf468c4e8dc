"""Per-file cost of a file system: what a checkpoint of many small tensors pays per tensor.

A zarr store holds one array per tensor: a directory, its zarr.json, a ``c`` directory and a chunk file. DCP's
FileSystemWriter appends every tensor to one file per rank and thread. On a file system where creating a file or a
directory is expensive, that difference, not the writer's code, decides the small-tensor save time.

    python benchmarks/file_ops.py --target /tmp/bench --count 2500
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

PAYLOAD = os.urandom(2048)  # a small tensor's chunk, about 512 float32
METADATA = os.urandom(900)  # about the size of an array's zarr.json


def write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def zarr_array(root: str, i: int) -> None:
    """What ZarrWriter does for one small tensor."""
    node = os.path.join(root, f"small.{i:06d}")
    os.mkdir(node)
    write_file(os.path.join(node, "zarr.json"), METADATA)
    os.mkdir(os.path.join(node, "c"))
    write_file(os.path.join(node, "c", "0"), PAYLOAD)


OPERATIONS: dict[str, Callable[[str, int], None]] = {
    "mkdir": lambda root, i: os.mkdir(os.path.join(root, f"d{i}")),
    "create + write 2 KiB": lambda root, i: write_file(os.path.join(root, f"f{i}"), PAYLOAD),
    "one zarr array (2 mkdir, 2 files)": zarr_array,
}


def time_operation(target: str, operation: Callable[[str, int], None], count: int) -> float:
    """Seconds per operation, the file system synced before and after (the sync is timed: it is part of a save)."""
    root = tempfile.mkdtemp(prefix="file-ops-", dir=target)
    try:
        os.sync()
        start = time.perf_counter()
        for i in range(count):
            operation(root, i)
        os.sync()
        return (time.perf_counter() - start) / count
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=tempfile.gettempdir(), help="a directory on the file system to measure")
    parser.add_argument("--count", type=int, default=2500, help="operations per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per operation; the median is shown")
    args = parser.parse_args()
    os.makedirs(args.target, exist_ok=True)
    print(f"{args.target}: {args.count} operations per run, median of {args.repeats} runs")
    for name, operation in OPERATIONS.items():
        runs = [time_operation(args.target, operation, args.count) for _ in range(args.repeats)]
        print(f"  {name:36s} {statistics.median(runs) * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
